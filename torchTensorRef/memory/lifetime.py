"""The manager's books of blocks: which are alive, which are resident, and when they die.

A block lives while a TensorRef views it (Note [Blocks and coherence] in ``core/blocks.py``).
A TensorRef's death reaches the books through a weakref callback, which may run anywhere
(in the middle of an op, on an autograd thread): it is queued, and applied at once when no
op is in flight, so that a dead tensor's memory comes back when plain torch would free it,
not at the next op (allocations then reuse it instead of taking fresh pages, and on an
accelerator the budget sees it).
"""

from __future__ import annotations

import functools
import time
import weakref
from typing import Dict, List, Optional

import torch

from ..core.blocks import Block
from .streams import Pending


class Books:
    """The live blocks and the resident ones; blocks' births and deaths.

    Attributes:
        blocks: id -> every live block.
        resident: id -> the blocks with a valid device copy.
        by_host_storage: host storage key -> the block a plain tensor's bytes were adopted as.
        dead: blocks whose TensorRefs died, not yet applied (``drain``).
        external: live blocks whose host bytes are shared outside torch (Note [External bytes]).
        host_only: live host-only blocks (CPU tensors of the program).
    """


    def __init__(self, manager) -> None:
        self.m = manager
        self.blocks: Dict[int, Block] = {}
        self.resident: Dict[int, Block] = {}
        self.by_host_storage: Dict[int, Block] = {}
        self.dead: List[Block] = []
        self.external: int = 0
        self.host_only: int = 0
        #: times a TensorRef was given another block or a block another size (what sizes a
        #: module's tensors is read again after)
        self.changes: int = 0

    def new_block(self, nbytes: int) -> Block:
        """A new live block of ``nbytes`` (no copy yet)."""
        m = self.m
        if m.unresolved:
            m.resolve_device()
        block = Block(nbytes)
        # (a partial, not a lambda: one Python frame less for every TensorRef that dies)
        block.on_ref_dead = functools.partial(self.ref_died, block)
        self.blocks[block.id] = block
        return block

    def ref_died(self, block: Block, _weakref: Optional[weakref.ref] = None) -> None:
        """Weakref callback: a TensorRef viewing ``block`` died (queued, applied when the lock is free)."""
        m = self.m
        if m.exiting:
            return  # (the process ends: its memory goes with it, and the modules the release uses may be gone)
        self.dead.append(block)
        lock = m.lock
        if lock._is_owned() or not lock.acquire(blocking=False):
            return  # mid-op on this thread, or another thread holds the lock: the next op drains
        try:
            self.drain()
        finally:
            lock.release()

    def drain(self) -> None:
        """Apply the TensorRef deaths the weakref callbacks queued; release dead blocks."""
        dead = self.dead
        while dead:
            block = dead.pop()
            block.refs -= 1
            if block.refs == 0 and block.alive:
                self.release(block)

    def release(self, block: Block) -> None:
        """``block`` has no TensorRef left: its copies go."""
        m = self.m
        if block.host_only:
            self.host_only -= 1
        if block.external:
            self.external -= 1  # (a late unmark_external sees the block dead)
        if block.dev is not None:
            del self.resident[block.id]
            m.accounting.remove(block.dev_bytes)
            if m.trace is not None:
                m.trace.resized(time.perf_counter_ns(), m.accounting.resident)
        if block.host is not None:
            m.residency.forget_host(block)
            block.host = None
        if block.dev is not None:
            m.residency.drop_dev(block)
        if block.disk is not None or block.spilling is not None:
            m.host_tier.disk_stale(block)
        block.left_device()
        block.alive = False
        block.on_ref_dead = None
        del self.blocks[block.id]
        m.strategy.on_release(block)

    def mark_external(self, block: Block) -> None:
        """One more holder of ``block``'s host bytes outside the manager (Note [External bytes])."""
        if not block.external and block.alive:
            self.external += 1
        block.external += 1

    def unmark_external(self, block: Block) -> None:
        """Undo one ``mark_external`` (counters only: it may run from a weakref callback)."""
        block.external -= 1
        if not block.external and block.alive:
            self.external -= 1

    def made_resident(self, block: Block, storage: torch.UntypedStorage, pending: Optional[Pending] = None,
                      counted: Optional[int] = None) -> None:
        """``block``'s device copy is ``storage`` now (being copied in where ``pending``),
        counted against the budget at what the device's allocator counts for it, or at
        ``counted`` (a range of a group's buffer, counted with it: Note [Region groups])."""
        if pending is None:
            block.set_dev(storage)
        else:
            block.arriving(storage, pending)
        self.resident[block.id] = block
        if counted is not None:
            block.dev_bytes = counted
            return
        m = self.m
        backend = m.backend
        block.dev_bytes = backend.dev_bytes(storage)
        m.accounting.add(block.dev_bytes, backend.block_bytes(block.nbytes))

    def left_device(self, block: Block) -> None:
        """``block``'s device copy is no longer counted (the caller drops the copy)."""
        del self.resident[block.id]
        self.m.accounting.remove(block.dev_bytes)

    def host_written(self, block: Block) -> None:
        """An op on the host wrote ``block``'s host copy: a device copy is stale now."""
        m = self.m
        m.host_tier.disk_stale(block)
        if block.dev is not None and not block.host_only:
            block.rewritten_on_host()
            m.residency.drop_dev(block)
            self.left_device(block)

    def set_host_only(self, block: Block, storage: torch.UntypedStorage) -> None:
        """``storage`` is ``block``'s host copy, and the one ops run on if it is host-only (or pass-through)."""
        block.set_host(storage, True)
        if self.m.backend.passthrough or block.host_only:
            block.dev_key = storage._cdata  # (and not paged: not counted against the host budget)
        else:
            self.m.host_tier.host_gained(block)

    def all_resident(self) -> bool:
        """Whether every live block that can be resident (not host-only) is."""
        return len(self.resident) == len(self.blocks) - self.host_only

    def pinned_bytes(self) -> int:
        """Device bytes of the resident blocks that are pinned there."""
        return sum(b.dev_bytes for b in self.resident.values() if b.pins)
