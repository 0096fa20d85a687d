"""Elementwise ops (and each position of a list op) in chunks: how an op is cut into
pieces (``_Cut``) and run on them (``run_chunked``), for the ops of ``split.py``.

An op is cut along positions of its result: ranges of its tensors' bytes where they have
one shape and layout (elements, or whole rows for the softmax family), else ranges of its
result's outer dimensions, each tensor as long there cut alike, the others given whole.
Each chunk runs the op's own kernel on pieces of its tensors (Note [Pieces] in
``pieces.py``): every element comes from the same inputs by the same kernel as in one call.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional

import torch

from ..core import raw
from ..core.errors import OutOfBudgetError
from ..core.op_specs import OpSpec
from ..core.tensor_ref import TensorRef, block_of
from .dispatch import run_generic
from .pieces import (alias_piece, dense, gathered_piece, held_on_host, host_result, land, landing, to_host,
                     write_back)
from .split import ALIGN, MIN_ALIGN, block_bytes, chunk_elements, may_retry, op_bytes, refs_bytes, refuse


#: list ops that reduce each position to one value: how chunk results combine
_REDUCTIONS = frozenset({"_foreach_norm", "_foreach_max", "linalg_vector_norm"})


def tensors_of(values):
    for v in values:
        if isinstance(v, TensorRef):
            yield v
        elif isinstance(v, (list, tuple)):
            for e in v:
                if isinstance(e, TensorRef):
                    yield e


class _Gathered(NamedTuple):
    """A cut tensor's pieces gathered on the host: its positions at its dims ``at`` to
    ``at + merged - 1``, taken as one."""

    at: int
    merged: int


class _Cut(NamedTuple):
    """How ``run_chunked`` cuts an op: along ``units`` positions of its result, ``chunk`` of
    them at a time. Each tensor of ``cut`` (by ``id``) is cut into pieces: ``cut[id]`` is
    ``(per, lead, tail, window)``; a position's elements start ``per`` elements after the
    previous one's, and its piece of ``n`` positions has the shape ``lead + (n,) + tail``:
    with no ``window``, one range of its bytes (``per`` elements a position); with a window
    ``(strides, span)``, the range from its first position's first element to the last's
    ``span``-th, seen with those strides (a view whose positions are not dense: the bytes
    between them come too); with a ``_Gathered`` window, its positions' elements copied
    together on the host (``per`` a position: interleaved with others over many bytes).
    The other tensors are given whole to every chunk. A new result holds ``out_per_unit``
    elements a position."""

    cut: dict
    big: list
    units: int
    chunk: int
    aligns: tuple
    shape: tuple
    out_per_unit: int
    out_stride: Optional[tuple]
    reduction: bool
    out_meta: Optional[list]


def _plan(func, args, kwargs, spec: OpSpec, left: int, row: int = 1, broadcast: bool = False) -> _Cut:
    """How ``run_chunked`` splits the op; raises ``OutOfBudgetError`` where it cannot.

    Elementwise (``row`` 1): the big tensors, those with the most elements, are cut in
    ranges of their bytes; they must be laid out alike, contiguous or dense in the same other
    order (gradients of a transposed weight, summed over its uses). By rows (``row`` > 1):
    the same, contiguous, in whole rows of ``row`` elements. Broadcasting (``broadcast``):
    the result is cut along its outer dimensions from the first longer than one, each
    contiguous tensor as long there cut alike, the others (broadcast along them) given whole."""
    name = spec.name
    tensors = list(tensors_of(list(args) + list(kwargs.values())))
    if broadcast:
        return _broadcast_plan(func, args, kwargs, spec, left, tensors)
    big = _largest(tensors)
    if not big or big[0].numel() == 0 or not _alike(big, row):
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    shape, stride = big[0].shape, big[0].stride()
    numel = big[0].numel()
    tail = (row,) if row > 1 else ()
    cut = {id(t): (row, (), tail, None) for t in big}
    reduction = func.overloadpacket.__name__ in _REDUCTIONS
    out_meta = None
    if spec.allocates and not reduction:
        out_meta = _out_dtypes(func, args, kwargs)
    aligns = (1,) if row > 1 else (ALIGN, MIN_ALIGN)
    return _sized(spec, args, kwargs, left, tensors, cut, numel // row, aligns, tuple(shape), row,
                  None if big[0].is_contiguous() else tuple(stride), reduction, out_meta)


def _largest(tensors) -> list:
    """The tensors with the most elements (an elementwise op's shape; scalars and steps aside)."""
    numel = max((t.numel() for t in tensors), default=0)
    return [t for t in tensors if t.numel() == numel]


def _alike(big, row: int = 1) -> bool:
    """Whether ``big`` can be cut in ranges of their bytes: one shape and layout, dense (by
    rows: contiguous). (A lazily conjugated or negated view has no such range.)"""
    shape, stride = big[0].shape, big[0].stride()
    return (not any(t.shape != shape or t.stride() != stride or t.is_conj() or t.is_neg() for t in big)
            and (big[0].is_contiguous() if row > 1 else dense(big[0])))


def by_positions(tensors) -> bool:
    """Whether an elementwise op over ``tensors`` is cut along its result's positions
    (``run_chunked``'s ``broadcast``) rather than in ranges of its tensors' bytes: they
    broadcast, or the largest are laid out differently (a half of a tensor ``chunk``-ed
    along its last dimension, times a contiguous one)."""
    big = _largest(tensors)
    return any(t.dim() and t.shape != big[0].shape for t in tensors) or not _alike(big)


def _window(t: torch.Tensor, at: int, merged: int):
    """``(step, span)`` of the positions of ``t`` at its dims ``at`` to ``at + merged - 1``:
    each position's first element ``step`` elements after the previous one's, its elements
    within ``span`` of it; ``None`` where the positions are not one step apart. Positions may
    interleave (``span`` > ``step``: a transposed view broadcast by ``repeat_interleave``):
    a piece then brings the bytes of the positions it overlaps, only read."""
    dims = [i for i in range(at, at + merged) if t.shape[i] != 1]
    if not dims or t.numel() == 0 or any(t.stride(a) != t.stride(b) * t.shape[b] for a, b in zip(dims, dims[1:])):
        return None
    step = t.stride(dims[-1])
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape[at + merged:], t.stride()[at + merged:]))
    return step, span


def _broadcast_plan(func, args, kwargs, spec: OpSpec, left: int, tensors) -> _Cut:
    name = spec.name
    if any(isinstance(v, torch.Tensor) and not isinstance(v, TensorRef) and v.dim()
           for v in list(args) + list(kwargs.values())):
        raise refuse(name, op_bytes(spec, args, kwargs), left)  # (a plain tensor: not cut)
    # (plain torch's own checks and layout, on meta tensors of the real shapes)
    result = func(*[_meta(a, whole=True) for a in args], **{k: _meta(v, whole=True) for k, v in kwargs.items()})
    out = _flat_results(result)
    if len(out) != 1:
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    shape = tuple(out[0].shape)
    d = next((i for i, n in enumerate(shape) if n > 1), None)
    if d is None or spec.allocates and not out[0].is_contiguous():  # (a new result lands in ranges)
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    # Cut along dims d, d + 1, ... while each tensor keeps its part: a cut one has the
    # result's sizes there (its positions are then one range of its bytes, contiguous), a
    # whole one sizes 1 or none.
    cut_at = {}  # (id of each tensor cut -> its dim at the result's d)
    for t in tensors:
        at = d - (len(shape) - t.dim())
        if at >= 0 and t.shape[at] == shape[d]:
            cut_at[id(t)] = at
        elif at >= 0 and t.shape[at] != 1:
            raise refuse(name, op_bytes(spec, args, kwargs), left)
    end = d + 1
    while end < len(shape) and all(_size_at(t, end, len(shape)) == (shape[end] if id(t) in cut_at else 1)
                                   for t in tensors):
        end += 1
    # (a cut tensor that is not contiguous is cut in windows: its positions one step apart)
    strided = [t for t in tensors if id(t) in cut_at and not t.is_contiguous()]
    while end > d + 1 and not all(_window(t, cut_at[id(t)], end - d) for t in strided):
        end -= 1
    written_blocks = {block_of(t).id for t in _written(spec, args, kwargs)}
    units = _numel(shape[d:end])
    cut = {}
    for t in tensors:
        at = cut_at.get(id(t))
        if at is not None:
            how = _cut_of(t, at, end - d, written_blocks, left)
            if how is None:
                raise refuse(name, op_bytes(spec, args, kwargs), left)
            cut[id(t)] = how
    if not cut:
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    out_meta = [out[0].dtype] if spec.allocates else None
    return _sized(spec, args, kwargs, left, tensors, cut, units, (1,), shape, _numel(shape[end:]), None,
                  False, out_meta)


#: a window of interleaved positions (each piece brings all it spans) takes at most this
#: fraction of the room left; wider, its pieces are gathered on the host
_SPAN_SHARE = 4


def _cut_of(t: torch.Tensor, at: int, merged: int, written_blocks: set, left: int):
    """How ``t`` is cut along its dims ``at`` to ``at + merged - 1`` (an entry of
    ``_Cut.cut``), or ``None`` where its positions are not ranges or windows of its bytes."""
    if t.is_conj() or t.is_neg():
        return None
    # (a piece keeps the rank: its positions in one dim, ones for the others cut)
    lead, inner = tuple(t.shape[:at]), tuple(t.shape[at + merged:])
    tail = (1,) * (merged - 1) + inner
    if t.is_contiguous():
        return (_numel(inner), lead, tail, None)
    window = _window(t, at, merged)
    # (only read: a window's write-back would write the bytes between its positions too,
    # which another piece of its block may write or have written; but for positions that
    # tile their bytes, each dense and one after the other: a transposed head of a cache)
    if window is None or block_of(t).id in written_blocks and window != (_numel(inner), _numel(inner)):
        return None
    step, span = window
    if span > step and span * t.element_size() > left // _SPAN_SHARE:
        return (_numel(inner), lead, tail, _Gathered(at, merged))
    strides = (0,) * at + (step,) + (0,) * (merged - 1) + tuple(t.stride()[at + merged:])
    return (step, lead, tail, (strides, span))


def _size_at(t: torch.Tensor, dim: int, rank: int) -> int:
    """``t``'s size at the result's ``dim`` (of ``rank`` dims), broadcast: 1 where it has none."""
    at = dim - (rank - t.dim())
    return t.shape[at] if at >= 0 else 1


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _sized(spec, args, kwargs, left, tensors, cut, units, aligns, shape, out_per_unit, out_stride,
           reduction, out_meta) -> _Cut:
    """The cut with its chunk: as many positions as fit ``left`` beside the tensors given whole."""
    big = [t for t in tensors if id(t) in cut]
    seen: set = set()
    refs_bytes(big, seen)
    fixed = refs_bytes([t for t in tensors if block_of(t).id not in seen])
    # (bytes a position of each piece holds: one piece per block cut)
    pieces = [_piece_size(t, cut[id(t)]) for t in {id(block_of(t)): t for t in big}.values()]
    if out_meta is not None:
        pieces += [(d.itemsize * out_per_unit, 0) for d in out_meta]
    if reduction:
        fixed += block_bytes(8)  # each chunk's result (one value)
    chunk = chunk_elements(sum(size for size, _extra in pieces), fixed, left, units, spec.name, aligns=aligns,
                           pieces=pieces)
    return _Cut(cut, big, units, chunk, aligns, shape, out_per_unit, out_stride, reduction, out_meta)


def _piece_size(t: torch.Tensor, how):
    """``(bytes per position, extra bytes)`` of ``t``'s pieces (``chunk_elements``'s
    ``pieces``): a window of ``n`` positions holds ``(n - 1) * step + span`` elements, less
    than ``n`` steps where its positions leave bytes between them, more where they interleave."""
    per, _lead, _tail, window = how
    size = t.element_size()
    if window is None or isinstance(window, _Gathered):
        return size * per, 0
    return size * per, size * (window[1] - per)


def check_chunkable(func, args, kwargs, spec: OpSpec, left: int) -> None:
    """Raise ``OutOfBudgetError`` now if ``run_chunked`` could not run the op (``args`` may
    hold meta stand-ins for per-position scalar tensors)."""
    _plan(func, args, kwargs, spec, left)


def _piece_of(v, plan: _Cut, start: int, stop: int, written: set, pieces: dict):
    """Argument ``v`` for the positions ``start:stop``: a cut tensor's piece (one per block,
    offset and shape, in ``pieces`` with whether the op writes it), in lists and tuples too."""
    if isinstance(v, TensorRef):
        how = plan.cut.get(id(v))
        if how is None:
            return v
        per, lead, tail, window = how
        key = (id(block_of(v)), v.storage_offset(), how)
        if key not in pieces:
            if window is None:
                piece = alias_piece(v, start * per, stop * per)
                piece = piece.view(*lead, stop - start, *tail) if lead or tail else piece
            elif isinstance(window, _Gathered):
                # (read by the host: its write-back, which pieces wait for on the device, ends first)
                whole = to_host(v).flatten(window.at, window.at + window.merged - 1)
                part = whole.narrow(window.at, start, stop - start).contiguous()
                piece = gathered_piece(part.view(*lead, stop - start, *tail))
            else:
                strides, span = window
                piece = alias_piece(v, start * per, (stop - 1) * per + span, (lead + (stop - start,) + tail, strides))
            pieces[key] = (piece, id(v) in written)
        return pieces[key][0]
    if isinstance(v, (list, tuple)):
        return v.__class__(_piece_of(e, plan, start, stop, written, pieces) for e in v)
    return v


def run_chunked(func, args, kwargs, spec: OpSpec, left: int, row: int = 1, broadcast: bool = False,
                cutter: Optional[Callable[[int, int], Optional[Callable[[int, int], int]]]] = None):
    """``func`` (elementwise, or a list op over one position) in chunks of its big tensors.

    The big tensors are those with the most elements (the op's shape); tensors with fewer
    (0-dim scalars, a step count, ``found_inf``) are passed whole to every chunk. With
    ``row`` > 1 the op works on each row of its last dimension alone (``log_softmax`` over
    it): chunks are whole rows, and each piece is seen as a matrix of them. With
    ``broadcast`` the op's tensors broadcast to its result's shape: chunks are ranges of the
    result's outer dimensions (``_plan``). ``cutter(elements, per_position)`` gives where
    chunks may end (``vector_loops.cutter``: ``cuts(start, most)``, 0 where none fits; ``None``:
    nowhere, the op is refused); without it any chunk will do.
    """
    layout = None
    if broadcast:
        args, layout = _in_result_order(func, args, kwargs, spec)
    plan = _plan(func, args, kwargs, spec, left, row, broadcast)
    chunk, units, per = plan.chunk, plan.units, plan.out_per_unit
    cuts = None if cutter is None else cutter(units * per, per)
    if cutter is not None and cuts is None:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    written = {id(b) for b in _written(spec, args, kwargs)}
    packet = func.overloadpacket.__name__
    outs = _new_results(plan, layout)
    partial: List = []
    retry = may_retry(spec)
    smallest = plan.aligns[-1]
    with held_on_host(plan.big + (outs or []), wait=False, read={id(t) for t in plan.big} - written):
        start = 0
        while start < units:
            stop = min(start + chunk, units) if cuts is None else cuts(start, chunk)
            if stop <= start:
                raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
            pieces: dict = {}
            cargs = [_piece_of(a, plan, start, stop, written, pieces) for a in args]
            ckwargs = {k: _piece_of(v, plan, start, stop, written, pieces) for k, v in kwargs.items()}
            try:
                with landing(outs, start * per, stop * per, spec) as host:
                    result = run_generic(func, cargs, ckwargs, spec)
            except OutOfBudgetError:
                smaller = max(chunk // 2 // smallest, 1) * smallest
                if not retry or smaller >= chunk:
                    raise
                chunk = smaller  # (the chunk did not fit after all: nothing was written, a smaller one is cut)
                del pieces, cargs, ckwargs
                continue
            write_back([p for p, w in pieces.values() if w])
            if plan.reduction:
                partial.append(result)
            elif outs is not None:
                for out, r in zip(outs, _flat_results(result)):
                    land(r, out, start * per, stop * per, host)
            del pieces, cargs, ckwargs, result
            start = stop
    if plan.reduction:
        return _combine(packet, args, kwargs, partial)
    if outs is None:
        return _in_place_result(spec, args, kwargs)
    return _shape_results(func, outs)


def _new_results(plan: _Cut, layout) -> Optional[list]:
    """The op's new results, in host memory: laid out as ``layout`` (``_in_result_order``)
    or as the big tensors, as plain torch lays out an elementwise op's result."""
    if plan.out_meta is None:
        return None
    shape, stride = layout or (plan.shape, plan.out_stride)
    return [host_result(shape, d, stride=stride, pinned=True) for d in plan.out_meta]


def _in_result_order(func, args, kwargs, spec: OpSpec):
    """``(args, layout)``: for a new result that plain torch lays out dense but not
    contiguous (its operands permuted alike: heads and positions of a scan swapped), the
    tensor arguments seen in the result's order of dimensions, where it is contiguous and
    is cut as any, and its ``(shape, stride)``, which the pieces' results land in by ranges
    of its bytes; else ``args`` as they are and ``None``."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if (not spec.allocates or spec.write_args or not tensors
            or any(isinstance(v, (list, tuple, torch.Tensor)) for v in kwargs.values())
            or any(isinstance(a, (list, tuple)) for a in args)
            or not all(isinstance(t, TensorRef) for t in tensors)):
        return args, None
    out = _flat_results(func(*[_meta(a, whole=True) for a in args], **kwargs))
    if len(out) != 1 or out[0].is_contiguous() or not dense(out[0]):
        return args, None
    rank = out[0].dim()
    order = sorted(range(rank), key=lambda i: -out[0].stride(i))  # (stable: ones keep their place)
    if not out[0].permute(order).is_contiguous() or any(t.dim() > rank for t in tensors):
        return args, None

    def seen(a):
        if not isinstance(a, TensorRef) or not a.dim():
            return a
        return a.view((1,) * (rank - a.dim()) + tuple(a.shape)).permute(order)

    return [seen(a) for a in args], (tuple(out[0].shape), out[0].stride())


def _written(spec, args, kwargs):
    out = []
    for i, name in spec.write_args:
        a = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(a, TensorRef):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(e for e in a if isinstance(e, TensorRef))
    return out


def _out_dtypes(func, args, kwargs) -> List[torch.dtype]:
    """dtypes of the op's new results, from a run on meta tensors of one element."""
    out = func(*[_meta(a) for a in args], **{k: _meta(v) for k, v in kwargs.items()})
    return [t.dtype for t in _flat_results(out)]


def _meta(v, whole: bool = False):
    """``v`` with its tensors as meta tensors: of one element, or of their own geometry (``whole``)."""
    if isinstance(v, torch.Tensor):
        if whole:
            return raw.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return raw.empty((1,) if v.dim() else (), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return v.__class__(_meta(e, whole) for e in v)
    return v


def _flat_results(result) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    flat = []
    for r in result:
        flat.extend(_flat_results(r))
    return flat


def _shape_results(func, outs):
    returns = func._schema.returns
    if len(returns) == 1 and isinstance(returns[0].type, torch._C.ListType):
        return outs
    return outs[0] if len(outs) == 1 else tuple(outs)


def _in_place_result(spec, args, kwargs):
    results = []
    for index in spec.return_args:
        if index is None:
            continue
        name = spec.func._schema.arguments[index].name
        results.append(args[index] if index < len(args) else kwargs[name])
    if not results:
        return None
    return results[0] if len(results) == 1 else tuple(results)


def _combine(packet, args, kwargs, partial):
    """One position's reduction from its chunks' results (each a one-element list; one
    tensor for ``linalg_vector_norm``)."""
    if packet == "linalg_vector_norm":  # (one tensor, not a list)
        return _combine("_foreach_norm", args, kwargs, [[p] for p in partial])[0]
    values = torch.stack([p[0] for p in partial])
    if packet == "_foreach_max":
        return [values.amax()]
    ord_ = kwargs.get("ord", args[1] if len(args) > 1 else 2)
    ord_ = float(ord_)
    if ord_ == float("inf"):
        return [values.amax()]
    if ord_ == float("-inf"):
        return [values.amin()]
    if ord_ == 0:
        return [values.sum()]
    return [torch.linalg.vector_norm(values, ord_)]
