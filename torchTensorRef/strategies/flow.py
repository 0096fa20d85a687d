"""Flow: keep what will be used again soon, evict what will not, prefetch what comes next.

Flow learns the program's access order as it runs. Training loops and ``generate()``
repeat the same sequence of ops, so once the sequence is seen to repeat with a period of
``T`` ops, the future is the past shifted by ``T``:

- a block that outlives a period (a weight, an optimizer state) is used again at its uses
  of the last period plus ``T``;
- a block created during this period (an activation, a gradient) is used like its
  *counterpart*, the block created by the same op one period earlier, plus ``T``.

Eviction picks the block whose predicted next use is farthest away (Belady's rule), blocks
predicted dead first. Before the period is known (the first pass) or when the sequence
stops repeating (data-dependent control flow), predictions fall back to recency (LRU),
which is always correct, only slower.

Before each op runs Flow looks a few ops ahead and prefetches their blocks into free
memory, so copies overlap compute on a GPU; while it follows a plan, it also evicts for the
next op's blocks where a trial found that costs few bytes (Note [Evicting for the next op]
in ``flow_prefetch.py``).

Once the sequence has repeated for a whole period, Flow compiles that period into a plan
(``flow_plan.py``) and follows it: each op is only checked against the plan, and blocks are
ranked when room has to be made, not after every op. Decisions stay the same; the per-op
cost of learning is gone until the program stops following the plan.

``Flow`` owns three parts and implements the strategy hooks by calling their public
methods: the learning part (``flow_learn.Learning``: the record, the period, the
predictions, the plan), the eviction order (``flow_order.Order``: the ranking of resident
blocks) and prefetching (``flow_prefetch.Prefetch``: to the device, and from disk). Their
settings are one ``flow_options.FlowOptions``.
"""

from __future__ import annotations

from typing import Optional

from .base import Strategy
from .flow_learn import Learning
from .flow_options import FlowOptions
from .flow_order import Order
from .flow_plan import Plan
from .flow_prefetch import Prefetch, Trial


class _Option:
    """A setting of ``Flow`` kept in its ``options``, where its parts read it."""

    def __set_name__(self, owner, name: str) -> None:
        self.field = name

    def __get__(self, flow, owner=None):
        return self if flow is None else getattr(flow.options, self.field)

    def __set__(self, flow, value) -> None:
        setattr(flow.options, self.field, value)


class Flow(Strategy):
    """Budgeted, reuse-aware, prefetching paging policy (the default).

    Args:
        lookahead: how many upcoming ops to prefetch for.
        min_period: shortest op sequence accepted as a repeating period.
        max_history: ops of history kept to find the period (longer loops fall back to LRU).
        prefetch_evicts: let a prefetch evict clean blocks needed later than the prefetched
            one: ``True`` for every prefetch, ``False`` for none (only free memory is
            filled: this never adds traffic), ``None`` (the default) for the next op's blocks
            where a trial of each plan both ways found it faster on CUDA, or costing at most
            10% more bytes on the simulated device (Note [Evicting for the next op] in
            ``flow_prefetch.py``).
        plan: compile the period into a plan once it repeated whole, and follow it (the same
            decisions at a fraction of the per-op cost); ``False`` keeps learning every op.
        disk_lookahead: while following the plan, start reading from disk the long-lived
            blocks (weights) the op this many ops ahead uses, if their only copy is on disk,
            making host room from free host copies needed later (Note [Three levels]).

    The arguments stay settable as attributes (``flow.lookahead = 2``; ``plan`` is
    ``compiles_plan``). ``period`` (``None`` until the loop is found) and ``plan`` (the
    compiled :class:`~torchTensorRef.strategies.flow_plan.Plan` while Flow follows one,
    else ``None``) say what Flow has learnt.
    """

    name = "flow"

    options: FlowOptions
    learning: Learning
    order: Order
    prefetching: Prefetch
    _now: int  # the op in flight, as the last before_op or fast_op saw it

    lookahead = _Option()
    min_period = _Option()
    max_history = _Option()
    prefetch_evicts = _Option()
    compiles_plan = _Option()
    disk_lookahead = _Option()

    def __init__(self, lookahead: int = 6, min_period: int = 1, max_history: int = 50_000,
                 prefetch_evicts: Optional[bool] = None, plan: bool = True, disk_lookahead: int = 64):
        super().__init__()
        evicts = None if prefetch_evicts is None else bool(prefetch_evicts)
        self.options = FlowOptions(lookahead, min_period, max_history, evicts, plan, disk_lookahead)
        self._reset()

    def _reset(self) -> None:
        """Start from nothing learnt, with the manager now attached (or none)."""
        self.learning = Learning(self.options)
        self.order = Order(self.learning, self.manager)
        self.prefetching = Prefetch(self.options, self.learning, self.order, self.manager, Trial())
        self._now = -1

    @property
    def period(self) -> Optional[int]:
        """The loop's period in ops while the sequence repeats, else ``None``."""
        return self.learning.period

    @property
    def plan(self) -> Optional[Plan]:
        """The period compiled, while Flow follows it; ``None`` while it learns."""
        return self.learning.plan

    @property
    def settled(self) -> bool:
        """Whether a loop the program repeats now runs as it will from here on: nothing to
        page, or Flow following its plan with its way of prefetching for it chosen (Note
        [Evicting for the next op] in ``flow_prefetch.py``). Until then its steps learn the
        loop or measure two ways of prefetching: a benchmark of the steady state waits."""
        if not self.needs_every_op():
            return True  # (nothing paged: nothing to learn)
        return self.learning.plan is not None and not self.prefetching.trial.deciding

    @property
    def evicts_ahead(self) -> bool:
        """Whether its prefetches evict for the blocks they bring in now: its option where
        set, else what the trial of its plan chose (or is trying)."""
        evicts = self.options.prefetch_evicts
        return self.prefetching.trial.evicts if evicts is None else evicts

    def attach(self, manager) -> None:
        super().attach(manager)
        self._reset()

    # -- learning the sequence -------------------------------------------------------------

    def _learns(self) -> bool:
        """Whether it records the program's ops: under a budget, or once the device's capacity
        (the limit with no budget) has made room by evicting. Until then nothing can page, and
        ranking every block of every op cost a training step with nothing to move more than
        its optimizer's bookkeeping; from the first eviction on it learns as under a budget."""
        mgr = self.manager
        return mgr.limit is not None and (mgr.budget is not None or mgr.under_pressure)

    def on_adopt(self, block) -> None:
        if not self._learns():
            return  # (see before_op: nothing is learnt, and nothing would prune the record)
        if block.id not in self.learning.births:  # (else seen at its first op: see before_op)
            self.learning.born_before(block, self.manager.op_index)

    def needs_every_op(self) -> bool:
        # Until something had to be evicted everything fits: nothing to learn or prefetch
        # (and the device's bytes never reach the budget, which the fast path checks).
        return self.manager is not None and self.manager.limit is not None and self.manager.under_pressure

    def before_op(self, op) -> None:
        mgr = self.manager
        if not self._learns():
            return  # nothing is evicted or prefetched yet: nothing to learn
        n = op.index
        self._now = n
        func = op.spec  # one per aten op; hashing it is cheaper than the op's own __hash__
        learning = self.learning
        if learning.plan is not None:
            if learning.follows(n, func, op.blocks):
                if n >= self.prefetching.trial.due:
                    self.prefetching.period_began(n)
                return
            learning.leave_plan(n, mgr.block)
            self.prefetching.plan_left()
            mgr.hooks_changed()  # every op goes through the hooks again
            self.order.rebuild(n)
        if learning.record(n, func, op.blocks):
            self.order.rebuild(n)  # the predictions changed with the period
        learning.prune_if_due(n)

    # -- decisions -------------------------------------------------------------------------

    def after_op(self, op) -> None:
        if not self._learns():
            return  # see before_op
        n = op.index
        learning = self.learning
        if learning.plan is not None:
            self.after_fast_op(n, op.outputs)
            return
        learning.record_outputs(n, op.outputs)
        if learning.compile_due(n):
            self._compile(n)
            if learning.plan is not None:
                return
        push = self.order.push
        for b in op.blocks:
            if b.dev is not None:
                push(b, n)
        for b in op.outputs:
            if b.dev is not None:
                push(b, n)

    def _compile(self, n: int) -> None:
        """The last ``period`` ops all repeated the period before them: follow them as a plan."""
        self.learning.compile(n)
        self.order.forget_ranking()
        self.prefetching.plan_compiled()
        self.manager.hooks_changed()  # ops that move nothing may take the fast path again

    def before_run(self, op) -> None:
        # Prefetch now: the op's blocks are in, the room for its results is known, and the
        # memory of tensors that died since the last op is free; on a GPU the copies then
        # overlap this op's compute.
        mgr, learning, options = self.manager, self.learning, self.options
        if learning.period is not None and options.lookahead and mgr.limit is not None:
            if mgr.all_resident():
                return  # every block is in already: nothing to look for
            if learning.plan is not None:
                self.prefetching.planned(op.index, op.blocks, op.output_estimate())
            else:
                self.prefetching.predicted(op.index, op.blocks, op.output_estimate())
        if learning.plan is not None and options.disk_lookahead and mgr.disk_blocks:
            self.prefetching.read_ahead(op.index)

    # -- following the plan ----------------------------------------------------------------

    def follows_fast_ops(self) -> bool:
        return self.learning.plan is not None

    def fast_op(self, n: int, func, blocks, reserved: int) -> bool:
        self._now = n
        learning = self.learning
        if learning.plan is None or not learning.follows(n, func, blocks):
            return False  # the generic path runs it: before_op finds the divergence
        mgr, options = self.manager, self.options
        if n >= self.prefetching.trial.due:
            self.prefetching.period_began(n)
        if options.lookahead and not mgr.all_resident():
            self.prefetching.planned(n, blocks, reserved)
        if options.disk_lookahead and mgr.disk_blocks:
            self.prefetching.read_ahead(n)
        return True

    def after_fast_op(self, n: int, outputs) -> None:
        self.learning.follow_outputs(n, outputs)

    # -- choosing victims ------------------------------------------------------------------

    def choose_host_victim(self, candidates, index: int):
        """The host copy needed furthest ahead; first one that is free to drop and whose
        block is on the device (its host copy is a second one)."""
        priority = self.order.priority
        best = None
        best_key = None
        for block in candidates:
            free = block.disk is not None or not block.host_valid
            key = (free and block.dev is not None, priority(block, index), free)
            if best is None or key > best_key:
                best, best_key = block, key
        return best

    def host_room_for(self, block, index: int) -> bool:
        """Room, from free host copies needed after ``block``, to keep ``block`` in host memory."""
        return self.prefetching.host_room_for(block, index)

    def choose_victim(self, protect):
        victim = self.order.victim(protect, self._now)
        if victim is None:
            return super().choose_victim(protect)  # blocks Flow never ranked (toGPU, pins)
        return victim

    def on_release(self, block) -> None:
        self.order.forget(block.id)
        self.learning.release(block.id)
