"""Throughput on a CUDA GPU: a 1B-parameter Llama under Flow, Genoa, accelerate's offload and all-resident.

A Llama-style model (random weights from ``LlamaConfig``: hidden 2048, 22 layers,
intermediate 5632, vocab 32000, about 1.1B parameters, bfloat16) is run

- all resident on the GPU (plain torch): the compute time;
- under ``accelerate.cpu_offload`` (weights on the host, copied in by its hooks);
- managed by torchTensorRef with no budget (the first strategy given), and with Flow and
  with Genoa at budgets of 25%, 50% and 100% of its weight bytes,

measuring greedy ``generate()`` tokens per second and the time of an AdamW training step,
the bytes each moved, and ``torch.cuda.max_memory_allocated`` against the budget. With the
pinned host-to-device bandwidth measured here (CUDA events around a large copy), the bound
for a run is ``max(compute time, bytes moved / bandwidth)``; the targets are printed with
the figures: Flow within 80% of the bound, at least 3x accelerate's tokens/s at the same
budget, at 100% budget at least 0.95x all-resident, with no budget at most 1.10x
all-resident's time, and a real peak within the budget + 10%.

    python benchmarks/gpu_throughput.py [--gpu NAME] [--json out.json]
    python benchmarks/gpu_throughput.py --device sim --tiny   # the same harness, no GPU

The managed rows run module calls as regions where they can (the default, training steps
too); ``--per-op`` runs them op by op, to compare the two paths on the same GPU.
Each managed ``generate()`` row reports ``manager_ops``: the ops the manager saw (a region
is one).

Each run is also predicted (``torchTensorRef.analysis.timeline``) on the row of
``torchTensorRef/analysis/data/gpus.json`` that ``torch.cuda.get_device_name()`` names (``--gpu``
for another): a strategy's from a recording of one more call or of as many steps more of
the same run, all-resident and accelerate's from a run managed without a budget. The
prediction stands beside the measurement in each row (``"predicted"``,
``"predicted_to_measured"``), so that a run on a GPU checks the model. ``--no-predict``
measures only: recording a call of the 1.1B model takes minutes on a GPU.

Without CUDA (and without ``--device sim``) it says so and exits 0. On ``"sim"`` the times
are meaningless (the "GPU" is host memory) but the bytes are real.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import MIB, tm  # noqa: E402
from torchTensorRef.analysis import gpus, timeline
from torchTensorRef import predict_run  # noqa: E402
from torchTensorRef.core.sizes import format_size  # noqa: E402
from torchTensorRef.strategies import Flow  # noqa: E402

SIZES = {
    # TinyLlama-1.1B's shape
    "full": dict(model=dict(layers=22, hidden=2048, intermediate=5632, vocab=32000, heads=32, kv_heads=4),
                 dtype="bfloat16", prompt=128, tokens=32, batch=1, seq=256, calls=3, timed_calls=2,
                 warmup_steps=3, steps=3, settle_calls=6, settle_steps=24,
                 bandwidth_bytes=1 << 30),
    # a quarter of that: every configuration runs in a few minutes on one GPU
    "small": dict(model=dict(layers=8, hidden=1024, intermediate=2816, vocab=32000, heads=16, kv_heads=4),
                  dtype="bfloat16", prompt=64, tokens=16, batch=1, seq=128, calls=3, timed_calls=3,
                  warmup_steps=2, steps=2, settle_calls=6, settle_steps=24,
                  bandwidth_bytes=256 << 20),
    # thin and several layers, so that every op fits in 25% of the weight bytes; float32,
    # because CPUs without native bfloat16 run bfloat16 matmuls tens of times slower
    "tiny": dict(model=dict(layers=6, hidden=32, intermediate=64, vocab=128, heads=4, kv_heads=2),
                 dtype="float32", prompt=8, tokens=3, batch=2, seq=8, calls=3, timed_calls=2, warmup_steps=2, steps=1,
                 settle_calls=4, settle_steps=24,
                 bandwidth_bytes=16 << 20),
}
STRATEGIES = ("flow", "genoa")
#: configurations beside the strategies' names (``--strategies``): Flow whose prefetches
#: always evict clean blocks needed later than the one they bring in, looking two ops
#: (regions) ahead, so that the next region's weights are copied while this one computes,
#: whatever the bytes; and Flow whose prefetches only fill free memory. Flow's default
#: evicts for the next op where a trial of its plan found it faster (on CUDA; on "sim",
#: costing at most 10% more bytes: Note [Evicting for the next op])
STRATEGY_SPECS = {"flow-evicting": lambda: Flow(prefetch_evicts=True, lookahead=2),
                  "flow-free": lambda: Flow(prefetch_evicts=False)}
#: the manager's counters each managed row reports, per call (generate) or per step (train)
COUNTERS = ("fetches", "prefetches", "prefetch_hits", "copies_to_device", "evictions", "writebacks", "host_syncs")
WORKLOADS = ("generate", "train")
FRACTIONS = (0.25, 0.5, 1.0)
TARGETS = {
    "flow_to_bound": 0.8,       # bound / measured time
    "flow_to_accelerate": 3.0,  # tokens/s
    "no_budget_to_resident": 1 / 1.10,  # managed with no budget: at most 1.10x all-resident's time
    "full_budget_to_resident": 0.95,
    "peak_over_budget": 1.10,
}
NEEDS_CUDA = ("gpu_throughput needs CUDA: torch.cuda.is_available() is False (torch {torch}). "
              "Run it on a machine with an NVIDIA GPU, or check the harness with "
              "`python benchmarks/gpu_throughput.py --device sim --tiny`.")
ACCELERATE_TRAINING = "not supported by accelerate's cpu_offload (it offloads for inference)"


class Device:
    """Timing, synchronization and peak memory on the GPU, or on ``"sim"`` for the harness."""

    def __init__(self, name: str):
        self.name = name
        self.cuda = name.startswith("cuda")
        self.compute = torch.device(name) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.compute)

    def timed(self, fn: Callable[[], object]):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.compute)

    def peak(self, managed: bool) -> Optional[int]:
        """The real peak: the most the device's allocator held since the stats were reset
        (on ``"sim"``, none for plain runs: their stats are not reset)."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.compute)
        return tm.stats()["max_memory_allocated"] if managed else None

    def free(self) -> None:
        gc.collect()
        tm.stats()  # releases the blocks of dead TensorRefs
        if self.cuda:
            torch.cuda.empty_cache()

    def bandwidth(self, nbytes: int, repeats: int = 5) -> dict:
        """Best host-to-device and device-to-host copy rates of a pinned ``nbytes`` buffer (bytes/s)."""
        return common.copy_rates(self.compute if self.cuda else None, self.timed, nbytes, repeats)


# -- one configuration -----------------------------------------------------------------------------

def measure_generate(dev: Device, model, ids, size: dict, moved: Callable[[], int], managed: bool,
                     predict: Optional[Callable] = None) -> dict:
    """Warm up (``calls - 1`` calls, and more until the strategy has settled, up to
    ``settle_calls``), then time ``timed_calls`` greedy ``generate()`` calls; with
    ``predict``, record one more (see :func:`predicted`)."""
    def call():
        return common.generate(model, ids, size["tokens"])

    common.warm_up(call, size["calls"] - 1, size["settle_calls"])
    moved(reset=True)
    timed = [dev.timed(call) for _ in range(size["timed_calls"])]
    out, seconds = timed[-1][0], statistics.median(t for _o, t in timed)
    calls = len(timed)
    result = {"seconds": seconds, "call_seconds": [t for _o, t in timed],
              "tokens_per_s": ids.shape[0] * size["tokens"] / seconds,
              "moved": moved() // calls, "peak": dev.peak(managed), "tokens": common.as_plain(out)}
    if managed:  # (a region is one op: the count says how much ran op by op)
        stats = tm.stats()
        result["manager_ops"] = stats["ops"] // calls
        result["counters"] = {k: stats[k] // calls for k in COUNTERS}
        result["settled"] = tm.strategy.settled
        result["evicts_ahead"] = getattr(tm.strategy, "evicts_ahead", None)
        # (whether the budget still paged after the timed calls: a generate() call is then a
        # loop with a region per layer, else one region, Note [Regions until the budget
        # pages]; and what the device held outside the manager, which the budget's share leaves)
        result["paged"] = tm.paged
        result["outside_after"] = tm.outside_bytes()
    if predict is not None:
        result["predicted"] = predict(call)
    return result


def measure_train(dev: Device, model, ids, size: dict, moved: Callable[[], int], managed: bool,
                  predict: Optional[Callable] = None) -> dict:
    """Warm up (``warmup_steps``, and more until the strategy has settled, up to
    ``settle_steps``: Flow learns a step's loop, then tries two ways of prefetching for it,
    a period a step), then time a few AdamW steps; the median step time. With ``predict``,
    record as many steps more (see :func:`predicted`)."""
    step = common.trainer(model, ids)
    losses = common.warm_up(step, size["warmup_steps"], size["settle_steps"])
    moved(reset=True)
    times = []
    for _ in range(size["steps"]):
        loss, seconds = dev.timed(step)
        losses.append(loss)
        times.append(seconds)
    result = {"seconds": statistics.median(times), "step_seconds": times,
              "moved": moved() // size["steps"], "peak": dev.peak(managed), "losses": losses}
    if managed:
        stats = tm.stats()
        result["counters"] = {k: stats[k] // size["steps"] for k in COUNTERS}
        result["settled"] = tm.strategy.settled
        result["evicts_ahead"] = getattr(tm.strategy, "evicts_ahead", None)
    if predict is not None:
        result["predicted"] = predict(step)
    del step
    return result


def predicted(dev: Device, run: Callable, workload: str, size: dict, gpu, scenarios=("recorded",)) -> dict:
    """Record ``run`` once more (a ``generate()`` call, or ``size["steps"]`` training steps)
    and predict it on ``gpu`` in each of ``scenarios``: per call or per step, beside the
    measured figure. On "sim" the same steps run once more unrecorded and timed: the host
    time comes from them (``timeline.unrecorded_scale``); on a GPU the host time is the
    recording's (the generic path: the prediction is pessimistic there)."""
    steps = size["tokens"] if workload == "generate" else size["steps"]
    calls = 1 if workload == "generate" else steps
    timing = {} if dev.cuda else dict(timed=(steps, 2 * steps))
    entry = predict_run.proxy_entry_ns()
    recorder = predict_run.StepRecorder(0, steps, step_on="forward" if workload == "generate" else "optimizer",
                                        progress=open(os.devnull, "w"), **timing)
    with recorder:
        for _ in range(calls * (2 if timing else 1)):
            run()
    trace = recorder.trace
    trace.entry_ns = entry
    out = {}
    for scenario in scenarios:
        p = timeline.predict(trace, gpu, scenario=scenario, steps=steps)
        seconds = p.step_seconds * (steps if workload == "generate" else 1)  # per call, or per step
        out[scenario] = {"gpu": p.gpu.name, "seconds": seconds, "bound_seconds": p.bound_seconds,
                         "step_seconds": p.step_seconds, "bottleneck": p.bottleneck, "bound_lane": p.bound_lane,
                         "host_unrecorded_scale": p.host_unrecorded_scale, "moved": p.bytes_to_device * steps
                         if workload == "generate" else p.bytes_to_device}
        if workload == "generate":
            out[scenario]["tokens_per_s"] = size["batch"] * size["tokens"] / seconds
    return out


def run_config(dev: Device, plain, ids: dict, size: dict, config: str, fraction: Optional[float],
               wbytes: int, gpu=None, baseline: Optional[dict] = None, outside: int = 0,
               workloads=WORKLOADS) -> dict:
    """Both workloads of one configuration: "resident", "accelerate", or a strategy at a budget.

    With ``gpu``, each workload has its prediction on that GPU beside the measured figures
    (``"predicted"``): a strategy's from a recording of the same run; "resident" and
    "accelerate" from ``baseline`` (:func:`baseline_predictions`).

    The budget is ``fraction`` of the weights on top of ``outside``, what the device holds
    outside the manager (cuBLAS's workspaces: the budget covers them, Note [Budget on CUDA])."""
    row = {"config": config, "budget_fraction": fraction, "outside_bytes": outside,
           "budget": None if fraction is None else outside + int(wbytes * fraction)}
    for workload in workloads:
        if config == "accelerate" and workload == "train":
            row[workload] = {"skipped": ACCELERATE_TRAINING}
            continue
        dev.free()
        dev.reset_peak()
        try:
            row[workload] = _run_workload(dev, plain, ids[workload], size, config, row["budget"], workload, gpu)
            scenario = {"resident": "resident", "accelerate": "cpu_offload"}.get(config)
            if scenario is not None and baseline and scenario in baseline.get(workload, {}):
                row[workload]["predicted"] = baseline[workload][scenario]
        except Exception as e:  # one failing configuration must not lose the others' figures
            traceback.print_exc()
            row[workload] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            tm.budget = None
            dev.free()
    return row


def baseline_predictions(dev: Device, plain, ids: dict, size: dict, gpu) -> dict:
    """All-resident and accelerate's ``cpu_offload`` predicted on ``gpu``, from a run managed
    without a budget (nothing moves): by workload, then scenario."""
    out = {}
    for workload in ("generate", "train"):
        scenarios = ("resident", "cpu_offload") if workload == "generate" else ("resident",)
        try:
            out[workload] = _run_workload(dev, plain, ids[workload], size, "flow", None, workload, gpu,
                                          scenarios)["predicted"]
        except Exception as e:  # the measured figures do not depend on it
            traceback.print_exc()
            out[workload] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            tm.budget = None
            dev.free()
    return out


def _run_workload(dev, plain, ids, size, config, budget, workload, gpu=None, scenarios=("recorded",)):
    measure = measure_generate if workload == "generate" else measure_train
    if config in ("resident", "accelerate"):
        counter = common.AccelerateCopies()

        def moved(reset=False):
            if reset:
                counter.reset()
            return counter.bytes

        # Resident: plain tensors of the device itself ("sim" picks other CPU kernels than the
        # CPU does, attention among them); accelerate's hooks move to the compute device.
        where = dev.name if config == "resident" else dev.compute
        with torchTensorRef.disabled(device=None if dev.cuda else dev.name), counter.counting():
            if config == "resident":
                model = common.plain_copy(plain).to(where)
            else:
                model = common.offloaded_copy(plain, where)
            model.train(workload == "train")
            result = measure(dev, model, ids.to(where), size, moved, managed=False)
        del model
        return result

    def moved(reset=False):
        if reset:
            tm.reset_stats()
        s = tm.stats()
        return s["bytes_to_device"] + s["bytes_to_host"]

    spec = STRATEGY_SPECS.get(config)
    model = common.managed_copy(plain, dev.name, config if spec is None else spec())
    tm.budget = budget
    model.train(workload == "train")
    mids = torchTensorRef.manage(ids.clone())
    def predict(run):
        return predicted(dev, run, workload, size, gpu, scenarios)

    try:
        result = measure(dev, model, mids, size, moved, managed=True, predict=predict if gpu is not None else None)
        if gpu is not None and scenarios == ("recorded",):
            result["predicted"] = result["predicted"]["recorded"]
        if not dev.cuda:
            result["peak"] = dev.peak(managed=True)  # (the recorded call's, a run like the others)
    finally:
        del model, mids
    return result


# -- the bound and the targets -------------------------------------------------------------------

def evaluate(rows: list, bandwidth: dict) -> list:
    """Bound, efficiency and each target's figure, per managed configuration and workload."""
    by = {(r["config"], r["budget_fraction"]): r for r in rows}
    resident = by.get(("resident", None), {})
    acc = by.get(("accelerate", None), {})
    checks = []
    for r in rows:
        for workload in ("generate", "train"):
            m = r.get(workload, {})
            if "seconds" in m and "seconds" in m.get("predicted", {}):
                m["predicted_to_measured"] = m["predicted"]["seconds"] / m["seconds"]
        if r["budget_fraction"] is None:
            if r["config"] in STRATEGIES or r["config"] in STRATEGY_SPECS:
                for workload in ("generate", "train"):
                    m, base = r.get(workload, {}), resident.get(workload, {})
                    if "seconds" in m and "seconds" in base:
                        m["to_resident"] = base["seconds"] / m["seconds"]
                        _equal_resident(m, base, workload)
                        checks.append(_check(f"{r['config']} no budget {workload}: vs all-resident",
                                             m["to_resident"], ">=", TARGETS["no_budget_to_resident"]))
            continue
        for workload in ("generate", "train"):
            m = r.get(workload, {})
            base = resident.get(workload, {})
            if "seconds" not in m or "seconds" not in base:
                continue
            transfer = m["moved"] / bandwidth["h2d"]
            bound = max(base["seconds"], transfer)
            m["transfer_seconds"] = transfer
            m["bound_seconds"] = bound
            m["bound_to_measured"] = bound / m["seconds"]
            m["to_resident"] = base["seconds"] / m["seconds"]
            m["peak_to_budget"] = common.ratio(m["peak"], r["budget"])
            _equal_resident(m, base, workload)
            if "seconds" in acc.get(workload, {}):
                m["to_accelerate"] = acc[workload]["seconds"] / m["seconds"]
            if r["config"] != "flow":
                continue
            name = f"flow {r['budget_fraction']:.0%} {workload}"
            checks.append(_check(f"{name}: bound / time", m["bound_to_measured"], ">=", TARGETS["flow_to_bound"]))
            if m.get("to_accelerate") is not None:
                checks.append(_check(f"{name}: tokens/s vs accelerate", m["to_accelerate"], ">=",
                                     TARGETS["flow_to_accelerate"]))
            if r["budget_fraction"] >= 1.0:
                checks.append(_check(f"{name}: vs all-resident", m["to_resident"], ">=",
                                     TARGETS["full_budget_to_resident"]))
            if m["peak_to_budget"] is not None:
                checks.append(_check(f"{name}: real peak / budget", m["peak_to_budget"], "<=",
                                     TARGETS["peak_over_budget"]))
    return checks


def _check(name: str, value: float, op: str, target: float) -> dict:
    ok = value >= target if op == ">=" else value <= target
    return {"check": name, "value": value, "target": f"{op} {target}", "met": ok}


def print_report(result: dict) -> None:
    size, bw = result["size"], result["bandwidth"]
    print(f"{result['model']} ({common.parameters_text(result['parameters'])} parameters, {size['dtype']}, "
          f"{format_size(result['weight_bytes'])} of weights) on {result['device']}, torch {result['torch']}")
    print(f"bandwidth: host to device {bw['h2d'] / 1e9:.1f} GB/s, device to host {bw['d2h'] / 1e9:.1f} GB/s "
          f"({'pinned' if bw['pinned'] else 'host memcpy'}, {bw['bytes'] / MIB:.0f} MiB)")
    if not result["device"].startswith("cuda"):
        print("on 'sim' the times are meaningless (the accelerator is host memory); the bytes are real")
    print(f"generate: batch {ids_shape(size, 'generate')}, {size['tokens']} new tokens; "
          f"train: AdamW, batch {ids_shape(size, 'train')}")
    print(f"{'config':>13} {'budget':>6} | {'tok/s':>8} {'MiB/call':>9} {'bound/t':>7} {'peak MiB':>8} | "
          f"{'s/step':>7} {'MiB/step':>9} {'bound/t':>7} {'peak MiB':>8}")

    def cell(value, spec, scale=1):
        return "-" if value is None else format(value / scale, spec)

    for r in result["rows"]:
        g, t = r.get("generate", {}), r.get("train", {})
        frac = "-" if r["budget_fraction"] is None else f"{r['budget_fraction']:.0%}"
        print(f"{r['config']:>13} {frac:>6} | {cell(g.get('tokens_per_s'), '.2f'):>8} "
              f"{cell(g.get('moved'), '.1f', MIB):>9} {cell(g.get('bound_to_measured'), '.2f'):>7} "
              f"{cell(g.get('peak'), '.1f', MIB):>8} | {cell(t.get('seconds'), '.3f'):>7} "
              f"{cell(t.get('moved'), '.1f', MIB):>9} {cell(t.get('bound_to_measured'), '.2f'):>7} "
              f"{cell(t.get('peak'), '.1f', MIB):>8}")
        for workload in ("generate", "train"):
            m = r.get(workload, {})
            if "error" in m or "skipped" in m:
                print(f"{'':>13} {workload}: {m.get('error') or m.get('skipped')}")
            elif "counters" in m:
                c = m["counters"]
                print(f"{'':>13} {workload}, per {'call' if workload == 'generate' else 'step'}: "
                      f"{c['fetches']} fetches, {c['prefetches']} prefetches ({c['prefetch_hits']} used) in "
                      f"{c['copies_to_device']} copies, "
                      f"{c['evictions']} evictions, {c['writebacks']} write-backs, {c['host_syncs']} host waits"
                      f"{'; prefetches evict ahead' if m.get('evicts_ahead') else ''}"
                      f"{'' if m.get('settled', True) else '; timed before the strategy settled'}"
                      f"{'; the budget pages' if m.get('paged') else ''}")
    if "predicted_on" in result:
        print_predictions(result, cell)
    print("targets:")
    for c in result["checks"]:
        print(f"  {'met ' if c['met'] else 'MISS'} {c['check']}: {c['value']:.3f} (target {c['target']})")


def print_predictions(result: dict, cell) -> None:
    print(f"predicted on {result['predicted_on']} (a model of each run, not measured; ratio = predicted / "
          f"measured):")
    for r in result["rows"]:
        frac = "-" if r["budget_fraction"] is None else f"{r['budget_fraction']:.0%}"
        cells = []
        for workload in ("generate", "train"):
            m = r.get(workload, {})
            p = m.get("predicted")
            if p and "seconds" in p:
                value = f"{p['tokens_per_s']:.2f} tok/s" if workload == "generate" else f"{p['seconds']:.4f} s/step"
                cells.append(f"{workload} {value} (busiest lane {p['bottleneck']}, ratio "
                             f"{cell(common.ratio(p['seconds'], m.get('seconds')), '.2f')})")
        print(f"{r['config']:>13} {frac:>6} | {'; '.join(cells) or '-'}")


def ids_shape(size: dict, workload: str) -> str:
    return f"{size['batch']}x{size['seq']}" if workload == "train" else f"1x{size['prompt']}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help='"cuda", "cuda:N", or "sim" to check the harness')
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="the model: full (TinyLlama-1.1B's shape), small, or tiny (checks the harness in seconds)")
    parser.add_argument("--tiny", action="store_true", help="the same as --size tiny")
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                        help="the managed configurations: strategy names, flow-evicting (Flow whose "
                             "prefetches always evict, two ops ahead) or flow-free (Flow whose prefetches "
                             "never evict); the first one also runs with no budget")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS),
                        help="greedy generate() calls, AdamW training steps, or both (the default)")
    parser.add_argument("--gpu", metavar="NAME", default=None,
                        help="the row of torchTensorRef/analysis/data/gpus.json (or a .json file of numbers) to "
                             "predict each run on, beside its measurement; default: the one "
                             "torch.cuda.get_device_name() names, h100-pcie on sim")
    parser.add_argument("--per-op", action="store_true",
                        help="run the managed rows op by op (torchTensorRef.regions.enabled = False), to compare "
                             "the per-op path with module regions (the default)")
    parser.add_argument("--no-predict", action="store_true",
                        help="measure only: no run recorded to predict it (recording a call of the 1.1B model "
                             "takes minutes on a GPU)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    command = common.command_line("benchmarks/gpu_throughput.py", argv)
    if args.device != "sim" and not args.device.startswith("cuda"):
        parser.error(f'--device must be "cuda", "cuda:N" or "sim" (got: {args.device!r})')
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        message = NEEDS_CUDA.format(torch=torch.__version__)
        print(message)
        return {**common.metadata(command, args.device), "skipped": message}

    size_name = "tiny" if args.tiny else args.size
    size = SIZES[size_name]
    dev = Device(args.device)
    gpu = args.gpu
    if gpu is None and not args.no_predict:
        gpu = gpus.for_device(torch.cuda.get_device_name(dev.compute)) if dev.cuda else "h100-pcie"
        if gpu is None:
            parser.error(f"--gpu: no row of {', '.join(gpus.names())} is the "
                         f"{torch.cuda.get_device_name(dev.compute)!r}: name the closest, or give a .json of numbers")
    try:
        gpu = None if args.no_predict else predict_run.load_gpu(gpu)
    except (ValueError, TypeError) as e:
        parser.error(f"--gpu: {e}")
    plain = common.llama(positions=max(size["seq"], size["prompt"] + size["tokens"]) + 8,
                         dtype=getattr(torch, size["dtype"]), **size["model"])
    wbytes = common.param_bytes(plain)
    vocab = plain.config.vocab_size
    ids = {"generate": common.plain_inputs(2, vocab, 1, size["prompt"]),
           "train": common.plain_inputs(1, vocab, size["batch"], size["seq"])}
    bandwidth = dev.bandwidth(size["bandwidth_bytes"])
    previous = (tm.device, tm.strategy, tm.budget, torchTensorRef.regions.enabled)
    configs = [("resident", None)] + ([("accelerate", None)] if "generate" in args.workloads else [])
    configs += [(args.strategies[0], None)]  # managed with no budget: the cost of managing alone
    configs += [(strategy, fraction) for fraction in args.fractions for strategy in args.strategies]
    rows = []
    try:
        torchTensorRef.regions.enabled = not args.per_op
        tm.device = dev.name
        outside = tm.outside_bytes()
        baseline = baseline_predictions(dev, plain, ids, size, gpu) if gpu is not None else {}
        for config, fraction in configs:
            rows.append(run_config(dev, plain, ids, size, config, fraction, wbytes, gpu, baseline, outside,
                                   args.workloads))
            # one line per configuration as it ends: a run cut short still says something
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("generate", "train")}
                             | {w: {k: v for k, v in rows[-1].get(w, {}).items() if k != "tokens"}
                                for w in ("generate", "train")}, default=str), flush=True)
    finally:
        tm.budget = None
        tm.device, tm.strategy = previous[0], previous[1]
        tm.budget = previous[2]
        torchTensorRef.regions.enabled = previous[3]
    checks = evaluate(rows, bandwidth)
    result = {
        **common.metadata(command, args.device),
        "model": "Llama (random init)", "parameters": sum(p.numel() for p in plain.parameters()),
        "weight_bytes": wbytes, "sizes": size_name, "size": size, "regions": not args.per_op,
        "bandwidth": bandwidth, "targets": TARGETS, "rows": rows, "checks": checks,
    }
    if gpu is not None:
        result["predicted_on"] = gpu.name
        result["predicted_note"] = ("predicted: torchTensorRef.analysis.timeline on a recording of the same run "
                                    "(docs/timeline.md), not measured")
    if not dev.cuda:
        result["note"] = "device 'sim': times are meaningless (the accelerator is host memory), bytes are real"
    print_report(result)
    for r in rows:  # the tokens were for comparisons; the losses stay
        for workload in ("generate", "train"):
            r.get(workload, {}).pop("tokens", None)
    if args.json:
        common.write_json(args.json, result)
    return result


def _equal_resident(m: dict, base: dict, workload: str) -> None:
    """Whether a managed row's tokens (``generate``) or losses (``train``: step by step, as
    far as both rows ran, a row that warmed up longer having more) are all-resident's."""
    if workload == "generate" and "tokens" in base:
        m["tokens_equal_resident"] = bool(torch.equal(m["tokens"], base["tokens"]))
    elif workload == "train" and "losses" in base and "losses" in m:
        steps = min(len(m["losses"]), len(base["losses"]))
        m["losses_equal_resident"] = m["losses"][:steps] == base["losses"][:steps]


def failed(result: dict) -> bool:
    """Whether a configuration raised (its figures are missing)."""
    return any("error" in r.get(w, {}) for r in result.get("rows", ()) for w in ("generate", "train"))


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
