"""The fast path (Note [Fast path] in ops/dispatch.py): same results, same bookkeeping."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import tensorsManager
from torchTensorRef.ops import dispatch
from torchTensorRef.core.op_specs import spec_of
from paired import (EMULATED_WORKSPACES, ON_SIM, SIM_ONLY_REASON, assert_identical, budget, needs_fast_path,
                    plain_torch, sim_only, values)

aten = torch.ops.aten

#: where ops move nothing: Flow with no budget on "sim" (after the first touch), pass-through
FAST_DEVICES = ("sim", "cpu")


@pytest.fixture
def fast(fresh_manager, request):
    if request.param == "sim" and not ON_SIM:
        pytest.skip(SIM_ONLY_REASON)  # (not registered beside CUDA)
    if request.param == "sim" and EMULATED_WORKSPACES:
        pytest.skip("emulated workspaces: every op on \"sim\" takes the generic path (no fast path)")
    fresh_manager.strategy = "flow"
    fresh_manager.device = request.param
    assert fresh_manager.fast
    return fresh_manager


@pytest.fixture
def counted(monkeypatch):
    """Counts of the ops the fast path ran and the ones it handed to the generic path."""
    counts = {"fast": 0, "generic": 0}
    run_fast, run_generic = dispatch.run_fast, dispatch.run_generic

    def fast(*a):
        out = run_fast(*a)
        counts["fast"] += out is not dispatch._NOT_FAST
        return out

    def generic(*a):
        counts["generic"] += 1
        return run_generic(*a)

    monkeypatch.setattr(dispatch, "run_fast", fast)
    monkeypatch.setattr(dispatch, "run_generic", generic)
    return counts


def _model_step(x, w):
    """A forward and backward with views, in-place ops, several results and a reduction."""
    h = (x @ w).relu_()
    a, b = h.split(2, dim=1)
    v = h.t()[0]
    loss = (a * b).sum() + v.mean() + h.max(dim=0).values.sum()
    loss.backward()
    return loss


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_results_and_gradients_match_plain_torch(fast, counted):
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    w = torch.randn(4, 4, requires_grad=True)
    w.toGPU()
    x.toGPU()
    with torchTensorRef.disabled():
        px, pw = x.target.clone(), w.target.clone().requires_grad_()
        expected = _model_step(px, pw)
    got = _model_step(x, w)
    assert counted["fast"] > 10
    assert_identical(expected, got)  # (by value, each read where it is: plain ones on the device)
    assert_identical(pw.grad, w.grad)


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_a_view_shares_its_base_block_and_writes_survive_eviction(fast, counted):
    x = torch.arange(12.0).reshape(3, 4)
    x.toGPU()
    before = counted["fast"]
    row = x[1]
    col = x.t()[2]
    assert counted["fast"] > before  # the views were made on the fast path
    assert row.proxyInfo.block_id == x.proxyInfo.block_id == col.proxyInfo.block_id
    row.mul_(10)
    col.add_(0.5)
    fast.evict_all()  # one block: one write-back carries both writes
    with torchTensorRef.disabled():
        expected = torch.arange(12.0).reshape(3, 4)
        expected[1] *= 10
        expected[:, 2] += 0.5
    assert_identical(expected, x)
    assert_identical(expected[1], row)


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_stats_count_the_same_ops_as_the_generic_path(fast):
    def work():
        x = torch.ones(8, 8)
        x.toGPU()
        y = (x * 2 + 1).sum(dim=0)
        y.add_(1)
        return y.split(4)

    tensorsManager.reset_stats()
    work()
    fast_ops = tensorsManager.stats()["ops"]
    handle = tensorsManager.add_callback(before=lambda op: None)  # every op is seen: generic path
    try:
        assert not tensorsManager.fast
        tensorsManager.reset_stats()
        work()
        assert tensorsManager.stats()["ops"] == fast_ops
    finally:
        handle.remove()
    assert tensorsManager.fast


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_callbacks_and_recording_still_see_every_op(fast):
    x = torch.ones(4, 4)
    x.toGPU()
    seen = []
    handle = tensorsManager.add_callback(before=lambda op: seen.append(op.name))
    x + x
    handle.remove()
    assert seen == ["aten.add.Tensor"]
    if fast.device == "sim":  # (pass-through records nothing: nothing moves)
        with tensorsManager.recording() as trace:
            x * x
        assert [name for _i, name, *_ in trace.ops] == ["aten.mul.Tensor"]


@needs_fast_path
def test_a_block_that_must_be_fetched_takes_the_generic_path(fresh_manager, counted):
    fresh_manager.strategy = "flow"
    x = torch.ones(4, 4)  # created on the device (it fits): send it to the host
    x.toCPU()
    fresh_manager.reset_stats()
    counted.update(fast=0, generic=0)
    y = x + 1
    assert counted == {"fast": 0, "generic": 1}
    assert fresh_manager.stats()["bytes_to_device"] == x.proxyInfo.nbytes
    y + 1  # now everything is resident
    assert counted == {"fast": 1, "generic": 1}


@sim_only
@needs_fast_path
def test_check_device_reads_the_device_after_an_op_of_the_fast_path(fresh_manager, counted):
    """The device's own count is checked at the end of the ops the fast path runs too, so a
    suite run with ``check_device`` on keeps them on it."""
    tm = fresh_manager
    tm.strategy = "flow"
    checking = tm.check_device  # (on where the suite runs with TORCHTENSORREF_CHECK_DEVICE=1)
    x = torch.ones(1024)
    tm.budget = budget(64 * 1024)
    try:
        tm.check_device = True
        assert tm.fast
        y = x + 1
        tm.reset_stats()
        with torchTensorRef.disabled():  # the program's own device tensor, past the budget
            extra = torch.empty(60 * 1024, dtype=torch.uint8, device="sim")
        counted.update(fast=0, generic=0)
        y = x * y
        assert counted == {"fast": 1, "generic": 0}
        over = tm.stats()["device_overshoot_bytes"]
        assert 0 < over <= 60 * 1024
        with plain_torch():
            expected = torch.ones(1024) * (torch.ones(1024) + 1)
        assert_identical(y, expected)
        del extra
        tm.reset_stats()  # (the overshoot above was the test's own)
    finally:
        tm.check_device = checking


@needs_fast_path
def test_genoa_and_a_flow_budget_under_pressure_need_every_op(fresh_manager):
    assert not fresh_manager.fast  # conftest: Genoa on "sim"
    fresh_manager.strategy = "flow"
    assert fresh_manager.fast
    fresh_manager.budget = budget(7168)  # everything fits so far: nothing to learn yet
    assert fresh_manager.fast
    a, b = torch.ones(512), torch.ones(512)  # 2 KiB each
    c = a + b  # 6 KiB resident
    d = c + a  # the budget is full: room is made by evicting, so Flow learns from now on
    assert fresh_manager.under_pressure and not fresh_manager.fast
    fresh_manager.budget = None
    assert fresh_manager.fast
    fresh_manager.fault_injector = lambda op: None
    assert not fresh_manager.fast
    del c, d


def test_flow_keeps_the_budget_after_running_without_one(fresh_manager):
    """Ops on the fast path leave Flow no history: a budget set later must still hold."""
    fresh_manager.strategy = "flow"
    torch.manual_seed(0)
    ws = [torch.randn(64, 64) for _ in range(8)]

    def forward(x):
        for w in ws:
            x = (x @ w).tanh()
        return x

    x = torch.randn(4, 64)
    with torchTensorRef.disabled():
        expected = x.target.clone()
        for w in ws:
            expected = (expected @ w.target.clone()).tanh()
    assert_identical(expected, forward(x))
    managed = 3 * ws[0].proxyInfo.nbytes
    fresh_manager.budget = budget(managed)
    fresh_manager.reset_stats()
    for _ in range(3):
        assert_identical(expected, forward(x))
    assert fresh_manager.stats()["peak_device_bytes"] <= managed


@needs_fast_path
def test_out_of_memory_on_the_fast_path_evicts_and_retries(fresh_manager, monkeypatch):
    fresh_manager.strategy = "flow"
    other = torch.ones(256)
    other.toGPU()
    x = torch.ones(4, 4)
    x.toGPU()
    spec = spec_of(aten.add.Tensor)
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return aten.add.Tensor(*args, **kwargs)

    monkeypatch.setattr(spec, "call", fails_once)
    y = x + x  # the retry calls the op itself, not the failing fast-path callable
    assert len(calls) == 1
    assert not other.proxyInfo.on_device  # evicted to make room for the retry
    assert x.proxyInfo.on_device
    with torchTensorRef.disabled():
        assert torch.equal(y.toCPU().target, torch.full((4, 4), 2.0))


@needs_fast_path
def test_an_op_on_a_prefetched_block_takes_the_fast_path(fresh_manager, counted):
    """Under Flow's plan, a block a prefetch brought in is waited for and counted as a hit
    on the fast path: only ops with a block to fetch take the generic path."""
    from torchTensorRef.strategies import Flow

    fresh_manager.strategy = Flow(lookahead=2, prefetch_evicts=True)
    torch.manual_seed(0)
    ws = [torch.randn(64, 64) for _ in range(8)]
    x = torch.randn(4, 64)
    with torchTensorRef.disabled():
        expected = x.target.clone()
        for w in ws:
            expected = (expected @ w.target.clone()).tanh()
    fresh_manager.budget = budget(4 * ws[0].proxyInfo.nbytes)

    def forward():
        h = x
        for w in ws:
            h = (h @ w).tanh()
        return h.toCPU()

    for _ in range(6):
        assert_identical(expected, forward())  # (on the host: the result was sent there)
    assert fresh_manager.strategy.plan is not None
    fresh_manager.reset_stats()
    counted.update(fast=0, generic=0)
    assert_identical(expected, forward())
    stats = fresh_manager.stats()
    assert stats["prefetch_hits"] > 0
    assert counted["generic"] <= stats["prefetch_misses"]  # (each generic op fetched a block)
    assert counted["fast"] >= stats["prefetch_hits"]


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_list_ops_with_nothing_to_slice_take_the_fast_path(fast, monkeypatch):
    # An optimizer's list (foreach) kernels: with no budget there is nothing to run in
    # slices, and they cost what any op does on the fast path.
    from torchTensorRef.ops import foreach

    generic = []  # (op, the TensorRefs of its first list) of each op on the generic path
    run_generic = dispatch.run_generic

    def counted(func, args, *rest):
        first = args[0] if args and isinstance(args[0], (list, tuple)) else ()
        generic.append((str(func), [t for t in first if isinstance(t, torchTensorRef.TensorRef)]))
        return run_generic(func, args, *rest)

    for module in (dispatch, foreach):
        monkeypatch.setattr(module, "run_generic", counted)

    def steps(params):
        opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
        for _ in range(2):
            for p in params:
                p.grad = p.detach() * 0.5 + 1
            generic.clear()  # (the first step makes AdamW's state: new blocks)
            opt.step()
        return params

    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    for p in params:
        p.toGPU()
    with plain_torch():  # (plain torch on the same device: its list kernels, as the managed step's)
        expected = steps([values(p).clone().to(fast.torch_device).requires_grad_() for p in params])
    got = steps(params)
    # the second step's list ops over the parameters and their state ran on the fast path
    # (its step counts, CPU scalars beside a device's tensors, are host-only blocks)
    assert [op for op, first in generic if "_foreach" in op and any(t.device == params[0].device for t in first)] == []
    for e, g in zip(expected, got):
        assert_identical(e, g)


FILLS = {
    "ones_like": lambda t: torch.ones_like(t), "zeros_like": lambda t: torch.zeros_like(t),
    "full_like": lambda t: torch.full_like(t, 2.5), "empty_like filled": lambda t: torch.empty_like(t).fill_(3),
    "new_zeros": lambda t: t.new_zeros(4, 2), "new_full": lambda t: t.new_full((3,), 7.0),
}


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
@pytest.mark.parametrize("make", list(FILLS))
def test_a_fill_like_a_resident_tensor_takes_the_fast_path(fast, counted, monkeypatch, make):
    # With no budget a fill made like a resident TensorRef (autograd's ones_like for the
    # loss's gradient, each step) ran on a meta stand-in, whose meta kernels are Python: a
    # hundred times the op. Its strides follow the source's (a transposed one here).
    from torchTensorRef.ops import metadata_only

    monkeypatch.setattr(metadata_only, "run_generic", dispatch.run_generic)  # (counted there too)
    fill = FILLS[make]
    with plain_torch():
        expected = fill(torch.arange(12.0, device=fast.torch_device).reshape(3, 4).t())
    source = torch.arange(12.0).reshape(3, 4).t()
    source.add_(0)  # (resident: written by an op)
    counted["fast"] = counted["generic"] = 0
    got = fill(source)
    assert counted == {"fast": 1 + (make == "empty_like filled"), "generic": 0}
    assert isinstance(got, torchTensorRef.TensorRef) and got.device == expected.device
    assert got.stride() == expected.stride()
    assert_identical(expected, got)


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_a_random_fill_like_a_resident_tensor_draws_as_plain_torch(fast):
    with plain_torch():
        torch.manual_seed(3)
        expected = torch.randn_like(torch.zeros(5, 2, device=fast.torch_device))
    source = torch.zeros(5, 2)
    source.add_(0)
    torch.manual_seed(3)
    assert_identical(expected, torch.randn_like(source))


@pytest.mark.parametrize("fast", FAST_DEVICES, indirect=True)
def test_a_fill_seen_by_callbacks_does_not_read_its_source(fast):
    # With the fast path closed (a callback watches every op) a fill runs on its stand-in:
    # the op the callback sees reads no block, as the fill reads no byte of its source.
    source = torch.arange(12.0).reshape(3, 4)
    source.add_(0)
    seen = []
    handle = tensorsManager.add_callback(before=lambda op: seen.append((op.name, list(op.blocks))))
    try:
        got = torch.ones_like(source)
    finally:
        handle.remove()
    assert [(name, blocks) for name, blocks in seen if "ones_like" in name] == [("aten.ones_like.default", [])]
    with plain_torch():
        expected = torch.ones_like(torch.arange(12.0, device=fast.torch_device).reshape(3, 4))
    assert_identical(expected, got)
