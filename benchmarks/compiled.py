"""Compiled regions under a budget: per-decoder-layer ``torch.compile`` of GPT-2 and Llama.

Each decoder layer of a random-weight ``transformers`` GPT-2 and Llama is compiled (Inductor,
the default backend); the embeddings, final norm and head run eagerly. The work is a batch-1
forward of ``--seq`` tokens with no cache, under ``torch.no_grad()``. Rows, on one thread:

- ``plain compiled``: plain torch on the CPU, each layer ``torch.compile``-d (the reference);
- ``plain eager``: plain torch on the CPU, nothing compiled;
- ``managed eager``: the model on ``"sim"`` under Flow at ``--fraction`` of its weights,
  every op through the manager (``torch.compile`` on it would run the same ops eagerly);
- ``managed compiled regions``: the same, each layer a ``torchTensorRef.compile_region``:
  the manager makes the layer's weights and inputs resident as one op, and the layer runs
  compiled on them.

``"sim"`` computes on the CPU, so the compiled rows run the same Inductor kernels. Every row
is a fresh copy of the model, warmed up twice (compiling, Flow learning its period), then
timed ``--repeats`` times interleaved with ``plain compiled``; the clock is the process's
CPU time. The ratio is the median of the per-pair ratios to ``plain compiled``. The managed
rows report the bytes moved per forward, the peak of device bytes (never above the budget)
and the manager's ops per forward. The compiled-region row must equal ``plain compiled`` bit
for bit and the eager rows must be close to it (``allclose``, Inductor fuses differently);
otherwise the run exits non-zero.

    python benchmarks/compiled.py [--models gpt2 llama] [--fraction 0.5] [--seq 32] [--repeats 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchTensorRef  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import tm  # noqa: E402

MODELS = {
    "gpt2": lambda: common.gpt2(layers=4, embd=256, vocab=1000, positions=128),
    "llama": lambda: common.llama(layers=4, hidden=256, intermediate=512, vocab=1000, heads=4, kv_heads=4,
                                  positions=128),
}


def layers_of(model):
    """The model's decoder layers (an ``nn.ModuleList``)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def compile_layers(model, how):
    layers = layers_of(model)
    for i, layer in enumerate(layers):
        layers[i] = how(layer)
    return model


def forward_of(model, ids, plain):
    def forward():
        with torch.no_grad():
            if plain:
                with torchTensorRef.disabled():  # the masks and positions it makes stay plain too
                    return model(ids, use_cache=False).logits
            return model(ids, use_cache=False).logits
    return forward


def measure(name, plain_model, ids, fraction, repeats):
    budget = int(common.param_bytes(plain_model) * fraction)
    reference = forward_of(compile_layers(common.plain_copy(plain_model), torch.compile), ids, True)
    rows = []
    expected = None
    for label in ("plain compiled", "plain eager", "managed eager", "managed compiled regions"):
        managed = label.startswith("managed")
        if managed:
            model = common.managed_copy(plain_model, "sim", "flow")
            if label.endswith("regions"):
                compile_layers(model, torchTensorRef.compile_region)
            tm.budget = budget
        else:
            model = common.plain_copy(plain_model)
            if label == "plain compiled":
                compile_layers(model, torch.compile)
        fn = forward_of(model, ids, not managed)
        for _ in range(2):
            out = fn()
        values = common.as_plain(out)
        if expected is None:
            expected = common.as_plain(reference())
        if label.endswith("regions"):
            equal = torch.equal(values, expected)
        else:
            equal = torch.allclose(values, expected, atol=1e-4, rtol=1e-4)
        if managed:
            tm.reset_stats()
        own, pairs = [], []
        for _ in range(repeats):
            start = time.process_time()
            reference()
            base = time.process_time() - start
            start = time.process_time()
            fn()
            t = time.process_time() - start
            own.append(t)
            pairs.append(t / base)
        row = dict(model=name, row=label, ms=round(1e3 * statistics.median(own), 3),
                   ratio_to_plain_compiled=round(statistics.median(pairs), 3),
                   equal_to_plain_compiled=bool(equal))
        if managed:
            s = tm.stats()
            row.update(budget=budget, weights=common.param_bytes(plain_model),
                       peak_device_bytes=s["peak_device_bytes"],
                       moved_per_forward=(s["bytes_to_device"] + s["bytes_to_host"]) // repeats,
                       ops_per_forward=s["ops"] // repeats)
            assert s["peak_device_bytes"] <= budget, row
            tm.budget = None
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model, fn
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--fraction", type=float, default=0.5, help="budget: this fraction of the weights")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="write the results (with device, torch, date, command) to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        plain_model = MODELS[name]().eval()
        ids = common.plain_inputs(0, 1000, 1, args.seq)
        rows += measure(name, plain_model, ids, args.fraction, args.repeats)
        torch._dynamo.reset()
    result = common.metadata(common.command_line("benchmarks/compiled.py", argv), "sim")
    result["rows"] = rows
    if args.json:
        common.write_json(args.json, result)
    if not all(r["equal_to_plain_compiled"] for r in rows):
        print("a row's logits differ from plain compiled torch", file=sys.stderr)
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
