"""``manage(obj)``: bring an existing module, tensor or state dict under management."""

from __future__ import annotations

from typing import Dict

import torch

from .manager import tensorsManager


def manage(obj):
    """Return ``obj`` with its tensors made TensorRefs.

    - a ``torch.nn.Module`` is converted in place (parameters and buffers; shared and tied
      parameters stay shared) and returned;
    - a tensor gives a TensorRef over the same bytes (a ``Parameter`` stays a Parameter);
    - a dict (a state dict), list or tuple gives a new one of the same kind.

    Raises:
        TypeError: for anything else.
    """
    if isinstance(obj, torch.nn.Module):
        memo: Dict[int, torch.Tensor] = {}
        for module in obj.modules():
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if value is not None:
                        if id(value) not in memo:
                            memo[id(value)] = tensorsManager.manage_tensor(value)
                        table[name] = memo[id(value)]
        return obj
    if isinstance(obj, torch.Tensor):
        return tensorsManager.manage_tensor(obj)
    if isinstance(obj, dict):
        new = type(obj)()
        new.update((k, manage(v) if isinstance(v, (torch.Tensor, dict, list, tuple)) else v) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            new._metadata = obj._metadata
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(manage(v) if isinstance(v, (torch.Tensor, dict, list, tuple)) else v for v in obj)
    raise TypeError(
        f"manage() accepts an nn.Module, a tensor, or a dict/list/tuple of tensors (got: {type(obj).__name__})"
    )
