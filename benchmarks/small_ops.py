"""Where the proxy's per-op cost shows: batch-1 decoding and small training steps.

Large matrix products hide the time a Python tensor subclass adds to each op; small models
at batch 1 do not. Four works, on one thread:

- ``decode``: greedy ``generate()`` (``do_sample=False``, the default dynamic cache) of a
  random-weight Llama and GPT-2 built from ``transformers`` configs, 8-token prompt, 24
  new tokens, batch 1;
- ``serve``: requests one after another, as a server gets them: greedy ``generate()`` calls
  of the Llama, each with its own prompt length and number of new tokens (the size's
  ``requests``), batch 1; Flow must find its period in calls that never repeat whole;
- ``train``: an AdamW step (forward, backward, step) of a 4-layer Llama, batch 4 x 32.

Rows: plain torch; the floor of any Python subclass (``overhead.MinimalWrapper`` around the
parameters, buffers and inputs: it unwraps, calls and rewraps); pass-through
(``device="cpu"``); ``"sim"`` with no budget; ``"sim"`` under Flow with a budget that fits
everything (twice the base: nothing is evicted); and ``"sim"`` at 50% and 25% of the base
under Flow and under Genoa. The base is the weights for decoding, and for training the peak
of the no-budget run (weights, grads, AdamW state and activations). A budget that cannot
hold one op is reported as "does not fit".

These rows run op by op (``torchTensorRef.regions.enabled = False``): they measure the
per-op path. For decoding, a second table compares module regions (Note [Module regions]
in ``torchTensorRef/regions/__init__.py``) on and off: pass-through and ``"sim"`` under
Flow at 50% and 25% of the weights, each row timed against plain torch on its own device
(plain ``"sim"``: ``SimTensor``s, under ``disabled("sim")``), tokens checked against plain
torch on that device. The ``sim-cpu`` rows run ``"sim"`` in its lenient form
(``tensorsManager.sim_strict = False``): its device tensors are plain CPU tensors, so they
time the manager's own cost against plain CPU torch running the same kernels, with the
copies, budget and paging of ``"sim"``. (Strict ``"sim"`` is a correctness emulator: each
op on its tensors pays a Python subclass, in the plain reference too.)

Every row does the same work. ``"sim"`` is an accelerator to torch, so there attention runs
as its math decomposition and AdamW uses its list (``_foreach``) kernels; the other rows are
made to do the same (``SDPBackend.MATH``, ``foreach=True``).

Each row is a fresh copy of the model: warm-up runs (four; under a budget, more until Flow
follows its plan, at most eight: ``WARMUP``), then
``--repeats`` runs interleaved with plain ones (``overhead.interleaved``). The clock is the
CPU time of the process: with one thread, time the machine gives to other processes does not
count, and on ``"sim"`` autograd runs backward on its own device thread, which the CPU time
of the calling thread would miss. The ratio to plain is the median of the per-pair ratios;
the ratio of the fastest runs is reported beside it (noise only ever adds time). Ops per run
are the aten ops the row dispatches (counted with a ``TorchDispatchMode`` for plain and the
floor, by the manager for the others); µs per op is the time added over plain (this row's
phase) divided by them. Every output (tokens, losses) is compared with plain torch on the
same device; a mismatch is printed and the run exits non-zero.

    python benchmarks/small_ops.py [--work all] [--size small] [--layers N] [--repeats 9] [--json out.json]
                                   [--plot out.png] [--no-regions]

``--layers`` sets the models' depth: under a budget Flow brings a region's blocks ahead where
that costs few more bytes than bringing them on demand, which depends on how many layers
share the room.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common, overhead  # noqa: E402
from benchmarks.common import tm  # noqa: E402

#: model and work sizes; ``tiny`` checks the harness in seconds
SIZES = {
    "small": dict(llama=dict(layers=4, hidden=256, intermediate=512, vocab=1000, heads=4, kv_heads=4),
                  gpt2=dict(layers=4, embd=256, vocab=1000), prompt=8, tokens=24, batch=4, seq=32, repeats=9,
                  requests=((8, 11), (15, 4), (4, 9), (11, 6))),
    "tiny": dict(llama=dict(layers=2, hidden=64, intermediate=128, vocab=128, heads=4, kv_heads=4),
                 gpt2=dict(layers=2, embd=64, vocab=128), prompt=8, tokens=4, batch=2, seq=16, repeats=2,
                 requests=((5, 3), (9, 2), (3, 4))),
    # the small shapes at four times the width: what a region computes grows 16x, its blocks
    # stay as many (where the manager's cost per region stops mattering)
    "medium": dict(llama=dict(layers=4, hidden=1024, intermediate=2048, vocab=1000, heads=8, kv_heads=8),
                   gpt2=dict(layers=4, embd=1024, vocab=1000), prompt=8, tokens=24, batch=4, seq=32, repeats=5,
                   requests=((8, 11), (15, 4), (4, 9), (11, 6))),
}
#: the models each work runs
WORKS = {"decode": ("llama", "gpt2"), "serve": ("llama",), "train": ("llama",)}
#: warm-up runs of a managed row: at least four (Flow finds its period; under a budget a
#: ``generate()`` call's own loop runs op by op in the first call, measured, and guarded in
#: the second: Note [Loops on plain tensors] in regions/scope.py), and under a budget more
#: until the strategy has settled, at most 24 (a training step through regions measures its
#: calls op by op first: Flow follows its plan from its sixth, then tries two ways of
#: prefetching for it over ten more, one period a step)
WARMUP = (4, 24)
#: CPU time of the process, not of the thread: on "sim" (an accelerator to torch) autograd runs
#: backward on its own device thread while this one waits
CLOCK = time.process_time
PLAIN, FLOOR = "plain", "minimal subclass (floor)"
#: (label, device, strategy, budget as a fraction of the base); plain and the floor run unmanaged
ROWS = (
    (PLAIN, None, None, None),
    (FLOOR, None, None, None),
    ("pass-through", "cpu", "flow", None),
    ("sim, no budget", "sim", "flow", None),
    ("sim, Flow, 2x (fits)", "sim", "flow", 2.0),
    ("sim, Flow, 50%", "sim", "flow", 0.5),
    ("sim, Genoa, 50%", "sim", "genoa", 0.5),
    ("sim, Flow, 25%", "sim", "flow", 0.25),
    ("sim, Genoa, 25%", "sim", "genoa", 0.25),
)


#: decoding with module regions on and off: (label, device, budget fraction of the weights, regions)
REGION_ROWS = (
    ("pass-through, per op", "cpu", None, False),
    ("pass-through, regions", "cpu", None, True),
    ("sim, Flow, 50%, per op", "sim", 0.5, False),
    ("sim, Flow, 50%, regions", "sim", 0.5, True),
    ("sim, Flow, 25%, per op", "sim", 0.25, False),
    ("sim, Flow, 25%, regions", "sim", 0.25, True),
    ("sim-cpu, Flow, 50%, per op", common.SIM_CPU, 0.5, False),
    ("sim-cpu, Flow, 50%, regions", common.SIM_CPU, 0.5, True),
    ("sim-cpu, Flow, 25%, per op", common.SIM_CPU, 0.25, False),
    ("sim-cpu, Flow, 25%, regions", common.SIM_CPU, 0.25, True),
    # (a budget the model fits in: nothing moves, the budget is kept)
    ("sim-cpu, Flow, 2x (fits), regions", common.SIM_CPU, 2.0, True),
)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that reach Python dispatch."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class Work:
    """One model and work: builds plain models, runners and the plain reference outputs."""

    def __init__(self, model: str, kind: str, size: dict, repeats: int):
        self.name, self.kind, self.size = f"{model} {kind}", kind, size
        positions = max([size["seq"], size["prompt"] + size["tokens"]] + [p + n for p, n in size["requests"]]) + 8
        if model == "gpt2":
            self.model = common.gpt2(positions=positions, **size["gpt2"])
        else:
            self.model = common.llama(positions=positions, **size["llama"])
        vocab = self.model.config.vocab_size
        if kind == "train":
            self.ids = common.plain_inputs(1, vocab, size["batch"], size["seq"])
        elif kind == "serve":  # (each request's prompt is a prefix of these)
            self.ids = common.plain_inputs(3, vocab, 1, max(p for p, _n in size["requests"]))
        else:
            self.ids = common.plain_inputs(2, vocab, 1, size["prompt"])
        self.runs = WARMUP[1] + repeats  # the most outputs a managed row produces
        self._expected = {}

    def runner(self, model: torch.nn.Module, ids: torch.Tensor):
        """One run per call: ``generate()`` returning the tokens, the requests returning each
        one's tokens, or a training step returning the loss."""
        if self.kind == "train":
            return common.trainer(model, ids)  # (AdamW's list kernels in every row)
        model.eval()
        if self.kind == "serve":
            requests = self.size["requests"]
            return lambda: [common.generate(model, ids[:, :prompt], tokens) for prompt, tokens in requests]
        return lambda: common.generate(model, ids, self.size["tokens"])

    def plain_runner(self, wrap: bool = False, device: str = "cpu"):
        """A run of a plain copy on ``device`` (parameters, buffers and inputs in ``MinimalWrapper``
        with ``wrap``)."""
        on = common.plain_device(device)
        if on != "cpu":
            with torchTensorRef.disabled(device=on):
                model, ids = common.plain_copy(self.model).to(on), self.ids.to(on)
                run = self.runner(model, ids)

            def plain_device_run():
                with torchTensorRef.disabled(device=on):
                    return run()
            return plain_device_run
        with torchTensorRef.disabled():
            if wrap:
                model = overhead.minimal_copy(self.model)
                for p in model.parameters():
                    p.requires_grad_(self.kind == "train")
                ids = overhead.MinimalWrapper.wrap(self.ids)
            else:
                model, ids = common.plain_copy(self.model), self.ids
            run = self.runner(model, ids)

        def plain_run():
            # disabled(): the masks and positions the model creates per call stay plain too
            with torchTensorRef.disabled():
                return run()
        return plain_run

    def expected(self, device: str) -> list:
        """Plain torch's outputs of ``self.runs`` runs on ``device`` (its kernels: "sim" differs in the last bits)."""
        device = common.plain_device(device)
        if device not in self._expected:
            with torchTensorRef.disabled(device=device):
                on = device
                model, ids = common.plain_copy(self.model).to(on), self.ids.to(on)
                run = self.runner(model, ids)
                outs = [run() for _ in range(self.runs if self.kind == "train" else 1)]
            self._expected[device] = [plain_value(o) for o in outs] * (1 if self.kind == "train" else self.runs)
        return self._expected[device]


def plain_value(out):
    """A run's output as a plain host tensor (tokens), a tuple of them (requests) or a float (loss)."""
    if isinstance(out, list):
        return tuple(plain_value(o) for o in out)
    if isinstance(out, overhead.MinimalWrapper):
        out = out.elem
    return common.as_plain(out) if isinstance(out, torch.Tensor) else out


def outputs_equal(outs: list, expected: list) -> bool:
    outs = [plain_value(o) for o in outs]
    return len(outs) <= len(expected) and all(_equal(o, e) for o, e in zip(outs, expected))


def _equal(out, expected) -> bool:
    if isinstance(expected, tuple):
        return isinstance(out, tuple) and len(out) == len(expected) and all(map(_equal, out, expected))
    return torch.equal(out, expected) if isinstance(expected, torch.Tensor) else out == expected


def timed(plain, fn, label: str, repeats: int, outs: list) -> dict:
    """``repeats`` runs of ``fn`` interleaved with ``plain``; ``fn``'s outputs go to ``outs``."""
    times, ratios = {"plain": []}, {}
    overhead.interleaved(plain, lambda: outs.append(fn()), label, repeats, times, ratios, clock=CLOCK)
    return {"times": times[label], "plain_times": times["plain"], "ratio": statistics.median(ratios[label]),
            "ratio_of_fastest": min(times[label]) / min(times["plain"])}


def floor_row(work: Work, plain, repeats: int) -> dict:
    run = work.plain_runner(wrap=True)
    outs = [run()]
    counter = OpCounter()
    with counter:
        outs.append(run())
    out = timed(plain, run, FLOOR, repeats, outs)
    return {**out, "ops": counter.ops, "equal": outputs_equal(outs, work.expected("cpu"))}


def managed_row(work: Work, plain, repeats: int, device: str, strategy: str, budget) -> dict:
    """A fresh managed copy on ``device`` under ``strategy`` and ``budget``: warm up, time, check."""
    try:
        row = _managed_phase(work, plain, repeats, device, strategy, budget)
    except torchTensorRef.OutOfBudgetError as e:
        row = {"fits": False, "error": str(e)}
    tm.budget = None
    gc.collect()  # the next row's copy must not share the device with this one's blocks
    return row


#: Flow's arguments in the managed rows (``--lookahead``, ``--prefetch-evicts``); none: its defaults
FLOW_OPTIONS: dict = {}


def _managed_phase(work: Work, plain, repeats: int, device: str, strategy: str, budget) -> dict:
    model = common.managed_copy(work.model, device, strategy)
    if strategy == "flow" and FLOW_OPTIONS:
        tm.strategy = torchTensorRef.strategies.Flow(**FLOW_OPTIONS)
    run = work.runner(model, torchTensorRef.manage(work.ids.clone()))
    # The budget covers what the device holds outside the manager (Note [Budget on CUDA]): the
    # plain reference's model on the same device, timed beside this row. ``budget`` is the
    # manager's share on top of it.
    tm.budget = None if budget is None else tm.outside_bytes() + budget
    tm.reset_stats()
    outs = warm_up(run, budget)
    warmup_runs = len(outs)
    peak = tm.stats()["peak_device_bytes"]
    tm.reset_stats()
    out = timed(plain, run, device, repeats, outs)
    stats = tm.stats()
    return {**out, "ops": stats["ops"] // repeats, "equal": outputs_equal(outs, work.expected(device)),
            "peak_device_bytes": max(peak, stats["peak_device_bytes"]),
            "bytes_moved": (stats["bytes_to_device"] + stats["bytes_to_host"]) // repeats,
            "evictions": stats["evictions"] // repeats, "ahead": ahead_share(stats), "warmup_runs": warmup_runs,
            "plan": getattr(tm.strategy, "plan", None) is not None, "settled": tm.strategy.settled}


def warm_up(run, budget) -> list:
    """The warm-up runs' outputs (``WARMUP``): under a budget, until the strategy has settled
    (``common.warm_up``), so that the timed runs and their bytes are the steady state's."""
    least, most = WARMUP
    return common.warm_up(run, least, most if budget is not None else least)


def ahead_share(stats: dict):
    """The share of the bytes brought to the device that a prefetch issued during an earlier
    op brought in (``None`` where nothing came in)."""
    into = stats["bytes_to_device"]
    return stats["bytes_prefetched_ahead"] / into if into else None


def training_base(work: Work) -> int:
    """Training's budget base: the peak of a no-budget step on "sim" (weights, gradients,
    AdamW's state, activations), as the per-op rows take it."""
    run = work.runner(common.managed_copy(work.model, "sim", "flow"), torchTensorRef.manage(work.ids.clone()))
    tm.budget = None
    tm.reset_stats()
    for _ in range(WARMUP[0]):
        run()
    peak = tm.stats()["peak_device_bytes"]
    del run
    gc.collect()
    return peak


def region_rows(work: Work, repeats: int, only: str = "") -> list:
    """``REGION_ROWS`` for ``work``: each a fresh copy, timed against plain torch on its device.
    Budgets are fractions of the weights (decoding) or of a no-budget step's peak (training).

    A sim-cpu row's copy floor: plain torch's time plus its bytes moved at the host's copy
    rate (``common.host_copy_rate``), as a ratio to plain. Its copies are host memcpys counted in
    the process time beside the kernels: no pager moving those bytes could take less."""
    base = training_base(work) if work.kind == "train" else common.param_bytes(work.model)
    rate = common.host_copy_rate(work.model)
    plains = {}
    rows = []
    previous = torchTensorRef.regions.enabled, torchTensorRef.regions.under_budget
    torchTensorRef.regions.under_budget = True  # (these rows measure regions under a budget too)
    try:
        for label, device, fraction, on in REGION_ROWS:
            if only not in label:
                continue
            if device not in plains:
                plains[device] = work.plain_runner(device=device)
                plains[device]()
            print(f"  {work.name}: {label}", flush=True)
            torchTensorRef.regions.enabled = on
            budget = None if fraction is None else int(fraction * base)
            row = managed_row(work, plains[device], repeats, device, "flow", budget)
            row.update(row=label, device=device, budget_fraction=fraction, budget=budget, regions=on)
            if device == common.SIM_CPU and row.get("fits") is not False:
                plain_s = statistics.median(row["plain_times"])
                row.update(host_copy_bytes_per_s=rate, copy_floor=1 + row["bytes_moved"] / rate / plain_s,
                           host_us_per_op=host_us_per_op(row, rate))
            rows.append(row)
    finally:
        torchTensorRef.regions.enabled, torchTensorRef.regions.under_budget = previous
    return rows


def host_us_per_op(row: dict, rate: float) -> float:
    """µs the manager adds per op of a sim-cpu row beyond plain torch's kernels and the copies'
    floor: (the row's median time - plain's - its bytes at the host's copy rate) / its ops. With
    regions, an op is a region call (or one op a region ran op by op)."""
    added = statistics.median(row["times"]) - statistics.median(row["plain_times"]) - row["bytes_moved"] / rate
    return added / row["ops"] * 1e6


def region_table(work: dict) -> str:
    lines = [f"{work['work']}, module regions: ratio to plain torch on the row's device",
             f"  {'row':<26} {'ms/run':>8} {'plain ms':>8} {'ratio':>7} {'fastest':>7} {'ops/run':>8} "
             f"{'MiB moved':>9} {'ahead':>6} {'peak/budget':>11} {'floor':>6} {'us/op':>7}  equal"]
    for r in work["region_rows"]:
        if r.get("fits") is False:
            lines.append(f"  {r['row']:<26} does not fit ({r['budget']} bytes)")
            continue
        within = f"{r['peak_device_bytes'] / r['budget']:11.3f}" if r["budget"] else f"{'-':>11}"
        floor = f"{r['copy_floor']:6.3f}" if "copy_floor" in r else f"{'-':>6}"
        ahead = f"{r['ahead']:6.3f}" if r.get("ahead") is not None else f"{'-':>6}"
        per_op = f"{r['host_us_per_op']:7.1f}" if "host_us_per_op" in r else f"{'-':>7}"
        lines.append(f"  {r['row']:<26} {statistics.median(r['times']) * 1e3:8.2f} "
                     f"{statistics.median(r['plain_times']) * 1e3:8.2f} {r['ratio']:7.3f} {r['ratio_of_fastest']:7.3f} "
                     f"{r['ops']:8d} {r['bytes_moved'] / common.MIB:9.2f} {ahead} {within} {floor} {per_op}  "
                     f"{r['equal']}")
    lines.append("  ahead: the share of the bytes brought to the device by a prefetch issued during an earlier op")
    lines.append("  floor (sim-cpu rows): plain's time plus the bytes moved at the host's copy rate, as a ratio "
                 "to plain")
    lines.append("  us/op (sim-cpu rows): time added per op (a region call, with regions) beyond plain and the "
                 "copies' floor")
    return "\n".join(lines)


def _seconds(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def run_work(work: Work, repeats: int, regions: bool = True, only: str = "") -> dict:
    """Every row of ``ROWS`` for ``work``, one phase per row, each interleaved with plain torch."""
    plain = work.plain_runner()
    plain()
    counter = OpCounter()
    with counter:
        plain()
    plain_ops = counter.ops
    work.expected("cpu")
    base_name, base = "weights", common.param_bytes(work.model)
    measured, plain_times = {}, []
    previous = torchTensorRef.regions.enabled
    torchTensorRef.regions.enabled = False  # (these rows measure the per-op path)
    for label, device, strategy, fraction in ROWS[1:]:
        if fraction is not None and work.kind == "train" and base_name == "weights":
            # training's base: the peak of the no-budget run (weights, grads, AdamW state, activations)
            base_name, base = "peak of the no-budget run", measured["sim, no budget"]["peak_device_bytes"]
        budget = None if fraction is None else int(fraction * base)
        print(f"  {work.name}: {label}", flush=True)
        if device is None:
            row = floor_row(work, plain, repeats)
        else:
            row = managed_row(work, plain, repeats, device, strategy, budget)
        row.update(device=device, strategy=strategy, budget_fraction=fraction, budget=budget)
        plain_times += row.get("plain_times", [])
        measured[label] = row
    torchTensorRef.regions.enabled = previous
    if not plain_times:  # no row ran (none fits): time plain alone
        plain_times = [_seconds(plain) for _ in range(repeats)]
    plain_med = statistics.median(plain_times)
    rows = [{"row": PLAIN, "device": None, "strategy": None, "budget_fraction": None, "budget": None,
             "fits": True, "median_ms": plain_med * 1e3, "fastest_ms": min(plain_times) * 1e3, "ratio": 1.0,
             "ratio_of_fastest": 1.0, "ops": plain_ops, "us_added_per_op": 0.0, "outputs_equal": True}]
    for label, row in measured.items():
        out = {"row": label, **{k: row[k] for k in ("device", "strategy", "budget_fraction", "budget")}}
        if row.get("fits") is False:
            rows.append({**out, "fits": False, "error": row["error"]})
            continue
        med = statistics.median(row["times"])
        # against this phase's own plain runs: the machine's speed drifts between phases
        added = (med - statistics.median(row["plain_times"])) / row["ops"] * 1e6
        out.update(fits=True, median_ms=med * 1e3, fastest_ms=min(row["times"]) * 1e3, ratio=row["ratio"],
                   ratio_of_fastest=row["ratio_of_fastest"], ops=row["ops"], us_added_per_op=added,
                   outputs_equal=row["equal"])
        for key in ("bytes_moved", "peak_device_bytes", "evictions"):
            if key in row:
                out[key] = row[key]
        rows.append(out)
    out = {"work": work.name, "kind": work.kind, "param_bytes": common.param_bytes(work.model),
           "budget_base": base_name, "budget_base_bytes": base, "rows": rows}
    if regions:
        out["region_rows"] = region_rows(work, repeats, only)
    return out


def table(work: dict) -> str:
    lines = [f"{work['work']}: budgets are fractions of the {work['budget_base']} "
             f"({work['budget_base_bytes'] / common.MIB:.2f} MiB)",
             f"  {'row':<26} {'ms/run':>8} {'ratio':>7} {'fastest':>7} {'ops/run':>8} {'us/op':>6} "
             f"{'MiB moved':>9}  equal"]
    for r in work["rows"]:
        if not r["fits"]:
            lines.append(f"  {r['row']:<26} does not fit ({r['budget']} bytes)")
            continue
        moved = f"{r['bytes_moved'] / common.MIB:9.2f}" if "bytes_moved" in r else f"{'-':>9}"
        lines.append(f"  {r['row']:<26} {r['median_ms']:8.2f} {r['ratio']:7.3f} {r['ratio_of_fastest']:7.3f} "
                     f"{r['ops']:8d} {r['us_added_per_op']:6.1f} {moved}  {r['outputs_equal']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", choices=tuple(WORKS) + ("all",), default="all")
    parser.add_argument("--size", choices=tuple(SIZES), default="small",
                        help="tiny: hidden 64, 2 layers, 4 new tokens (checks the harness in seconds); "
                             "medium: the small shapes at hidden 1024")
    parser.add_argument("--layers", type=int, default=None,
                        help="the models' decoder layers (default: the size's): how deep the pager's plan looks")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per row (default: the size's)")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    parser.add_argument("--plot", help="write the plot (PNG) to this file")
    parser.add_argument("--no-regions", action="store_true", help="leave out the module regions table")
    parser.add_argument("--regions-only", action="store_true",
                        help="the module regions tables alone (the per-op rows are left out)")
    parser.add_argument("--rows", default="", metavar="TEXT",
                        help="only the module regions rows whose label contains TEXT (e.g. 'sim-cpu')")
    parser.add_argument("--lookahead", type=int, default=None, help="Flow's lookahead in the managed rows")
    parser.add_argument("--prefetch-evicts", action="store_true",
                        help="Flow may evict clean blocks needed later to prefetch (prefetch_evicts=True)")
    args = parser.parse_args(argv)
    FLOW_OPTIONS.clear()
    if args.lookahead is not None:
        FLOW_OPTIONS["lookahead"] = args.lookahead
    if args.prefetch_evicts:
        FLOW_OPTIONS["prefetch_evicts"] = True
    torch.set_num_threads(1)
    size = SIZES[args.size]
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"--layers must be a whole number of decoder layers >= 1, not {args.layers}")
        size = dict(size, llama=dict(size["llama"], layers=args.layers), gpt2=dict(size["gpt2"], layers=args.layers))
    repeats = args.repeats or size["repeats"]
    kinds = tuple(WORKS) if args.work == "all" else (args.work,)
    works = []
    # "sim" reports its own device, for which torch's attention is its math decomposition: the
    # CPU rows use it too
    with sdpa_kernel(SDPBackend.MATH):
        for kind in kinds:
            for model in WORKS[kind]:
                work = Work(model, kind, size, repeats)
                if args.regions_only:
                    works.append({"work": work.name, "kind": kind, "rows": [],
                                  "region_rows": region_rows(work, repeats, args.rows)})
                    continue
                works.append(run_work(work, repeats, regions=not args.no_regions, only=args.rows))
    result = {"torch": torch.__version__, "threads": 1, "size": args.size, "repeats": repeats, "warmup": list(WARMUP),
              "clock": "process CPU time", "tokens": size["tokens"], "prompt": size["prompt"],
              "requests": size["requests"], "flow_options": dict(FLOW_OPTIONS),
              "train_batch": [size["batch"], size["seq"]], "llama": size["llama"], "gpt2": size["gpt2"],
              "works": works}
    print(f"1 thread, torch {torch.__version__}, {repeats} repeats per row (process CPU time); ratio: median of "
          f"per-pair ratios to plain; fastest: ratio of the fastest runs; us/op: time added per op over plain")
    for work in works:
        if work["rows"]:
            print(table(work))
        if "region_rows" in work:
            print(region_table(work))
    mismatches = [(w["work"], r["row"]) for w in works for r in w["rows"] if r["fits"] and not r["outputs_equal"]]
    mismatches += [(w["work"], r["row"]) for w in works for r in w.get("region_rows", ())
                   if r.get("fits") is not False and not r["equal"]]
    result["outputs_equal"] = not mismatches
    if args.json:
        common.write_result(args.json, "benchmarks/small_ops.py", argv, "cpu (pass-through) and sim", result)
    if args.plot:
        from benchmarks import plots

        plots.small_ops(result, args.plot)
    if mismatches:
        print(f"!!! OUTPUTS DIFFER FROM PLAIN TORCH: {mismatches}", flush=True)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
