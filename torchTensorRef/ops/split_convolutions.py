"""Convolutions larger than the budget, forward and backward, in groups of channels (Note
[Pieces] in ``pieces.py``, and ``split.py``).

A convolution's output channel is its own filter over the input, and its input's gradient
for a channel reads only that channel's column of the weight: a convolution of one group
runs in groups of output channels (the input whole), its backward in groups of output
channels for the weight's and bias's gradients (the input whole) and of input channels for
the input's gradient (the output's gradient whole). A convolution of several groups (a
depthwise one) runs forward and backward in runs of whole groups, each with its own
channels: as a convolution of that many groups. Its batch is never cut: on the CPU,
cutting it apart did not give one call's bits (4 of 5 shapes tried), where groups of
channels did, but for the bias's gradient, whose sum over the batch and positions rounds
otherwise in a group of channels (``docs/concepts.md``)."""

from __future__ import annotations

import torch

from ..core import raw
from ..core.op_specs import OpSpec, implements
from ..core.tensor_ref import TensorRef
from .dispatch import run_generic
from .pieces import fill_in_groups, host_result, settle
from .result_bounds import to_meta
from .split import chunk_elements, op_bytes, refs_bytes, refuse, when_refused
from .split_products import TILE_ALIGNS, part_of

aten = torch.ops.aten


def memory_format_of(result: torch.Tensor) -> torch.memory_format:
    """The layout a kernel gave ``result`` (a convolution's, a norm's): channels last where it
    is so and not also contiguous."""
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(result.dim())
    if last is not None and result.is_contiguous(memory_format=last) and not result.is_contiguous():
        return last
    return torch.contiguous_format


def _filled(metas, count: int, step: int, run) -> list:
    """An op's results in host memory, filled run by run of ``step`` of its ``count`` units:
    ``run(start, n)`` gives the results of the op on those units' parts (``None`` where
    not asked), each copied into its place; ``metas`` holds per result ``(meta result, its
    dimension cut, indices of it per unit)``, or ``None`` where not asked. Each result is laid
    out as the kernel laid out its first part (channels last or not)."""
    first = [run(0, min(step, count))]
    outs = [_laid_out_as(meta[0], result) if meta is not None else None for meta, result in zip(metas, first[0])]
    fill_in_groups([(o, m[1], m[2]) if o is not None else (None, 0, 0) for o, m in zip(outs, metas)], count, step,
                   run, first)
    return outs


def _laid_out_as(meta: torch.Tensor, part: torch.Tensor) -> TensorRef:
    """A result in host memory of ``meta``'s shape and dtype, laid out as ``part`` is."""
    layout = raw.empty(meta.shape, device="meta", memory_format=memory_format_of(part)).stride()
    return host_result(meta.shape, meta.dtype, stride=layout)


def _bytes_per(t, units: int) -> int:
    """Bytes of one of ``units`` equal parts of ``t`` (a tensor or a meta result)."""
    return t.numel() // units * t.element_size()


@implements(aten.convolution.default)
@when_refused
def convolution(func, args, kwargs, spec: OpSpec, left: int):
    """A convolution (not transposed) in groups of its output channels when it does not
    fit: with one group, its input whole, each group's rows of the weight and the bias;
    with several (a depthwise one), in runs of whole groups, each with its own channels of
    the input, as a convolution of that many groups. Each output channel is computed from
    the same input by its own filter, as in one call (on the CPU, groups of any size gave
    one call's bits for every shape, dtype and layout tried)."""
    if kwargs or len(args) != 9:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    refs = [t for t in (x, weight, bias) if t is not None]
    if transposed or not all(isinstance(t, TensorRef) for t in refs):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    meta = func(*to_meta([x, weight]), None, *args[3:])  # (plain torch's checks, result shape and layout)
    channels = weight.shape[0]
    units = channels if groups == 1 else groups  # (what a piece takes whole: a channel, or a group)
    per = channels // units  # output channels of a unit
    pieces = [_bytes_per(t, units) for t in (weight, meta)]  # (its filters, its output)
    pieces += [per * bias.element_size()] if bias is not None else []
    pieces += [_bytes_per(x, groups)] if groups > 1 else []  # (a group's own input)
    step = chunk_elements(sum(pieces), refs_bytes([x]) if groups == 1 else 0, left, units, spec.name,
                          TILE_ALIGNS if groups == 1 else (1,), pieces)
    settle(refs if groups > 1 else [t for t in (weight, bias) if t is not None])
    inputs = x.shape[1] // groups  # input channels of a group

    def run(start: int, n: int):
        part = [part_of(t, 0, start * per, n * per) if t is not None else None for t in (weight, bias)]
        if groups == 1:
            return [run_generic(func, [x, *part, *args[3:]], {}, spec)]
        given = part_of(x, 1, start * inputs, n * inputs)
        return [run_generic(func, [given, *part, *args[3:8], n], {}, spec)]

    return _filled([(meta, 1, per)], units, step, run)[0]


@implements(aten.convolution_backward.default)
@when_refused
def convolution_backward(func, args, kwargs, spec: OpSpec, left: int):
    """A convolution's backward (not transposed) when it does not fit. With one group: the
    weight's and bias's gradients in groups of output channels (the input whole, each
    group's channels of the output's gradient and rows of the weight), then the input's
    gradient in groups of input channels (the output's gradient whole, each group's
    channels of the input and columns of the weight: a channel's gradient reads only its
    column). With several (a depthwise one): in runs of whole groups, each with its own
    channels of every tensor, as the backward of a convolution of that many groups."""
    if kwargs or len(args) != 11:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    if transposed or not all(isinstance(t, TensorRef) for t in (grad, x, weight)):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    metas = func(*to_meta([grad, x, weight]), *args[3:])  # (plain torch's checks, results' shapes)
    outs, ins = weight.shape[0], x.shape[1]  # output and input channels
    name, rest = spec.name, args[4:9]  # (stride ... output_padding)

    def sizes(n: int):
        return [n] if bias_sizes is not None else None

    if groups > 1:
        per_out, per_in = outs // groups, ins // groups
        pieces = [_bytes_per(t, groups) for t in (grad, x, weight, *metas) if t is not None]
        step = chunk_elements(sum(pieces), 0, left, groups, name, (1,), pieces)
        settle([grad, x, weight])

        def groups_of(start: int, n: int):
            parts = [part_of(t, dim, start * per, n * per)
                     for t, dim, per in ((grad, 1, per_out), (x, 1, per_in), (weight, 0, per_out))]
            return run_generic(func, [*parts, sizes(n * per_out), *rest, n, mask], {}, spec)

        cuts = ((1, per_in), (0, per_out), (0, per_out))
        return tuple(_filled([(m, *c) if m is not None else None for m, c in zip(metas, cuts)], groups, step,
                             groups_of))
    gi = gw = gb = None
    if mask[1] or mask[2]:
        pieces = [_bytes_per(t, outs) for t in (grad, weight, *metas[1:]) if t is not None]
        step = chunk_elements(sum(pieces), refs_bytes([x]), left, outs, name, TILE_ALIGNS, pieces)
        settle([grad, weight])

        def filters(start: int, n: int):
            parts = [part_of(grad, 1, start, n), x, part_of(weight, 0, start, n)]
            return run_generic(func, [*parts, sizes(n), *rest, 1, [False, mask[1], mask[2]]], {}, spec)

        _, gw, gb = _filled([None] + [(m, 0, 1) if m is not None else None for m in metas[1:]], outs, step, filters)
    if mask[0]:
        pieces = [_bytes_per(t, ins) for t in (x, weight, metas[0])]
        step = chunk_elements(sum(pieces), refs_bytes([grad]), left, ins, name, TILE_ALIGNS, pieces)
        settle([x, weight])

        def channels(start: int, n: int):
            parts = [grad, part_of(x, 1, start, n), part_of(weight, 1, start, n)]
            return run_generic(func, [*parts, None, *rest, 1, [True, False, False]], {}, spec)

        gi = _filled([(metas[0], 1, 1), None, None], ins, step, channels)[0]
    return gi, gw, gb
