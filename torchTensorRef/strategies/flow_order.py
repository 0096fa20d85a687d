"""Flow's eviction order: the resident block whose next use is farthest away goes first.

Belady's rule on Flow's predictions (``flow_learn.py``): blocks predicted dead first (clean
ones before dirty ones), then the one needed farthest ahead, a dirty block's distance
counting half (Note [Dirty blocks cost two copies]); blocks with no prediction after
those, least recently used first. While learning, Flow keeps the resident blocks in a heap,
re-ranked after each op that touches them; while following the plan, it ranks them only
when room has to be made, once per op.
"""

from __future__ import annotations

import heapq
from typing import Optional

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


# Note [Dirty blocks cost two copies]: evicting a clean block costs one copy, its fetch when
# next needed; a dirty one costs two, its write-back now and its fetch. Per byte of room, a
# dirty block needed ahead is the better victim only where it is needed much farther ahead
# than the clean one (the greedy rule for caching with costs: farthest distance per copy),
# so a dirty block ranks at half its distance. The distance is from the op that ranks: the
# plan ranks when room is needed, exactly; learning's heap ranks a block when an op uses
# it, and a dirty block's half-distance is stale by the ops since, so the two can choose
# differently where dirty blocks compete (the plan never moved more in the tests). Ranked
# from its last use instead, both would agree, but a dirty block idle long before its next
# use (a gradient, an optimizer's moments) would look due and be kept: an AdamW step at 100%
# of the weights moved 1.176x the offline reference against 1.075x
# (``benchmarks/train_budget.py``). Decoding makes a new dirty key/value cache in every
# layer at every step, needed again at the next step, as far ahead as the layer's weights:
# ranked by distance alone, it was written back and fetched again at every step. The Llama
# decoding of ``benchmarks/small_ops.py --size small`` (4 layers) on the lenient "sim" at
# 50% of the weights: 233 -> 63 write-backs and 699 -> 570 evictions per ``generate()``
# call, 199.2 -> 196.3 MB moved; at 25%, 208 -> 2 write-backs.


def _first(entry) -> int:
    return entry[0]


class FlowOrder:
    """Flow's ranking of resident blocks and its choice of a victim."""

    def _priority(self, block, n: int) -> int:
        plan = self.plan
        nxt = plan.next_use(block.id, n, self._birth, _DEAD) if plan is not None else self.next_use(block.id, n)
        if nxt is None:
            return _UNKNOWN - block.last_use  # recency: least recently used first
        if nxt != _DEAD and not block.clean:
            return n + (nxt - n) // 2  # (Note [Dirty blocks cost two copies])
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
