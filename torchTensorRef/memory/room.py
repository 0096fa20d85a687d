"""Room on the device: what it holds beside the manager, making room within the budget, and
allocating with a recovery from out-of-memory errors.

Note [Garbage holding device memory]: device tensors that only reference cycles hold (an
exception's frames, a closure that refers to its module, tensors an autograd node's hook
refers back to) stay allocated until Python's cycle collector runs, whenever its counts of
allocations say. The device counts them (``memory_allocated`` on CUDA, ``"sim"`` likewise),
so a reading counts them as outside the manager, and an op that fits beside what the program
holds would be refused. So before refusing for room the manager collects cycles, applies the
deaths of the TensorRefs that freed, and reads the device again (``Room.collect_garbage``).
A full collection takes tens to hundreds of milliseconds where the heap is large, and a
refusal is not rare where it is caught (an op refused whole runs in pieces, a region refused
runs op by op, on every call): so it collects only where the device holds more outside the
manager than at the budget's setting or the last collection (what was outside then, the
budget was set over or a collection could not free), and after a collection that freed no
device bytes the next waits for ``COLLECT_BACKOFF`` room checks, twice as many after each
such collection (up to ``COLLECT_BACKOFF_MAX``).

An out-of-memory error from an allocation (a real one on CUDA, the capacity check on
``"sim"``) evicts every unpinned block the current op does not use, returns cached memory
to the driver and tries once more; a second failure raises ``DeviceOutOfMemoryError``.
"""

from __future__ import annotations

import gc
from typing import Any, Collection, Optional

import torch

from ..core.errors import DeviceOutOfMemoryError, OutOfBudgetError
from ..core.sizes import format_size
from .accounting import READ_EVERY
from .devices import workspace_key
from .streams import Pending

#: substrings of the errors libraries raise when their own device allocations fail
_OOM_MARKERS = ("out of memory", "ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED")
#: room checks after a collection that freed no device bytes before the next (Note
#: [Garbage holding device memory]); doubled after each, up to the most
COLLECT_BACKOFF = 256
COLLECT_BACKOFF_MAX = 1 << 20


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` reports a failed device allocation (cuBLAS and cuDNN raise RuntimeErrors)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MARKERS)


class Fault:
    """What ``tensorsManager.fault_injector`` is called with, before each allocation and op.

    Attributes:
        kind: ``"op"`` (an op about to run), ``"fetch"``, ``"prefetch"``, ``"writeback"``
            or ``"create"`` (a device allocation about to be made).
        nbytes: bytes of the allocation (for ``"op"``: of the op's new results).
        op: the :class:`~torchTensorRef.ops.op_context.OpContext` for ``"op"``, else ``None``.
        name: the op's name for ``"op"``, else ``kind``.
    """

    __slots__ = ("kind", "nbytes", "op")

    def __init__(self, kind: str, nbytes: int, op: Any = None) -> None:
        self.kind, self.nbytes, self.op = kind, nbytes, op

    @property
    def name(self) -> str:
        return self.op.name if self.op is not None else self.kind

    def __repr__(self) -> str:
        return f"Fault({self.name}, {self.nbytes} bytes)"


class Room:
    """Readings of the device and room made within the budget (the strategy chooses victims)."""


    def __init__(self, manager) -> None:
        self.m = manager
        #: ``Accounting.checks`` before which no garbage is collected, the wait after the
        #: last collection, and the bytes outside the manager then (Note [Garbage holding
        #: device memory])
        self.collect_after = 0
        self.backoff = 0
        self.outside_seen = 0

    # -- readings of the device (Note [Budget on CUDA] in ``accounting.py``) ------------------

    def used_bytes(self) -> int:
        """Device bytes that count against the budget now (asking the device what else it holds)."""
        acct = self.m.accounting
        acct.readings += 1
        acct.reread = False
        # (less the resident blocks only: the device counts a buffer a copy still uses free
        # once dropped, Note [Stream-ordered frees])
        acct.elsewhere_bytes = self.m.backend.in_use_elsewhere(acct.resident) + acct.reserved
        return acct.resident + acct.elsewhere_bytes

    def read_outside(self) -> int:
        """Device bytes allocated outside the manager, asked of the device now (and remembered).

        Buffers whose copies are known to have ended are forgotten first: the allocator
        freed them, and the reading would otherwise subtract them as still held. Asking
        does not finish a copy ("sim"'s stay deferred: their buffers are allocated until
        then, as counted)."""
        self.m.accounting.forget_ended()
        self.used_bytes()
        return self.m.accounting.elsewhere_bytes

    def collect_garbage(self, always: bool = False) -> bool:
        """Before refusing for room: collect reference cycles and read the device again, where
        the device holds more outside the manager than when last asked and no recent
        collection came up empty (or ``always``); whether it ran (Note [Garbage holding
        device memory]). The caller holds the manager's lock."""
        m = self.m
        acct = m.accounting
        if acct.checks < self.collect_after and not always:
            return False
        m.drain()  # (deaths already queued: what follows measures the collection's)
        before = self.used_bytes()
        if acct.elsewhere_bytes - acct.reserved <= self.outside_seen and not always:
            return False
        gc.collect()
        m.drain()  # (the TensorRefs the collection freed give their blocks back)
        freed = before - self.used_bytes()
        self.backoff = 0 if freed > 0 else min(max(2 * self.backoff, COLLECT_BACKOFF), COLLECT_BACKOFF_MAX)
        self.collect_after = acct.checks + self.backoff
        self.outside_seen = acct.elsewhere_bytes - acct.reserved
        m.statistics.counters["garbage_collections"] += 1
        return True

    def collect_again(self) -> None:
        """A budget was set (over what the device holds outside the manager now, as last
        read): collect before a refusal once more is outside. The checks count from here, so
        the device is read at the same ops of a program under a budget whatever ran before."""
        acct = self.m.accounting
        acct.checks = self.collect_after = self.backoff = 0
        self.outside_seen = acct.elsewhere_bytes - acct.reserved

    def warm_up(self) -> int:
        """Have the device make the workspaces of this thread and of the backward (once:
        each warm-up runs a product, which would raise the device's peak that ``stats()``
        reports), then read what it holds outside the manager."""
        warmed = self.m.accounting.warmed
        key = workspace_key()
        if key not in warmed or "backward" not in warmed:
            self.m.backend.warm_up()
            warmed.update((key, "backward"))
        return self.read_outside()

    def retire(self, wait: bool = False) -> None:
        """Forget the held buffers whose copies ended (on ``"sim"``: end them); with ``wait``, all."""
        acct = self.m.accounting
        acct.retire(self.wait_host if wait else None)
        if acct.reread:
            self.used_bytes()

    def wait_host(self, pending: Pending) -> None:
        """Block the host until ``pending`` ends (counted as a host wait if it had not)."""
        if not pending.done():
            self.m.statistics.counters["host_syncs"] += 1
        pending.wait_host()

    # -- making room ------------------------------------------------------------------------

    def make(self, nbytes: int, protect: Collection[int], op_name: str, allocated: int = 0, inside: int = 0) -> None:
        """Evict (strategy's choice) until ``nbytes`` more fit in the budget; ``allocated`` of
        them are already allocated, to become blocks (a region's outputs): not outside too;
        nor ``inside``, what a running region's kernels hold in the room kept for them.
        Room is made for the allocator's ``slack`` too (Note [Room for the allocator's slack])."""
        m = self.m
        acct = m.accounting
        limit = acct.limit
        if limit is None:
            return
        if m.unresolved:
            m.resolve_device()
        acct.checks += 1
        if acct.elsewhere:
            key = workspace_key()
            if key not in acct.warmed:
                # A thread's first op: its workspaces are made (and counted) before its kernels.
                acct.warmed.add(key)
                m.backend.warm_up(backward=False)
                self.used_bytes()
        acct.promised = nbytes - allocated
        margin = acct.slack if acct.promised > acct.slack else 0  # (a small allocation has none)
        if (acct.resident + acct.elsewhere_bytes + nbytes + margin <= limit
                and (not acct.elsewhere or acct.checks % READ_EVERY)):
            return  # the common case: without asking the device (CUDA) what else it holds
        self._evict_for(nbytes, protect, op_name, allocated + inside, limit, margin)

    def settle(self, protect: Collection[int]) -> None:
        """An allocation came with slack: evict what ``protect`` does not name until the room
        still promised, and the slack of the next allocation, fit (Note [Room for the
        allocator's slack])."""
        m = self.m
        acct = m.accounting
        limit = acct.limit
        if limit is None:
            return
        while acct.in_use() + acct.promised + acct.slack > limit:
            victim = m.strategy.choose_victim(protect)
            if victim is None:
                return  # (the margin is given up: the count shows any overshoot)
            if not m.residency.evict_victim(victim, protect):
                protect = {*protect, victim.id}  # (its group's buffer stays: it frees nothing)

    def _evict_for(self, nbytes: int, protect: Collection[int], op_name: str, allocated: int, limit: int,
                   margin: int = 0) -> None:
        m = self.m
        acct = m.accounting
        while True:
            if acct.pending:
                # finished copies give their buffers back (on "sim": all); the reading below
                # counts what a buffer held as viewed let go (``Room.retire`` would read twice)
                acct.retire()
            used = self.used_bytes()
            taken = min(allocated, acct.elsewhere_bytes)  # (a reading counts them outside the manager)
            acct.elsewhere_bytes, used = acct.elsewhere_bytes - taken, used - taken
            if used + nbytes + margin <= limit:
                return
            victim = m.strategy.choose_victim(protect)
            if victim is not None:
                m.note_pressure()
                if not m.residency.evict_victim(victim, protect):
                    protect = {*protect, victim.id}  # (its group's buffer stays: it frees nothing)
                continue
            if used + nbytes <= limit:
                return  # (the room fits without the slack's margin: given up)
            if self.collect_garbage():
                continue
            raise OutOfBudgetError(
                op_name, used + nbytes, limit,
                f"{format_size(m.books.pinned_bytes())} is pinned and the rest is in use by this op",
                outside=acct.elsewhere_bytes,
            )

    def recover(self, protect: Collection[int]) -> None:
        """After an out-of-memory error: free every device byte the current op does not need."""
        m = self.m
        for block in [b for b in m.books.resident.values() if b.id not in protect and not b.pins]:
            m.residency.evict(block)
        self.retire(wait=True)
        m.backend.release_cached()
        if m.settings.budget is None:
            m.accounting.limit = m.settings.limit_for(None)  # another process may have taken memory

    # -- allocating ---------------------------------------------------------------------------

    def allocate(self, nbytes: int, protect: Optional[Collection[int]], what: str) -> torch.Tensor:
        """A device buffer of ``nbytes``; on out-of-memory, recover (unless ``protect`` is ``None``) and retry once."""
        m = self.m
        for attempt in (0, 1):
            try:
                self.inject(what, nbytes)
                backend = m.backend
                if backend.simulated:
                    self.check_capacity(backend.block_bytes(nbytes))
                return backend.allocate(nbytes)
            except Exception as e:
                if not is_out_of_memory(e) or protect is None:
                    raise
                if attempt:
                    raise DeviceOutOfMemoryError(what, nbytes, self.free_estimate()) from e
                self.recover(protect)
        raise AssertionError("unreachable")

    def check_capacity(self, nbytes: int) -> None:
        """The simulated device's allocator: refuse what does not fit in its capacity, once
        the copies still using freed buffers are waited for (as CUDA's allocator waits for
        their events before it reports an out-of-memory: Note [Stream-ordered frees])."""
        capacity = self.m.backend.capacity()
        if capacity is None:
            return
        acct = self.m.accounting
        if acct.on_device() + nbytes > capacity and acct.waitable():
            self.retire(wait=True)
        in_use = acct.on_device()
        if in_use + nbytes > capacity:
            raise torch.OutOfMemoryError(
                f"sim: out of memory: tried to allocate {format_size(nbytes)}; the device has "
                f"{format_size(capacity)} of which {format_size(in_use)} is in use")

    def free_estimate(self) -> int:
        capacity = self.m.backend.capacity()
        return 0 if capacity is None else max(capacity - self.used_bytes(), 0)

    def inject(self, kind: str, nbytes: int, op: Any = None) -> None:
        """Call the fault injector, if one is set, before an allocation or an op."""
        injector = self.m.fault_injector
        if injector is not None:
            injector(Fault(kind, nbytes, op))
