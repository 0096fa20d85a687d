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
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Dict, List, Optional, Tuple

from .base import Strategy
from .flow_plan import Plan

#: priority of blocks with no prediction: evicted after the predicted-dead, LRU among them
_UNKNOWN = 1 << 60
_DEAD = 1 << 62


#: a dirty block predicted dead and smaller than this is evicted last, as if the next op
#: needed it: writing it back costs a copy's fixed cost (host time, a launch, the link's
#: latency) for almost no room, and it is about to be freed anyway. (Batch-1 decoding
#: leaves hundreds of such vectors per call: Llama at 50% of its weights, 565 -> 172
#: write-backs and 1113 -> 721 evictions per ``generate()`` call, bytes 1% fewer; a
#: training step's activations are larger and keep their rank.)
_TINY_BYTES = 16 * 1024


def _first(entry) -> int:
    return entry[0]


def _span(t: int) -> int:
    """Ops compared to accept a period of ``t``: a whole period, at most 64, never fewer than
    16 (a few ops that happen to look alike are not a loop)."""
    return min(64, max(t, 16))


class Flow(Strategy):
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
        # candidate period -> an op that did not repeat the op one candidate period before:
        # the candidate cannot be the period while that op is in its window
        self._mismatch: Dict[int, int] = {}
        self._period_since = 0  # op at which the current period was found
        self.plan: Optional[Plan] = None  # the period compiled, once it repeated whole
        self._plan_from = 0  # first op followed by the plan (not recorded as uses)
        self._ranking: Tuple[int, list] = (-1, [])  # (op, victims best first) while following the plan

    def attach(self, manager) -> None:
        super().attach(manager)
        self._reset()

    # -- learning the sequence -------------------------------------------------------------

    def on_adopt(self, block) -> None:
        if block.id not in self._birth:  # (else seen at its first op: see before_op)
            self._born_before(block, self.manager.op_index)

    def _born_before(self, block, n: int) -> None:
        """Record ``block`` as made by a creation function just before op ``n``."""
        adopted = self._adopted.setdefault(n, [])
        self._birth[block.id] = (n, -len(adopted) - 1)
        adopted.append(block.id)

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

    def _track_period(self, n: int, sig: tuple) -> None:
        positions = self._sig_positions.setdefault(sig, [])
        period = self.period
        if period is not None and not self._same(n, period):
            self.period = None  # the sequence changed: back to recency until it repeats
            self._rebuild_heap()
        if self.period is None:
            mismatch = self._mismatch
            for q in reversed(positions[-64:]):  # newest first: the shortest period that repeats
                t = n - q
                if t < self.min_period:
                    continue
                k = mismatch.get(t)
                if k is not None and k > n - _span(t):
                    continue  # op k did not repeat op k - t, and it is still in t's window
                k = self._mismatch_in_window(n, t)
                if k is None:
                    self.period = t
                    self._period_since = n
                    self._rebuild_heap()
                    break
                if k >= 0:
                    mismatch[t] = k
        positions.append(n)

    def _role(self, block_id: int, m: int, period: int):
        birth = self._birth.get(block_id)
        if birth is None or birth[0] <= m - period:
            return block_id  # long-lived: the very same block
        return (m - birth[0], birth[1])  # created this many ops earlier, by this slot

    def _same(self, n: int, t: int) -> bool:
        """Whether op ``n`` repeats op ``n - t``: same aten op, same block roles."""
        m = n - t
        if self._func.get(m) is not self._func.get(n):
            return False
        a, b = self._op_blocks.get(n), self._op_blocks.get(m)
        if a is None or b is None or len(a) != len(b):
            return False
        role = self._role
        return all(x == y or role(x, n, t) == role(y, m, t) for x, y in zip(a, b))

    def _mismatch_in_window(self, n: int, t: int) -> Optional[int]:
        """The newest op of the window ending at ``n`` that does not repeat the op ``t``
        before it; ``None`` if all do (``t`` is a period), -1 if the history is too short."""
        span = _span(t)
        if (n - t - span + 1) not in self._func:
            return -1
        same = self._same
        for i in range(span):
            if not same(n - i, t):
                return n - i
        return None

    def _keep_from(self, n: int) -> int:
        """The first op whose record is kept at op ``n``."""
        # Keep much more than a period: a longer loop around this one (each generate() call
        # around its tokens) is only found again if its previous round is still on record.
        return n - max(self.max_history, 2 * (self.period or 0) + self.lookahead + 8)

    def _prune(self, n: int) -> None:
        keep_from = self._keep_from(n)
        for table in (self._func, self._op_blocks, self._created, self._adopted):
            for k in [k for k in table if k < keep_from]:
                del table[k]
        for sig, pos in list(self._sig_positions.items()):
            cut = bisect_right(pos, keep_from)
            if cut == len(pos):
                del self._sig_positions[sig]
            elif cut:
                del pos[:cut]
        self._mismatch = {t: k for t, k in self._mismatch.items() if k > n - _span(t)}
        block = self.manager.block
        for bid, lst in list(self._uses.items()):
            if lst[-1] < keep_from and block(bid) is None:
                del self._uses[bid]
                self._birth.pop(bid, None)
        if self.plan is not None:  # blocks made while following the plan have no use list
            for bid, (born, _slot) in list(self._birth.items()):
                if born < keep_from and block(bid) is None:
                    del self._birth[bid]
        self._pruned_at = n

    # -- predicting ----------------------------------------------------------------------

    def _counterpart(self, block_id: int, n: int, period: int) -> Optional[int]:
        """The id of the block that played ``block_id``'s role one period ago."""
        birth = self._birth.get(block_id)
        if birth is None or birth[0] <= n - period:
            return block_id  # it outlived a period: its own history is its pattern
        return self._born_at(birth[0] - period, birth[1])

    def _born_at(self, index: int, slot: int) -> Optional[int]:
        """The id of the block born at op ``index`` in ``slot``, if known."""
        if slot >= 0:
            created = self._created.get(index)
            return created[slot] if created is not None and slot < len(created) else None
        adopted = self._adopted.get(index)
        k = -slot - 1
        return adopted[k] if adopted is not None and k < len(adopted) else None

    def next_use(self, block_id: int, n: int) -> Optional[int]:
        """Predicted op index of the next use of ``block_id`` after op ``n``; ``None`` if unknown.

        Returns ``_DEAD`` when it was not used again within a whole period.
        """
        period = self.period
        if period is None:
            return None
        cp = self._counterpart(block_id, n, period)
        if cp is None:
            return None
        uses = self._uses.get(cp)
        if not uses:
            return None
        i = bisect_right(uses, n - period)
        if i < len(uses) and uses[i] <= n:
            return uses[i] + period
        return _DEAD

    def _priority(self, block, n: int) -> int:
        plan = self.plan
        nxt = plan.next_use(block.id, n, self._birth, _DEAD) if plan is not None else self.next_use(block.id, n)
        if nxt is None:
            return _UNKNOWN - block.last_use  # recency: least recently used first
        if nxt == _DEAD:
            if block.clean:
                return _DEAD + 1  # among dead blocks, clean ones go first: dropping them is free
            if block.nbytes < _TINY_BYTES:
                return n + 1  # evicted last: see _TINY_BYTES
        return nxt

    def _push(self, block, n: int) -> None:
        self._counter += 1
        self._stamp[block.id] = self._counter
        heapq.heappush(self._heap, (-self._priority(block, n), self._counter, block.id))

    def _rebuild_heap(self) -> None:
        if self.manager is None:
            return
        self._heap = []
        self._stamp = {}
        for block in self.manager.resident_blocks():
            self._push(block, self._now)

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
        if self.plan is not None and self.disk_lookahead and mgr._disk_blocks:
            self._read_ahead(op.index)

    # -- following the plan --------------------------------------------------------------

    def _compile(self, n: int) -> None:
        """The last ``period`` ops all repeated the period before them: compile them."""
        self.plan = Plan.compile(self.period, n, self._func, self._op_blocks, self._role, self.lookahead)
        self._plan_from = n + 1
        self._ranking = (-1, [])
        self.manager.hooks_changed()  # ops that move nothing may take the fast path again

    def follows_fast_ops(self) -> bool:
        return self.plan is not None

    def fast_op(self, n: int, func, blocks, reserved: int) -> bool:
        self._now = n
        if self.plan is None or not self._follows(n, func, blocks):
            return False  # the generic path runs it: before_op finds the divergence
        mgr = self.manager
        if self.lookahead and not mgr.all_resident():
            self._plan_prefetch(n, blocks, reserved)
        if self.disk_lookahead and mgr._disk_blocks:
            self._read_ahead(n)
        return True

    def _read_ahead(self, n: int) -> None:
        """Start reading from disk what the plan's op ``disk_lookahead`` ops ahead uses."""
        mgr = self.manager
        m = n + self.disk_lookahead
        plan = self.plan
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
        needed = self._priority(block, index)
        if needed >= _UNKNOWN:
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
        for block in self.manager.host_copies():
            if block.host_valid and block.disk is None:
                continue  # (would have to be written first)
            priority = self._priority(block, n)
            if priority > best_priority:
                best, best_priority = block, priority
        return best

    def after_fast_op(self, n: int, outputs) -> None:
        if outputs:
            ids = tuple([b.id for b in outputs])  # (a list comprehension: no generator per op)
            self._created[n] = ids
            birth = self._birth
            for j, i in enumerate(ids):
                birth[i] = (n, j)

    def _follows(self, n: int, func, blocks) -> bool:
        """Whether op ``n`` follows the plan."""
        if not self.plan.follows(func, blocks, n, self._birth, self._born_before):
            return False
        if n - self._pruned_at >= max(self.period, self.max_history // 4):
            self._prune(n)
        return True

    def _leave_plan(self, n: int) -> None:
        """Op ``n`` does not follow the plan: record the followed ops as learning would have."""
        # Note [Leaving the plan]: while following, Flow kept only the blocks each op created
        # (what a role resolves to), not each op's record, the per-block use lists, the
        # candidate periods or the ranking: every op followed the plan, so the plan and the
        # created blocks say what each op was. The rest is rebuilt from them here, once, so
        # learning goes on as if it had never stopped.
        plan, self.plan = self.plan, None
        self.manager.hooks_changed()
        uses, sigs, birth = self._uses, self._sig_positions, self._birth
        for m in range(max(self._plan_from, self._keep_from(n)), n):
            op = plan.op_at(m, self._born_at)
            if op is None:
                continue
            self._func[m], ids = op
            self._op_blocks[m] = ids
            for i in ids:
                uses.setdefault(i, []).append(m)
            for i in self._created.get(m, ()):
                uses.setdefault(i, []).append(m)
            # (a block made by an op has a birth slot >= 0: ``from_op`` for blocks now dead)
            long_lived = tuple(i for i in ids if (birth.get(i) or (0, -1))[1] < 0)
            sigs.setdefault((self._func[m], long_lived), []).append(m)
        self._period_since = n  # (checked at this op like any other)
        self._rebuild_heap()

    def _plan_rank(self, n: int) -> list:
        """Resident blocks, best victim last, ranked by the plan at op ``n`` (once per op)."""
        if self._ranking[0] == n:
            return self._ranking[1]
        priority = self._priority
        ranked = [(priority(block, n), block.id, block) for block in self.manager.resident_blocks()]
        ranked.sort(key=_first)
        self._ranking = (n, ranked)
        return ranked

    def _plan_victim(self, protect, worse_than: Optional[int] = None, clean_only: bool = False):
        ranked = self._plan_rank(self._now)
        resident = self.manager.resident_block
        for i in range(len(ranked) - 1, -1, -1):
            priority, bid, block = ranked[i]
            if worse_than is not None and priority <= worse_than:
                return None  # everything left is needed sooner
            if resident(bid) is not block:
                del ranked[i]  # evicted or freed since the ranking
                continue
            if block.pins or bid in protect or (clean_only and not block.clean):
                continue
            del ranked[i]
            return block
        return None

    def _plan_prefetch(self, n: int, blocks, reserved: int) -> None:
        mgr, plan = self.manager, self.plan
        limit = mgr.limit - reserved  # the op's results still need their room
        lookup, born_at = mgr.block, self._born_at
        for j, role in plan.ahead[plan.offset(n)]:
            if role.__class__ is int:
                block = lookup(role)
            else:
                bid = born_at(n + j - role[0], role[1])
                block = lookup(bid) if bid is not None else None
            if block is None or block.dev is not None:
                continue
            # (the plan's ranking may predate this op's fetches: its blocks are protected)
            if not self._prefetch_one(block, n, n + j, limit, blocks):
                return

    def _upcoming(self, n: int):
        """(op index, block) pairs the next ``lookahead`` ops will read, by prediction."""
        period = self.period
        lookup = self.manager.block
        for m in range(n + 1, n + 1 + self.lookahead):
            past = self._op_blocks.get(m - period)
            if past is None:
                return
            for h in past:
                birth = self._birth.get(h)
                if birth is None or birth[0] <= m - 2 * period:
                    current = h  # long-lived: the same block again
                else:
                    current = self._born_at(birth[0] + period, birth[1])
                    if current is None:
                        continue  # will be created by an op still to come
                block = lookup(current)
                if block is not None:
                    yield m, block

    def _prefetch(self, n: int, reserved: int) -> None:
        mgr = self.manager
        limit = mgr.limit - reserved  # the op's results still need their room
        for m, block in self._upcoming(n):
            if block.dev is not None:
                continue
            if not self._prefetch_one(block, n, m, limit, ()):
                return
            self._push(block, n)

    def _prefetch_one(self, block, n: int, m: int, limit: int, protect_blocks) -> bool:
        """Prefetch ``block``, needed at op ``m``, at op ``n`` within ``limit``; ``False`` if it
        does not fit (nothing further is tried then)."""
        mgr = self.manager
        # Make room only from clean blocks predicted to be needed after op m: evicting them
        # is free, while a dirty one might still die (be freed) before it is needed.
        while mgr.in_use() + block.nbytes > limit:
            if not self._evicting_prefetch:
                return False
            protect = {b.id for b in protect_blocks}
            victim = (self._plan_victim(protect, worse_than=m, clean_only=True) if self.plan is not None
                      else self._pop_victim(protect, worse_than=m, clean_only=True))
            if victim is None:
                return False
            mgr.evict(victim)
        mgr.prefetch(block)
        block.last_use = n
        return True

    def _pop_victim(self, protect, worse_than: Optional[int] = None, clean_only: bool = False):
        heap = self._heap
        stamp = self._stamp
        resident = self.manager.resident_block
        skipped = []
        found = None
        while heap:
            neg, s, bid = heap[0]
            block = resident(bid)
            if block is None or stamp.get(bid) != s:
                heapq.heappop(heap)  # stale entry
                continue
            if worse_than is not None and -neg <= worse_than:
                break  # everything left is needed sooner
            heapq.heappop(heap)
            if block.pins or bid in protect or (clean_only and not block.clean):
                skipped.append((neg, s, bid))
                continue
            found = block
            stamp.pop(bid, None)
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

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
