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

After each op Flow looks a few ops ahead and prefetches their blocks into free memory, so
copies overlap compute on a GPU.

Once the sequence has repeated for a whole period, Flow compiles that period into a plan
(``flow_plan.py``) and follows it: each op is only checked against the plan, and blocks are
ranked when room has to be made, not after every op. Decisions stay the same; the per-op
cost of learning is gone until the program stops following the plan.

Two ops one period apart match when they are the same aten op on blocks with the same
*roles*: the same long-lived block, or blocks created the same number of ops earlier by
the same output slot. Shapes are left out so that ``generate()``, whose activations grow
every step, still repeats. Candidate periods come from the distances between earlier ops
with the same op and long-lived (not op-created) inputs.

This module holds the ``Flow`` class and its hooks; its parts live beside it: learning the
period and predicting next uses in ``flow_learn.py``, the eviction order in
``flow_order.py``, prefetching and disk read-ahead in ``flow_prefetch.py``, the compiled
period in ``flow_plan.py``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .base import Strategy
from .flow_learn import FlowLearning
from .flow_order import FlowOrder
from .flow_plan import Plan
from .flow_prefetch import FlowPrefetch


class Flow(FlowLearning, FlowOrder, FlowPrefetch, Strategy):
    """Budgeted, reuse-aware, prefetching paging policy (the default).

    Args:
        lookahead: how many upcoming ops to prefetch for.
        min_period: shortest op sequence accepted as a repeating period.
        max_history: ops of history kept to find the period (longer loops fall back to LRU).
        prefetch_evicts: let a prefetch evict clean blocks needed later than the prefetched
            one (default: off, on every device). Prefetching into free memory only never
            adds traffic; evicting for a prefetch can force out a block that would have
            stayed had the op waited, and that costs bytes. The timeline predicts nothing
            gained for them on an H100 PCIe, from the schedule of copies and kernels alone
            (Llama decode at 50% of the weights: 14% more bytes and a 9% longer step; at
            25% and in training, within 4%), so the simulated device and CUDA make the
            same decisions.
        plan: compile the period into a plan once it repeated whole, and follow it (the same
            decisions at a fraction of the per-op cost); ``False`` keeps learning every op.
        disk_lookahead: while following the plan, start reading from disk the long-lived
            blocks (weights) the op this many ops ahead uses, if their only copy is on disk,
            making host room from free host copies needed later (Note [Three levels]).
    """

    name = "flow"

    def __init__(self, lookahead: int = 6, min_period: int = 1, max_history: int = 50_000,
                 prefetch_evicts: bool = False, plan: bool = True, disk_lookahead: int = 64):
        super().__init__()
        if lookahead < 0 or min_period < 1 or max_history < 2 * min_period or disk_lookahead < 0:
            raise ValueError(
                "Flow needs lookahead >= 0, min_period >= 1, max_history >= 2 * min_period and "
                f"disk_lookahead >= 0 (got: lookahead={lookahead}, min_period={min_period}, "
                f"max_history={max_history}, disk_lookahead={disk_lookahead})"
            )
        self.lookahead = lookahead
        self.disk_lookahead = disk_lookahead
        self._evicting_prefetch = bool(prefetch_evicts)
        self.min_period = min_period
        self.max_history = max_history
        self.compiles_plan = plan
        self._reset()

    def _reset(self) -> None:
        self.period: Optional[int] = None
        self._func: Dict[int, object] = {}            # op index -> aten op (its OpSpec)
        self._sig_positions: Dict[tuple, List[int]] = {}
        self._op_blocks: Dict[int, Tuple[int, ...]] = {}  # op index -> ids of blocks it read
        self._created: Dict[int, Tuple[int, ...]] = {}   # op index -> ids of blocks it created
        self._adopted: Dict[int, List[int]] = {}         # op index -> ids created just before it
        # block id -> (op index, slot): slot j >= 0 is the op's j-th result; -k-1 is the k-th
        # tensor created by a creation function just before that op
        self._birth: Dict[int, Tuple[int, int]] = {}
        self._uses: Dict[int, List[int]] = {}             # block id -> op indices using it
        self._heap: List[Tuple[int, int, int]] = []       # (-priority, stamp, block id)
        self._stamp: Dict[int, int] = {}                  # block id -> stamp of its live entry
        self._counter = 0
        self._now = -1
        self._pruned_at = 0
        self._released: List[int] = []  # ids of dead blocks whose records the next prune may drop
        # candidate period -> an op that did not repeat the op one candidate period before:
        # the candidate cannot be the period while that op is in its window
        self._mismatch: Dict[int, int] = {}
        self._period_since = 0  # op at which the current period was found
        self._displaced = None  # (period, found at, replaced at) of a period a shorter one replaced
        self.plan: Optional[Plan] = None  # the period compiled, once it repeated whole
        self._plan_from = 0  # first op followed by the plan (not recorded as uses)
        self._ranking: Tuple[int, list] = (-1, [])  # (op, victims best first) while following the plan

    def attach(self, manager) -> None:
        super().attach(manager)
        self._reset()

    # -- learning the sequence -------------------------------------------------------------

    def on_adopt(self, block) -> None:
        if self.manager.limit is None:
            return  # (see before_op: nothing is learnt, and nothing would prune the record)
        if block.id not in self._birth:  # (else seen at its first op: see before_op)
            self._born_before(block, self.manager.op_index)

    def needs_every_op(self) -> bool:
        # Until something had to be evicted everything fits: nothing to learn or prefetch
        # (and the device's bytes never reach the budget, which the fast path checks).
        return self.manager is not None and self.manager.limit is not None and self.manager.under_pressure

    def before_op(self, op) -> None:
        if self.manager.limit is None:
            return  # nothing is ever evicted or prefetched: nothing to learn
        n = op.index
        self._now = n
        func = op.spec  # one per aten op; hashing it is cheaper than the op's own __hash__
        if self.plan is not None:
            if self._follows(n, func, op.blocks):
                return
            self._leave_plan(n)
        self._func[n] = func
        self._op_blocks[n] = tuple(b.id for b in op.blocks)
        sig = (func, tuple(b.id for b in op.blocks if not b.from_op))
        uses = self._uses
        for b in op.blocks:
            lst = uses.get(b.id)
            if lst is None:
                uses[b.id] = [n]
                if b.last_use == n and not b.from_op and b.id not in self._birth:
                    self._born_before(b, n)  # made by the device's empty kernel, for this op to fill
            else:
                lst.append(n)
        self._track_period(n, sig)
        if n - self._pruned_at >= max(self.period or 0, self.max_history // 4):
            self._prune(n)

    # -- decisions -----------------------------------------------------------------------

    def after_op(self, op) -> None:
        mgr = self.manager
        if mgr.limit is None:
            return  # see before_op
        n = op.index
        if self.plan is not None:
            self.after_fast_op(n, op.outputs)
            return
        if op.outputs:
            ids = tuple(b.id for b in op.outputs)
            self._created[n] = ids
            birth = self._birth
            uses = self._uses
            for j, i in enumerate(ids):
                birth[i] = (n, j)
                uses.setdefault(i, []).append(n)
        period = self.period
        if (period is not None and n - self._period_since >= period and 2 * period <= self.max_history
                and self.compiles_plan):
            self._compile(n)
            if self.plan is not None:
                return
        for b in op.blocks:
            if b.dev is not None:
                self._push(b, n)
        for b in op.outputs:
            if b.dev is not None:
                self._push(b, n)

    def before_run(self, op) -> None:
        # Prefetch now: the op's blocks are in, the room for its results is known, and the
        # memory of tensors that died since the last op is free; on a GPU the copies then
        # overlap this op's compute.
        mgr = self.manager
        if self.period is not None and self.lookahead and mgr.limit is not None:
            if mgr.all_resident():
                return  # every block is in already: nothing to look for
            if self.plan is not None:
                self._plan_prefetch(op.index, op.blocks, op.output_estimate())
            else:
                self._prefetch(op.index, op.output_estimate())
        if self.plan is not None and self.disk_lookahead and mgr.disk_blocks:
            self._read_ahead(op.index)

    # -- following the plan --------------------------------------------------------------

    def follows_fast_ops(self) -> bool:
        return self.plan is not None

    def fast_op(self, n: int, func, blocks, reserved: int) -> bool:
        self._now = n
        if self.plan is None or not self._follows(n, func, blocks):
            return False  # the generic path runs it: before_op finds the divergence
        mgr = self.manager
        if self.lookahead and not mgr.all_resident():
            self._plan_prefetch(n, blocks, reserved)
        if self.disk_lookahead and mgr.disk_blocks:
            self._read_ahead(n)
        return True

    def after_fast_op(self, n: int, outputs) -> None:
        if outputs:
            ids = tuple([b.id for b in outputs])  # (a list comprehension: no generator per op)
            self._created[n] = ids
            birth = self._birth
            for j, i in enumerate(ids):
                birth[i] = (n, j)

    # -- choosing victims ---------------------------------------------------------------

    def choose_host_victim(self, candidates, index: int):
        """The host copy needed furthest ahead; first one that is free to drop and whose
        block is on the device (its host copy is a second one)."""
        best = None
        best_key = None
        for block in candidates:
            free = block.disk is not None or not block.host_valid
            key = (free and block.dev is not None, self._priority(block, index), free)
            if best is None or key > best_key:
                best, best_key = block, key
        return best

    def choose_victim(self, protect):
        victim = self._plan_victim(protect) if self.plan is not None else self._pop_victim(protect)
        if victim is None:
            return super().choose_victim(protect)  # blocks Flow never ranked (toGPU, pins)
        return victim

    def on_release(self, block) -> None:
        self._stamp.pop(block.id, None)
        if block.id in self._uses or block.id in self._birth:
            self._released.append(block.id)  # (its records go at a prune: Note [Pruning the history])
