"""What the benchmarks share: models, workloads, accelerate's copy counter, result metadata."""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from typing import Callable, Dict, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# (transformers 5.25 and later kernelize what from_pretrained loads with hub kernels, which
# need a download, and whose library refuses devices it does not know, "sim" among them)
os.environ.setdefault("USE_HUB_KERNELS", "NO")

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torchTensorRef import tensorsManager as tm  # noqa: E402

#: special tokens inside every benchmark's vocabulary; no eos, so generate() always makes its tokens
SPECIAL = dict(bos_token_id=1, eos_token_id=None, pad_token_id=0)
MIB = 2**20


def quiet_transformers() -> None:
    """Silence transformers' config and generation warnings (they fill the benchmark's output)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# -- models (built plain, on the host, from a seed) ------------------------------------------------

def gpt2(layers: int, embd: int, vocab: int, positions: int, seed: int = 0) -> torch.nn.Module:
    """A plain ``transformers`` GPT-2 with random weights and no dropout (comparisons stay exact)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet_transformers()
    config = GPT2Config(n_layer=layers, n_embd=embd, n_head=max(embd // 32, 1), vocab_size=vocab,
                        n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **SPECIAL)
    with torchTensorRef.disabled():
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)


def llama(layers: int, hidden: int, intermediate: int, vocab: int, heads: int, kv_heads: int,
          positions: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A plain ``transformers`` Llama with random weights, built directly in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                         vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions, **SPECIAL)
    previous = torch.get_default_dtype()
    with torchTensorRef.disabled():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)  # build in dtype: a 1B model never exists in float32
        try:
            return LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


#: the benchmarks' name for the lenient form of "sim" (``tensorsManager.sim_strict = False``):
#: its device tensors are plain CPU tensors, so a row on it times the manager's own cost
#: against plain CPU torch running the same kernels (copies, budget and paging are sim's)
SIM_CPU = "sim-cpu"


def plain_device(device: str) -> str:
    """Where plain torch puts the tensors of ``device``: the CPU for "sim-cpu", and for "sim"
    where the strict simulated device cannot be registered (a machine with CUDA: its lenient
    form, whose device tensors are CPU tensors), else ``device`` itself."""
    from torchTensorRef.memory.sim import device as sim_device

    if device == SIM_CPU or device.split(":")[0] == "sim" and sim_device.register() is None:
        return "cpu"
    return device


def set_device(device: str) -> None:
    """Make ``device`` the manager's ("sim-cpu": "sim" in its lenient form)."""
    tm.sim_strict = device != SIM_CPU
    tm.device = "sim" if device == SIM_CPU else device


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent plain copy of plain ``model``."""
    with torchTensorRef.disabled():
        return copy.deepcopy(model)


def managed_copy(model: torch.nn.Module, device: str, strategy: str) -> torch.nn.Module:
    """A copy of plain ``model`` brought under management on ``device`` with ``strategy``, no budget yet."""
    tm.budget = None
    set_device(device)
    tm.strategy = strategy
    return torchTensorRef.manage(plain_copy(model))


def host_copy_rate(model: torch.nn.Module, repeats: int = 9) -> float:
    """Bytes per second of process time to copy the model's tensors into buffers already
    mapped (a fetch on the lenient "sim" is a host memcpy; a caching allocator would spare it
    the page faults of a new buffer): the fastest of ``repeats``, a bound no pager beats."""
    with torchTensorRef.disabled():
        tensors = [t.detach() for t in plain_copy(model).state_dict().values()]
        buffers = [torch.empty_like(t) for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            for b, t in zip(buffers, tensors):
                b.copy_(t)
            best = min(best, time.process_time() - start)
    return nbytes / best


def plain_inputs(seed: int, vocab: int, batch: int, seq: int) -> torch.Tensor:
    """Token ids (a plain tensor) from ``seed``."""
    with torchTensorRef.disabled():
        g = torch.Generator().manual_seed(seed)
        return torch.randint(2, vocab, (batch, seq), generator=g)


# -- workloads ---------------------------------------------------------------------------------------

def generate(model: torch.nn.Module, ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy ``generate()`` of exactly ``tokens`` new tokens."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, pad_token_id=SPECIAL["pad_token_id"])


def trainer(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    """One AdamW training step of ``model`` on ``ids`` (labels = ids) per call; returns the loss."""
    model.train()
    # The list (foreach) kernels everywhere: torch picks them for accelerator tensors ("sim"
    # included) and a per-parameter loop on the CPU, whose results differ in the last bits.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()

    step.optimizer = opt  # type: ignore[attr-defined]
    return step


def warm_up(run: Callable[[], object], least: int, most: int) -> list:
    """``run()``'s results, called ``least`` times and then until the manager's strategy
    has settled (``Strategy.settled``: Flow follows its plan and has chosen how to prefetch
    for it, a trial of several periods), at most ``most`` times: the calls timed next are
    its steady state."""
    outs = [run() for _ in range(least)]
    while len(outs) < most and not tm.strategy.settled:
        outs.append(run())
    return outs


def as_plain(t: torch.Tensor) -> torch.Tensor:
    """The values of a TensorRef or plain tensor as a plain host tensor."""
    if isinstance(t, torchTensorRef.TensorRef):
        t = t.target
    with torchTensorRef.disabled():
        return t.detach().cpu().clone()


# -- accelerate ---------------------------------------------------------------------------------------

class AccelerateCopies:
    """Counts the bytes accelerate's hooks copy to an execution device.

    ``accelerate.cpu_offload`` keeps the weights on the host and, in each module's
    pre-forward hook, sets every weight on the execution device with
    ``set_module_tensor_to_device`` (and back to ``meta`` after). Wrapping that function in
    ``accelerate.hooks`` counts every value set on a real device: what a GPU would receive
    over PCIe, also when the execution device is the host (where ``.to`` copies nothing).
    """

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    @contextlib.contextmanager
    def counting(self):
        import accelerate.hooks

        original = accelerate.hooks.set_module_tensor_to_device

        def counted(module, tensor_name, device, value=None, *args, **kwargs):
            if isinstance(device, int) or torch.device(device).type != "meta":
                self._count(module, tensor_name, device, value, kwargs.get("tied_params_map"))
            return original(module, tensor_name, device, value, *args, **kwargs)

        accelerate.hooks.set_module_tensor_to_device = counted
        try:
            yield self
        finally:
            accelerate.hooks.set_module_tensor_to_device = original

    def _count(self, module, name, device, value, tied) -> None:
        if value is None:
            owner = module
            for part in name.split(".")[:-1]:
                owner = getattr(owner, part)
            value = getattr(owner, name.split(".")[-1])
        if value is None or value.device.type == "meta":
            return
        if tied is not None and value.data_ptr() in tied and device in tied[value.data_ptr()]:
            return  # a tied weight already on the device: accelerate reuses it
        self.bytes += value.numel() * value.element_size()
        self.calls += 1

    def reset(self) -> None:
        self.bytes = self.calls = 0


def offloaded_copy(model: torch.nn.Module, execution_device) -> torch.nn.Module:
    """A plain copy of ``model`` under ``accelerate.cpu_offload`` (weights on the host)."""
    import accelerate

    with torchTensorRef.disabled():
        return accelerate.cpu_offload(plain_copy(model), execution_device=execution_device)


# -- results --------------------------------------------------------------------------------------------

def command_line(script: str, argv) -> str:
    """The command that reproduces a run, from the repository root."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", script] + [shlex.quote(str(a)) for a in args])


def metadata(command: str, device: str) -> Dict[str, object]:
    """Where, when and how a result was obtained."""
    meta = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }
    for name in ("transformers", "accelerate"):
        try:
            meta[name] = __import__(name).__version__
        except ImportError:
            meta[name] = None
    meta["commit"] = _git_commit()
    if hasattr(os, "getloadavg"):
        meta["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if device.startswith("cuda") and torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
    return meta


def _git_commit() -> Optional[str]:
    """The repository's commit, with "+changes" when the tree differs from it; None outside git.

    The benchmarks' own outputs (``docs/benchmarks``, ``assets``) do not count as changes: a
    run writes them one benchmark after another.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!docs/benchmarks", ":!assets"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if dirty else "")


def write_json(path: str, result: dict) -> None:
    """Write ``result`` to ``path`` (folders made as needed)."""
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")


def write_result(path: str, script: str, argv, device: str, result: dict) -> None:
    """Write ``result`` to ``path`` with where, when and how it was obtained (``metadata``)."""
    write_json(path, {**metadata(command_line(script, argv), device), "result": result})


def parameters_text(n: int) -> str:
    """``1.10B`` or ``0.25M`` parameters."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or ``None`` when either is missing or ``b`` is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


@contextlib.contextmanager
def regions_off():
    """Module regions off inside (the benchmarks that measure the per-op path), restored after."""
    previous = torchTensorRef.regions.enabled
    torchTensorRef.regions.enabled = False
    try:
        yield
    finally:
        torchTensorRef.regions.enabled = previous


class _KernelTemporaries(TorchDispatchMode):
    """Records, op by op, the most the CUDA allocator held during the op above what it holds
    after it: the temporaries the kernel made and freed inside its call."""

    def __init__(self, device):
        super().__init__()
        self.device = device
        self.largest = {"bytes": 0, "op": None}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.reset_peak_memory_stats(self.device)
        out = func(*args, **(kwargs or {}))
        made = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
        if made > self.largest["bytes"]:
            self.largest = {"bytes": made, "op": str(func)}
        return out


def kernel_temporary(call: Callable[[], object], cuda_device) -> dict:
    """The largest temporary one kernel of plain torch's ``call`` makes inside its call on
    ``cuda_device`` (a convolution's cuDNN workspace, say): ``{"bytes", "op"}``. The budget
    leaves those out (docs/concepts.md, "The budget on a GPU"): a managed row's real peak is
    compared with the budget plus this."""
    mode = _KernelTemporaries(cuda_device)
    with mode:
        call()
    torch.cuda.reset_peak_memory_stats(cuda_device)
    return mode.largest


def copy_rates(cuda_device, timed, nbytes: int, repeats: int = 5) -> dict:
    """Best host-to-device (``h2d``) and device-to-host (``d2h``) copy rates of a pinned
    ``nbytes`` buffer on ``cuda_device``, in bytes/s, timed with CUDA events. With no CUDA
    device (``None``: "sim", whose device is host memory) a host memcpy's rate, timed by
    ``timed(fn) -> (result, seconds)``, both ways."""
    with torchTensorRef.disabled():
        if cuda_device is None:
            src = torch.empty(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            best = min(timed(lambda: dst.copy_(src))[1] for _ in range(repeats))
            return {"h2d": nbytes / best, "d2h": nbytes / best, "bytes": nbytes, "pinned": False}
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=cuda_device)
        out = {"bytes": nbytes, "pinned": True}
        for key, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)  # (warm-up)
            ms = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                ms.append(start.elapsed_time(end))
            out[key] = nbytes / (min(ms) / 1e3)
        del host, dev
        return out


#: the libraries ``host_profile`` files a function's own time under, by a folder in its path
_LIBRARIES = (("/torch/", "torch (Python)"), ("/transformers/", "transformers"))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _area(path: str, name: str, root: str = _ROOT) -> str:
    """The area of a profiled function: the folder of the project it is in
    (``torchTensorRef/regions``; the simulated device's, ``torchTensorRef/memory/sim``, which
    a GPU does not run, apart; ``benchmarks``), a library, or, for a function written in C,
    whether it is torch's own (its kernels' launches, its copies, its C++ bookkeeping) or
    Python's."""
    if path == "~":
        return "torch C calls" if "torch." in name or "TensorBase" in name else "Python built-ins"
    if path.startswith(root + os.sep):
        folder = os.path.dirname(os.path.relpath(path, root)).replace(os.sep, "/")
        if folder.startswith("torchTensorRef") or folder == "benchmarks":
            return folder
    path = path.replace(os.sep, "/")
    for part, label in _LIBRARIES:
        if part in path:
            return label
    return "other Python"


def bytecode_counts(run: Callable[[], object], repeats: int, per: int, top: int) -> dict:
    """``run`` ``repeats`` times with Python's tracing of each bytecode: the Python work of
    the host, per ``per`` units of work, as a count no machine's load moves (what C code
    does, a kernel's or a built-in's, is not counted; tracing runs Python about 30 times
    slower).

    ``total``: bytecodes per unit; ``functions``: the ``top`` functions by bytecodes of their
    own, as ``(function, bytecodes)`` per unit; ``areas``: the bytecodes per unit of each
    area (:func:`_area`), largest first."""
    counts: dict = {}

    def trace(frame, event, _arg):
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            code = frame.f_code
            counts[code] = counts.get(code, 0) + 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for _ in range(repeats):
            run()
    finally:
        sys.settrace(previous)
    root = _ROOT
    rows, areas = [], {}
    for code, n in counts.items():
        path = code.co_filename
        where = (f"{os.path.relpath(path, root) if path.startswith(root) else os.path.basename(path)}:"
                 f"{code.co_firstlineno}({code.co_name})")
        rows.append((where, n / per))
        area = _area(path, code.co_name)
        areas[area] = areas.get(area, 0.0) + n / per
    rows.sort(key=lambda r: -r[1])
    return {"total": sum(counts.values()) / per, "functions": rows[:top],
            "areas": dict(sorted(areas.items(), key=lambda kv: -kv[1]))}


def host_profile(run: Callable[[], object], repeats: int, per: int, top: int,
                 sync: Callable[[], None] = lambda: None) -> dict:
    """``run`` ``repeats`` times under ``cProfile``: where the host's time goes, per ``per``
    units of work (``repeats`` for a call, the number of region calls for a region call).

    ``functions``: the ``top`` functions by time of their own, as ``(function, calls, own µs,
    inclusive µs)`` per unit; ``areas``: the own time per unit, in µs, of each area
    (:func:`_area`: the package's folders, torch's Python, transformers, torch's C calls ...),
    largest first. The profiler's own cost per function call is included: compare areas and
    rows within one profile, not with unprofiled times."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    sync()
    profiler.enable()
    for _ in range(repeats):
        run()
    sync()
    profiler.disable()
    stats = pstats.Stats(profiler)
    root = _ROOT
    rows, areas = [], {}
    for (path, line, name), (_cc, ncalls, own, inclusive, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.relpath(path, root) if path.startswith(root) else os.path.basename(path)}:{line}({name})"
        rows.append((where, ncalls / per, own / per * 1e6, inclusive / per * 1e6))
        area = _area(path, name)
        areas[area] = areas.get(area, 0.0) + own / per * 1e6
    rows.sort(key=lambda r: -r[2])
    return {"functions": rows[:top], "areas": dict(sorted(areas.items(), key=lambda kv: -kv[1]))}
