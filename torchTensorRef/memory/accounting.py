"""The device bytes counted against the budget, and their peaks (Note [Budget on CUDA]).

Note [Budget on CUDA]: the budget bounds what the device has allocated: the manager's
blocks, the device buffers copies still use, and what it holds beside them
(``elsewhere``: libraries' workspaces, the program's plain device tensors). cuBLAS keeps
a workspace per thread's handle for the life of the process (tens of MiB), made at
a thread's first product: so the budget setter makes them first (``Backend.warm_up``:
this thread and autograd's device thread) and refuses a budget at or below them, and room
is made for a new thread's before its first kernel, then the device is read. Otherwise the
device is read when an estimate does not fit and every ``READ_EVERY``-th check (a reading
costs more than an op). Blocks count what the allocator gives them (``Backend.block_bytes``),
not the bytes they hold: counted bare, every small block would add up to 511 bytes to the
device's reading of what is outside the manager, which goes stale between readings, and
real use would pass the budget. What a kernel allocates and frees inside one call, and the
allocator's cache, are not counted (docs/concepts.md says what is promised). ``"sim"``
emulates the workspaces (``SimBackend.workspace``).

Note [Stream-ordered frees]: a device buffer that a copy on another stream still reads or
writes (a write-back's source, a prefetch dropped before it was used) must not be reused
before that copy ends, whatever the manager did with its block. On CUDA ``record_stream``
keeps the allocator from reusing it until the event recorded after the copy completes,
while ``memory_allocated`` stops counting it at the free (the caching allocator lowers its
allocated bytes in ``free``, before it waits on the stream's events); on ``"sim"`` the
stand-in copy holds the buffer until the copy ends, and the device counts it free at the
drop as CUDA's does (``Backend.freed_in_flight``). So such buffers (``pending``) are not
counted against the budget, which bounds ``memory_allocated``: room is never waited for
while a write-back drains, which would stall the host on every eviction of a dirty block
once the budget is full. They still take the device's memory until their copy ends: where
an allocation would not fit in the device beside them, the allocator waits for their copies
first (CUDA's does this itself before it reports an out-of-memory; ``Room.check_capacity``
on ``"sim"``). A reading of the device subtracts only the resident blocks from what it
holds, as the device no longer counts the pending ones. Every device buffer the manager
allocates is allocated on the stream the program's ops run on (a prefetch's too: the side
stream only writes it), so the copy streams hold no pool of their own for the budget to miss.

Note [Room for the allocator's slack]: a block is counted at what the device's allocator
counts for its buffer (``Backend.dev_bytes``), which may exceed ``Backend.block_bytes`` by up
to ``slack`` (Note [Allocator slack] in ``sim/caching.py``): the slack is known only once
the buffer is allocated. So room is made for ``slack`` more than asked (``Room.make``), which
keeps the next allocation within the budget whatever block it gets, and the room made is
remembered (``promised``) until allocations take it. After an allocation that came with
slack, blocks the op does not use are evicted until the room still promised, and the
``slack`` of the next one, fit again (``Room.settle``). Where nothing is left to evict the
margin is given up rather than the op refused: the count shows any overshoot.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Set, Tuple

from .streams import Pending

#: one check in this many reads the device even when the estimate fits (CUDA)
READ_EVERY = 64


class Accounting:
    """What counts against the budget now, the budget in force, and the peaks.

    Attributes:
        resident: device bytes of resident blocks, each as the allocator gives it.
        pending: ``(Pending, nbytes)`` of device buffers a copy still uses (Note
            [Stream-ordered frees]); ``pending_bytes`` their sum, which the device's memory
            holds but the budget does not count; and of dropped copies the program still
            views (``hold_viewed``), whose bytes are in ``elsewhere_bytes``.
        elsewhere: whether the device has allocations beside the manager's to ask about.
        elsewhere_bytes: the last reading of those (``Backend.in_use_elsewhere``).
        limit: the budget in force in bytes (``None``: unlimited).
        peak: the most of ``resident`` since the last reset.
        overshoot: the most bytes ever in use above the budget (stays 0 when it holds).
        warmed: the ``workspace_key()``s whose workspaces the device has made.
        checks: room checks made (one in ``READ_EVERY`` reads the device).
        slack: the most the device's allocator may count one allocation above
            ``Backend.block_bytes`` (Note [Room for the allocator's slack]).
        promised: bytes of the room last made that no allocation has taken yet.
        device_overshoot: the most the device itself held above the budget at an op's end,
            where asked (``tensorsManager.check_device``).
        reserved: room kept, within ``elsewhere_bytes``, for plain tensors code outside the
            manager's ops will make (Note [Loops on plain tensors] in ``regions/scope.py``),
            and for what regions' kernels allocate while they run (``kept``).
        kept: thread id -> the room kept (within ``reserved``) for the region step that thread
            runs outside the lock (Note [Room kept while a region runs] in ``regions/step.py``).
        readings: how many times the device was asked what it holds (``elsewhere_bytes``
            is as old as the last).
    """

    __slots__ = ("resident", "pending", "pending_bytes", "elsewhere", "elsewhere_bytes", "limit", "peak",
                 "overshoot", "warmed", "checks", "slack", "promised", "device_overshoot", "reserved", "reread",
                 "readings", "kept")

    def __init__(self) -> None:
        self.resident: int = 0
        self.pending: List[Tuple[Pending, int]] = []
        self.pending_bytes: int = 0
        self.elsewhere: bool = False
        self.elsewhere_bytes: int = 0
        self.limit: Optional[int] = None
        self.peak: int = 0
        self.overshoot: int = 0
        self.warmed: Set[object] = set()
        self.checks: int = 0
        self.slack: int = 0
        self.promised: int = 0
        self.device_overshoot: int = 0
        self.reserved: int = 0
        #: a buffer held as still viewed was let go: the next reading counts what is outside
        self.reread: bool = False
        self.readings: int = 0
        self.kept: Dict[int, int] = {}

    def reserve(self, nbytes: int) -> None:
        """Keep ``nbytes`` more of room (less, where negative) for plain tensors to come."""
        self.reserved += nbytes
        self.elsewhere_bytes += nbytes

    def keep(self, nbytes: int) -> None:
        """Keep ``nbytes`` of room, against other threads' ops, for the step this thread runs."""
        ident = threading.get_ident()
        self.kept[ident] = self.kept.get(ident, 0) + nbytes
        self.reserve(nbytes)

    def give_back(self) -> None:
        """The room this thread kept given back, if any (its step ended, or it runs an op itself)."""
        if not self.kept:
            return
        nbytes = self.kept.pop(threading.get_ident(), 0)
        if nbytes:
            self.reserve(-nbytes)

    def in_use(self) -> int:
        """Bytes counted against the budget now (the last reading of what is elsewhere)."""
        return self.resident + self.elsewhere_bytes

    def share(self) -> Optional[int]:
        """Bytes of the budget the manager may use: the limit less what the device holds
        beside its blocks, as last read, not counting the room kept for the plain tensors of
        its own steps running now (``reserved``); ``None``: no limit. What is "small" or
        "large" beside the budget is weighed against this, which is steady from op to op: on
        a GPU the limit also holds cuBLAS's workspaces, tens of MiB that are no room for
        blocks."""
        limit = self.limit
        return None if limit is None else max(limit - self.elsewhere_bytes + self.reserved, 0)

    def on_device(self) -> int:
        """Bytes the device's memory holds now: those of ``in_use`` and the buffers copies
        still use (what must fit in the device, not in the budget)."""
        return self.resident + self.pending_bytes + self.elsewhere_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget now."""
        limit = self.limit
        return limit is None or self.resident + self.elsewhere_bytes + nbytes <= limit

    def room(self) -> Optional[int]:
        """Bytes that still fit under the budget now; ``None`` when unlimited."""
        limit = self.limit
        if limit is None:
            return None
        return max(limit - self.resident - self.elsewhere_bytes, 0)

    def room_for(self, planned: int, nbytes: int) -> int:
        """Room a new allocation of ``nbytes`` needs, ``planned`` as ``Backend.block_bytes``
        counts it: the allocator's ``slack`` on top where a large one may get it (the pool
        of allocations of at most ``slack`` bytes splits off every rest)."""
        return planned + self.slack if nbytes > self.slack else planned

    def within(self, left: int) -> int:
        """Room to keep, out of ``left``, for allocations the allocator may give ``slack``
        more: a large one needs it, while ``slack`` bytes or less hold only small ones."""
        return max(left - self.slack, min(left, self.slack))

    def add(self, nbytes: int, planned: int = 0) -> None:
        """A block became resident with ``nbytes`` (as the allocator counts them), taking
        ``planned`` bytes of the room promised to it (``Backend.block_bytes``)."""
        self.resident += nbytes
        if planned:
            self.promised = max(self.promised - planned, 0)
        used = self.resident
        if used > self.peak:
            self.peak = used
        limit = self.limit
        if limit is not None and used + self.elsewhere_bytes - limit > self.overshoot:
            self.overshoot = used + self.elsewhere_bytes - limit  # (the budget covers both)

    def remove(self, nbytes: int) -> None:
        """A resident block's ``nbytes`` left the device (or are now ``pending``: not counted)."""
        self.resident -= nbytes

    def hold(self, pending: Pending, nbytes: int) -> None:
        """A device buffer of ``nbytes`` stays allocated until ``pending`` ends (Note [Stream-ordered frees])."""
        self.pending.append((pending, nbytes))
        self.pending_bytes += nbytes

    def hold_viewed(self, viewed: Pending, nbytes: int) -> None:
        """A dropped device copy of ``nbytes`` that the program still views: outside the
        manager from now on, as a reading of the device counts it, until ``viewed`` ends
        (Note [Buffers still viewed] in ``residency.py``). Not ``pending_bytes``: the device
        counts it allocated until the program lets go, so the budget counts it too."""
        self.pending.append((viewed, nbytes))
        self.elsewhere_bytes += nbytes

    def _ended(self, pending: Pending, nbytes: int) -> None:
        # (a held buffer is freed: a copy's bytes were pending, a viewed copy's outside)
        if pending.waitable:
            self.pending_bytes -= nbytes
        else:
            # (left to a reading of the device: another thread may still hold the buffer it
            # counted, the manager's count would fall below the device's)
            self.reread = True

    def waitable(self) -> bool:
        """Whether a held buffer's copy is still to be waited for (a buffer the program still
        views ends when the program drops the view: Note [Buffers still viewed])."""
        return any(entry[0].waitable for entry in self.pending)

    def forget_ended(self) -> None:
        """Forget the held buffers whose copies are known to have ended (asking finishes none),
        and give back the dropped copies no program view holds any more."""
        if self.pending:
            kept = []
            for entry in self.pending:
                pending = entry[0]
                if pending.done() if pending.waitable else pending.retire():
                    self._ended(*entry)
                else:
                    kept.append(entry)
            self.pending = kept

    def retire(self, wait_host: Optional[Callable[[Pending], None]] = None) -> None:
        """Forget the held buffers whose copies ended (on ``"sim"``: end them now); with
        ``wait_host`` (a callable waiting on a pending copy), wait for every copy first
        (buffers the program still views are kept while it does)."""
        kept = []
        for pending, nbytes in self.pending:
            if wait_host is not None and pending.waitable:
                wait_host(pending)
            if not pending.retire():
                kept.append((pending, nbytes))
                continue
            self._ended(pending, nbytes)
        self.pending = kept

    def record_top(self, top: int) -> None:
        """A step kept ``top`` bytes in use at once (a region's working set and the room it kept
        for what it allocates inside, ``elsewhere`` included): its peak and overshoot."""
        if top - self.elsewhere_bytes > self.peak:
            self.peak = top - self.elsewhere_bytes
        if self.limit is not None and top - self.limit > self.overshoot:
            self.overshoot = top - self.limit

    def reset_peak(self) -> None:
        """The peak restarts from the bytes in use now; no overshoot."""
        self.peak = self.resident
        self.overshoot = self.device_overshoot = 0
