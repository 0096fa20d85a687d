"""The host tier: host copies within ``tensorsManager.host_budget``, the disk below them.

Every host copy of a block the manager pages (not a CPU tensor's: those are the program's)
is counted in ``HostTier.nbytes``. Before a new one is made (a write-back, a read from disk)
``HostTier.make_room`` brings the total under the host budget by dropping host copies, the
strategy choosing which (``Strategy.choose_host_victim``):

- a stale host copy (the device copy is newer) or a clean one (a checkpoint range or a
  spill slot holds the same bytes) is dropped at once: nothing is written;
- any other is *spilled*: written to a slot of the spill file on the disk thread, and
  dropped when the write has ended (its bytes count until then; a failed write keeps it,
  and the error is raised: nothing is lost).

A block whose only copy is on disk is read back where its bytes are needed: before an op
fetches it, or where the host reads it (``sync_host``). ``read_ahead`` starts that read on
the disk thread early (Flow does, from its predictions: Note [Three levels] in ``disk.py``).
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Collection, Dict, Iterator, List, Optional

from ..core import raw
from ..core.blocks import Block
from ..core.sizes import format_size
from .disk import DiskError, DiskIO, DiskPending, FileRange, SpillFile, default_offload_dir
from .host_memory import HostMemoryWatch

#: host allocations at least this large are mapped apart (glibc), once a host budget is set
MMAP_THRESHOLD = 1 << 20
_mmap_threshold_set = False


def return_freed_host_memory() -> None:
    """Make the C allocator give freed host copies back to the system (glibc; once).

    glibc serves allocations below a threshold that grows with use (up to 32 MiB) from its
    heap, and keeps what is freed there: host copies dropped under a host budget would stay
    in the process. Allocations of ``MMAP_THRESHOLD`` bytes or more are mapped apart
    instead, and unmapped when freed.
    """
    global _mmap_threshold_set
    if _mmap_threshold_set or not sys.platform.startswith("linux"):
        return
    _mmap_threshold_set = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops its growth)
    except (OSError, AttributeError):
        pass  # (another C library: nothing to set)


class HostBudgetError(MemoryError):
    """A host copy the manager must make does not fit in ``tensorsManager.host_budget``."""

    def __init__(self, needed: int, used: int, limit: int, what: str):
        self.needed, self.used, self.limit = needed, used, limit
        super().__init__(
            f"{what} needs {format_size(needed)} of host memory; tensorsManager.host_budget is "
            f"{format_size(limit)} and {format_size(used)} of host copies cannot leave it now (in use "
            f"by this op, shared with tensors the program holds, or CPU tensors): raise "
            f"tensorsManager.host_budget")


class _Spill:
    """A host copy being written to the spill file."""

    __slots__ = ("block", "pending", "range", "stale")

    def __init__(self, block: Block, pending: DiskPending, range_: FileRange):
        self.block, self.pending, self.range, self.stale = block, pending, range_, False


class HostTier:
    """Host copies within the host budget, and the disk tier below them.

    Attributes:
        budget: ``tensorsManager.host_budget`` as set (``None``: none of its own).
        limit: the host budget in force.
        hosted: id -> the pageable blocks with a host copy (counted in ``nbytes``).
        nbytes: host bytes of those copies; ``peak`` their most since the last reset.
        offload_dir: the spill file's folder (``None``: a temporary one).
        spill_file: the spill file, once a copy was spilled.
        spilling: host copies being written to the spill file.
        disk_io: the disk thread.
        disk_blocks: live blocks with a disk copy (strategies read ahead while any).
        watch: the system's available host memory, against ``host_reserve``.
    """


    def __init__(self, manager) -> None:
        self.m = manager
        self.budget: Optional[int] = None
        self.limit: Optional[int] = None
        self.hosted: Dict[int, Block] = {}
        self.nbytes: int = 0
        self.peak: int = 0
        self.offload_dir: Optional[str] = None
        self.spill_file: Optional[SpillFile] = None
        self.spilling: List[_Spill] = []
        self.disk_io = DiskIO()
        self.disk_blocks: int = 0
        self.watch = HostMemoryWatch()
        self.watch.release = lambda: manager.backend.release_cached()  # (on "sim": host memory)

    # -- accounting --------------------------------------------------------------------------

    def host_gained(self, block: Block) -> None:
        """``block`` has a host copy now (counted unless it is a CPU tensor's)."""
        if not block.host_only and block.id not in self.hosted:
            self.hosted[block.id] = block
            self.nbytes += block.nbytes
            if self.nbytes > self.peak:
                self.peak = self.nbytes

    def pin_host(self, block: Block) -> bool:
        """Move ``block``'s host copy into pinned memory (once); whether it is pinned now.

        Not for host bytes someone else holds (a tensor given to ``TensorRef(t)``, numpy):
        they must stay where they are.
        """
        if not block.host_valid or not self.host_copy_movable(block):
            return False
        buffer = self.m.backend.pinned.allocate(block.nbytes)
        if buffer is None:
            return False
        buffer.copy_(raw.flat_bytes(block.host_storage()))
        self.m.residency.forget_host(block)
        block.set_host(buffer.untyped_storage(), True)
        self.host_gained(block)
        return True

    def host_copy_movable(self, block: Block) -> bool:
        """Whether ``block`` has a host copy the manager may move: its own (Note [External
        bytes]), with no copy in flight into it or to the disk (and an accelerator to pin for)."""
        return not (self.m.backend.pinned is None or block.host is None or block.external or block.host_shared
                    or block.host_pending is not None or block.spilling is not None)

    def may_rehome(self, block: Block) -> bool:
        """Whether ``block``'s pageable host copy may move into pinned memory: movable, and
        nothing else holds it."""
        return (self.host_copy_movable(block) and not self.m.backend.pinned.is_pinned(block.host)
                and host_copy_is_ours(block))

    def count_host_copies(self) -> None:
        """After a device change: the host copies paged now (none on pass-through, where the
        blocks are the program's CPU tensors)."""
        m = self.m
        self.hosted = {} if m.backend.passthrough else {
            b.id: b for b in m.books.blocks.values() if b.host is not None and not b.host_only}
        self.nbytes = sum(b.nbytes for b in self.hosted.values())
        self.peak = max(self.peak, self.nbytes)

    def host_lost(self, block: Block) -> None:
        if self.hosted.pop(block.id, None) is not None:
            self.nbytes -= block.nbytes

    # -- disk copies ---------------------------------------------------------------------------

    def set_disk(self, block: Block, range_: FileRange) -> None:
        """``range_`` holds ``block``'s current bytes."""
        block.disk = range_
        self.disk_blocks += 1

    def disk_stale(self, block: Block) -> None:
        """``block`` was written: its disk copy (and one being written) no longer holds its bytes."""
        if block.disk is not None:
            block.disk.release()
            block.disk = None
            self.disk_blocks -= 1
        if block.spilling is not None:
            block.spilling.stale = True

    # -- making room -------------------------------------------------------------------------

    def make_room(self, nbytes: int, protect: Collection[int] = (), what: str = "a host copy") -> None:
        """Drop or spill host copies (strategy's choice) until ``nbytes`` more fit in the host budget."""
        limit = self.limit
        m = self.m
        if limit is None or self.nbytes + nbytes <= limit or m.backend.passthrough:
            return
        if m.accounting.pending:
            m.device_room.retire()  # (write-backs into host copies: a spill reads them)
        self.retire_spills()
        while self.nbytes + nbytes > limit:
            victim = m.strategy.choose_host_victim(self.candidates(protect), m.op_count)
            if victim is not None:
                self.leave_host(victim)
                continue
            if self.spilling:
                self.retire_spills(wait=True)
                continue
            if m.accounting.waitable():
                m.device_room.retire(wait=True)  # (copies still writing host copies: then spillable)
                continue
            raise HostBudgetError(nbytes, self.nbytes, limit, what)

    def keep_on_host(self, block: Block) -> bool:
        """Whether ``block``, leaving the device with its bytes only on disk, should be copied
        to host memory rather than read from disk again (the strategy says, by making room)."""
        room = self.room()
        if room is None or room >= block.nbytes:
            return room is not None  # (no host budget: blocks are never only on disk)
        return self.m.strategy.host_room_for(block, self.m.op_count)

    # -- what strategies use ----------------------------------------------------------------

    def op_room(self) -> Optional[int]:
        """Host bytes one op's tensors may hold under the host budget: the budget less the
        host copies no op can move (shared with the program's tensors, CPU tensors); ``None``
        when unlimited."""
        limit = self.limit
        if limit is None:
            return None
        return max(limit - sum(b.nbytes for b in self.hosted.values() if b.external or b.host_shared), 0)

    def holds(self, nbytes: int) -> bool:
        """Whether one op's tensors of ``nbytes`` fit the host budget together (``op_room``)."""
        room = self.op_room()
        return room is None or nbytes <= room

    def room(self) -> Optional[int]:
        """Host bytes that still fit under the host budget now; ``None`` when unlimited."""
        limit = self.limit
        return None if limit is None else max(limit - self.nbytes, 0)

    def drop_host_copy(self, block: Block) -> bool:
        """Drop ``block``'s host copy if that is free (a stale copy, or one a disk copy holds);
        whether it did. For strategies that make room for a read-ahead."""
        with self.m.lock:
            if (block.host is None or block.spilling is not None or block.external
                    or (block.host_valid and block.disk is None)):
                return False  # (held outside the manager: Note [External bytes])
            if block.host_pending is not None:
                if not block.host_pending.done():
                    return False
                self.m.residency.wait_pending_host(block)
            self.m.residency.drop_host(block)
            return True

    def candidates(self, protect: Collection[int]) -> Iterator[Block]:
        """The blocks whose host copy may leave host memory now (not those in ``protect``)."""
        for block in self.hosted.values():
            if (block.spilling is None and not block.external and not block.host_shared
                    and block.id not in protect and (block.host_pending is None or block.host_pending.done())):
                yield block

    def leave_host(self, block: Block) -> None:
        """Drop ``block``'s host copy, or start spilling it if no other copy holds its bytes."""
        residency = self.m.residency
        if block.host_pending is not None:
            residency.wait_pending_host(block)  # (finished: only its bookkeeping is left)
        if not block.host_valid or block.disk is not None:
            residency.drop_host(block)
            return
        spill = self.spill()
        nbytes = block.nbytes
        start = time.perf_counter_ns()
        offset = spill.allocate(nbytes)
        range_ = FileRange(spill.path, offset, nbytes, spill=spill)
        entry = _Spill(block, self.disk_io.submit(spill.write, offset, raw.flat_bytes(block.host_storage())), range_)
        block.spilling = entry
        self.spilling.append(entry)
        if self.m.trace is not None:
            self.m.trace.disk_move("to_disk", block.id, nbytes, start, time.perf_counter_ns())

    def retire_spills(self, wait: bool = False) -> None:
        """Finish the spills that ended (with ``wait``: all): their host copies go."""
        failed = None
        kept = []
        for entry in self.spilling:
            if not wait and not entry.pending.done():
                kept.append(entry)
                continue
            block = entry.block
            block.spilling = None
            try:
                entry.pending.wait_host()
            except DiskError as e:
                entry.range.release()
                failed = failed or e  # the host copy stays: nothing is lost
                continue
            self.m.statistics.counters["bytes_to_disk"] += block.nbytes
            if entry.stale or not block.alive:
                entry.range.release()  # written meanwhile, or freed: the slot holds nothing of use
                continue
            self.set_disk(block, entry.range)
            if block.host is not None:
                self.m.residency.drop_host(block)
        self.spilling = kept
        if failed is not None:
            raise failed

    def spill(self) -> SpillFile:
        """The spill file, made at its first use."""
        if self.spill_file is None:
            directory = self.offload_dir if self.offload_dir is not None else default_offload_dir()
            self.spill_file = SpillFile(directory)
        return self.spill_file

    def set_offload_dir(self, path: Optional[str]) -> None:
        """New spills go to ``path``; the old file goes once its slots are read back or freed."""
        if path == self.offload_dir:
            return
        self.retire_spills(wait=True)
        if self.spill_file is not None:
            self.spill_file.retire()  # (read from until its last slot is freed, then removed)
            self.spill_file = None
        self.offload_dir = path

    # -- reading back --------------------------------------------------------------------------

    def load_host(self, block: Block, protect: Collection[int] = ()) -> None:
        """Give ``block``, whose bytes are only on disk, a valid host copy now (waits for the read)."""
        self._start_read(block, protect)
        self.m.residency.wait_pending_host(block)

    def read_ahead(self, block: Block) -> bool:
        """Start reading ``block`` from disk into host memory on the disk thread; whether it did.

        For strategies: the read runs beside the ops, and the op or prefetch that needs the
        block waits for it. Skipped (``False``) when the block is not only on disk or the host
        budget has no room without spilling.
        """
        with self.m.lock:
            if block.host_valid or block.disk is None or block.dev is not None or not block.alive:
                return False
            room = self.room()
            if room is not None and room < block.nbytes:
                return False
            self._start_read(block, (block.id,), wait=False)
            return True

    def _start_read(self, block: Block, protect: Collection[int], wait: bool = True) -> None:
        m = self.m
        nbytes = block.nbytes
        self.make_room(nbytes, set(protect) | {block.id}, "reading a tensor back from disk")
        self.watch.reserve_bytes(nbytes)
        pinned = m.backend.pinned
        buffer = pinned.allocate(nbytes) if pinned is not None else None
        if buffer is None:
            buffer = raw.empty(nbytes, dtype=raw.UINT8)
        source = block.disk
        start = time.perf_counter_ns()
        block.set_host(buffer.untyped_storage(), True)
        self.host_gained(block)
        if wait:
            try:
                source.read_into(buffer)
            except BaseException:
                m.residency.drop_host(block)  # the block is as it was: only on disk
                raise
        else:
            block.host_pending = _ReadPending(self.disk_io.submit(source.read_into, buffer), self, block)
        m.statistics.counters["bytes_from_disk"] += nbytes
        if m.trace is not None:
            m.trace.disk_move("from_disk", block.id, nbytes, start, time.perf_counter_ns())

    def read_failed(self, block: Block) -> None:
        """A read-ahead of ``block`` failed: the host copy it was filling goes (the disk copy stays)."""
        with self.m.lock:
            if block.host is not None:
                self.m.residency.drop_host(block)


def host_copy_is_ours(block: Block) -> bool:
    """No tensor over ``block``'s host bytes but its own storage object (one use), and no
    other name for that object than ``block.host`` (where PyTorch cannot count: no). The
    views its TensorRefs cached are let go first: they are made again when next used."""
    block.drop_views()
    host = block.host_storage()
    return raw.storage_users(host) == 1 and sys.getrefcount(host) == 3  # (block.host, host, the call's)


class _ReadPending(DiskPending):
    """A read-ahead: a failure forgets the half-filled host copy before it is raised."""

    __slots__ = ("tier", "block")

    def __init__(self, pending: DiskPending, tier: HostTier, block: Block):
        super().__init__(pending.future)
        self.tier, self.block = tier, block

    def wait_host(self) -> None:
        try:
            self.future.result()
        except BaseException:
            self.tier.read_failed(self.block)
            raise

    wait_compute = wait_host
