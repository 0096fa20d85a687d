"""Bytes Flow moves per training step against the offline reference and Genoa.

Trains a small GPT-2 (transformers, random init) on the simulated accelerator for a few
steps at budgets of 50% and 25% of its parameter bytes, records one steady-state step and
prints the bytes Flow moved beside the offline reference computed on that same trace
(``torchTensorRef.analysis.offline.reference_moves``) and beside Genoa.

    python benchmarks/flow_vs_reference.py [--layers 6] [--steps 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from torchTensorRef import tensorsManager as tm  # noqa: E402
from torchTensorRef.analysis.offline import reference_moves  # noqa: E402


def build(layers: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=512, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def run(strategy: str, fraction: float, layers: int, steps: int, seed: int = 0) -> dict:
    tm.device = "sim"
    tm.strategy = strategy
    tm.budget = None
    model = build(layers, seed)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    share = int(param_bytes * fraction)
    tm.budget = tm.outside_bytes() + share  # (the budget covers what is outside the manager too)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(seed + 1)
    ids = torch.randint(0, 512, (4, 32))
    losses = []

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        return out.loss.item()

    for _ in range(steps - 1):
        losses.append(step(model, opt))
    tm.reset_stats()
    start = time.perf_counter()
    with tm.recording() as trace:
        losses.append(step(model, opt))
    seconds = time.perf_counter() - start
    stats = tm.stats()
    ref = reference_moves(trace.accesses, share, trace.initial, trace.created, trace.block_bytes)
    result = {
        "strategy": strategy, "budget_fraction": fraction, "budget": share,
        "param_bytes": param_bytes, "bytes_to_device": stats["bytes_to_device"],
        "bytes_to_host": stats["bytes_to_host"], "peak_device_bytes": stats["peak_device_bytes"],
        "reference_to_device": ref["bytes_to_device"], "reference_to_host": ref["bytes_to_host"],
        "ops": stats["ops"], "prefetch_hits": stats["prefetch_hits"],
        "prefetch_misses": stats["prefetch_misses"], "step_seconds": seconds, "losses": losses,
    }
    moved = result["bytes_to_device"] + result["bytes_to_host"]
    ref_moved = result["reference_to_device"] + result["reference_to_host"]
    result["ratio_to_reference"] = moved / ref_moved if ref_moved else float("inf") if moved else 1.0
    del model, opt
    tm.budget = None
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    rows = []
    for fraction in args.fractions:
        for strategy in ("flow", "genoa"):
            rows.append(run(strategy, fraction, args.layers, args.steps))
    mib = 2**20
    print(f"GPT-2 ({args.layers} layers, n_embd 128) training step on 'sim', torch {torch.__version__}")
    print(f"{'budget':>8} {'strategy':>8} {'moved MiB':>10} {'reference MiB':>14} {'ratio':>7} {'peak<=budget':>12} "
          f"{'prefetch hit/miss':>18}")
    for r in rows:
        moved = (r["bytes_to_device"] + r["bytes_to_host"]) / mib
        ref = (r["reference_to_device"] + r["reference_to_host"]) / mib
        print(f"{r['budget_fraction']:>7.0%} {r['strategy']:>8} {moved:>10.2f} {ref:>14.2f} "
              f"{r['ratio_to_reference']:>7.3f} {str(r['peak_device_bytes'] <= r['budget']):>12} "
              f"{r['prefetch_hits']:>8}/{r['prefetch_misses']:<8}")
    for fraction in args.fractions:
        flow = next(r for r in rows if r["strategy"] == "flow" and r["budget_fraction"] == fraction)
        genoa = next(r for r in rows if r["strategy"] == "genoa" and r["budget_fraction"] == fraction)
        f_moved = flow["bytes_to_device"] + flow["bytes_to_host"]
        g_moved = genoa["bytes_to_device"] + genoa["bytes_to_host"]
        print(f"budget {fraction:.0%}: flow/reference = {flow['ratio_to_reference']:.3f} (target <= 1.10), "
              f"genoa/flow = {g_moved / f_moved:.1f}x, losses equal: {flow['losses'] == genoa['losses']}")
    result = {"torch": torch.__version__, "device": "sim", "layers": args.layers, "rows": rows}
    if args.json:
        common.write_result(args.json, "benchmarks/flow_vs_reference.py", argv, "sim", result)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
