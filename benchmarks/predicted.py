"""Predicted step times on GPUs of a 1.1B Llama-style model, from runs on "sim".

The model has TinyLlama-1.1B's shapes (hidden 2048, MLP 5632, 32 heads, 4 KV heads,
vocabulary 32000) with random weights. Two works:

- ``decode``: batch-1 greedy ``generate()`` calls of 4 new tokens from an 8-token prompt.
  Two calls or more are warm-up (under Flow, until it follows its plan: it learns its
  period from the first call and compiles the plan once the sequence repeats); the next
  call's last two decode steps are recorded;
- ``train``: an AdamW step (forward, backward, step), batch 1 x ``--seq`` tokens, on
  ``--train-layers`` layers and a ``--train-vocab`` vocabulary: AdamW's update of a
  32000 x 2048 embedding in fp32 needs 750 MiB resident at once, more than 25% or 50% of
  the weights of a few layers. Three steps or more are warm-up (the same way), two are
  recorded.

Recording turns the fast path off, so the host time recorded is the generic path's. The
host time of an unrecorded run (the fast path, Flow's plan) is measured on the same model
16 times narrower (the same ops; 8 or 4 times where that does not fit the budget;
``host_scale``): its steps are recorded and the same steps timed unrecorded, three times
over, and the median of ``timeline.unrecorded_scale`` scales the full-width trace's host
time. At full width on "sim" the host time is a few
percent of a step and the wall time less the device work would be noise.

Rows: the run under Flow and Genoa at 25%, 50% and 100% of the weights' bytes, and from
the no-budget run the same steps predicted all-resident (no moves, none of our host time)
and, for decoding, with accelerate's ``cpu_offload`` hooks (every module's weights copied
from pageable memory before its forward). Each row is predicted on the H100 PCIe and
RTX 4090 rows of ``torchTensorRef/analysis/data/gpus.json`` (``--gpus``).

These are predictions of a model (``docs/timeline.md``), never measurements. A CPU
without fast bf16 records in fp32 and the prediction halves every byte and uses the 16-bit
peak (``predict(as_half=True)``), as a bf16 run would; ``--layers`` below 22 keeps the
shapes of each layer and has fewer of them (the result says how many).

    python benchmarks/predicted.py [--layers 22] [--train-layers 4] [--train-vocab 8000] [--seq 32]
                                   [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from torchTensorRef import predict_run
from torchTensorRef.analysis import timeline  # noqa: E402

#: TinyLlama-1.1B's shapes; ``layers`` is set per work
SHAPES = dict(hidden=2048, intermediate=5632, vocab=32000, heads=32, kv_heads=4)
TINY = dict(hidden=64, intermediate=160, vocab=256, heads=4, kv_heads=2)
FRACTIONS = (0.25, 0.5, 1.0)
LANE = {"host": "host", "compute": "comp", "host-to-device": "h2d", "device-to-host": "d2h"}
STRATEGIES = ("flow", "genoa")
#: decode: generate() calls of TOKENS new tokens (one step each: the prefill, then one per
#: token); of the recorded call, steps SKIP.. are recorded
TOKENS, SKIP = 4, 2
#: warm-up: at least this many calls (decode) or steps (training), more while Flow has no
#: plan yet, up to the second number
WARMUP = {"decode": (2, 6), "train": (3, 12)}
#: steps recorded; the host-time run records them and times them unrecorded PAIRS times
#: over, one after the other (the machine's load changes both alike), and keeps the median
RECORDED, PAIRS = 2, 3
#: the host-time run's model is this many times narrower in every width: the first of
#: these whose run fits in the same fraction of its weights
NARROW = (16, 8, 4)


def steps_of(kind: str):
    """After warm-up: (first, end) of the recorded steps, the StepRecorder's timing
    argument (the same steps of the next call, or the next steps), and how many
    ``generate()`` calls or training steps to run, with timing and without."""
    if kind == "decode":
        return (SKIP, SKIP + RECORDED), (TOKENS + SKIP, TOKENS + SKIP + RECORDED), 2, 1
    return (0, RECORDED), (RECORDED, 2 * RECORDED), 2 * RECORDED, RECORDED


def narrow(shapes: dict, factor: int) -> dict:
    """The same model ``factor`` times narrower (the same layers, heads and ops; a head
    keeps at least 2 dimensions for the rotary embedding)."""
    hidden = max(shapes["hidden"] // factor, 2 * shapes["heads"])
    ratio = hidden / shapes["hidden"]
    return dict(shapes, hidden=hidden, intermediate=max(int(shapes["intermediate"] * ratio), 2),
                vocab=max(int(shapes["vocab"] * ratio), 16))


def bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 matrices about as fast as fp32 (else: record in fp32)."""
    import time

    with torchTensorRef.disabled():
        a32, b32 = torch.rand(64, 1024), torch.rand(1024, 1024)
        times = []
        for a, b in ((a32, b32), (a32.bfloat16(), b32.bfloat16())):
            a @ b
            start = time.perf_counter()
            for _ in range(5):
                a @ b
            times.append(time.perf_counter() - start)
    return times[1] < 2 * times[0]


def record(model, kind: str, ids, strategy: str, budget, pairs: int = 0):
    """Run ``kind`` on a managed copy of ``model`` and record steady-state steps (after
    warm-up: under Flow, until it follows its plan); with ``pairs``, that many times over,
    each followed by the same steps timed unrecorded (:func:`steps_of`). The traces, the
    peak and whether Flow followed its plan at the end."""
    managed = common.managed_copy(model, "sim", strategy)
    entry = predict_run.proxy_entry_ns()
    inputs = torchTensorRef.manage(ids.clone())
    tm.budget = None if budget is None else tm.outside_bytes() + budget  # (the share given: ``budget``)
    recorded, timed, runs, runs_untimed = steps_of(kind)
    if kind == "decode":
        run = functools.partial(common.generate, managed, inputs, TOKENS)
    else:
        run = common.trainer(managed, inputs)
    least, most = WARMUP[kind]
    traces = []
    try:
        warmup = 0
        learns = strategy == "flow" and budget is not None  # (without a budget Flow makes no plan)
        while warmup < least or warmup < most and learns and not tm.strategy.settled:
            run()
            warmup += 1
        for _ in range(max(pairs, 1)):
            # (a training step ends at optimizer.step(): from the recording's start, a step
            # ending at the model's forward would leave the first backward out)
            recorder = predict_run.StepRecorder(*recorded, step_on="forward" if kind == "decode" else "optimizer",
                                                progress=open(os.devnull, "w"), timed=timed if pairs else None)
            with recorder:
                for _ in range(runs if pairs else runs_untimed):
                    run()
            recorder.trace.entry_ns = entry
            recorder.trace.warmup = warmup
            traces.append(recorder.trace)
        plan = getattr(tm.strategy, "plan", None) is not None
    finally:
        tm.budget = None
        del managed, inputs, run
        gc.collect()
    return traces, tm.stats()["peak_device_bytes"], plan


def host_scale(narrowed, kind: str, strategy: str, fraction) -> dict:
    """The factor from recorded to unrecorded host time, measured on a narrower model.

    At full width the host time is a few percent of a step on "sim" (its kernels and copies
    run on the CPU): the wall time less the device work would be noise. Host time goes per
    op, not per byte, and the narrow model runs the same ops, so there it is most of the
    step and the subtraction holds (``timeline.unrecorded_scale``). ``narrowed`` yields
    (factor, model, ids), narrowest first; the first that fits the fraction is used.
    """
    error = None
    for factor, model, ids in narrowed():
        budget = None if fraction is None else int(fraction * common.param_bytes(model))
        try:
            traces, _peak, plan = record(model, kind, ids, strategy, budget, pairs=PAIRS)
        except torchTensorRef.OutOfBudgetError as e:
            error = str(e)
            continue
        scales = [timeline.unrecorded_scale(t, RECORDED) for t in traces]
        out = {"scale": statistics.median(scales), "pairs": scales, "narrower": factor,
               "flow_plan": plan if strategy == "flow" else None}
        if not out["scale"] > 0:  # the unrecorded runs took less than the device work recorded: noise
            out.update(scale=1.0, error="no host time left in the unrecorded runs: the host time is the recording's")
        return out
    return {"scale": 1.0, "error": f"no narrower model fits ({error}): the host time is the recording's"}


def rows_of(work: str, trace, label: str, strategy, fraction, budget, gpu_names, as_half, scenario="recorded",
            plan=None, host=None):
    out = []
    scale = host["scale"] if host else 1.0
    for gpu in gpu_names:
        p = timeline.predict(trace, gpu, scenario=scenario, as_half=as_half, steps=RECORDED, host_scale=scale)
        # The same schedule of kernels and copies with no host time but the launches: what
        # the row would take if neither our code nor the program's cost anything per op.
        schedule = timeline.predict(trace, gpu, scenario=scenario, as_half=as_half, steps=RECORDED, host_scale=0)
        out.append({"work": work, "row": label, "strategy": strategy, "budget_fraction": fraction, "budget": budget,
                    "fits": True, "flow_plan": plan, "warmup": trace.warmup, "host_time": host, **p.summary(),
                    "schedule_step_seconds": schedule.step_seconds})
    return out


def run_work(work: str, layers: int, seq: int, gpu_names, half: bool, shapes: dict, vocab=None) -> dict:
    dtype = torch.bfloat16 if half else torch.float32
    if vocab is not None:
        shapes = dict(shapes, vocab=vocab)
    positions = max(seq, 64) + 8
    model = common.llama(layers=layers, positions=positions, dtype=dtype, **shapes)
    weights = common.param_bytes(model)
    vocab = model.config.vocab_size

    def inputs(vocab):
        return common.plain_inputs(1, vocab, 1, seq) if work == "train" else common.plain_inputs(2, vocab, 1, 8)

    ids = inputs(vocab)
    small = {}

    def narrowed():
        for factor in NARROW:
            if factor not in small:
                m = common.llama(layers=layers, positions=positions, dtype=dtype, **narrow(shapes, factor))
                small[factor] = (factor, m, inputs(m.config.vocab_size))
            yield small[factor]

    as_half = not half
    rows = []
    print(f"  {work}: no budget", flush=True)
    (trace,), _peak, _plan = record(model, work, ids, "flow", None)
    rows += rows_of(work, trace, "all-resident", None, None, None, gpu_names, as_half, "resident")
    if work == "decode":
        rows += rows_of(work, trace, "accelerate cpu_offload", None, None, None, gpu_names, as_half, "cpu_offload")
    del trace
    for strategy in STRATEGIES:
        for fraction in FRACTIONS:
            budget = int(fraction * weights)
            label = f"{strategy.capitalize()}, {fraction:.0%}"
            print(f"  {work}: {label}", flush=True)
            try:
                (trace,), peak, plan = record(model, work, ids, strategy, budget)
                host = host_scale(narrowed, work, strategy, fraction)
            except torchTensorRef.OutOfBudgetError as e:
                rows += [{"work": work, "row": label, "strategy": strategy, "budget_fraction": fraction,
                          "budget": budget, "fits": False, "error": str(e), "gpu": g} for g in gpu_names]
                continue
            rows += rows_of(work, trace, label, strategy, fraction, budget, gpu_names, as_half,
                            plan=plan if strategy == "flow" else None, host=host)
            del trace
    return {"work": work, "layers": layers, "vocab": shapes["vocab"], "param_bytes": weights,
            "parameters": common.parameters_text(sum(p.numel() for p in model.parameters())),
            "recorded_dtype": str(dtype).replace("torch.", ""), "predicted_dtype": "bfloat16", "rows": rows}


def table(result: dict) -> str:
    lines = []
    for work in result["works"]:
        lines.append(f"{work['work']}: {work['layers']} layers, vocabulary {work['vocab']}, "
                     f"{work['parameters']} parameters (recorded in {work['recorded_dtype']}, "
                     f"predicted as {work['predicted_dtype']}), ms per step and the busiest lane:")
        gpu_names = list(dict.fromkeys(r["gpu"] for r in work["rows"]))
        lines.append(f"  {'':24s}" + "".join(f"{g:>15s}" for g in gpu_names))
        for label in dict.fromkeys(r["row"] for r in work["rows"]):
            cells = []
            for g in gpu_names:
                r = next(r for r in work["rows"] if r["row"] == label and r["gpu"] == g)
                cells.append(f"{r['step_seconds'] * 1e3:10.2f} {LANE[r['bottleneck']]:>4s}" if r["fits"]
                             else f"{'does not fit':>15s}")
            lines.append(f"  {label:24s}" + "".join(cells))
    return "\n".join(lines)


#: the targets, all on predictions: Flow's step within this factor of its bound at
#: 25% and 50%; Flow's decode step this many times faster than cpu_offload's; Flow's
#: training step at 100% at least this fraction of all-resident's speed
TARGETS = {"flow_step_to_bound": 1.25, "flow_to_cpu_offload": 3.0, "full_budget_to_resident": 0.95}


def checks(result: dict) -> list:
    """Each target per GPU, with the figure and the busiest lane of the Flow row.

    Beside each figure, two others say where it could go: ``attainable``, the figure if
    Flow's step took the longest of its bound and the all-resident step (no runner of the
    same program on this host beats either: the all-resident step is the program's own host
    time and kernels); and ``schedule``, the figure with no host time in any row but the
    modelled launches (``schedule_step_seconds``): what Flow's copies and their overlap
    allow once per-op host costs are gone.
    """
    out = []
    for work in result["works"]:
        rows = {(r["row"], r["gpu"]): r for r in work["rows"]}
        for gpu in dict.fromkeys(r["gpu"] for r in work["rows"]):
            def row(label):
                r = rows.get((label, gpu))
                return r if r is not None and r["fits"] else None

            def check(name, flow, value, op, target, attainable, schedule):
                if value is not None:
                    met = value <= target if op == "<=" else value >= target
                    out.append({"work": work["work"], "gpu": gpu, "check": name, "value": value,
                                "target": f"{op} {target}", "met": met, "attainable": attainable,
                                "schedule": schedule, "busiest_lane": flow["bottleneck"],
                                "bound_lane": flow["bound_lane"]})

            resident = row("all-resident")
            for fraction in ("25%", "50%"):
                flow = row(f"Flow, {fraction}")
                if flow:
                    bound = flow["bound_seconds"]
                    best = max(bound, resident["step_seconds"]) if resident else bound
                    check(f"Flow {fraction}: step / bound", flow, flow["step_seconds"] / bound,
                          "<=", TARGETS["flow_step_to_bound"], best / bound, flow["schedule_step_seconds"] / bound)
                    offload = row("accelerate cpu_offload")
                    if offload:
                        check(f"Flow {fraction}: cpu_offload step / Flow step", flow,
                              offload["step_seconds"] / flow["step_seconds"], ">=", TARGETS["flow_to_cpu_offload"],
                              offload["step_seconds"] / best,
                              offload["schedule_step_seconds"] / flow["schedule_step_seconds"])
            flow = row("Flow, 100%")
            if flow and resident and work["work"] == "train":
                check("Flow 100%: all-resident step / Flow step", flow,
                      resident["step_seconds"] / flow["step_seconds"], ">=", TARGETS["full_budget_to_resident"],
                      resident["step_seconds"] / max(flow["bound_seconds"], resident["step_seconds"]),
                      resident["schedule_step_seconds"] / flow["schedule_step_seconds"])
    return out


def main(argv=None) -> dict:
    """The benchmark with module regions off: it measures traces of aten ops, and Flow's plan over them."""
    with common.regions_off():
        return _main(argv)


def _main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22, help="decoder layers for decoding (default: 22, the 1.1B)")
    parser.add_argument("--train-layers", type=int, default=4,
                        help="decoder layers for the training step (default: 4: fp32 AdamW of 22 needs ~18 GB)")
    parser.add_argument("--train-vocab", type=int, default=8000,
                        help="vocabulary for the training step (default: 8000, see above)")
    parser.add_argument("--seq", type=int, default=32, help="training tokens per step (batch 1)")
    parser.add_argument("--gpus", nargs="+", default=["h100-pcie", "rtx-4090"])
    parser.add_argument("--works", nargs="+", default=["decode", "train"], choices=("decode", "train"))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the harness in seconds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    half = bf16_is_fast()
    shapes = TINY if args.tiny else SHAPES
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    result = common.metadata(common.command_line("benchmarks/predicted.py", argv), "sim (predicted for GPUs)")
    result.update(predicted=True, bf16_recorded=half, shapes=shapes, decode_tokens_per_call=TOKENS,
                  warmup={k: {"least": a, "most": b} for k, (a, b) in WARMUP.items()}, recorded_steps=RECORDED,
                  host_time_pairs=PAIRS, host_time_narrower=NARROW,
                  note="predicted by torchTensorRef.analysis.timeline from runs on sim; not measured on a GPU",
                  works=[])
    for work in args.works:
        layers = args.layers if work == "decode" else args.train_layers
        print(f"== {work}, {layers} layers", flush=True)
        vocab = args.train_vocab if work == "train" and not args.tiny else None
        result["works"].append(run_work(work, layers, args.seq, args.gpus, half, shapes, vocab))
    result["targets"] = TARGETS
    result["checks"] = checks(result)
    print(table(result))
    print("targets (predicted):")
    for c in result["checks"]:
        print(f"  {'met ' if c['met'] else 'MISS'} {c['work']} {c['gpu']} {c['check']}: {c['value']:.3f} "
              f"(target {c['target']}; attainable {c['attainable']:.3f}, schedule alone {c['schedule']:.3f}; "
              f"busiest lane {c['busiest_lane']}, bound by {c['bound_lane']})")
    if args.json:
        common.write_json(args.json, result)
    if args.plot:
        from benchmarks import plots

        plots.predicted(result, args.plot)
    return result


if __name__ == "__main__":
    main()
