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
stand-in copy holds the buffer, which stays allocated until the copy is waited on. Such
buffers are counted here (``pending``) until their copy is known to have ended: the count
is then at or above the allocator's on both.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Set, Tuple

from .streams import Pending

#: one check in this many reads the device even when the estimate fits (CUDA)
READ_EVERY = 64


class Accounting:
    """What counts against the budget now, the budget in force, and the peaks.

    Attributes:
        resident: device bytes of resident blocks, each as the allocator gives it.
        pending: ``(Pending, nbytes)`` of device buffers a copy still uses (Note
            [Stream-ordered frees]); ``pending_bytes`` their sum.
        elsewhere: whether the device has allocations beside the manager's to ask about.
        elsewhere_bytes: the last reading of those (``Backend.in_use_elsewhere``).
        limit: the budget in force in bytes (``None``: unlimited).
        peak: the most of ``resident + pending_bytes`` since the last reset.
        overshoot: the most bytes ever in use above the budget (stays 0 when it holds).
        warmed: the ``workspace_key()``s whose workspaces the device has made.
        checks: room checks made (one in ``READ_EVERY`` reads the device).
    """

    __slots__ = ("resident", "pending", "pending_bytes", "elsewhere", "elsewhere_bytes", "limit", "peak",
                 "overshoot", "warmed", "checks")

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

    def in_use(self) -> int:
        """Bytes counted against the budget now (the last reading of what is elsewhere)."""
        return self.resident + self.pending_bytes + self.elsewhere_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget now."""
        limit = self.limit
        return limit is None or self.resident + self.pending_bytes + self.elsewhere_bytes + nbytes <= limit

    def room(self) -> Optional[int]:
        """Bytes that still fit under the budget now; ``None`` when unlimited."""
        limit = self.limit
        if limit is None:
            return None
        return max(limit - self.resident - self.pending_bytes - self.elsewhere_bytes, 0)

    def add(self, nbytes: int) -> None:
        """A block became resident with ``nbytes`` (as the allocator gives them)."""
        self.resident += nbytes
        used = self.resident + self.pending_bytes
        if used > self.peak:
            self.peak = used
        limit = self.limit
        if limit is not None and used + self.elsewhere_bytes - limit > self.overshoot:
            self.overshoot = used + self.elsewhere_bytes - limit  # (the budget covers both)

    def remove(self, nbytes: int) -> None:
        """A resident block's ``nbytes`` left the device (or are now ``pending``)."""
        self.resident -= nbytes

    def hold(self, pending: Pending, nbytes: int) -> None:
        """A device buffer of ``nbytes`` stays allocated until ``pending`` ends (Note [Stream-ordered frees])."""
        self.pending.append((pending, nbytes))
        self.pending_bytes += nbytes

    def forget_ended(self) -> None:
        """Forget the held buffers whose copies are known to have ended (asking finishes none)."""
        if self.pending:
            kept = []
            for entry in self.pending:
                if entry[0].done():
                    self.pending_bytes -= entry[1]
                else:
                    kept.append(entry)
            self.pending = kept

    def retire(self, wait_host: Optional[Callable[[Pending], None]] = None) -> None:
        """Forget the held buffers whose copies ended (on ``"sim"``: end them now); with
        ``wait_host`` (a callable waiting on a pending copy), wait for all of them first."""
        kept = []
        for pending, nbytes in self.pending:
            if wait_host is not None:
                wait_host(pending)
            elif not pending.retire():
                kept.append((pending, nbytes))
                continue
            self.pending_bytes -= nbytes
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
        self.peak = self.resident + self.pending_bytes
        self.overshoot = 0
