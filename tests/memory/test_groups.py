"""Region groups: a region's tensors brought in with one allocation and one copy, counted as
the device counts them, and seen by the program as separate tensors (Note [Region groups]
in ``memory/groups.py``)."""

from __future__ import annotations

import gc
import io
import sys

import pytest
import torch

from paired import assert_identical, budget, plain_torch, sim_only, to_plain
import torchTensorRef
from torchTensorRef import regions, tensorsManager as tm
from torchTensorRef.analysis.offline import reference_moves
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.memory import groups
from torchTensorRef.strategies import Flow

WIDTH = 64
LAYERS = 32  # (a layer's group is 1/16 of the budget at half the weights: small enough to be one)


def _stack(layers=LAYERS):
    """Residual MLP blocks (seeded): each a region whose two weights and first bias (their
    sizes multiples of 512 bytes) make its group, and whose last bias (256 bytes) stays out."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(layers)])


def _input():
    return torch.rand(2, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu").to(tm.torch_device)


def _forward(model, x):
    for layer in model:
        x = x + layer(x)
    return x


def _weights(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture
def as_regions():
    """Every layer a region, under a budget too."""
    previous = regions.enabled, regions.under_budget
    regions.enabled = regions.under_budget = True
    yield lambda model: [regions.region(layer) for layer in model]
    regions.enabled, regions.under_budget = previous


def _run(model, x, calls):
    with torch.no_grad():
        return [to_plain(_forward(model, x)) for _ in range(calls)]


def _plain(calls=1):
    with plain_torch():
        return _run(_stack().to(tm.torch_device), _input(), calls)


def _outside() -> int:
    with tm.lock:
        return tm.read_outside()


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_region_brings_its_group_in_with_one_copy(strategy, as_regions, monkeypatch):
    expected = _plain()[0]

    def run(grouped):
        if not grouped:
            monkeypatch.setattr(groups, "SHARE", 0.0)  # (no group is small enough)
        tm.strategy = Flow(prefetch_evicts=True) if strategy == "flow" else strategy
        model = _stack()
        as_regions(model)
        x = _input()
        tm.budget = budget(_weights(model) // 2)
        outside = _outside()
        readings = []
        handle = tm.add_callback(after=lambda op: readings.append(tm.read_outside()))
        try:
            for out in _run(model, x, 8):
                assert_identical(expected, out)
            tm.reset_stats()
            for out in _run(model, x, 4):
                assert_identical(expected, out)
        finally:
            handle.remove()
            tm.budget = None
            monkeypatch.undo()
        # the manager counts what the device holds: nothing it allocated reads as outside
        assert set(readings) == {outside}
        grouped_blocks = [block_of(p) for p in model.parameters() if block_of(p).group is not None]
        return tm.stats(), {id(b.group): b.group for b in grouped_blocks}.values()

    alone, none = run(False)
    grouped, made = run(True)
    # (a layer's weights and a bias or both: a tensor whose write-back was still in flight
    # when its region made the group stays out of it)
    assert not none and len(made) == LAYERS and all(len(g.members) >= 3 for g in made)
    saved = sum(len(g.members) - 1 for g in made)  # (copies saved per call)
    assert alone["copies_to_device"] == alone["fetches"] + alone["prefetches"]
    if strategy == "genoa":  # (everything goes back after each op: the same bytes either way)
        assert grouped["bytes_to_device"] == alone["bytes_to_device"]
        # each layer's group comes in with one copy where it was one per member, at each of 4 calls
        assert grouped["copies_to_device"] == alone["copies_to_device"] - saved * 4
    else:
        assert 2 * grouped["copies_to_device"] < grouped["fetches"] + grouped["prefetches"]
        assert grouped["bytes_to_device"] <= 1.10 * alone["bytes_to_device"]
        assert grouped["bytes_prefetched_ahead"] >= 0.95 * grouped["bytes_to_device"] > 0


@sim_only  # (the emulated workspaces are "sim"'s; on CUDA cuBLAS's are there already)
def test_a_group_is_small_beside_the_managers_share_not_the_workspaces_beside_it(as_regions):
    """On a GPU the budget also holds cuBLAS's workspaces, tens of MiB: a layer's group, half
    of what the manager may hold, is no small group for being an eighth of the budget with
    them. Weighed against the whole budget, each layer moved as one group, and room was
    made a whole group at a time, moving more bytes with 1 MiB workspaces than without
    (Flow's tests of its bytes failed so on the H200)."""

    def run(workspace):
        previous = tm.sim_workspace
        tm.sim_workspace = workspace
        try:
            tm.strategy = Flow(plan=False)
            model = _stack(4)
            as_regions(model)
            x = _input()
            tm.budget = budget(_weights(model) // 2)
            assert tm.stats()["outside_bytes"] >= 2 * workspace
            outs = _run(model, x, 4)
            tm.reset_stats()
            outs += _run(model, x, 4)
            grouped = [p for p in model.parameters() if block_of(p).group is not None]
            return outs, tm.stats(), grouped
        finally:
            tm.budget = None
            tm.sim_workspace = previous

    with plain_torch():
        expected = _run(_stack(4).to(tm.torch_device), _input(), 8)
    for workspace in (0, 2**20):
        outs, stats, grouped = run(workspace)
        for out, want in zip(outs, expected):
            assert_identical(want, out)
        assert not grouped, workspace  # (a layer's group is half the share: not small)
        if workspace == 0:
            alone = stats
    assert stats["bytes_to_device"] == alone["bytes_to_device"]
    assert stats["evictions"] == alone["evictions"]


def test_a_member_out_alone_stays_counted_until_its_group_goes(as_regions):
    tm.strategy = "flow"
    model = _stack()
    as_regions(model)
    x = _input()
    tm.budget = budget(_weights(model) // 2)
    _run(model, x, 3)
    tm.evict_all()
    layer = model[0]
    with torch.no_grad():
        layer(x)  # (its group comes in as one)
    members = [block_of(p) for p in layer.parameters() if block_of(p).group is not None]
    group = members[0].group
    assert group.base is not None and group.live == {b.id for b in members}
    others = sum(block_of(p).dev_bytes for p in layer.parameters()
                 if block_of(p).group is None and block_of(p).dev is not None)
    held = tm.stats()["device_bytes"]
    outside = _outside()
    tm.move_to_host(layer[0].weight)
    # its range of the group's buffer is still allocated: counted, not outside the manager
    assert tm.stats()["device_bytes"] == held and _outside() == outside
    assert group.base is not None and members[0].dev is None
    for p in layer.parameters():
        tm.move_to_host(p)
    assert group.base is None and tm.stats()["device_bytes"] == held - group.dev_bytes - others
    assert _outside() == outside
    with plain_torch():
        want = _stack()[0][0].weight.to(tm.torch_device) * 2
    assert_identical(want, layer[0].weight * 2)


def test_a_group_whose_member_changes_is_dissolved(as_regions):
    tm.strategy = "flow"

    def changed(model):
        with torch.no_grad():
            model[3][0].weight.data = model[3][0].weight.data * 0.5 + 1  # (a new tensor: peft's merges)
            model[5][2].weight.mul_(2)
        return model

    with plain_torch():
        plain = changed(_stack().to(tm.torch_device))
        expected = _run(plain, _input(), 1)[0]
    model = _stack()
    as_regions(model)
    x = _input()
    tm.budget = budget(_weights(model) // 2)
    _run(model, x, 3)
    old = block_of(model[3][2].weight).group
    changed(model)
    for out in _run(model, x, 3):
        assert_identical(expected, out)
    assert old.dissolved and block_of(model[3][0].weight).group is not old
    assert block_of(model[3][2].weight).group is not old


def test_training_with_groups_matches_plain_torch(as_regions):
    # (groups move as one only without gradients; in training their members page alone,
    # their host copies ranges of the group's buffer)
    def train(model, x, steps):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(steps):
            loss = _forward(model, x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(to_plain(loss.detach()))
        return losses

    with plain_torch():
        expected = train(_stack(8).to(tm.torch_device), _input(), 6)
    tm.strategy = "flow"
    model = _stack(8)
    as_regions(model)
    tm.budget = budget(2 * _weights(model))  # (half of the weights, gradients and moments)
    losses = train(model, _input(), 6)
    stats = tm.stats()
    tm.budget = None
    for want, got in zip(expected, losses):
        assert_identical(want, got, "loss")
    # (a layer whose weights stay on the device stays dirty after each step: no group is
    # made of tensors whose host copies are stale, nor needed for them)
    assert sum(block_of(p).group is not None for p in model.parameters()) >= 3
    assert stats["evictions"]  # (members written back into their ranges and fetched again)


def test_checkpoints_and_the_host_buffer_of_a_group(as_regions):
    tm.strategy = "flow"
    pinned = tm.backend.pinned.used
    model = _stack()
    as_regions(model)
    tm.budget = budget(_weights(model) // 2)
    _run(model, _input(), 3)
    assert sum(block_of(p).group is not None for p in model.parameters()) >= 3 * LAYERS
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    with plain_torch():
        plain = _stack()
        plain.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), map_location="cpu"))
        reference = _stack()
        for a, b in zip(plain.parameters(), reference.parameters()):
            assert torch.equal(a, b)
    tm.budget = None
    del model
    with tm.lock:
        tm.drain()
    assert tm.backend.pinned.used <= pinned  # (the groups' host buffers went with their members)



def test_a_group_dies_quietly_after_the_device_changed(as_regions, monkeypatch):
    # A model grouped on one device, the manager moved to the CPU, then the model dropped:
    # the group's host buffer goes with its last member, though the CPU has no pinned pool
    # (that raised in a finalizer, reported and ignored). The weights stay the model's.
    raised = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: raised.append(info.exc_value))
    tm.strategy = "flow"
    model = _stack()
    as_regions(model)
    tm.budget = budget(_weights(model) // 2)
    _run(model, _input(), 3)
    assert any(block_of(p).group is not None for p in model.parameters())
    weights = to_plain(model.state_dict())  # (drawn where the device draws: on CUDA, its generator)
    tm.budget = None
    with pytest.warns(UserWarning, match="tensorsManager.device changed to 'cpu' while"):
        tm.device = "cpu"
    with plain_torch():
        x = torch.rand(2, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu")
        reference = _stack()
        reference.load_state_dict(weights)
        expected = _run(reference, x, 1)[0]
    assert_identical(expected, _run(model, torchTensorRef.manage(x), 1)[0])
    del model
    gc.collect()
    assert raised == []


def test_a_recording_names_each_tensor_read_in_a_group(as_regions):
    # (the offline reference at group granularity reads them: Flow's bytes against it)
    expected = _plain()[0]
    tm.strategy = "flow"
    model = _stack()
    as_regions(model)
    x = _input()
    tm.budget = budget(_weights(model) // 2)
    try:
        _run(model, x, 8)
        share = tm.limit - _outside()
        tm.reset_stats()
        with tm.recording(regions=True) as trace:
            assert_identical(expected, _run(model, x, 1)[0])
        stats = tm.stats()
    finally:
        tm.budget = None
    made = {}
    for layer in model:
        members = [block_of(p) for p in layer.parameters() if block_of(p).group is not None]
        assert len(members) >= 3
        assert {trace.groups[b.id] for b in members} == {members[0].group.members[0].id}
        made[members[0].group.members[0].id] = members
    assert len(made) == LAYERS and set(trace.groups.values()) == set(made)
    assert len(trace.groups) == sum(len(m) for m in made.values())
    args = (trace.accesses, share, trace.initial, trace.created, trace.block_bytes)
    alone, grouped = reference_moves(*args), reference_moves(*args, groups=trace.groups)
    ahead = reference_moves(*args, groups=trace.groups, ahead=1)
    moved = stats["bytes_to_device"] + stats["bytes_to_host"]
    assert 0 < alone["bytes_to_device"] <= grouped["bytes_to_device"] <= ahead["bytes_to_device"]
    assert moved <= 1.10 * (ahead["bytes_to_device"] + ahead["bytes_to_host"])
