"""Flow's prefetching part: the blocks the next ops will read, brought in ahead of them.

Before each op runs, Flow looks ``lookahead`` ops ahead (by its prediction while learning,
by the plan's list while following it) and prefetches their blocks into free memory, so
copies overlap compute on a GPU; while following a plan it may also evict for the next op's
blocks, where that costs few bytes (Note [Evicting for the next op]). While following the
plan it also starts reading from disk the long-lived blocks the op ``disk_lookahead`` ops
ahead uses (Note [Three levels]), making host room from free host copies needed later.

Note [Evicting for the next op]: under a budget the device is full of blocks kept for later,
so a prefetch into free memory seldom finds room, and the next op's blocks are fetched when
it needs them, on the compute stream, after the kernels queued before it: the copies do not
overlap compute. Evicting a block needed later than the prefetched one makes the room (a
dirty one too: in training every weight is written each step), and one op ahead (a decoder
layer's region while the one before it runs) is enough to overlap. It costs bytes where the
blocks kept across steps must make room for the next op's working set: decoding the small
models of ``benchmarks/small_ops.py`` at 25% of the weights nothing, per op or by regions,
and by regions at 50% 1.4x the bytes, a whole layer of four no longer kept; their training
steps 1.04x-1.16x. So with ``prefetch_evicts=None`` (the default), each plan is tried both
ways (``Trial``): after a period to settle, ``MEASURED`` periods prefetching into free memory
only, then, after another, ``MEASURED`` evicting for the next op. On CUDA, where a copy on
the side stream overlaps the kernels, the evicting way is kept where its periods took less
time: the overlap may be worth more bytes. On "sim", whose copies overlap nothing and whose
clock says nothing of a GPU's, it is kept where it moved at most ``EVICTING_BYTES`` times the
bytes per period. The choice is remembered for the plan's ops and budget: a later plan of
the same loop (each ``generate()`` call compiles its own) needs no new trial, and goes on
with one left unfinished. Between plans, while Flow learns by a period it knows (a
``generate()`` call's prompt and first tokens), prefetches evict for the next op as the last
plan's trial chose.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

from .flow_learn import Learning
from .flow_options import FlowOptions
from .flow_order import UNKNOWN, Order

#: the most bytes per period prefetching one op ahead may move, evicting for it, as a ratio
#: to prefetching into free memory only (Note [Evicting for the next op])
EVICTING_BYTES = 1.10
#: the periods measured each way (the bytes of one period may differ from the next: a
#: decoding loop's key/value cache grows)
MEASURED = 4
#: the most choices, and trials under way, remembered (plans of distinct loops and budgets)
REMEMBERED = 64
_NEVER = 1 << 62


class Trial:
    """Whether prefetches evict for the next op while Flow follows the current plan (Note
    [Evicting for the next op]).

    Each plan's periods are measured after one to settle: ``MEASURED`` of them prefetching
    into free memory only, then, after one more to settle, ``MEASURED`` evicting for the next
    op. A plan of the same loop compiled later (each ``generate()`` call compiles its own)
    goes on where the last one left off, so loops shorter than a trial are tried too.
    """

    __slots__ = ("evicts", "last", "due", "start", "started", "skip", "key", "timed", "tally", "chosen")

    def __init__(self) -> None:
        self.evicts = False  # prefetches evict for the next op now
        self.last = False  # the choice of the last plan that had one (for learning after it)
        self.due = _NEVER  # the op at which the next period begins
        self.start = 0  # bytes moved when the period now measured began
        self.started = 0.0  # and the time then, in seconds
        self.timed = False  # decided by time (a GPU), else by bytes
        self.skip = 0  # boundaries until a period is measured (the first ones settle)
        self.key: Optional[tuple] = None  # the plan's ops and budget
        #: key -> [bytes, periods, seconds] measured into free memory, then the same measured
        #: evicting, while undecided
        self.tally: Dict[tuple, list] = {}
        self.chosen: Dict[tuple, bool] = {}  # key -> evicts

    def begin(self, plan, limit: int, timed: bool = False) -> None:
        """A plan was compiled: use the choice made for its loop, or go on trying both ways
        (``timed``: deciding by the time its periods take, else by their bytes)."""
        self.key = key = (limit, plan.key)
        self.timed = timed
        known = self.chosen.get(key)
        if known is not None:
            self.evicts = self.last = known
            self.due = _NEVER
            return
        if key not in self.tally and len(self.tally) >= REMEMBERED:
            self.tally.clear()
        tally = self.tally.setdefault(key, [0, 0, 0.0, 0, 0, 0.0])
        self.evicts = tally[1] >= MEASURED
        self.skip = 2  # (the first boundary begins a period to settle, the second ends it)
        self.due = plan.base + plan.period

    def end(self) -> None:
        """The program left the plan (what was measured stays for its loop's next plan)."""
        self.evicts = False
        self.due = _NEVER

    @property
    def deciding(self) -> bool:
        """Whether the current plan's periods are still measured, the choice not made."""
        return self.due != _NEVER

    def period_began(self, n: int, period: int, moved: int, now: float = 0.0) -> None:
        """Op ``n`` begins a period of the plan; ``moved``: bytes moved so far; ``now``: the
        time, in seconds."""
        self.due = n + period
        if self.skip:
            self.skip -= 1
            self.start, self.started = moved, now
            return
        tally = self.tally[self.key]
        at = 3 if self.evicts else 0
        tally[at] += moved - self.start
        tally[at + 1] += 1
        tally[at + 2] += now - self.started
        self.start, self.started = moved, now
        if tally[at + 1] < MEASURED:
            return
        if self.evicts:
            free, evicting = tally[0:3], tally[3:6]
            if self.timed:  # (seconds per period)
                self._choose(evicting[2] * free[1] < free[2] * evicting[1])
            else:  # (bytes per period)
                self._choose(evicting[0] * free[1] <= EVICTING_BYTES * free[0] * evicting[1])
        elif not tally[0]:
            self._choose(False)  # (nothing moved: nothing to bring in ahead)
        else:
            self.evicts = True
            self.skip = 1  # (a period to settle)

    def _choose(self, evicts: bool) -> None:
        self.evicts = self.last = evicts
        self.due = _NEVER
        self.tally.pop(self.key, None)
        if len(self.chosen) >= REMEMBERED:
            self.chosen.clear()
        self.chosen[self.key] = evicts


class Prefetch:
    """Flow's prefetches to the device and read-aheads from disk.

    It reads the settings (``lookahead``, ``disk_lookahead``, ``prefetch_evicts``), asks the
    learning part what comes next and the order part what may make room, and moves blocks
    through the manager (``prefetch``, ``evict``, ``read_ahead``, ``drop_host_copy``). Its
    own state is the trial of evicting for the next op (``trial``).
    """

    options: FlowOptions
    learning: Learning
    order: Order
    manager: Any  # the TensorsManager (its strategy interface), or None before attach
    trial: Trial

    def __init__(self, options: FlowOptions, learning: Learning, order: Order, manager, trial: Trial):
        self.options = options
        self.learning = learning
        self.order = order
        self.manager = manager
        self.trial = trial

    # -- evicting for the next op (Note [Evicting for the next op]) ------------------------

    def plan_compiled(self) -> None:
        plan, options, limit = self.learning.plan, self.options, self.manager.limit
        if plan is not None and options.prefetch_evicts is None and options.lookahead and limit is not None:
            self.trial.begin(plan, limit, timed=self.manager.device_kind == "cuda")

    def plan_left(self) -> None:
        self.trial.end()

    def period_began(self, n: int) -> None:
        """Op ``n``, following the plan, is at or past the start of the period the trial awaits."""
        stats = self.manager.stats()
        plan = self.learning.plan
        self.trial.period_began(n - plan.offset(n), plan.period, stats["bytes_to_device"] + stats["bytes_to_host"],
                                time.perf_counter())

    # -- to the device ---------------------------------------------------------------------

    def predicted(self, n: int, blocks, reserved: int) -> None:
        """While learning: prefetch, at op ``n`` (reading ``blocks``, which no prefetch evicts),
        what the next ops read by prediction, leaving ``reserved`` bytes for the op's results."""
        mgr = self.manager
        limit = mgr.limit - reserved  # the op's results still need their room
        lookup = mgr.block
        evicts = self.options.prefetch_evicts
        next_only = evicts is None and self.trial.last  # (as the last plan chose)
        for m, bid in self.learning.upcoming(n):
            if next_only and m > n + 1:
                return
            block = lookup(bid)
            if block is None or block.dev is not None:
                continue
            if not self._prefetch_one(block, n, m, limit, blocks, bool(evicts) or next_only):
                return
            self.order.push(block, n)

    def planned(self, n: int, blocks, reserved: int) -> None:
        """While following the plan: prefetch, at op ``n`` (reading ``blocks``), what the
        plan's next ops read, leaving ``reserved`` bytes for the op's results."""
        mgr, plan = self.manager, self.learning.plan
        limit = mgr.limit - reserved  # the op's results still need their room
        lookup, born_at = mgr.block, self.learning.born_at
        evicts = self.options.prefetch_evicts
        next_only = evicts is None and self.trial.evicts  # (evicting for the next op only)
        for j, role in plan.ahead[plan.offset(n)]:
            if next_only and j > 1:
                return  # (a block brought in for a later op would be the next op's victim)
            if role.__class__ is int:
                block = lookup(role)
            else:
                bid = born_at(n + j - role[0], role[1])
                block = lookup(bid) if bid is not None else None
            if block is None or block.dev is not None:
                continue
            # (the plan's ranking may predate this op's fetches: its blocks are protected)
            if not self._prefetch_one(block, n, n + j, limit, blocks, bool(evicts) or next_only):
                return

    def _prefetch_one(self, block, n: int, m: int, limit: int, protect_blocks, evicts: bool = False) -> bool:
        """Prefetch ``block``, needed at op ``m``, at op ``n`` within ``limit`` (evicting for it
        where ``evicts``); ``False`` if it does not fit (nothing further is tried then)."""
        mgr = self.manager
        # Make room from blocks predicted to be needed after op m, dirty ones too: training
        # writes every weight each step, and its write-back runs on the copy stream while
        # the budget counts the room free at once (Note [Stream-ordered frees]). What it
        # costs in bytes is the trial's to weigh. Room is made for the block's group where
        # it comes in with it (one copy for a region's tensors), else for the block alone.
        alone = mgr.alloc_bytes(block.nbytes)  # (as the allocator may give it)
        need = mgr.prefetch_bytes(block)
        protect = None
        while mgr.in_use() + need > limit:
            victim = None
            if evicts:
                if protect is None:
                    protect = {b.id for b in protect_blocks}
                victim = self.order.victim(protect, n, worse_than=m)
            if victim is None:
                if need == alone or mgr.in_use() + alone > limit:
                    return False
                need = alone  # (the block alone fits)
                break
            if not mgr.evict(victim, protect):
                protect.add(victim.id)  # (its group's buffer stays for the op: it frees nothing)
        mgr.prefetch(block, group=need != alone)
        block.last_use = n  # (recency must not evict it before the op it was brought in for)
        return True

    # -- from disk -------------------------------------------------------------------------

    def read_ahead(self, n: int) -> None:
        """Start reading from disk what the plan's op ``disk_lookahead`` ops after ``n`` uses."""
        mgr = self.manager
        m = n + self.options.disk_lookahead
        plan = self.learning.plan
        for role in plan.roles[plan.offset(m)]:
            if role.__class__ is not int:
                continue  # (made by an op: never only on disk that soon)
            block = mgr.block(role)
            if block is None or block.host is not None or block.disk is None or block.dev is not None:
                continue
            if not self._free_host_room(block.nbytes, n, m):
                return  # host memory holds only what is needed sooner: read it later
            mgr.read_ahead(block)

    def host_room_for(self, block, index: int) -> bool:
        """Room, from free host copies needed after ``block``, to keep ``block`` in host memory."""
        needed = self.order.priority(block, index)
        if needed >= UNKNOWN:
            return False  # not known to be needed again: the disk holds it
        return self._free_host_room(block.nbytes, index, needed)

    def _free_host_room(self, nbytes: int, n: int, m: int) -> bool:
        """Drop free host copies needed after op ``m``, furthest first, until ``nbytes`` fit
        under the host budget; whether they do."""
        mgr = self.manager
        room = mgr.host_room()
        while room is not None and room < nbytes:
            victim = self._free_host_victim(n, m)
            if victim is None or not mgr.drop_host_copy(victim):
                return False
            room = mgr.host_room()
        return True

    def _free_host_victim(self, n: int, m: int):
        """The host copy, free to drop, needed furthest ahead and after op ``m``; or ``None``."""
        best, best_priority = None, m
        priority = self.order.priority
        for block in self.manager.host_copies():
            if block.host_valid and block.disk is None:
                continue  # (would have to be written first)
            p = priority(block, n)
            if p > best_priority:
                best, best_priority = block, p
        return best
