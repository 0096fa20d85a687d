"""The host budget: host copies past it go to disk, come back where needed, and nothing is lost."""

from __future__ import annotations

import gc

import pytest
import torch

import torchTensorRef
from paired import budget, plain_torch, values
from torchTensorRef import DiskError, HostBudgetError, tensorsManager
from torchTensorRef.core.tensor_ref import block_of, host_view

N = 64 * 64 * 4  # bytes of one weight


def held() -> int:
    """Host bytes that cannot leave host memory, left by earlier tests (shared with plain
    tensors or numpy): the budgets below are set above them."""
    gc.collect()
    tensorsManager.synchronize()
    return sum(b.nbytes for b in tensorsManager.host_tier.hosted.values() if b.host_shared or b.external)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain CPU tensor (a TensorRef's bytes may be on the device, the host or disk)."""
    return values(t).cpu()


def _full(shape, value) -> torch.Tensor:
    """A plain CPU tensor filled with ``value``, to compare bytes with (``torch.full`` makes a TensorRef)."""
    with torchTensorRef.disabled():
        return torch.full(shape, value)


def _weights(n: int = 12):
    torch.manual_seed(0)
    return [torch.randn(64, 64) for _ in range(n)], torch.randn(2, 64)


def _chain(ws, x):
    for w in ws:
        x = torch.tanh(x @ w)
    return x


def _spilled(tmp_path, strategy: str, value: float, wait: bool = True):
    """A TensorRef of ``value``s and its block, its host copy leaving for disk (``wait``: gone)."""
    tm = tensorsManager
    tm.strategy = strategy
    tm.offload_dir = tmp_path
    a = torch.full((64, 64), value)
    tm.evict_all()
    block = block_of(a)
    with tm.lock:
        tm.host_tier.leave_host(block)
    if wait:
        tm.host_tier.retire_spills(wait=True)
    return a, block


def _written_while_held(a, value: float) -> None:
    """``a``'s host copy held outside the manager and filled there, as a piece's result lands."""
    block = block_of(a)
    tensorsManager.mark_external(block)
    try:
        with torchTensorRef.disabled():
            host_view(a).fill_(value)
    finally:
        tensorsManager.unmark_external(block)


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_host_copies_past_the_host_budget_go_to_disk_and_values_match(strategy):
    tm = tensorsManager
    with plain_torch():
        want = _chain(*_weights())
    tm.strategy = strategy
    tm.budget = budget(3 * N + 4096)
    ws, x = _weights()
    tm.evict_all()  # every weight now has a host copy: 12 of them
    base = held()
    tm.host_budget = base + 4 * N
    tm.synchronize()
    assert tm.stats()["bytes_to_disk"] >= 8 * N  # the weights had no copy on disk: written once
    tm.reset_stats()
    for _ in range(3):
        got = _chain(ws, x)
        assert torch.equal(_host(got), _host(want))  # (on CUDA, got may be on the host, want on the GPU)
    stats = tm.stats()
    assert stats["peak_host_bytes"] <= base + 4 * N
    assert stats["bytes_from_disk"] >= 3 * 4 * N  # (at least what is not held in host or device memory)
    assert stats["bytes_to_disk"] < 2 * N  # ... and never again: their spill slots stay valid
    assert all(torch.equal(_host(w), _host(p)) for w, p in zip(ws, _plain_weights()))


def _plain_weights():
    with plain_torch():
        return _weights()[0]


def test_a_written_block_leaves_its_disk_copy_and_is_spilled_again():
    tm = tensorsManager
    tm.strategy = "genoa"
    tm.budget = budget(2 * N)
    a, b, c = (torch.ones(64, 64) * i for i in (1, 2, 3))
    tm.evict_all()
    tm.host_budget = held() + N
    assert tm.stats()["host_bytes"] <= tm.host_budget and block_of(a).disk is not None
    a.add_(10)  # read back, written: the spilled copy is stale now
    assert block_of(a).disk is None
    tm.evict_all()
    b.sum()  # makes room on the host: a is spilled again
    tm.synchronize()
    assert torch.equal(_host(a), _full((64, 64), 11.0))
    assert torch.equal(_host(b), _full((64, 64), 2.0)) and torch.equal(_host(c), _full((64, 64), 3.0))


def test_host_only_readers_get_bytes_from_disk():
    tm = tensorsManager
    t = torch.arange(4096, dtype=torch.float32)
    tm.evict_all()
    tm.host_budget = held() + 0
    tm.synchronize()
    assert block_of(t).host is None and block_of(t).disk is not None
    tm.host_budget = None
    assert t.tolist() == list(range(4096))
    with torchTensorRef.disabled():
        assert torch.equal(_host(t), torch.arange(4096, dtype=torch.float32))


def test_a_host_budget_too_small_for_one_op_names_the_setting_and_loses_nothing():
    tm = tensorsManager
    tm.budget = budget(4 * N)
    t = torch.full((64, 64), 5.0)
    tm.evict_all()
    tm.host_budget = held() + 0
    tm.synchronize()
    tm.host_budget = held() + N // 2
    with pytest.raises(HostBudgetError, match="host_budget"):
        t.sum()  # its bytes must come back through host memory
    tm.host_budget = held() + N
    assert t.sum().item() == 5.0 * 64 * 64


def test_host_budget_settings_are_checked_and_a_refused_one_changes_nothing(tmp_path):
    tm = tensorsManager
    with pytest.raises(ValueError, match="host_budget"):
        tm.host_budget = "lots"
    assert tm.host_budget is None
    base = held()
    with torchTensorRef.disabled():
        plain = torch.ones(64, 64)
    t = torchTensorRef.TensorRef(plain)  # shares a plain tensor's bytes: cannot leave
    with pytest.raises(HostBudgetError):
        tm.host_budget = base + 16
    assert tm.host_budget is None and block_of(t).host is not None
    tm.host_budget = "1GiB"
    assert tm.host_budget == 2**30 and tm.stats()["host_budget"] == 2**30


def test_offload_dir_holds_the_spill_file_until_its_tensors_leave_it(tmp_path):
    tm = tensorsManager
    # (tensors earlier tests keep alive go to a file of their own first: in the first file
    # they would keep it after t leaves)
    tm.offload_dir = tmp_path / "earlier"
    tm.host_budget = held() + 0
    tm.synchronize()
    tm.host_budget = None
    tm.offload_dir = tmp_path / "first"
    t = torch.ones(64, 64)
    tm.evict_all()
    tm.host_budget = held() + 0
    tm.synchronize()
    first = list((tmp_path / "first").iterdir())
    assert [p.name.startswith("torchTensorRef-spill") for p in first] == [True]
    tm.offload_dir = tmp_path / "second"
    tm.host_budget = held() + N
    u = torch.full((64, 64), 2.0)
    tm.evict_all()
    tm.host_budget = held() + 0
    tm.synchronize()
    assert len(list((tmp_path / "second").iterdir())) == 1
    assert first[0].exists()  # t is still there
    tm.host_budget = None
    assert t.sum().item() == 4096.0
    del t  # its slot was the last of the first file
    tm.synchronize()
    assert not first[0].exists()
    assert u.sum().item() == 2 * 4096.0


def test_a_host_copy_held_while_its_spill_runs_keeps_what_is_written_into_it(tmp_path):
    # Found by the model sessions: a Mixtral's stacked experts scaled in chunks under a host
    # budget. The result's host copy was being spilled when the chunks' pieces came to alias
    # it (held outside the manager: Note [External bytes]) and were written into it; the
    # spill then ended and dropped that host copy, keeping the bytes read before the writes.
    a, block = _spilled(tmp_path, "genoa", 1.0, wait=False)
    assert block.spilling is not None
    block.spilling.pending.wait_host()  # (its bytes are on disk: the writes below come after)
    _written_while_held(a, 5.0)
    tensorsManager.host_tier.retire_spills(wait=True)
    assert torch.equal(_host(a), _full((64, 64), 5.0))


def test_a_host_copy_read_back_from_disk_then_written_by_its_holders_is_not_lost(tmp_path):
    # Found by the model sessions: a Mixtral's stacked experts scaled in chunks under a host
    # budget. The result's host copy had been spilled and read back (its disk copy kept, as
    # it held the same bytes) when the chunks' pieces came to alias it and wrote into it; the
    # host budget then dropped that host copy, as the disk one seemed current, and the result
    # read back what the spill had written before the chunks ran.
    tm = tensorsManager
    a, block = _spilled(tmp_path, "genoa", 1.0)
    assert block.host is None and block.disk is not None
    _written_while_held(a, 5.0)  # (read back first: its holders see its bytes)
    tm.host_budget = held() + 0  # (its host copy goes: to disk again, or dropped if disk held it)
    tm.synchronize()
    tm.host_budget = None
    assert block.host is None
    assert torch.equal(_host(a), _full((64, 64), 5.0))


def test_a_host_copy_held_to_be_read_keeps_its_disk_copy_and_stays(tmp_path):
    # An op's pieces that only read a block hold its host copy as any holder does, but the
    # disk copy still holds its bytes: it stays, and the host copy is not written to disk
    # again. Held, the host copy stays too, even where a strategy asks to drop it to make
    # room for a read ahead (the disk copy holds its bytes): the pieces view it.
    tm = tensorsManager
    a, block = _spilled(tmp_path, "flow", 3.0)
    tm.mark_external(block, writes=False)  # (read back from disk)
    try:
        assert block.host is not None and block.disk is not None
        assert not tm.drop_host_copy(block) and block.host is not None
    finally:
        tm.unmark_external(block)
    assert tm.drop_host_copy(block) and block.host is None  # (free to drop again)
    assert torch.equal(_host(a), _full((64, 64), 3.0))


def test_a_full_disk_raises_and_keeps_the_host_copy(monkeypatch, tmp_path):
    tm = tensorsManager
    tm.offload_dir = tmp_path  # a new spill file, not yet opened
    t = torch.full((64, 64), 7.0)
    tm.evict_all()
    monkeypatch.setattr(tm.host_tier.spill(), "path", "/dev/full")
    with pytest.raises(DiskError, match="disk is full"):
        tm.host_budget = held() + 0
        tm.synchronize()
    tm.host_budget = None
    assert block_of(t).host is not None and block_of(t).disk is None
    assert torch.equal(_host(t), _full((64, 64), 7.0))


def test_the_trace_has_a_disk_lane():
    tm = tensorsManager
    tm.budget = budget(2 * N)
    ws, x = _weights(4)
    tm.evict_all()
    with tm.recording() as trace:
        tm.host_budget = held() + 2 * N
        _chain(ws, x)
    kinds = {k for k, *_ in trace.disk}
    assert kinds == {"from_disk", "to_disk"}
    assert any(e.get("cat") == "disk" for e in trace.chrome_events())


def test_the_environment_sets_the_host_budget(tmp_path):
    tm = tensorsManager
    torchTensorRef.configure_from_environment({"TORCHTENSORREF_HOST_BUDGET": "3MiB",
                                               "TORCHTENSORREF_OFFLOAD_DIR": str(tmp_path)})
    assert tm.host_budget == 3 * 2**20 and tm.offload_dir == str(tmp_path)
    with pytest.raises(ValueError, match="TORCHTENSORREF_HOST_BUDGET"):
        torchTensorRef.configure_from_environment({"TORCHTENSORREF_HOST_BUDGET": "x"})


def test_tensors_made_in_host_memory_are_counted_within_the_host_budget():
    tm = tensorsManager
    tm.host_budget = held() + 3 * N
    tm.reset_stats()
    made = [torch.tensor([[float(i)] * 64] * 64) for i in range(10)]  # from data: made in host memory
    tm.synchronize()
    assert tm.stats()["peak_host_bytes"] <= tm.host_budget
    assert tm.stats()["bytes_to_disk"] >= 7 * N
    assert [t[0, 0].item() for t in made] == [float(i) for i in range(10)]


def test_host_copies_still_being_written_back_are_spilled_once_their_copies_end(monkeypatch, tmp_path):
    # Fixed: with the write-backs in flight (a GPU's copies outlast the op that starts them),
    # no host copy could leave yet and the smaller host budget was refused.
    tm = tensorsManager
    monkeypatch.setattr(tm, "sim_copy_ops", 2)
    tm.strategy = "flow"
    tm.offload_dir = tmp_path
    base = held()
    ys = [torch.full((64, 64), float(i)) * 2 for i in range(4)]  # only on the device
    tm.evict_all()  # their write-backs are in flight
    assert all(block_of(y).host_pending is not None for y in ys)
    tm.host_budget = base + 2 * N
    try:
        assert sum(block_of(y).host is None and block_of(y).disk is not None for y in ys) >= 2
        assert all(torch.equal(_host(y), _full((64, 64), 2.0 * i)) for i, y in enumerate(ys))
    finally:
        tm.host_budget = None
