"""What a region leaves allocated on the device after its call: nothing beside the manager's
blocks, so that when the blocks it used are evicted their device memory is free again,
without waiting for the garbage collector.
"""

from __future__ import annotations

import gc

import pytest
import torch

import torchTensorRef
from torchTensorRef import regions, tensorsManager as tm
from conftest import TEST_DEVICE
from paired import assert_identical, budget, plain_torch


@pytest.fixture(autouse=True)
def regions_on():
    previous = regions.enabled, regions.min_ops, regions.under_budget
    regions.enabled, regions.min_ops, regions.under_budget = True, 0, True
    yield
    regions.enabled, regions.min_ops, regions.under_budget = previous


@pytest.fixture
def no_collector():
    """The cyclic garbage collector off: a cycle would hold what it holds for the test's length."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def layers():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).eval()
            for _ in range(3)]


def layer_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


@pytest.mark.parametrize("strategy", list(torchTensorRef.strategies.NAMES))
def test_evicted_blocks_of_a_region_leave_no_device_memory_behind(strategy, no_collector):
    tm.device = TEST_DEVICE
    with plain_torch():
        x = torch.randn(2, 64)
        plain_layers = [m.to(tm.torch_device) for m in layers()]
        with torch.no_grad():
            plain = x.to(tm.torch_device)
            for m in plain_layers:
                plain = m(plain)
    managed = [regions.region(m) for m in layers()]
    tm.strategy = strategy
    # room for one layer's weights and the activations: each layer evicts the one before
    tm.budget = limit = budget(layer_bytes(managed[0]) * 3 // 2)
    floor = tm.outside_bytes()
    out = torchTensorRef.manage(x.cpu())
    with torch.no_grad():
        for _ in range(3):  # (the first calls are measured op by op)
            out = torchTensorRef.manage(x.cpu())
            for m in managed:
                out = m(out)
                # a region's plain views and the SimTensors given for them are gone with the call:
                # nothing but the manager's blocks (and what the device held before) is allocated
                assert tm.outside_bytes() <= floor + 4096
    assert tm.stats()["evictions"] > 0
    assert_identical(plain, out)
    assert tm.stats()["peak_device_bytes"] <= limit


def test_a_region_s_outputs_do_not_stay_counted_as_outside_the_manager(monkeypatch):
    # A reading of the device taken while the call's new tensors were allocated and not yet
    # blocks (a room check does read it, every 64th time or when the last reading says it does
    # not fit) counted them as outside; remembered, it made the next calls look larger than
    # the budget, and a Llama's decoder layer ran op by op
    tm.device = TEST_DEVICE
    layer = regions.region(layers()[0])
    tm.strategy = "flow"
    tm.budget = budget(layer_bytes(layer) * 4)
    floor = tm.outside_bytes()
    room = tm.device_room.make

    def reading_room(*args, **kwargs):
        tm.read_outside()  # (as a room check that reads the device)
        return room(*args, **kwargs)

    x = torch.randn(64, 64)
    with torch.no_grad():
        layer(x)  # (measured op by op)
        monkeypatch.setattr(tm.device_room, "make", reading_room)
        out = layer(x)
        monkeypatch.undo()
    assert tm.accounting.elsewhere_bytes <= floor + 4096, (tm.accounting.elsewhere_bytes, floor)
    with plain_torch():
        plain = layers()[0].to(tm.torch_device)
        with torch.no_grad():
            assert_identical(plain(x.to(tm.torch_device)), out)


class Fan(torch.nn.Module):
    """Small outputs, many of them: each takes more on the device than its bytes."""

    def __init__(self, outputs=8, width=25):
        super().__init__()
        self.outputs = outputs
        self.w = torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        return tuple(x * self.w + i for i in range(self.outputs))


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_room_for_a_region_s_outputs_is_made_at_the_size_the_allocator_gives_them(strategy, monkeypatch):
    # Room is made for a region's new outputs once they are allocated. With allocations
    # counted as CUDA's allocator counts them (512-byte multiples), room made at their exact
    # bytes (8 x 100) was short of what they take (8 x 512), and where making room read the
    # device, the reading counted them outside the manager too: a 3 KiB overshoot (an
    # overshoot in `generate()` of a Whisper model under Flow), and once sized right, an
    # OutOfBudgetError from counting them twice.
    monkeypatch.setattr(tm, "sim_rounding", True)
    tm.strategy = strategy
    torch.manual_seed(0)
    fan = regions.region(Fan().requires_grad_(False))
    x = torch.rand(25)
    filler = [torch.rand(25) for _ in range(12)]  # (each a 512-byte block on the device)
    with plain_torch():
        expected = Fan().to(TEST_DEVICE).requires_grad_(False)
        expected.w.copy_(fan.w.target.to(TEST_DEVICE) if TEST_DEVICE != "cpu" else fan.w.target)
        expected = expected(x.target.to(TEST_DEVICE))
    tm.budget = budget(16 * 512)
    tm.reset_stats()
    for _ in range(130):  # (the first call measures it op by op; every 64th room check reads the device)
        for t in filler:
            t.toGPU()
        got = fan(x)
    for e, g in zip(expected, got):
        assert_identical(e, g)
    stats = tm.stats()
    assert stats["worst_overshoot_bytes"] == 0 and stats["peak_device_bytes"] <= tm.budget, stats


_SEEN: list = []


class _Seeing(torch.nn.Linear):
    """A Linear recording what its forward reads of its weight (in a list outside the module;
    not the tensor itself: a view the program keeps is a view the manager must not reuse)."""

    def forward(self, x):
        w = self.weight
        _SEEN.append((id(w), w.__class__, w.requires_grad, dict(w.__dict__)))
        return super().forward(x)


@pytest.fixture
def lenient():
    """Plain device tensors on "sim" (CUDA as it is): a call is given plain views, not SimTensors."""
    previous = tm.sim_strict
    tm.sim_strict = False
    tm.device = TEST_DEVICE
    yield
    tm.sim_strict = previous


def test_a_parameter_s_alias_is_given_again_until_its_copy_or_attributes_change(lenient, no_collector):
    """Note [Views need gradients as their tensors do]: a call without gradients gets, for a
    parameter that needs them, an alias of its view that needs them too; the same one call
    after call while its device copy and attributes stay, a new one where they change, and
    it never keeps an evicted copy allocated."""
    tm.strategy = "flow"  # (no budget: it keeps what it brought in)
    torch.manual_seed(0)
    layer = regions.region(_Seeing(64, 64))
    x = torchTensorRef.manage(torch.randn(2, 64))
    _SEEN.clear()
    with torch.no_grad():
        for _ in range(3):
            layer(x)
    alias = layer.weight._tr_alias  # (kept on the TensorRef with its view)
    assert [seen[:3] for seen in _SEEN[-2:]] == [(id(alias), torch.Tensor, True)] * 2
    assert all(grad and attrs.get("_is_param") for _id, _cls, grad, attrs in _SEEN)
    del alias

    layer.weight.tag = "a"
    with torch.no_grad():
        layer(x)
    assert _SEEN[-1][3].get("tag") == "a"
    del layer.weight.tag
    with torch.no_grad():
        layer(x)
    assert "tag" not in _SEEN[-1][3] and "tag" not in layer.weight.__dict__

    tm.synchronize()
    floor = tm.outside_bytes()
    tm.evict_all()
    tm.synchronize()  # (a GPU's copies out end: what stays allocated is what something views)
    assert tm.stats()["evictions"] > 0
    assert tm.outside_bytes() <= floor  # (no alias kept a dropped copy allocated)
    with torch.no_grad():
        out = layer(x)
    assert layer.weight._tr_alias is not None and _SEEN[-1][0] == id(layer.weight._tr_alias)
    with plain_torch():
        torch.manual_seed(0)
        plain_layer = torch.nn.Linear(64, 64).to(tm.torch_device)
        plain_x = torch.randn(2, 64).to(tm.torch_device)
        with torch.no_grad():
            plain = plain_layer(plain_x)
    assert_identical(plain, out)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_a_region_larger_than_the_host_budget_runs_op_by_op(fresh_manager, tmp_path, grad):
    # Genoa, no device budget, a host budget of half the weights (the disk tier below it):
    # as one op the call's working set, every weight read from disk into host copies at
    # once, raised HostBudgetError; op by op, each op's tensors fit.
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])

    with plain_torch():
        plain, px = model().to(TEST_DEVICE), torch.ones(2, 64, device=TEST_DEVICE)
        expected = plain(px)
        if grad:
            expected.sum().backward()
    managed = regions.region(model())
    weights = sum(p.nbytes for p in managed.parameters())
    fresh_manager.strategy = "genoa"
    fresh_manager.offload_dir = tmp_path
    fresh_manager.host_budget = weights // 2
    try:
        for _ in range(3):
            managed.zero_grad()
            with torch.set_grad_enabled(grad):
                out = managed(torch.ones(2, 64))
                if grad:
                    out.sum().backward()
            assert_identical(expected, out)
        for p, q in zip(managed.parameters(), plain.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if grad:
                assert_identical(q.grad, p.grad)
        assert fresh_manager.stats()["bytes_to_disk"] > 0
    finally:
        fresh_manager.host_budget = None


def test_a_region_whose_backward_is_larger_than_the_host_budget_runs_it_op_by_op(fresh_manager, tmp_path):
    # Found by the model sessions: a Llama under Genoa, no device budget, a host budget of its
    # weights. Its call's tensors fit that budget; its backward's, the weights and what the
    # call saved, did not, and as one op it raised HostBudgetError reading them from disk.
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.ReLU())])

    with plain_torch():
        plain = model().to(TEST_DEVICE)
        torch.manual_seed(1)
        px = torch.randn(32, 64).to(TEST_DEVICE)
        expected = plain(px)
        expected.sum().backward()
    managed = regions.region(model())
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    weights = sum(p.nbytes for p in managed.parameters())
    fresh_manager.strategy = "genoa"
    fresh_manager.offload_dir = tmp_path
    fresh_manager.host_budget = weights + x.nbytes + 1024  # (the call's tensors, not the backward's)
    try:
        for _ in range(3):
            managed.zero_grad()
            with fresh_manager.recording(regions=True) as trace:
                out = managed(x)
                out.sum().backward()
            assert_identical(expected, out)
            for p, q in zip(managed.parameters(), plain.parameters()):
                assert_identical(q.grad, p.grad)
        names = [name for _i, name, *_ in trace.ops]
        assert names.count("region Sequential") == 1 and names.count("aten.threshold_backward.default") == 4
    finally:
        fresh_manager.host_budget = None
