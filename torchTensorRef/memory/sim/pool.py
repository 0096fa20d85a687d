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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from ...core import raw

#: buffers smaller than this are not kept
MIN_BYTES = 1 << 20


class BufferPool:
    """Free buffers by size (``take`` / ``give``), at most ``limit`` bytes of them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.cached_bytes = 0
        self.hits = 0
        self._free: "OrderedDict[int, torch.UntypedStorage]" = OrderedDict()  # (cdata -> storage), oldest first
        self._by_size: dict = {}  # nbytes -> [cdata, ...]

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
