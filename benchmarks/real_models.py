"""Models of a real size on one GPU, under budgets smaller than their weights.

Three workloads, each from random weights (nothing is downloaded):

- ``llama``: a Llama of 7B shapes in bfloat16 (hidden 4096, 32 layers, intermediate 11008,
  32 heads, vocabulary 32000: 12.6 GiB of weights), greedy ``generate()`` of a few tokens at
  batch 1 and batch 8, under Flow at budgets of 8 GiB and 4 GiB, and under Genoa at 8 GiB
  while the run has time for it;
- ``lora``: a LoRA fine-tuning step of that Llama (peft, ``r=8`` on ``q_proj`` and
  ``v_proj``, AdamW on the adapters) under Flow at 8 GiB;
- ``denoiser``: a diffusers ``UNet2DConditionModel`` of Stable Diffusion 1.5's shapes (860M
  parameters, bfloat16) taking a few DDIM steps at batch 2 on 64x64 latents, under Flow at
  half its weights.

Each budget is on top of what the device holds outside the manager then
(``tensorsManager.outside_bytes()``: cuBLAS's workspaces), as the manager's budget covers
them. Beside each managed row:

- plain torch with the model resident on the device, the reference every row is compared
  with and timed against;
- plain torch on the machine's CPU, for a cut-down count of tokens or steps (a GPU only:
  on ``"sim"`` the accelerator is the CPU already);
- for the Llama's decoding, accelerate's big-model inference at the same budget: the device
  map ``infer_auto_device_map`` makes with ``max_memory={gpu: budget, "cpu": ...}`` (what
  ``from_pretrained(device_map="auto", max_memory=...)`` does), dispatched by
  ``dispatch_model``, whose hooks copy the offloaded layers' weights in before each forward;
- for the denoiser, diffusers' own ``enable_group_offload`` (block level, one block per
  group, copies on a side stream), whose peak is reported beside the managed row's budget.

Each row reports its time per call (per new token and per step too), its ratio to plain
torch, its ratio to its bound ``max(plain time, bytes moved / pinned host-to-device
bandwidth)`` (the bandwidth measured at the start of the run), the real peak against the
budget (``torch.cuda.max_memory_allocated`` on CUDA; on ``"sim"`` the manager's
``peak_device_bytes`` plus the outside bytes), and whether its outputs (tokens, losses,
latents) are those of plain torch bit for bit, or their largest difference. Rows the budget
does not bind (plain, CPU) have no bound or budget of their own.

    python benchmarks/real_models.py [--json out.json]                       # a CUDA GPU
    python benchmarks/real_models.py --size small --device sim [--json out.json]

``--size small`` runs the same rows at tiny shapes (a 4-layer Llama of hidden 256, a small
UNet) with the budgets at the same share of the weights as at full size (8 GiB and 4 GiB
are 64% and 32% of the 7B's weights), so that the whole run checks the harness, the bytes
and the outputs on ``"sim"`` in seconds. On ``"sim"`` plain torch runs on the simulated
device (``torchTensorRef.disabled(device="sim")``: the same kernels as the managed rows);
times are meaningless there (the accelerator is host memory) but bytes and outputs are
real. accelerate's hooks and diffusers' group offloading rebuild or swap parameters in
ways the simulated device's tensors refuse, so on ``"sim"`` those two rows run with the CPU
as their device: their code runs and their bytes are counted, their times and peaks say
nothing.

A run on a GPU is costly to repeat, so the script is defensive: every row runs on its own,
and one that fails prints its error and the others still run; a row is stopped at a cap of
its own (``--row-cap``, ``--cpu-cap``), rows are skipped once the run passes
``--deadline``, Genoa's once it passes ``--genoa-by``; a call slower than ``--slow-call``
ends its row's timed calls; the JSON (``--json``) is written again after every row. The
rows run in the order of what they are for: for each model plain torch on the device (the
reference) and the managed rows; then the offloading libraries' rows of each model; then
plain torch on the CPU; then Genoa's. On an H200 the Llama's own rows (its build, plain
torch, Flow's decoding and LoRA step) took about 90 s and accelerate's four rows 71 s
(`docs/benchmarks/gpu-check-2026-11-30.md`); the default run stops starting rows at six
minutes (``--deadline``).
peft and diffusers are optional: their rows say so when they are missing. Exit status 1
when a row failed or a managed row's outputs differ from plain torch's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import math
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from torchTensorRef.sizes import format_size  # noqa: E402

GiB = 2**30
SCRIPT = "benchmarks/real_models.py"

#: Stable Diffusion 1.5's UNet (860M parameters)
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280),
                 down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                 up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                 cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32)

#: A budget is bytes (an int) or a share of the model's weight bytes (a float).
SIZES = {
    "full": dict(
        llama=dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
        llama_dtype="bfloat16", budgets=(8 * GiB, 4 * GiB), genoa_budgets=(8 * GiB,), lora_budget=8 * GiB,
        prompt=32, tokens=8, batches=(1, 8), cpu_tokens=2,
        lora_batch=2, lora_seq=128,
        unet=SD15_UNET, unet_dtype="bfloat16", unet_batch=2, text_len=77, denoise_steps=4, unet_budget=0.5,
        bandwidth_bytes=GiB,
        # calls: warm-up then timed. Flow follows a plan from its third call of a generate() (the
        # first two: learning it), then tries two ways of prefetching for it over ten periods
        # (tokens): a managed row of calls that change nothing (decoding, denoising) warms up by
        # ``settle`` calls more while it has not settled (one was too few for the 7B at 8 GiB,
        # timed unsettled on an H200); plain torch warms up its kernels; the offloading
        # baselines learn nothing
        warmup=2, settle=3, timed=2, plain_warmup=1, baseline_warmup=0, cpu_timed=1,
        row_cap=100.0, cpu_cap=40.0, slow_call=40.0, deadline=360.0, genoa_by=300.0),
    "small": dict(
        # (proportions of the 7B's: accelerate's map puts a layer or two on the device at 64%)
        llama=dict(layers=4, hidden=256, intermediate=688, heads=8, kv_heads=8, vocab=1024),
        llama_dtype="bfloat16", budgets=(0.64, 0.32), genoa_budgets=(0.64,), lora_budget=0.64,
        prompt=16, tokens=4, batches=(1, 8), cpu_tokens=2,
        lora_batch=1, lora_seq=32,
        # float32: bfloat16 convolutions are slow on CPUs without native support
        unet=dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                  cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8),
        unet_dtype="float32", unet_batch=2, text_len=7, denoise_steps=2, unet_budget=0.5,
        bandwidth_bytes=64 * 2**20,
        # (plain "sim" has no kernels to warm up)
        warmup=2, settle=2, timed=1, plain_warmup=0, baseline_warmup=0, cpu_timed=1,
        row_cap=60.0, cpu_cap=30.0, slow_call=30.0, deadline=300.0, genoa_by=250.0),
}
SECTIONS = ("llama", "lora", "denoiser")
NEEDS_CUDA = ("real_models needs CUDA: torch.cuda.is_available() is False (torch {torch}). Run it on a machine "
              "with an NVIDIA GPU, or check the harness with `python benchmarks/real_models.py --size small "
              "--device sim`.")
CPU_ON_SIM = "on 'sim' the accelerator is the host's CPU already"
#: a LoRA step's work in forwards of its tokens: the forward, and a backward through frozen
#: weights (gradients of the activations only), with room for the CPU's slower backward kernels
CPU_STEP_FORWARDS = 3.0
SIM_CPU_NOTE = ("on 'sim' it runs with the CPU as its device (the simulated device's tensors refuse how it "
                "rebuilds parameters): its code and bytes, not its time or peak")


class RowTimeout(Exception):
    """A row ran past its cap."""


@contextlib.contextmanager
def time_cap(seconds: Optional[float]):
    """Raise ``RowTimeout`` in the block once ``seconds`` have passed (main thread only).

    The signal's handler runs between Python bytecodes, so a model call, which is many ops,
    stops within one op of the cap."""
    usable = seconds and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def expired(signum, frame):
        raise RowTimeout(f"stopped at the row's cap of {seconds:.3g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def optional(module: str) -> Optional[str]:
    """Why the rows that need ``module`` cannot run, or ``None`` when it is installed."""
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    return None


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two plain tensors hold the same bits (NaNs compare equal to themselves)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def max_difference(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    """The largest absolute difference (``inf`` where one side is not finite and the other is)."""
    if a.shape != b.shape:
        return None
    diff = (a.double() - b.double()).abs()
    both_nan = a.isnan() & b.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), diff).nan_to_num(nan=math.inf)
    return float(diff.max()) if diff.numel() else 0.0


def budget_bytes(spec, weight_bytes: int) -> int:
    """Bytes of a budget given as bytes or as a share of the weights."""
    return int(spec * weight_bytes) if isinstance(spec, float) else int(spec)


def budget_label(spec, weight_bytes: int) -> str:
    nbytes = budget_bytes(spec, weight_bytes)
    return f"{format_size(nbytes)} ({nbytes / weight_bytes:.0%} of weights)"


# -- the device and the run -----------------------------------------------------------------------

class Run:
    """The device, the clock, the rows and where they are written."""

    def __init__(self, args, size: dict, command: str):
        self.args = args
        self.size = size
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        #: where plain torch runs the managed rows' kernels
        self.plain_device = torch.device(args.device) if self.cuda else torch.device("sim")
        self.start = time.perf_counter()
        self.rows: List[dict] = []
        self.result = {"sizes": args.size, "size": size, "rows": self.rows, "models": {}}
        self.command = command
        self.bandwidth: dict = {}
        #: the offloading libraries' rows, run after every section's own: slower than the
        #: managed rows, they would otherwise leave a later section's unmeasured at the deadline
        self.baselines: List[Callable[[], None]] = []
        #: rows of plain torch on the CPU, run after the sections' other rows: the slowest, and
        #: among the first to leave out when the run is short of time
        self.cpu_rows: List[Callable[[], None]] = []
        #: rows run last, when there is time left: Genoa's
        self.later: List[Callable[[], None]] = []

    # clock and memory
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.plain_device)
        else:
            tm.synchronize()

    def timed(self, fn: Callable[[], object]):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start

    def plain(self, made_on_device: bool = False):
        """Plain torch inside: creations are plain tensors, on "sim" on the device where not
        told. With ``made_on_device``, on CUDA too: the reference of a row whose own code makes
        tensors without a device (a scheduler's tables), which the manager makes on the
        accelerator (docs/concepts.md, "Tensors made without a device")."""
        return torchTensorRef.disabled(device=self.plain_device if made_on_device or not self.cuda else None)

    def free(self) -> None:
        gc.collect()
        tm.stats()  # (releases the blocks of dead TensorRefs)
        if self.cuda:
            torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        tm.reset_stats()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.plain_device)

    def peak(self, managed: bool, outside: int = 0) -> Optional[int]:
        """The most the device held since ``reset_peak``: torch.cuda's on CUDA; on "sim" the
        manager's peak plus the outside bytes for a managed row, and the simulated
        allocator's peak for plain torch on it."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.plain_device)
        stats = tm.stats()
        return stats["peak_device_bytes"] + outside if managed else stats.get("max_memory_allocated")

    def measure_bandwidth(self, nbytes: int, repeats: int = 5) -> dict:
        """Best pinned copy rates (bytes/s); on "sim" a host memcpy's."""
        return common.copy_rates(self.plain_device if self.cuda else None, self.timed, nbytes, repeats)

    # rows
    def row(self, body: Optional[Callable[[dict], None]], *, cap: Optional[float] = None,
            skip: Optional[str] = None, error: Optional[str] = None, **meta) -> dict:
        """Run one row: ``body(row)`` fills in its figures. A failure, a skip or the cap is
        written in the row and the run goes on. With ``error``, a row that records one.

        A row of plain torch on the CPU that reaches its cap is "stopped", not failed: that
        the CPU takes longer is its figure."""
        row = dict(meta)
        self.rows.append(row)
        if skip is None and error is None and self.elapsed() > self.size["deadline"]:
            skip = f"the run passed its deadline ({self.size['deadline']:.0f} s)"
        if error is not None:
            row["error"] = error
        elif skip is not None:
            row["skipped"] = skip
        else:  # (the rows before freed what they made)
            started = time.perf_counter()
            try:
                with time_cap(cap if cap is not None else self.size["row_cap"]):
                    body(row)
            except RowTimeout as e:
                row["stopped" if row.get("config") == "cpu" else "error"] = f"{type(e).__name__}: {e}"
            except Exception as e:  # one row failing must not lose the others' figures
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
            finally:
                row["wall_seconds"] = time.perf_counter() - started
                tm.budget = None
                self.free()
            evaluate(self, row)
        print(row_line(row), flush=True)
        self.save()
        return row

    def save(self) -> None:
        if self.args.json:
            self.result["elapsed_seconds"] = self.elapsed()
            self.result["bandwidth"] = self.bandwidth
            common.write_result(self.args.json, SCRIPT, self.args.argv, self.device, public(self.result))

    def find(self, group: str, config: str) -> Optional[dict]:
        for r in self.rows:
            if r.get("group") == group and r.get("config") == config:
                return r
        return None


def public(value):
    """``value`` without the keys that start with "_" (outputs kept for comparisons)."""
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [public(v) for v in value]
    return value


def measure(run: Run, row: dict, call: Callable[[], object], warmup: int, timed: int, *,
            moved: Callable[[bool], int], managed: bool = False, outside: int = 0, units: int = 1,
            collect: Optional[Callable[[object], None]] = None, settle: bool = False):
    """Warm up (with ``settle``, a managed row's calls that change nothing, by up to
    ``size["settle"]`` calls more while the strategy has not settled; training steps are
    compared with plain torch's step by step, and run as many), then time ``timed`` calls
    (fewer when one is slower than ``--slow-call``):
    the median call, the bytes moved per call, the peak over all of them. The figures are
    written into ``row`` as they come, so that a row stopped at its cap keeps what it had.
    ``collect`` receives each call's output (losses of successive training steps)."""
    run.reset_peak()
    out = None
    row["warmup_seconds"] = []
    for i in range(warmup + (run.size["settle"] if settle else 0)):
        if i >= warmup and tm.strategy.settled:
            break
        out, seconds = run.timed(call)
        row["warmup_seconds"].append(seconds)
        if collect:
            collect(out)
    if managed:
        row["settled"] = tm.strategy.settled
    peak = run.peak(managed, outside)
    moved(True)
    if managed:
        tm.reset_stats()
    row["call_seconds"] = []
    for _ in range(timed):
        out, seconds = run.timed(call)
        if collect:
            collect(out)
        row["call_seconds"].append(seconds)
        row["seconds"] = statistics.median(row["call_seconds"])
        row["units"] = units
        row["moved"] = moved(False) // len(row["call_seconds"])
        if seconds > run.size["slow_call"]:
            row["note"] = f"timed {len(row['call_seconds'])} call(s): one took over {run.size['slow_call']:.0f} s"
            break
    later = run.peak(managed, outside)
    row["peak"] = None if peak is None and later is None else max(p for p in (peak, later) if p is not None)
    if managed:
        stats = tm.stats()
        calls = len(row["call_seconds"])
        row["counters"] = {k: stats[k] // calls for k in ("fetches", "prefetches", "copies_to_device", "evictions",
                                                           "writebacks", "host_syncs")}
        row["bytes_to_device"] = stats["bytes_to_device"] // calls
        row["bytes_to_host"] = stats["bytes_to_host"] // calls
        row["overshoot"] = stats["worst_overshoot_bytes"]
        if not run.cuda:
            row["allocator_peak"] = stats.get("max_memory_allocated")
    return out


def manager_moved(reset: bool) -> int:
    if reset:
        tm.reset_stats()
        return 0
    s = tm.stats()
    return s["bytes_to_device"] + s["bytes_to_host"]


def nothing_moved(reset: bool) -> int:
    return 0


@contextlib.contextmanager
def managed_under(strategy: str, budget_spec, weight_bytes: int, row: dict):
    """The manager under ``strategy`` at a budget of ``budget_spec`` on top of the outside bytes."""
    tm.budget = None
    tm.strategy = strategy  # (a new instance: nothing learned in an earlier row)
    tm.evict_all()
    tm.synchronize()
    outside = tm.outside_bytes()
    row["outside_bytes"] = outside
    row["budget"] = outside + budget_bytes(budget_spec, weight_bytes)
    tm.budget = row["budget"]
    try:
        yield outside
    finally:
        tm.budget = None


# -- comparisons ----------------------------------------------------------------------------------

def evaluate(run: Run, row: dict) -> None:
    """Ratios to plain torch and to the bound, peak / budget, outputs against plain's."""
    if "seconds" not in row:
        return
    row["seconds_per_unit"] = row["seconds"] / row["units"]
    plain = run.find(row["group"], "plain")
    if row["config"] == "cpu" or not run.cuda and row.get("strategy") in ("accelerate device_map",
                                                                         "group offload"):
        row["peak"] = None  # (it ran on the CPU, SIM_CPU_NOTE: no device memory to speak of)
    if row.get("budget"):
        row["peak_to_budget"] = common.ratio(row.get("peak"), row["budget"])
        temporary = (plain or {}).get("kernel_temporary")
        if temporary and row.get("peak") is not None:  # (the promise: the budget plus one kernel's temporaries)
            row["peak_to_budget_and_temporary"] = row["peak"] / (row["budget"] + temporary["bytes"])
    if plain is None or "seconds" not in plain:
        return
    if row["config"] == "cpu" and plain.get("cut_seconds"):  # (the same cut-down call on the device)
        row["to_plain"] = row["seconds"] / plain["cut_seconds"]
    else:
        row["to_plain"] = row["seconds_per_unit"] / plain["seconds_per_unit"]
    if row["config"] != "cpu":
        transfer = row["moved"] / run.bandwidth["h2d"] / row["units"]
        row["bound_per_unit"] = max(plain["seconds_per_unit"], transfer)
        row["transfer_per_unit"] = transfer
        row["to_bound"] = row["seconds_per_unit"] / row["bound_per_unit"]
    if row is plain:
        return
    expected = plain.get("_cpu_reference") if row["config"] == "cpu" else plain.get(row.get("_reference", "_output"))
    got = row.get("_output")
    if expected is None or got is None:
        return
    if isinstance(got, torch.Tensor):
        row["equal"] = equal_bits(got, expected)
        if not row["equal"]:
            if got.is_floating_point():
                row["max_difference"] = max_difference(got, expected)
            else:
                row["differing"] = int((got != expected).sum()) if got.shape == expected.shape else None
    else:  # losses
        row["equal"] = got == expected
        if not row["equal"]:
            row["max_difference"] = max((abs(a - b) for a, b in zip(got, expected)), default=None)


# -- models ---------------------------------------------------------------------------------------

def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_llama(spec: dict, dtype: torch.dtype, positions: int, where) -> torch.nn.Module:
    """A plain Llama with seeded random weights, built straight on ``where`` in ``dtype``
    (a 7B model never exists in float32, nor on the host before it is needed there)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    common.quiet_transformers()
    config = LlamaConfig(num_hidden_layers=spec["layers"], hidden_size=spec["hidden"],
                         intermediate_size=spec["intermediate"], vocab_size=spec["vocab"],
                         num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                         max_position_embeddings=positions, **common.SPECIAL)
    with torchTensorRef.disabled(), torch.device(where), default_dtype(dtype):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


def build_unet(config: dict, dtype: torch.dtype, where) -> torch.nn.Module:
    """A plain diffusers UNet with seeded random weights, built on ``where``."""
    import diffusers

    with torchTensorRef.disabled(), torch.device(where):
        torch.manual_seed(0)
        return diffusers.UNet2DConditionModel(**config).to(dtype).eval()


def to_host(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` moved to host memory, in place (its device memory freed)."""
    with torchTensorRef.disabled():
        return model.to("cpu")


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with LoRA adapters (peft, r=8 on q_proj and v_proj), their weights set from
    a seeded host generator: where peft draws them (the host, or a device's generator for a
    managed model) must not change them. Both factors are nonzero, so that the first
    forward already goes through the adapters."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in sorted(peft_model.named_parameters()):
            if not p.requires_grad:
                continue
            with torchTensorRef.disabled():
                fan_in = p.shape[1]
                value = (torch.rand(tuple(p.shape), generator=g, device="cpu") * 2 - 1) / math.sqrt(fan_in)
            p.copy_(value.to(p.dtype))
    return peft_model


# -- workloads --------------------------------------------------------------------------------------

def decode(model, ids, tokens: int) -> torch.Tensor:
    return common.generate(model, ids, tokens)


def lora_step(model, ids) -> Callable[[], float]:
    """One AdamW step of the adapters on ``ids`` (labels = ids) per call; returns the loss."""
    model.train()
    # the list (foreach) kernels on every device: the CPU's per-parameter loop rounds differently
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()

    return step


def denoise(unet, latents, text, steps: int):
    """``steps`` DDIM steps of ``unet`` from ``latents``; the final latents."""
    import diffusers

    scheduler = diffusers.DDIMScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in scheduler.timesteps:
            eps = unet(latents, t, encoder_hidden_states=text).sample
            latents = scheduler.step(eps, t, latents).prev_sample
    return latents


# -- sections -------------------------------------------------------------------------------------

def llama_sections(run: Run, sections) -> None:
    """The Llama's decoding rows (``"llama"`` in ``sections``) and its LoRA step (``"lora"``),
    in an order that holds one copy of the weights on the device at a time, the rows the run
    is for first: plain torch resident there; Flow's; and, after the other sections' own,
    accelerate's (``Run.baselines``), plain torch on the CPU (``Run.cpu_rows``) and Genoa's
    (``Run.later``)."""
    size = run.size
    dtype = dtype_of(size["llama_dtype"])
    spec = size["llama"]
    positions = max(size["prompt"] + size["tokens"], size["lora_seq"]) + 8
    lora_skip = optional("peft") if "lora" in sections else "not asked for"
    decoding = "llama" in sections
    if not decoding and lora_skip:  # (no row to build the model for)
        run.row(None, skip=lora_skip, group="llama lora step", config="all", unit="step")
        return
    #: the section's models, dropped once their rows are done
    held = {"master": build_llama(spec, dtype, positions, run.plain_device if run.cuda else "cpu")}
    wbytes = common.param_bytes(held["master"])
    run.result["models"]["llama"] = {"parameters": sum(p.numel() for p in held["master"].parameters()),
                                     "weight_bytes": wbytes, "dtype": size["llama_dtype"], **spec}
    print(f"Llama: {common.parameters_text(run.result['models']['llama']['parameters'])} parameters, "
          f"{format_size(wbytes)} of weights ({size['llama_dtype']})", flush=True)
    vocab = spec["vocab"]
    ids = {b: common.plain_inputs(2 + b, vocab, b, size["prompt"]) for b in size["batches"]}
    lora_ids = common.plain_inputs(1, vocab, size["lora_batch"], size["lora_seq"])
    decode_groups = {b: f"llama decode b{b}" for b in size["batches"]}
    lora_meta = dict(group="llama lora step", batch=size["lora_batch"], seq=size["lora_seq"], unit="step")
    tokens, cpu_tokens = size["tokens"], size["cpu_tokens"]

    # 1. plain torch, resident on the device: the reference of every row
    def plain_decode(row, b):
        with run.plain():
            dev_ids = ids[b].to(run.plain_device)
            out = measure(run, row, lambda: decode(held["plain"], dev_ids, tokens), size["plain_warmup"],
                          size["timed"], moved=nothing_moved, units=tokens)
            if run.cuda:  # the CPU's cut-down call, timed here too: its ratio compares like with like
                row["cut_seconds"] = run.timed(lambda: decode(held["plain"], dev_ids, cpu_tokens))[1]
        row["_output"] = common.as_plain(out)
        if run.cuda:  # (greedy: the CPU's cut-down call gives the first tokens of these)
            row["_cpu_reference"] = row["_output"][:, :size["prompt"] + cpu_tokens]

    def plain_lora(row):
        # (as many steps as the managed row: the losses of every step are compared)
        losses = []
        with run.plain():
            peft_model = with_lora(copy.deepcopy(held["plain"]))
            measure(run, row, lora_step(peft_model, lora_ids.to(run.plain_device)), size["warmup"],
                    size["timed"], moved=nothing_moved, collect=losses.append)
        row["_output"] = row["losses"] = losses
        row["_cpu_reference"] = losses[:1]

    with run.plain():
        held["plain"] = held["master"] if run.cuda else common.plain_copy(held["master"]).to(run.plain_device)
    if decoding:
        for b in size["batches"]:
            run.row(lambda row, b=b: plain_decode(row, b), group=decode_groups[b], config="plain",
                    device=run.device, batch=b, unit="token")
    run.row(plain_lora, skip=lora_skip, config="plain", device=run.device, **lora_meta)
    del held["plain"]
    if run.cuda:
        held["master"] = to_host(held["master"])
    run.free()
    # the host copy the offloading baselines and the CPU start from; the manager takes the other
    held["host"] = copy_plain(held["master"])

    # 2. managed: the model under the manager, at each budget (Genoa's rows at the end of the run)
    held["managed"] = torchTensorRef.manage(held.pop("master"))
    managed_ids = {b: torchTensorRef.manage(ids[b].clone()) for b in size["batches"]}

    def managed_decode(row, b, strategy, spec_budget):
        with managed_under(strategy, spec_budget, wbytes, row) as outside:
            out = measure(run, row, lambda: decode(held["managed"], managed_ids[b], tokens), size["warmup"],
                          size["timed"], moved=manager_moved, managed=True, outside=outside, units=tokens,
                          settle=True)
        row["_output"] = common.as_plain(out)

    def managed_lora(row):
        losses = []
        peft_model = with_lora(held["managed"])  # (in place: unloaded again below)
        held["peft"] = peft_model
        step = lora_step(peft_model, torchTensorRef.manage(lora_ids.clone()))
        with managed_under("flow", size["lora_budget"], wbytes, row) as outside:
            measure(run, row, step, size["warmup"], size["timed"], moved=manager_moved, managed=True,
                    outside=outside, collect=losses.append)
        row["_output"] = row["losses"] = losses

    def decode_rows(strategy, spec_budget, skip=None):
        for b in size["batches"]:
            run.row(lambda row, b=b: managed_decode(row, b, strategy, spec_budget), skip=skip,
                    group=decode_groups[b], config=f"{strategy} {budget_label(spec_budget, wbytes)}",
                    device=run.device, batch=b, unit="token", strategy=strategy)

    if decoding:
        for spec_budget in size["budgets"]:
            decode_rows("flow", spec_budget)
    run.row(managed_lora, skip=lora_skip, config=f"flow {budget_label(size['lora_budget'], wbytes)}",
            device=run.device, strategy="flow", **lora_meta)
    if "peft" in held:  # the adapters out again: Genoa decodes the model plain torch decoded
        with torchTensorRef.disabled():
            held["managed"] = held.pop("peft").unload()
        held["managed"].eval()
    tm.evict_all()  # (the device to the rows of plain torch that follow; the model waits on the host)
    tm.synchronize()
    run.free()

    def genoa_rows():
        try:
            for spec_budget in size["genoa_budgets"]:
                skip = None
                if run.args.no_genoa:
                    skip = "--no-genoa"
                elif run.elapsed() > size["genoa_by"]:
                    skip = f"the run passed {size['genoa_by']:.0f} s, when Genoa's rows are left out"
                decode_rows("genoa", spec_budget, skip)
        finally:
            held.pop("managed", None)
            managed_ids.clear()
            run.free()

    if decoding:
        run.later.append(genoa_rows)
    else:
        held.pop("managed")
        managed_ids.clear()
        run.free()

    # 3. accelerate's device map at each budget, its offloaded layers copied in by its hooks
    def accelerate_decode(row, b, spec_budget, first: bool):
        if first:  # (the batch sizes share a dispatched model)
            row["outside_bytes"] = tm.outside_bytes()
            row["budget"] = row["outside_bytes"] + budget_bytes(spec_budget, wbytes)
            held["accelerate"], row["device_map"] = accelerate_dispatch(run, copy_plain(held["host"]),
                                                                        row["budget"])
        else:
            earlier = run.find(decode_groups[size["batches"][0]], row["config"])
            row["budget"], row["outside_bytes"] = earlier.get("budget"), earlier.get("outside_bytes")
        if "accelerate" not in held:
            raise RuntimeError("the model could not be dispatched (see the row of the first batch size)")
        counter = common.AccelerateCopies()

        def moved(reset):
            if reset:
                counter.reset()
            return counter.bytes

        with torchTensorRef.disabled(), counter.counting():
            dev_ids = ids[b].to(run.plain_device if run.cuda else "cpu")
            out = measure(run, row, lambda: decode(held["accelerate"], dev_ids, tokens), size["baseline_warmup"],
                          size["timed"], moved=moved, units=tokens)
        row["_output"] = common.as_plain(out)
        if not run.cuda:
            row["note"] = SIM_CPU_NOTE

    def accelerate_rows():
        try:
            for spec_budget in size["budgets"]:
                for i, b in enumerate(size["batches"]):
                    run.row(lambda row, b=b, s=spec_budget, first=i == 0: accelerate_decode(row, b, s, first),
                            skip=optional("accelerate"), group=decode_groups[b],
                            config=f"accelerate {budget_label(spec_budget, wbytes)}", device=run.device,
                            batch=b, unit="token", strategy="accelerate device_map")
                held.pop("accelerate", None)
                run.free()
        finally:
            held.pop("host", None)

    if decoding:
        run.baselines.append(accelerate_rows)

    # 4. plain torch on the host's CPU, a cut-down count of tokens or steps, at the end of the run
    cpu_skip = "--no-cpu" if run.args.no_cpu else None if run.cuda else CPU_ON_SIM
    host = held["host"] if decoding else held.pop("host")
    if cpu_skip is not None:
        host = None  # (kept for those rows only)

    def cpu_decode(row, b):
        with torchTensorRef.disabled():
            out = measure(run, row, lambda: decode(host, ids[b], cpu_tokens), 0, size["cpu_timed"],
                          moved=nothing_moved, units=cpu_tokens)
        row["_output"] = common.as_plain(out)

    def cpu_lora(row):
        losses = []
        with torchTensorRef.disabled():
            peft_model = with_lora(host)  # (in place: the last row of this model)
            measure(run, row, lora_step(peft_model, lora_ids), 0, 1, moved=nothing_moved, collect=losses.append)
        row["_output"] = row["losses"] = losses

    def cpu_lora_skip() -> Optional[str]:
        """Why the CPU's LoRA step is left out: its backward, one call into autograd, cannot
        be stopped at the cap, so it runs only when the batch-8 decoding call (a forward of as
        many tokens and more) says it ends well within the cap."""
        reason = cpu_skip or lora_skip
        if reason is not None:
            return reason
        b = max(size["batches"])
        known = run.find(decode_groups[b], "cpu")
        if known is None:
            return f"no decoding row of batch {b} on the CPU to estimate the step from"
        if "seconds" not in known:
            return f"the CPU's batch-{b} decoding call did not finish: no estimate of the step"
        scale = size["lora_batch"] * size["lora_seq"] / (b * size["prompt"])
        estimate = CPU_STEP_FORWARDS * scale * known["seconds"]
        if estimate > size["cpu_cap"]:
            return f"estimated {estimate:.0f} s from the batch-{b} decoding call, over the cap of " \
                   f"{size['cpu_cap']:.0f} s"
        return None

    def cpu_rows():
        if decoding:
            for b in size["batches"]:
                run.row(lambda row, b=b: cpu_decode(row, b), cap=size["cpu_cap"], skip=cpu_skip,
                        group=decode_groups[b], config="cpu", device="cpu", batch=b, unit="token",
                        cut=f"{cpu_tokens} new tokens")
        run.row(cpu_lora, cap=size["cpu_cap"], skip=cpu_lora_skip(), config="cpu", device="cpu", cut="1 step",
                **lora_meta)

    run.cpu_rows.append(cpu_rows)


def copy_plain(model: torch.nn.Module) -> torch.nn.Module:
    with torchTensorRef.disabled():
        return copy.deepcopy(model)


def host_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available * 0.9)
    except ImportError:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * 0.9)


def accelerate_dispatch(run: Run, model: torch.nn.Module, budget: int):
    """``model`` (plain, on the host) dispatched by accelerate as ``from_pretrained(device_map="auto",
    max_memory={gpu: budget, "cpu": ...})`` places it; the device map, by device."""
    from accelerate import dispatch_model, infer_auto_device_map

    index = run.plain_device.index if run.plain_device.index is not None else 0
    device_map = infer_auto_device_map(model, max_memory={index: budget, "cpu": host_memory_bytes()},
                                       no_split_module_classes=getattr(model, "_no_split_modules", None))
    if run.cuda:
        main = index
    else:
        # the CPU as a torch.device is a device of its own to accelerate ("cpu", a string,
        # means offloaded): the modules placed on the GPU stay, the others get their hooks
        main = torch.device("cpu")
        device_map = {name: main if d == index else d for name, d in device_map.items()}
    # a budget that holds no layer beside accelerate's room for one offloaded layer places
    # everything on the host: its hooks must still run it on the device
    force = {"force_hooks": True} if all(d != main for d in device_map.values()) else {}
    with torchTensorRef.disabled():
        model = dispatch_model(model, device_map=dict(device_map), main_device=main, **force)
    placed: Dict[str, int] = {}
    for d in device_map.values():
        placed[str(d)] = placed.get(str(d), 0) + 1
    return model, placed


def denoiser_section(run: Run) -> None:
    """The UNet's rows: plain torch resident on the device, the managed row at half its
    weights, and after the other sections' own diffusers' group offloading
    (``Run.baselines``) and plain torch on the CPU (``Run.cpu_rows``)."""
    size = run.size
    dtype = dtype_of(size["unet_dtype"])
    held = {"master": build_unet(size["unet"], dtype, run.plain_device if run.cuda else "cpu")}
    wbytes = common.param_bytes(held["master"])
    run.result["models"]["denoiser"] = {"parameters": sum(p.numel() for p in held["master"].parameters()),
                                        "weight_bytes": wbytes, "dtype": size["unet_dtype"]}
    print(f"UNet: {common.parameters_text(run.result['models']['denoiser']['parameters'])} parameters, "
          f"{format_size(wbytes)} of weights ({size['unet_dtype']})", flush=True)
    with torchTensorRef.disabled():
        g = torch.Generator().manual_seed(1)
        side, channels = size["unet"]["sample_size"], size["unet"]["in_channels"]
        latents = torch.randn(size["unet_batch"], channels, side, side, generator=g, device="cpu").to(dtype)
        text = torch.randn(size["unet_batch"], size["text_len"], size["unet"]["cross_attention_dim"], generator=g,
                           device="cpu").to(dtype)
    steps = size["denoise_steps"]
    meta = dict(group=f"unet denoise {steps} steps", batch=size["unet_batch"], unit="step")

    # 1. plain, resident on the device
    def plain(row):
        # (the scheduler's tables are made without a device: on CUDA its float32 kernels round
        # otherwise than the CPU's, and the latents part by up to an ulp of bfloat16 a step)
        with run.plain(made_on_device=True):
            model = held["master"] if run.cuda else common.plain_copy(held["master"]).to(run.plain_device)
            lat, tx = latents.to(run.plain_device), text.to(run.plain_device)
            out = measure(run, row, lambda: denoise(model, lat, tx, steps), size["plain_warmup"], size["timed"],
                          moved=nothing_moved, units=steps)
            row["_output"] = common.as_plain(out)
        if run.cuda:
            with run.plain():  # the scheduler on the host, as plain torch makes it without a device
                row["_host_scheduler"] = common.as_plain(denoise(model, lat, tx, steps))
                # the CPU's one step, here too: its reference and its time
                one, row["cut_seconds"] = run.timed(lambda: denoise(model, lat, tx, 1))
                row["_cpu_reference"] = common.as_plain(one)
                row["kernel_temporary"] = common.kernel_temporary(lambda: denoise(model, lat, tx, 1),
                                                                  run.plain_device)

    run.row(plain, config="plain", device=run.device, **meta)
    if run.cuda:
        held["master"] = to_host(held["master"])
    run.free()
    held["host"] = copy_plain(held["master"])

    # 2. managed, at half its weights
    held["managed"] = torchTensorRef.manage(held.pop("master"))

    def flow(row):
        lat, tx = torchTensorRef.manage(latents.clone()), torchTensorRef.manage(text.clone())
        expected = run.find(meta["group"], "plain")
        expected = None if expected is None else expected.get("_output")
        outputs = []  # every call's, compared with plain torch's after the timing

        def call():
            outputs.append(denoise(held["managed"], lat, tx, steps))
            return outputs[-1]

        with managed_under("flow", size["unet_budget"], wbytes, row) as outside:
            out = measure(run, row, call, size["warmup"], size["timed"], moved=manager_moved, managed=True,
                          outside=outside, units=steps, settle=True)
        row["_output"] = common.as_plain(out)
        if expected is not None:  # (which call first parts from plain torch, where one does)
            row["call_differences"] = [max_difference(common.as_plain(o), expected) for o in outputs]
        host_made = run.find(meta["group"], "plain")
        if host_made is not None and "_host_scheduler" in host_made:
            row["host_scheduler_difference"] = max_difference(row["_output"], host_made["_host_scheduler"])

    flow_row = run.row(flow, config=f"flow {budget_label(size['unet_budget'], wbytes)}", device=run.device,
                       strategy="flow", **meta)
    del held["managed"]
    run.free()

    # 3. diffusers' group offloading, block by block on a side stream
    def group_offload(row):
        model = copy_plain(held["host"])
        onload = run.plain_device if run.cuda else torch.device("cpu")
        calls = [0]

        def call():
            calls[0] += 1
            return denoise(model, lat, tx, steps)

        def moved(reset):  # every group is brought in before it runs and dropped after: the weights, per step
            if reset:
                calls[0] = 0
            return wbytes * steps * calls[0]

        with torchTensorRef.disabled():
            model.enable_group_offload(onload, offload_type="block_level", num_blocks_per_group=1,
                                       use_stream=run.cuda)
            lat, tx = latents.to(onload), text.to(onload)
            out = measure(run, row, call, size["baseline_warmup"], size["timed"], moved=moved, units=steps)
        row["moved_estimated"] = True
        row["_output"] = common.as_plain(out)
        row["_reference"] = "_host_scheduler" if run.cuda else "_output"  # (its scheduler's tables are on the host)
        if not run.cuda:
            row["note"] = SIM_CPU_NOTE
        if flow_row.get("budget") and row.get("peak"):  # (beside the managed row's budget)
            row["peak_to_flow_budget"] = row["peak"] / flow_row["budget"]

    lacks = None if hasattr(held["host"], "enable_group_offload") else \
        "the installed diffusers has no enable_group_offload"

    def offload_row():
        try:
            run.row(group_offload, skip=lacks, config="diffusers group offload", device=run.device,
                    strategy="group offload", **meta)
        finally:
            held.clear()
            run.free()

    run.baselines.append(offload_row)

    # 4. plain on the CPU: one step, at the end of the run
    cpu_skip = "--no-cpu" if run.args.no_cpu else None if run.cuda else CPU_ON_SIM
    host = held["host"]
    if cpu_skip is not None:
        host = None  # (kept for that row only)

    def cpu(row):
        with torchTensorRef.disabled():
            out = measure(run, row, lambda: denoise(host, latents, text, 1), 0, size["cpu_timed"],
                          moved=nothing_moved, units=1)
        row["_output"] = common.as_plain(out)

    run.cpu_rows.append(lambda: run.row(cpu, cap=size["cpu_cap"], skip=cpu_skip, config="cpu", device="cpu",
                                        cut="1 step", **meta))


# -- report -----------------------------------------------------------------------------------------

def cell(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def row_line(r: dict) -> str:
    """One line of the table."""
    config = f"{r['config']} ({r['cut']})" if r.get("cut") else r["config"]
    head = f"{r['group']:<22} {config:<34}"
    if "skipped" in r:
        return f"{head} skipped: {r['skipped']}"
    if "error" in r and "seconds" not in r:
        return f"{head} ERROR {r['error']}"
    if "stopped" in r and "seconds" not in r:
        return f"{head} stopped: {r['stopped']}"
    if r.get("equal") is None:
        outputs = "reference" if r["config"] == "plain" else "-"
    elif r["equal"]:
        outputs = "equal"
    elif "max_difference" in r:
        outputs = f"max diff {r['max_difference']:.3g}"
    else:
        outputs = f"{r.get('differing')} differ"
    peak = "-"
    if r.get("peak") is not None:
        peak = format_size(r["peak"])
        if r.get("peak_to_budget") is not None:
            peak += f" ({r['peak_to_budget']:.2f})"
        elif r.get("peak_to_flow_budget") is not None:
            peak += f" ({r['peak_to_flow_budget']:.2f} of flow's)"
    moved = "-" if r.get("moved") is None else format_size(r["moved"] // r["units"])
    line = (f"{head} {cell(r.get('seconds_per_unit'), '9.4f')} s/{r['unit']:<5} "
            f"{cell(r.get('to_plain'), '7.2f')} {cell(r.get('to_bound'), '7.2f')} {moved:>10} "
            f"{peak:>25} {outputs}")
    if "error" in r:
        line += f"  (partial: {r['error']})"
    return line


def print_table(run: Run) -> None:
    bw = run.bandwidth
    print()
    print(f"on {run.device}, torch {torch.__version__}; host to device {bw['h2d'] / 1e9:.1f} GB/s "
          f"({'pinned' if bw['pinned'] else 'host memcpy'}); {run.elapsed():.0f} s")
    if not run.cuda:
        print("on 'sim' the times are meaningless (the accelerator is host memory); bytes and outputs are real")
    print(f"{'group':<22} {'config':<34} {'time':>9} {'':<7} {'x plain':>7} {'x bound':>7} "
          f"{'moved/unit':>10} {'peak (/ budget)':>25} outputs vs plain")
    groups = list(dict.fromkeys(r["group"] for r in run.rows))
    for r in sorted(run.rows, key=lambda r: (groups.index(r["group"]), table_rank(r))):
        print(row_line(r))
    for r in run.rows:
        if r.get("peak_to_budget_and_temporary") is not None:
            temporary = run.find(r["group"], "plain")["kernel_temporary"]
            print(f"{r['group']} / {r['config']}: real peak / (budget + {format_size(temporary['bytes'])}, the "
                  f"largest temporary one kernel made, {temporary['op']}): {r['peak_to_budget_and_temporary']:.3f}")
        if r.get("host_scheduler_difference") is not None:
            print(f"{r['group']} / {r['config']}: max diff {r['host_scheduler_difference']:.3g} from plain torch "
                  f"with the scheduler's tables made on the host")


def table_rank(r: dict) -> int:
    """Where a row stands in its group: plain, CPU, offloading baselines, Flow, Genoa."""
    return {"plain": 0, "cpu": 1}.get(r["config"], {"flow": 3, "genoa": 4}.get(r.get("strategy"), 2))


def failures(rows: List[dict]) -> List[str]:
    """Rows that raised, and managed rows whose outputs differ from plain torch's."""
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['group']} / {r['config']}: {r['error']}")
        elif r.get("strategy") in ("flow", "genoa") and r.get("equal") is False:
            out.append(f"{r['group']} / {r['config']}: outputs differ from plain torch")
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help='"cuda", "cuda:N", or "sim" to check the harness')
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--no-cpu", action="store_true", help="leave out the rows of plain torch on the CPU")
    parser.add_argument("--no-genoa", action="store_true", help="leave out Genoa's rows")
    parser.add_argument("--deadline", type=float, help="seconds after which rows not started are skipped")
    parser.add_argument("--genoa-by", type=float, help="seconds after which Genoa's rows are skipped")
    parser.add_argument("--row-cap", type=float, help="seconds a row may take before it is stopped")
    parser.add_argument("--cpu-cap", type=float, help="seconds a row on the CPU may take")
    parser.add_argument("--slow-call", type=float, help="a call slower than this ends its row's timed calls")
    parser.add_argument("--json", help="write the rows to this file (again after every row)")
    args = parser.parse_args(argv)
    args.argv = argv
    command = common.command_line(SCRIPT, argv)
    if args.device != "sim" and not args.device.startswith("cuda"):
        parser.error(f'--device must be "cuda", "cuda:N" or "sim" (got: {args.device!r})')
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        message = NEEDS_CUDA.format(torch=torch.__version__)
        print(message)
        return {**common.metadata(command, args.device), "skipped": message}
    size = dict(SIZES[args.size])
    for key in ("deadline", "genoa_by", "row_cap", "cpu_cap", "slow_call"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    common.quiet_transformers()
    previous = (tm.device, tm.strategy, tm.budget)
    tm.budget = None
    tm.device = args.device  # (before any tensor is made)
    run = Run(args, size, command)
    try:
        run.bandwidth = run.measure_bandwidth(size["bandwidth_bytes"])
        print(f"host to device: {run.bandwidth['h2d'] / 1e9:.1f} GB/s", flush=True)
        sections = []
        if {"llama", "lora"} & set(args.sections):
            sections.append(("llama", lambda: llama_sections(run, args.sections)))
        if "denoiser" in args.sections:
            sections.append(("denoiser", lambda: denoiser_section(run)))
        for name, section in sections:
            if name == "denoiser" and optional("diffusers"):
                run.row(None, skip=optional("diffusers"), group="unet denoise", config="all", unit="step")
                continue
            try:
                section()
            except Exception as e:  # building a model failed: its rows are missing, the next section runs
                traceback.print_exc()
                run.row(None, error=f"the section failed: {type(e).__name__}: {e}", group=name, config="all",
                        unit="-")
            finally:
                tm.budget = None
                run.free()
        for rows in run.baselines + run.cpu_rows + run.later:
            try:
                rows()
            except Exception as e:  # (each row catches its own: this is the code around them)
                traceback.print_exc()
                run.row(None, error=f"{type(e).__name__}: {e}", group="later rows", config="-", unit="-")
        run.baselines.clear()
        run.cpu_rows.clear()
        run.later.clear()
    finally:
        tm.budget = None
        tm.device, tm.strategy = previous[0], previous[1]
        tm.budget = previous[2]
    run.result["failures"] = failures(run.rows)
    print_table(run)
    for line in run.result["failures"]:
        print(f"FAILED {line}")
    run.save()
    return {**common.metadata(command, args.device), **public(run.result)}


if __name__ == "__main__":
    sys.exit(1 if main().get("failures") else 0)
