"""The simulated device's caching allocator (``sim_memory.BufferPool``)."""

from __future__ import annotations


import pytest
import torch

import torchTensorRef
from torchTensorRef.core import raw
from torchTensorRef.memory.host_memory import HostMemoryError, HostMemoryWatch
from torchTensorRef.memory.sim.pool import MIN_BYTES, BufferPool
from torchTensorRef.core.tensor_ref import block_of
from paired import budget, sim_only

MIB = 2**20


def _storage(nbytes: int) -> torch.UntypedStorage:
    with torchTensorRef.disabled():
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def test_a_given_buffer_comes_back_for_the_same_size_only():
    pool = BufferPool(limit=8 * MIB)
    storage = _storage(2 * MIB)
    address = storage.data_ptr()
    assert pool.give(storage)
    del storage
    assert pool.cached_bytes == 2 * MIB
    assert pool.take(2 * MIB + 1) is None and pool.take(MIB) is None
    buffer = pool.take(2 * MIB)
    assert buffer.dtype == torch.uint8 and buffer.shape == (2 * MIB,) and buffer.data_ptr() == address
    assert pool.cached_bytes == 0 and pool.hits == 1
    assert pool.take(2 * MIB) is None


def test_small_buffers_and_buffers_past_the_limit_are_not_kept():
    pool = BufferPool(limit=4 * MIB)
    assert not pool.give(_storage(MIN_BYTES - 1))
    assert not pool.give(_storage(5 * MIB))
    assert pool.cached_bytes == 0


def test_the_oldest_buffers_go_first_past_the_limit():
    pool = BufferPool(limit=4 * MIB)
    first, second, third = _storage(2 * MIB), _storage(2 * MIB), _storage(2 * MIB)
    addresses = [s.data_ptr() for s in (first, second, third)]
    for s in (first, second, third):
        assert pool.give(s)
    del first, second, third
    assert pool.cached_bytes == 4 * MIB
    kept = {pool.take(2 * MIB).data_ptr(), pool.take(2 * MIB).data_ptr()}
    assert kept == set(addresses[1:])
    assert pool.take(2 * MIB) is None


@sim_only
def test_a_buffer_is_not_handed_out_while_a_tensor_uses_it():
    pool = BufferPool(limit=8 * MIB)
    with torchTensorRef.disabled():
        t = torch.arange(MIB, dtype=torch.int32)  # 4 MiB
    assert pool.give(t.untyped_storage())
    assert pool.take(4 * MIB) is None  # t still uses the bytes
    assert torch.equal(t[:5], torch.arange(5, dtype=torch.int32))
    address = t.data_ptr()
    del t
    assert pool.take(4 * MIB).data_ptr() == address


def test_clear_gives_everything_back():
    pool = BufferPool(limit=8 * MIB)
    pool.give(_storage(2 * MIB))
    pool.clear()
    assert pool.cached_bytes == 0 and pool.take(2 * MIB) is None


@sim_only
def test_paging_on_sim_reuses_device_buffers_and_keeps_every_value(fresh_manager):
    tm = fresh_manager
    tm.strategy = "flow"
    with torchTensorRef.disabled():
        plain = [torch.randn(512, 1024) for _ in range(4)]  # 2 MiB each
    weights = [torchTensorRef.manage(p.clone()) for p in plain]
    tm.budget = budget("5MiB")  # two of them at a time
    pool = tm.backend.pool
    hits = pool.hits
    for _ in range(3):
        for w, p in zip(weights, plain):
            w.mul_(1.5)
            p.mul_(1.5)
    assert pool.hits > hits  # buffers of evicted weights were handed to later fetches
    for w, p in zip(weights, plain):
        assert torch.equal(w.cpu(), p)


@sim_only
def test_a_buffer_a_queued_write_back_still_reads_is_not_reused(fresh_manager):
    tm = fresh_manager
    tm.strategy = "flow"
    with torchTensorRef.disabled():
        plain = [torch.full((512, 1024), float(i)) for i in range(3)]  # 2 MiB each
    tensors = [torchTensorRef.manage(p.clone()) for p in plain]
    tm.budget = budget("5MiB")  # two of them at a time
    for _ in range(3):
        for t, p in zip(tensors, plain):
            t.add_(1)  # dirty: each eviction queues a write-back reading the device buffer
            p.add_(1)
    for t, p in zip(tensors, plain):
        assert torch.equal(t.cpu(), p)


@sim_only
def test_a_buffer_freed_while_its_write_back_is_queued_counts_free_on_the_device_not_for_the_manager(fresh_manager):
    # As CUDA's allocator: a freed block a stream still uses is counted free at once, and not
    # reused before the stream is done with it (record_stream). The manager counts it until
    # the copy ends, and reads what the device holds outside it as the device's count less
    # its resident blocks: less its pending ones too, that reading came out low while the
    # copy was in flight (a region backward planned its room from it, and was refused once
    # the copy ended: Genoa's training on CUDA at 25%).
    tm = fresh_manager
    tm.strategy = "flow"  # (no budget: it stays on the device until evicted)
    with torchTensorRef.disabled():
        plain = torch.full((512, 1024), 1.0)  # 2 MiB
    t = torchTensorRef.manage(plain.clone()) + 1  # made on the device: its write-back goes to pinned memory
    allocated = tm.backend.allocated
    before = allocated.total()
    outside = tm.stats()["outside_bytes"]
    assert block_of(t).dev is not None and tm.accounting.pending_bytes == 0
    with tm.lock:
        tm.evict(block_of(t))  # (as the strategies do) a write-back queued, reading the buffer the pool keeps
    assert tm.accounting.pending_bytes == 2 * MIB  # the manager's count: until the copy ends
    assert allocated.total() == before - 2 * MIB  # the device's: free at once
    assert tm.stats()["outside_bytes"] == outside
    tm.synchronize()
    assert tm.accounting.pending_bytes == 0 and allocated.total() == before - 2 * MIB
    assert tm.stats()["outside_bytes"] == outside
    assert torch.equal(t.cpu(), plain + 1)


@sim_only
def test_sim_reports_the_most_its_allocator_held_since_the_stats_were_reset(fresh_manager):
    tm = fresh_manager
    tm.reset_stats()
    base = tm.stats()["max_memory_allocated"]
    with torchTensorRef.disabled(device="sim"):
        a = torch.empty(MIB, dtype=torch.uint8, device="sim")  # a plain tensor of the program's
        b = torch.empty(2 * MIB, dtype=torch.uint8, device="sim")
    del a, b
    assert tm.stats()["max_memory_allocated"] == base + 3 * MIB
    tm.reset_stats()
    assert tm.stats()["max_memory_allocated"] == base


@sim_only
def test_freed_device_buffers_are_left_out_of_the_recorded_host_time(fresh_manager):
    tm = fresh_manager
    tm.strategy = "flow"  # (no budget: nothing moves)
    with tm.recording() as trace:
        x = torch.ones(MIB)
        y = x * 2
        before = len(trace.hidden_copies)
        del y  # its 4 MiB buffer is kept for reuse
        z = x[: MIB // 4] * 3
        del z  # 1 MiB: kept too
        assert len(trace.hidden_copies) == before + 2
        assert tm.backend.pool.cached_bytes >= 5 * MIB
    start, end = trace.hidden_copies[-1]
    assert 0 <= end - start < trace.t_end - trace.t0
    assert torch.equal(x.cpu(), torch.ones(MIB, device="cpu"))


def test_the_host_watch_releases_kept_memory_before_refusing():
    watch = HostMemoryWatch(reserve=0)
    released = []
    # (nothing may be allocated, however much the machine's free memory moves meanwhile:
    # other processes free memory between two readings, and 1 byte above one reading failed)
    watch.reserve = watch._available + (1 << 50)
    watch.release = lambda: released.append(True)
    with pytest.raises(HostMemoryError):
        watch.reserve_bytes(1)
    assert released == [True]
    freed = {"bytes": 0}

    def release():
        freed["bytes"] = 2 * watch.reserve  # what the release frees, as the system reports it
    watch.release = release
    watch._refresh = lambda: setattr(watch, "_available", watch.reserve + freed["bytes"])
    watch.reserve_bytes(1)  # fits once the kept memory is back
    assert freed["bytes"] > 0


def test_raw_flat_bytes_of_a_kept_buffer_is_its_size():
    pool = BufferPool(limit=8 * MIB)
    pool.give(_storage(2 * MIB))
    assert raw.flat_bytes(pool.take(2 * MIB).untyped_storage()).numel() == 2 * MIB


@sim_only
def test_sim_reuses_freed_buffers_except_under_a_host_budget(fresh_manager):
    tm = fresh_manager
    tm.strategy = "flow"
    kept = tm.backend.pinned.kept
    with torchTensorRef.disabled():
        plain = [torch.randn(512, 1024) for _ in range(3)]  # 2 MiB each
    tm.budget = budget("5MiB")
    for _ in range(2):
        results = [torchTensorRef.manage(p.clone()) * 2 for p in plain]  # made on the device
        for r in results:
            r.add_(1)  # paged out: each gets a host copy, freed with it
        for r, p in zip(results, plain):
            assert torch.equal(r.cpu(), p * 2 + 1)
        del results
    assert kept.hits > 0
    assert tm.backend.pool.cached_bytes > 0
    tm.host_budget = "1GiB"  # nothing kept from now on: freed memory must leave the process
    assert kept.cached_bytes == 0 and tm.backend.pool.cached_bytes == 0
    for _ in range(2):
        results = [torchTensorRef.manage(p.clone()) * 2 for p in plain]
        for r in results:
            r.add_(1)
        del results
    assert kept.cached_bytes == 0 and tm.backend.pool.cached_bytes == 0


@sim_only
def test_freed_host_copies_are_left_out_of_the_recorded_host_time_too(fresh_manager):
    tm = fresh_manager
    tm.strategy = "flow"
    x = torch.ones(MIB)
    y = x * 2
    tm.evict_all()  # y gets a pinned host copy
    tm.synchronize()
    with tm.recording() as trace:
        before = len(trace.hidden_copies)
        del y  # no device copy to drop: only its host copy goes, to the pinned allocator
        assert len(trace.hidden_copies) == before + 1
    assert torch.equal(x.cpu(), torch.ones(MIB, device="cpu"))
