"""Serving through regions: ``generate()`` requests one after another, each with its own
prompt length and number of new tokens, under Flow at half the weights (Note [Module
regions] in regions/__init__.py; Note [State carried over a period] in
strategies/flow_learn.py). Every request's tokens are plain torch's on the same device."""

from __future__ import annotations

import gc

import pytest
import torch

import torchTensorRef
from torchTensorRef import regions, tensorsManager as tm
from torchTensorRef.strategies import Flow
from paired import assert_identical, budget, plain_torch

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
#: (prompt length, new tokens) of each request: no two alike
REQUESTS = [(5, 6), (9, 3), (3, 8), (7, 5), (4, 7), (11, 4)]


pytestmark = pytest.mark.usefixtures("regions_on")


def llama(layers: int = CONFIG["num_hidden_layers"]):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(CONFIG, num_hidden_layers=layers))).eval()


def generate(model, ids, prompt: int, tokens: int):
    """One request's tokens (its prompt: a prefix of ``ids``)."""
    with torch.no_grad():
        return model.generate(ids[:, :prompt], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=0)


def test_requests_of_every_length_run_as_regions_keep_flow_s_period_and_match_plain_torch():
    # Note [Calls larger than measured]: after the first request, whose calls are measured op by
    # op, every decoder layer's call is a region, the longest prompts and caches yet included
    ids = torch.randint(1, 64, (1, max(p for p, _n in REQUESTS)), generator=torch.Generator().manual_seed(3))
    with plain_torch():
        plain = llama().to(tm.torch_device)
        expected = [generate(plain, ids.to(tm.torch_device), p, n) for p, n in REQUESTS]
        del plain
    gc.collect()  # (the plain model's cycles: its device bytes would count as outside the manager)
    flow = Flow()
    tm.strategy = flow
    model = llama()
    layer = sum(t.numel() * t.element_size() for t in model.model.layers[0].state_dict().values())
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tm.budget = budget(weights // 2)
    assert layer <= regions.fraction * (weights // 2)  # (the size rule: a layer is a region)
    tm.reset_stats()
    layers = []
    def note_layer(op):
        if op.name == "region LlamaDecoderLayer":
            layers.append(op.index)

    handle = tm.add_callback(before=note_layer)
    managed_ids = torchTensorRef.manage(ids.clone())
    periods = []
    try:
        for (prompt, tokens), plain_tokens in zip(REQUESTS, expected):
            layers.clear()
            assert_identical(plain_tokens, generate(model, managed_ids, prompt, tokens))
            if periods:  # (the first request measures each shape op by op)
                assert len(layers) == CONFIG["num_hidden_layers"] * tokens, (prompt, tokens)  # (a prefill is a step)
            periods.append(flow.period)
    finally:
        handle.remove()
    # Flow's period is one decode step, kept through requests that never repeat whole. (The
    # first request runs op by op, measuring what generate()'s own loop makes; the second may
    # be the first whose loop runs on plain tensors, with a period of fewer ops, which Flow
    # learns during it: Note [Loops on plain tensors] in regions/scope.py.)
    assert periods[0] is not None and periods[2] is not None and set(periods[2:]) == {periods[2]}
    assert flow.plan is not None
    stats = tm.stats()
    assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= tm.budget
    assert stats["worst_overshoot_bytes"] == 0  # (no call's inside outgrew the room made for it)


def test_a_batch_of_shorter_prompts_keeps_its_calls_within_the_budget():
    # Found by the model sessions: after a request of one prompt of 6, one of two prompts of
    # 3 holds as many tokens, and its calls were estimated at the first one's peaks (no
    # growth in elements); their scores (batch x heads x length x length) and their
    # allocations' rounding took more, past the budget. Counted dimension by dimension, the
    # batch grew 2x, and the room made covers it.
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    requests = [(ids[:1], 6), (ids[:, :3], 3)]  # (one prompt of 6, then two of 3)
    with plain_torch():
        plain = llama(2).to(tm.torch_device)
        expected = [generate(plain, p.to(tm.torch_device), n, 1) for p, n in requests]
        del plain
    gc.collect()
    tm.strategy = Flow()
    model = llama(2)  # (at two layers, half the weights leave the least room beside a call)
    tm.budget = budget(sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 2)
    tm.reset_stats()
    for (prompt, length), plain_tokens in zip(requests, expected):
        assert_identical(plain_tokens, generate(model, torchTensorRef.manage(prompt.clone()), length, 1))
    stats = tm.stats()
    assert stats["worst_overshoot_bytes"] == 0 and stats["peak_device_bytes"] <= tm.budget


class Cube(torch.nn.Module):
    """A layer whose call allocates as the cube of its rows: more than the square the room
    made for a larger call grows by."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x):
        h = self.lin(x)
        return (h[:, None, None, :] * h[None, :, None, :] * h[None, None, :, :]).sum((1, 2)) * 1e-3 + x


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_call_that_outgrows_the_room_made_for_it_evicts_to_stay_within_the_budget(strategy, monkeypatch):
    # Note [Calls larger than measured]: rows 4 then 8, the second call's room was made for
    # 4x the first's peak and it took 8x; under Flow, which kept the other layers' weights,
    # the device went 30 KiB past the budget. Its ops now make room before they run.
    monkeypatch.setattr(regions, "min_ops", 0)

    def run(layers, x):
        for layer in layers:
            x = layer(x)
        return x

    def cubes():
        torch.manual_seed(0)
        return torch.nn.ModuleList([Cube() for _ in range(12)]).eval()

    xs = [torch.randn(n, 32, generator=torch.Generator().manual_seed(n)) for n in (4, 8)]
    with plain_torch(), torch.no_grad():
        plain = cubes().to(tm.torch_device)
        expected = [run(plain, x.to(tm.torch_device)) for x in xs]
        del plain
    gc.collect()
    tm.strategy = strategy
    layers = cubes()
    tm.budget = budget(90 * 1024)  # (the weights, 50 KiB, and the larger call's inside, 72 KiB, do not fit)
    tm.reset_stats()
    with torch.no_grad():
        got = [run(layers, torchTensorRef.manage(xs[0].clone()))]
        with tm.recording(regions=True) as trace:
            got.append(run(layers, torchTensorRef.manage(xs[1].clone())))
    assert_identical(expected, got)
    assert sum(name == "region Cube" for _i, name, *_ in trace.ops) == 12  # (each call one region)
    stats = tm.stats()
    assert stats["worst_overshoot_bytes"] == 0 and stats["peak_device_bytes"] <= tm.budget, stats


def test_a_call_beyond_the_growth_limit_is_measured_op_by_op():
    from torchTensorRef.regions import inside

    table = inside.Inside()
    small = (((1, 4, 32), torch.float32),), False
    table.record(small, 0, 1000)
    table.uses[(small, 0)] = []
    within = (((1, 6, 32), torch.float32),), False
    beyond = (((1, 9, 32), torch.float32),), False
    near, growth = table.nearest(within, 0)
    assert near == small and growth == 1.5
    assert table.grown(near, growth, 0) >= 1000 * 1.5 ** 2  # (a square: attention's scores)
    assert table.nearest(beyond, 0) is None  # (more than GROWTH: measured again)
    assert table.nearest(within, 2) is None  # (the objects hold other tensors: what it reads is unknown)
    wider = (((2, 2, 32), torch.float32),), False  # (as many elements, twice the batch)
    assert table.nearest(wider, 0) == (small, 2.0)
    assert table.nearest((within[0], True), 0) is None  # (one needing gradients: not from one that did not)


def test_a_call_bounded_by_a_larger_one_keeps_that_bound_under_its_own_shapes():
    from torchTensorRef.regions import inside

    table = inside.Inside()
    large = (((1, 8, 32), torch.float32),), False
    small = (((1, 3, 32), torch.float32),), False
    table.record(large, 100, 1000)
    assert table.estimate(small, 100) == 1000  # (bounded by the larger call's measurement)
    assert table.peaks[small] == (100, 1000)  # (looked up at once next time, not searched for)


#: requests that reorder, expand and sample: beam search reorders the cache outside the layers'
#: calls, sampling draws from the generator between them
SEARCHES = [dict(num_beams=3, max_new_tokens=5, do_sample=False),
            dict(do_sample=True, top_k=20, temperature=0.9, max_new_tokens=6),
            dict(num_beams=2, do_sample=True, max_new_tokens=4)]


@pytest.mark.parametrize("share", [2, 4], ids=["half", "quarter"])
def test_beam_search_and_sampling_on_a_padded_batch_through_regions_match_plain_torch(share):
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # (the second prompt is shorter: padded on the left)

    def run(model, ids, mask):
        out = []
        with torch.no_grad():
            for search in SEARCHES:
                torch.manual_seed(5)
                out.append(model.generate(ids, attention_mask=mask, pad_token_id=0, **search))
        return out

    with plain_torch():
        plain = llama().to(tm.torch_device)
        expected = run(plain, ids.to(tm.torch_device), mask.to(tm.torch_device))
        del plain
    gc.collect()  # (the plain model's cycles: its device bytes would count as outside the manager)
    tm.strategy = Flow()
    model = llama()
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tm.budget = budget(weights // share)
    tm.reset_stats()
    calls = []
    handle = tm.add_callback(before=lambda op: calls.append(op.name) if op.name.startswith("region ") else None)
    try:
        got = run(model, torchTensorRef.manage(ids.clone()), torchTensorRef.manage(mask.clone()))
    finally:
        handle.remove()
    for want, have in zip(expected, got):
        assert_identical(want, have)
    # (the size rule: at half the weights the decoder layers are regions, at a quarter their attention and MLP)
    assert {"region LlamaDecoderLayer", "region LlamaAttention"} & set(calls), sorted(set(calls))
    stats = tm.stats()
    assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= tm.budget
    assert stats["worst_overshoot_bytes"] == 0
