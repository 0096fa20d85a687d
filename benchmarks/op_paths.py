"""Where the microseconds of one small op go, layer by layer.

One 64x64 ``add`` is timed call by call, alternating with plain torch and the minimal Python
subclass (the floor of any ``__torch_dispatch__`` wrapper), under each of the manager's paths:

- pass-through (``"cpu"``): the fast path on host copies;
- ``"sim"``, no budget / a budget that fits: the fast path on device copies, with the room
  check (the output-size estimate) under a budget;
- ``"sim"``, Flow following its plan: the fast path plus Flow's ``fast_op`` hooks, once
  something had to be evicted (Flow sees every op from then on);
- ``"sim"``, the generic path: a strategy that sees every op (the base class);
- ``"sim"``, Flow learning: the generic path plus Flow's learning (``Flow(plan=False)``).

The differences between rows are what each layer costs. ``--profile`` adds a cProfile of the
plan row: the package's functions by their own time.

    python benchmarks/op_paths.py [--calls N] [--profile] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.overhead import MinimalWrapper, alternating_add_us  # noqa: E402
from torchTensorRef import tensorsManager as tm  # noqa: E402
from torchTensorRef.strategies import Flow, Strategy  # noqa: E402

KIB = 1024
SIDE = 64  # a 64x64 float32 tensor: 16 KiB


def _fits(device, strategy, budget):
    def setup():
        tm.device, tm.strategy, tm.budget = device, strategy(), budget
    return setup


def _paging(strategy):
    """Flow once paging began: three fillers cycled with room for two and a half of them."""
    def setup():
        tm.device, tm.strategy = "sim", strategy()
        # The budget is absolute: what earlier code still holds on the device outside the
        # manager must not squeeze the row into splitting its op (x and the result fit)
        tm.budget = tm.outside_bytes() + 5 * SIDE * SIDE * 2
        fillers = [torch.zeros(SIDE, SIDE) for _ in range(3)]
        for _ in range(3):
            for f in fillers:
                f.add_(1)
        assert tm.under_pressure
        return fillers  # kept alive while the row runs
    return setup


ROWS = (
    ("pass-through", _fits("cpu", Flow, None)),
    ("sim, no budget", _fits("sim", Flow, None)),
    ("sim, a budget that fits", _fits("sim", Flow, "1GiB")),
    ("sim, Flow following its plan", _paging(Flow)),
    ("sim, generic path", _fits("sim", Strategy, "1GiB")),
    ("sim, Flow learning", _paging(lambda: Flow(plan=False))),
)


def row_us(setup, calls: int) -> dict:
    """Median µs of one add: plain, the minimal wrapper and a TensorRef, alternating."""
    keep = setup()
    x = torch.rand(SIDE, SIDE)
    with torchTensorRef.disabled():
        y = torch.rand(SIDE, SIDE)
        w = MinimalWrapper.wrap(y.clone())
    for _ in range(200):  # warm-up: Flow finds the period and compiles its plan here
        x + x
    strategy = tm.strategy
    out = dict(zip(("plain_us", "floor_us", "managed_us"), alternating_add_us(y, w, x, calls)))
    out["plan"] = getattr(strategy, "plan", None) is not None
    out["under_pressure"] = tm.under_pressure
    del keep
    tm.budget = None
    return out


def profile_plan_row(calls: int) -> list:
    """(function, µs of own time per op) for the plan row, the package's functions only."""
    keep = ROWS[3][1]()
    x = torch.rand(SIDE, SIDE)
    for _ in range(200):
        x + x
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        x + x
    prof.disable()
    del keep
    tm.budget = None
    stats = pstats.Stats(prof).stats
    rows = [(f"{os.path.basename(file)}:{name}", tottime / calls * 1e6)
            for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.items()
            if "torchTensorRef" in file]
    return sorted(rows, key=lambda r: -r[1])[:12]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--profile", action="store_true", help="also profile the plan row (cProfile)")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    # (the paths as they run: reading the device after every op keeps ops off the fast path)
    checking, tm.check_device = tm.check_device, False
    try:
        return _measure(args, argv)
    finally:
        tm.check_device = checking


def _measure(args, argv) -> dict:
    torch.set_num_threads(1)
    torchTensorRef.patch()
    # The rows' budgets are absolute and cover what the device holds outside the manager:
    # device tensors that earlier code left in reference cycles must be freed first
    gc.collect()
    rows = {}
    for label, setup in ROWS:
        rows[label] = row_us(setup, args.calls)
    tm.strategy, tm.device = "flow", "cpu"
    print(f"one {SIDE}x{SIDE} add, median of {args.calls} calls, torch {torch.__version__}, 1 thread")
    print(f"  {'row':32} {'us/op':>7} {'added':>7} {'over floor':>10} {'over row above':>14}")
    previous = None
    for label, r in rows.items():
        added = r["managed_us"] - r["plain_us"]
        over_floor = r["managed_us"] - r["floor_us"]
        step = "" if previous is None else f"{added - previous:+14.2f}"
        flags = " (plan)" if r["plan"] else ""
        print(f"  {label:32} {r['managed_us']:7.2f} {added:7.2f} {over_floor:10.2f} {step:>14}{flags}")
        previous = added
    floor = statistics.median(r["floor_us"] - r["plain_us"] for r in rows.values())
    print(f"  the minimal subclass adds {floor:.2f} us to plain torch's "
          f"{statistics.median(r['plain_us'] for r in rows.values()):.2f} us")
    result = {"calls": args.calls, "rows": rows, "floor_added_us": floor}
    if args.profile:
        result["profile_plan_row"] = profile_plan_row(args.calls)
        print("  plan row, own time per op under cProfile (inflated by the profiler):")
        for name, us in result["profile_plan_row"]:
            print(f"    {us:6.2f} us  {name}")
    if args.json:
        common.write_result(args.json, "benchmarks/op_paths.py", argv, "cpu (pass-through) and sim", result)
    return result


if __name__ == "__main__":
    main()
