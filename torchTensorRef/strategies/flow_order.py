"""Flow's eviction order: the resident block whose next use is farthest away goes first.

Belady's rule on the learning part's predictions (``flow_learn.py``): blocks predicted dead
first (clean ones before dirty ones), then the one needed farthest ahead, a dirty block's
distance counting half (Note [Dirty blocks cost two copies]); blocks with no prediction
after those, least recently used first. While learning, the resident blocks are kept in a
heap, re-ranked after each op that touches them; while following the plan, they are ranked
only when room has to be made, once per op, and a victim chosen at an offset of the plan is
taken again there one period later (Note [Victims replayed from the plan]).
"""

from __future__ import annotations

import heapq
from typing import Any, Dict, List, Optional, Tuple

from .flow_learn import DEAD, Learning

#: priority of blocks with no prediction: evicted after the predicted-dead, LRU among them
UNKNOWN = 1 << 60

#: a dirty block predicted dead and smaller than this is evicted last, as if the next op
#: needed it: writing it back costs a copy's fixed cost (host time, a launch, the link's
#: latency) for almost no room, and it is about to be freed anyway. Batch-1 decoding leaves
#: hundreds of such vectors per call; a training step's activations are larger and keep
#: their rank. (Measured: docs/benchmarks/README.md, "Flow's choices, as measured".)
_TINY_BYTES = 16 * 1024
#: a block smaller than ``_TINY_BYTES`` and than this fraction of the manager's share of
#: the budget, that the program uses again, is evicted last too: each of its moves costs a
#: copy's fixed cost for almost no room (a bias, a norm's weight). Under a budget of only
#: tiny blocks (small models) they keep Belady's rank. The share, not the budget: on a GPU
#: the budget also holds what the device keeps beside the manager (cuBLAS's workspaces, tens
#: of MiB), which is no room for blocks. (Measured: docs/benchmarks/README.md, "Flow's
#: choices, as measured".)
_SMALL_SHARE = 256
#: periods a victim chosen by ranking is taken again at its offset before the blocks are
#: ranked there anew (Note [Victims replayed from the plan]); each ranking that chooses it
#: again doubles that, up to ``MOST_REPLAYS``
REPLAYS = 4
MOST_REPLAYS = 32


# Note [Dirty blocks cost two copies]: evicting a clean block costs one copy, its fetch when
# next needed; a dirty one costs two, its write-back now and its fetch. Per byte of room, a
# dirty block needed ahead is the better victim only where it is needed much farther ahead
# than the clean one (the greedy rule for caching with costs: farthest distance per copy),
# so a dirty block ranks at half its distance. The distance is from the op that ranks: the
# plan ranks when room is needed, exactly; learning's heap ranks a block when an op uses
# it, and a dirty block's half-distance is stale by the ops since, so the two can choose
# differently where dirty blocks compete. Ranked from its last use instead, both would
# agree, but a dirty block idle long before its next use (a gradient, an optimizer's
# moments) would look due and be kept, and an AdamW step would move more. Decoding makes a
# new dirty key/value cache in every layer at every step, needed again at the next step, as
# far ahead as the layer's weights: ranked by distance alone, it would be written back and
# fetched again at every step. (Measured: docs/benchmarks/README.md, "Flow's choices, as
# measured".)


# Note [Victims replayed from the plan]: a program that follows the plan repeats its period
# with the same blocks resident at the same offsets, so the victims chosen at an offset are
# those chosen there one period earlier. Ranking the resident blocks costs a next-use lookup
# each (a region call under a budget ranks some thirty blocks; the lookups were the largest
# share of its host time), so each victim chosen at offset ``k`` by ranking is remembered by
# its role (``flow_plan.py``), and at offset ``k`` of the next ``REPLAYS - 1`` periods,
# asked in the same way, the block in that role is taken again if it may still go (resident,
# unpinned, not protected, clean where asked, ranked above ``worse_than``). Anything else
# ranks the blocks as before and remembers the new choice, and so does the ``REPLAYS``-th
# period: where the program drifted from what was resident then, a remembered choice is
# corrected within that many periods. A ranking that chooses the remembered victim again
# doubles the periods it is trusted for, up to ``MOST_REPLAYS``, and one that chooses
# another brings them back to ``REPLAYS``: a loop that repeats itself exactly (decoding, a
# training step) ranks seldom, and the rankings were a tenth of a region call's host time
# under a budget. A remembered victim is always a block that may be evicted, so a worse
# guess costs bytes, never a value.


def _rank(block, n: int, nxt: Optional[int], share: int) -> int:
    """``Order.priority`` of ``block`` at op ``n``, its next use predicted at ``nxt`` (``None``:
    unknown), the manager's blocks having ``share`` bytes of the budget (``Order.share``)."""
    if nxt is None:
        return UNKNOWN - block.last_use  # recency: least recently used first
    if nxt != DEAD:
        if block.nbytes < _TINY_BYTES and block.nbytes * _SMALL_SHARE < share:
            return n + 1  # needed again, and tiny beside the budget: evicted last (see _SMALL_SHARE)
        if not block.clean:
            return n + (nxt - n) // 2  # (Note [Dirty blocks cost two copies])
        return nxt
    if block.clean:
        return DEAD + 1  # among dead blocks, clean ones go first: dropping them is free
    if block.nbytes < _TINY_BYTES:
        return n + 1  # evicted last: see _TINY_BYTES
    return nxt


def _first(entry) -> int:
    return entry[0]


class Order:
    """Flow's ranking of the resident blocks and its choice of a victim.

    It owns the heap of resident blocks ranked while learning and the ranking made once per
    op while following the plan; the predictions come from the learning part, the blocks
    from the manager (``resident_blocks()``, ``resident_block(id)``).
    """

    learning: Learning
    manager: Any  # the TensorsManager (its strategy interface), or None before attach
    _heap: List[Tuple[int, int, int]]  # (-priority, stamp, block id)
    _stamp: Dict[int, int]  # block id -> stamp of its live entry in the heap
    _counter: int  # the last stamp given
    _ranking: Tuple[int, list]  # (op, [(priority, id, block)], best victim last) while following the plan
    #: plan offset -> [(period ranked in, call, role, periods trusted)] (Note [Victims replayed from the plan])
    _chosen: Dict[int, list]
    _asked: Tuple[int, int]  # (op, victims asked for at it so far) while following the plan

    def __init__(self, learning: Learning, manager):
        self.learning = learning
        self.manager = manager
        self._heap = []
        self._stamp = {}
        self._counter = 0
        self._ranking = (-1, [])
        self._chosen = {}
        self._asked = (-1, 0)

    def share(self) -> int:
        """Bytes of the budget the manager's blocks may take: its limit less what the device
        holds beside them, as last read (0 with no limit)."""
        share = self.manager.accounting.share() if self.manager is not None else None
        return share or 0

    def priority(self, block, n: int) -> int:
        """How good a victim ``block`` is at op ``n``: the higher, the sooner it goes."""
        return _rank(block, n, self.learning.predict(block.id, n), self.share())

    def push(self, block, n: int) -> None:
        """Rank ``block`` at op ``n`` in the heap (its earlier entry goes stale)."""
        self._counter += 1
        self._stamp[block.id] = self._counter
        heapq.heappush(self._heap, (-self.priority(block, n), self._counter, block.id))

    def rebuild(self, n: int) -> None:
        """Rank every resident block anew at op ``n`` (the predictions changed)."""
        if self.manager is None:
            return
        self._heap = []
        self._stamp = {}
        for block in self.manager.resident_blocks():
            self.push(block, n)

    def forget(self, block_id: int) -> None:
        """Block ``block_id`` died: its heap entry is stale."""
        self._stamp.pop(block_id, None)

    def forget_ranking(self) -> None:
        """A plan was compiled: the next victim is chosen from a ranking by it."""
        self._ranking = (-1, [])
        self._chosen = {}
        self._asked = (-1, 0)

    def victim(self, protect, n: int, worse_than: Optional[int] = None, clean_only: bool = False):
        """The best victim at op ``n``: resident, unpinned, its id not in ``protect``, clean if
        ``clean_only``, ranked above ``worse_than`` if given; ``None`` if there is none."""
        if self.learning.plan is not None:
            return self._plan_victim(protect, n, worse_than, clean_only)
        return self._pop_victim(protect, worse_than, clean_only)

    def _plan_rank(self, n: int) -> list:
        """Resident blocks, best victim last, ranked by the plan at op ``n`` (once per op)."""
        if self._ranking[0] == n:
            return self._ranking[1]
        # (``priority`` for each block, its calls unrolled: this ranks every resident block)
        learning = self.learning
        next_use, births = learning.plan.next_use, learning.births
        share = self.share()
        ranked = [(_rank(block, n, next_use(block.id, n, births, DEAD), share), block.id, block)
                  for block in self.manager.resident_blocks()]
        ranked.sort(key=_first)
        self._ranking = (n, ranked)
        return ranked

    def _plan_victim(self, protect, n: int, worse_than: Optional[int], clean_only: bool):
        """The victim the plan ranks best, or the one chosen here one period earlier (Note
        [Victims replayed from the plan])."""
        plan = self.learning.plan
        k = plan.offset(n)
        turn = (n - plan.base) // plan.period
        i = self._asked[1] + 1 if self._asked[0] == n else 0
        self._asked = (n, i)
        call = (clean_only, None if worse_than is None else worse_than - n)
        chosen = self._chosen.get(k)
        due = None  # (the remembered role and its trust, where its time to be checked came)
        if chosen is not None and i < len(chosen):
            ranked_at, was_call, role, trusted = chosen[i]
            if was_call == call:
                if turn - ranked_at < trusted:
                    block = self._again(role, protect, n, worse_than, clean_only)
                    if block is not None:
                        return block
                else:
                    due = (role, trusted)
        block = self._ranked_victim(protect, n, worse_than, clean_only)
        if chosen is None:
            chosen = self._chosen[k] = []
        if block is None:
            del chosen[i:]
            return None
        role = self.learning.role(block.id, n, plan.period)
        if due is not None and due[0] == role:
            # (confirmed: trusted longer, and the victims after it at this op stand)
            chosen[i] = (turn, call, role, min(2 * due[1], MOST_REPLAYS))
            return block
        del chosen[i:]
        chosen.append((turn, call, role, REPLAYS))
        return block

    def _again(self, role, protect, n: int, worse_than: Optional[int], clean_only: bool):
        """The block in ``role`` at op ``n`` if it may be evicted as asked, else ``None``."""
        learning = self.learning
        bid = role if role.__class__ is int else learning.born_at(n - role[0], role[1])
        block = self.manager.resident_block(bid) if bid is not None else None
        if block is None or block.pins or bid in protect or (clean_only and not block.clean):
            return None
        if worse_than is not None:
            nxt = learning.plan.next_use(bid, n, learning.births, DEAD)
            if _rank(block, n, nxt, self.share()) <= worse_than:
                return None
        return block

    def _ranked_victim(self, protect, n: int, worse_than: Optional[int], clean_only: bool):
        ranked = self._plan_rank(n)
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

    def _pop_victim(self, protect, worse_than: Optional[int], clean_only: bool):
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
