"""Normalizations larger than the budget, forward, in groups of batch elements (Note
[Pieces] in ``pieces.py``, and ``split.py``): GroupNorm normalizes each sample's groups
alone, LayerNorm each position alone, so a part of the batch gives one call's bits for its
samples. Their backward, whose weight's and bias's gradients sum over the whole batch, is
not cut."""

from __future__ import annotations

import math

import torch

from ..core import raw
from ..core.op_specs import OpSpec, implements
from ..core.tensor_ref import TensorRef, host_view
from .dispatch import run_generic
from .pieces import fill_in_groups, gathered_piece, host_result, settle
from .split import chunk_elements, op_bytes, refs_bytes, refuse, when_refused
from .split_convolutions import memory_format_of
from .split_products import in_order

aten = torch.ops.aten


@implements(aten.native_group_norm.default)
@when_refused
def group_norm(func, args, kwargs, spec: OpSpec, left: int):
    """GroupNorm's forward in groups of batch elements when it does not fit: each sample's
    groups are normalized alone, by the same kernel, as in one call (on the CPU, every
    grouping tried gave one call's bits, with any thread count, dtype and layout)."""
    if kwargs or len(args) != 8 or not isinstance(args[0], TensorRef):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    x, weight, bias, count, channels, hxw, groups, eps = args
    return _in_samples(func, spec, left, x, count, [weight, bias], groups,
                       lambda part: [part, weight, bias, part.shape[0], channels, hxw, groups, eps])


@implements(aten.native_layer_norm.default)
@when_refused
def layer_norm(func, args, kwargs, spec: OpSpec, left: int):
    """LayerNorm's forward in groups of batch elements (its input's first dimension) when it
    does not fit: each position is normalized alone, by the same kernel, as in one call (on
    the CPU, every grouping of positions tried gave one call's bits, float32 and bfloat16, 1
    and 2 threads). Its backward, whose weight's and bias's gradients sum over every
    position, is not cut."""
    if kwargs or len(args) != 5 or not isinstance(args[0], TensorRef) or args[0].dim() <= len(args[1]):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    x, shape, weight, bias, eps = args
    count = x.shape[0]
    positions = x.numel() // max(count * math.prod(shape), 1)
    return _in_samples(func, spec, left, x, count, [weight, bias], positions,
                       lambda part: [part, shape, weight, bias, eps])


def _in_samples(func, spec: OpSpec, left: int, x: TensorRef, count: int, params, stats: int, arguments):
    """A norm's forward in groups of the ``count`` batch elements of ``x`` (``arguments(part)``:
    the op's arguments for a part of them), its output and its ``stats`` means and rstds a
    sample copied into results in host memory, the output laid out as the kernel laid out
    the first part's (channels last or not)."""
    sample = x.numel() // max(count, 1) * x.element_size()
    stat = stats * max(x.element_size(), 4)  # (a sample's means, and its rstds: float or wider)
    pieces = (sample, sample, stat, stat)
    step = chunk_elements(sum(pieces), refs_bytes([p for p in params if p is not None]), left, count, spec.name,
                          (1,), pieces)
    settle([x])

    def samples(start: int, n: int):
        part = gathered_piece(in_order(host_view(x).detach()[start:start + n]))
        return run_generic(func, arguments(part), {}, spec)

    first = [samples(0, min(step, count))]
    out, *rest = first[0]
    layout = raw.empty(x.shape, device="meta", memory_format=memory_format_of(out)).stride()
    outs = [host_result(x.shape, out.dtype, stride=layout)]
    outs += [host_result((count, *r.shape[1:]), r.dtype) for r in rest]
    del out, rest
    fill_in_groups([(o, 0, 1) for o in outs], count, step, samples, first)
    return tuple(outs)
