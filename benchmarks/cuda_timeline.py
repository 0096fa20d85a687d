"""Where a call's time goes on a GPU: kernels, copies, their overlap, and the host's waits.

``gpu_throughput.py`` measures a run's time against its bound (plain torch's time, or its
bytes over the pinned bandwidth); this says what fills the gap. The model and workloads of
``gpu_throughput.py`` (``--size``: ``small`` by default, 8 layers of width 1024 in bfloat16):
greedy ``generate()`` calls and AdamW training steps, all resident in plain torch, managed
with no budget, and under Flow (``--strategy``) at ``--fractions`` of the weights on top of
what the device holds outside the manager. Each row is warmed up until the strategy has
settled (as ``gpu_throughput.py`` does), then ``--calls`` calls are recorded with
``torch.profiler`` (CPU and CUDA activities), the device synchronized after each. From what
the profiler saw, per call (ms):

- wall: the host's time of the call, the device synchronized after it;
- kernels: the time some kernel ran, on any stream (the union of their intervals);
- to device / to host: the time some copy ran that way, and how many copies; ``pageable``
  counts those from or to pageable host memory (the copy's kind, in its name), for which
  the host waits;
- under kernels: the time a copy to or from the device ran while a kernel did: what paging
  needs to cost no time;
- idle: the wall time during which the device ran nothing (no kernel, copy or fill): what the
  host's own work and its waits cost the device;
- host waits: the CUDA runtime calls that block the host (synchronizations of a stream, an
  event or the device, synchronous copies, allocations and frees of device or pinned
  memory): their count and ms, by name, and the runtime calls that took the most time.

``--trace DIR`` also writes each row's profile as a Chrome trace (``DIR/<row>.json``). The
manager's counters (bytes moved, fetches on demand, prefetches, host waits it counted) are
printed beside each managed row. ``--host-profile N`` then runs each row's calls once more
under ``cProfile`` and gives where the host's own time went per call: by area (each of the
package's layers, torch's Python, transformers, torch's C calls: its kernels' launches and
copies) and the ``N`` functions with the most (the profiler's cost per function call
included: compare rows of one run, not with the wall times). Where the device is idle, this
says what the host did instead.

    PYTHONPATH=. python benchmarks/cuda_timeline.py [--size small] [--fractions 0.5] [--calls 2]
                                                    [--workloads generate train] [--trace DIR]
                                                    [--host-profile 15] [--json out.json]
    PYTHONPATH=. python benchmarks/cuda_timeline.py --device sim --size tiny   # the harness, no GPU

On ``"sim"`` there is no device activity: every device figure reads 0 and the wall times are
the host's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from benchmarks.gpu_throughput import SIZES, WORKLOADS, Device  # noqa: E402

SCRIPT = "benchmarks/cuda_timeline.py"
#: CUDA runtime and driver calls that block the host until the device (or a stream) gets
#: somewhere, or that allocate or free memory (a device free synchronizes the device)
BLOCKING = frozenset((
    "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpy2D",
    "cudaMalloc", "cudaFree", "cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister",
    "cudaHostUnregister", "cudaMemset", "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize",
    "cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuMemFreeHost", "cuMemcpyHtoD", "cuMemcpyDtoH"))
#: runtime calls the table names beside the blocking ones
TOP_RUNTIME = 6
COUNTERS = ("bytes_to_device", "bytes_to_host", "fetches", "bytes_on_demand", "prefetches", "prefetch_hits",
            "evictions", "writebacks", "host_syncs", "ops")


class Event(NamedTuple):
    """One thing the profiler saw: ``kind`` (``kernel``, ``to_device``, ``to_host``,
    ``copy`` (device to device, or of another kind), ``fill``, ``runtime`` or ``other``), its
    name, and its start and end on the profiler's clock (ns)."""
    kind: str
    name: str
    start: int
    end: int


def classify(name: str, on_device: bool) -> str:
    """The kind of an event named ``name``, seen on the device or on the host."""
    if on_device:
        if name.startswith("Memcpy"):
            if "HtoD" in name:
                return "to_device"
            if "DtoH" in name:
                return "to_host"
            return "copy"
        if name.startswith("Memset"):
            return "fill"
        return "kernel"
    # (runtime calls are named cuda..., driver calls cu... with a capital: cuMemAlloc_v2)
    return "runtime" if name.startswith("cuda") or name[:2] == "cu" and name[2:3].isupper() else "other"


def from_profiler(prof) -> List[Event]:
    """The events of a ``torch.profiler.profile`` that has stopped."""
    cuda = torch.autograd.DeviceType.CUDA
    out = []
    for e in prof.profiler.kineto_results.events():
        name = e.name()
        start = e.start_ns()
        out.append(Event(classify(name, e.device_type() == cuda), name, start, start + e.duration_ns()))
    return out


def merged(intervals: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """``intervals`` as disjoint sorted intervals covering the same time."""
    out: List[List[int]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: Sequence[Tuple[int, int]]) -> int:
    """Total time of disjoint ``intervals``."""
    return sum(e - s for s, e in intervals)


def overlap(a: Sequence[Tuple[int, int]], b: Sequence[Tuple[int, int]]) -> int:
    """Time both of two lists of disjoint sorted intervals cover."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: Sequence[Event], wall_ns: int, calls: int) -> dict:
    """Per call, in ms: the device's busy times by kind, their overlap, its idle time within
    ``wall_ns`` (the recorded calls' wall time), and the host's waits in the runtime."""
    by_kind: Dict[str, List[Tuple[int, int]]] = {}
    for e in events:
        by_kind.setdefault(e.kind, []).append((e.start, e.end))
    spans = {k: merged(v) for k, v in by_kind.items()}
    kernels = spans.get("kernel", [])
    copies = merged(spans.get("to_device", []) + spans.get("to_host", []))
    busy = merged(kernels + copies + spans.get("copy", []) + spans.get("fill", []))
    per = 1e-6 / calls
    runtime: Dict[str, List[float]] = {}
    for e in events:
        if e.kind == "runtime":
            entry = runtime.setdefault(e.name, [0, 0.0])
            entry[0] += 1
            entry[1] += e.end - e.start
    waits = {name: {"count": n / calls, "ms": ns * per} for name, (n, ns) in runtime.items()
             if name.removesuffix("_v2") in BLOCKING}
    top = sorted(runtime.items(), key=lambda kv: -kv[1][1])[:TOP_RUNTIME]
    return {
        "wall_ms": wall_ns * per,
        "kernels_ms": length(kernels) * per,
        "to_device_ms": length(spans.get("to_device", [])) * per,
        "to_host_ms": length(spans.get("to_host", [])) * per,
        "copies_to_device": len(by_kind.get("to_device", [])) / calls,
        "copies_to_host": len(by_kind.get("to_host", [])) / calls,
        "pageable_copies": sum(1 for e in events if e.kind in ("to_device", "to_host") and "Pageable" in e.name)
        / calls,
        "copies_under_kernels_ms": overlap(copies, kernels) * per,
        "idle_ms": max(wall_ns - length(busy), 0) * per,
        "host_waits": waits,
        "runtime_top": {name: {"count": n / calls, "ms": ns * per} for name, (n, ns) in top},
    }


def recorded(dev: Device, call: Callable[[], object], calls: int, trace: Optional[str]) -> dict:
    """``calls`` calls of ``call`` under the profiler, summarized (:func:`summarize`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    dev.sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
            dev.sync()
        wall = time.perf_counter_ns() - start
    if trace:
        prof.export_chrome_trace(trace)
    return summarize(from_profiler(prof), wall, calls)


def host_profiled(dev: Device, call: Callable[[], object], out: dict, args) -> dict:
    """``out`` with, under ``--host-profile``, where the host's time went in ``--calls`` more
    calls (``host``: ``common.host_profile`` per call)."""
    if args.host_profile:
        out["host"] = common.host_profile(call, args.calls, args.calls, args.host_profile, dev.sync)
    return out


def rows_of(args) -> List[Tuple[str, Optional[float]]]:
    """(label, budget fraction): plain torch resident, managed with no budget, then each fraction."""
    return ([("resident", None), (f"{args.strategy}, no budget", None)]
            + [(f"{args.strategy} {f:.0%}", f) for f in args.fractions])


def caller(model, ids: torch.Tensor, workload: str, tokens: int) -> Callable[[], object]:
    """One call of ``workload``: an AdamW step (``common.trainer``) or a greedy ``generate()``."""
    if workload == "train":
        return common.trainer(model, ids)
    return lambda: common.generate(model, ids, tokens)


def run_row(dev: Device, plain, ids: torch.Tensor, size: dict, label: str, fraction: Optional[float],
            workload: str, args, outside: int) -> dict:
    """One row: its calls warmed up, then recorded."""
    trace = os.path.join(args.trace, f"{workload}-{label.replace(' ', '_').replace('%', 'pct')}.json") \
        if args.trace else None
    if label == "resident":
        with torchTensorRef.disabled(device=None if dev.cuda else dev.name):
            model = common.plain_copy(plain).to(dev.name)
            model.train(workload == "train")
            call = caller(model, ids.to(dev.name), workload, size["tokens"])
            common.warm_up(call, 2, 2)
            return {"row": label, "workload": workload,
                    **host_profiled(dev, call, recorded(dev, call, args.calls, trace), args)}
    model = common.managed_copy(plain, dev.name, args.strategy)
    budget = None if fraction is None else outside + int(fraction * common.param_bytes(plain))
    tm.budget = budget
    try:
        model.train(workload == "train")
        call = caller(model, torchTensorRef.manage(ids.clone()), workload, size["tokens"])
        settle = size["settle_steps"] if workload == "train" else size["settle_calls"]
        common.warm_up(call, 2, settle)
        tm.reset_stats()
        out = recorded(dev, call, args.calls, trace)
        stats = tm.stats()
        out["counters"] = {k: stats[k] / args.calls for k in COUNTERS}
        out["settled"] = tm.strategy.settled
        return {"row": label, "workload": workload, "budget": budget, **host_profiled(dev, call, out, args)}
    finally:
        tm.budget = None
        model = call = None  # (its blocks go before the next row's)
        dev.free()


def print_row(r: dict) -> None:
    print(f"  {r['row']:<16} wall {r['wall_ms']:8.2f}  kernels {r['kernels_ms']:8.2f}  "
          f"to device {r['to_device_ms']:7.2f} ({r['copies_to_device']:.0f})  "
          f"to host {r['to_host_ms']:7.2f} ({r['copies_to_host']:.0f})  pageable {r['pageable_copies']:.0f}  "
          f"under kernels {r['copies_under_kernels_ms']:7.2f}  idle {r['idle_ms']:8.2f}")
    waits = ", ".join(f"{k} {v['count']:.0f}x {v['ms']:.2f}" for k, v in sorted(r["host_waits"].items()))
    print(f"    host waits: {waits or 'none'}")
    top = ", ".join(f"{k} {v['count']:.0f}x {v['ms']:.2f}" for k, v in r["runtime_top"].items())
    if top:
        print(f"    runtime, most time: {top}")
    if "counters" in r:
        c = r["counters"]
        print(f"    manager: {(c['bytes_to_device'] + c['bytes_to_host']) / common.MIB:.1f} MiB moved, "
              f"{c['fetches']:.0f} fetches ({c['bytes_on_demand'] / common.MIB:.1f} MiB on demand), "
              f"{c['prefetch_hits']:.0f} of {c['prefetches']:.0f} prefetches used, {c['evictions']:.0f} evictions, "
              f"{c['host_syncs']:.0f} host waits counted, {c['ops']:.0f} ops; settled {r['settled']}")
    host = r.get("host")
    if host:
        areas = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in host["areas"].items() if v >= 50)
        print(f"    host, own ms per call (profiled): {areas}")
        for where, ncalls, own, inclusive in host["functions"]:
            print(f"      {ncalls:8.1f} calls {own / 1e3:7.2f} own {inclusive / 1e3:8.2f} incl.  {where}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help='"cuda", "cuda:N", or "sim" to check the harness')
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--strategy", default="flow")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--calls", type=int, default=2, help="recorded calls per row")
    parser.add_argument("--trace", metavar="DIR", help="write each row's Chrome trace into DIR")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also profile each row's calls and print the host's own time by area and "
                             "the N functions with the most")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    if args.device != "sim" and not args.device.startswith("cuda"):
        parser.error(f'--device must be "cuda", "cuda:N" or "sim" (got: {args.device!r})')
    if args.calls < 1 or args.host_profile < 0 or any(not 0 < f for f in args.fractions):
        parser.error("--calls must be at least 1, --host-profile at least 0 and every fraction above 0")
    command = common.command_line(SCRIPT, argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        message = "cuda_timeline needs CUDA: torch.cuda.is_available() is False (try --device sim --size tiny)"
        print(message)
        return {**common.metadata(command, args.device), "skipped": message}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    size = SIZES[args.size]
    dev = Device(args.device)
    plain = common.llama(positions=max(size["seq"], size["prompt"] + size["tokens"]) + 8,
                         dtype=getattr(torch, size["dtype"]), **size["model"])
    vocab = plain.config.vocab_size
    ids = {"generate": common.plain_inputs(2, vocab, 1, size["prompt"]),
           "train": common.plain_inputs(1, vocab, size["batch"], size["seq"])}
    previous = (tm.device, tm.strategy, tm.budget)
    rows = []
    try:
        tm.device = dev.name
        outside = tm.outside_bytes()
        for workload in args.workloads:
            print(f"{workload}: ms per call, {args.calls} recorded ({args.size} Llama on {args.device})", flush=True)
            for label, fraction in rows_of(args):
                rows.append(run_row(dev, plain, ids[workload], size, label, fraction, workload, args, outside))
                print_row(rows[-1])
    finally:
        tm.budget = None
        tm.device, tm.strategy = previous[0], previous[1]
        tm.budget = previous[2]
    result = {**common.metadata(command, args.device), "size": args.size, "calls": args.calls, "rows": rows}
    if args.json:
        common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
