"""Asynchronous copies: the simulated streams poison a copy's destination until it is waited
on, and every reader of a block's bytes waits for the copy that writes them, counting a
host wait only where the host really waited."""

from __future__ import annotations

import io
import math
import os

import pytest
import torch

import torchTensorRef
from torchTensorRef.core import raw
from torchTensorRef import tensorsManager as tm
from torchTensorRef.memory.streams import POISON, SimStreams, joined
from torchTensorRef.core.tensor_ref import block_of
from paired import capacity, outside, small_sim_capacity

pytestmark = pytest.mark.skipif(
    os.environ.get("TORCHTENSORREF_TEST_DEVICE", "sim") != "sim",
    reason='the simulated streams of "sim" (their copies run only when waited on)',
)


def _plain(*values, dtype=torch.float32):
    with torchTensorRef.disabled():
        return torch.tensor(values, dtype=dtype)


def _bytes(t):
    """A flat byte view of ``t``'s storage: what the copy protocol hands the streams."""
    return raw.flat_bytes(t.untyped_storage())


def _syncs() -> int:
    return tm.stats()["host_syncs"]


def _host_values(ref) -> list:
    """What the block's host copy holds right now, read without waiting for anything."""
    block = block_of(ref)
    return raw.typed_view(block.host, ref.dtype, ref.shape, ref.stride(), ref.storage_offset()).tolist()


def _device_values(ref) -> list:
    """What the block's device copy holds right now, read without waiting for anything."""
    block = block_of(ref)
    return raw.typed_view(block.dev, ref.dtype, ref.shape, ref.stride(), ref.storage_offset()).tolist()


def _is_poison(values) -> bool:
    return all(math.isnan(v) for v in values)


# -- SimStreams ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "write-back"])
def test_an_asynchronous_copy_leaves_poison_in_its_destination_until_waited_on(prefetch):
    src, dst = _plain(1.0, 2.0, 3.0), _plain(0.0, 0.0, 0.0)
    pending = SimStreams().copy_async(_bytes(dst), _bytes(src), prefetch=prefetch)
    assert not pending.done()
    assert _bytes(dst).tolist() == [POISON] * 12
    assert _is_poison(dst.tolist())  # every byte 0xFF: NaN in a floating-point type
    pending.wait_compute()
    assert pending.done() and dst.tolist() == [1.0, 2.0, 3.0]


def test_poison_in_an_integer_destination_is_all_ones():
    src, dst = _plain(5, 6, dtype=torch.int32), _plain(0, 0, dtype=torch.int32)
    pending = SimStreams().copy_async(_bytes(dst), _bytes(src), prefetch=True)
    assert dst.tolist() == [-1, -1]
    pending.wait_host()
    assert dst.tolist() == [5, 6]


@pytest.mark.parametrize("finish", ["wait_compute", "wait_host", "retire"])
def test_every_way_of_finishing_a_simulated_copy_completes_it_once(finish):
    src, dst = _plain(1.0, 2.0), _plain(0.0, 0.0)
    pending = SimStreams().copy_async(_bytes(dst), _bytes(src), prefetch=False)
    result = getattr(pending, finish)()
    assert dst.tolist() == [1.0, 2.0] and pending.done()
    if finish == "retire":
        assert result is True  # by the time memory is needed a copy engine has finished
    src.fill_(9.0)
    pending.wait_host()  # a finished copy is not run again
    assert dst.tolist() == [1.0, 2.0] and pending.retire()


def _clocked_copy(lag, clock):
    """Streams whose copies last ``lag`` ops of ``clock`` (a one-item list), and a write-back
    of [1.0, 2.0] they started: (streams, its destination, its Pending)."""
    streams = SimStreams()
    streams.lag, streams.clock = lag, lambda: clock[0]
    src, dst = _plain(1.0, 2.0), _plain(0.0, 0.0)
    return streams, dst, streams.copy_async(_bytes(dst), _bytes(src), prefetch=False)


def test_a_copy_given_ops_to_last_ends_after_them_unless_waited_on():
    # (Note [Copies that outlast their op]: as on a GPU, where the manager plans while copies run)
    clock = [10]
    streams, dst, pending = _clocked_copy(2, clock)
    clock[0] = 11
    assert not pending.retire() and not pending.done() and pending.buffer_users() == 1
    assert _is_poison(dst.tolist())
    clock[0] = 12
    assert pending.done() and dst.tolist() == [1.0, 2.0] and pending.retire()
    waited = streams.copy_async(_bytes(dst), _bytes(_plain(3.0, 4.0)), prefetch=True)
    waited.wait_compute()  # (waited on before its end: done at once)
    assert waited.done() and dst.tolist() == [3.0, 4.0]


def test_copies_into_one_host_copy_are_waited_on_together_and_let_go_once_ended():
    # (the write-backs of pieces into a big tensor's host copy: Note [Pieces] in ops/pieces.py)
    clock = [10]
    streams, dst, first = _clocked_copy(2, clock)
    clock[0] = 11
    second = streams.copy_async(_bytes(dst), _bytes(_plain(3.0, 4.0)), prefetch=False)
    copies = joined(joined(None, first), second)
    assert copies.untracked and copies.buffer_users() == 0  # (they read other blocks' buffers)
    assert not copies.done() and _is_poison(dst.tolist())
    clock[0] = 12  # (the first one ends)
    third = streams.copy_async(_bytes(dst), _bytes(_plain(5.0, 6.0)), prefetch=False)
    assert joined(copies, third) is copies and copies.parts == [second, third]
    copies.wait_host()
    assert copies.done() and dst.tolist() == [5.0, 6.0]


def test_a_copy_that_ends_inside_a_dispatch_mode_is_not_seen_by_it():
    # Fixed: FSDP2's sharding propagation asked for room under its FakeTensorMode, and the
    # copy that ended then ran as an op of the mode, which refused its plain tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode

    clock = [0]
    _streams, dst, pending = _clocked_copy(1, clock)
    clock[0] = 1
    with FakeTensorMode():
        assert pending.done()
    assert dst.tolist() == [1.0, 2.0]


def test_write_backs_in_flight_stay_held_until_the_ops_they_last_have_run(monkeypatch):
    monkeypatch.setattr(tm, "sim_copy_ops", 2)
    tm.strategy = "flow"  # (no budget: nothing else moves)
    x = torch.full((256,), 3.0)
    y = x * 2  # (resident and dirty)
    tm.evict(block_of(y))  # its write-back goes on a side stream
    assert tm.stats()["writebacks"] == 1
    held = tm.accounting.pending_bytes
    assert held == block_of(y).nbytes and _is_poison(_host_values(y))
    x + 1  # one op: still in flight
    assert tm.accounting.pending_bytes == held
    x + 1  # its second: it has ended (and it is known once asked)
    assert all(pending.done() for pending, _nbytes in tm.accounting.pending)
    assert _host_values(y) == [6.0] * 256 and _syncs() == 0


def test_sim_copy_ops_comes_from_the_environment_and_reaches_the_device(monkeypatch):
    monkeypatch.setattr(tm, "sim_copy_ops", tm.sim_copy_ops)  # (restored after)
    torchTensorRef.configure_from_environment({"TORCHTENSORREF_SIM_COPY_OPS": "3"})
    assert tm.sim_copy_ops == 3 and tm.backend.streams.lag == 3


@pytest.mark.parametrize("value", [-1, "two", 1.5, True])
def test_sim_copy_ops_refuses_what_is_not_a_count_of_ops(value):
    before = tm.sim_copy_ops
    with pytest.raises(ValueError, match="sim_copy_ops must be a count of ops"):
        tm.sim_copy_ops = value
    assert tm.sim_copy_ops == before


def test_an_ordered_copy_is_visible_at_once():
    src, dst = _plain(1.0, 2.0), _plain(0.0, 0.0)
    assert SimStreams().copy_ordered(dst, src) is None
    assert dst.tolist() == [1.0, 2.0]


# -- prefetches -------------------------------------------------------------------------------------


def _prefetched(value=5.0, n=256):
    x = torch.full((n,), value)
    x.toCPU()
    assert tm.prefetch(block_of(x))
    assert block_of(x).dev_pending is not None
    return x


def test_target_of_a_tensor_being_prefetched_waits_for_the_copy():
    x = _prefetched()
    assert _is_poison(_device_values(x))  # the copy has not run yet
    start = _syncs()
    assert x.target.tolist() == [5.0] * 256
    assert block_of(x).dev_pending is None and x.proxyInfo.on_device
    assert _syncs() == start  # ordered on the device: the host did not wait


def test_an_op_on_a_tensor_being_prefetched_waits_for_the_copy():
    tm.strategy = "flow"
    x = _prefetched()
    tm.reset_stats()
    y = x * 2
    stats = tm.stats()
    assert (stats["prefetch_hits"], stats["fetches"], stats["host_syncs"]) == (1, 0, 0)
    assert y.tolist() == [10.0] * 256


def test_a_prefetch_evicted_before_it_was_waited_on_leaves_the_host_copy_valid():
    x = _prefetched()
    tm.evict(block_of(x))
    assert block_of(x).dev_pending is None and not x.proxyInfo.on_device
    assert x.tolist() == [5.0] * 256 and (x + 1).tolist() == [6.0] * 256


# -- write-backs ------------------------------------------------------------------------------------


def _written_back(value=2.0, n=256):
    """A result Genoa has just sent back: its write-back to pinned memory still runs."""
    y = torch.full((n,), value - 1) + 1
    block = block_of(y)
    assert block.dev is None and block.host_pending is not None and not block.host_pending.done()
    assert _is_poison(_host_values(y))
    return y


def _save_and_load(t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    with torchTensorRef.disabled():
        return torch.load(buffer, weights_only=True)


READERS = {
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy().tolist(),
    "torch.save": lambda t: _save_and_load(t).tolist(),
    "target": lambda t: t.target.tolist(),
    "repr": lambda t: eval(repr(t).split("device=")[0].replace("tensor(", "").rstrip(", \n")),
    "item": lambda t: [t[i].item() for i in range(t.numel())],
}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_reading_a_result_whose_write_back_is_in_flight_gives_its_values(read):
    y = _written_back(2.0, n=8)
    assert read(y) == [2.0] * 8


@pytest.mark.parametrize("read", ["tolist", "numpy", "torch.save", "target"])
def test_the_host_waits_once_for_a_write_back_it_reads(read):
    y = _written_back()
    start = _syncs()
    assert READERS[read](y) == [2.0] * 256
    assert _syncs() == start + 1  # it waited for the copy
    assert block_of(y).host_pending is None
    assert READERS[read](y) == [2.0] * 256
    assert _syncs() == start + 1  # and not again


def test_a_write_back_finished_before_it_is_read_costs_no_host_wait():
    y = _written_back()
    for _ in range(max(tm.sim_copy_ops, 1)):
        torch.ones(4) + 1  # the ops a copy lasts retire it (a copy engine would be done by now)
    start = _syncs()
    assert y.tolist() == [2.0] * 256
    assert _syncs() == start


def test_a_fetch_of_a_block_being_written_back_waits_on_the_device_not_the_host():
    y = _written_back()
    tm.strategy = "flow"
    start = _syncs()
    y.toGPU()  # the fetch is ordered after the write-back that fills its source
    assert y.target.tolist() == [2.0] * 256
    assert _syncs() == start


def test_a_prefetch_of_a_block_being_written_back_copies_the_written_bytes():
    y = _written_back()
    assert tm.prefetch(block_of(y))
    assert y.target.tolist() == [2.0] * 256
    assert (y * 1).tolist() == [2.0] * 256


def test_reading_a_dirty_resident_tensor_writes_it_back_and_keeps_it_resident():
    tm.strategy = "flow"
    y = torch.full((256,), 1.0) + 1  # only on the device
    assert y.proxyInfo.dirty
    start = _syncs()
    assert y.tolist() == [2.0] * 256
    assert _syncs() == start + 1
    assert y.proxyInfo.on_device and not y.proxyInfo.dirty
    assert y.tolist() == [2.0] * 256 and _syncs() == start + 1


def test_write_backs_in_flight_take_the_devices_memory_but_not_the_budget():
    # (Note [Stream-ordered frees]: the device counts the buffer free at the drop, as
    # torch.cuda.memory_allocated does, and keeps it from reuse until the copy ends)
    resident, floor = tm.device_bytes, outside()  # (in use counts what is outside the manager too)
    y = _written_back()
    nbytes = tm.block_bytes(y.proxyInfo.nbytes)
    assert tm.device_bytes == resident  # the block is on the host ...
    assert tm.in_use() == floor + resident and tm.room() == tm.limit - floor - resident
    assert tm.accounting.on_device() == floor + resident + nbytes  # ... its device copy still read
    tm.synchronize()
    assert tm.accounting.on_device() == tm.in_use() == floor + resident


def test_an_op_needing_the_room_of_a_write_back_in_flight_does_not_wait_for_it(monkeypatch):
    monkeypatch.setattr(tm, "sim_copy_ops", 2)  # (the copy outlasts the op that evicts for it)
    tm.strategy = "flow"
    tm.budget = outside() + 2 * tm.block_bytes(1024)  # two blocks of 256 floats
    a = torch.full((256,), 1.0) + 1  # resident, and only on the device
    start = _syncs()
    b = torch.full((256,), 2.0) + 1  # the room for its result: a, written back
    assert _syncs() == start and block_of(a).dev is None and not block_of(a).host_pending.done()
    assert tm.in_use() <= tm.budget
    assert b.tolist() == [3.0] * 256 and a.tolist() == [2.0] * 256


@small_sim_capacity
def test_an_allocation_the_device_cannot_hold_beside_a_write_back_waits_for_its_copy(monkeypatch):
    monkeypatch.setattr(tm, "sim_copy_ops", 2)
    before = tm.sim_capacity
    try:
        tm.strategy = "flow"
        tm.sim_capacity = capacity(2 * tm.block_bytes(1024))  # no budget: the device's memory is the limit
        a = torch.full((256,), 1.0) + 1
        start = _syncs()
        b = torch.full((256,), 2.0) + 1  # the device holds a's buffer until its copy ends
        assert _syncs() == start + 1  # the allocator waited for that copy (CUDA's does too)
        assert tm.accounting.on_device() <= tm.sim_capacity
        assert b.tolist() == [3.0] * 256 and a.tolist() == [2.0] * 256
    finally:
        tm.sim_capacity = before


def test_a_dropped_copy_is_given_back_once_the_programs_view_goes_while_its_write_back_runs(monkeypatch):
    # (Note [Buffers still viewed]: the write-back's own hold on the buffer is not the
    # program's; the device counts the buffer free at once, as CUDA's allocator would)
    monkeypatch.setattr(tm, "sim_copy_ops", 2)
    tm.strategy = "flow"
    floor = outside()
    y = torch.full((256,), 1.0) + 1
    view = y.target  # the program views the device copy
    tm.evict(block_of(y))  # written back (in flight) and dropped: the view keeps the buffer
    assert outside() == floor + tm.block_bytes(1024)
    del view
    assert outside() == floor and not block_of(y).host_pending.done()
    assert y.tolist() == [2.0] * 256


def test_a_viewed_copy_let_go_stays_counted_while_its_buffer_lives(monkeypatch):
    # (Note [Buffers still viewed]: a dropped copy held while the program viewed it counts as
    # gone when a reading of the device says so. Counted gone when the manager let go of it,
    # a buffer still held elsewhere (here: its storage object, which PyTorch's use count does
    # not show; in a threaded backward, another thread) left the manager's count below the
    # device's, and the device above the budget: 512-1024 bytes in about 1 run in 400)
    tm.strategy = "flow"
    y = torch.full((256,), 1.0) + 1
    tm.evict(block_of(y))
    tm.synchronize()
    assert y.tolist() == [2.0] * 256  # (fetched back: resident and clean)
    y.toGPU()
    view = y.target  # the program views the device copy
    kept = view.untyped_storage()
    tm.evict(block_of(y))  # dropped: the view keeps the buffer, held as viewed
    del view
    tm.device_room.retire()  # (the hold ends: only the storage object is left)
    acct = tm.accounting
    assert acct.resident + acct.elsewhere_bytes >= tm.backend.in_use_elsewhere(0)
    del kept
    tm.device_room.read_outside()
    assert acct.resident + acct.elsewhere_bytes == tm.backend.in_use_elsewhere(0)


def test_synchronize_completes_every_write_back_in_flight():
    tm.strategy = "flow"
    floor = outside()
    results = [torch.full((256,), float(i)) * 2 for i in range(4)]  # only on the device
    tm.evict_all()  # four write-backs in flight, and no op since to retire them
    assert all(_is_poison(_host_values(r)) for r in results)
    start = _syncs()
    tm.synchronize()
    assert _syncs() == start + len(results)  # it waited for each copy
    for i, r in enumerate(results):
        assert block_of(r).host_pending is None and block_of(r).host_valid
        assert _host_values(r) == [2.0 * i] * 256
    assert tm.in_use() == floor + tm.device_bytes
    tm.synchronize()
    assert [r.tolist() for r in results] == [[2.0 * i] * 256 for i in range(4)]
    assert _syncs() == start + len(results)  # nothing was left to wait for


# -- streams of "sim" for PyTorch code ---------------------------------------------------------


def test_sim_offers_pytorch_code_streams_and_events_that_wait_for_nothing():
    # FSDP2 orders its all-gathers with them (Note [Streams of sim for PyTorch code])
    module = torch.get_device_module("sim")
    side = module.Stream(priority=-1)
    with module.stream(side):
        x = torch.ones(4, device="sim") * 3
    event = side.record_event()
    module.current_stream().wait_event(event)
    module.current_stream().wait_stream(side)
    assert event.query() and side.query()
    assert module.current_stream() is module.default_stream() and side != module.current_stream()
    event.synchronize()
    side.synchronize()
    assert module.Event().record() is None
    assert x.tolist() == [3.0] * 4
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        module.no_such_thing
