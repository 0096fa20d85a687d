"""Moves a program asks for: ``toGPU()``, ``toCPU()``, ``data_ptr``, pins, ``evict_all()``."""

from __future__ import annotations

import torch

from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import TensorRef, block_of


class Moves:
    """The explicit moves of TensorRefs (the manager's public methods of the same names)."""

    def __init__(self, manager) -> None:
        self.m = manager

    def to_device(self, ref: TensorRef) -> None:
        """Make ``ref``'s block resident now, evicting others if the budget needs it."""
        m = self.m
        with m.lock:
            m.drain()
            block = block_of(ref)
            if m.backend.passthrough or block.dev is not None or block.external or block.host_only:
                return  # (an external block stays on the host: Note [External bytes])
            size = m.backend.block_bytes(block.nbytes)
            limit = m.accounting.limit
            if limit is not None and size + m.accounting.elsewhere_bytes > limit:
                outside = m.device_room.read_outside()  # (a reading of the device, not a stale one)
                if size + outside > limit and m.device_room.collect_garbage():
                    outside = m.accounting.elsewhere_bytes
                if size + outside > limit:
                    raise OutOfBudgetError("toGPU", size + outside, limit, outside=outside)
            m.device_room.make(size, (block.id,), "toGPU")
            m.residency.fetch(block, (block.id,))
            block.last_use = m.op_count

    def expose(self, ref: TensorRef) -> torch.Tensor:
        """``ref``'s device copy for code outside torch's ops (``data_ptr``): brought in,
        counted as written, and kept resident until room is needed."""
        m = self.m
        with m.lock:
            view = self.write_view(ref)
            block_of(ref).exposed = True
            return view

    def write_view(self, ref: TensorRef) -> torch.Tensor:
        """A plain view of ``ref``'s device copy (brought in) that its caller writes: the host
        copy is stale from now on. For code that writes a TensorRef's bytes without an op."""
        m = self.m
        with m.lock:
            self.to_device(ref)
            block = block_of(ref)
            view = ref.target
            if not block.host_only and block.dev is not None:
                block.written_on_device()
                m.host_tier.disk_stale(block)
            return view

    def to_host(self, ref: TensorRef) -> None:
        """Write ``ref``'s block back if needed and drop its accelerator copy."""
        m = self.m
        with m.lock:
            block = block_of(ref)
            if not block.pins:
                m.residency.evict(block)
            m.residency.sync_host(block)
            m.device_room.retire()  # its write-back ended: its device bytes are free now

    def discard(self, ref: TensorRef) -> None:
        """``ref``'s bytes are rewritten before they are read again: free its accelerator copy
        without writing it back (FSDP2 frees its gathered parameters so between uses).

        The host copy is kept as the valid one (its stale bytes are never read); a block that
        has none yet is written back once to get it.
        """
        m = self.m
        with m.lock:
            m.drain()
            block = block_of(ref)
            if block.dev is None or block.pins or block.host_only or block.external or block.host_shared:
                return
            if block.host is not None and block.host.nbytes() == block.nbytes:
                block.written_back()  # (its stale bytes are never read: rewritten first)
            m.residency.evict(block)

    def evict_all(self) -> None:
        """Send every unpinned block back to host memory (writing back what changed)."""
        m = self.m
        with m.lock:
            m.drain()
            for block in [b for b in m.books.resident.values() if not b.pins]:
                m.residency.evict(block)

    def pin(self, tensor: TensorRef) -> None:
        """Keep ``tensor``'s block resident until ``unpin``; pins nest."""
        m = self.m
        if not isinstance(tensor, TensorRef):
            raise TypeError(f"pin needs a TensorRef (got: {type(tensor).__name__})")
        with m.lock:
            self.to_device(tensor)
            block_of(tensor).pins += 1

    def unpin(self, tensor: TensorRef) -> None:
        """Undo one ``pin``."""
        m = self.m
        if not isinstance(tensor, TensorRef):
            raise TypeError(f"unpin needs a TensorRef (got: {type(tensor).__name__})")
        with m.lock:
            block = block_of(tensor)
            if block.pins == 0:
                raise ValueError("unpin of a tensor that is not pinned")
            block.pins -= 1
