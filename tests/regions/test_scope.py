"""Loops on plain tensors whose module calls page (Note [Loops on plain tensors] in
regions/scope.py): ``generate()`` and other methods run through ``regions.run_method`` under
a budget. Every result is plain torch's on the same device, and the device never holds more
than the budget."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import regions, tensorsManager as tm
from torchTensorRef.regions import scope
from torchTensorRef.strategies import Flow
from conftest import TEST_DEVICE
from paired import assert_identical, budget, plain_torch, timing_form_of_sim

pytestmark = pytest.mark.usefixtures("regions_on")

WIDTH = 256


class Stack(torch.nn.Module):
    """Four layers, each a region under half its weights (the stack is none)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def loop(model, x, steps: int, cube: int = 0):
    """A decoding loop's shape: the model called at each step, small ops of its own between;
    with ``cube``, a tensor of its own that grows as the cube of the batch."""
    outs = []
    for _ in range(steps):
        x = x + 0.5 * model(x)
        if cube:
            x = x + torch.ones(x.shape[0] ** 3 * cube, device=x.device).sum()
        outs.append(x.sum(-1))
    return torch.stack(outs)


def run(model, *args):
    with torch.no_grad():
        return regions.run_method(model, "loop", lambda *a: loop(model, *a), args, {})


def stack():
    torch.manual_seed(0)
    return Stack().eval()


def weight_bytes(model) -> int:
    return sum(tm.block_bytes(t.numel() * t.element_size()) for t in model.state_dict().values())


def expected(inputs, *args):
    with plain_torch():
        model = stack().to(tm.torch_device)
        return [run(model, x.to(tm.torch_device), *args) for x in inputs]


def managed_runs(inputs, *args, fraction=0.6):
    """Each input's run under Flow at ``fraction`` of the weights (a layer is a region, the
    stack is not): results, manager ops."""
    tm.strategy = "flow"
    model = stack()
    tm.budget = budget(int(fraction * weight_bytes(model)))
    tm.reset_stats()
    outs, ops = [], []
    counted_runs(model, inputs, args, outs, ops)
    return outs, ops


def counted_runs(model, inputs, args, outs: list, ops: list) -> None:
    """Each input's run of ``model``, managed: its result into ``outs``, its manager ops into ``ops``."""
    for x in inputs:
        x = torchTensorRef.manage(x.clone())
        before = tm.stats()["ops"]
        outs.append(run(model, x, *args))
        ops.append(tm.stats()["ops"] - before)


def test_a_loop_under_a_budget_runs_on_plain_tensors_its_layers_paged():
    inputs = [torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain = expected(inputs, 6)
    outs, ops = managed_runs(inputs, 6)
    for got, want in zip(outs, plain):
        assert_identical(want, got)
    # the first call runs op by op (measuring what the loop makes); the others are one op
    # for the loop and one per layer call: the loop's own ops run on plain tensors
    assert ops[1] == ops[2] == 1 + 4 * 6 < ops[0], ops
    stats = tm.stats()
    assert stats["evictions"] > 0
    assert stats["max_memory_allocated"] <= tm.budget and stats["peak_device_bytes"] <= tm.budget


def test_a_loop_is_one_region_again_once_the_pressure_that_paged_has_passed():
    # A large tensor of the program's, made and freed, made room by evicting once: the
    # loop's later calls, with everything fitting again, ran one region per layer for good
    inputs = [torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(7)]
    plain = expected(inputs, 3)
    tm.strategy = "flow"
    model = stack()
    tm.budget = budget(2 * weight_bytes(model))
    outs, ops = [], []
    counted_runs(model, inputs[:3], (3,), outs, ops)
    assert ops[-1] == 1, ops  # (one region: the budget has not paged)
    transient = torch.ones(int(1.5 * weight_bytes(model)) // 4)
    transient.add_(1)  # (resident: the model's tensors evicted for it)
    assert tm.stats()["evictions"] > 0 and tm.paged
    del transient
    counted_runs(model, inputs[3:], (3,), outs, ops)
    for got, want in zip(outs, plain):
        assert_identical(want, got)
    assert ops[-2:] == [1, 1], ops
    stats = tm.stats()
    assert stats["max_memory_allocated"] <= tm.budget and stats["peak_device_bytes"] <= tm.budget


@pytest.mark.skipif(TEST_DEVICE != "sim", reason="the timing form is sim's")
def test_a_loop_in_the_timing_form_of_sim_gives_its_layers_plain_tensors_as_regions():
    # There the loop's plain tensors are plain CPU tensors, as the device's copies are: its
    # layers must take them as the device's and run as regions, as on strict "sim" and CUDA,
    # not op by op (the form that times the manager would time another path)
    with timing_form_of_sim():
        inputs = [torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        plain = expected(inputs, 6)
        outs, ops = managed_runs(inputs, 6)
        for got, want in zip(outs, plain):
            assert_identical(want, got)
        assert ops[1] == ops[2] == 1 + 4 * 6 < ops[0], ops
        assert tm.stats()["evictions"] > 0


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_loop_larger_than_measured_keeps_room_for_what_it_makes_as_it_runs(strategy):
    # The budget is full of the program's tensors. The second call's batch is 1.5x the
    # first's: the room kept for its loop is estimated from the first call's, and the loop's
    # own tensor (the cube of the batch) outgrows that estimate: room is made as its ops
    # run (the program's tensors evicted), and the device stays within the budget.
    def cubed(model, x):
        return model(x).sum() + torch.ones(x.shape[0] ** 3 * 1024, device=x.device).sum()

    torch.manual_seed(0)
    with plain_torch():
        plain_model = torch.nn.Linear(16, 16).to(tm.torch_device)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    inputs = [torch.randn(b, 16, generator=torch.Generator().manual_seed(b)) for b in (2, 3)]
    with plain_torch(), torch.no_grad():
        want = [cubed(plain_model, x.to(tm.torch_device)) for x in inputs]
    tm.strategy = strategy
    tm.budget = budget(512 * 1024)
    kept = [torch.ones(16 * 1024) for _ in range(7)]  # (448 KiB the program keeps, resident)
    for x, expect in zip(inputs, want):
        x = torchTensorRef.manage(x.clone())
        tm.reset_stats()
        with torch.no_grad():
            got = regions.run_method(model, "cubed", lambda x: cubed(model, x), (x,), {})
        assert_identical(expect, got)
        stats = tm.stats()
        assert stats["max_memory_allocated"] <= tm.budget, (stats["max_memory_allocated"], tm.budget)
    assert stats["evictions"] > 0  # (of the program's tensors, for the loop's own)
    assert all(torch.equal(t, torch.ones(16 * 1024)) for t in kept)


def test_a_loop_whose_tensors_take_much_of_the_budget_runs_op_by_op():
    # where what the loop makes takes more than ``MOST_OF_SHARE`` of the manager's share, its
    # tensors stay blocks the manager can page: every call runs op by op
    inputs = [torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    share = 0.6 * weight_bytes(stack())
    cube = int(scope.MOST_OF_SHARE * share) // 4 // 8 + 1024  # (2 ** 3 elements of 4 bytes per unit)
    plain = expected(inputs, 3, cube)
    outs, ops = managed_runs(inputs, 3, cube)
    for got, want in zip(outs, plain):
        assert_identical(want, got)
    assert ops[1] > 1 + 4 * 3, ops  # (its own ops through the manager)
    assert tm.stats()["max_memory_allocated"] <= tm.budget


transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_pages_its_layers_and_their_cache_under_a_budget(cache):
    # generate() under a budget: its loop on plain tensors, each decoder layer a region whose
    # working set holds its own layer's cache; a static cache, made by the loop, joins the
    # manager at the first layer call given it
    def generate(model, ids):
        with torch.no_grad():
            # (on CUDA a static cache compiles the forward: tests/integrations/test_compiler.py)
            return model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
                                  cache_implementation=cache, disable_compile=True)

    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with plain_torch():
        want = generate(llama().to(tm.torch_device), ids.to(tm.torch_device))
    tm.strategy = "flow"
    model = llama()
    # (a decoder layer is a region: it takes under half the share the loop leaves)
    tm.budget = budget(int(0.6 * weight_bytes(model)))
    layer = len(model.model.layers[0].state_dict())
    # (the first call runs op by op, measuring the loop; the second measures the layers'
    # calls given a static cache made on plain tensors, which joins the manager there)
    for _ in range(2):
        assert_identical(want, generate(model, torchTensorRef.manage(ids.clone())))
    managed_ids = torchTensorRef.manage(ids.clone())
    seen = []
    handle = tm.add_callback(before=lambda op: seen.append((op.name, len(op.blocks))))
    try:
        tm.reset_stats()
        assert_identical(want, generate(model, managed_ids))
    finally:
        handle.remove()
    names = [name for name, _n in seen]
    assert names[0] == "generate LlamaForCausalLM" and names.count("generate LlamaForCausalLM") == 1
    assert not any(name.startswith("aten.") for name in names), names  # (no op of its own through the manager)
    working_sets = [n for name, n in seen if name == "region LlamaDecoderLayer"]
    assert len(working_sets) == 4 * 5  # (the prefill and four steps)
    # its own layer's keys and values beside the weights, not the whole cache
    assert layer < max(working_sets) <= layer + 2, working_sets
    stats = tm.stats()
    assert stats["evictions"] > 0 and stats["max_memory_allocated"] <= tm.budget


@pytest.mark.parametrize("evicts", [True, None])
def test_gpt2_s_generate_under_flow_evicting_to_prefetch_keeps_the_budget(evicts):
    # While Flow learns, a prefetch for the next ops evicted blocks of the op about to run
    # (not yet pinned by its region): the region then ran on copies no longer counted, and
    # the device held a layer's weights above the budget
    config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=500, n_positions=64)

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).eval()

    def generate(model, ids):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, pad_token_id=0)

    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    with plain_torch():
        want = generate(gpt2().to(tm.torch_device), ids.to(tm.torch_device))
    model = gpt2()
    tm.strategy = Flow(prefetch_evicts=evicts)
    tm.budget = budget(weight_bytes(model) // 4)
    tm.reset_stats()
    for _ in range(3):
        assert_identical(want, generate(model, torchTensorRef.manage(ids.clone())))
    stats = tm.stats()
    assert stats["worst_overshoot_bytes"] == 0 and stats["max_memory_allocated"] <= tm.budget, stats
