"""Bringing tensors under management: plain tensors, deep copies, rebinding ``p.data``."""

from __future__ import annotations

import copy
from typing import Iterable, Optional, cast

import torch

from ..core import raw
from ..core.blocks import Block
from ..core.tensor_ref import TensorRef, block_of, make_ref, rebind_view, user_attributes, with_math_bits
from .host_tier import host_copy_is_ours

#: host copies of at least this size are moved into pinned memory when a tensor is adopted
PIN_AT_ADOPTION_BYTES = 4096


class Adoption:
    """TensorRefs made over existing bytes: plain tensors, deep copies, rebinding ``p.data``."""


    def __init__(self, manager) -> None:
        self.m = manager

    def manage_tensor(self, t: torch.Tensor, requires_grad: Optional[bool] = None, *, host_only: bool = False,
                      shared: bool = True) -> TensorRef:
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
            # (a Parameter of a tensor subclass is an instance of that subclass, marked
            # ``_is_param``; the stubs say Parameter)
            ref = cast(TensorRef, torch.nn.Parameter(ref, requires_grad=rg))
        if t.__dict__:
            ref.__dict__.update(t.__dict__)  # attributes users set (transformers marks parameters)
        return ref

    def take_over(self, refs: Iterable[torch.Tensor]) -> int:
        """Blocks of ``refs`` whose plain tensors nobody holds any more become the manager's
        own: their host copies may be pinned, re-homed and spilled from now on (while
        someone holds the plain tensor, its bytes stay where they are: Note [External
        bytes]). ``manage(module)`` calls it once the module's plain tensors are replaced.
        Returns how many blocks it took over."""
        taken = 0
        with self.m.lock:
            for ref in refs:
                block = block_of(ref) if isinstance(ref, TensorRef) else None
                if block is None or not block.host_shared or not block.alive or block.host is None:
                    continue
                if not host_copy_is_ours(block):
                    continue
                block.host_shared = False
                taken += 1
                if not block.host_only and not block.external and block.nbytes >= PIN_AT_ADOPTION_BYTES:
                    self.m.host_tier.pin_host(block)
        return taken

    def _wrap_plain(self, t: torch.Tensor, requires_grad: bool, host_only: bool = False,
                    shared: bool = True) -> TensorRef:
        m = self.m
        with m.lock:
            m.drain()
            if m.unresolved:
                m.resolve_device()
            backend = m.backend
            on_device = (not backend.passthrough and not backend.simulated and not host_only
                         and t.device == backend.compute)
            if not on_device and t.device.type != "cpu":
                t = t.to("cpu")
            storage = t.untyped_storage()
            key = storage._cdata
            block = m.books.by_host_storage.get(key) if not on_device else None
            if block is None:
                block = self._new_block_for(storage, key, on_device, host_only, shared)
            # t views the block's storage unless an existing block's current copy is elsewhere
            current = block.dev if block.dev is not None else block.host
            view = t if current is storage else compute_view_of(block, t)
            return make_ref(block, view, m.declared, requires_grad=requires_grad)

    def _new_block_for(self, storage: torch.UntypedStorage, key: int, on_device: bool, host_only: bool,
                       shared: bool) -> Block:
        """The block of a plain tensor's ``storage`` (its bytes, not a copy)."""
        m = self.m
        books = m.books
        block = books.new_block(storage.nbytes())
        if on_device:
            # Made on the device outside the manager (a GPU tensor given to it): it counts
            # from now on, and the budget is restored by evicting others.
            books.made_resident(block, storage)
            block.explicit = True  # (the program put it there: Note [Default-device tensors])
            block.last_use = m.op_count
            m.device_room.make(0, (block.id,), "adopting a device tensor")
        else:
            block.host_only = host_only
            books.host_only += block.host_only
            block.host_shared = shared
            if not host_only:
                m.host_tier.make_room(block.nbytes, (), "a new tensor")  # (counted within the budget)
            books.set_host_only(block, storage)
            books.by_host_storage[key] = block
            if not shared and not block.host_only and block.nbytes >= PIN_AT_ADOPTION_BYTES:
                m.host_tier.pin_host(block)  # once, now, rather than on the way to the device
        m.strategy.on_adopt(block)
        return block

    def clone_ref(self, ref: TensorRef, memo: dict) -> TensorRef:
        """A deep copy of leaf ``ref`` with its own block (``copy.deepcopy``)."""
        m = self.m
        with m.lock:
            block = block_of(ref)
            key = ("torchTensorRef.block", block.id)
            new_block = memo.get(key)
            if new_block is None:
                m.residency.sync_host(block)
                m.host_tier.make_room(block.nbytes, (block.id,), "a copy of a tensor")
                m.host_tier.watch.reserve_bytes(block.nbytes)
                storage = raw.flat_bytes(block.host).clone().untyped_storage()
                new_block = m.books.new_block(block.nbytes)
                m.books.set_host_only(new_block, storage)
                memo[key] = new_block
            else:
                m.residency.sync_host(new_block)  # (it may have left host memory since)
            view = with_math_bits(raw.typed_view(new_block.host, ref.dtype, ref.size(), ref.stride(),
                                                 ref.storage_offset()), ref)
            new = make_ref(new_block, view, m.declared, requires_grad=ref.requires_grad)
        if getattr(ref, "_is_param", False):
            new = cast(TensorRef, torch.nn.Parameter(new, requires_grad=ref.requires_grad))  # (as above)
        if ref.grad is not None:
            new.grad = copy.deepcopy(ref.grad, memo)
        for name, value in user_attributes(ref).items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def rebind(self, ref: TensorRef, new: TensorRef) -> None:
        """Point ``ref`` at ``new``'s block (after ``ref.data = new``)."""
        m = self.m
        m.books.changes += 1
        with m.lock:
            old = block_of(ref)
            block = block_of(new)
            # Count the new view first: ``p.data = p`` (Module.to on a tied parameter that
            # already has the dtype) rebinds a block to itself and must not release it.
            block.refs += 1
            rebind_view(ref, new)  # (the old liveness weakref goes, with its callback)
            old.refs -= 1
            if old.refs == 0 and old.alive:
                m.books.release(old)


def compute_view_of(block: Block, t: torch.Tensor) -> torch.Tensor:
    """``t``'s geometry on ``block``'s current copy."""
    storage = block.dev if block.dev is not None else block.host
    assert storage is not None  # (Note [Blocks and coherence]: a copy is valid)
    return with_math_bits(raw.typed_view(storage, t.dtype, t.size(), t.stride(), t.storage_offset()), t)
