"""Genoa: bring an op's inputs in just before it runs, send everything back right after.

The accelerator holds one op's data at a time, so the peak is the largest op's working
set; every op pays for moving its inputs in and its results out.
"""

from __future__ import annotations

from .base import Strategy


class Genoa(Strategy):
    """Least accelerator memory, most traffic."""

    name = "genoa"
    new_tensors_on_device = False
    sends_back = True

    def on_adopt(self, block) -> None:
        # A tensor made on the device (a random one: the device's generator draws it) goes
        # to the host like any op's result.
        if block.dev is not None and not block.pins:
            self.manager.evict(block)

    def after_op(self, op) -> None:
        # (a block whose address was handed out stays until room is needed: Block.exposed)
        evict = self.manager.evict
        for block in op.blocks:
            if block.dev is not None and not block.pins and not block.exposed:
                evict(block)
        for block in op.outputs:
            if block.dev is not None and not block.pins:
                evict(block)
