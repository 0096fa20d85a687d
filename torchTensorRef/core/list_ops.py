"""The tensor types torch lets choose its list (``_foreach``) implementations.

Optimizers (``torch.optim``) and gradient clipping (``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_``) pick their ``_foreach`` kernels by default only for tensors whose exact
type torch lists, each in its own list; elsewhere they loop over the tensors one op each. On a
GPU the two ways round differently in the last bits, so a tensor type standing in for plain
device tensors (a TensorRef, a plain tensor of ``"sim"``) must be listed in both, or it gets
another result than plain torch on the same device.
"""

from __future__ import annotations

from typing import List

from torch.optim import optimizer
from torch.utils import _foreach_utils


def _lists() -> List[list]:
    return [optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types]


def admit(cls: type) -> None:
    """Let tensors of type ``cls`` choose the list implementations plain tensors choose."""
    for types in _lists():
        if cls not in types:
            types.append(cls)


def withdraw(cls: type) -> None:
    """Undo :func:`admit` (idempotent)."""
    for types in _lists():
        if cls in types:
            types.remove(cls)
