"""An optimizer's step alone, with nothing to page and under a budget: the manager against plain torch.

A small Llama (``small_ops``' small shapes) with gradients from one backward; its AdamW step
(list kernels, ``foreach=True``) is timed alone, interleaved with the same step of a plain
copy on the same device, on one thread in process CPU time. Rows: pass-through ("cpu") and
the lenient ``"sim"`` with no budget (plain CPU torch's kernels), and the lenient ``"sim"``
under Flow with a budget of 64x the parameters' bytes (the step's parameters, gradients and
two moments, each rounded as the budget counts it, fit an eighth of it: one part) and of 2x
(they take twice the budget: the step runs in parts, each tensor brought in and written back
once a step), each with the step on plain tensors (Notes [Optimizer steps on plain tensors]
and [Optimizer steps under a budget] in ``torchTensorRef/integrations/optimizers.py``) and
op by op (``regions.enabled = False``). Per row: ms per step, the median of per-pair ratios
to plain, the manager's ops per step, the MiB it moved per step, and whether the parameters
equal plain torch's after every step (bit for bit: the same kernels on the same gradients).

    python benchmarks/optimizer_step.py [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
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
from benchmarks.small_ops import SIZES  # noqa: E402

#: (label, device, the step on plain tensors, the budget as a multiple of the parameters' bytes)
ROWS = (
    ("pass-through, one op", "cpu", True, None),
    ("pass-through, op by op", "cpu", False, None),
    ("sim-cpu, no budget, one op", common.SIM_CPU, True, None),
    ("sim-cpu, no budget, op by op", common.SIM_CPU, False, None),
    ("sim-cpu, Flow, 64x, one op", common.SIM_CPU, True, 64.0),
    ("sim-cpu, Flow, 64x, op by op", common.SIM_CPU, False, 64.0),
    ("sim-cpu, Flow, 2x, in parts", common.SIM_CPU, True, 2.0),
    ("sim-cpu, Flow, 2x, op by op", common.SIM_CPU, False, 2.0),
)
WARMUP = 3
CLOCK = time.process_time


def model_and_ids(size: dict):
    model = common.llama(positions=size["seq"] + 8, **size["llama"])
    ids = common.plain_inputs(1, model.config.vocab_size, size["batch"], size["seq"])
    return model, ids


def with_gradients(model, ids):
    """``model`` in training mode, its gradients those of one backward on ``ids``."""
    model.train()
    model(ids, labels=ids).loss.backward()
    return model


def row(model, ids, device: str, one_op: bool, steps: int, budget=None) -> dict:
    """A fresh managed copy and a plain one on ``device``, their steps timed in turn (under a
    budget of ``budget`` times the parameters' bytes, on top of what the device holds)."""
    on = common.plain_device(device)
    with torchTensorRef.disabled(device=on if on != "cpu" else None):
        plain = with_gradients(common.plain_copy(model).to(on), ids.to(on))
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=True)
    managed = common.managed_copy(model, device, "flow")
    previous = torchTensorRef.regions.enabled
    torchTensorRef.regions.enabled = one_op
    try:
        with_gradients(managed, torchTensorRef.manage(ids.clone()))
        opt = torch.optim.AdamW(managed.parameters(), lr=1e-3, foreach=True)
        if budget is not None:
            tm.budget = tm.outside_bytes() + int(budget * common.param_bytes(managed))

        def plain_step():
            with torchTensorRef.disabled(device=on if on != "cpu" else None):
                plain_opt.step()

        equal = []
        for _ in range(WARMUP):
            plain_step()
            opt.step()
        equal.append(_equal(plain, managed))
        times, ratios = {"plain": []}, {}
        tm.reset_stats()
        overhead.interleaved(plain_step, opt.step, "managed", steps, times, ratios, clock=CLOCK)
        stats = tm.stats()
        ops = stats["ops"] / steps
        moved = (stats["bytes_to_device"] + stats["bytes_to_host"]) / steps / 2**20
        equal.append(_equal(plain, managed))
        within = stats["peak_device_bytes"] <= tm.budget if budget is not None else True
    finally:
        torchTensorRef.regions.enabled = previous
        tm.budget = None
    return {"device": device, "one_op": one_op, "budget": budget, "ms": statistics.median(times["managed"]) * 1e3,
            "plain_ms": statistics.median(times["plain"]) * 1e3, "ratio": statistics.median(ratios["managed"]),
            "ops_per_step": ops, "mib_moved": moved, "within_budget": within, "equal": all(equal)}


def _equal(plain, managed) -> bool:
    return all(torch.equal(common.as_plain(p), common.as_plain(m))
               for p, m in zip(plain.parameters(), managed.parameters()))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per row")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torchTensorRef.patch()
    model, ids = model_and_ids(SIZES[args.size])
    try:
        rows = {label: row(model, ids, device, one_op, args.steps, budget) for label, device, one_op, budget in ROWS}
    finally:
        tm.strategy, tm.device, tm.sim_strict = "flow", "cpu", True
    print(f"a {args.size} Llama's AdamW step alone, torch {torch.__version__}, 1 thread, "
          f"{args.steps} steps per row (process CPU time)")
    print(f"  {'row':<30} {'ms':>7} {'plain':>7} {'ratio':>6} {'ops':>5} {'MiB':>6}  within  equal")
    for label, r in rows.items():
        print(f"  {label:<30} {r['ms']:7.2f} {r['plain_ms']:7.2f} {r['ratio']:6.3f} {r['ops_per_step']:5.0f} "
              f"{r['mib_moved']:6.2f}  {str(r['within_budget']):<6}  {r['equal']}")
    result = {"size": args.size, "steps": args.steps, "rows": rows}
    if args.json:
        common.write_result(args.json, "benchmarks/optimizer_step.py", argv, "cpu (pass-through) and sim (lenient)",
                            result)
    if not all(r["equal"] for r in rows.values()):
        raise SystemExit("parameters differ from plain torch")
    if not all(r["within_budget"] for r in rows.values()):
        raise SystemExit("a row's peak went over its budget")
    return result


if __name__ == "__main__":
    main()
