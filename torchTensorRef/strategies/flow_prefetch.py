"""Flow's prefetching: the blocks the next ops will read, brought in ahead of them.

After each op Flow looks ``lookahead`` ops ahead (by its prediction while learning, by the
plan's list while following it) and prefetches their blocks into free memory, so copies
overlap compute on a GPU. While following the plan it also starts reading from disk the
long-lived blocks the op ``disk_lookahead`` ops ahead uses (Note [Three levels]), making
host room from free host copies needed later.
"""

from __future__ import annotations

from .flow_order import _UNKNOWN


class FlowPrefetch:
    """Flow's prefetches to the device and read-aheads from disk."""

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
                if birth is None or birth[0] < m - 2 * period:  # (its role at op m - period)
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
        while mgr.in_use() + mgr.block_bytes(block.nbytes) > limit:  # (as the allocator gives it)
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
