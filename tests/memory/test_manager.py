"""Tests of the tensorsManager's settings, statistics, thread safety and budget errors."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import torchTensorRef
from paired import budget, outside, plain_torch, values
from torchTensorRef import BudgetBelowFloorError, OutOfBudgetError, TensorRef, strategies, tensorsManager
from torchTensorRef.memory.settings import CUDA_RESERVE_BYTES
from torchTensorRef.strategies import Genoa, Strategy
from torchTensorRef.core.tensor_ref import block_of

STAT_KEYS = {"bytes_to_device", "bytes_to_host", "peak_device_bytes", "device_bytes", "ops", "evictions"}
#: the suite's device (tests/conftest.py)
TEST_DEVICE = os.environ.get("TORCHTENSORREF_TEST_DEVICE", "sim")


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain CPU tensor (a TensorRef's bytes may be on the device or the host)."""
    return values(t).cpu()


def _on_test_device(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the test device (plain torch's) holding ``t``'s values."""
    with plain_torch():
        return torch.empty(t.shape, dtype=t.dtype).copy_(values(t))


def _is_what_the_device_has(nbytes) -> bool:
    """Whether ``nbytes`` is what no budget allows: on "sim" its ``sim_capacity``; on CUDA the
    memory the process can use less ``CUDA_RESERVE_BYTES``, which moves with other processes'
    allocations: more than nothing and at most the card's memory less the reserve."""
    kind = tensorsManager.device_kind
    assert kind in ("sim", "cuda"), f"no device capacity on {kind}"
    if kind == "sim":
        return nbytes == tensorsManager.sim_capacity
    total = torch.cuda.get_device_properties(torch.device(tensorsManager.device)).total_memory
    return nbytes is not None and 0 < nbytes <= total - CUDA_RESERVE_BYTES


def _state():
    gc.collect()  # (tensors of earlier tests that die now would change the counts in between)
    stats = tensorsManager.stats()
    # (a refusal for room collects reference cycles first, and counts that it did: Note
    # [Garbage holding device memory])
    del stats["garbage_collections"]
    return (tensorsManager.device, tensorsManager.strategy, tensorsManager.budget, stats)


# -- device --------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("sim", "sim"), ("SIM", "sim"), (" cpu ", "cpu"),
                                             (torch.device("cpu"), "cpu")])
def test_device_accepts(value, expected):
    tensorsManager.device = value
    assert tensorsManager.device == expected


@pytest.mark.parametrize("value", ["gpu", "", "tpu:0", 3, None, "cuda:x"])
def test_bad_device_raises_naming_accepted_values(value):
    x = torch.rand(8)
    x + 1
    before = _state()
    with pytest.raises(ValueError) as info:
        tensorsManager.device = value
    message = str(info.value)
    for accepted in ('"cpu"', '"sim"', '"cuda"', '"cuda:N"'):
        assert accepted in message
    assert repr(value) in message
    assert _state() == before


@pytest.mark.parametrize("value", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_cuda_raises(value, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = _state()
    with pytest.raises(ValueError, match="needs CUDA, which is not available") as info:
        tensorsManager.device = value
    assert '"sim"' in str(info.value)
    assert _state() == before


def test_device_change_keeps_values():
    x = torch.arange(10.0)
    y = x * 2
    tensorsManager.device = "cpu"
    z = y + x
    tensorsManager.device = TEST_DEVICE  # (not "sim": registering it in a CUDA process breaks CUDA's autograd)
    w = z + 1
    with torchTensorRef.disabled():
        expected = torch.arange(10.0) * 3 + 1
    assert torch.equal(_host(w), expected)


# -- strategy ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", strategies.NAMES)
def test_strategy_by_name(name):
    tensorsManager.strategy = name.upper()
    assert tensorsManager.strategy.name == name
    assert tensorsManager.stats()["strategy"] == name


def test_strategy_instance_is_attached_and_the_old_one_detached():
    old = tensorsManager.strategy
    mine = Genoa()
    tensorsManager.strategy = mine
    assert tensorsManager.strategy is mine
    assert mine.manager is tensorsManager
    assert old.manager is None


@pytest.mark.parametrize("value", ["lru", "", 3, None, object()])
def test_bad_strategy_raises_naming_accepted_values(value):
    before = _state()
    with pytest.raises(ValueError) as info:
        tensorsManager.strategy = value
    message = str(info.value)
    for name in strategies.NAMES:
        assert f'"{name}"' in message
    assert "Strategy" in message
    assert _state() == before
    assert tensorsManager.strategy.manager is tensorsManager


def test_strategy_class_instead_of_instance_says_how_to_fix():
    before = _state()
    with pytest.raises(ValueError, match=r"instance.*Genoa\(\)"):
        tensorsManager.strategy = Genoa
    assert _state() == before


# -- budget --------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("512MiB", 512 * 2**20), ("6GB", 6 * 10**9), ("1.5GiB", 3 * 2**29), ("64 kb", 64_000),
    (4096, 4096), (0, 0), (None, None),
])
def test_budget_accepts(value, expected):
    torch.ones(1)  # (a tensor: "cuda" knows its GPU, and so what it has)
    floor = outside()
    if floor and expected is not None and expected <= floor:
        # parsed, and refused: at or below what the device holds outside the manager (a GPU's
        # workspaces) nothing managed fits (Note [Budget on CUDA])
        with pytest.raises(BudgetBelowFloorError, match=f"more than .*{floor} bytes"):
            tensorsManager.budget = value
        assert tensorsManager.budget is None
        return
    tensorsManager.budget = value
    assert tensorsManager.budget == expected
    # the budget in force: no budget means what the device has (on "sim", its capacity; it
    # was compared with sim_capacity on CUDA too)
    in_force = tensorsManager.stats()["budget"]
    if expected is None:
        assert _is_what_the_device_has(in_force), in_force
    else:
        assert in_force == expected


@pytest.mark.parametrize("value", [-1, "-5MiB", "6 gigs", "MiB", "", 1.5, True, [1], "1e9"])
def test_bad_budget_raises_naming_accepted_values(value):
    tensorsManager.budget = budget("1MiB")
    before = _state()
    with pytest.raises(ValueError) as info:
        tensorsManager.budget = value
    message = str(info.value)
    assert "budget must be" in message and '"512MiB"' in message and "None" in message
    assert repr(value) in message
    assert _state() == before


def test_lowering_the_budget_evicts_down_to_it():
    x = torch.rand(1000)
    tensorsManager.strategy = _KeepEverything()
    y = x + 1
    size = tensorsManager.block_bytes(4000)  # (device bytes: as the device's allocator gives them)
    assert tensorsManager.stats()["device_bytes"] == 2 * size
    tensorsManager.budget = budget(size)
    assert tensorsManager.stats()["device_bytes"] <= size
    expected = _on_test_device(x) + 1  # (plain torch on the CPU: other kernels on CUDA)
    assert torch.equal(_host(y), _host(expected))


def test_budget_below_pinned_bytes_raises_and_keeps_the_old_budget():
    x = torch.rand(1000)
    tensorsManager.budget = budget(10_000)
    tensorsManager.pin(x)
    try:
        before = _state()
        with pytest.raises(OutOfBudgetError):
            tensorsManager.budget = budget(1000)
        assert _state() == before
    finally:
        tensorsManager.unpin(x)


class _KeepEverything(Strategy):
    """Never evicts on its own: only the budget makes the manager evict."""

    name = "keep-everything"


# -- statistics ----------------------------------------------------------------------------


def test_stats_keys():
    assert STAT_KEYS <= set(tensorsManager.stats())


def test_stats_count_moves_of_one_op():
    x = torch.rand(1000)
    tensorsManager.reset_stats()
    y = x + 1
    s = tensorsManager.stats()
    nx, ny = x.proxyInfo.nbytes, y.proxyInfo.nbytes
    assert s["ops"] == 1
    assert s["bytes_to_device"] == nx  # Genoa brings the input in
    assert s["bytes_to_host"] == ny  # and sends the new result back
    # (moves count the bytes copied, the peak device bytes as the device's allocator gives them)
    assert s["peak_device_bytes"] == tensorsManager.block_bytes(nx) + tensorsManager.block_bytes(ny)
    assert s["device_bytes"] == 0
    assert s["evictions"] == 2


def test_reset_stats_zeroes_counters_and_restarts_the_peak_from_now():
    tensorsManager.strategy = _KeepEverything()
    x = torch.rand(1000)
    x.toCPU()  # so that the op moves bytes
    y = x * 3
    before = tensorsManager.stats()
    assert before["bytes_to_device"] > 0 and before["ops"] > 0
    tensorsManager.reset_stats()
    after = tensorsManager.stats()
    for key in ("bytes_to_device", "bytes_to_host", "ops", "evictions"):
        assert after[key] == 0, key
    assert after["device_bytes"] == before["device_bytes"]
    assert after["peak_device_bytes"] == after["device_bytes"]
    del y


def test_stats_on_cpu_pass_through_move_nothing():
    tensorsManager.device = "cpu"
    x = torch.rand(1000)
    (x @ x).item()
    s = tensorsManager.stats()
    assert s["bytes_to_device"] == s["bytes_to_host"] == s["peak_device_bytes"] == 0
    assert s["ops"] > 0


# -- environment ---------------------------------------------------------------------------


def test_configure_from_environment():
    torchTensorRef.configure_from_environment(
        {"TORCHTENSORREF_DEVICE": "cpu", "TORCHTENSORREF_BUDGET": "2MiB", "TORCHTENSORREF_STRATEGY": ""})
    assert tensorsManager.device == "cpu"
    assert tensorsManager.budget == 2 * 2**20
    assert tensorsManager.strategy.name == "genoa"


def test_bad_environment_variable_is_named():
    with pytest.raises(ValueError, match="TORCHTENSORREF_BUDGET.*budget must be"):
        torchTensorRef.configure_from_environment({"TORCHTENSORREF_BUDGET": "lots"})
    assert tensorsManager.budget is None


# -- thread safety -------------------------------------------------------------------------


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


@pytest.mark.parametrize("managed_bytes", [None, 8192])
@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_backward_on_several_threads_gives_the_grads_of_plain_torch(strategy, managed_bytes, monkeypatch):
    # The device is asked after every op whether it held more than the budget (the fixture
    # fails the test where it did): a dying TensorRef's view of its device copy must not
    # outlive the release of its block, or another thread's op takes that room (Note [A
    # dying TensorRef's view] in ``core/tensor_ref.py``).
    monkeypatch.setattr(tensorsManager, "check_device", True)
    tensorsManager.strategy = strategy
    torch.manual_seed(0)
    model = _mlp()
    inputs = [torch.randn(8, 16) for _ in range(4)]
    with plain_torch():  # (the reference ran on the CPU: on CUDA, beside CUDA results)
        reference = _mlp()
        reference.load_state_dict({k: _on_test_device(v) for k, v in model.state_dict().items()})
        plain_inputs = [_on_test_device(x) for x in inputs]
        expected = [torch.autograd.grad(reference(x).square().sum(), list(reference.parameters()))
                    for x in plain_inputs]
    # (each thread makes its own workspaces: the budget leaves room for them; an earlier
    # test's plain device tensors in reference cycles would be read as outside, then freed)
    gc.collect()
    floor = outside()
    limit = None if managed_bytes is None else budget(managed_bytes, threads=len(inputs))
    tensorsManager.budget = limit
    params = list(model.parameters())
    assert all(isinstance(p, torch.nn.Parameter) and isinstance(p, TensorRef) for p in params)
    results, errors = [None] * len(inputs), []
    start = threading.Barrier(len(inputs))

    def work(i):
        try:
            start.wait()
            for _ in range(3):
                results[i] = torch.autograd.grad(model(inputs[i]).square().sum(), params)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in zip(results, expected):
        for g, w in zip(got, want):
            assert type(g) is TensorRef
            torch.testing.assert_close(_host(g), _host(w))
    if limit is not None:
        # (the threads' room is the manager's while their workspaces do not exist yet; the
        # fixture checks that nothing went past the budget beside them)
        assert tensorsManager.stats()["peak_device_bytes"] <= limit - floor


# -- an op larger than the budget ----------------------------------------------------------


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_op_larger_than_budget_raises_and_changes_nothing(strategy):
    tensorsManager.strategy = strategy
    x = torch.rand(1000)
    expected = _host(x).clone()
    gc.collect()  # (an earlier test's plain device tensors, in cycles, are not what the device holds now)
    floor = outside()
    need = 2 * tensorsManager.block_bytes(4000)  # (x and its result, as the device's allocator gives them)
    # x alone fits; its cumulative sum needs x and its result: 8000 bytes (a scan: it cannot
    # run in chunks, as an elementwise op does when it is larger than the budget)
    tensorsManager.budget = floor + 6000
    tensorsManager.reset_stats()
    before = _state()
    with pytest.raises(OutOfBudgetError) as info:
        x.cumsum(0)
    e = info.value
    # The traceback holds this frame: a cycle that would keep x alive, and resident, after the test.
    e.__traceback__ = None
    del info
    # (what it needed counts what the device holds outside the manager, as the budget does)
    assert (e.op, e.needed, e.budget, e.outside) == ("aten.cumsum.default", need + floor, 6000 + floor, floor)
    message = str(e)
    assert "aten.cumsum.default" in message and f"{need + floor} bytes" in message
    assert f"{6000 + floor} bytes" in message
    assert _state() == before
    assert torch.equal(_host(x), expected)
    tensorsManager.budget = budget(need)
    assert torch.equal(_host(x.cumsum(0)), _host(_on_test_device(x).cumsum(0)))


def test_out_of_budget_in_backward_names_the_op():
    torch.manual_seed(0)
    w = torch.randn(10000, requires_grad=True)
    loss = w.cumsum(0).sum()  # (its backward, a cumsum of a vector's gradient, is not split)
    tensorsManager.budget = budget(10000 * 4)
    with pytest.raises(OutOfBudgetError, match=r"op aten\.\w+"):
        loss.backward()
    assert w.grad is None


def test_evict_all_sends_unpinned_blocks_home_and_keeps_values():
    tm = tensorsManager
    tm.strategy = "flow"
    a, pinned = torch.ones(64), torch.ones(64)
    b = a * 3  # only on the device, dirty
    tm.pin(pinned)
    try:
        tm.evict_all()
        assert not a.proxyInfo.on_device and not b.proxyInfo.on_device
        assert pinned.proxyInfo.on_device
        assert tm.stats()["device_bytes"] == tm.block_bytes(pinned.proxyInfo.nbytes)
    finally:
        tm.unpin(pinned)
    with torchTensorRef.disabled():
        expected = torch.full((64,), 3.0)  # (was a TensorRef: compared with b's plain CPU bytes)
    assert torch.equal(_host(b.toCPU()), expected)


# -- dead tensors ---------------------------------------------------------------------------


def _resident_bytes():
    return sum(b.nbytes for b in tensorsManager.resident_blocks())  # (does not drain: stats() would)


def test_a_dead_tensor_frees_its_device_memory_at_once(fresh_manager):
    fresh_manager.strategy = "flow"  # no budget: results stay resident
    x = torch.ones(256)
    y = x * 2
    before = _resident_bytes()
    del y
    assert before - _resident_bytes() == 256 * 4  # no op has run since


def test_a_tensor_dying_mid_op_is_released_after_the_op(fresh_manager):
    fresh_manager.strategy = "flow"
    x = torch.ones(4)
    held = [x * 3]
    dead_block = block_of(held[0])
    released_in_op = []

    def drop(op):
        held.clear()  # the TensorRef dies while the manager is in the middle of this op
        released_in_op.append(not dead_block.alive)

    handle = fresh_manager.add_callback(before=drop)
    try:
        y = x + 1
    finally:
        handle.remove()
    assert released_in_op == [False]
    x + 1  # the next op releases it
    assert not dead_block.alive
    with torchTensorRef.disabled():
        assert torch.equal(y.toCPU().target, torch.full((4,), 2.0))


def test_a_tensor_dying_while_another_thread_holds_the_lock_is_released_later(fresh_manager):
    fresh_manager.strategy = "flow"
    x = torch.ones(4)
    y = x * 3
    block = block_of(y)
    holding, done = threading.Event(), threading.Event()

    def hold():
        with fresh_manager.lock:
            holding.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    holding.wait(10)
    del y  # must not wait for the other thread's lock
    assert block.alive
    done.set()
    t.join()
    x + 1
    assert not block.alive


# -- room ------------------------------------------------------------------------------------


def test_room_is_the_budget_less_the_resident_bytes(fresh_manager):
    torch.ones(1)  # (a tensor: "cuda" knows its GPU)
    # no budget: what the device has, less what it holds outside the manager
    assert _is_what_the_device_has(fresh_manager.room() + outside())
    fresh_manager.strategy = "flow"
    fresh_manager.budget = budget(10_000)  # (room leaves out what is outside the manager)
    assert fresh_manager.room() == 10_000
    x = torch.ones(500)  # 2000 bytes, made on the device (it fits)
    size = fresh_manager.block_bytes(2000)  # (as the device's allocator gives them)
    assert fresh_manager.room() == 10_000 - size
    x.toCPU()
    assert fresh_manager.room() == 10_000
    x.toGPU()
    assert fresh_manager.room() == 10_000 - size
    y = x + 1
    assert fresh_manager.room() == 10_000 - 2 * size
    del y
    assert fresh_manager.room() == 10_000 - size
    fresh_manager.budget = budget(size)  # exactly x: nothing else fits
    assert fresh_manager.room() == 0


def test_a_device_resolved_at_first_use_is_resolved_before_an_op_fetches(monkeypatch):
    # Fixed: on CUDA, tensorsManager.device = "cuda" with blocks alive left the backend
    # unresolved (no index, no streams until its first use), and the next op on a block on
    # the host fetched it with no streams: AttributeError 'copy_ordered'. Here the simulated
    # device is made to resolve as "cuda" does.
    x = torch.arange(10.0)
    tensorsManager.evict_all()
    backend = tensorsManager.backend
    streams = backend.streams
    resolved = []

    def resolve():
        resolved.append(True)
        backend.streams = streams

    monkeypatch.setattr(backend, "streams", None)
    monkeypatch.setattr(backend, "resolve", resolve, raising=False)
    monkeypatch.setattr(tensorsManager, "unresolved", True)
    monkeypatch.setattr(tensorsManager.accounting, "limit", None)  # (no limit is known until it is resolved)
    w = x + 1
    assert resolved == [True]
    with torchTensorRef.disabled():
        expected = torch.arange(10.0) + 1
    assert torch.equal(_host(w), expected)
