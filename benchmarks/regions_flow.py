"""What Flow learns when module calls are regions: ``generate()`` calls of different prompt lengths.

A random-weight Llama of ``--layers`` (4 by default) of hidden ``--width`` (256 by default, the
``small`` size of ``small_ops.py``; its MLP twice as wide) on
``"sim"`` under Flow at ``--fraction`` of its weights runs greedy ``generate()`` six times,
each with a different prompt length (8, 11, 5, 9, 13, 7 tokens) and number of new tokens
(16, 12, 20, 16, 9, 14), as real serving does, with module regions on and then off (a fresh
copy each). Flow should learn the period of one decode step and keep it across calls. After each
call it prints the ops the manager counted, Flow's period (in ops) and whether Flow follows a compiled plan, and the
bytes moved and evictions of that call. Every call is recorded (a recorded ``generate()``
runs its own loop op by op, its model's calls as regions, so that the trace has every op: a
call recorded after unrecorded ones would be a loop Flow has not seen), and the last call's
bytes are compared with the offline reference on its trace (at region granularity where regions are
on: ``tensorsManager.recording(regions=True)``), and with regions also at the granularity
of their groups (a region's tensors moved as one: ``reference_moves(..., groups=trace.groups)``,
Note [Region groups]), and in groups with room for the next op's blocks while each op runs
(``ahead=1``: what a pager whose copies overlap compute needs). A decode step is the ops of one token: with
regions, one op per region plus ``generate()``'s own ops.

Where the device counts allocations as CUDA's allocator does (``tensorsManager.sim_rounding``),
the manager keeps room for the allocator's slack beside what it holds (Note [Room for the
allocator's slack]); the group reference is then also computed within the share less that
margin (``to_margin_reference``): what a pager of groups keeping the same margin could move.

    python benchmarks/regions_flow.py [--fraction 0.5] [--layers 4] [--width 256] [--regions-only]
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from torchTensorRef.analysis.offline import reference_moves  # noqa: E402

PROMPTS = (8, 11, 5, 9, 13, 7)
TOKENS = (16, 12, 20, 16, 9, 14)


def to_reference(trace, share: int, moved: int, groups=None, ahead: int = 0):
    """``moved`` as a ratio to the offline reference's bytes on ``trace`` within ``share``
    (``groups``: at their granularity; ``ahead``: room for the next ops' blocks too);
    ``None`` where the reference moves nothing."""
    ref = reference_moves(trace.accesses, share, trace.initial, trace.created, trace.block_bytes, groups, ahead)
    ref_moved = ref["bytes_to_device"] + ref["bytes_to_host"]
    return moved / ref_moved if ref_moved else None


def run(model, fraction: float, regions: bool) -> list:
    previous = torchTensorRef.regions.enabled, torchTensorRef.regions.under_budget
    torchTensorRef.regions.enabled = torchTensorRef.regions.under_budget = regions
    try:
        managed = common.managed_copy(model, "sim", "flow").eval()
        share = int(fraction * common.param_bytes(model))
        tm.budget = tm.outside_bytes() + share  # (the budget covers what is outside the manager too)
        flow = tm.strategy
        rows = []
        for i, n in enumerate(PROMPTS):
            ids = torchTensorRef.manage(common.plain_inputs(i, model.config.vocab_size, 1, n))
            tm.reset_stats()
            last = i == len(PROMPTS) - 1
            # (regions as regions: the offline reference at their granularity)
            with tm.recording(regions=regions) as trace:
                common.generate(managed, ids, TOKENS[i])
            s = tm.stats()
            moved = s["bytes_to_device"] + s["bytes_to_host"]
            row = dict(prompt=n, tokens=TOKENS[i], ops=s["ops"], period=flow.period, plan=flow.plan is not None,
                       mib_moved=moved / common.MIB, evictions=s["evictions"], to_reference=None,
                       to_group_reference=None, to_overlap_reference=None, to_margin_reference=None, groups=0,
                       share=share, slack=tm.accounting.slack)
            if last:
                row["to_reference"] = to_reference(trace, share, moved)
                row["groups"] = len(trace.groups)
                if regions:
                    row["to_group_reference"] = to_reference(trace, share, moved, trace.groups)
                    row["to_overlap_reference"] = to_reference(trace, share, moved, trace.groups, ahead=1)
                    if 0 < row["slack"] < share:
                        row["to_margin_reference"] = to_reference(trace, share - row["slack"], moved, trace.groups)
            rows.append(row)
        tm.budget = None
        return rows
    finally:
        torchTensorRef.regions.enabled, torchTensorRef.regions.under_budget = previous


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fraction", type=float, default=0.5, help="budget as a fraction of the weights")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--width", type=int, default=256, help="hidden size (a multiple of 64)")
    parser.add_argument("--regions-only", action="store_true", help="leave out the per-op run")
    args = parser.parse_args(argv)
    if args.width < 64 or args.width % 64:
        parser.error(f"--width must be a positive multiple of 64 (got {args.width})")
    torch.set_num_threads(1)
    model = common.llama(layers=args.layers, hidden=args.width, intermediate=2 * args.width, vocab=1000,
                         heads=args.width // 64, kv_heads=args.width // 64, positions=96)
    result = {}
    for regions in (True,) if args.regions_only else (True, False):
        label = "regions" if regions else "per op"
        result[label] = run(model, args.fraction, regions)
        print(f"Flow at {args.fraction:.0%} of the weights, {label}:")
        for r in result[label]:
            ratio = "" if r["to_reference"] is None else f"  moved/offline reference {r['to_reference']:.3f}"
            if r["to_group_reference"] is not None:
                ratio += f", in groups {r['to_group_reference']:.3f}, and copying a call ahead " \
                         f"{r['to_overlap_reference']:.3f}"
            if r["to_margin_reference"] is not None:
                ratio += f"; in groups within the share less the slack margin " \
                         f"({r['slack'] / common.MIB:.1f} of {r['share'] / common.MIB:.1f} MiB) " \
                         f"{r['to_margin_reference']:.3f}"
            print(f"  prompt {r['prompt']:2d}, {r['tokens']:2d} new: ops {r['ops']:6d}  period {r['period']}  "
                  f"plan {r['plan']}  "
                  f"MiB moved {r['mib_moved']:6.1f}  evictions {r['evictions']}{ratio}")
        if result[label][-1]["groups"]:
            print(f"  (the last call's trace: {result[label][-1]['groups']} tensors read in region groups)")
    return result


if __name__ == "__main__":
    main()
