"""Training under budgets below the weights: a 4-layer Llama, AdamW, clipping, a scheduler.

Trains a ``transformers`` Llama (random weights, hidden 256) on "sim" (or ``--device cuda``) for a few steps at
budgets of 100%, 50%, 25% and 10% of its weight bytes (on top of what the device holds
outside the manager), under Flow and Genoa, and prints per budget and strategy: ok or the
error, the largest |parameter difference| from plain torch on the same device, the peak device bytes
over the budget, the bytes one recorded step moved over the offline reference on that
step's trace (``torchTensorRef.analysis.offline.reference_moves``), and that step's ops and
how many of them were module regions (``--regions``: the reference is then at their granularity).

    python benchmarks/train_budget.py [--vocab 4096] [--steps 3] [--regions] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from torchTensorRef import tensorsManager as tm  # noqa: E402
from torchTensorRef.analysis.offline import reference_moves  # noqa: E402


#: ``--size small``: gpu_throughput.py's small Llama (8 layers, hidden 1024, vocab 32000), in float32
SMALL = dict(layers=8, hidden=1024, intermediate=2816, vocab=32000, heads=16, kv_heads=4)


def build(vocab: int, intermediate: int, seed: int = 0, layers: int = 4, hidden: int = 256, heads: int = 4,
          kv_heads: int = 2) -> torch.nn.Module:
    """The plain Llama (by default 4 layers, hidden 256), random weights."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
                         vocab_size=vocab, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    with torchTensorRef.disabled():
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def train(model, ids, steps: int, record_last: bool = False, regions: bool = False):
    """``steps`` AdamW steps (default foreach), clipping to norm 1 and a decaying LR; the
    trace of the last step when ``record_last`` (with module regions as regions: ``regions``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    trace = None
    for i in range(steps):
        def step():
            opt.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        if record_last and i == steps - 1:
            tm.reset_stats()
            with tm.recording(regions=regions) as trace:
                step()
        else:
            step()
    return trace


def as_plain(t):
    if isinstance(t, torchTensorRef.TensorRef):
        t = t.target
    with torchTensorRef.disabled():
        return t.detach().cpu().clone()


def run(plain, ids, reference, strategy: str, fraction: float, steps: int, device: str = "sim") -> dict:
    tm.budget = None
    tm.device = device
    tm.strategy = strategy
    with torchTensorRef.disabled():
        model = copy.deepcopy(plain)
    model = torchTensorRef.manage(model)
    wbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    share = int(fraction * wbytes)
    tm.budget = tm.outside_bytes() + share
    row = {"strategy": strategy, "fraction": fraction, "budget": tm.budget}
    try:
        trace = train(model, torchTensorRef.manage(ids.clone()), steps, record_last=True,
                      regions=torchTensorRef.regions.enabled)
        stats = tm.stats()
        # The reference pages within the manager's share: what the device held outside it
        # when the budget was set (library workspaces on CUDA, or on "sim" emulating them)
        # is not room for blocks.
        ref = reference_moves(trace.accesses, share, trace.initial, trace.created, trace.block_bytes)
        moved = stats["bytes_to_device"] + stats["bytes_to_host"]
        ref_moved = ref["bytes_to_device"] + ref["bytes_to_host"]
        row.update(ok=True, max_diff=max((as_plain(p) - r).abs().max().item()
                                         for p, r in zip(model.parameters(), reference)),
                   peak=stats["peak_device_bytes"], peak_to_budget=stats["peak_device_bytes"] / tm.budget,
                   # the device's own count (torch.cuda.max_memory_allocated on CUDA), outside bytes included
                   device_peak=stats.get("max_memory_allocated"),
                   device_peak_to_budget=stats["max_memory_allocated"] / tm.budget
                   if stats.get("max_memory_allocated") is not None else None,
                   moved=moved, reference=ref_moved, to_reference=moved / ref_moved if ref_moved else None,
                   ops=len(trace.ops), region_ops=sum(1 for op in trace.ops if op[1].startswith("region ")))
    except Exception as e:  # a row that fails is reported, the others still run
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
    del model
    tm.budget = None
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--size", choices=("default", "small"), default="default",
                        help="small: gpu_throughput.py's small Llama's shapes (overrides --vocab and --intermediate)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    parser.add_argument("--device", default="sim", help='"sim" (the default) or "cuda"')
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--regions", action="store_true",
                        help="leave module regions on, in the recorded step too: its offline reference is "
                             "at their granularity (off by default: this measures the per-op path)")
    args = parser.parse_args(argv)
    regions = getattr(torchTensorRef, "regions", None)
    if regions is not None and not args.regions:
        regions.enabled = False
    shape = dict(SMALL) if args.size == "small" else dict(vocab=args.vocab, intermediate=args.intermediate)
    args.vocab = shape["vocab"]
    plain = build(**shape)
    with torchTensorRef.disabled():
        ids = torch.randint(2, args.vocab, (2, args.seq), generator=torch.Generator().manual_seed(1))
    with torchTensorRef.disabled(args.device):
        model = copy.deepcopy(plain).to(args.device)
        train(model, ids.to(args.device), args.steps)
        reference = [p.detach().cpu() for p in model.parameters()]
    del model
    wbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    config = plain.config
    print(f"Llama {config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab {args.vocab}: "
          f"{wbytes / 2**20:.1f} MiB of weights; {args.steps} AdamW steps (clip 1.0, LambdaLR), "
          f"batch 2x{args.seq}, {args.device!r}, torch {torch.__version__}")
    print(f"{'budget':>7} {'strategy':>8} {'result':>6} {'max|diff|':>10} {'peak/budget':>11} {'device':>7} "
          f"{'moved/ref':>9} {'ops':>6} {'regions':>7}  error")
    print(f"{'':>7} {'':>8} {'':>6} {'':>10} {'(manager)':>11} {'(its own)':>7}")
    rows = []
    for fraction in args.fractions:
        for strategy in ("flow", "genoa"):
            r = run(plain, ids, reference, strategy, fraction, args.steps, args.device)
            rows.append(r)
            if r["ok"]:
                ratio = "-" if r["to_reference"] is None else f"{r['to_reference']:.3f}"
                device = "-" if r["device_peak_to_budget"] is None else f"{r['device_peak_to_budget']:.4f}"
                print(f"{fraction:>7.0%} {strategy:>8} {'ok':>6} {r['max_diff']:>10.2e} "
                      f"{r['peak_to_budget']:>11.4f} {device:>7} {ratio:>9} {r['ops']:>6} {r['region_ops']:>7}",
                      flush=True)
            else:
                print(f"{fraction:>7.0%} {strategy:>8} {'error':>6} {'':>10} {'':>11} {'':>7} {'':>9}  {r['error']}",
                      flush=True)
    result = {"torch": torch.__version__, "device": args.device, "vocab": args.vocab, "rows": rows}
    if args.json:
        common.write_result(args.json, "benchmarks/train_budget.py", argv, args.device, result)
    return result


if __name__ == "__main__":
    main()
