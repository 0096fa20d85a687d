"""A training step with nothing to move, part by part, against plain torch.

A Llama (``--layers`` of ``--width``, random weights) takes AdamW steps (the list kernels) on
``--batch`` x ``--seq`` tokens twice in one process: in plain torch (``disabled()``, on the
plain device: the CPU for the lenient ``"sim"``) and managed with no budget on ``--device``.
The two alternate step by step, so that what else loads the machine slows both alike. Each
part of a step (``zero_grad``, the forward and its loss, ``backward``, the optimizer's
``step``) is timed with the device synchronized after it; the table gives, per part, the
minimum and the median over ``--steps`` steps of each, what the managed one adds (medians) and
their ratio, and the manager's ops per step (a region is one). The losses of the two are
checked equal bit for bit: the same kernels run in the same order.

With small widths the kernels are short and the host's work shows, as on a GPU, where the
host queues kernels and does not wait for them.

    python benchmarks/train_parts.py [--device sim-cpu|cuda] [--layers 8] [--width 64]
                                     [--batch 1] [--seq 16] [--steps 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402

SCRIPT = "benchmarks/train_parts.py"
PARTS = ("zero_grad", "forward", "backward", "step")


def parts_of(model, ids, opt, sync: Callable[[], None]) -> tuple:
    """One training step: the seconds of each of ``PARTS``, and its loss."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    sync()
    t1 = time.perf_counter()
    loss = model(ids, labels=ids).loss
    sync()
    t2 = time.perf_counter()
    loss.backward()
    sync()
    t3 = time.perf_counter()
    opt.step()
    sync()
    t4 = time.perf_counter()
    return (t1 - t0, t2 - t1, t3 - t2, t4 - t3), loss.item()


def summarize(plain: List[tuple], managed: List[tuple]) -> Dict[str, dict]:
    """Per part and for the whole step: minimum and median of each side (ms), what the managed
    side adds (medians, ms) and its ratio to plain."""
    out = {}
    for i, name in enumerate(PARTS + ("step total",)):
        p = [sum(s) if i == len(PARTS) else s[i] for s in plain]
        m = [sum(s) if i == len(PARTS) else s[i] for s in managed]
        pm, mm = statistics.median(p), statistics.median(m)
        out[name] = {"plain_min_ms": min(p) * 1e3, "plain_median_ms": pm * 1e3, "managed_min_ms": min(m) * 1e3,
                     "managed_median_ms": mm * 1e3, "added_ms": (mm - pm) * 1e3, "ratio": mm / pm if pm else None}
    return out


def run(args) -> dict:
    cuda = args.device.startswith("cuda")
    plain_device = args.device if cuda else common.plain_device(args.device)
    heads = max(args.width // 16, 1)
    model = common.llama(args.layers, args.width, 2 * args.width, args.vocab, heads, heads, args.seq + 8)
    ids = common.plain_inputs(0, args.vocab, args.batch, args.seq)
    previous = (tm.device, tm.strategy, tm.budget)
    try:
        managed = common.managed_copy(model, args.device, "flow")
        with torchTensorRef.disabled():
            plain = common.plain_copy(model).to(plain_device)
            plain_ids = ids.to(plain_device)
            plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, foreach=True)
        managed_ids = torchTensorRef.manage(ids.clone())
        managed_opt = torch.optim.AdamW(managed.parameters(), lr=1e-3, foreach=True)
        sync_plain = (lambda: torch.cuda.synchronize(plain_device)) if cuda else (lambda: None)

        def plain_step():
            with torchTensorRef.disabled():
                return parts_of(plain, plain_ids, plain_opt, sync_plain)

        def managed_step():
            return parts_of(managed, managed_ids, managed_opt, tm.synchronize)

        timed_plain, timed_managed, losses = [], [], {"plain": [], "managed": []}
        ops = 0
        for i in range(args.warmup + args.steps):
            p, lp = plain_step()
            before = tm.stats()["ops"]
            m, lm = managed_step()
            losses["plain"].append(lp)
            losses["managed"].append(lm)
            if i >= args.warmup:
                timed_plain.append(p)
                timed_managed.append(m)
                ops += tm.stats()["ops"] - before
    finally:
        tm.budget = None
        tm.device, tm.strategy = previous[0], previous[1]
        tm.budget = previous[2]
    return {"model": {"layers": args.layers, "width": args.width, "vocab": args.vocab,
                      "parameters": sum(p.numel() for p in model.parameters())},
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "parts": summarize(timed_plain, timed_managed), "manager_ops_per_step": ops / max(args.steps, 1),
            "losses": losses, "losses_equal": losses["plain"] == losses["managed"]}


def print_table(result: dict, device: str) -> None:
    m = result["model"]
    print(f"Llama, {m['layers']} layers of {m['width']} ({common.parameters_text(m['parameters'])} parameters), "
          f"batch {result['batch']} x {result['seq']}, AdamW, no budget on {device}; "
          f"{result['steps']} steps each, alternating")
    print(f"{'part':<11} {'plain min':>10} {'median':>8} | {'managed min':>11} {'median':>8} | "
          f"{'added':>8} {'ratio':>6}   (ms)")
    for name, r in result["parts"].items():
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        print(f"{name:<11} {r['plain_min_ms']:>10.2f} {r['plain_median_ms']:>8.2f} | {r['managed_min_ms']:>11.2f} "
              f"{r['managed_median_ms']:>8.2f} | {r['added_ms']:>+8.2f} {ratio:>6}")
    print(f"manager ops per step: {result['manager_ops_per_step']:.0f}; "
          f"losses {'equal to plain torch bit for bit' if result['losses_equal'] else 'DIFFER from plain torch'}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=common.SIM_CPU, help='"sim-cpu" (the lenient "sim") or "cuda"')
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the result to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.layers < 1 or args.width < 16:
        parser.error("--steps and --layers must be at least 1, --warmup at least 0, --width at least 16")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    result = run(args)
    print_table(result, args.device)
    if args.json:
        common.write_result(args.json, SCRIPT, argv, args.device, result)
    return result


if __name__ == "__main__":
    torch.set_num_threads(1)  # (one thread, as the other CPU rows: kernels alike for both sides)
    main()
