"""Ops larger than the budget whose result is made in host memory by copies (``split.py``):
``cat`` along its outermost dimension, a constant pad, and the backward of a slice or of
a select (the input's gradient: zeros, the part's gradient in its place).

Each result is laid out as plain torch lays out one call's (its kernel run on meta
tensors), filled where it must be, and the tensors' host copies copied into their places:
the same values as one call, bit for bit (copies compute nothing), and no room on the
device, to which the next op brings the result as any tensor.
"""

from __future__ import annotations

import torch

from ..core.op_specs import OpSpec, implements
from ..core.tensor_ref import TensorRef, host_view
from .pieces import held_on_host, host_result
from .result_bounds import to_meta
from .split import op_bytes, refuse, when_refused

aten = torch.ops.aten


def cat_on_host(func, tensors, dim: int) -> TensorRef:
    """``cat`` of ``tensors`` (TensorRefs) along ``dim``, which only ones precede."""
    meta = func(to_meta(list(tensors)), dim)
    out = host_result(meta.shape, meta.dtype, stride=meta.stride())
    with held_on_host([out, *tensors], read={id(t) for t in tensors}):
        out_host = host_view(out)
        at = 0
        for t in tensors:
            if t.dim() == meta.dim() and t.shape[dim]:
                out_host.narrow(dim, at, t.shape[dim]).copy_(host_view(t).detach())
                at += t.shape[dim]
    return out


def _placed(meta: torch.Tensor, value, part: TensorRef, place) -> TensorRef:
    """A result laid out as ``meta``, filled with ``value``, and ``part``'s values copied
    in: ``place(result's host view, part's)`` gives where, and which of them."""
    out = host_result(meta.shape, meta.dtype, stride=meta.stride())
    with held_on_host([out, part], read={id(part)}):
        out_host = host_view(out)
        out_host.fill_(value)
        if meta.numel():
            where, values = place(out_host, host_view(part).detach())
            where.copy_(values)
    return out


@implements(aten.constant_pad_nd.default)
@when_refused
def pad(func, args, kwargs, spec: OpSpec, left: int):
    """``constant_pad_nd`` (``F.pad`` with a value: a sequence padded to a multiple of a
    scan's chunk): the result filled with the value, the tensor's part that stays in its place."""
    x, pads = args[0], args[1] if len(args) > 1 else kwargs["pad"]
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if not isinstance(x, TensorRef) or len(pads) % 2 or len(pads) // 2 > x.dim():
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)

    def place(out, kept):
        for i in range(len(pads) // 2):  # (pads name the last dimension first)
            dim, low, high = x.dim() - 1 - i, pads[2 * i], pads[2 * i + 1]
            # (a negative pad crops: the tensor loses those positions, the result gains none)
            kept = kept.narrow(dim, max(-low, 0), kept.shape[dim] - max(-low, 0) - max(-high, 0))
            out = out.narrow(dim, max(low, 0), kept.shape[dim])
        return out, kept

    return _placed(func(to_meta(x), pads, value), value, x, place)


def _arguments(func, args, kwargs) -> list:
    """``args`` and ``kwargs`` in the order of ``func``'s schema, defaults filled in."""
    out = list(args)
    for a in func._schema.arguments[len(args):]:
        out.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return out


@implements([aten.slice_backward.default, aten.select_backward.default])
@when_refused
def part_backward(func, args, kwargs, spec: OpSpec, left: int):
    """The gradient of a tensor from its part's (projections split from one product: a
    Mamba's ``in_proj``): zeros, the part's gradient copied into its place."""
    grad, sizes, dim, *where = _arguments(func, args, kwargs)
    if not isinstance(grad, TensorRef):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    if func is aten.select_backward.default:
        part = lambda out: out.select(dim, where[0])  # noqa: E731
    else:
        part = lambda out: aten.slice.Tensor(out, dim, *where)  # noqa: E731
    return _placed(func(to_meta(grad), sizes, dim, *where), 0, grad, lambda out, values: (part(out), values))
