"""The host tier: host copies within ``tensorsManager.host_budget``, the disk below them.

Every host copy of a block the manager pages (not a CPU tensor's: those are the program's)
is counted in ``_host_bytes``. Before a new one is made (a write-back, a read from disk)
``_make_host_room`` brings the total under the host budget by dropping host copies, the
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
from typing import Collection, Dict, List, Optional

from ..core import raw
from ..core.blocks import Block
from ..core.sizes import format_size
from .disk import DiskError, DiskIO, DiskPending, FileRange, SpillFile, default_offload_dir

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
    """The ``TensorsManager`` methods of the host budget and the disk tier."""

    def _init_host_tier(self) -> None:
        self._host_budget: Optional[int] = None
        self._host_limit: Optional[int] = None  # the host budget in force
        self._hosted: Dict[int, Block] = {}  # pageable blocks with a host copy
        self._host_bytes = 0
        self._peak_host = 0
        self._offload_dir: Optional[str] = None
        self._spill_file: Optional[SpillFile] = None
        self._spilling: List[_Spill] = []
        self._disk_io = DiskIO()
        self._disk_blocks = 0  # live blocks with a disk copy (strategies read ahead while any)

    # -- accounting --------------------------------------------------------------------------

    def _host_gained(self, block: Block) -> None:
        """``block`` has a host copy now (counted unless it is a CPU tensor's)."""
        if not block.host_only and block.id not in self._hosted:
            self._hosted[block.id] = block
            self._host_bytes += block.nbytes
            if self._host_bytes > self._peak_host:
                self._peak_host = self._host_bytes

    def _pin_host(self, block: Block) -> bool:
        """Move ``block``'s host copy into pinned memory (once); whether it is pinned now.

        Not for host bytes someone else holds (a tensor given to ``TensorRef(t)``, numpy):
        they must stay where they are.
        """
        if not block.host_valid or not self._host_copy_movable(block):
            return False
        buffer = self._backend.pinned.allocate(block.nbytes)
        if buffer is None:
            return False
        buffer.copy_(raw.flat_bytes(block.host))
        self._forget_host(block)
        block.set_host(buffer.untyped_storage(), True)
        self._host_gained(block)
        return True

    def _host_copy_movable(self, block: Block) -> bool:
        """Whether ``block`` has a host copy the manager may move: its own (Note [External
        bytes]), with no copy in flight into it or to the disk (and an accelerator to pin for)."""
        return not (self._backend.pinned is None or block.host is None or block.external or block.host_shared
                    or block.host_pending is not None or block.spilling is not None)

    def _may_rehome(self, block: Block) -> bool:
        """Whether ``block``'s pageable host copy may move into pinned memory: movable, and
        nothing else holds it."""
        return (self._host_copy_movable(block) and not self._backend.pinned.is_pinned(block.host)
                and self._host_copy_is_ours(block))

    @staticmethod
    def _host_copy_is_ours(block: Block) -> bool:
        """No tensor over ``block``'s host bytes but its own storage object (one use), and no
        other name for that object than ``block.host`` (where PyTorch cannot count: no). The
        views its TensorRefs cached are let go first: they are made again when next used."""
        block._drop_views()
        host = block.host
        return raw.storage_users(host) == 1 and sys.getrefcount(host) == 3  # (block.host, host, the call's)

    def _count_host_copies(self) -> None:
        """After a device change: the host copies paged now (none on pass-through, where the
        blocks are the program's CPU tensors)."""
        self._hosted = {} if self._backend.passthrough else {
            b.id: b for b in self._blocks.values() if b.host is not None and not b.host_only}
        self._host_bytes = sum(b.nbytes for b in self._hosted.values())
        self._peak_host = max(self._peak_host, self._host_bytes)

    def _host_lost(self, block: Block) -> None:
        if self._hosted.pop(block.id, None) is not None:
            self._host_bytes -= block.nbytes

    # -- disk copies ---------------------------------------------------------------------------

    def _set_disk(self, block: Block, range_: FileRange) -> None:
        """``range_`` holds ``block``'s current bytes."""
        block.disk = range_
        self._disk_blocks += 1


    def _disk_stale(self, block: Block) -> None:
        """``block`` was written: its disk copy (and one being written) no longer holds its bytes."""
        if block.disk is not None:
            block.disk.release()
            block.disk = None
            self._disk_blocks -= 1
        if block.spilling is not None:
            block.spilling.stale = True

    # -- making room -------------------------------------------------------------------------

    def _make_host_room(self, nbytes: int, protect: Collection[int] = (), what: str = "a host copy") -> None:
        """Drop or spill host copies (strategy's choice) until ``nbytes`` more fit in the host budget."""
        limit = self._host_limit
        if limit is None or self._host_bytes + nbytes <= limit or self._backend.passthrough:
            return
        if self._inflight:
            self._retire_inflight()  # (write-backs into host copies: a spill reads them)
        self._retire_spills()
        while self._host_bytes + nbytes > limit:
            victim = self._strategy.choose_host_victim(self._host_candidates(protect), self._op_count)
            if victim is not None:
                self._leave_host(victim)
                continue
            if self._spilling:
                self._retire_spills(wait=True)
                continue
            raise HostBudgetError(nbytes, self._host_bytes, limit, what)

    def _keep_on_host(self, block: Block) -> bool:
        """Whether ``block``, leaving the device with its bytes only on disk, should be copied
        to host memory rather than read from disk again (the strategy says, by making room)."""
        room = self.host_room()
        if room is None or room >= block.nbytes:
            return room is not None  # (no host budget: blocks are never only on disk)
        return self._strategy.host_room_for(block, self._op_count)

    # -- what strategies use ----------------------------------------------------------------

    def host_room(self) -> Optional[int]:
        """Host bytes that still fit under the host budget now; ``None`` when unlimited."""
        limit = self._host_limit
        return None if limit is None else max(limit - self._host_bytes, 0)

    def host_copies(self):
        """The blocks whose host copy may leave host memory now (for strategies)."""
        return self._host_candidates(())

    def drop_host_copy(self, block: Block) -> bool:
        """Drop ``block``'s host copy if that is free (a stale copy, or one a disk copy holds);
        whether it did. For strategies that make room for a read-ahead."""
        with self._lock:
            if block.host is None or block.spilling is not None or (block.host_valid and block.disk is None):
                return False
            if block.host_pending is not None:
                if not block.host_pending.done():
                    return False
                self._wait_pending_host(block)
            self._drop_host(block)
            return True

    def _host_candidates(self, protect: Collection[int]):
        for block in self._hosted.values():
            if (block.spilling is None and not block.external and not block.host_shared
                    and block.id not in protect and (block.host_pending is None or block.host_pending.done())):
                yield block

    def _leave_host(self, block: Block) -> None:
        """Drop ``block``'s host copy, or start spilling it if no other copy holds its bytes."""
        if block.host_pending is not None:
            self._wait_pending_host(block)  # (finished: only its bookkeeping is left)
        if not block.host_valid or block.disk is not None:
            self._drop_host(block)
            return
        spill = self._spill()
        nbytes = block.nbytes
        start = time.perf_counter_ns()
        offset = spill.allocate(nbytes)
        range_ = FileRange(spill.path, offset, nbytes, spill=spill)
        entry = _Spill(block, self._disk_io.submit(spill.write, offset, raw.flat_bytes(block.host)), range_)
        block.spilling = entry
        self._spilling.append(entry)
        if self._trace is not None:
            self._trace.disk_move("to_disk", block.id, nbytes, start, time.perf_counter_ns())

    def _retire_spills(self, wait: bool = False) -> None:
        """Finish the spills that ended (with ``wait``: all): their host copies go."""
        failed = None
        kept = []
        for entry in self._spilling:
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
            self._counters["bytes_to_disk"] += block.nbytes
            if entry.stale or not block.alive:
                entry.range.release()  # written meanwhile, or freed: the slot holds nothing of use
                continue
            self._set_disk(block, entry.range)
            if block.host is not None:
                self._drop_host(block)
        self._spilling = kept
        if failed is not None:
            raise failed

    def _spill(self) -> SpillFile:
        if self._spill_file is None:
            directory = self._offload_dir if self._offload_dir is not None else default_offload_dir()
            self._spill_file = SpillFile(directory)
        return self._spill_file

    # -- reading back --------------------------------------------------------------------------

    def _load_host(self, block: Block, protect: Collection[int] = ()) -> None:
        """Give ``block``, whose bytes are only on disk, a valid host copy now (waits for the read)."""
        self._start_read(block, protect)
        self._wait_pending_host(block)

    def read_ahead(self, block: Block) -> bool:
        """Start reading ``block`` from disk into host memory on the disk thread; whether it did.

        For strategies: the read runs beside the ops, and the op or prefetch that needs the
        block waits for it. Skipped (``False``) when the block is not only on disk or the host
        budget has no room without spilling.
        """
        with self._lock:
            if block.host_valid or block.disk is None or block.dev is not None or not block.alive:
                return False
            room = self.host_room()
            if room is not None and room < block.nbytes:
                return False
            self._start_read(block, (block.id,), wait=False)
            return True

    def _start_read(self, block: Block, protect: Collection[int], wait: bool = True) -> None:
        nbytes = block.nbytes
        self._make_host_room(nbytes, set(protect) | {block.id}, "reading a tensor back from disk")
        self._host_watch.reserve_bytes(nbytes)
        pinned = self._backend.pinned
        buffer = pinned.allocate(nbytes) if pinned is not None else None
        if buffer is None:
            buffer = raw.empty(nbytes, dtype=raw.UINT8)
        source = block.disk
        start = time.perf_counter_ns()
        block.set_host(buffer.untyped_storage(), True)
        self._host_gained(block)
        if wait:
            try:
                source.read_into(buffer)
            except BaseException:
                self._drop_host(block)  # the block is as it was: only on disk
                raise
        else:
            block.host_pending = _ReadPending(self._disk_io.submit(source.read_into, buffer), self, block)
        self._counters["bytes_from_disk"] += nbytes
        if self._trace is not None:
            self._trace.disk_move("from_disk", block.id, nbytes, start, time.perf_counter_ns())

    def _read_failed(self, block: Block) -> None:
        """A read-ahead of ``block`` failed: the host copy it was filling goes (the disk copy stays)."""
        with self._lock:
            if block.host is not None:
                self._drop_host(block)



class _ReadPending(DiskPending):
    """A read-ahead: a failure forgets the half-filled host copy before it is raised."""

    __slots__ = ("manager", "block")

    def __init__(self, pending: DiskPending, manager, block: Block):
        super().__init__(pending.future)
        self.manager, self.block = manager, block

    def wait_host(self) -> None:
        try:
            self.future.result()
        except BaseException:
            self.manager._read_failed(self.block)
            raise

    wait_compute = wait_host
