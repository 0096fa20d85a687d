"""One step of a region as one op of the manager (Note [Region steps]).

Note [Region steps]: a region's call and its backward are each one op of the manager, in
the same sequence: ``begin`` makes its blocks resident together within the budget (the op
protocol's ``prepare``: the strategy sees one op) and pins them while the step computes on
their plain views; ``end`` unpins them, records the working set and the room kept for what
the step allocated inside as one peak, and lets the strategy react (``finish``); ``abort``
does the op's bookkeeping after an error instead (``op_raised``).

Note [Room kept while a region runs]: a region's kernels run outside the manager's lock,
in the room its step made for what they allocate inside; until its results join the
books, that room is kept for it against other threads' ops (``Accounting.keep``: counted
with the bytes outside the manager), or one of them would take it and the device would
hold more than the budget. It is given back under the lock before the results are
counted, so that they are not counted twice, and where the step's own thread runs an op
of the manager inside it (a checkpointed forward recomputed in a backward, a tensor its
module reads that is not a region's): that op's room is the step's.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import block_of
from ..memory.devices import largest_within
from ..memory.manager import tensorsManager as _mgr
from ..ops.op_context import blocks_of_list
from .inside import Measure, measured
from .op import RegionContext, Wrapper


class Plan:
    """What a region call is, as one op: decided before its blocks are brought in."""

    __slots__ = ("ctx", "key", "grad", "on_host", "paged", "limited", "measure", "meter", "near", "held_refs")

    def __init__(self, ctx: RegionContext, key, grad: bool, on_host: bool, paged: bool, limited: bool):
        self.ctx, self.key, self.grad, self.on_host = ctx, key, grad, on_host
        self.paged = paged  # the manager pages under a limit (a device, a budget or its capacity)
        self.limited = limited  # and the call's peak counts against it (not a call on the host)
        self.measure = False  # it runs op by op first, to measure what it allocates inside
        self.meter = False  # it is larger than measured: a dispatch mode measures it as it runs
        self.near = None
        self.held_refs = 0


class Step:
    """A region's call or backward as one op (Note [Region steps]).

    Args:
        ctx: the op: its blocks and the room it keeps for what it allocates inside.
        limited: its peak counts against a budget (a limit, on a device that pages).
        keep: that room is kept against other threads' ops while it runs (Note [Room kept
            while a region runs]): not where it is all the room left.
    """

    def __init__(self, ctx: RegionContext, limited: bool, keep: bool = True):
        self.ctx = ctx
        self.limited = limited
        self.keep = keep and limited
        self.base = 0  # bytes in use once its blocks are resident (less those evicted for it since)
        self.top = 0  # the most in use at once before its room last grew (``grow``)

    def begin(self, on_host: bool = False) -> None:
        """Its blocks resident and pinned (their host copies current where it runs on the host).

        Raises:
            OutOfBudgetError: they do not fit the budget together; nothing changed.
        """
        mgr = _mgr
        with mgr.lock:
            mgr.prepare(self.ctx)
            blocks = self.ctx.blocks
            for b in blocks:
                b.pins += 1
            if on_host:
                for b in blocks:
                    mgr.sync_host(b)  # the call reads the host copies
            self.base = mgr.in_use()
            if self.keep and self.ctx.estimate:
                mgr.accounting.keep(self.ctx.estimate)

    def grow(self, extra: int, held: int, room: int) -> bool:
        """``extra`` bytes more of room for the running step, which holds ``held`` of the
        ``room`` kept for it (a call larger than measured outgrew its estimate: Note [Calls
        larger than measured] in ``inside.py``): blocks outside it evicted; whether it was
        made (where not, the call goes on, and its excess shows as ``worst_overshoot_bytes``)."""
        mgr = _mgr
        with mgr.lock:
            acct = mgr.accounting
            self.top = max(self.top, self.base + room)
            resident = acct.resident
            try:
                mgr.make_room(extra, {b.id for b in self.ctx.blocks}, self.ctx.name, inside=held)
            except OutOfBudgetError:
                return False
            finally:
                self.base -= resident - acct.resident
            if self.keep:
                acct.keep(extra)
            return True

    def _unpin(self) -> None:
        for b in self.ctx.blocks:
            b.pins -= 1

    def end(self, inside: Optional[int]) -> None:
        """The step ran and allocated ``inside`` bytes (or had that room kept; ``None``: its
        results were counted as they joined the books): its blocks unpinned, its peak recorded."""
        mgr = _mgr
        ctx = self.ctx
        with mgr.lock:
            mgr.accounting.give_back()
            self._unpin()
            if inside is not None and self.limited:
                # (the working set and the room kept for the inside)
                mgr.record_top(max(self.top, self.base + inside))
            mgr.finish(ctx)
            if mgr.trace is not None:
                ctx.record_inside(mgr.trace, inside or 0)

    def abort(self) -> None:
        """The step raised: its blocks unpinned, what it wrote counted as written."""
        mgr = _mgr
        with mgr.lock:
            mgr.accounting.give_back()
            self._unpin()
            mgr.op_raised(self.ctx)


#: the most bytes a region's backward has held resident (``BackwardStep.held``): a budget
#: below it may refuse a pending one (Note [Refused before a backward runs] in
#: ``integrations/backward.py``)
largest_held = [0]


class BackwardStep:
    """A region call's backward as one step (a context manager): ``refs`` (the blocks its
    saved tensors are on, the incoming gradients) resident and pinned while it runs, with
    room for what it allocates: measured on its first run with the call's shapes (``key``),
    which under a budget runs op by op where what it saved are blocks (Note [A first backward
    runs op by op]), and else keeps all the room the budget leaves (with no budget, twice the
    blocks' bytes and the forward's room, ``inside``): what a backward's formulas allocate is
    not bounded by what the forward did."""

    def __init__(self, region, refs, key, inside: int, saved_blocks: bool = False):
        self.region, self.refs, self.key, self.inside = region, refs, key, inside
        self.measuring = None
        self.held = 0
        self.seen = None  # (bytes of its blocks, peak inside) of a backward with shapes at least these
        #: what it saved are blocks: unmeasured under a budget, its inner graph runs on
        #: TensorRefs, op by op (Note [A first backward runs op by op])
        self.saved_blocks = saved_blocks
        self.by_op = False
        self.paged = False

    def __enter__(self):
        mgr = _mgr
        with mgr.lock:
            mgr.drain()
            blocks = blocks_of_list([block_of(r) for r in self.refs])
            self.ctx = ctx = RegionContext(self.region.backward_spec, blocks, [], (), {}, False)
            backend = mgr.backend
            self.device = None if backend.passthrough else backend.declared
            limited = mgr.limit is not None and not backend.passthrough
            if (limited and self.saved_blocks and mgr.settings.budget_value is not None
                    and measured(self.region.backward_peaks, self.key) is None):
                return self._by_op(blocks)
            if self.saved_blocks and not mgr.host_tier.holds(sum([b.nbytes for b in blocks])):
                return self._by_op(blocks)  # (its blocks come through host copies, as a call's: mechanism.py)
            ctx.estimate = self._room(blocks) if limited else 0
            # (unmeasured, its room is all the budget leaves: not kept from other threads)
            self.step = Step(ctx, limited, keep=self.seen is not None)
            paged = mgr.paged
            try:
                self.step.begin()  # (no op-by-op fallback here: the graph is plain)
            except OutOfBudgetError:
                if not limited or self.seen is not None or mgr.settings.budget_value is None:
                    raise
                # All the room the budget leaves was read before the evictions that make it:
                # a block still viewed outside the manager stays counted once evicted (Note
                # [Buffers still viewed] in memory/residency.py). Read again, now that they ran.
                ctx.estimate = self._room(blocks)
                self.step.begin()
            if self.seen is None:
                # What it evicted made room for a measurement, not room the budget lacks: the
                # budget pages only where later calls, measured, must evict too (Note
                # [Regions until the budget pages] in regions/__init__.py)
                mgr.paged = paged
            if limited and self.seen is None:
                # (the blocks' storages once resident: views of them are not new bytes)
                self.measuring = Measure({b.dev_key for b in blocks}, mgr.alloc_bytes, backend.dev_bytes)
        return self

    def _by_op(self, blocks):
        """Note [A first backward runs op by op]: unmeasured, what a backward's formulas
        allocate inside is not known, and autograd would run them on plain tensors the manager
        cannot evict: kept all the room the budget leaves, they could still take more (a
        generic ``silu`` backward keeps six temporaries alive at once). So under a budget its
        inner graph runs once on TensorRefs: its saved tensors unpacked as views of their
        blocks, each op paged within the budget, its peak measured for the calls after it.
        It is one op with no blocks of its own; its evictions are not the budget paging."""
        mgr = _mgr
        self._hold(blocks)
        self.by_op, self.paged = True, mgr.paged
        self.ctx = RegionContext(self.region.backward_spec, [], [], (), {}, False)
        self.ctx.estimate = 0
        self.step = Step(self.ctx, False)
        self.step.begin()
        self.measuring = Measure({b.id for b in blocks}, mgr.alloc_bytes)
        return self

    def _hold(self, blocks) -> None:
        """``held``: the bytes of its blocks, as the budget counts them."""
        size = _mgr.backend.block_bytes
        self.held = sum(size(b.nbytes) for b in blocks if not b.host_only)
        if self.held > largest_held[0]:
            largest_held[0] = self.held  # (Note [Refused before a backward runs])

    def _room(self, blocks) -> int:
        """The room kept for what the backward allocates inside."""
        mgr = _mgr
        size = mgr.backend.block_bytes
        self._hold(blocks)
        seen = self.seen = measured(self.region.backward_peaks, self.key)
        # (asked of the device: a reading from before the forward's end may count tensors
        # freed since, and the room would then be more than the op's check allows; counted
        # as the device counts it, so that the check does not round it past the budget)
        # (less the allocator's slack on the blocks it brings in: Note [Room for the
        # allocator's slack])
        room = largest_within(mgr.accounting.within(mgr.limit - mgr.read_outside() - self.held), size)
        # Until measured, under a budget all the room it leaves (what a backward's formulas
        # allocate is not bounded by the forward: recomputing a checkpointed forward inside
        # it takes several times the forward's); with none, twice the blocks and the
        # forward's room (evicting all else for a device's whole capacity would move every
        # block). Measured, that peak: the forward runs op by op where it saw the backward
        # would not fit.
        if seen is not None:
            return min(room, seen[1])
        if mgr.settings.budget_value is not None:
            return room
        return min(room, 2 * (self.held + self.inside))

    def meter(self):
        return self.measuring if self.measuring is not None else contextlib.nullcontext()

    def results(self, grads) -> tuple:
        """The gradients the inner graph gave for the leaves, as TensorRefs."""
        mgr = _mgr
        with mgr.lock:
            # (no room to make: they were allocated in the room kept for the inside, which
            # ``finish`` gives back if they took more)
            mgr.accounting.give_back()
            wrap = Wrapper(mgr, self.ctx, {}, True)
            return tuple(None if g is None else wrap(g) for g in grads)

    def __exit__(self, *exc):
        if self.by_op:
            _mgr.paged = self.paged  # (what its ops evicted measured it)
        if exc[0] is not None:
            self.step.abort()
            return False
        inside = self.ctx.estimate
        if self.measuring is not None and (self.by_op or self.step.limited):
            self.region.backward_peaks[self.key] = (self.held, self.measuring.peak)
            # (what it took, kept room or not; op by op, each op counted its own)
            inside = None if self.by_op else self.measuring.counted_peak
        self.step.end(inside)
        return False
