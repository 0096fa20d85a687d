"""Flow's prefetching part: the blocks the next ops will read, brought in ahead of them.

Before each op runs, Flow looks ``lookahead`` ops ahead (by its prediction while learning,
by the plan's list while following it) and prefetches their blocks into free memory, so
copies overlap compute on a GPU. While following the plan it also starts reading from disk
the long-lived blocks the op ``disk_lookahead`` ops ahead uses (Note [Three levels]),
making host room from free host copies needed later.
"""

from __future__ import annotations

from typing import Any

from .flow_learn import Learning
from .flow_options import FlowOptions
from .flow_order import UNKNOWN, Order


class Prefetch:
    """Flow's prefetches to the device and read-aheads from disk.

    It owns no state of its own: it reads the settings (``lookahead``, ``disk_lookahead``,
    ``prefetch_evicts``), asks the learning part what comes next and the order part what
    may make room, and moves blocks through the manager (``prefetch``, ``evict``,
    ``read_ahead``, ``drop_host_copy``).
    """

    options: FlowOptions
    learning: Learning
    order: Order
    manager: Any  # the TensorsManager (its strategy interface), or None before attach

    def __init__(self, options: FlowOptions, learning: Learning, order: Order, manager):
        self.options = options
        self.learning = learning
        self.order = order
        self.manager = manager

    # -- to the device ---------------------------------------------------------------------

    def predicted(self, n: int, reserved: int) -> None:
        """While learning: prefetch, at op ``n``, what the next ops read by prediction, leaving
        ``reserved`` bytes for the op's results."""
        mgr = self.manager
        limit = mgr.limit - reserved  # the op's results still need their room
        lookup = mgr.block
        for m, bid in self.learning.upcoming(n):
            block = lookup(bid)
            if block is None or block.dev is not None:
                continue
            if not self._prefetch_one(block, n, m, limit, ()):
                return
            self.order.push(block, n)

    def planned(self, n: int, blocks, reserved: int) -> None:
        """While following the plan: prefetch, at op ``n`` (reading ``blocks``), what the
        plan's next ops read, leaving ``reserved`` bytes for the op's results."""
        mgr, plan = self.manager, self.learning.plan
        limit = mgr.limit - reserved  # the op's results still need their room
        lookup, born_at = mgr.block, self.learning.born_at
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

    def _prefetch_one(self, block, n: int, m: int, limit: int, protect_blocks) -> bool:
        """Prefetch ``block``, needed at op ``m``, at op ``n`` within ``limit``; ``False`` if it
        does not fit (nothing further is tried then)."""
        mgr = self.manager
        # Make room only from clean blocks predicted to be needed after op m: evicting them
        # is free, while a dirty one might still die (be freed) before it is needed.
        while mgr.in_use() + mgr.alloc_bytes(block.nbytes) > limit:  # (as the allocator may give it)
            if not self.options.prefetch_evicts:
                return False
            protect = {b.id for b in protect_blocks}
            victim = self.order.victim(protect, n, worse_than=m, clean_only=True)
            if victim is None:
                return False
            mgr.evict(victim)
        mgr.prefetch(block)
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
