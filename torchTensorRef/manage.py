"""``manage(obj)``: bring an existing module, tensor or state dict under management."""

from __future__ import annotations

import copy
from typing import Dict

import torch

from .manager import tensorsManager


def manage(obj):
    """Return ``obj`` with its tensors made TensorRefs.

    - a ``torch.nn.Module`` is converted in place (parameters, their grads, and buffers;
      shared and tied parameters stay shared) and returned;
    - a tensor gives a TensorRef over the same bytes (a ``Parameter`` stays a Parameter);
    - a dict (a state dict), list or tuple gives a new one of the same kind; a tensor that
      appears twice in it gives one TensorRef, twice.

    Raises:
        TypeError: for anything else.
        ValueError: for a tensor that cannot be managed (meta, sparse ...); a module is
            then left unchanged.
    """
    memo: Dict[int, torch.Tensor] = {}
    if isinstance(obj, torch.nn.Module):
        slots = [(table, name, value)
                 for module in obj.modules()
                 for table in (module._parameters, module._buffers)
                 for name, value in table.items() if value is not None]
        # Convert everything before changing anything, so that a failure leaves the module as it was.
        for _table, _name, value in slots:
            _convert(value, memo)
        for table, name, value in slots:
            table[name] = memo[id(value)]
        # The module held the plain tensors; where nobody else does, their bytes are ours now.
        refs = list(memo.values())
        slots = value = memo = None  # (this call's names for them must not count as holders)
        tensorsManager.take_over(refs)
        return obj
    if isinstance(obj, (torch.Tensor, dict, list, tuple)):
        return _convert(obj, memo)
    raise TypeError(
        f"manage() accepts an nn.Module, a tensor, or a dict/list/tuple of tensors (got: {type(obj).__name__})"
    )


def _convert(obj, memo: Dict[int, torch.Tensor]):
    if isinstance(obj, torch.Tensor):
        new = memo.get(id(obj))
        if new is None:
            new = tensorsManager.manage_tensor(obj)
            if new is not obj and obj.is_leaf and obj.grad is not None:
                new.grad = _convert(obj.grad, memo)
            memo[id(obj)] = new
        return new
    if isinstance(obj, dict):
        new = copy.copy(obj)  # keeps the kind of dict and its attributes (a state dict's _metadata)
        for key, value in obj.items():
            new[key] = _convert(value, memo)
        return new
    if isinstance(obj, (list, tuple)):
        items = [_convert(v, memo) for v in obj]
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    return obj
