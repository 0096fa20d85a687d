"""Per-op cost of the proxy on a machine with no GPU.

Forward pass of a GPT-2 with the width of GPT-2 small (768) and 6 layers, sequence 128,
one thread: plain torch against torchTensorRef in pass-through (``device="cpu"``) and on
``"sim"`` with no budget (everything resident after the first touch), interleaved in one
process so that machine noise hits all three alike. Prints median ratios and the time
added per dispatched op.

    python benchmarks/overhead.py [--layers 6] [--seq 128] [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from torchTensorRef import tensorsManager as tm  # noqa: E402


def build(layers: int, width: int, seq: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 1), vocab_size=vocab,
                        n_positions=max(seq, 8))
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, vocab, (1, seq))
    return model, ids


def small_op_added_us(device: str, rounds: int = 15, loops: int = 2000) -> float:
    """Median time added per op on a 64x64 add, where the op itself is cheap.

    A whole model's forward is dominated by large kernels, so its per-op figure is the
    noisy difference of two large numbers; this one isolates the proxy's own cost.
    """
    tm.device = device
    x = torch.rand(64, 64)
    with torchTensorRef.disabled():
        y = torch.rand(64, 64)
    x + x  # first touch
    added = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(loops):
            y + y
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(loops):
            x + x
        added.append((time.perf_counter() - start - plain_s) / loops * 1e6)
    return statistics.median(added)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    with torchTensorRef.disabled():
        plain_model, plain_ids = build(args.layers, args.width, args.seq, args.vocab)
    tm.device = "cpu"
    model, ids = build(args.layers, args.width, args.seq, args.vocab)
    # the same weights for both, so the outputs can be compared too
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain_model.parameters()):
            p.copy_(q)

    def plain():
        # disabled(): the masks and positions the model creates per call stay plain too
        with torch.no_grad(), torchTensorRef.disabled():
            return plain_model(plain_ids).logits

    def managed():
        with torch.no_grad():
            return model(ids).logits

    # One phase per device, each interleaved with plain torch: switching the device sends
    # every block back to the host, which is not what is measured here.
    tm.strategy = "flow"
    tm.budget = None
    reference = plain()
    times, equal, ops, moved = {"plain": []}, {}, {}, {}
    for device, label in (("cpu", "pass-through"), ("sim", "sim")):
        tm.device = device
        out = managed()  # warm-up: on "sim" this brings every block in
        equal[label] = torch.equal(out.clone().toCPU().target, reference)
        tm.reset_stats()
        managed()
        ops[label] = tm.stats()["ops"]
        # only the tensors the model creates per call (masks, positions) are copied in now
        moved[label] = tm.stats()["bytes_to_device"]
        times[label] = []
        for _ in range(args.repeats):
            for name, fn in (("plain", plain), (label, managed)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ops_per_forward = ops["sim"]
    result = {
        "torch": torch.__version__, "threads": 1, "layers": args.layers, "width": args.width,
        "seq": args.seq, "ops_per_forward": ops_per_forward, "median_seconds": med,
        "ratio_pass_through": med["pass-through"] / med["plain"],
        "ratio_sim": med["sim"] / med["plain"],
        "added_us_per_op_pass_through": (med["pass-through"] - med["plain"]) / ops_per_forward * 1e6,
        "added_us_per_op_sim": (med["sim"] - med["plain"]) / ops_per_forward * 1e6,
        "outputs_equal": equal, "bytes_to_device_per_forward": moved,
        "small_op_added_us": {label: small_op_added_us(device) for device, label in
                              (("cpu", "pass-through"), ("sim", "sim"))},
    }
    runs = ("plain", "pass-through", "sim")
    print(f"GPT-2 forward, {args.layers} layers x {args.width}, seq {args.seq}, 1 thread, "
          f"{ops_per_forward} ops, torch {torch.__version__}")
    for name in runs:
        print(f"  {name:>12}: median {med[name] * 1e3:8.2f} ms")
    print(f"  pass-through / plain = {result['ratio_pass_through']:.3f} (target <= 1.05), "
          f"{result['added_us_per_op_pass_through']:.1f} us added per op")
    print(f"  sim resident / plain = {result['ratio_sim']:.3f} (target <= 1.10), "
          f"{result['added_us_per_op_sim']:.1f} us added per op (target < 8)")
    small = result["small_op_added_us"]
    print(f"  64x64 add, time added per op: pass-through {small['pass-through']:.1f} us, "
          f"sim {small['sim']:.1f} us (target < 8)")
    print(f"  outputs equal to plain: {equal}; bytes copied in per forward: {moved}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
