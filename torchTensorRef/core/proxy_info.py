"""``TensorRef.proxyInfo``: where a TensorRef's bytes are and what the manager tracks."""

from __future__ import annotations

import torch

from . import context
from .blocks import Block


class ProxyInfo:
    """A live description of one TensorRef; read it, do not keep it.

    Attributes are computed on access from the TensorRef's block (see Note [Blocks and
    coherence] in ``blocks.py``), so they always say how things are now.
    """

    __slots__ = ("_ref", "_block")

    def __init__(self, ref: torch.Tensor, block: Block) -> None:
        self._ref = ref
        self._block = block  # (the TensorRef's block: ``ref.data = t`` gives it another, so read it at once)

    @property
    def device(self) -> str:
        """Where the bytes are now: the accelerator's name (``"cuda:0"``, ``"sim"``) or ``"cpu"``."""
        if self._block.dev is not None:
            return context.manager().device
        return "cpu"

    @property
    def nbytes(self) -> int:
        """Bytes of the storage block (shared by every view of it)."""
        return self._block.nbytes

    @property
    def block_id(self) -> int:
        """Identity of the storage block; views of one tensor share it."""
        return self._block.id

    @property
    def on_device(self) -> bool:
        """Whether a valid accelerator copy exists."""
        return self._block.dev is not None

    @property
    def dirty(self) -> bool:
        """Whether the accelerator copy has writes not yet copied back to the host."""
        return self._block.dirty

    @property
    def residence(self) -> str:
        """The block's state (Note [Residence] in ``blocks.py``): ``"host only"``, ``"on host"``,
        ``"on disk"``, ``"arriving"``, ``"resident, clean"`` or ``"resident, dirty"``."""
        return self._block.residence.value

    @property
    def pinned(self) -> bool:
        """Whether ``tensorsManager.pin`` keeps this block resident."""
        return self._block.pins > 0

    @property
    def views(self) -> int:
        """Live TensorRefs that view the same block."""
        return self._block.refs

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in
                ("device", "nbytes", "block_id", "on_device", "dirty", "residence", "pinned", "views")}

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"ProxyInfo({fields})"
