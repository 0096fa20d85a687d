"""Unpatched torch constructors, for torchTensorRef's own allocations.

Imported before :mod:`.patching` wraps torch, so these names always refer to plain torch.
"""

from __future__ import annotations

import torch


def _unwrapped(fn):
    # If torch was already patched (for instance by a reload), reach the original.
    return getattr(fn, "__wrapped__", fn)


empty = _unwrapped(torch.empty)
empty_strided = _unwrapped(torch.empty_strided)

UINT8 = torch.uint8


def flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``'s bytes (no copy)."""
    return empty(0, dtype=UINT8, device=storage.device).set_(storage)


def typed_view(storage: torch.UntypedStorage, dtype, size, stride, offset) -> torch.Tensor:
    """A plain tensor of ``dtype`` viewing ``storage`` with the given geometry (no copy)."""
    return empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
