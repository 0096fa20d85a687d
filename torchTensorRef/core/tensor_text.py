"""How a TensorRef prints: as the plain tensor of its values would, with its own device
and autograd state."""

from __future__ import annotations

from typing import Optional

import torch


def tensor_text(ref: torch.Tensor, plain: torch.Tensor, tensor_contents: Optional[str] = None) -> str:
    """``repr`` of a plain tensor with ``ref``'s values (``plain``, a host copy of them),
    metadata and autograd state.

    Mirrors ``torch._tensor_str._str`` for dense tensors: the suffixes (device, dtype,
    grad_fn ...) must be known before the text is laid out, because a long one moves to a
    line of its own, so appending them to the repr of a host copy wraps lines differently.
    """
    from torch._tensor_str import PRINT_OPTS, _add_suffixes, _tensor_str

    prefix = "tensor("
    indent = len(prefix)
    suffixes = []
    device = ref.device
    if device.type != torch._C._get_default_device() or (
        device.type == "cuda" and torch.cuda.current_device() != device.index
    ):
        suffixes.append(f"device='{device}'")
    default = torch.get_default_dtype()
    complex_default = torch.cdouble if default == torch.double else torch.cfloat
    empty = plain.numel() == 0
    if empty:
        if plain.dim() != 1:
            suffixes.append(f"size={tuple(plain.shape)}")
        if plain.dtype != default:
            suffixes.append(f"dtype={plain.dtype}")
    else:
        if not PRINT_OPTS.edgeitems:
            suffixes.append(f"size={tuple(plain.shape)}")
        if plain.dtype not in (default, complex_default, torch.int64, torch.bool):
            suffixes.append(f"dtype={plain.dtype}")
    if tensor_contents is not None:
        text = tensor_contents
    elif empty:
        text = "[]"
    else:
        with torch.no_grad():
            text = _tensor_str(plain, indent)
    try:
        grad_fn = ref.grad_fn
        name = None if grad_fn is None else type(grad_fn).__name__
        if grad_fn is not None and name == "CppFunction":
            name = grad_fn.name().rsplit("::", 1)[-1]
    except RuntimeError:  # a view made and written in place under no_grad (pytorch#99968)
        name = "Invalid"
    if name is not None:
        suffixes.append(f"grad_fn=<{name}>")
    elif ref.requires_grad:
        suffixes.append("requires_grad=True")
    return _add_suffixes(prefix + text, suffixes, indent, force_newline=False)
