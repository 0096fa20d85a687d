"""The simulated device's caching allocator: freed device buffers kept for reuse.

A GPU program rarely pays for memory: PyTorch's CUDA allocator keeps the blocks it frees
and hands them to the next allocation of a fitting size, so dropping a device copy and
fetching another costs the host nothing. The simulated device lives in host memory, where
freeing a large buffer unmaps it and a fresh one faults its pages in again: milliseconds
per buffer of tens of MiB, on the host thread. Without a cache those milliseconds would be
counted as our host time, on ``"sim"`` only, and a prediction from a ``"sim"`` trace
(``timeline.py``) would carry them to a GPU that never pays them.

``BufferPool`` keeps the device buffers the manager drops (evictions, released blocks),
keyed by their exact size, and gives them back to the next allocation of that size. The
emulated pinned memory of ``"sim"`` keeps the host copies it frees the same way, as
PyTorch's pinned host allocator does (``pinned.py``). Only large buffers are kept (small
ones are the C allocator's fast case anyway), at most ``limit`` bytes, the oldest dropped
first. A buffer is handed out again only when no tensor uses its bytes any more: a view
somebody holds, or a copy still queued on a stream, keeps it back (PyTorch counts the users
of a storage).

``Allocated`` counts what the device has allocated, as ``torch.cuda.memory_allocated``
does (Note [Allocated bytes on sim]).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch

from ...core import raw
from .caching import Block, CachingAllocator

#: buffers smaller than this are not kept
MIN_BYTES = 1 << 20


class BufferPool:
    """Free buffers by size (``take`` / ``give``), at most ``limit`` bytes of them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.cached_bytes = 0
        self.hits = 0
        self._free: "OrderedDict[int, torch.UntypedStorage]" = OrderedDict()  # (cdata -> storage), oldest first
        self._by_size: Dict[int, List[int]] = {}  # nbytes -> [cdata, ...]

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """A kept buffer of exactly ``nbytes`` as a flat uint8 tensor, or ``None``."""
        for key in reversed(self._by_size.get(nbytes, ())):  # (the newest first: its pages are warm)
            if raw.storage_users(self._free[key]) == 1:  # (else a tensor still uses its bytes)
                self.hits += 1
                return raw.empty(0, dtype=raw.UINT8).set_(self._pop(key))
        return None

    def give(self, storage: torch.UntypedStorage) -> bool:
        """Keep ``storage`` for reuse if it is large; whether kept.

        A tensor may still use its bytes (a view being freed, a queued copy): the buffer is
        handed out only once none does (``take``).
        """
        nbytes = storage.nbytes()
        if nbytes < MIN_BYTES or nbytes > self.limit or raw.storage_users(storage) is None:
            return False
        key = storage._cdata
        self._free[key] = storage
        self._by_size.setdefault(nbytes, []).append(key)
        self.cached_bytes += nbytes
        while self.cached_bytes > self.limit:
            self._pop(next(iter(self._free)))
        return True

    def clear(self) -> None:
        """Give every kept buffer back to the system."""
        self._free.clear()
        self._by_size.clear()
        self.cached_bytes = 0

    def _pop(self, key: int) -> torch.UntypedStorage:
        storage = self._free.pop(key)
        nbytes = storage.nbytes()
        keys = self._by_size[nbytes]
        keys.remove(key)
        if not keys:
            del self._by_size[nbytes]
        self.cached_bytes -= nbytes
        return storage


# Note [Allocated bytes on sim]: on CUDA the manager reads what else the device holds as
# ``memory_allocated() - its blocks' bytes`` (Note [Budget on CUDA]), and that reading counts
# the program's own plain CUDA tensors and every allocation at the size the caching
# allocator gave it (rounded up to 512 bytes). "sim" counts the same way, so that CI shows
# what a GPU would: every live storage of the device counts once, at its rounded size, as
# long as something holds it (a block's device copy, a SimTensor, a view of either), and
# the ``BufferPool``'s kept buffers do not count (CUDA's cache is not "allocated").


class _Entry(weakref.ref):
    """A live allocation: a weakref to its storage, with its key and counted bytes."""

    __slots__ = ("key", "nbytes", "request", "block")
    key: Optional[int]  # (``None`` once forgotten: its death is not counted again)
    nbytes: int
    request: int  # (the storage's own size)
    block: Optional[Block]  # (its place in ``Allocated.placement``, where that is emulated)


class Allocated:
    """The simulated device's live allocations (``total()``: the bytes they take)."""

    def __init__(self, block_bytes: Callable[[int], int] = lambda n: n):
        #: the device bytes an allocation of n bytes takes (the backend sets CUDA's rounding)
        self.block_bytes = block_bytes
        #: where set, allocations are counted at the blocks CUDA's caching allocator would
        #: give them, slack included (Note [Allocator slack])
        self.placement: Optional[CachingAllocator] = None
        self._live: Dict[int, _Entry] = {}  # storage._cdata -> _Entry
        self._total = 0
        self._peak = 0  # the most ``_total`` has been since ``reset_peak()``
        #: cdata -> storage: kept by the pool while a tensor still uses it
        self._in_use: Dict[int, torch.UntypedStorage] = {}
        self._dead: List[_Entry] = []  # entries whose storage died (appended by the weakref callback)
        self._lock = threading.Lock()

    def track(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (once, at its current size) while it lives."""
        key = storage._cdata
        request = storage.nbytes()
        entry = self._live.get(key)
        if self._in_use and key in self._in_use:
            with self._lock:
                self._in_use.pop(key, None)  # (handed out again: counted as it is)
        if entry is not None and entry() is not None:
            if entry.request != request:  # (resized in place: a new allocation)
                with self._lock:
                    self._total -= entry.nbytes
                    self._place(entry, request)
            return  # (the common case for a SimTensor: a view of a counted storage)
        entry = _Entry(storage, self._dead.append)
        entry.key, entry.block = key, None
        with self._lock:
            self._live[key] = entry  # (a dead entry at this address: its storage is gone)
            self._place(entry, request)
            if self._total > self._peak:
                self._drain()  # (deaths not counted yet are no part of a peak)
                if self._total > self._peak:
                    self._peak = self._total

    def alias(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage``, a range of a counted allocation, at no bytes while it lives: a
        SimTensor over it is not a new allocation (on CUDA it is none either)."""
        entry = _Entry(storage, self._dead.append)
        entry.key, entry.block, entry.nbytes, entry.request = storage._cdata, None, 0, storage.nbytes()
        with self._lock:
            self._live[storage._cdata] = entry

    def _place(self, entry: _Entry, request: int) -> None:
        # (the lock held) count ``entry`` at ``request`` bytes, as the device's allocator does
        placement = self.placement
        if placement is not None:
            if entry.block is not None:
                placement.free(entry.block)
            entry.block = placement.malloc(request) if request else None
            entry.nbytes = 0 if entry.block is None else entry.block.size
        else:
            entry.block = None
            entry.nbytes = self.block_bytes(request)
        entry.request = request
        self._total += entry.nbytes

    def counted(self, storage: torch.UntypedStorage) -> int:
        """The bytes ``storage`` is counted at (``block_bytes`` of its size where it is not
        tracked)."""
        entry = self._live.get(storage._cdata)
        if entry is None or entry() is None:
            return self.block_bytes(storage.nbytes())
        return entry.nbytes

    def untrack(self, storage: torch.UntypedStorage) -> None:
        """Stop counting ``storage`` (kept by the pool for reuse) once no tensor uses its
        bytes, as CUDA counts a buffer until its last tensor goes (one that a copy still in
        flight uses was counted free already: ``freed``)."""
        with self._lock:
            users = raw.storage_users(storage)
            if users is not None and users > 1:
                self._in_use[storage._cdata] = storage
                return
            self._forget(storage._cdata)

    def freed(self, storage: torch.UntypedStorage) -> None:
        """Stop counting ``storage`` now: freed while a copy on another stream still uses it,
        which CUDA's allocator counts free at once (Note [Stream-ordered frees] in
        ``accounting.py``)."""
        with self._lock:
            key = storage._cdata
            self._in_use.pop(key, None)
            self._forget(key)

    def _forget(self, key: int) -> None:
        # (the lock held)
        entry = self._live.pop(key, None)
        if entry is not None:
            self._release(entry)
            entry.key = None  # (its death, if queued, is not counted again)

    def _release(self, entry: _Entry) -> None:
        # (the lock held)
        self._total -= entry.nbytes
        if entry.block is not None and self.placement is not None:
            self.placement.free(entry.block)
            entry.block = None

    def total(self) -> int:
        """Bytes of the live allocations."""
        with self._lock:
            self._drain()
            return self._total

    def peak(self) -> int:
        """The most bytes live at once since ``reset_peak()`` (``torch.cuda.max_memory_allocated``'s count)."""
        with self._lock:
            return self._peak

    def reset_peak(self) -> None:
        """The peak restarts from the bytes live now."""
        with self._lock:
            self._drain()
            self._peak = self._total

    def _drain(self) -> None:
        # (the lock held) forget the storages that died, and the kept ones no tensor uses now
        if self._in_use:
            for key, storage in list(self._in_use.items()):
                if raw.storage_users(storage) == 1:
                    del self._in_use[key]
                    self._forget(key)
        dead = self._dead
        while dead:
            entry = dead.pop()
            if entry.key is None:
                continue
            self._release(entry)
            if self._live.get(entry.key) is entry:
                del self._live[entry.key]


#: the simulated device's allocations (one device: plain SimTensors and blocks share it)
ALLOCATED = Allocated()
