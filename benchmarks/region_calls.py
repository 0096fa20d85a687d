"""Host time per region call: what a module region adds beyond plain torch and its copies.

A stack of ``--layers`` residual MLP blocks (LayerNorm, a Linear to four times the width,
GELU, a Linear back), each block a region of its own (``regions.region``; the stack is
not one), called on one ``--width`` vector with gradients off: a forward is ``--layers``
region calls and nothing else, so what the manager adds per call is not mixed with the
per-op path. It runs on the lenient ``"sim"`` (``tensorsManager.sim_strict = False``: its
device tensors are plain CPU tensors, so the kernels are plain CPU torch's and a copy is a
host memcpy), interleaved with plain CPU torch on the same model, on one thread, in process
CPU time. Rows:

- no budget: nothing moves;
- Flow, a budget that fits every block: nothing moves, the budget is checked;
- Flow at 50% and 25% of the weights, once it follows its plan (``flow.plan``).

Per row: ms per forward, its ratio to plain (the median of per-pair ratios), the copies'
floor (plain's time plus the bytes moved at the host's copy rate, ``common.host_copy_rate``),
and **µs per region call** beyond plain and that floor: the host work of the boundary (the
working set made resident, fetches, evictions, the strategy's choices, the plain views given
and the outputs wrapped). Also the fetches and evictions per call, the copies to the device
per call (a region's group, its tensors in one buffer, comes in with one: Note [Region
groups]; ``--no-groups`` moves every tensor alone), the MiB moved per forward, the share of the bytes
brought to the device by a prefetch issued during an earlier call, the peak against the
budget, and whether the outputs equal plain torch's (bit for bit: the same kernels). A block
whose working set does not fit the budget runs op by op: the row's ops per forward say so.

    python benchmarks/region_calls.py [--layers 8] [--width 256] [--repeats 30] [--prefetch-evicts] [--no-groups]
                                      [--json out.json]
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

import torchTensorRef  # noqa: E402
from benchmarks import common, overhead  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from torchTensorRef import regions  # noqa: E402
from torchTensorRef.memory import groups  # noqa: E402
from torchTensorRef.strategies import Flow  # noqa: E402

#: (label, budget as a fraction of the weights; None: no budget)
ROWS = (("no budget", None), ("Flow, fits (2x)", 2.0), ("Flow, 50%", 0.5), ("Flow, 25%", 0.25))
WARMUP = 6
CLOCK = time.process_time


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def stack(layers: int, width: int) -> torch.nn.Sequential:
    """The plain model (seeded)."""
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[Block(width) for _ in range(layers)]).eval()


def managed_stack(model, x, fraction, flow_options: dict, device: str = common.SIM_CPU):
    """A fresh managed copy of the stack on ``device`` (the lenient "sim" unless given) under
    Flow, each block a region (the stack is not one), its input, and the budget at
    ``fraction`` of the weights (``None``: no budget): ``(managed, managed input)``."""
    managed = common.managed_copy(model, device, "flow")
    tm.strategy = Flow(**flow_options)
    regions.no_region(managed)
    for block in managed:
        regions.region(block)
    mx = torchTensorRef.manage(x.clone())
    weights = common.param_bytes(model)
    tm.budget = None if fraction is None else tm.outside_bytes() + int(fraction * weights)
    return managed, mx


def row(model, x, plain_run, expected, fraction, repeats: int, rate: float, flow_options: dict) -> dict:
    """One row: a fresh managed copy, warmed up until Flow has settled, then timed."""
    managed, mx = managed_stack(model, x, fraction, flow_options)

    def run():
        with torch.no_grad():
            return managed(mx)

    outs = common.warm_up(run, WARMUP, 4 * WARMUP)
    tm.reset_stats()
    times, ratios = {"plain": []}, {}
    overhead.interleaved(plain_run, lambda: outs.append(run()), "managed", repeats, times, ratios, clock=CLOCK)
    stats = tm.stats()
    plain_s, managed_s = statistics.median(times["plain"]), statistics.median(times["managed"])
    calls = stats["ops"] / repeats
    moved = (stats["bytes_to_device"] + stats["bytes_to_host"]) / repeats
    into = stats["bytes_to_device"]
    result = {
        "budget_fraction": fraction, "budget": tm.budget, "ms": managed_s * 1e3, "plain_ms": plain_s * 1e3,
        "ratio": statistics.median(ratios["managed"]), "calls": calls, "bytes_moved": moved,
        "copy_floor": 1 + moved / rate / plain_s,
        "host_us_per_call": (managed_s - plain_s - moved / rate) / calls * 1e6,
        "fetches_per_call": stats["fetches"] / repeats / calls,
        "evictions_per_call": stats["evictions"] / repeats / calls,
        "copies_per_call": stats["copies_to_device"] / repeats / calls,
        "ahead": stats["bytes_prefetched_ahead"] / into if into else None,
        "peak_device_bytes": stats["peak_device_bytes"],
        "plan": getattr(tm.strategy, "plan", None) is not None, "settled": tm.strategy.settled,
        "equal": all(torch.equal(common.as_plain(o), expected) for o in outs),
    }
    return result


def fresh_row(*args) -> dict:
    """``row``, then the budget lifted and its model freed (the next row's must not share the device)."""
    try:
        return row(*args)
    finally:
        tm.budget = None
        gc.collect()


def table(rows: dict) -> str:
    lines = [f"  {'row':<16} {'ms':>6} {'plain':>6} {'ratio':>6} {'floor':>6} {'ops':>4} {'us/call':>8} {'fetch':>6} "
             f"{'evict':>6} {'copies':>6} {'MiB':>6} {'ahead':>6} {'peak/budget':>11}  plan  equal"]
    for label, r in rows.items():
        ahead = "-" if r["ahead"] is None else f"{r['ahead']:.3f}"
        peak = "-" if r["budget"] is None else f"{r['peak_device_bytes'] / r['budget']:.3f}"
        lines.append(f"  {label:<16} {r['ms']:6.3f} {r['plain_ms']:6.3f} {r['ratio']:6.3f} {r['copy_floor']:6.3f} "
                     f"{r['calls']:4.0f} {r['host_us_per_call']:8.1f} {r['fetches_per_call']:6.2f} "
                     f"{r['evictions_per_call']:6.2f} {r['copies_per_call']:6.2f} {r['bytes_moved'] / 2**20:6.2f} "
                     f"{ahead:>6} {peak:>11}  {str(r['plan']):5} {r['equal']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30, help="timed forwards per row")
    parser.add_argument("--prefetch-evicts", action="store_true", help="Flow(prefetch_evicts=True)")
    parser.add_argument("--no-groups", action="store_true", help="every tensor moves alone (no region groups)")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torchTensorRef.patch()
    model = stack(args.layers, args.width)
    with torchTensorRef.disabled():
        x = torch.randn(1, args.width)
        plain_model = common.plain_copy(model)
        with torch.no_grad():
            expected = plain_model(x)

    def plain_run():
        with torchTensorRef.disabled(), torch.no_grad():
            return plain_model(x)

    rate = common.host_copy_rate(model)
    flow_options = {"prefetch_evicts": True} if args.prefetch_evicts else {}
    previous = regions.enabled, regions.under_budget, groups.SHARE
    regions.enabled = regions.under_budget = True
    if args.no_groups:
        groups.SHARE = 0.0  # (no group is small enough beside the budget)
    try:
        rows = {label: fresh_row(model, x, plain_run, expected, fraction, args.repeats, rate, flow_options)
                for label, fraction in ROWS}
    finally:
        regions.enabled, regions.under_budget, groups.SHARE = previous
        tm.strategy, tm.device, tm.sim_strict = "flow", "cpu", True
    print(f"{args.layers} blocks of width {args.width}, one region each, batch 1, no gradients; lenient sim, "
          f"torch {torch.__version__}, 1 thread, {args.repeats} forwards per row (process CPU time)")
    print(table(rows))
    print("  floor: plain's time plus the bytes moved at the host's copy rate, as a ratio to plain")
    print("  ops: the manager's ops per forward, one per block where each runs as a region")
    print("  us/call: time a region call adds beyond plain and the copies' floor")
    print("  copies: copies to the device per call (a region's group in one); MiB: moved per forward")
    result = {"layers": args.layers, "width": args.width, "repeats": args.repeats, "host_copy_bytes_per_s": rate,
              "flow_options": flow_options, "groups": not args.no_groups, "rows": rows}
    if args.json:
        common.write_result(args.json, "benchmarks/region_calls.py", argv, "sim (lenient)", result)
    if not all(r["equal"] for r in rows.values()):
        raise SystemExit("outputs differ from plain torch")
    return result


if __name__ == "__main__":
    main()
