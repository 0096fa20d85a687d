"""What the GPU holds at a managed training step's real peak: each live allocation, largest first, and its code.

    PYTHONPATH=. python benchmarks/cuda_peak.py [--size small] [--strategy flow] [--fraction 0.5]

The step is one AdamW step of ``gpu_throughput.py``'s model, with a budget of ``fraction`` of
its weights on top of what the device holds outside the manager. The step runs after
``--warmup`` steps, under ``torch.cuda.memory._record_memory_history``. Its allocation events
are replayed to find the moment the allocator held the most, as ``max_memory_allocated``
counts it. The allocations live then are printed with the frames that made them, largest
first. This shows what a real peak above the budget is made of: the manager's blocks,
kernels' results, or tensors that the manager never saw.

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable, List, Optional, Tuple

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import MIB, tm  # noqa: E402
from benchmarks.gpu_throughput import SIZES  # noqa: E402

#: frames worth showing: this project's, the model's and the optimizer's (not torch's internals)
SHOWN = ("torchTensorRef", "transformers", "optim", "benchmarks")


def live_at_peak(entries: Iterable[dict], start: int = 0) -> Tuple[int, List[dict]]:
    """Replay allocator events (``action``, ``addr``, ``size``: those of
    ``torch.cuda.memory._snapshot()["device_traces"][device]``), from ``start`` bytes
    allocated before the first one: the most bytes allocated at once, and the ``alloc``
    events still live at that moment. A block counts from its ``alloc`` until its
    ``free_completed``: a block freed while a stream still uses it stays allocated until
    then, as ``memory_allocated`` counts it. A block allocated before the first event and
    freed after it leaves ``start`` then."""
    live: dict = {}
    now = peak = start
    at_peak: List[dict] = []
    for e in entries:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
            now += e["size"]
            if now > peak:
                peak = now
                at_peak = list(live.values())
        elif action == "free_completed":
            live.pop(e["addr"], None)
            now -= e["size"]
    return peak, sorted(at_peak, key=lambda e: -e["size"])


def where(entry: dict, depth: int = 3, shown: Tuple[str, ...] = SHOWN) -> str:
    """The innermost ``depth`` frames of an event that belong to the code worth showing."""
    frames = [f for f in entry.get("frames", ()) if any(s in f.get("filename", "") for s in shown)]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames[:depth]) or "?"


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--strategy", default="flow")
    parser.add_argument("--fraction", type=float, default=0.5, help="the budget: this fraction of the weights, "
                                                                     "on top of what is outside the manager")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the recorded one")
    parser.add_argument("--top", type=int, default=20, help="allocations to print")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"cuda_peak needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__}).")
        return 0
    size = SIZES[args.size]
    plain = common.llama(positions=size["seq"] + 8, dtype=getattr(torch, size["dtype"]), **size["model"])
    wbytes = common.param_bytes(plain)
    ids = common.plain_inputs(1, plain.config.vocab_size, size["batch"], size["seq"])
    tm.device = "cuda"
    outside = tm.outside_bytes()
    model = common.managed_copy(plain, "cuda", args.strategy)
    tm.budget = outside + int(wbytes * args.fraction)
    step = common.trainer(model, torchTensorRef.manage(ids.clone()))
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    tm.reset_stats()
    start = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    stats = tm.stats()
    device = torch.cuda.current_device()
    peak, live = live_at_peak(snapshot["device_traces"][device], start)
    print(f"{args.strategy} at {args.fraction:.0%} of {wbytes / MIB:.1f} MiB of weights: budget "
          f"{tm.budget / MIB:.1f} MiB ({outside / MIB:.1f} MiB outside the manager before the step)")
    print(f"max_memory_allocated {stats['max_memory_allocated'] / MIB:.1f} MiB; replayed peak {peak / MIB:.1f} MiB; "
          f"the manager's peak {stats['peak_device_bytes'] / MIB:.1f} MiB, worst overshoot it counted "
          f"{stats['worst_overshoot_bytes'] / MIB:.2f} MiB")
    print(f"{len(live)} allocations live at the peak (after the {start / MIB:.1f} MiB allocated before the step); "
          f"the largest:")
    for e in live[:args.top]:
        print(f"  {e['size'] / MIB:9.2f} MiB  stream {e.get('stream', 0)}  {where(e)}")
    tm.budget = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
