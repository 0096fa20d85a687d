"""A mixture of experts decoding under a budget: the experts a token uses, or every expert.

A transformers Mixtral (``--layers`` of hidden ``--hidden``, ``--experts`` experts of
``--expert-width``, two per token; random weights, no download) decodes ``--tokens`` tokens
greedily after 8, batch 1, under Flow at each of ``--fractions`` of its weights, on the
device (``"sim"`` by default). Decoding gathers each token's two experts' weights from a
parameter stacking every expert's (transformers' ``batched_mm``); the manager reads those
rows alone from the host copy (Note [Rows of a table]) and runs the layers whose gathers do
so op by op (Note [Regions that read rows]). Each row compares that with reading every
expert: the same run with ``ROWS_MIN_TABLE`` above the stacks, so that only a stack that does
not fit is read by rows. Per row, the MiB brought to the device per ``generate()`` call (the
steady call, after ``--warmup``), the ratio of the two, the manager's ops per call, the peak
against the budget and whether the tokens equal plain torch's on the device.

    python benchmarks/moe_decode.py [--layers 8] [--fractions 0.25,0.5,1.0] [--device sim] [--json out.json]
    python benchmarks/moe_decode.py --device cuda --dtype bfloat16 --expert-width 512   (on a GPU)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402
from torchTensorRef.ops import split_handlers  # noqa: E402


def mixtral(layers: int, hidden: int, experts: int, width: int, dtype: torch.dtype = torch.float32, vocab: int = 256):
    """A plain Mixtral with random weights (seeded), in ``dtype``."""
    import transformers

    common.quiet_transformers()
    config = transformers.MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_local_experts=experts,
        num_experts_per_tok=2, **common.SPECIAL)
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(config).to(dtype).eval()


def row(model, ids, expected, device: str, fraction: float, tokens: int, warmup: int, rows_alone: bool) -> dict:
    """Flow at ``fraction`` of the weights: the steady call's bytes, ops, peak and tokens."""
    previous = split_handlers.ROWS_MIN_TABLE
    if not rows_alone:
        split_handlers.ROWS_MIN_TABLE = 1 << 62  # (by rows only where a stack does not fit)
    try:
        managed = common.managed_copy(model, device, "flow")
        mids = torchTensorRef.manage(ids.clone())
        tm.budget = tm.outside_bytes() + int(fraction * common.param_bytes(model))
        for _ in range(warmup):
            common.generate(managed, mids, tokens)
        tm.reset_stats()
        out = common.generate(managed, mids, tokens)
        stats = tm.stats()
        return {"mib_to_device": stats["bytes_to_device"] / common.MIB, "ops": stats["ops"],
                "peak_to_budget": (stats["peak_device_bytes"] + stats["outside_bytes"]) / tm.budget,
                "equal": torch.equal(common.as_plain(out), expected)}
    finally:
        split_handlers.ROWS_MIN_TABLE = previous
        tm.budget = None
        gc.collect()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--fractions", default="0.25,0.5,1.0")
    parser.add_argument("--device", default="sim")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the weights' (a stack is read by rows from 4 MiB: bfloat16 wants --expert-width 512)")
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    fractions = [float(f) for f in args.fractions.split(",")]
    model = mixtral(args.layers, args.hidden, args.experts, args.expert_width, getattr(torch, args.dtype))
    ids = common.plain_inputs(1, 256, 1, 8)
    plain_device = common.plain_device(args.device)
    with torchTensorRef.disabled(device=plain_device):
        plain = common.plain_copy(model).to(plain_device)
        expected = common.as_plain(common.generate(plain, ids.to(plain_device), args.tokens))
        del plain
    weights = common.param_bytes(model)
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    rows = {}
    for fraction in fractions:
        rows[fraction] = {"rows": row(model, ids, expected, args.device, fraction, args.tokens, args.warmup, True),
                          "whole": row(model, ids, expected, args.device, fraction, args.tokens, args.warmup, False)}
    tm.strategy, tm.device = "flow", "cpu"
    print(f"Mixtral of {args.layers} layers of hidden {args.hidden}, {args.experts} experts of width "
          f"{args.expert_width} (a stack of {stack.numel() * stack.element_size() / common.MIB:.1f} MiB a layer), "
          f"{weights / common.MIB:.1f} MiB of {args.dtype} weights; greedy generate() of {args.tokens} tokens after 8, "
          f"batch 1, Flow, device {args.device}, torch {torch.__version__}")
    print(f"  {'budget':>7} {'MiB/call, experts used':>23} {'MiB/call, every expert':>23} {'ratio':>6} "
          f"{'ops':>11} {'peak/budget':>11}  equal")
    for fraction, r in rows.items():
        used, whole = r["rows"], r["whole"]
        print(f"  {fraction:7.0%} {used['mib_to_device']:23.1f} {whole['mib_to_device']:23.1f} "
              f"{whole['mib_to_device'] / used['mib_to_device']:6.2f} {used['ops']:5d}/{whole['ops']:<5d} "
              f"{max(used['peak_to_budget'], whole['peak_to_budget']):11.3f}  {used['equal'] and whole['equal']}")
    result = {"layers": args.layers, "hidden": args.hidden, "experts": args.experts, "dtype": args.dtype,
              "expert_width": args.expert_width, "tokens": args.tokens, "weights": weights,
              "rows": {str(f): r for f, r in rows.items()}}
    if args.json:
        common.write_result(args.json, "benchmarks/moe_decode.py", argv, args.device, result)
    if not all(r[k]["equal"] for r in rows.values() for k in ("rows", "whole")):
        raise SystemExit("tokens differ from plain torch")
    return result


if __name__ == "__main__":
    main()
