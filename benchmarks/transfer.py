"""Bytes moved per training step and per ``generate()`` call: Genoa, Flow, the offline reference, accelerate.

Small ``transformers`` models (GPT-2 and Llama, random weights) on the simulated
accelerator, at budgets of 25%, 50% and 100% of their parameter bytes. For each strategy
and budget a fresh copy of the model runs a few AdamW steps (or greedy ``generate()``
calls) to warm up; one steady-state step (call) is recorded, and the bytes the strategy
moved are printed beside what the offline reference (Belady with write-back costs,
``torchTensorRef.analysis.offline.reference_moves``) moves for that same trace.

The reference is a yardstick rather than a reachable target: it drops a block the step
created, once the trace does not use it again, for free, even while the program still holds
it (a safe pager must keep it or write it back). With blocks of different sizes Belady's
rule is not a proven optimum either, so a pager may move a little less.

Beside them: what ``accelerate.cpu_offload`` copies for the same work, counted from its
hooks (see ``benchmarks.common.AccelerateCopies``): it copies every weight to the execution
device on every forward, whatever the memory. accelerate's offload does not support
training, so for a training step only its forward copy volume is reported.

    python benchmarks/transfer.py [--quick] [--models gpt2 llama] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import MIB, tm  # noqa: E402
from torchTensorRef.core.errors import OutOfBudgetError  # noqa: E402
from torchTensorRef.analysis.offline import reference_moves  # noqa: E402

#: model and workload sizes; ``quick`` checks the harness in seconds. Of ``steps`` training
#: steps (``calls`` generate() calls) the last is recorded: Flow learns the period in the
#: first two (the first call of generate() shows it a shorter, wrong period).
SIZES = {
    "full": dict(
        gpt2=dict(layers=6, embd=128, vocab=512),
        llama=dict(layers=6, hidden=128, intermediate=344, vocab=512, heads=4, kv_heads=2),
        batch=4, seq=32, prompt=16, tokens=16, steps=4, calls=3,
    ),
    "quick": dict(
        # thin and several layers, so that every op fits in 25% of the parameter bytes
        gpt2=dict(layers=6, embd=32, vocab=128),
        llama=dict(layers=6, hidden=32, intermediate=64, vocab=128, heads=4, kv_heads=2),
        batch=2, seq=8, prompt=8, tokens=4, steps=3, calls=3,
    ),
}
STRATEGIES = ("genoa", "flow")
FRACTIONS = (0.25, 0.5, 1.0)
WORKLOADS = ("train", "generate")
FORWARD_ONLY_NOTE = ("accelerate's cpu_offload does not support training: for a training step the "
                     "bytes its hooks copy in one forward pass are reported (backward and the "
                     "optimizer step would need more)")


def build(name: str, size: dict) -> torch.nn.Module:
    positions = max(size["seq"], size["prompt"] + size["tokens"]) + 8
    if name == "gpt2":
        return common.gpt2(positions=positions, **size["gpt2"])
    if name == "llama":
        return common.llama(positions=positions, **size["llama"])
    raise ValueError(f"model must be one of 'gpt2', 'llama' (got: {name!r})")


def inputs(size: dict, vocab: int, workload: str) -> torch.Tensor:
    if workload == "train":
        return common.plain_inputs(1, vocab, size["batch"], size["seq"])
    return common.plain_inputs(2, vocab, 1, size["prompt"])


def plain_run(model: torch.nn.Module, ids: torch.Tensor, workload: str, size: dict):
    """What plain torch computes on "sim" (the kernels the managed runs use): the losses of
    every step, or the generated tokens."""
    with torchTensorRef.disabled(device="sim"):
        model = common.plain_copy(model).to(common.plain_device("sim"))
        ids = ids.to(common.plain_device("sim"))
        if workload == "train":
            step = common.trainer(model, ids)
            return [step() for _ in range(size["steps"])]
        return common.generate(model.eval(), ids, size["tokens"]).cpu()


def managed_run(plain: torch.nn.Module, ids: torch.Tensor, workload: str, strategy: str,
                fraction: float, size: dict, expected) -> dict:
    """Warm up, record one steady-state step (call), and compare with the offline reference."""
    pbytes = common.param_bytes(plain)
    model = common.managed_copy(plain, "sim", strategy)
    # (the budget covers what the device holds beside the manager too, as on a GPU: the
    # fraction is of the share left to it, which the reference gets as its capacity)
    budget = int(pbytes * fraction)
    # (garbage an earlier run left in reference cycles would read as outside now and free
    # its room to the manager once collected, past the fraction asked for)
    gc.collect()
    tm.budget = tm.outside_bytes() + budget
    mids = torchTensorRef.manage(ids.clone())
    try:
        if workload == "train":
            step = common.trainer(model, mids)
            outputs = [step() for _ in range(size["steps"] - 1)]
            tm.reset_stats()
            start = time.perf_counter()
            with tm.recording() as trace:
                outputs.append(step())
            equal = outputs == expected
        else:
            model.eval()
            for _ in range(size["calls"] - 1):
                common.generate(model, mids, size["tokens"])
            tm.reset_stats()
            start = time.perf_counter()
            with tm.recording() as trace:
                out = common.generate(model, mids, size["tokens"])
            equal = torch.equal(common.as_plain(out), expected)
        seconds = time.perf_counter() - start
        stats = tm.stats()
    finally:
        del model
        tm.budget = None
    try:
        ref = reference_moves(trace.accesses, budget, trace.initial, trace.created, trace.block_bytes)
    except OutOfBudgetError as e:  # one op needs more than the budget: no reference exists
        ref = {"bytes_to_device": None, "bytes_to_host": None, "error": str(e)}
    moved = stats["bytes_to_device"] + stats["bytes_to_host"]
    ref_moved = (None if ref["bytes_to_device"] is None
                 else ref["bytes_to_device"] + ref["bytes_to_host"])
    return {
        "strategy": strategy, "budget_fraction": fraction, "budget": budget,
        "bytes_to_device": stats["bytes_to_device"], "bytes_to_host": stats["bytes_to_host"],
        "moved": moved, "reference_to_device": ref["bytes_to_device"],
        "reference_to_host": ref["bytes_to_host"], "reference_moved": ref_moved,
        "ratio_to_reference": common.ratio(moved, ref_moved) if ref_moved else (1.0 if moved == 0 else None),
        "peak_device_bytes": stats["peak_device_bytes"],
        "within_budget": stats["peak_device_bytes"] <= budget,
        "ops": stats["ops"], "evictions": stats["evictions"],
        "prefetch_hits": stats["prefetch_hits"], "prefetch_misses": stats["prefetch_misses"],
        "equal_to_plain": bool(equal), "seconds": seconds,
    }


def accelerate_run(plain: torch.nn.Module, ids: torch.Tensor, workload: str, size: dict, expected) -> dict:
    """What ``accelerate.cpu_offload`` copies for the same work (counted from its hooks)."""
    counter = common.AccelerateCopies()
    with counter.counting(), torchTensorRef.disabled():
        model = common.offloaded_copy(plain, "cpu")
        if workload == "train":
            model.train()
            counter.reset()
            with torch.no_grad():
                model(ids, labels=ids)
            equal = None
        else:
            model.eval()
            for _ in range(size["calls"] - 1):
                common.generate(model, ids, size["tokens"])
            counter.reset()
            out = common.generate(model, ids, size["tokens"])
            equal = torch.equal(out, expected)
    return {
        "strategy": "accelerate", "budget_fraction": None, "budget": None,
        "bytes_to_device": counter.bytes, "bytes_to_host": 0, "moved": counter.bytes,
        "copies": counter.calls, "forward_only": workload == "train",
        "equal_to_plain": equal,
    }


def run(models, size: dict, fractions=FRACTIONS, strategies=STRATEGIES, workloads=WORKLOADS) -> list:
    """One row per model, workload and configuration."""
    rows = []
    for name in models:
        plain = build(name, size)
        pbytes = common.param_bytes(plain)
        vocab = plain.config.vocab_size
        for workload in workloads:
            ids = inputs(size, vocab, workload)
            expected = plain_run(plain, ids, workload, size)
            base = {"model": name, "workload": workload, "param_bytes": pbytes}
            for fraction in fractions:
                for strategy in strategies:
                    rows.append({**base, **managed_run(plain, ids, workload, strategy, fraction, size, expected)})
            acc = accelerate_run(plain, ids, workload, size, expected)
            acc["per_param_bytes"] = acc["moved"] / pbytes
            rows.append({**base, **acc})
    return rows


def _find(rows, model, workload, strategy, fraction=None):
    for r in rows:
        if (r["model"], r["workload"], r["strategy"]) == (model, workload, strategy) and \
                (fraction is None or r["budget_fraction"] == fraction):
            return r
    return None


def summary(rows) -> list:
    """Per model, workload and budget: Genoa, Flow, reference and accelerate side by side."""
    out = []
    keys = sorted({(r["model"], r["workload"], r["budget_fraction"]) for r in rows
                   if r["budget_fraction"] is not None}, key=lambda k: (k[0], k[1], -k[2]))
    for model, workload, fraction in keys:
        flow = _find(rows, model, workload, "flow", fraction)
        genoa = _find(rows, model, workload, "genoa", fraction)
        acc = _find(rows, model, workload, "accelerate")
        entry = {"model": model, "workload": workload, "budget_fraction": fraction}
        if flow:
            entry.update(flow=flow["moved"], reference=flow["reference_moved"],
                         flow_to_reference=flow["ratio_to_reference"])
        if genoa:
            entry["genoa"] = genoa["moved"]
            entry["genoa_reference"] = genoa["reference_moved"]
        if flow and genoa:
            entry["genoa_to_flow"] = common.ratio(genoa["moved"], flow["moved"])
        if acc:
            entry["accelerate"] = acc["moved"]
            entry["accelerate_forward_only"] = acc["forward_only"]
            if flow:
                entry["accelerate_to_flow"] = common.ratio(acc["moved"], flow["moved"])
        out.append(entry)
    return out


def print_table(rows, size_name: str) -> None:
    def mib(x):
        return "-" if x is None else f"{x / MIB:.2f}"

    def times(x):
        return "-" if x is None else f"{x:.2f}x"

    print(f"Bytes moved per training step (AdamW) and per generate() call on 'sim' "
          f"({size_name} sizes), torch {torch.__version__}; MiB = to device + to host")
    header = (f"{'model':>6} {'workload':>8} {'budget':>6} {'genoa':>9} {'flow':>9} {'reference':>9} "
              f"{'flow/ref':>8} {'genoa/flow':>10} {'accelerate':>10} {'acc/flow':>8}")
    print(header)
    for s in summary(rows):
        star = "*" if s.get("accelerate_forward_only") else " "
        print(f"{s['model']:>6} {s['workload']:>8} {s['budget_fraction']:>6.0%} {mib(s.get('genoa')):>9} "
              f"{mib(s.get('flow')):>9} {mib(s.get('reference')):>9} {times(s.get('flow_to_reference')):>8} "
              f"{times(s.get('genoa_to_flow')):>10} {mib(s.get('accelerate')):>9}{star} "
              f"{times(s.get('accelerate_to_flow')):>8}")
    print(f"* {FORWARD_ONLY_NOTE}")
    for r in rows:
        if r["strategy"] == "accelerate":
            eq = "" if r["equal_to_plain"] is None else f", tokens equal to plain: {r['equal_to_plain']}"
            print(f"accelerate {r['model']} {r['workload']}: {r['per_param_bytes']:.2f}x the parameter "
                  f"bytes per {'forward' if r['forward_only'] else 'call'}{eq}")
    bad = [r for r in rows if r["strategy"] != "accelerate" and not (r["equal_to_plain"] and r["within_budget"])]
    print("all managed runs equal to plain torch and within budget: " + ("yes" if not bad else f"NO: {bad}"))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models: checks the harness in seconds")
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    size_name = "quick" if args.quick else "full"
    size = SIZES[size_name]
    rows = run(args.models, size, args.fractions)
    print_table(rows, size_name)
    result = {
        **common.metadata(common.command_line("benchmarks/transfer.py", argv), "sim"),
        "sizes": size_name, "size": size, "accelerate_training_note": FORWARD_ONLY_NOTE,
        "rows": rows, "summary": summary(rows),
    }
    if args.json:
        common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
