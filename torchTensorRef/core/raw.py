"""Unpatched torch constructors, for torchTensorRef's own allocations.

Imported before :mod:`.patching` wraps torch, so these names always refer to plain torch.
"""

from __future__ import annotations

from typing import Optional, Sequence, TypeVar, Union

import torch

_F = TypeVar("_F")


def _unwrapped(fn: _F) -> _F:
    # If torch was already patched (for instance by a reload), reach the original.
    return getattr(fn, "__wrapped__", fn)


empty = _unwrapped(torch.empty)
empty_strided = _unwrapped(torch.empty_strided)

UINT8 = torch.uint8

#: ``Tensor.data``'s descriptor, for a subclass that overrides ``data`` (the stubs declare
#: ``data`` a plain attribute, without ``__get__`` and ``__set__``)
TENSOR_DATA = vars(torch._C.TensorBase)["data"]


def flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all of ``storage``'s bytes (no copy).

    Never an inference tensor, even when made under ``torch.inference_mode()``: copies into
    it (a write-back) may finish outside inference mode.
    """
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return empty(0, dtype=UINT8, device=storage.device).set_(storage)
    return empty(0, dtype=UINT8, device=storage.device).set_(storage)


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_users(storage: torch.UntypedStorage) -> Optional[int]:
    """How many tensors and storage objects use ``storage``'s bytes (PyTorch's own count),
    or ``None`` where this torch cannot say."""
    return _use_count(storage._cdata) if _use_count is not None else None


def typed_view(storage: torch.UntypedStorage, dtype: torch.dtype, size: Sequence[int], stride: Sequence[int],
               offset: Union[int, torch.SymInt]) -> torch.Tensor:
    """A plain tensor of ``dtype`` viewing ``storage`` with the given geometry (no copy)."""
    return empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def storage_bytes(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of the smallest storage a tensor of this geometry needs (from offset 0)."""
    if any(s == 0 for s in size):
        return 0
    extent = 1 + sum((n - 1) * st for n, st in zip(size, stride))
    return extent * torch.empty((), dtype=dtype, device="meta").element_size()


def alias(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor over exactly the bytes of contiguous ``t``: its storage is that range
    of ``t``'s (from dlpack, so it keeps ``t``'s storage alive and takes no bytes of its own)."""
    from_dlpack = _unwrapped(torch.from_dlpack)  # (creation is patched)
    return from_dlpack(t.detach())


def alias_range(storage: torch.UntypedStorage, start: int, stop: int) -> torch.UntypedStorage:
    """A storage over bytes ``start:stop`` of ``storage`` (:func:`alias`)."""
    return alias(flat_bytes(storage)[start:stop]).untyped_storage()


_from_pointer = torch._C._construct_storage_from_data_pointer


def borrowed_range(storage: torch.UntypedStorage, start: int, stop: int) -> torch.UntypedStorage:
    """A storage over bytes ``start:stop`` of ``storage`` that does not keep it alive: its
    caller keeps ``storage`` while the range, or any view of it, is used (PyTorch counts
    the range's users: ``storage_users``). A fraction of :func:`alias_range`'s cost."""
    return _from_pointer(storage.data_ptr() + start, storage.device, stop - start)  # type: ignore[return-value]


_SET_STORAGE = torch.ops.aten.set_.source_Storage_storage_offset
_META_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


def set_geometry(wrapper: torch.Tensor, like: torch.Tensor) -> None:
    """Give the wrapper subclass tensor ``wrapper`` the sizes, strides and offset of ``like``.

    A wrapper has no bytes, only metadata: it is set with the meta kernel, which any
    declared device accepts (the sim device has no kernel of its own for ``set_``).
    """
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        _SET_STORAGE.redispatch(_META_KEYS, wrapper, torch._C.TensorBase.untyped_storage(wrapper),
                                like.storage_offset(), like.shape, like.stride())
