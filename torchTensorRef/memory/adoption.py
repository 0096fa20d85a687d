"""Bringing tensors under management: plain tensors, deep copies, rebinding ``p.data``."""

from __future__ import annotations

import copy
import weakref
from typing import Optional

import torch

from ..core import raw
from ..core.blocks import Block
from ..core.tensor_ref import TensorRef, make_ref, user_attributes, with_math_bits

#: host copies of at least this size are moved into pinned memory when a tensor is adopted
PIN_AT_ADOPTION_BYTES = 4096


class Adoption:
    """The ``TensorsManager`` methods that make TensorRefs over existing bytes."""

    def manage_tensor(self, t: torch.Tensor, requires_grad: Optional[bool] = None, *, host_only: bool = False,
                      shared: bool = True):
        """A TensorRef over plain tensor ``t``'s bytes (shared, not copied).

        A ``Parameter`` stays a ``Parameter``; a TensorRef is returned as is. Tensors on
        another accelerator than the manager's are copied to host memory first.

        Args:
            host_only: a CPU tensor that stays one (made with ``device="cpu"``).
            shared: someone else still holds ``t`` (``TensorRef(t)``): its bytes stay where
                they are (Note [External bytes]). ``False`` for tensors torchTensorRef made.

        Raises:
            ValueError: for tensors that cannot be managed (meta, sparse, other subclasses).
        """
        if isinstance(t, TensorRef):
            return t
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(f"only plain torch.Tensor can be managed (got: {type(t).__name__})")
        if t.layout is not torch.strided or t.device.type == "meta":
            raise ValueError(
                f"only strided tensors with data can be managed (got: layout={t.layout}, device={t.device})"
            )
        rg = t.requires_grad if requires_grad is None else requires_grad
        ref = self._wrap_plain(t.detach(), rg, host_only, shared)
        if isinstance(t, torch.nn.Parameter):
            ref = torch.nn.Parameter(ref, requires_grad=rg)
        if t.__dict__:
            ref.__dict__.update(t.__dict__)  # attributes users set (transformers marks parameters)
        return ref

    def take_over(self, refs) -> int:
        """Blocks of ``refs`` whose plain tensors nobody holds any more become the manager's
        own: their host copies may be pinned, re-homed and spilled from now on (while
        someone holds the plain tensor, its bytes stay where they are: Note [External
        bytes]). ``manage(module)`` calls it once the module's plain tensors are replaced.
        Returns how many blocks it took over."""
        taken = 0
        with self._lock:
            for ref in refs:
                block = getattr(ref, "_tr_block", None)
                if block is None or not block.host_shared or not block.alive or block.host is None:
                    continue
                if not self._host_copy_is_ours(block):
                    continue
                block.host_shared = False
                taken += 1
                if not block.host_only and not block.external and block.nbytes >= PIN_AT_ADOPTION_BYTES:
                    self._pin_host(block)
        return taken

    def _wrap_plain(self, t: torch.Tensor, requires_grad: bool, host_only: bool = False,
                    shared: bool = True) -> TensorRef:
        with self._lock:
            self._drain()
            if self._unresolved:
                self._resolve_device()
            backend = self._backend
            on_device = (not backend.passthrough and not backend.simulated and not host_only
                         and t.device == backend.compute)
            if not on_device and t.device.type != "cpu":
                t = t.to("cpu")
            storage = t.untyped_storage()
            key = storage._cdata
            block = self._by_host_storage.get(key) if not on_device else None
            if block is None:
                block = self._new_block(storage.nbytes())
                if on_device:
                    # Made on the device outside the manager (a GPU tensor given to it): it
                    # counts from now on, and the budget is restored by evicting others.
                    block.set_dev(storage)
                    block.explicit = True  # (the program put it there: Note [Default-device tensors])
                    self._resident[block.id] = block
                    self._add_device_bytes(self._backend.block_bytes(block.nbytes))
                    block.last_use = self._op_count
                    self._make_room(0, (block.id,), "adopting a device tensor")
                else:
                    block.host_only = host_only
                    self._host_only_blocks += block.host_only
                    block.host_shared = shared
                    if not host_only:
                        self._make_host_room(block.nbytes, (), "a new tensor")  # (counted within the budget)
                    self._set_host_only(block, storage)
                    self._by_host_storage[key] = block
                    if not shared and not block.host_only and block.nbytes >= PIN_AT_ADOPTION_BYTES:
                        self._pin_host(block)  # once, now, rather than on the way to the device
                self._strategy.on_adopt(block)
            # t views the block's storage unless an existing block's current copy is elsewhere
            current = block.dev if block.dev is not None else block.host
            view = t if current is storage else compute_view_of(block, t)
            return make_ref(block, view, self._declared, requires_grad=requires_grad)

    def clone_ref(self, ref: TensorRef, memo: dict):
        """A deep copy of leaf ``ref`` with its own block (``copy.deepcopy``)."""
        with self._lock:
            block = ref._tr_block
            key = ("torchTensorRef.block", block.id)
            new_block = memo.get(key)
            if new_block is None:
                self.sync_host(block)
                self._make_host_room(block.nbytes, (block.id,), "a copy of a tensor")
                self._host_watch.reserve_bytes(block.nbytes)
                storage = raw.flat_bytes(block.host).clone().untyped_storage()
                new_block = self._new_block(block.nbytes)
                self._set_host_only(new_block, storage)
                memo[key] = new_block
            else:
                self.sync_host(new_block)  # (it may have left host memory since)
            view = with_math_bits(raw.typed_view(new_block.host, ref.dtype, ref.size(), ref.stride(),
                                                 ref.storage_offset()), ref)
            new = make_ref(new_block, view, self._declared, requires_grad=ref.requires_grad)
        if getattr(ref, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=ref.requires_grad)
        if ref.grad is not None:
            new.grad = copy.deepcopy(ref.grad, memo)
        for name, value in user_attributes(ref).items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def rebind(self, ref: TensorRef, new: TensorRef) -> None:
        """Point ``ref`` at ``new``'s block (after ``ref.data = new``)."""
        with self._lock:
            old = ref._tr_block
            block = new._tr_block
            # Count the new view first: ``p.data = p`` (Module.to on a tied parameter that
            # already has the dtype) rebinds a block to itself and must not release it.
            block.refs += 1
            # The old liveness weakref goes, and its callback with it: the old block's list
            # of views holds it too, and kept there it would count this tensor's death
            # against the old block a second time (releasing it under its other views).
            old_wr, ref._tr_wr = ref._tr_wr, None
            old.views = [v for v in old.views if v is not old_wr]
            old.refs -= 1
            if old.refs == 0 and old.alive:
                self._release(old)
            ref._tr_block = block
            # ``new``'s view as it is, made afresh at the next use where stale: a block whose
            # only copy is a checkpoint's range (``from_pretrained``, then ``model.to(device)``)
            # has no copy to view yet.
            ref._tr_view, ref._tr_gen = new._tr_view, new._tr_gen
            ref._tr_wr = wr = weakref.ref(ref, block.on_ref_dead)
            block.views.append(wr)


def compute_view_of(block: Block, t: torch.Tensor) -> torch.Tensor:
    """``t``'s geometry on ``block``'s current copy."""
    storage = block.dev if block.dev is not None else block.host
    return with_math_bits(raw.typed_view(storage, t.dtype, t.size(), t.stride(), t.storage_offset()), t)
