"""Flow's plan: one period of the program, compiled so that following it costs little per op.

While Flow learns (``flow_learn.py``) it records every op, checks every op against the op one
period earlier and ranks every block it touches. Once the sequence has repeated for a whole
period, none of that tells it anything new. It compiles the last period into a
:class:`Plan` and from then on only checks that each op follows it:

- per offset ``k`` in the period: the aten op and the *roles* of its blocks (a long-lived
  block by its id, a block made ``age`` ops earlier by output ``slot``), which is what a
  repeat must match;
- when each long-lived block, and each role of a block made during the period, is used, so
  that the next use of a resident block (Belady's rule) is a lookup, done only when room
  has to be made, for the resident blocks then;
- per offset: what the next ``lookahead`` ops read, so a prefetch is a list walk.

An op that does not follow the plan drops it: Flow records the ops it skipped as it would
have while learning, and goes on learning from there (Note [Leaving the plan] in
``flow_learn.py``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

#: a long-lived block's role is its id; a block made during the period is (age, slot)
Role = object


def loop_key(funcs) -> tuple:
    """A period's aten ops (``None`` for a hole), as one key whatever op the period begins at:
    a later plan of the same loop may begin elsewhere in it."""
    return (len(funcs), frozenset(Counter(funcs).items()))


class Plan:
    """One compiled period: ops ``base .. base + period - 1`` as Flow recorded them."""

    __slots__ = ("period", "base", "funcs", "roles", "long_uses", "made_uses", "ahead", "key")

    def __init__(self, period: int, base: int):
        self.period = period
        self.base = base
        self.funcs: List[object] = []
        self.roles: List[Tuple[Role, ...]] = []
        #: long-lived block id -> sorted offsets of its uses in the period
        self.long_uses: Dict[int, List[int]] = {}
        #: (birth offset, slot) -> sorted ages (ops after its birth) of its uses
        self.made_uses: Dict[Tuple[int, int], List[int]] = {}
        #: per offset: ((j, role), ...) read by the op j ops later (1 <= j <= lookahead)
        self.ahead: List[Tuple[Tuple[int, Role], ...]] = []
        #: the loop it follows, whatever op its period begins at (``loop_key``)
        self.key: tuple = ()

    @classmethod
    def compile(cls, period: int, end: int, funcs: Dict[int, object], op_blocks: Dict[int, tuple],
                role: Callable[[int, int, int], Role], lookahead: int) -> "Plan":
        """The plan of ops ``end - period + 1 .. end``.

        An index the record lacks (an op on host copies, which Flow does not see) stays a
        hole: an op Flow sees there does not follow the plan.
        """
        plan = cls(period, end - period + 1)
        long_uses, made_uses = plan.long_uses, plan.made_uses
        for k in range(period):
            m = plan.base + k
            ids = op_blocks.get(m)
            if ids is None or m not in funcs:
                plan.funcs.append(None)
                plan.roles.append(())
                continue
            roles = tuple(role(x, m, period) for x in ids)
            plan.funcs.append(funcs[m])
            plan.roles.append(roles)
            for r in roles:
                if r.__class__ is int:
                    long_uses.setdefault(r, []).append(k)
                else:
                    age, slot = r
                    made_uses.setdefault(((k - age) % period, slot), []).append(age)
        for ages in made_uses.values():
            ages.sort()  # a block made late in the period is used early in the next one
        plan.key = loop_key(plan.funcs)
        for k in range(period):
            own = set(plan.roles[k])
            seen = set()
            ahead = []
            for j in range(1, min(lookahead, period - 1) + 1):
                for r in plan.roles[(k + j) % period]:
                    if r.__class__ is int:
                        key = r
                    elif r[0] < j:
                        continue  # made after op k: nothing to prefetch
                    else:
                        key = (r[0] - j, r[1])  # the same block as seen from op k
                    if key in own or key in seen:
                        continue
                    seen.add(key)
                    ahead.append((j, r))
            plan.ahead.append(tuple(ahead))
        return plan

    def offset(self, n: int) -> int:
        return (n - self.base) % self.period

    def follows(self, func, blocks, n: int, birth: dict, born_before: Callable) -> bool:
        """Whether op ``n`` (aten op ``func`` on ``blocks``) is the plan's op at its offset.

        A block made by the device's empty kernel for this op to fill is first seen here:
        ``born_before(block, n)`` records its birth, as learning does.
        """
        k = (n - self.base) % self.period
        if self.funcs[k] is not func:
            return False
        roles = self.roles[k]
        if len(roles) != len(blocks):
            return False
        for b, r in zip(blocks, roles):
            if r.__class__ is int:
                if b.id != r:
                    return False
                continue
            born = birth.get(b.id)
            if born is None and b.last_use == n and not b.from_op:
                born_before(b, n)
                born = birth[b.id]
            if born is None or born[1] != r[1] or born[0] != n - r[0]:  # (no tuple per role)
                return False
        return True

    def op_at(self, m: int, born_at: Callable) -> Optional[Tuple[object, tuple]]:
        """(aten op, block ids) of op ``m``, which followed the plan; ``None`` for a hole."""
        k = (m - self.base) % self.period
        func = self.funcs[k]
        if func is None:
            return None
        ids = tuple(r if r.__class__ is int else born_at(m - r[0], r[1]) for r in self.roles[k])
        return None if None in ids else (func, ids)

    def next_use(self, block_id: int, n: int, birth: dict, dead: int) -> Optional[int]:
        """Predicted op index of ``block_id``'s next use after op ``n``: ``dead`` if the plan
        uses it no more, ``None`` if the plan does not know it."""
        period = self.period
        b = birth.get(block_id)
        if b is None or b[0] < n - period:  # (Note [State carried over a period], flow_learn.py)
            offsets = self.long_uses.get(block_id)
            if offsets is None:
                # Made over a period ago (or never used in the period): not a role the plan has.
                return None if b is not None else dead
            k = (n - self.base) % period
            i = bisect_right(offsets, k)
            nxt = offsets[i] if i < len(offsets) else offsets[0] + period
            return n + nxt - k
        ages = self.made_uses.get(((b[0] - self.base) % period, b[1]))
        if ages is None:
            return dead
        i = bisect_right(ages, n - b[0])
        return b[0] + ages[i] if i < len(ages) else dead
