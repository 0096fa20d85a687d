"""Training through regions (Note [Regions with gradients] in regions/training.py): a call
that needs gradients runs as a region, its inner graph linked to the TensorRefs' by one node.

Every test compares with plain torch on the same device, bit for bit, and checks that the
calls did run as regions (the loss's graph holds the region's node).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils.checkpoint

import torchTensorRef
from torchTensorRef import TensorRef, regions, tensorsManager as tm
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.regions import training
from conftest import TEST_DEVICE
from paired import assert_identical, budget, plain_torch

transformers = pytest.importorskip("transformers")

#: the package's default, read before the fixture changes it
DEFAULT_MIN_OPS = regions.min_ops

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def regions_on():
    previous = regions.enabled, regions.min_ops, regions.under_budget, regions.train
    regions.enabled, regions.under_budget, regions.train = True, True, True
    regions.min_ops = 0
    yield
    regions.enabled, regions.min_ops, regions.under_budget, regions.train = previous


class Block(torch.nn.Module):
    """A residual MLP block whose last op saves its output (sigmoid)."""

    def __init__(self, width=16, p=0.0):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x))))).sigmoid()


def stack(n=3, p=0.0):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(p=p) for _ in range(n)])


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def link_nodes(t):
    """The region nodes in ``t``'s graph."""
    found, seen, todo = [], set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_LinkBackward":
            found.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return found


def grads(model):
    return [p.grad for p in model.parameters()]


def train_steps(model, x, steps=3):
    """AdamW steps (the device's default kernels); the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("device,fraction", [("cpu", None), (TEST_DEVICE, None), (TEST_DEVICE, 1.5),
                                             (TEST_DEVICE, 0.75)],
                         ids=["cpu", "device-no-budget", "device-1.5x", "device-0.75x"])
def test_adamw_steps_through_regions_match_plain_torch(device, fraction):
    tm.device = device
    with plain_torch():
        x = torch.randn(8, 16)
        plain_model = stack().to(tm.torch_device)
        plain_losses = train_steps(plain_model, x.to(tm.torch_device))
        plain_params = [p.detach() for p in plain_model.parameters()]
    model = stack()
    tm.strategy = "flow"
    if fraction is not None:
        # (weights, gradients, two AdamW states: 4x the weights; the fraction of that)
        tm.budget = budget(int(fraction * weight_bytes(model)))
    mx = torchTensorRef.manage(x.cpu())
    losses = train_steps(model, mx)
    assert link_nodes(model(mx).sum())  # the blocks ran as regions
    assert_identical(plain_losses, losses)
    assert_identical(plain_params, [p.detach() for p in model.parameters()])
    assert all(isinstance(p, TensorRef) and isinstance(p.grad, TensorRef) for p in model.parameters())
    if fraction is not None:
        assert tm.stats()["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("fraction", [2.0, 1.0, 0.85, 0.7])
def test_a_budget_the_step_fits_keeps_what_regions_save_plain_and_the_device_within_it(fraction):
    # Under a budget a step's regions need at most half of, and before anything was evicted,
    # what they save stays plain, counted as the device's outside bytes (Note [Saved while
    # nothing pages]); where the step does not fit and the budget starts paging, later calls
    # make blocks of it. Either way the device itself never holds more than the budget at an
    # op's end, and the values are plain torch's.
    with plain_torch():
        x = torch.randn(512, 16)  # (activations several times the weights)
        plain_model = stack().to(tm.torch_device)
        plain_losses = train_steps(plain_model, x.to(tm.torch_device), steps=5)
        plain_params = [p.detach() for p in plain_model.parameters()]
    tm.strategy = "flow"
    model = stack()
    mx = torchTensorRef.manage(x.cpu())
    train_steps(stack(), mx, steps=2)  # (the same step's peak with no budget, on a copy)
    peak = tm.stats()["peak_device_bytes"]
    checking = tm.check_device
    tm.check_device = True
    try:
        tm.reset_stats()
        tm.budget = budget(int(fraction * peak))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, overshoot = [], 0
        for step in range(5):
            if step == 3:  # (the first calls and backwards measured what they allocate)
                overshoot = tm.stats()["device_overshoot_bytes"]
                tm.reset_stats()
            opt.zero_grad(set_to_none=True)
            loss = model(mx).square().mean()
            nodes = link_nodes(loss)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        stats = tm.stats()
    finally:
        tm.check_device = checking
    assert_identical(plain_losses, losses)
    assert_identical(plain_params, [p.detach() for p in model.parameters()])
    assert nodes and stats["peak_device_bytes"] <= tm.budget
    assert overshoot == stats["device_overshoot_bytes"] == 0
    if fraction == 2.0:  # (nothing pages: the last steps evict nothing, and keep what they save plain)
        assert stats["evictions"] == 0 and not any(node.training.paged for node in nodes)
    if fraction == 0.7:
        assert stats["evictions"] > 0 and all(node.training.paged for node in nodes)


def test_a_budget_below_what_a_plain_graph_holds_is_refused_until_its_backward():
    # A graph kept plain under a budget it fits in holds its activations outside the manager
    # until its backward: a budget set below them meanwhile is refused, as any budget below
    # what the device holds outside the manager, and nothing changes (Note [Saved while
    # nothing pages]); after the backward the same budget is taken.
    with plain_torch():
        x = torch.randn(512, 16)
        plain_model = stack().to(tm.torch_device)
        plain_losses = train_steps(plain_model, x.to(tm.torch_device), steps=4)
    tm.strategy = "flow"
    model = stack()
    mx = torchTensorRef.manage(x.cpu())
    train_steps(stack(), mx, steps=2)  # (the step's peak with no budget, on a copy)
    tm.budget = budget(2 * tm.stats()["peak_device_bytes"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        held = tm.outside_bytes()  # (what the device holds outside the manager anyway: workspaces on CUDA)
        loss = model(mx).square().mean()
        nodes = link_nodes(loss)
        if step == 3:
            assert nodes and not any(node.training.paged for node in nodes)
            before = (tm.budget, tm.stats()["evictions"])
            lower = held + (tm.outside_bytes() - held) // 2  # (below the activations the graph holds)
            with pytest.raises(torchTensorRef.BudgetBelowFloorError, match="outside the manager"):
                tm.budget = lower
            assert (tm.budget, tm.stats()["evictions"]) == before
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    assert_identical(plain_losses, losses)
    tm.budget = lower  # (the activations are gone)
    assert tm.budget == lower and tm.stats()["device_bytes"] <= lower


def llama_steps(model, ids, clip=False, checkpointing=False):
    """Five AdamW steps of a Llama; the losses and the last loss."""
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
    return losses, loss


def managed_llama_trains_as_plain_torch(**options):
    """``llama_steps`` on a plain and a managed tiny Llama (a budget of 3x its weights):
    losses, parameters and the peak checked; the managed last loss."""
    ids = torch.randint(1, 64, (2, 12))
    with plain_torch():
        torch.manual_seed(0)
        plain_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(tm.torch_device)
        plain_losses, _ = llama_steps(plain_model, ids.to(tm.torch_device), **options)
        plain_params = [p.detach() for p in plain_model.parameters()]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    tm.strategy = "flow"
    tm.budget = budget(weight_bytes(model) * 3)
    losses, loss = llama_steps(model, torchTensorRef.manage(ids), **options)
    assert_identical(plain_losses, losses)
    assert_identical(plain_params, [p.detach() for p in model.parameters()])
    assert tm.stats()["peak_device_bytes"] <= tm.budget
    return loss


def test_a_llama_trains_through_decoder_layer_regions_under_a_budget():
    # (each level of modules runs op by op once, measured, before its parts are considered:
    # the decoder layers are regions from the fourth step)
    loss = managed_llama_trains_as_plain_torch(clip=True)
    names = {n.training.region.name for n in link_nodes(loss)}
    assert "region LlamaDecoderLayer" in names, names


def test_a_region_lets_go_of_its_views_before_the_strategy_evicts_its_blocks(monkeypatch):
    # A region call's views and a region backward's gradients were alive while Genoa evicted
    # the step's blocks: each dropped copy was held as still viewed until the next op (on
    # CUDA, allocated beside the budget until then; Note [Buffers still viewed] in
    # ``memory/residency.py``): 169 of them over these six steps.
    accounting = type(tm.accounting)
    held = []
    hold = accounting.hold_viewed
    monkeypatch.setattr(accounting, "hold_viewed", lambda self, viewed, nbytes: (held.append(nbytes),
                                                                                    hold(self, viewed, nbytes)))
    ids = torch.randint(1, 64, (2, 12))
    with plain_torch():
        torch.manual_seed(0)
        plain_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(tm.torch_device)
        for _ in range(6):
            plain_model(ids.to(tm.torch_device), labels=ids.to(tm.torch_device)).loss.backward()
        plain_grads = [p.grad for p in plain_model.parameters()]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    tm.strategy = "genoa"
    tm.budget = budget(weight_bytes(model) * 3)
    mids = torchTensorRef.manage(ids)
    for _ in range(6):
        loss = model(mids, labels=mids).loss
        loss.backward()
    assert link_nodes(loss)  # (regions ran, with gradients)
    assert held == []
    assert_identical(plain_grads, [p.grad for p in model.parameters()])


def llama_on_batches(lengths, budget_of_weights=3, extra=0):
    """AdamW steps of a plain and a managed tiny Llama on batches of ``lengths`` tokens, under
    a budget of ``budget_of_weights`` times its weights (and ``extra`` bytes): losses and parameters checked against
    plain torch, the peak within the budget; per step, the regions the loss's graph holds."""
    batches = [torch.randint(1, 64, (2, n), generator=torch.Generator().manual_seed(n)) for n in lengths]

    def steps(model, batches):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, layer_regions = [], []
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            layer_regions.append([n.training.region.name for n in link_nodes(loss)])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses, layer_regions

    with plain_torch():
        torch.manual_seed(0)
        plain_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(tm.torch_device)
        plain_losses, _ = steps(plain_model, [b.to(tm.torch_device) for b in batches])
        plain_params = [p.detach() for p in plain_model.parameters()]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    tm.strategy = "flow"
    tm.budget = budget(int(weight_bytes(model) * budget_of_weights) + extra)
    losses, layer_regions = steps(model, [torchTensorRef.manage(b) for b in batches])
    del plain_model
    gc.collect()  # (the plain model's cycles: its device bytes would count as outside in later tests)
    assert_identical(plain_losses, losses)
    assert_identical(plain_params, [p.detach() for p in model.parameters()])
    assert tm.stats()["peak_device_bytes"] <= tm.budget
    return layer_regions


def test_a_llama_trains_on_batches_of_every_length_through_regions():
    # Batches padded to their own longest sequence (dynamic padding), with the default size
    # rules: after the first steps measure each level of modules, a shorter batch runs its
    # decoder layers as regions at once, and so does one longer than any before, within twice
    # the longest measured (Note [Calls larger than measured])
    regions.min_ops = DEFAULT_MIN_OPS
    names = llama_on_batches((12, 12, 12, 12, 9, 16, 20, 7), budget_of_weights=5)
    layer_regions = [step.count("region LlamaDecoderLayer") for step in names]
    assert layer_regions[4:] == [CONFIG["num_hidden_layers"]] * 4, layer_regions
    assert tm.stats()["worst_overshoot_bytes"] == 0


# (where what a region saves stays plain, its first backward keeps all the room the budget
# leaves: it runs on plain tensors; where they are blocks it runs op by op, Note [A first
# backward runs op by op] in regions/step.py)
@pytest.mark.parametrize("budget_of_weights", [1.0, 0.75])
def test_a_region_s_first_backward_keeps_no_more_room_than_the_budget_leaves(budget_of_weights):
    # A region's first backward keeps all the room the budget leaves. With allocations counted
    # as CUDA's allocator counts them (512-byte multiples) and a budget that is not one, that
    # room counted as one allocation rounded up past the budget: every training row under a
    # budget raised OutOfBudgetError on an H100 ("region LlamaRMSNorm backward needs 214.0 MiB
    # ..., budget is 213.5 MiB"), a few hundred bytes over.
    rounding = tm.sim_rounding
    tm.sim_rounding = True
    try:
        names = llama_on_batches((12,) * 4, budget_of_weights, extra=257)
    finally:
        tm.sim_rounding = rounding
    assert names[-1], names  # (the last steps trained through regions)


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_a_region_s_first_backward_finds_its_room_while_the_program_views_a_managed_tensor(strategy):
    # A region's first backward keeps all the room the budget leaves, read before the
    # evictions that make it; a block whose device copy the program still views stays counted
    # once evicted (Note [Buffers still viewed]), so that room was its size too large and the
    # backward was refused ("region Linear backward needs 13.2 KiB ... 256 B is allocated
    # outside the manager"; peft's PSOFT tests after its FRoD tests).
    def run(managed):
        model, x = stack(), torch.randn(8, 16)
        if managed:
            tm.strategy = strategy
            tm.budget = budget(weight_bytes(model))
        else:
            model, x = model.to(tm.torch_device), x.to(tm.torch_device)
        for _ in range(2):  # (the first call measures the region op by op)
            model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        viewed = torch.full((64,), 2.0)
        kept = viewed.target if managed else viewed  # (a plain view of its device copy)
        loss.backward()
        assert kept.sum().item() == 128.0
        return loss, grads(model)

    with plain_torch():
        plain_loss, plain_grads = run(False)
    loss, got = run(True)
    assert link_nodes(loss)  # (the backward ran through regions)
    assert_identical(plain_grads, got)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def test_a_llama_s_norms_as_regions_of_their_own_train_as_plain_torch():
    # (Note [Gradients summed inside a region]: a norm's input is also the residual, added
    # outside it, and the norm reads it twice; summed inside the region, the parameters
    # differed from plain torch's in the last bits from the second step at 18 tokens)
    llama_on_batches((20,) * 6)


class Reads(torch.nn.Module):
    """Reads its input ``times`` times, each read a different function of it."""

    def __init__(self, times, width=64):
        super().__init__()
        self.times = times
        self.w = torch.nn.Parameter(torch.randn(width))

    def forward(self, h):
        terms = [h * self.w, torch.tanh(h) * self.w, h.pow(2) * 0.11, torch.sin(h), h * h.mean()]
        return sum(terms[:self.times])


def _residual_grads(times, managed):
    """Gradients of the input and the weight when ``h`` goes through ``Reads`` and around it,
    two steps (the first measures the call op by op)."""
    torch.manual_seed(0)
    module = Reads(times)
    x = torch.rand(64)
    if not managed:
        with plain_torch():
            module = module.to(TEST_DEVICE)
            x = x.to(TEST_DEVICE)
    else:
        regions.region(module)
    x.requires_grad_()
    for _ in range(2):
        x.grad = module.w.grad = None
        h = x * 1.3
        y = h + module(h) + module.w * 0.5  # (h and w: read inside the module and outside it)
        (y * y.mean()).sum().backward()
    return y, [x.grad, module.w.grad]


def test_an_input_read_once_inside_a_region_and_outside_gets_plain_torch_s_gradient():
    with plain_torch():
        _y, expected = _residual_grads(1, managed=False)
    y, got = _residual_grads(1, managed=True)
    assert link_nodes(y)  # (the second call ran as a region)
    for g, e in zip(got, expected):
        assert_identical(e, g)


def test_an_input_read_several_times_inside_a_region_and_outside_gets_plain_torch_s_gradient():
    # (Note [Gradients summed inside a region]: each read's contribution reaches autograd
    # apart, in the inner graph's order)
    with plain_torch():
        _y, expected = _residual_grads(5, managed=False)
    y, got = _residual_grads(5, managed=True)
    assert link_nodes(y)
    for g, e in zip(got, expected):
        assert_identical(e, g)


def test_gradients_reach_inputs_frozen_parameters_and_dropout_as_in_plain_torch():
    def run(model, x):
        model[1].up.weight.requires_grad_(False)  # frozen: no gradient, as in plain torch
        torch.manual_seed(5)  # (dropout draws its masks inside the regions, in plain torch's order)
        for _ in range(2):
            model(x).sum().backward()
        return x.grad, grads(model)

    with plain_torch():
        x = torch.randn(4, 16)
        plain = run(stack(p=0.3).to(tm.torch_device).train(), x.to(tm.torch_device).requires_grad_())
    model = stack(p=0.3).train()
    mx = torchTensorRef.manage(x.cpu()).requires_grad_()
    managed = run(model, mx)
    assert link_nodes(model(mx).sum())
    assert model[1].up.weight.grad is None
    assert_identical(plain[0], managed[0], "input gradient")
    assert_identical([g for g in plain[1] if g is not None], [g for g in managed[1] if g is not None])


def test_retain_graph_keeps_the_region_s_graph_and_without_it_a_second_backward_is_refused():
    with plain_torch():
        x = torch.randn(4, 16)
        plain_model = stack().to(tm.torch_device)
        loss = plain_model(x.to(tm.torch_device)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        plain = grads(plain_model)
    model = stack()
    mx = torchTensorRef.manage(x.cpu())
    model(mx)  # (the first call with these shapes is measured op by op)
    loss = model(mx).sum()
    (node,) = link_nodes(loss)
    loss.backward(retain_graph=True)
    assert not node.training.released
    loss.backward()
    assert_identical(plain, grads(model))
    assert node.training.released  # the graph was freed: so are the activations it saved
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize("fraction", [None, 0.75], ids=["no-budget", "paged"])
@pytest.mark.parametrize("call", ["backward()", "backward(retain_graph=True)", "autograd.backward(positional)",
                                  "autograd.grad()", "autograd.grad(positional)", "autograd.grad(create_graph=True)"])
def test_a_region_s_inner_graph_is_freed_as_its_backward_runs_unless_the_backward_keeps_its_graph(call, fraction):
    """Note [Keeping the inner graph]: what a region saved goes once its node ran (as plain
    torch frees each node's saved tensors), not at the backward's end; it is kept where the
    backward keeps its graph, however ``retain_graph`` is given."""
    keeps = call not in ("backward()", "autograd.grad()")
    with plain_torch():
        x = torch.randn(4, 16)
        plain_model = stack().to(tm.torch_device)
        px = x.to(tm.torch_device).requires_grad_()
        plain = torch.autograd.grad(plain_model(px).sum(), [px] + list(plain_model.parameters()))
    model = stack()
    if fraction is not None:
        tm.strategy = "flow"
        tm.budget = budget(int(fraction * weight_bytes(model)))
    mx = torchTensorRef.manage(x.cpu()).requires_grad_()
    for _ in range(2):
        model(mx)  # (the first calls with these shapes are measured op by op: the model's, then its blocks')
    loss = model(mx).sum()
    nodes = link_nodes(loss)
    assert len(nodes) == 1 if fraction is None else len(nodes) > 1  # (paged: the blocks, or their modules)
    seen = []
    # (the input's gradient comes once every region's node ran, before the backward ends)
    mx.register_hook(lambda g: seen.append([n.training.released for n in nodes]))
    params = [mx] + list(model.parameters())
    got = None
    if call == "backward()":
        loss.backward()
    elif call == "backward(retain_graph=True)":
        loss.backward(retain_graph=True)
    elif call == "autograd.backward(positional)":
        torch.autograd.backward(loss, None, True)
    elif call == "autograd.grad()":
        got = torch.autograd.grad(loss, params)
    elif call == "autograd.grad(positional)":
        got = torch.autograd.grad(loss, params, None, True)
    else:
        # (a region's backward records no graph: it refuses, and is not run again)
        with pytest.raises(RuntimeError, match="create_graph=True"):
            torch.autograd.grad(loss, params, create_graph=True)
        assert not any(n.training.released for n in nodes)
        return
    assert seen == [[not keeps] * len(nodes)]
    assert_identical(list(plain), list(got) if got is not None else [mx.grad] + grads(model))
    assert all(n.training.released is not keeps for n in nodes)
    if fraction is not None:
        assert tm.stats()["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_a_forward_whose_graph_is_dropped_without_a_backward_leaves_nothing_behind(strategy):
    # Under a budget that pages, the saved-tensor hooks live in the inner graph's nodes,
    # which the region's call holds: hooks that held the call made a cycle through
    # autograd that the collector cannot see, and a forward never backpropagated (a
    # validation pass with gradients on, the last forward of a loop) kept its TensorRefs
    # and plain device activations for the life of the process.
    model = stack()
    tm.strategy = strategy
    tm.budget = budget(int(0.75 * weight_bytes(model)))
    mx = torchTensorRef.manage(torch.randn(4, 16)).requires_grad_()
    for _ in range(2):
        model(mx)  # (the first calls with these shapes are measured op by op)
    gc.collect()
    before = tm.stats()
    loss = model(mx).sum()
    assert len(link_nodes(loss)) > 1  # (its blocks ran as regions, saving through the hooks)
    held = tm.stats()["tensors"]
    del loss
    gc.collect()
    after = tm.stats()
    assert held > before["tensors"]
    assert (after["tensors"], after["outside_bytes"]) == (before["tensors"], before["outside_bytes"])


def test_a_llama_evaluated_with_gradients_on_holds_no_more_after_each_forward():
    # What a user meets: a validation loop with gradients on (no ``torch.no_grad()``) under
    # Flow at half the weights kept every forward's region calls alive (the cycle above):
    # host bytes and TensorRefs grew with each forward, and the losses still matched.
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with plain_torch():
        torch.manual_seed(0)
        plain_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(tm.torch_device)
        expected = plain_model(ids.to(tm.torch_device), labels=ids.to(tm.torch_device)).loss.detach()
        del plain_model
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    tm.strategy = "flow"
    tm.budget = budget(weight_bytes(model) // 2)
    mids = torchTensorRef.manage(ids)
    held = []
    for _ in range(6):
        loss = model(mids, labels=mids).loss
        assert_identical(expected, loss.detach())
        del loss
        gc.collect()
        stats = tm.stats()
        held.append((stats["tensors"], stats["host_bytes"], stats["outside_bytes"]))
    assert held[3:] == [held[2]] * 3  # (the first calls of each shape run op by op, measured)


class Squash(torch.nn.Module):
    """Its last op (sigmoid) saves its result: the call's output."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).sigmoid()


def test_a_saved_output_changed_in_place_before_backward_is_refused_as_in_plain_torch():
    def run(model, x):
        out = model(x)
        out.mul_(2)
        out.sum().backward()

    with plain_torch():
        x = torch.randn(4, 16)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(Squash().to(tm.torch_device), x.to(tm.torch_device))
    model = Squash()
    mx = torchTensorRef.manage(x.cpu())
    model(mx)
    assert link_nodes(model(mx).sum())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(model, mx)


@pytest.mark.parametrize("outer", ["region", "no region"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointed_blocks_train_as_in_plain_torch(reentrant, outer):
    # (a reentrant checkpoint's backward refuses to run inside a region's, which asks for given
    # inputs' gradients: a model checkpointing its blocks, itself a region, raised from its
    # second step: Note [Reentrant checkpoints in a region])
    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = stack()

        def forward(self, x):
            for b in self.blocks:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=reentrant)
            return x

    def run(model, x):
        for _ in range(3):
            model(x).square().sum().backward()
        return grads(model)

    with plain_torch():
        x = torch.randn(4, 16)
        plain = run(Checkpointed().to(tm.torch_device), x.to(tm.torch_device).requires_grad_())
    model = Checkpointed() if outer == "region" else regions.no_region(Checkpointed())
    managed = run(model, torchTensorRef.manage(x.cpu()).requires_grad_())
    assert_identical(plain, managed)


def _penalty_step(model, x):
    """A gradient penalty (WGAN-GP): the input's gradient with a graph, its norm in the loss."""
    out = model(x)
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.mean() + g.square().sum(dim=1).mean()).backward()
    return grads(model)


@pytest.mark.parametrize("weights", [None, 2])
def test_gradients_of_gradients_through_a_region_match_plain_torch(weights):
    # Regions' backward recorded no graph: from the second call on, the penalty's gradient
    # had none either, and its terms were silently missing from every parameter's gradient
    # (Note [Gradients of gradients]).
    def run(model, x):
        return [[g.clone() for g in _penalty_step(model, x)] for _ in range(3)]

    with plain_torch():
        x = torch.randn(4, 16)
        plain = run(stack().to(tm.torch_device), x.to(tm.torch_device).requires_grad_())
    model = stack()
    if weights is not None:
        tm.budget = budget(weights * weight_bytes(model))
    managed = run(model, torchTensorRef.manage(x.cpu()).requires_grad_())
    assert_identical(plain, managed)
    assert not link_nodes(model(torchTensorRef.manage(x.cpu()).requires_grad_()).sum())  # (op by op from then on)


def test_a_graph_recorded_through_a_region_after_plain_backwards_raises_then_runs_op_by_op():
    model = stack(1)
    x = torchTensorRef.manage(torch.randn(4, 16))
    for _ in range(2):  # (plain backwards seen: the calls become regions)
        model(x).square().sum().backward()
    x.requires_grad_()
    out = model(x)
    assert link_nodes(out)
    with pytest.raises(RuntimeError, match="create_graph=True went through the region"):
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        g.sum().backward()
    model.zero_grad()
    with plain_torch():
        plain_model = stack(1).to(tm.torch_device)
        px = torch.randn(4, 16)
    got = [g.clone() for g in _penalty_step(model, torchTensorRef.manage(px.cpu()).requires_grad_())]
    with plain_torch():
        plain_model.load_state_dict(model.state_dict())
        expected = _penalty_step(plain_model, px.to(tm.torch_device).requires_grad_())
    assert_identical(expected, got)


def test_training_regions_switched_off_run_op_by_op():
    regions.train = False
    model = stack()
    x = torchTensorRef.manage(torch.randn(4, 16))
    model(x)
    loss = model(x).sum()
    assert not link_nodes(loss)
    loss.backward()
    assert all(isinstance(p.grad, TensorRef) for p in model.parameters())


def test_a_region_s_backward_is_one_op_whose_working_set_holds_the_weights_it_saved():
    model = stack()
    tm.strategy = "flow"
    tm.budget = budget(weight_bytes(model) * 4)
    tm.note_pressure()  # (the budget pages: what the backward saved are blocks of the manager)
    x = torchTensorRef.manage(torch.randn(8, 16))
    model(x).sum().backward()  # (measured: op by op)
    model(x).sum().backward()
    model(x).sum().backward()  # (each region's first backward: op by op, measured)
    with tm.recording(regions=True) as trace:
        model(x).sum().backward()
    names = [name for _i, name, *_ in trace.ops]
    assert names.count("region Block") == 3 and names.count("region Block backward") == 3
    first = next(i for i, name, *_ in trace.ops if name == "region Block backward")
    read = {block for i, block, _n, _w in trace.accesses if i == first}
    # the last block's backward: its weights (saved by its matmuls), not the other blocks'
    assert block_of(model[2].up.weight).id in read and block_of(model[0].up.weight).id not in read
    assert tm.stats()["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("device,strategy,limit,paged", [
    ("cpu", "flow", "none", False), (TEST_DEVICE, "flow", "budget", False), (TEST_DEVICE, "flow", "tight", True),
    (TEST_DEVICE, "flow", "budget-evicted", True), (TEST_DEVICE, "flow", "none", False),
    (TEST_DEVICE, "flow", "evicted", True), (TEST_DEVICE, "genoa", "none", True)],
    ids=["pass-through", "budget-it-fits", "budget-over-half", "budget-after-evicting", "no-budget",
         "no-budget-after-evicting", "genoa-no-budget"])
def test_activations_become_blocks_only_where_the_manager_pages(device, strategy, limit, paged, monkeypatch):
    # With nothing ever evicted (pass-through, no budget before the device's capacity made
    # the manager evict, or a budget the call's needs take at most half of) the inner graph
    # keeps what it saves, as plain torch does; under a budget the call needs more of, once
    # room was made by evicting, or under a strategy that sends every block back after its op
    # (Genoa), each activation becomes a block of the manager (Note [Saved while nothing
    # pages]). The gradients are plain torch's either way.
    tm.device = device
    tm.strategy = strategy
    with plain_torch():
        x = torch.randn(4, 16)
        torch.manual_seed(0)
        plain = Block().to(tm.torch_device)
        plain(x.to(tm.torch_device)).sum().backward()
    torch.manual_seed(0)
    model = Block()
    if limit.startswith("budget") or limit == "tight":
        tm.budget = budget(weight_bytes(model) * 32)
    if limit == "tight":  # (the call's needs are more than this share of the budget)
        monkeypatch.setattr(training, "PLAIN_SHARE", 0.01)
    if limit.endswith("evicted"):
        tm.note_pressure()  # (as making room does once the device's capacity or the budget is reached)
    mx = torchTensorRef.manage(x.cpu())
    model(mx)  # (the first call with gradients runs op by op: Note [Gradients of gradients])
    model.zero_grad(set_to_none=True)
    before = len(tm.books.blocks)
    out = model(mx)
    (node,) = link_nodes(out.sum())
    added = len(tm.books.blocks) - before
    activations = [s for s in node.training.saved if s.ref is not None and block_of(s.ref) is not block_of(mx)
                   and all(block_of(s.ref) is not block_of(p) for p in model.parameters())]
    assert (added > 1) is paged and bool(activations) is paged
    out.sum().backward()
    assert all(isinstance(p.grad, TensorRef) for p in model.parameters())
    assert_identical([p.grad for p in plain.parameters()], [p.grad for p in model.parameters()])


def test_a_smaller_batch_after_a_larger_one_and_one_up_to_twice_as_large_train_through_regions_at_once():
    # (Note [Calls larger than measured])
    def run(model, batches):
        losses, regions_run = [], []
        for x in batches:
            loss = model(x).square().mean()
            regions_run.append(len(link_nodes(loss)))
            loss.backward()
            losses.append(loss.detach())
        return losses, regions_run, grads(model)

    with plain_torch():
        batches = [torch.randn(n, 16) for n in (8, 8, 4, 12, 40)]
        plain_losses, _, plain_grads = run(stack().to(tm.torch_device), [b.to(tm.torch_device) for b in batches])
    model = stack()
    tm.strategy = "flow"
    tm.budget = budget(weight_bytes(model) * 4)
    losses, regions_run, managed_grads = run(model, [torchTensorRef.manage(b.cpu()) for b in batches])
    # the first batch is measured op by op; 4 rows are bounded by 8, 12 within twice 8 (a
    # region measuring itself); 40 rows, five times larger, are measured op by op again
    assert regions_run[2:] == [3, 3, 0], regions_run
    assert_identical(plain_losses, losses)
    assert_identical(plain_grads, managed_grads)
    stats = tm.stats()
    assert stats["peak_device_bytes"] <= tm.budget and stats["worst_overshoot_bytes"] == 0


def test_transformers_gradient_checkpointing_trains_as_in_plain_torch():
    managed_llama_trains_as_plain_torch(checkpointing=True)


class _Shared(torch.nn.Module):
    """Buffers shared by several layers, kept out of their module trees (as peft's FRoD tuner
    shares its projections)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(8, 8))


class _HoldsUnseen(torch.nn.Module):
    """A trainable scale, read with a tensor its module tree does not hold."""

    def __init__(self, held: str, shared: _Shared):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))
        self.held = held
        if held == "module":
            object.__setattr__(self, "shared", shared)  # (not registered: not a submodule)
        else:
            proj = shared.proj
            self.project = lambda t: t @ proj  # (in a closure)

    def forward(self, x):
        h = self.inp(x)
        projected = h @ self.shared.proj if self.held == "module" else self.project(h)
        return (projected * self.scale).sum(-1)


class _Adapter(torch.nn.Module):
    """A layer wrapping another, adding a trainable scale of a projection held out of its
    module tree (as peft injects its FRoD layers into a model)."""

    def __init__(self, base: torch.nn.Module, shared: _Shared):
        super().__init__()
        self.base = base
        self.scale = torch.nn.Parameter(torch.ones(8))
        object.__setattr__(self, "shared", shared)  # (not registered: not a submodule)

    def forward(self, x):
        return self.base(x) + (x @ self.shared.proj) * self.scale


@pytest.mark.parametrize("held", ["module", "closure", "injected"])
def test_a_region_reading_a_tensor_its_call_does_not_hold_trains_as_plain_torch(held):
    # Note [Tensors no scan finds]: the gradients of the scale were lost after the region's
    # first call (peft's FRoD adapters did not train: their outputs did not move); injected
    # once the model had been called, the adapter's region was measured before it held one
    def run():
        torch.manual_seed(0)
        shared = _Shared()
        x = torch.randn(4, 8)
        if held == "injected":
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
            first = model(x)  # (with gradients, before the adapter: as peft's tests call the base model)
            model[0] = _Adapter(model[0], shared)
        else:
            model = _HoldsUnseen(held, shared)
            model.eval()
            first = model(x)  # (a call with gradients in eval mode, as peft's tests make one first)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
            opt.step()
        return [first.detach(), *losses, *[p.detach() for p in model.parameters()]]

    with plain_torch():
        expected = [t.cpu() for t in run()]
    got = [t.cpu() for t in run()]
    assert not torch.equal(expected[1], expected[3]), "the plain model did not train: the test shows nothing"
    for e, g in zip(expected, got):
        assert_identical(g, e)


class _PlainScale(torch.nn.Module):
    """A block of the stack and a trainable scale that is a plain tensor read from a closure,
    as a program keeps a tensor made inside ``disabled()``."""

    def __init__(self, scale):
        super().__init__()
        self.block = Block()
        self.scaled = lambda t: t * scale

    def forward(self, x):
        return self.scaled(self.block(x))


@pytest.mark.parametrize("plain", ["parameters", "parameters, input frozen", "argument", "closure"])
def test_plain_tensors_that_need_gradients_get_plain_torch_s_from_every_call(plain):
    # Note [Plain tensors that need gradients]: a model built inside disabled() and called on
    # a managed input lost its parameters' gradients from its second call on (the first runs
    # op by op), silently; with the input frozen its backward was refused
    def run(managed: bool):
        torch.manual_seed(0)
        with plain_torch():
            x = torch.randn(4, 16).to(tm.torch_device)
            scale = torch.randn(16).to(tm.torch_device).requires_grad_()
            model = stack().to(tm.torch_device) if plain != "closure" else None
        if plain == "closure":  # (the model's own parameters managed, the scale plain)
            torch.manual_seed(1)
            if managed:
                model = _PlainScale(scale)
            else:
                with plain_torch():
                    model = _PlainScale(scale).to(tm.torch_device)
        leaves = [*model.parameters(), scale]
        if managed:
            x = torchTensorRef.manage(x.cpu())
        x.requires_grad_(plain != "parameters, input frozen")
        calls = []
        for _ in range(3):  # (gradients accumulate: each call's must arrive)
            y = model(x) if plain != "argument" else model(x) * scale
            calls.append(y)
            y.sum().backward()
        return calls, [p.grad for p in leaves if p.grad is not None] + ([x.grad] if x.requires_grad else [])

    with plain_torch():
        plain_calls, expected = run(managed=False)
        expected = [g.cpu() for g in expected]
    calls, got = run(managed=True)
    assert len(got) == len(expected) > 1
    for g, e in zip(got, expected):
        assert_identical(g, e)
    # (calls reading such a tensor run op by op; a block that reads none is still a region)
    assert bool(link_nodes(calls[-1])) == (plain == "closure")


class _Samples:
    """Noise drawn ahead and kept in a plain object, which no scan of a call searches (an
    object attribute of a module that is no tensor, list or dict), as peft's MonteCLoRA
    sampler keeps its samples."""

    def __init__(self, width: int):
        self.buffer = [torch.randn(width) for _ in range(4)]
        self.index = 0

    def get(self):
        self.index += 1
        return self.buffer[(self.index - 1) % len(self.buffer)]


class _Noisy(torch.nn.Module):
    """A layer that adds scaled noise in training mode only."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.rand(8))
        self.sampler = _Samples(8)

    def forward(self, x):
        y = self.lin(x)
        if self.training:  # (exp(scale), an activation saved on a plain leaf, times a TensorRef)
            y = y + torch.exp(self.scale) * self.sampler.get()
        return torch.log_softmax(y, -1)


@pytest.mark.parametrize("paged", [False, True])
def test_gradients_through_tensors_no_scan_finds_in_training_mode_reach_the_parameters(paged):
    # Note [Gradients past a region's node]: measured in eval mode, where it reads no sample,
    # the region's first call in training mode ran on the samples op by op inside; its result,
    # a TensorRef, reached the call's plain leaves past the region's node, and the parameters
    # got no gradient, silently; under a budget a second model's backward then unpacked a
    # saved activation of a call already freed (on "sim", the process aborted)
    def run():
        grads = []
        for _ in range(2):  # (two models, one after the other)
            torch.manual_seed(0)
            model = _Noisy().to(tm.torch_device)
            x = torch.randn(4, 8).to(tm.torch_device)
            model.eval()
            model(x)  # (with gradients on, in eval mode: the call measured)
            model.train()
            opt = torch.optim.Adam(model.parameters(), lr=0.01)
            for _ in range(3):
                opt.zero_grad()
                model(x).sum().backward()
                grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
                opt.step()
        return grads

    with plain_torch():
        expected = [[g.cpu() for g in step] for step in run()]
    if paged:  # (Genoa sends every block back: what a call saves becomes blocks, unpacked by hooks)
        tm.strategy = "genoa"
        tm.budget = budget(4096)
    got = run()
    assert all(g is not None for step in got for g in step)
    for g, e in zip(got, expected):
        assert_identical(g, e)
