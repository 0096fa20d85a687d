"""Region groups: the tensors a region owns, moved as one buffer (Note [Region groups]).

Note [Region groups]: a region's call needs its module's parameters and buffers together,
and under a budget they leave together. Moved block by block, each is an allocation, a
copy and its bookkeeping of its own: a decoder layer has nine or more. A *group* gives
them one buffer each way. Its members' host copies are ranges of one pinned host buffer
(``Group.host``), and when every member is off the device and the op bringing them in
needs them all (a region's call), or a prefetch brings them in, one device allocation
(``Group.base``) gets one copy, each member's device copy being its range of it (a storage
of its own over those bytes, so ops, views, autograd, ``state_dict`` and the program see
separate tensors exactly as before; ``raw.borrowed_range``: the group keeps ``base`` while
any range is used, PyTorch counting each range's users). A member's range
starts where the one before it ends, at its size as the allocator counts it
(``Backend.block_bytes``, a multiple of ``ALIGN``): the allocation takes what its members
would take apart, and every member is aligned for any dtype's kernels.

The books: while ``base`` is allocated it is counted once, at what the device's allocator
counts for it, and its members at 0 (``Block.dev_bytes``). A member leaves the device
alone as any block does (evicted, rewritten on the host, dead); its bytes stay allocated,
and counted, until the last member in ``base`` leaves, when ``base`` is freed as a block's
buffer is (its copies still reading it, views of it outside the manager: Note
[Stream-ordered frees], Note [Buffers still viewed]). One member out frees nothing, so the
victims of room-making take the rest of their group with them where the op does not need
them (``Residency.evict_victim``). Write-backs stay per member (its device range into its
host range, asynchronously: the host buffer is pinned) and read ``base`` itself, so that on
CUDA the allocator keeps ``base`` until they end (``record_stream``).

A group moves as one only where it is small beside the budget (``SHARE``) and no gradients
are recorded or computed (``Groups.movable`` says why). A member may still be fetched alone
(an op outside its region reads it): it gets a buffer of its own, as any block. A group
whose members change (one dies, is resized or gets another host copy) is dissolved: its
members go on as blocks of their own, and a region makes a new group of its tensors when it
runs next.
"""

from __future__ import annotations

import time
from typing import Collection, Iterable, List, Optional, Set

import torch

from ..core import raw
from ..core.blocks import Block
from .residency import InUse
from .streams import Copies, Pending

_in_backward = torch._C._current_graph_task_id

#: a member's range starts at a multiple of this many bytes (any dtype's alignment, and
#: CUDA's allocator's rounding): blocks whose counted size is not a multiple stay out
ALIGN = 512
#: a group moves as one only where it takes at most this share of the budget: room is freed
#: a whole group at a time, so under a budget of few groups the blocks kept from call to
#: call are whole groups only, and more bytes move (Note [Region groups])
SHARE = 1 / 8


class Group:
    """Blocks whose host copies are ranges of one buffer, brought in with one copy."""

    __slots__ = ("members", "offsets", "hosts", "host", "nbytes", "base", "ranges", "dev_bytes", "live",
                 "arriving", "reads", "dissolved")

    def __init__(self, members: List[Block], offsets: List[int], nbytes: int, host: torch.UntypedStorage):
        self.members = members
        #: each member's byte offset in both buffers
        self.offsets = offsets
        #: each member's host copy (its range of ``host``) while it is the group's: ``host``
        #: goes with the last
        self.hosts: List[Optional[torch.UntypedStorage]] = [None] * len(members)
        #: the pinned host buffer
        self.host = host
        #: bytes of both buffers: the members' sizes as the allocator counts them
        self.nbytes = nbytes
        #: the device buffer while any member's device copy is a range of it, else None
        self.base: Optional[torch.UntypedStorage] = None
        #: the members' ranges of ``base``, made when it was: kept with it (they do not keep it)
        self.ranges: List[torch.UntypedStorage] = []
        #: what the device's allocator counts for ``base``
        self.dev_bytes = 0
        #: ids of the members whose device copy is a range of ``base``
        self.live: Set[int] = set()
        #: the prefetch copying into ``base``, if it brought the group in
        self.arriving: Optional[Pending] = None
        #: write-backs reading ``base`` (pruned as they end)
        self.reads: List[Pending] = []
        #: a member changed: never moved as one again
        self.dissolved = False

    def index(self, block: Block) -> int:
        return self.members.index(block)

    def device_range(self, block: Block) -> torch.Tensor:
        """``block``'s bytes in ``base`` as a view of ``base`` (the source of its write-back)."""
        assert self.base is not None
        # (one tensor over the range: a copy's one view of the buffer, ``buffer_users``)
        return raw.typed_view(self.base, raw.UINT8, (block.nbytes,), (1,), self.offsets[self.index(block)])


class _Reads(Copies):
    """Write-backs reading a group's device buffer, freed with them in flight: what the
    buffer's release waits for (``Residency.release``), their views of it its users."""

    __slots__ = ()
    untracked = False  # (they write their members' own host ranges, which stay theirs)

    def retire(self) -> bool:
        return all([part.retire() for part in self.parts])

    def buffer_users(self) -> int:
        return sum(part.buffer_users() for part in self.parts)


class _Viewed(InUse):
    """A group's device buffer whose ranges tensors outside the manager still view (Note
    [Buffers still viewed] in ``residency.py``): freed once none does."""

    __slots__ = ("ranges",)

    def __init__(self, base: torch.UntypedStorage, ranges: List[torch.UntypedStorage], free, copy) -> None:
        super().__init__(base, free, copy)
        self.ranges = ranges

    def done(self) -> bool:
        return all(raw.storage_users(r) == 1 for r in self.ranges) and super().done()


class Groups:
    """The groups of the manager's blocks: made, brought in, let go (Note [Region groups])."""

    def __init__(self, manager) -> None:
        self.m = manager

    # -- making one ----------------------------------------------------------------------------

    def form(self, blocks: Iterable[Block]) -> Optional[Group]:
        """A group of those of ``blocks`` that can be one (at least two), their host copies
        moved into its buffer; ``None`` where fewer can, or no pinned buffer is left."""
        m = self.m
        backend = m.backend
        if backend.passthrough or backend.pinned is None or m.host_tier.limit is not None:
            return None  # (nothing moves; or host copies may leave for the disk)
        members, seen = [], set()
        for b in blocks:
            if b.id not in seen and self._joins(b):
                seen.add(b.id)
                members.append(b)
        if len(members) < 2:
            return None
        offsets, nbytes = [], 0
        for b in members:
            offsets.append(nbytes)
            nbytes += backend.block_bytes(b.nbytes)
        if not self._small(nbytes):
            return None
        m.host_tier.watch.reserve_bytes(nbytes)
        buffer = backend.pinned.allocate(nbytes)
        if buffer is None:
            return None
        group = Group(members, offsets, nbytes, buffer.untyped_storage())
        residency, tier = m.residency, m.host_tier
        for i, b in enumerate(members):
            start = offsets[i]
            residency.wait_pending_host(b)
            buffer[start:start + b.nbytes].copy_(raw.flat_bytes(b.host_storage()))
            residency.forget_host(b)
            host = raw.alias_range(group.host, start, start + b.nbytes)
            b.set_host(host, True)
            tier.host_gained(b)
            group.hosts[i] = host
            b.group = group
        return group

    def _joins(self, b: Block) -> bool:
        """Whether ``b`` may join a new group: its host copy current, its own, in host memory,
        its size a multiple of ``ALIGN`` as counted, and no group holding it on the device."""
        old = b.group
        return (b.alive and not b.host_only and b.nbytes > 0 and b.host is not None and b.host_valid
                and not b.external and not b.host_shared and b.host_parent is None and b.disk is None
                and b.spilling is None and (b.host_pending is None or b.host_pending.done())
                and self.m.backend.block_bytes(b.nbytes) % ALIGN == 0
                and (old is None or old.dissolved and old.base is None))

    # -- bringing it in ------------------------------------------------------------------------

    def _small(self, nbytes: int) -> bool:
        """Whether a group of ``nbytes`` is small beside the manager's share of the budget
        (``SHARE``; ``Accounting.share``)."""
        share = self.m.accounting.share()
        return share is not None and nbytes <= SHARE * share

    def movable(self, group: Group, protect: Optional[Collection[int]]) -> bool:
        """Whether ``group`` comes in as one: without gradients, intact, small beside the
        budget, every member off the device with its host copy current, and (``protect``
        given: an op's blocks) every member needed.

        Not while gradients are recorded or computed: a backward needs some of a region's
        tensors only (a weight, not its bias), and those it holds would keep the whole buffer
        allocated, the rest of it unusable, where a tight budget needs every byte."""
        if (group.dissolved or group.base is not None or not self._small(group.nbytes)
                or torch.is_grad_enabled() or _in_backward() != -1):
            return False
        for b in group.members:
            if b.dev is not None or not b.host_valid or b.external or (protect is not None and b.id not in protect):
                return False
        return True

    def fetch(self, group: Group, protect: Collection[int]) -> None:
        """Bring ``group`` in for an op, on the compute stream: one allocation, one copy."""
        m = self.m
        start = time.perf_counter_ns()
        if m.backend.simulated:
            m.host_tier.watch.reserve_bytes(group.nbytes)  # (the simulated device is host memory)
        base = m.device_room.allocate(group.nbytes, protect, "fetch")
        self._after_write_backs(group)
        m.backend.streams.copy_ordered(base, raw.flat_bytes(group.host))
        self._resident(group, base, start, "ordered", None)
        for b in group.members:
            b.fetches += 1
        counters = m.statistics.counters
        counters["fetches"] += len(group.members)
        counters["bytes_on_demand"] += sum(b.nbytes for b in group.members)
        if group.dev_bytes > m.backend.block_bytes(group.nbytes):
            m.device_room.settle(protect)

    def prefetch(self, group: Group) -> bool:
        """Bring ``group`` in ahead of use on a side stream, where it fits the budget now;
        whether it did (no prefetch ever makes room or fails the op it runs beside)."""
        m = self.m
        acct = m.accounting
        backend = m.backend
        if acct.limit is not None and acct.in_use() + acct.room_for(backend.block_bytes(group.nbytes),
                                                                     group.nbytes) > acct.limit:
            return False
        start = time.perf_counter_ns()
        base = m.residency.prefetch_buffer(group.nbytes)
        if base is None:
            return False
        self._after_write_backs(group)
        pending = backend.streams.copy_async(base, raw.flat_bytes(group.host), prefetch=True)
        self._resident(group, base, start, "async", pending)
        counters = m.statistics.counters
        for b in group.members:
            b.prefetch_op = m.op_count  # (ops from this index on run after the one issuing it)
        counters["prefetches"] += len(group.members)
        counters["bytes_prefetched"] += sum(b.nbytes for b in group.members)
        return True

    def _after_write_backs(self, group: Group) -> None:
        # (a member's write-back into its host range may still run: the copy in comes after)
        for b in group.members:
            if b.host_pending is not None:
                b.host_pending.wait_compute()

    def _resident(self, group: Group, base: torch.Tensor, start: int, mode: str, pending: Optional[Pending]) -> None:
        m = self.m
        backend = m.backend
        storage = base.untyped_storage()
        group.base, group.arriving = storage, pending
        group.dev_bytes = backend.dev_bytes(storage)
        m.accounting.add(group.dev_bytes, group.nbytes)
        books, counters, trace = m.books, m.statistics.counters, m.trace
        end = time.perf_counter_ns() if trace is not None else 0
        ranges = group.ranges = []
        for b, offset in zip(group.members, group.offsets):
            dev = raw.borrowed_range(storage, offset, offset + b.nbytes)
            ranges.append(dev)
            backend.track_alias(dev)
            books.made_resident(b, dev, pending, counted=0)
            group.live.add(b.id)
            counters["bytes_to_device"] += b.nbytes
            if trace is not None:
                trace.move("to_device", b.id, b.nbytes, start, end, m.accounting.resident, mode)
        counters["copies_to_device"] += 1

    # -- letting it go -------------------------------------------------------------------------

    def left(self, group: Group, block: Block) -> None:
        """``block``'s device copy, its range of ``group.base``, was dropped; with the last
        one, ``base`` is freed (once what still reads it ends)."""
        live = group.live
        live.discard(block.id)
        if live:
            return
        m = self.m
        base, group.base = group.base, None
        arriving, group.arriving = group.arriving, None
        reads, group.reads = [p for p in group.reads if not p.done()], []
        ranges, group.ranges = group.ranges, []
        if base is None:
            return
        m.accounting.remove(group.dev_bytes)
        if arriving is not None and not arriving.done():
            # (a prefetch never waited on still writes it: counted until it ends, Note
            # [Stream-ordered frees]; no op read its ranges)
            m.accounting.hold(arriving, group.dev_bytes)
            m.backend.freed_in_flight(base)
            return
        copies = _Reads(reads) if reads else None
        if copies is not None:
            m.accounting.hold(copies, group.dev_bytes)  # (the device's memory holds it until they end)
        viewed = [r for r in ranges if raw.storage_users(r) != 1]
        if viewed:
            # (the ranges do not keep ``base``: it stays here, counted, until no view of them is left)
            m.accounting.hold_viewed(_Viewed(base, viewed, m.residency.release, copies), group.dev_bytes)
            return
        m.residency.free_buffer(base, copies, group.dev_bytes)

    def wrote_back(self, group: Group, pending: Pending) -> None:
        """A member's write-back reads ``group.base`` until ``pending`` ends."""
        reads = group.reads
        if len(reads) > 8:
            reads[:] = [p for p in reads if not p.done()]
        reads.append(pending)

    def host_left(self, block: Block, host: torch.UntypedStorage) -> None:
        """``block`` no longer uses ``host`` as its host copy: where that was its range of its
        group's buffer, the group is dissolved, and the buffer goes with the last range."""
        group = block.group
        assert group is not None
        hosts, i = group.hosts, group.index(block)
        if host is not hosts[i]:
            return
        hosts[i] = None
        group.dissolved = True
        if not any(h is not None for h in hosts):
            m = self.m
            pinned = m.backend.pinned
            # (none where the device changed since to one without pinned memory, the CPU:
            # the buffer goes with its last view, as an unpinned one would)
            if pinned is not None:
                pinned.freed(group.host, m.residency.kept_limit())

    def detach(self, block: Block) -> None:
        """``block``'s storage may be resized or replaced (a restriding op writes it): its
        group is dissolved and, where its device copy is a range of it, that copy is evicted
        (the op fetches it into a buffer of its own)."""
        group = block.group
        if group is None:
            return
        group.dissolved = True
        if block.id in group.live:
            self.m.residency.evict(block)
