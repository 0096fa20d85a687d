"""The offline reference on small traces whose optimum can be worked out by hand."""

from __future__ import annotations

import gc

import pytest

from torchTensorRef.core.errors import OutOfBudgetError
from torchTensorRef.analysis.offline import reference_disk_moves, reference_moves
from paired import budget


def reads(*blocks, size=10):
    """One op per block, reading it: ``(op, block, nbytes, write)``."""
    return [(i, b, size, False) for i, b in enumerate(blocks)]


def test_everything_fits_moves_each_block_once():
    r = reference_moves(reads("a", "b", "a", "b"), budget=20)
    assert r["bytes_to_device"] == 20 and r["bytes_to_host"] == 0 and r["peak_device_bytes"] == 20


def test_evicts_the_block_used_farthest_in_the_future():
    # Room for two of a, b, c. Reading a b c a b: at c, a is needed next and b after it, so b
    # goes; then a is a hit and b is fetched again: 4 fetches (LRU would need 5).
    r = reference_moves(reads("a", "b", "c", "a", "b"), budget=20)
    assert r["bytes_to_device"] == 40


def test_dirty_blocks_are_written_back_clean_ones_dropped():
    accesses = [(0, "a", 10, True), (1, "b", 10, False), (2, "a", 10, False)]
    # room for one: b evicts dirty a (written back), then b (clean) is dropped for a
    r = reference_moves(accesses, budget=10)
    assert r["bytes_to_host"] == 10 and r["bytes_to_device"] == 10 + 10 + 10


def test_blocks_created_in_the_trace_need_no_copy_and_die_free():
    accesses = [(0, "x", 10, False), (0, "t", 10, True), (1, "t", 10, False), (1, "y", 10, True),
                (2, "y", 10, False)]
    r = reference_moves(accesses, budget=20, created={"t", "y"})
    # x is fetched; t and y are made on the device; t dies after op 1 (dropped, dirty or not)
    assert r["bytes_to_device"] == 10 and r["bytes_to_host"] == 0


def test_blocks_from_before_the_trace_come_back_next_step():
    # w existed before the step, so after its last use it is needed again next step: when
    # it must make room for z, the dirty w is written back; a created block would be dropped.
    accesses = [(0, "w", 10, True), (1, "z", 10, True)]
    r = reference_moves(accesses, budget=10, created={"z"})
    assert r["bytes_to_host"] == 10
    r = reference_moves(accesses, budget=10, created={"w", "z"})
    assert r["bytes_to_host"] == 0


def test_initial_residents_need_no_copy():
    r = reference_moves(reads("a", "b"), budget=20, initial={"a": (10, False)})
    assert r["bytes_to_device"] == 10


def test_blocks_take_the_room_the_allocator_gives_them():
    # a b a b with room for 20 bytes: two 10-byte blocks fit, but not once each takes 16
    # bytes on the device (rounded up as CUDA's allocator does); the moves stay in bytes
    rounded = lambda n: -(-n // 16) * 16  # noqa: E731
    assert reference_moves(reads("a", "b", "a", "b"), budget=20)["bytes_to_device"] == 20
    r = reference_moves(reads("a", "b", "a", "b"), budget=20, block_bytes=rounded)
    assert r["bytes_to_device"] == 40 and r["peak_device_bytes"] == 16
    with pytest.raises(OutOfBudgetError):
        reference_moves([(0, "a", 10, False), (0, "b", 10, False)], budget=31, block_bytes=rounded)


def test_an_op_larger_than_the_budget_is_an_error():
    with pytest.raises(OutOfBudgetError):
        reference_moves([(0, "a", 10, False), (0, "b", 10, False)], budget=15)


def test_a_group_comes_in_and_leaves_whole():
    # a1 and a2 are one group: reading a1 brings both in, and room for b takes both out
    accesses = [(0, "a1", 10, False), (1, "b", 10, False), (2, "a2", 10, False)]
    units = {"a1": "A", "a2": "A"}
    assert reference_moves(accesses, budget=30, groups=units)["bytes_to_device"] == 30
    # room for 20: block by block a1 and b stay and b goes for a2 (30); in groups, A goes
    # for b and comes back whole (50)
    assert reference_moves(accesses, budget=20)["bytes_to_device"] == 30
    r = reference_moves(accesses, budget=20, groups=units)
    assert r["bytes_to_device"] == 50 and r["peak_device_bytes"] == 20
    with pytest.raises(OutOfBudgetError):
        reference_moves(accesses, budget=15, groups=units)  # (the group alone is 20)


def test_a_group_writes_back_only_its_members_written():
    accesses = [(0, "a1", 10, True), (0, "a2", 10, False), (1, "b", 20, False)]
    r = reference_moves(accesses, budget=20, groups={"a1": "A", "a2": "A"})
    assert r["bytes_to_host"] == 10 and r["bytes_to_device"] == 40
    # a group read at the start is resident whole where one member was, its dirt kept
    r = reference_moves(accesses, budget=20, initial={"a1": (10, True)}, groups={"a1": "A", "a2": "A"})
    assert r["bytes_to_device"] == 20 and r["bytes_to_host"] == 10


def test_copies_ahead_need_the_next_ops_room_while_an_op_runs():
    # a b c a, room for two: Belady keeps a (b goes for c): 30 bytes. With the next op's
    # blocks resident beside each op, a must go for c while b runs, and come back: 40.
    assert reference_moves(reads("a", "b", "c", "a"), budget=20)["bytes_to_device"] == 30
    r = reference_moves(reads("a", "b", "c", "a"), budget=20, ahead=1)
    assert r["bytes_to_device"] == 40 and r["peak_device_bytes"] == 20
    # where the next op's blocks do not fit beside an op's, the op runs with its own alone
    assert reference_moves(reads("a", "b", "a"), budget=10, ahead=1)["bytes_to_device"] == 30


class _Trace:
    def __init__(self, accesses, initial=None, initial_host=None, created=()):
        self.accesses, self.created = accesses, set(created)
        self.initial, self.initial_host = initial or {}, initial_host or {}


def test_the_disk_reference_is_the_rule_on_device_and_host_memory_together():
    # a, b, c cycle; one block fits on the device and one in host memory, a is on the device
    # and b in host memory at the start. Reading a b c: c must come from disk, and b (needed
    # next step after a) is the one to let go; the next step then reads b: 10 bytes a step.
    trace = _Trace(reads("a", "b", "c"), initial={"a": (10, False)}, initial_host={"b": (10, False)})
    r = reference_disk_moves(trace, budget=10, host_budget=10)
    assert r == {"bytes_from_disk": 10, "bytes_to_disk": 0}
    # b, then a written, c, d: at c the written a is needed last (next step), so it goes to disk.
    written = _Trace([(0, "b", 10, False), (1, "a", 10, True), (2, "c", 10, False), (3, "d", 10, False)],
                     initial={"a": (10, False)}, initial_host={"b": (10, False)})
    assert reference_disk_moves(written, budget=10, host_budget=10) == {"bytes_from_disk": 20, "bytes_to_disk": 10}


def test_the_disk_reference_bounds_what_flow_reads():
    import torch

    from torchTensorRef import tensorsManager as tm

    tm.strategy = "flow"
    n = 64 * 64 * 4
    managed = 3 * n + 4096
    tm.budget = budget(managed)
    torch.manual_seed(0)
    ws = [torch.randn(64, 64) for _ in range(12)]
    x = torch.randn(2, 64)

    def step():
        y = x
        for w in ws:
            y = torch.tanh(y @ w)
        return y

    tm.evict_all()
    gc.collect()
    tm.host_budget = 4 * n + sum(b.nbytes for b in tm.host_tier.hosted.values() if b.host_shared or b.external)
    for _ in range(3):
        step()
    tm.reset_stats()
    with tm.recording() as trace:
        step()
    measured = tm.stats()["bytes_from_disk"]
    reference = reference_disk_moves(trace, managed, tm.host_budget)["bytes_from_disk"]
    assert 0 < reference <= measured
