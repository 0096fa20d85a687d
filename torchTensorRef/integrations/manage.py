"""``manage(obj)``: bring an existing module, tensor or state dict under management."""

from __future__ import annotations

import copy
from typing import Dict

import torch

from ..memory.manager import tensorsManager


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


def adopt(obj, memo=None, host_only: bool = False):
    """``obj`` with its plain tensors (also inside lists, tuples and dicts) made TensorRefs.

    A tensor found twice gives one TensorRef, twice (``memo``: id -> TensorRef). With
    ``host_only`` the tensors stay CPU tensors (``device="cpu"`` was asked for).
    """
    if memo is None:
        memo = {}
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            return obj  # a TensorRef already, or another subclass (fake tensors)
        # (is_meta, is_cpu: ``device.type`` costs a microsecond)
        if obj.layout is not torch.strided or obj.is_meta:
            return obj
        if not obj.is_cpu and obj.device != tensorsManager.backend.compute:
            return obj  # explicitly asked for another device than the managed one
        memo[id(obj)] = ref = tensorsManager.manage_tensor(obj, host_only=host_only and obj.is_cpu, shared=False)
        return ref
    if isinstance(obj, dict):
        items = [(k, adopt(v, memo, host_only)) for k, v in obj.items()]
        try:
            new = type(obj)()
        except TypeError:
            return obj
        new.update(items)
        if hasattr(obj, "_metadata"):
            new._metadata = obj._metadata  # state dicts carry version metadata
        return new
    if isinstance(obj, list) and type(obj) is list:
        return [adopt(v, memo, host_only) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(adopt(v, memo, host_only) for v in obj)
    if isinstance(obj, torch.nn.Module):
        return manage(obj)  # ``torch.load`` of a pickled module: its parameters and buffers
    return obj
