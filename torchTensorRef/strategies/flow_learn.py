"""Flow's learning part: the op sequence recorded, its period found, next uses predicted.

Two ops one period apart match when they are the same aten op on blocks with the same
*roles*: the same long-lived block, or blocks created the same number of ops earlier by
the same output slot. Shapes are left out so that ``generate()``, whose activations grow
every step, still repeats. Candidate periods come from the distances between earlier ops
with the same op and long-lived (not op-created) inputs.

Once the period is known, a block's next use is its counterpart's use one period earlier,
plus the period. Once the sequence has repeated for a whole period it is compiled into a
plan (``flow_plan.py``); an op that does not follow it sends Flow back to learning (Note
[Leaving the plan]).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from .flow_options import FlowOptions
from .flow_plan import Plan, loop_key

#: the predicted next use of a block not used again within a whole period
DEAD = 1 << 62
#: the most loops remembered (Note [A loop seen before])
LOOPS = 64

# Note [A loop seen before]: a plan is compiled once the period found has repeated for a whole
# period, which checks that it is the loop and not a stretch that happens to repeat. A program
# leaves its plan and learns again at every change of its sequence: each ``generate()`` call
# begins with its prompt's pass, and the decoding loop's period is found again after two
# tokens, then checked for a third. Where the period found is that of a loop compiled before
# (the same aten ops, ``flow_plan.loop_key``), the check was made then: the plan is compiled at
# once. If it is not the loop after all, its first op that differs drops it, as any plan.


def _span(t: int) -> int:
    """Ops compared to accept a period of ``t``: a whole period, at most 64, never fewer than
    16 (a few ops that happen to look alike are not a loop)."""
    return min(64, max(t, 16))


class Learning:
    """What Flow knows of the program: the ops it recorded, the period, the plan.

    It owns the record (per op index: the aten op, the blocks read, the blocks created),
    each block's birth and uses, the search for the period and the plan compiled from it,
    and answers the other parts' questions: when is a block used next (``predict``), which
    blocks do the next ops read (``upcoming``), which block plays a role (``born_at``).
    """

    options: FlowOptions
    #: the loop's period in ops while the sequence repeats, else ``None`` (recency)
    period: Optional[int]
    #: the period compiled, once it repeated whole; ``None`` while learning
    plan: Optional[Plan]
    #: op index -> aten op (its ``OpSpec``)
    funcs: Dict[int, object]
    #: ``loop_key`` of the plans compiled (Note [A loop seen before])
    loops: set
    #: op index -> ids of the blocks it read
    op_blocks: Dict[int, Tuple[int, ...]]
    #: op index -> ids of the blocks it created
    created: Dict[int, Tuple[int, ...]]
    #: op index -> ids of the blocks creation functions made just before it
    adopted: Dict[int, List[int]]
    #: block id -> (op index, slot): slot j >= 0 is the op's j-th result; -k-1 is the k-th
    #: tensor created by a creation function just before that op
    births: Dict[int, Tuple[int, int]]
    #: block id -> op indices using it
    uses: Dict[int, List[int]]
    #: ids of dead blocks whose records the next prune may drop
    released: List[int]
    #: the op of the last prune
    pruned_at: int
    _sig_positions: Dict[tuple, List[int]]  # (aten op, long-lived ids) -> op indices
    # candidate period -> an op that did not repeat the op one candidate period before:
    # the candidate cannot be the period while that op is in its window
    _mismatch: Dict[int, int]
    _period_since: int  # op at which the current period was found
    _displaced: Optional[Tuple[int, int, int]]  # (period, found at, replaced at) a shorter one replaced
    _plan_from: int  # first op followed by the plan (not recorded as uses)

    def __init__(self, options: FlowOptions):
        self.options = options
        self.period = None
        self.plan = None
        self.funcs = {}
        self.op_blocks = {}
        self.created = {}
        self.adopted = {}
        self.births = {}
        self.uses = {}
        self.released = []
        self.pruned_at = 0
        self._sig_positions = {}
        self._mismatch = {}
        self._period_since = 0
        self._displaced = None
        self._plan_from = 0
        self.loops = set()

    # -- recording -------------------------------------------------------------------------

    def born_before(self, block, n: int) -> None:
        """Record ``block`` as made by a creation function just before op ``n``."""
        adopted = self.adopted.setdefault(n, [])
        self.births[block.id] = (n, -len(adopted) - 1)
        adopted.append(block.id)

    def record(self, n: int, func, blocks) -> bool:
        """Record op ``n`` (aten op ``func`` reading ``blocks``) and look for the period in it;
        whether the period was dropped or (re)found, which makes every ranking stale."""
        self.funcs[n] = func
        self.op_blocks[n] = tuple(b.id for b in blocks)
        sig = (func, tuple(b.id for b in blocks if not b.from_op))
        uses = self.uses
        for b in blocks:
            lst = uses.get(b.id)
            if lst is None:
                uses[b.id] = [n]
                if b.last_use == n and not b.from_op and b.id not in self.births:
                    self.born_before(b, n)  # made by the device's empty kernel, for this op to fill
            else:
                lst.append(n)
        return self._track_period(n, sig)

    def record_outputs(self, n: int, outputs) -> None:
        """Record the blocks op ``n`` created, while learning (their births and first use)."""
        if outputs:
            ids = tuple(b.id for b in outputs)
            self.created[n] = ids
            birth = self.births
            uses = self.uses
            for j, i in enumerate(ids):
                birth[i] = (n, j)
                uses.setdefault(i, []).append(n)

    def follow_outputs(self, n: int, outputs) -> None:
        """Record the blocks op ``n`` created, while following the plan (their births only)."""
        if outputs:
            ids = tuple([b.id for b in outputs])  # (a list comprehension: no generator per op)
            self.created[n] = ids
            birth = self.births
            for j, i in enumerate(ids):
                birth[i] = (n, j)

    def release(self, block_id: int) -> None:
        """Block ``block_id`` died: its records go at a prune (Note [Pruning the history])."""
        if block_id in self.uses or block_id in self.births:
            self.released.append(block_id)

    # -- the period ------------------------------------------------------------------------

    def _track_period(self, n: int, sig: tuple) -> bool:
        positions = self._sig_positions.setdefault(sig, [])
        period = self.period
        changed = False
        if period is not None and not self._same(n, period):
            self.period = None  # the sequence changed: back to recency until it repeats
            changed = True
        elif period is not None and positions:
            changed = self._shorter_period(n, n - positions[-1])
        if self.period is None:
            for q in reversed(positions[-64:]):  # newest first: the shortest period that repeats
                t = n - q
                if t >= self.options.min_period and self._try_period(n, t):
                    changed = True
                    break
            if self._displaced is not None and self.period is not None:
                self._restore_displaced(n)
        positions.append(n)
        return changed

    def _try_period(self, n: int, t: int) -> bool:
        """Take ``t`` as the period if the window ending at op ``n`` repeats it (remembering
        where it did not, so that the window is not scanned again while that op is in it)."""
        k = self._mismatch.get(t)
        if k is not None and k > n - _span(t):
            return False  # op k did not repeat op k - t, and it is still in t's window
        k = self._mismatch_in_window(n, t)
        if k is None:
            self.period = t
            self._period_since = n
            return True
        if k >= 0:
            self._mismatch[t] = k
        return False

    def _shorter_period(self, n: int, t: int) -> bool:
        """Take ``t`` as the period if it is shorter and the window ending at op ``n`` repeats
        it; whether it did.

        Note [The shortest period]: a period is first looked for where the sequence changed,
        and there the only repeat may be a long one: at the start of a ``generate()`` call,
        whose prefill no decode step repeats, the previous call's prefill is the first match,
        and its distance, a whole call, stays the period while the calls have as many new
        tokens. The plan compiled from it breaks at the first call of another length. So
        while a period holds, a shorter distance between this op and the newest op like it
        (same aten op, same long-lived blocks) replaces it once a whole window repeats at
        that distance: one decode step, the same in calls of any length.
        """
        if self.options.min_period <= t < self.period:
            held = (self.period, self._period_since)
            if self._try_period(n, t):
                self._displaced = held + (n,)
                return True
        return False

    def _restore_displaced(self, n: int) -> None:
        """The period found at op ``n`` is the one a shorter distance displaced: it held since it
        was found, if the window just compared covers every op since it was displaced.

        Note [A look-alike inside the period]: a step may run the same ops on the same
        long-lived tensors twice in a row (AdamW's foreach step reads each parameter's step
        count once per bias correction), and that stretch repeats at the distance of one pass
        for a whole window. The shorter distance then replaces the period until the next op,
        where the step goes on and the period is found again. Counted as found anew, the
        period would never hold a whole period, and a training step's plan would never be
        compiled."""
        period, since, at = self._displaced
        self._displaced = None
        if self.period == period and n - at < _span(period):
            self._period_since = since

    def role(self, block_id: int, m: int, period: int):
        """Block ``block_id``'s role at op ``m`` (``flow_plan.py``): its id, or (age, slot)."""
        # Note [State carried over a period]: a block made exactly one period before the op
        # that reads it is a role, not a long-lived block: what one step hands the next (a
        # key/value cache a layer extends, generate()'s ids and mask) is made by op k and read
        # by op k one period later, each step a new block. Taken as long-lived, every step's
        # block would differ from the last step's, a step would not repeat the one before it
        # and the period found would be two steps, or a whole generate() call.
        birth = self.births.get(block_id)
        if birth is None or birth[0] < m - period:
            return block_id  # long-lived: the very same block
        return (m - birth[0], birth[1])  # created this many ops earlier, by this slot

    def _same(self, n: int, t: int) -> bool:
        """Whether op ``n`` repeats op ``n - t``: same aten op, same block roles."""
        m = n - t
        if self.funcs.get(m) is not self.funcs.get(n):
            return False
        a, b = self.op_blocks.get(n), self.op_blocks.get(m)
        if a is None or b is None or len(a) != len(b):
            return False
        role = self.role
        return all(x == y or role(x, n, t) == role(y, m, t) for x, y in zip(a, b))

    def _mismatch_in_window(self, n: int, t: int) -> Optional[int]:
        """The newest op of the window ending at ``n`` that does not repeat the op ``t``
        before it; ``None`` if all do (``t`` is a period), -1 if the history is too short."""
        span = _span(t)
        if (n - t - span + 1) not in self.funcs:
            return -1
        same = self._same
        for i in range(span):
            if not same(n - i, t):
                return n - i
        return None

    # -- pruning ---------------------------------------------------------------------------

    def _keep_from(self, n: int) -> int:
        """The first op whose record is kept at op ``n``."""
        # Keep much more than a period: a longer loop around this one (each generate() call
        # around its tokens) is only found again if its previous round is still on record.
        return n - max(self.options.max_history, 2 * (self.period or 0) + self.options.lookahead + 8)

    def prune_if_due(self, n: int) -> None:
        """Prune at op ``n`` if a quarter of the history (at least a period) passed since the last."""
        if n - self.pruned_at >= max(self.period or 0, self.options.max_history // 4):
            self.prune(n)

    def prune(self, n: int) -> None:
        """Drop the records older than the history kept at op ``n``.

        Note [Pruning the history]: the work must be the records dropped, not the records
        kept, or pruning a long decoding loop's history costs a noticeable share of its time:
        the tables keyed by op index were filled in op order, so the old entries come first;
        a block's use list and birth go once the block died and its last record left the
        window, which only the blocks released since (``release``) can have done.
        """
        keep_from = self._keep_from(n)
        for table in (self.funcs, self.op_blocks, self.created, self.adopted):
            old = []
            for k in table:
                if k >= keep_from:
                    break
                old.append(k)
            for k in old:
                del table[k]
        for sig, pos in list(self._sig_positions.items()):
            cut = bisect_right(pos, keep_from)
            if cut == len(pos):
                del self._sig_positions[sig]
            elif cut:
                del pos[:cut]
        self._mismatch = {t: k for t, k in self._mismatch.items() if k > n - _span(t)}
        self._drop_released(keep_from)
        self.pruned_at = n

    def _drop_released(self, keep_from: int) -> None:
        """Forget the dead blocks whose last record is older than op ``keep_from``."""
        uses, birth = self.uses, self.births
        recent = []
        for bid in self.released:
            lst, born = uses.get(bid), birth.get(bid)
            if lst is not None and lst[-1] >= keep_from or born is not None and born[0] >= keep_from:
                recent.append(bid)  # (its records are still in the window)
            else:
                uses.pop(bid, None)
                birth.pop(bid, None)
        self.released = recent

    # -- predicting ------------------------------------------------------------------------

    def _counterpart(self, block_id: int, n: int, period: int) -> Optional[int]:
        """The id of the block that played ``block_id``'s role one period ago."""
        birth = self.births.get(block_id)
        if birth is None or birth[0] < n - period:  # (Note [State carried over a period])
            return block_id  # it outlived a period: its own history is its pattern
        return self.born_at(birth[0] - period, birth[1])

    def born_at(self, index: int, slot: int) -> Optional[int]:
        """The id of the block born at op ``index`` in ``slot``, if known."""
        if slot >= 0:
            created = self.created.get(index)
            return created[slot] if created is not None and slot < len(created) else None
        adopted = self.adopted.get(index)
        k = -slot - 1
        return adopted[k] if adopted is not None and k < len(adopted) else None

    def next_use(self, block_id: int, n: int) -> Optional[int]:
        """Predicted op index of the next use of ``block_id`` after op ``n``, by the record;
        ``None`` if unknown, ``DEAD`` when it was not used again within a whole period."""
        period = self.period
        if period is None:
            return None
        cp = self._counterpart(block_id, n, period)
        if cp is None:
            return None
        uses = self.uses.get(cp)
        if not uses:
            return None
        i = bisect_right(uses, n - period)
        if i < len(uses) and uses[i] <= n:
            return uses[i] + period
        return DEAD

    def predict(self, block_id: int, n: int) -> Optional[int]:
        """Predicted op index of the next use of ``block_id`` after op ``n``, by the plan while
        following it, else by the record; ``None`` if unknown, ``DEAD`` if not used again."""
        plan = self.plan
        if plan is not None:
            return plan.next_use(block_id, n, self.births, DEAD)
        return self.next_use(block_id, n)

    def upcoming(self, n: int) -> Iterator[Tuple[int, int]]:
        """(op index, block id) the next ``lookahead`` ops will read, by the record (the
        period must be known); blocks still to be created are left out."""
        period = self.period
        for m in range(n + 1, n + 1 + self.options.lookahead):
            past = self.op_blocks.get(m - period)
            if past is None:
                return
            for h in past:
                birth = self.births.get(h)
                if birth is None or birth[0] < m - 2 * period:  # (its role at op m - period)
                    current = h  # long-lived: the same block again
                else:
                    current = self.born_at(birth[0] + period, birth[1])
                    if current is None:
                        continue  # will be created by an op still to come
                yield m, current

    # -- entering and leaving the plan -----------------------------------------------------

    def compile_due(self, n: int) -> bool:
        """Whether the last ``period`` ops, up to op ``n``, all repeated the period before them
        and the history holds two periods, or the period was found at op ``n`` and is that of
        a loop compiled before (Note [A loop seen before]): then the plan may be compiled."""
        period = self.period
        if period is None or 2 * period > self.options.max_history or not self.options.compiles_plan:
            return False
        since = n - self._period_since
        return since >= period or (since == 0 and bool(self.loops) and self._loop_key(n) in self.loops)

    def _loop_key(self, n: int) -> tuple:
        """``loop_key`` of the period ending at op ``n``, as ``Plan.compile`` would make it."""
        funcs, recorded = self.funcs, self.op_blocks
        return loop_key([funcs[m] if m in funcs and m in recorded else None
                         for m in range(n - self.period + 1, n + 1)])

    def compile(self, n: int) -> None:
        """Compile the period ending at op ``n`` into the plan."""
        self.plan = plan = Plan.compile(self.period, n, self.funcs, self.op_blocks, self.role, self.options.lookahead)
        self._plan_from = n + 1
        if len(self.loops) >= LOOPS:
            self.loops.clear()
        self.loops.add(plan.key)

    def follows(self, n: int, func, blocks) -> bool:
        """Whether op ``n`` (aten op ``func`` reading ``blocks``) follows the plan."""
        if not self.plan.follows(func, blocks, n, self.births, self.born_before):
            return False
        if n - self.pruned_at >= max(self.period, self.options.max_history // 4):
            self.prune(n)
        return True

    def leave_plan(self, n: int, block: Callable[[int], object]) -> None:
        """Op ``n`` does not follow the plan: drop it and record the followed ops as learning
        would have. ``block(id)`` is the live block with this id, or ``None``.

        Note [Leaving the plan]: while following, Flow keeps only the blocks each op created
        (what a role resolves to), not each op's record, the per-block use lists, the
        candidate periods or the ranking: every op followed the plan, so the plan and the
        created blocks say what each op was. The rest is rebuilt from them here, once, so
        learning goes on as if it had never stopped (the owner rebuilds the ranking).
        """
        plan, self.plan = self.plan, None
        uses, sigs, birth = self.uses, self._sig_positions, self.births
        for m in range(max(self._plan_from, self._keep_from(n)), n):
            op = plan.op_at(m, self.born_at)
            if op is None:
                continue
            self.funcs[m], ids = op
            self.op_blocks[m] = ids
            for i in ids + self.created.get(m, ()):
                lst = uses.get(i)
                if lst is None:
                    lst = uses[i] = []
                    if block(i) is None:
                        self.released.append(i)  # (dead already: Note [Pruning the history])
                lst.append(m)
            # (a block made by an op has a birth slot >= 0: ``from_op`` for blocks now dead)
            long_lived = tuple(i for i in ids if (birth.get(i) or (0, -1))[1] < 0)
            sigs.setdefault((self.funcs[m], long_lived), []).append(m)
        self._period_since = n  # (checked at this op like any other)
