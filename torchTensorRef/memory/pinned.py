"""Pinned (page-locked) host memory: what lets copies to and from the accelerator be asynchronous.

A copy between the accelerator and pageable host memory makes the host wait; from pinned
memory it does not. Host copies of blocks are therefore allocated pinned, up to
``limit`` bytes (``tensorsManager.pinned_limit``): page-locked memory cannot be swapped,
and too much of it starves the rest of the system. Beyond the limit host copies are
pageable and their copies synchronous (``stats()["host_syncs"]`` counts them).

A fetch from a pageable host copy of at most ``STAGE_MAX`` bytes is staged through a
transient pinned buffer (:meth:`PinnedMemory.staged`): the host copies the bytes, and the
copy to the device is asynchronous. (From pageable memory, CUDA first waits for the stream:
everything queued before the copy.)

Accounting follows PyTorch's pinned allocator, which rounds every allocation up to a power
of two; only the buffers allocated here are counted (a tensor the user pinned is not).
On ``"sim"`` (no CUDA) pinning is emulated: the buffers are ordinary, and this registry is
what says they are pinned, with the same limit and accounting; a storage that aliases one of
them (a piece of a big host tensor an op runs in slices) is pinned too, found by its address
as CUDA finds page-locked bytes.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional

import psutil
import torch

from ..core import raw
from .sim.pool import BufferPool


#: the largest fetch staged through a transient pinned buffer: small tensors that live in
#: pageable memory (a mask, a model's plain buffer shared with an attribute), whose waits cost
#: far more than their copies; a larger one is pinned once it is paged, if it can move
STAGE_MAX = 16 << 20


def default_limit() -> int:
    """A quarter of the machine's RAM."""
    return psutil.virtual_memory().total // 4


def rounded(nbytes: int) -> int:
    """Bytes the pinned allocator takes for ``nbytes`` (the next power of two)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


class PinnedMemory:
    """Allocates pinned host buffers within a limit and knows which storages are pinned.

    Args:
        emulated: pin nothing for real (``"sim"``, or a machine without CUDA).
        limit: most bytes pinned at once (rounded sizes); ``None``: :func:`default_limit`.
    """

    def __init__(self, emulated: bool, limit: Optional[int] = None):
        self.emulated = emulated
        self.limit = default_limit() if limit is None else limit
        self.used = 0
        #: pins PyTorch refused (locked-memory limits, no pinned allocator for the device):
        #: their host copies stay pageable, their copies make the host wait, and no prefetch
        #: brings them in; counted, since nothing else says so
        self.failed = 0
        self._sizes: Dict[int, int] = {}  # storage key -> rounded bytes, for the buffers allocated here
        #: emulated: (start, end) addresses of those buffers, sorted, so that a storage aliasing
        #: one (a piece of a big host tensor, from dlpack) is pinned too, as CUDA finds it
        self._spans: List[tuple] = []
        #: emulated: freed buffers kept for reuse (PyTorch's pinned allocator keeps its own)
        self.kept = BufferPool(0)

    def allocate(self, nbytes: int) -> Optional[torch.Tensor]:
        """A flat uint8 pinned buffer of ``nbytes``, or ``None`` past the limit (or if pinning fails)."""
        size = rounded(nbytes)
        if self.used + size > self.limit:
            return None
        if self.emulated:
            buffer = self.kept.take(nbytes)
            if buffer is None:
                buffer = raw.empty(nbytes, dtype=raw.UINT8)
        else:
            try:
                buffer = raw.empty(nbytes, dtype=raw.UINT8, pin_memory=True)
            except RuntimeError:
                self.failed += 1
                return None  # (pageable memory still works)
        storage = buffer.untyped_storage()
        self._sizes[storage._cdata] = size
        if self.emulated:
            start = storage.data_ptr()
            bisect.insort(self._spans, (start, start + storage.nbytes()))
        self.used += size
        return buffer

    def staged(self, src: torch.Tensor) -> Optional[torch.Tensor]:
        """A pinned copy of the flat bytes ``src`` for one copy to the device, or ``None`` (larger
        than ``STAGE_MAX``, past the limit, or pinning fails). Not counted: it lives only until
        its copy ends (PyTorch's pinned allocator keeps it from reuse until then)."""
        nbytes = src.numel()
        if nbytes > STAGE_MAX or self.used + rounded(nbytes) > self.limit:
            return None
        try:
            buffer = raw.empty(nbytes, dtype=raw.UINT8, pin_memory=not self.emulated)
        except RuntimeError:
            self.failed += 1
            return None
        return buffer.copy_(src)

    def is_pinned(self, storage: torch.UntypedStorage) -> bool:
        if storage._cdata in self._sizes:
            return True
        if self.emulated:
            spans = self._spans
            if not spans:
                return False
            start = storage.data_ptr()
            i = bisect.bisect_right(spans, (start, 1 << 64)) - 1
            return i >= 0 and start + storage.nbytes() <= spans[i][1] and storage.nbytes() > 0
        return storage.device.type == "cpu" and storage.is_pinned()

    def freed(self, storage: torch.UntypedStorage, keep: int = 0) -> None:
        """``storage`` is no longer used by a block (it is freed when its last view dies);
        emulated, it may be kept for reuse, up to ``keep`` bytes kept."""
        size = self._sizes.pop(storage._cdata, None)
        if size is not None:
            self.used -= size
            if self.emulated:
                start = storage.data_ptr()
                i = bisect.bisect_left(self._spans, (start, start + storage.nbytes()))
                if i < len(self._spans) and self._spans[i][0] == start:
                    del self._spans[i]
                self.kept.limit = keep
                self.kept.give(storage)
