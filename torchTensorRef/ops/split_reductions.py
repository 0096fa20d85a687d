"""Sums larger than the budget (``split.py``): ``sum`` along dimensions, ``cumsum`` and
``scatter_add``, in slices of the outermost dimension they keep; ``flip``, ``tril`` and
``triu`` the same way.

A slice of a kept dimension holds whole sums: each value of the result is the sum of the
same elements, by the same kernel, as in one call, and the slices' results are copied into
their places in a result made in host memory. A kernel may order a sum's additions by the
shape it is given (how it shares one sum between threads), so a slice's sums may round
apart from one call's in the last bits, as a CUDA kernel's do between shapes.
"""

from __future__ import annotations

import torch

from ..core.errors import OutOfBudgetError
from ..core.op_specs import OpSpec, implements
from ..core.tensor_ref import TensorRef
from .dispatch import run_generic
from .pieces import host_result, in_groups, settle
from .result_bounds import to_meta
from .split import chunk_elements, op_bytes, refuse, when_refused
from .split_products import part_of

aten = torch.ops.aten


def _kept_dimension(x: torch.Tensor, dims, keepdim: bool):
    """(the outermost dimension of ``x`` the sum keeps that is longer than one, its place
    in the result), or ``None`` where there is none (a whole-tensor sum)."""
    reduced = {d % x.dim() for d in dims} if dims else set(range(x.dim()))
    for d in range(x.dim()):
        if d not in reduced and x.shape[d] > 1:
            return d, d if keepdim else d - sum(1 for r in reduced if r < d)
    return None


@implements(aten.sum.dim_IntList)
@when_refused
def sum_along(func, args, kwargs, spec: OpSpec, left: int):
    """``sum`` along dimensions (a scan's ``(C * B).sum(-1)``) of a tensor that does not
    fit, in slices of the outermost dimension it keeps."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    return _in_slices(func, args, kwargs, spec, left, dims, keepdim)


@implements(aten.cumsum.default)
@when_refused
def cumsum_along(func, args, kwargs, spec: OpSpec, left: int):
    """``cumsum`` along a dimension (a scan's segment sums) of a tensor that does not fit,
    in slices of its outermost other dimension."""
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    return _in_slices(func, args, kwargs, spec, left, [dim], True)


@implements(aten.flip.default)
@when_refused
def flip_along(func, args, kwargs, spec: OpSpec, left: int):
    """``flip`` (a scan run backwards) of a tensor that does not fit, in slices of its
    outermost dimension not flipped (copies: the same bits)."""
    dims = args[1] if len(args) > 1 else kwargs["dims"]
    return _in_slices(func, args, kwargs, spec, left, dims, True)


@implements([aten.tril.default, aten.triu.default])
@when_refused
def triangle_of_each_matrix(func, args, kwargs, spec: OpSpec, left: int):
    """``tril`` and ``triu`` (a gated delta rule's masks of each chunk) of a batch of
    matrices that does not fit, in slices of its outermost batch dimension, and one matrix
    larger than the room in groups of its rows, each with the diagonal counted from its
    first row (copies: the same bits)."""
    return _triangle(func, args, kwargs, spec, left)


def _triangle(func, args, kwargs, spec: OpSpec, left: int):
    x = args[0]
    if not (isinstance(x, TensorRef) and x.dim() >= 2 and all(n == 1 for n in x.shape[:-2])):
        return _in_slices(func, args, kwargs, spec, left, (-2, -1), True, each=_triangle)
    diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
    at, count = x.dim() - 2, x.shape[-2]
    row = x.shape[-1] * x.element_size()
    step = chunk_elements(2 * row, 0, left, count, spec.name, (1,), (row, row))
    out = host_result(x.shape, x.dtype)
    settle([x])
    in_groups(out, at, count, step, lambda start, n: run_generic(
        func, [part_of(x, at, start, n), diagonal + start], {}, spec))
    return out


@implements(aten.scatter_add.default)
@when_refused
def scatter_add_along(func, args, kwargs, spec: OpSpec, left: int):
    """``scatter_add`` (a gather's backward: a sparse attention's chosen keys) into a tensor
    that does not fit, in slices of the outermost other dimension its index and source are
    as long along: each value sums the same values in the same order as in one call."""
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if len(args) != 4 or kwargs or not all(isinstance(t, TensorRef) for t in (args[0], args[2], args[3])):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    return _in_slices(func, args, kwargs, spec, left, [dim], True, cut=(0, 2, 3))


def _in_slices(func, args, kwargs, spec: OpSpec, left: int, dims, keepdim: bool, cut=(0,), each=None):
    """``func`` along ``dims`` of its first argument, in slices of the outermost dimension
    it keeps, each slice's result copied into its place in a result in host memory; where
    one slice does not fit (one head's segment sums), each is cut along the next dimension
    kept, in turn (or as ``each(func, args, kwargs, spec, left)`` runs it). The arguments at
    the positions ``cut`` (the first: the others as long there, else refused) are sliced
    alike."""
    x = args[0]
    kept = _kept_dimension(x, dims, keepdim) if isinstance(x, TensorRef) and x.dim() else None
    sliced = [args[i] for i in cut]
    if kept is None or any(t.dim() != x.dim() or t.shape[kept[0]] != x.shape[kept[0]] for t in sliced):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    at, out_at = kept
    meta = func(*to_meta(list(args)), **kwargs)  # (the result as one call lays it out)
    count = x.shape[at]
    pieces = [t.numel() // count * t.element_size() for t in sliced] + [meta.numel() // count * meta.element_size()]
    try:
        step = chunk_elements(sum(pieces), 0, left, count, spec.name, (1,), pieces)
    except OutOfBudgetError:
        step = 0

    def with_parts(part):
        return [part(a) if i in cut else a for i, a in enumerate(args)]

    out = host_result(meta.shape, meta.dtype, stride=meta.stride())
    if not step:
        run = each or (lambda *a: _in_slices(*a, dims, keepdim, cut))
        in_groups(out, out_at, count, 1, lambda i, _n: run(
            func, with_parts(lambda t: t.narrow(at, i, 1)), kwargs, spec, left))
        return out
    settle(sliced)
    in_groups(out, out_at, count, step, lambda start, n: run_generic(
        func, with_parts(lambda t: part_of(t, at, start, n)), kwargs, spec))
    return out
