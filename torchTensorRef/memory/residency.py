"""Residency: moving blocks between host and device memory.

Every copy torchTensorRef makes goes through here, the same code for every backend:

- ``fetch``: a demand fetch, on the compute stream. From pinned host memory it is
  asynchronous for the host (the op queued next waits for it on the GPU, not in Python).
- ``prefetch``: a copy on a side stream from pinned memory, whose ``Pending`` the op that
  needs the block waits on (Note [Pending copies]). Never synchronous: a block whose host
  copy cannot be pinned is not prefetched, and an out-of-memory drops the prefetch.
- ``evict``: drops the device copy; a dirty block is written back first, on a copy stream
  into pinned memory, and the host copy is waited on only where it is read
  (``sync_host``: numpy, tolist, torch.save, toCPU) or re-fetched (ordered on the GPU).

The device bytes are counted in ``Accounting`` (``accounting.py``): a device buffer a copy
still uses stays counted until the copy ends (Note [Stream-ordered frees]).
``stats()["host_syncs"]`` counts every time the protocol made the host wait for the device:
a copy to or from pageable memory, or a wait on a pending write-back that had not finished.
"""

from __future__ import annotations

import time
from typing import Callable, Collection, Optional, Sequence

import torch

from ..core import raw
from ..core.blocks import Block
from ..core.tensor_ref import TensorRef, make_ref
from .room import is_out_of_memory
from .sim.pool import MIN_BYTES as KEPT_MIN_BYTES
from .streams import Pending, joined


# Note [Buffers still viewed]: a block's device copy may be viewed by plain tensors the
# manager does not own: a ``target`` the program kept, a plain view autograd saved, a view
# another thread is still letting go of. Dropping the copy does not free those bytes: the
# device's allocator counts them until the last view goes (``torch.cuda.memory_allocated``
# does; "sim" counts the same way). So a dropped copy that PyTorch counts other users of is
# held as an ``InUse`` (``Accounting.hold_viewed``): counted against the budget as outside
# the manager, as the program's own device tensors are, until only the manager's reference
# is left (asked before each op), and only then given to the device for reuse; it counts as
# gone at the next reading of the device, not before (a holder PyTorch's count of users does
# not show, another thread's, may keep it a while). Nothing can wait for such a view to go:
# a budget that needs those bytes fails as it would on the device.


class InUse(Pending):
    """A dropped device copy that tensors outside the manager still view (Note [Buffers
    still viewed]): ended when none does, then passed to ``free``."""

    __slots__ = ("storage", "free", "copy")
    waitable = False

    def __init__(self, storage: torch.UntypedStorage, free: Callable[[torch.UntypedStorage, Optional[Pending]], None],
                 copy: Optional[Pending] = None):
        self.storage: Optional[torch.UntypedStorage] = storage
        self.free = free
        #: the block's write-back still reading the buffer, if any: its own view is not the program's
        self.copy = copy

    def wait_compute(self) -> None:
        pass

    def wait_host(self) -> None:
        pass  # (a view held by the program ends when the program drops it)

    def done(self) -> bool:
        storage = self.storage
        if storage is None:
            return True
        users = raw.storage_users(storage)
        copy = self.copy
        return users is not None and users - (copy.buffer_users() if copy is not None else 0) == 1

    def retire(self) -> bool:
        if not self.done():
            return False
        storage, self.storage = self.storage, None
        if storage is not None:
            self.free(storage, self.copy)
        return True


class Residency:
    """The moves of blocks between host and device memory."""


    def __init__(self, manager) -> None:
        self.m = manager

    def fetch(self, block: Block, protect: Collection[int] = ()) -> None:
        """Give ``block`` a valid device copy now (no budget check: see ``Room.make``).

        ``protect``: ids of the blocks the current op needs; an out-of-memory recovery
        never evicts them.
        """
        m = self.m
        backend = m.backend
        if block.dev is not None or block.host_only or backend.passthrough:
            return
        group = block.group
        if group is not None and m.groups.movable(group, protect):
            m.groups.fetch(group, protect)  # (the op needs them all: one copy, Note [Region groups])
            return
        if not block.host_valid and block.disk is not None:
            m.host_tier.load_host(block, protect)  # its bytes are only on disk
        start = time.perf_counter_ns()
        if backend.simulated:
            m.host_tier.watch.reserve_bytes(block.nbytes)  # the simulated device is host memory
        dev = m.device_room.allocate(block.nbytes, set(protect) | {block.id}, "fetch")
        if block.host_pending is not None:
            block.host_pending.wait_compute()  # a write-back of these bytes is still running
        block.fetches += 1
        pinned, mode, src = backend.pinned, "ordered", None
        # Paged from pageable memory: pinned once, so later moves do not wait; else a small
        # one is staged (copied by the host, then asynchronously).
        if not pinned.is_pinned(block.host) and not (
                block.fetches > 1 and m.host_tier.may_rehome(block) and m.host_tier.pin_host(block)):
            src = raw.flat_bytes(block.host_storage())
            staged = pinned.staged(src)
            if staged is not None:
                src = staged
            else:
                m.statistics.counters["host_syncs"] += 1  # from pageable memory the host waits
                mode = "blocking"
        backend.streams.copy_ordered(dev, src if src is not None else raw.flat_bytes(block.host_storage()))
        self._now_resident(block, dev, start, mode)
        if block.dev_bytes > backend.block_bytes(block.nbytes):
            m.device_room.settle(set(protect) | {block.id})
        counters = m.statistics.counters
        counters["fetches"] += 1
        counters["copies_to_device"] += 1
        counters["bytes_on_demand"] += block.nbytes

    def prefetch(self, block: Block, group: bool = False) -> bool:
        """Bring ``block`` in ahead of use on a side stream (no budget check); whether it did.
        With ``group``, its whole group comes in with it where it can and fits the budget
        (one copy, Note [Region groups]).

        A block whose host copy cannot be pinned is skipped (the copy would make the host
        wait), and so is one that does not fit in the device: a prefetch never evicts for
        itself here (a strategy evicts first if it wants) and never fails the op it runs beside.
        """
        m = self.m
        backend = m.backend
        if block.dev is not None or block.host_only or block.external or backend.passthrough:
            return False
        if group and block.group is not None and m.groups.movable(block.group, None) and m.groups.prefetch(block.group):
            return True  # (its whole group, where that fits: else the block alone)
        if not block.host_valid and block.disk is not None:
            m.host_tier.read_ahead(block)  # only on disk: the op will find it in host memory, or nearer
            return False
        if not backend.pinned.is_pinned(block.host) and not m.host_tier.pin_host(block):
            return False
        acct = m.accounting
        if acct.slack and acct.limit is not None and (
                acct.in_use() + acct.room_for(backend.block_bytes(block.nbytes), block.nbytes) > acct.limit):
            m.statistics.counters["prefetches_dropped"] += 1  # (the allocator's slack would not fit)
            return False
        start = time.perf_counter_ns()
        dev = self.prefetch_buffer(block.nbytes)
        if dev is None:
            return False
        if block.host_pending is not None:
            block.host_pending.wait_compute()
        pending = backend.streams.copy_async(dev, raw.flat_bytes(block.host_storage()), prefetch=True)
        self._now_resident(block, dev, start, "async", pending)
        block.prefetch_op = m.op_count  # (ops from this index on run after the one issuing it)
        counters = m.statistics.counters
        counters["prefetches"] += 1
        counters["copies_to_device"] += 1
        counters["bytes_prefetched"] += block.nbytes
        return True

    def prefetch_buffer(self, nbytes: int) -> Optional[torch.Tensor]:
        """A device buffer of ``nbytes`` for a prefetch, or ``None`` where the device is out of
        memory (the prefetch is dropped: it never fails the op it runs beside)."""
        m = self.m
        try:
            if m.backend.simulated:
                m.host_tier.watch.reserve_bytes(nbytes)  # (the simulated device is host memory)
            return m.device_room.allocate(nbytes, None, "prefetch")
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            m.statistics.counters["prefetches_dropped"] += 1
            return None

    def _now_resident(self, block: Block, dev: torch.Tensor, start: int, mode: str,
                      pending: Optional[Pending] = None) -> None:
        m = self.m
        m.books.made_resident(block, dev.untyped_storage(), pending)
        m.statistics.counters["bytes_to_device"] += block.nbytes
        if m.trace is not None:
            m.trace.move("to_device", block.id, block.nbytes, start, time.perf_counter_ns(), m.accounting.resident,
                         mode)

    def evict(self, block: Block) -> None:
        """Drop ``block``'s device copy, writing it back first if it is dirty."""
        if block.dev is None:
            return
        m = self.m
        start = time.perf_counter_ns()
        if block.prefetched:  # brought in and never used (``left_device`` forgets it)
            m.statistics.counters["prefetches_unused"] += 1
        wrote = not block.clean or (block.host is None and m.host_tier.keep_on_host(block))
        if wrote:
            self.write_back(block)
        pending = block.dev_pending
        block.left_device()
        m.books.left_device(block)
        held = pending is not None and not pending.done()
        if held:
            # (a prefetch never waited on: its copy may still write the buffer, which is not
            # reused before it ends, and is counted until then: Note [Stream-ordered frees])
            m.accounting.hold(pending, block.dev_bytes)
        self.drop_dev(block, reuse=not held)
        m.statistics.counters["evictions"] += 1
        if m.trace is not None:
            m.trace.move("to_host", block.id, block.nbytes if wrote else 0, start,
                         time.perf_counter_ns(), m.accounting.resident, _write_mode(block, wrote))

    def evict_victim(self, block: Block, protect: Collection[int]) -> bool:
        """Evict ``block``, chosen to make room, and the rest of its group that is not pinned
        and that ``protect`` does not name: one member out of the group's buffer frees
        nothing, and a group comes in as one only once all of it is out (Note [Region groups]);
        a member in a buffer of its own goes where that is free (clean). Whether it did: not
        where the group's buffer must stay for a member that cannot go (nothing would be freed)."""
        group = block.group
        if group is None or group.dissolved and block.id not in group.live:
            self.evict(block)
            return True
        live = group.live
        if block.id in live:
            for mate in group.members:
                if mate.id in live and (mate.pins or mate.id in protect):
                    return False
        self.evict(block)
        for mate in group.members:
            if (mate.dev is not None and not mate.pins and mate.id not in protect
                    and (mate.id in live or mate.host_valid)):
                self.evict(mate)
        return True

    def drop_dev(self, block: Block, reuse: bool = True) -> None:
        """Forget ``block``'s device copy; with ``reuse`` the device may keep its buffer for
        reuse (``Backend.recycle``, up to :meth:`kept_limit`). A buffer a tensor outside the
        manager still views stays counted until none does (Note [Buffers still viewed])."""
        storage = block.dev
        block.set_dev(None)
        if storage is None:
            return
        group = block.group
        if group is not None and block.id in group.live:
            self.m.groups.left(group, block)  # (a range of the group's buffer, which goes with the last)
            return
        # (a copy on a side stream still using it is counted by the manager until it ends;
        # the device counts it free now: Note [Stream-ordered frees] in accounting.py)
        if not reuse:
            self.m.backend.freed_in_flight(storage)  # (a prefetch still writes it)
            return
        self.free_buffer(storage, block.host_pending, block.dev_bytes)

    def free_buffer(self, storage: torch.UntypedStorage, copy: Optional[Pending], nbytes: int) -> None:
        """Give the device buffer ``storage`` (counted at ``nbytes``) back, or hold it while a
        tensor outside the manager views it (Note [Buffers still viewed]); ``copy``: copies
        that may still read it (their own views of it are not the program's)."""
        copying = copy.buffer_users() if copy is not None else 0
        users = raw.storage_users(storage)
        if users is not None and users - copying > 1:
            self.m.accounting.hold_viewed(InUse(storage, self.release, copy), nbytes)
            return
        self.release(storage, copy)

    def release(self, storage: torch.UntypedStorage, copy: Optional[Pending]) -> None:
        """Give the device buffer ``storage`` back; ``copy``: a write-back that may still read it
        (the device counts the buffer free now and reuses it once the copy ends)."""
        if copy is not None and copy.buffer_users():
            self.m.backend.freed_in_flight(storage)
        self.recycle(storage)

    def recycle(self, storage: torch.UntypedStorage) -> None:
        """The manager is done with the device buffer ``storage``: the device may keep it for
        reuse (``Backend.recycle``, up to :meth:`kept_limit`)."""
        if storage.nbytes() < KEPT_MIN_BYTES:
            return  # (small buffers: the C allocator's fast case, and the per-op path)
        m = self.m
        backend = m.backend
        start = time.perf_counter_ns()
        backend.recycle(storage, self.kept_limit())
        del storage
        if backend.simulated and m.trace is not None:
            # Keeping or freeing the simulated device's buffer is its allocator's work, not
            # the host's (a GPU's allocator keeps it for free): left out of the host's time.
            m.trace.hidden(start, time.perf_counter_ns())

    def kept_limit(self) -> int:
        """Bytes of freed buffers a simulated allocator may keep for reuse: the budget (an
        eighth of the device's capacity without one), so that the simulated device's host
        memory stays within twice what the budget promises; none under a host budget, where
        freed memory must leave the process."""
        m = self.m
        if m.host_tier.limit or not m.backend.simulated:
            return 0  # (CUDA's allocators keep freed memory themselves)
        return m.settings.budget or (m.backend.capacity() or 0) // 8

    def write_back(self, block: Block) -> None:
        """Start copying ``block``'s device copy to its host copy (asynchronously into pinned memory)."""
        m = self.m
        m.device_room.inject("writeback", block.nbytes)
        host = self._host_for_write_back(block)
        assert block.dev is not None  # (a write-back's source is the device copy)
        group = block.group
        if group is not None and block.id in group.live:
            dev = group.device_range(block)  # (a view of the group's buffer: kept until the copy ends)
        else:
            group = None
            dev = raw.flat_bytes(block.dev)
        block.wait_arrival()
        backend = m.backend
        counters = m.statistics.counters
        parent = block.host_parent
        if backend.pinned.is_pinned(host) and not (block.external or (block.host_shared and parent is None)):
            if block.host_pending is not None and block.host_pending.untracked:
                block.host_pending.wait_compute()  # (pieces' copies into it land first, in order)
            pending = backend.streams.copy_async(raw.flat_bytes(host), dev, prefetch=False)
            block.host_pending = pending
            if group is not None:
                m.groups.wrote_back(group, pending)
            m.accounting.hold(pending, block.dev_bytes)  # (the device copy, until the copy ends)
            if parent is not None:
                # (a piece: the host copy it is a range of is read once its copies end)
                parent.host_pending = joined(parent.host_pending, pending)
        else:
            # Into pageable memory (the host waits), or into bytes others read directly.
            self.wait_pending_host(block)
            raw.flat_bytes(host).copy_(dev)
            counters["host_syncs"] += 1
        block.written_back()
        counters["bytes_to_host"] += block.nbytes
        counters["writebacks"] += 1

    def _host_for_write_back(self, block: Block) -> torch.UntypedStorage:
        """The host storage a write-back of ``block`` goes to: its own, or a new (pinned) one."""
        m = self.m
        host = block.host
        if host is not None and not block.host_valid and m.host_tier.may_rehome(block):
            host = None  # (stale, pageable and nobody else's: rewritten whole, into pinned memory)
        if host is None or host.nbytes() != block.nbytes:
            if block.host is not None:
                self.drop_host(block)
            m.host_tier.make_room(block.nbytes, (block.id,), "writing a tensor back to host memory")
            m.host_tier.watch.reserve_bytes(block.nbytes)
            buffer = m.backend.pinned.allocate(block.nbytes)
            if buffer is None:
                buffer = raw.empty(block.nbytes, dtype=raw.UINT8)
            host = buffer.untyped_storage()
            block.set_host(host, False)
            m.host_tier.host_gained(block)
        return host

    def wait_pending_host(self, block: Block) -> None:
        """Wait for a copy into ``block``'s host copy still in flight, if any."""
        pending = block.host_pending
        if pending is not None:
            self.m.device_room.wait_host(pending)
            block.host_pending = None

    def sync_host(self, block: Block, record: bool = True) -> bool:
        """Make the host copy valid and readable now (keeping the device copy); whether it copied."""
        m = self.m
        wrote = False
        if not block.host_valid and block.dev is None and block.disk is not None:
            m.host_tier.load_host(block, (block.id,))
        trace = m.trace
        if not block.host_valid and block.dev is not None:
            start = time.perf_counter_ns()
            self.write_back(block)
            wrote = True
            if record and trace is not None:
                trace.move("to_host", block.id, block.nbytes, start, time.perf_counter_ns(), m.accounting.resident,
                           _write_mode(block, wrote))
        if trace is not None and (wrote or block.host_pending is not None):
            trace.sync(time.perf_counter_ns(), block.id)  # the host reads these bytes now
        self.wait_pending_host(block)
        return wrote

    def drop_host(self, block: Block) -> None:
        """``block`` has no host copy any more (it is stale, or another copy holds the bytes)."""
        self.forget_host(block)
        block.set_host(None, False)

    def forget_host(self, block: Block) -> None:
        """``block`` stops using its host copy (accounting; the bytes go when no view holds them)."""
        m = self.m
        pending = block.host_pending
        if pending is not None and pending.untracked and block.host_parent is None:
            # (copies into views of its buffer, which PyTorch's pinned allocator would hand
            # out again before they end: Note [Pieces] in ``ops/pieces.py``)
            m.device_room.wait_host(pending)
        host = block.host_storage()
        if block.group is not None:
            m.groups.host_left(block, host)
        m.books.by_host_storage.pop(host._cdata, None)
        pinned = m.backend.pinned
        if pinned is not None:
            timed = pinned.emulated and m.trace is not None
            start = time.perf_counter_ns() if timed else 0
            pinned.freed(host, self.kept_limit())  # (the pool keeps no small buffer)
            if timed:
                # Keeping or freeing the buffer is the pinned allocator's work, which PyTorch's
                # does for free on a GPU machine (it keeps the buffer): not host time.
                m.trace.hidden(start, time.perf_counter_ns())
        block.host_pending = None
        m.host_tier.host_lost(block)

    def new_device_tensor(self, size: Sequence[int], stride: Optional[Sequence[int]], dtype: Optional[torch.dtype],
                          memory_format: Optional[torch.memory_format] = None) -> TensorRef:
        """A new TensorRef on the device, within the budget (the device's ``empty`` kernels)."""
        m = self.m
        dtype = dtype or torch.get_default_dtype()
        size = tuple(size)
        if stride is None:
            meta = raw.empty(size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format)
            stride = meta.stride()
        nbytes = raw.storage_bytes(size, tuple(stride), dtype)
        with m.lock:
            m.drain()
            if m.backend.name != "sim":
                raise RuntimeError(
                    f'tensors on device "sim" need tensorsManager.device = "sim" (it is {m.device!r})')
            m.device_room.make(m.backend.block_bytes(nbytes), (), "empty")
            buffer = m.device_room.allocate(nbytes, (), "create")
            block = m.books.new_block(nbytes)
            m.books.made_resident(block, buffer.untyped_storage())
            block.last_use = m.op_count
            view = raw.typed_view(block.dev, dtype, size, tuple(stride), 0)
            return make_ref(block, view, m.declared)


def _write_mode(block: Block, wrote: bool) -> str:
    """How a write-back just started copies, for the trace: only one into pinned memory is in flight."""
    if not wrote:
        return "drop"
    return "async" if block.host_pending is not None else "blocking"
