"""Genoa: bring an op's inputs in just before it runs, send everything back right after.

The accelerator holds one op's data at a time, so the peak is the largest op's working
set; every op pays for moving its inputs in and its results out.
"""

from __future__ import annotations

from .base import Strategy


class Genoa(Strategy):
    """Least accelerator memory, most traffic."""

    name = "genoa"

    def after_op(self, op) -> None:
        evict = self.manager.evict
        for block in op.blocks:
            if block.dev is not None and not block.pins:
                evict(block)
        for block in op.outputs:
            if block.dev is not None and not block.pins:
                evict(block)
