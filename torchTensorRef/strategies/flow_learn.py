"""How Flow learns the program: the op sequence recorded, its period found, next uses predicted.

Two ops one period apart match when they are the same aten op on blocks with the same
*roles*: the same long-lived block, or blocks created the same number of ops earlier by
the same output slot. Shapes are left out so that ``generate()``, whose activations grow
every step, still repeats. Candidate periods come from the distances between earlier ops
with the same op and long-lived (not op-created) inputs.

Once the period is known, a block's next use is its counterpart's use one period earlier,
plus the period. Once the sequence has repeated for a whole period it is compiled into a
plan (``flow_plan.py``); an op that does not follow it sends Flow back to learning (Note
[Leaving the plan]). The state these methods share is set up by ``Flow._reset``
(``flow.py``).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Optional

from .flow_order import _DEAD
from .flow_plan import Plan


def _span(t: int) -> int:
    """Ops compared to accept a period of ``t``: a whole period, at most 64, never fewer than
    16 (a few ops that happen to look alike are not a loop)."""
    return min(64, max(t, 16))


class FlowLearning:
    """Flow's recording of the op sequence, its period, its predictions and its plan."""

    def _born_before(self, block, n: int) -> None:
        """Record ``block`` as made by a creation function just before op ``n``."""
        adopted = self._adopted.setdefault(n, [])
        self._birth[block.id] = (n, -len(adopted) - 1)
        adopted.append(block.id)

    def _track_period(self, n: int, sig: tuple) -> None:
        positions = self._sig_positions.setdefault(sig, [])
        period = self.period
        if period is not None and not self._same(n, period):
            self.period = None  # the sequence changed: back to recency until it repeats
            self._rebuild_heap()
        elif period is not None and positions:
            self._shorter_period(n, n - positions[-1])
        if self.period is None:
            for q in reversed(positions[-64:]):  # newest first: the shortest period that repeats
                t = n - q
                if t >= self.min_period and self._try_period(n, t):
                    break
            if self._displaced is not None and self.period is not None:
                self._restore_displaced(n)
        positions.append(n)

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
            self._rebuild_heap()
            return True
        if k >= 0:
            self._mismatch[t] = k
        return False

    def _shorter_period(self, n: int, t: int) -> None:
        """Take ``t`` as the period if it is shorter and the window ending at op ``n`` repeats it.

        Note [The shortest period]: a period is first looked for where the sequence changed,
        and there the only repeat may be a long one: at the start of a ``generate()`` call,
        whose prefill no decode step repeats, the previous call's prefill is the first match,
        and its distance, a whole call, stays the period while the calls have as many new
        tokens. The plan compiled from it breaks at the first call of another length. So
        while a period holds, a shorter distance between this op and the newest op like it
        (same aten op, same long-lived blocks) replaces it once a whole window repeats at
        that distance: one decode step, the same in calls of any length.
        """
        if self.min_period <= t < self.period:
            held = (self.period, self._period_since)
            if self._try_period(n, t):
                self._displaced = held + (n,)

    def _restore_displaced(self, n: int) -> None:
        """The period found at op ``n`` is the one a shorter distance displaced: it held since it
        was found, if the window just compared covers every op since it was displaced.

        Note [A look-alike inside the period]: a step may run the same ops on the same
        long-lived tensors twice in a row (AdamW's foreach step reads each parameter's step
        count once per bias correction: 2 x 39 ops for a 4-layer Llama), and that stretch
        repeats at the distance of one pass for a whole window. The shorter distance then
        replaces the period until the next op, where the step goes on and the period is found
        again. Counted as found anew, it never held a whole period, and the plan of a
        training step was never compiled."""
        period, since, at = self._displaced
        self._displaced = None
        if self.period == period and n - at < _span(period):
            self._period_since = since

    def _role(self, block_id: int, m: int, period: int):
        # Note [State carried over a period]: a block made exactly one period before the op
        # that reads it is a role, not a long-lived block: what one step hands the next (a
        # key/value cache a layer extends, generate()'s ids and mask) is made by op k and read
        # by op k one period later, each step a new block. Taken as long-lived, every step's
        # block differed from the last step's, a step did not repeat the one before it and
        # the period found was two steps, or a whole generate() call.
        birth = self._birth.get(block_id)
        if birth is None or birth[0] < m - period:
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
        # Note [Pruning the history]: the work is the records dropped, not the records kept
        # (scanned whole, a decoding loop's 50,000 ops of history took 100 ms to prune, every
        # 12,500 ops: 3% of its time on the lenient "sim"; now 15 ms): the tables
        # keyed by op index were filled in op order, so the old entries come first; a block's
        # use list and birth go once the block died and its last record left the window,
        # which only the blocks released since (``on_release``) can have done.
        keep_from = self._keep_from(n)
        for table in (self._func, self._op_blocks, self._created, self._adopted):
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
        uses, birth = self._uses, self._birth
        recent = []
        for bid in self._released:
            lst, born = uses.get(bid), birth.get(bid)
            if lst is not None and lst[-1] >= keep_from or born is not None and born[0] >= keep_from:
                recent.append(bid)  # (its records are still in the window)
            else:
                uses.pop(bid, None)
                birth.pop(bid, None)
        self._released = recent
        self._pruned_at = n

    # -- predicting ----------------------------------------------------------------------

    def _counterpart(self, block_id: int, n: int, period: int) -> Optional[int]:
        """The id of the block that played ``block_id``'s role one period ago."""
        birth = self._birth.get(block_id)
        if birth is None or birth[0] < n - period:  # (Note [State carried over a period])
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

    # -- entering and leaving the plan ---------------------------------------------------

    def _compile(self, n: int) -> None:
        """The last ``period`` ops all repeated the period before them: compile them."""
        self.plan = Plan.compile(self.period, n, self._func, self._op_blocks, self._role, self.lookahead)
        self._plan_from = n + 1
        self._ranking = (-1, [])
        self.manager.hooks_changed()  # ops that move nothing may take the fast path again

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
            for i in ids + self._created.get(m, ()):
                lst = uses.get(i)
                if lst is None:
                    lst = uses[i] = []
                    if self.manager.block(i) is None:
                        self._released.append(i)  # (dead already: Note [Pruning the history])
                lst.append(m)
            # (a block made by an op has a birth slot >= 0: ``from_op`` for blocks now dead)
            long_lived = tuple(i for i in ids if (birth.get(i) or (0, -1))[1] < 0)
            sigs.setdefault((self._func[m], long_lived), []).append(m)
        self._period_since = n  # (checked at this op like any other)
        self._rebuild_heap()
