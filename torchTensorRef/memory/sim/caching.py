"""How PyTorch's CUDA caching allocator places allocations, emulated for ``"sim"``.

Note [Allocator slack]: ``torch.cuda.memory_allocated`` counts each allocation at the size
of the block the caching allocator gave it, and that block can be larger than the request
rounded to 512 bytes. The allocator serves a request from the smallest cached free block of
the same stream and pool that fits, and splits off the rest only where the rest is worth
keeping: in the large pool (requests over 1 MiB) only a rest of more than 1 MiB. So a 2 MiB
request served from a free 2.9 MiB block is counted as 2.9 MiB until it is freed. Which
blocks are free depends on everything allocated and freed before (freed neighbours merge), so
the slack cannot be known from the request's size alone: on a GPU, a training step whose
blocks come and go at many sizes was measured above the budget the manager's own count held.

``CachingAllocator`` replays the allocator's choices on sizes alone (no memory behind the
addresses): segments made at its sizes, a best fit per stream and pool, its rules for
splitting, and frees that merge with free neighbours. The simulated device counts its
allocations through it when it emulates CUDA's allocator (``tensorsManager.sim_rounding``),
so that the slack shows on a CPU as it does on a GPU.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Tuple

# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), default settings
MIN_BLOCK = 512  # kMinBlockSize: every allocation is rounded up to a multiple of it
SMALL_SIZE = 2**20  # kSmallSize: larger requests come from the large pool
SMALL_BUFFER = 2 * 2**20  # kSmallBuffer: the segment a small request makes
LARGE_BUFFER = 20 * 2**20  # kLargeBuffer: the segment a request under kMinLargeAlloc makes
MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc: from here a segment is the request...
ROUND_LARGE = 2 * 2**20  # ...rounded up to kRoundLarge


def round_size(nbytes: int) -> int:
    """The size a request of ``nbytes`` asks the pools for."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """The segment a request of ``size`` (rounded) makes when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class Block:
    """A piece of a segment: allocated, or free in its pool."""

    __slots__ = ("ptr", "size", "stream", "small", "prev", "next", "allocated")

    def __init__(self, ptr: int, size: int, stream: object, small: bool):
        self.ptr, self.size, self.stream, self.small = ptr, size, stream, small
        self.prev: Optional[Block] = None
        self.next: Optional[Block] = None
        self.allocated = False


class CachingAllocator:
    """The allocator's placement (Note [Allocator slack]): ``malloc`` gives a ``Block``
    whose ``size`` is what ``memory_allocated`` counts for it, ``free`` gives it back.

    Attributes:
        allocated: bytes of allocated blocks (``memory_allocated``).
        reserved: bytes of segments (``memory_reserved``).
    """

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self._next_ptr = 0
        # (stream, small) -> free blocks sorted by (size, ptr), and ptr -> Block
        self._free: Dict[Tuple[object, bool], List[Tuple[int, int]]] = {}
        self._blocks: Dict[int, Block] = {}

    def malloc(self, nbytes: int, stream: object = None) -> Block:
        """Place a request of ``nbytes`` made on ``stream`` (``None``: the default stream)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(stream, small, size)
        if block is None:
            block = Block(self._next_ptr, segment_size(size), stream, small)
            self._next_ptr += block.size
            self.reserved += block.size
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            tail = Block(block.ptr + size, rest, stream, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._insert(tail)
        block.allocated = True
        self.allocated += block.size
        return block

    def free(self, block: Block) -> None:
        """``block`` is freed: merged with its free neighbours, cached in its pool."""
        if not block.allocated:
            return
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove(neighbour)
                if neighbour is block.prev:
                    block.ptr, block.prev = neighbour.ptr, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        self._insert(block)

    def empty_cache(self) -> None:
        """Release every segment that is wholly free (``torch.cuda.empty_cache``)."""
        for key, entries in self._free.items():
            kept = []
            for size, ptr in entries:
                block = self._blocks[ptr]
                if block.prev is None and block.next is None:
                    del self._blocks[ptr]
                    self.reserved -= size
                else:
                    kept.append((size, ptr))
            self._free[key] = kept

    def _best_fit(self, stream: object, small: bool, size: int) -> Optional[Block]:
        entries = self._free.get((stream, small))
        if not entries:
            return None
        i = bisect.bisect_left(entries, (size, -1))
        if i == len(entries):
            return None
        _, ptr = entries.pop(i)
        return self._blocks.pop(ptr)

    def _insert(self, block: Block) -> None:
        self._blocks[block.ptr] = block
        bisect.insort(self._free.setdefault((block.stream, block.small), []), (block.size, block.ptr))

    def _remove(self, block: Block) -> None:
        entries = self._free[(block.stream, block.small)]
        del entries[bisect.bisect_left(entries, (block.size, block.ptr))]
        del self._blocks[block.ptr]
