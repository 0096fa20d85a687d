"""Ops larger than the budget, split where the math allows.

An op whose own tensors do not fit the budget together cannot run as one kernel. Some can
run as several kernels on *pieces* of their tensors, each piece small enough:

- elementwise ops (and each position of a list op): consecutive chunks of the flattened
  tensors; every element is computed by the same kernel from the same inputs, so the bits
  are those of one call;
- elementwise ops that broadcast (``torch.outer``, a bias added to every row), and ``cat``
  along an inner dimension: ranges of the result's outer dimensions, each tensor as long
  there cut alike, the others given whole;
- reductions (``_foreach_norm``, ``_foreach_max``): one result per chunk, then combined
  (max and min exactly; a 2-norm as the norm of the chunks' norms: equal up to rounding,
  not bit for bit, since one kernel sums in another order);
- ``embedding``: only the rows the indices name are read; its backward
  (``embedding_dense_backward``) computes the gradient of those rows and places them in a
  full-size gradient kept in host memory;
- ``mm``: tiles of the output's columns (or rows), each reading the matching columns of
  the second operand (rows of the first); every output element is one dot product as in
  one call;
- ``softmax`` and ``log_softmax`` over the last dimension, and their backward: chunks of
  whole rows (each row is computed alone, by the same kernel, whatever the other rows).

Each runs on *pieces* of its big tensors (Note [Pieces] in ``pieces.py``).

The handlers of those ops are in ``split_handlers.py``; the list ops use ``run_chunked``
from ``foreach.py``.

What cannot be split (a matrix product whose two operands are both too large, a
reduction of other kinds, a non-contiguous big tensor) raises ``OutOfBudgetError`` naming
the op and the smallest budget that works.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch

from ..core import raw
from ..core.errors import OutOfBudgetError
from ..core.op_specs import OpSpec
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as mgr
from . import dispatch
from .dispatch import run_generic
from .output_size import estimate_output_bytes
from .pieces import alias_piece, dense, held_on_host, host_result, land, landing, write_back

aten = torch.ops.aten

#: chunks are multiples of this many elements (and start at such multiples): the kernels'
#: vector loops then split every chunk as they split the whole tensor
ALIGN = 4096
#: the smallest chunk when room is short (still a multiple of any vector width)
MIN_ALIGN = 64


# -- room and sizes ----------------------------------------------------------------------

def room() -> Optional[int]:
    """Bytes one op may hold on the device now: the budget less what the device holds
    outside the manager and the blocks pinned there; ``None`` without a budget."""
    limit = mgr.limit
    if limit is None or mgr.backend.passthrough:
        return None
    with mgr.lock:
        pinned = sum(b.dev_bytes for b in mgr.books.resident.values() if b.pins)
        return limit - mgr.read_outside() - pinned


def block_bytes(nbytes: int) -> int:
    """Device bytes an allocation of ``nbytes`` may take, as the budget counts it: the
    device's allocator rounds sizes up (512 bytes on CUDA, more for large ones) and may give
    a large one a larger block (Note [Room for the allocator's slack]), so pieces sized by
    their exact bytes would not fit the room they were cut for."""
    return mgr.alloc_bytes(nbytes)


def refs_bytes(values, seen=None) -> int:
    """Device bytes of the distinct blocks of the TensorRefs among ``values`` (one level of
    lists), host-only blocks excepted; ``seen`` (block ids) is updated."""
    seen = set() if seen is None else seen
    total = 0
    for v in values:
        if isinstance(v, TensorRef):
            b = block_of(v)
            if b.id not in seen and not b.host_only:
                seen.add(b.id)
                total += block_bytes(b.nbytes)
        elif isinstance(v, (list, tuple)):
            total += refs_bytes(v, seen)
    return total


def op_bytes(spec: OpSpec, args, kwargs, out_bytes: Optional[int] = None) -> int:
    """What the op needs resident at once: its TensorRefs' blocks and its new results
    (``out_bytes`` where the caller knows them, else estimated from its schema)."""
    need = refs_bytes(list(args) + list(kwargs.values()))
    if out_bytes is not None:
        need += out_bytes
    elif spec.allocates:
        need += estimate_output_bytes(spec, args, kwargs)
    return need


def refuse(name: str, smallest: int, left: int):
    """``OutOfBudgetError`` for an op that needs ``smallest`` bytes of room where ``left`` is left."""
    outside = mgr.limit - left
    return OutOfBudgetError(name, smallest + outside, mgr.limit,
                            f"it cannot be split into smaller pieces; a budget of "
                            f"{smallest + outside} bytes runs it", outside=outside)


def default(func, args, kwargs, spec: OpSpec):
    """The dispatcher's own paths for an op that fits (a view of a block on disk reads nothing)."""
    return dispatch.run_unhandled(func, args, kwargs, spec)


def fits(spec: OpSpec, args, kwargs, out_bytes: Optional[int] = None) -> Optional[int]:
    """``None`` when the op fits (or there is no budget), else the room left (``out_bytes``:
    as in :func:`op_bytes`).

    Without a budget nothing is split: the device's capacity is then the limit, and checking
    every add and view against it cost more than it ever saved (``benchmarks/op_paths.py``).
    """
    limit = mgr.limit
    if mgr.settings.budget_value is None or limit is None or mgr.backend.passthrough:
        return None
    need = op_bytes(spec, args, kwargs, out_bytes)
    if need + mgr.accounting.elsewhere_bytes <= limit:
        return None  # the common case, without reading the device or the pins
    left = room()
    if left is None or need <= left:
        return None
    return left


def when_refused(split_fn):
    """The handler of an op that runs whole by the dispatcher's own paths and, where they
    refuse it for the budget, as ``split_fn(func, args, kwargs, spec, left)`` with the room
    ``left``. The generic path refuses before the op changes anything (``may_retry``), so
    the op that fits, nearly every call, pays no check of its own bytes here."""
    def handler(func, args, kwargs, spec: OpSpec):
        try:
            return default(func, args, kwargs, spec)
        except OutOfBudgetError:
            left = fits(spec, args, kwargs) if may_retry(spec) else None
            if left is None:
                raise
        return split_fn(func, args, kwargs, spec, left)
    handler.__name__ = handler.__qualname__ = split_fn.__name__
    handler.__doc__ = split_fn.__doc__
    return handler


def chunk_elements(per_element: int, fixed: int, left: int, numel: int, name: str,
                   aligns=(ALIGN, MIN_ALIGN), pieces: Sequence[int] = ()) -> int:
    """Elements per chunk so that ``fixed`` and a chunk's pieces fit in ``left``, a multiple
    of the first of ``aligns`` that fits (or all ``numel``). ``pieces``: the bytes per
    element of each piece a chunk allocates on its own (default: one of ``per_element``);
    each is counted as the device's allocator rounds it (:func:`block_bytes`)."""
    sizes = tuple(pieces) or (per_element,)

    def need(n: int) -> int:
        return fixed + sum(block_bytes(n * size) for size in sizes)

    for align in aligns:
        n = min(numel, (left - fixed) // max(per_element, 1))
        if n < numel:
            n = n // align * align
        while n > 0 and need(n) > left:  # (the rounding of the pieces' sizes)
            n = (n - 1) // align * align
        if n > 0:
            return n
    raise refuse(name, need(min(numel, aligns[-1])), left)


# -- elementwise ops and list positions ----------------------------------------------------

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


class _Cut(NamedTuple):
    """How ``run_chunked`` cuts an op: along ``units`` positions of its result, ``chunk`` of
    them at a time. Each tensor of ``cut`` (by ``id``) is cut into pieces: it holds
    ``cut[id][0]`` elements a position, in one range of its bytes, and its piece of ``n``
    positions has the shape ``lead + (n,) + tail`` (``cut[id][1:]``); the other tensors are
    given whole to every chunk. A new result holds ``out_per_unit`` elements a position."""

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
    numel = max((t.numel() for t in tensors), default=0)
    big = [t for t in tensors if t.numel() == numel]
    if not big or numel == 0:
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    shape, stride = big[0].shape, big[0].stride()
    # (pieces alias ranges of the bytes: a lazily conjugated or negated view has no such range)
    if (any(t.shape != shape or t.stride() != stride or t.is_conj() or t.is_neg() for t in big)
            or not (big[0].is_contiguous() if row > 1 else dense(big[0]))):
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    tail = (row,) if row > 1 else ()
    cut = {id(t): (row, (), tail) for t in big}
    reduction = func.overloadpacket.__name__ in _REDUCTIONS
    out_meta = None
    if spec.allocates and not reduction:
        out_meta = _out_dtypes(func, args, kwargs)
    aligns = (1,) if row > 1 else (ALIGN, MIN_ALIGN)
    return _sized(spec, args, kwargs, left, tensors, cut, numel // row, aligns, tuple(shape), row,
                  None if big[0].is_contiguous() else tuple(stride), reduction, out_meta)


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
    if d is None or not out[0].is_contiguous():
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
    units = _numel(shape[d:end])
    cut = {}
    for t in tensors:
        at = cut_at.get(id(t))
        if at is not None:
            if not t.is_contiguous() or t.is_conj() or t.is_neg():
                raise refuse(name, op_bytes(spec, args, kwargs), left)
            # (a piece keeps the rank: its positions in one dim, ones for the others cut)
            cut[id(t)] = (_numel(t.shape[end - d + at:]), tuple(t.shape[:at]),
                          (1,) * (end - d - 1) + tuple(t.shape[end - d + at:]))
    if not cut:
        raise refuse(name, op_bytes(spec, args, kwargs), left)
    out_meta = [out[0].dtype] if spec.allocates else None
    return _sized(spec, args, kwargs, left, tensors, cut, units, (1,), shape, _numel(shape[end:]), None,
                  False, out_meta)


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
    pieces = [t.element_size() * cut[id(t)][0] for t in {id(block_of(t)): t for t in big}.values()]
    if out_meta is not None:
        pieces += [d.itemsize * out_per_unit for d in out_meta]
    if reduction:
        fixed += block_bytes(8)  # each chunk's result (one value)
    chunk = chunk_elements(sum(pieces), fixed, left, units, spec.name, aligns=aligns, pieces=pieces)
    return _Cut(cut, big, units, chunk, aligns, shape, out_per_unit, out_stride, reduction, out_meta)


def may_retry(spec: OpSpec) -> bool:
    """Whether a piece of the op that raised ``OutOfBudgetError`` can be run again, smaller.

    The room a piece was cut for is an estimate (what the device holds outside the manager
    moves, the allocator rounds). The generic path raises before the kernel when the op's
    blocks do not fit, so nothing was written; an op that writes in place *and* returns new
    tensors could have raised after its kernel, while its results were adopted: it is not
    run twice."""
    return not (spec.write_args and spec.allocates)


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
        per, lead, tail = how
        key = (id(block_of(v)), v.storage_offset(), how)
        if key not in pieces:
            piece = alias_piece(v, start * per, stop * per)
            pieces[key] = (piece.view(*lead, stop - start, *tail) if lead or tail else piece, id(v) in written)
        return pieces[key][0]
    if isinstance(v, (list, tuple)):
        return v.__class__(_piece_of(e, plan, start, stop, written, pieces) for e in v)
    return v


def run_chunked(func, args, kwargs, spec: OpSpec, left: int, row: int = 1, broadcast: bool = False):
    """``func`` (elementwise, or a list op over one position) in chunks of its big tensors.

    The big tensors are those with the most elements (the op's shape); tensors with fewer
    (0-dim scalars, a step count, ``found_inf``) are passed whole to every chunk. With
    ``row`` > 1 the op works on each row of its last dimension alone (``log_softmax`` over
    it): chunks are whole rows, and each piece is seen as a matrix of them. With
    ``broadcast`` the op's tensors broadcast to its result's shape: chunks are ranges of the
    result's outer dimensions (``_plan``).
    """
    plan = _plan(func, args, kwargs, spec, left, row, broadcast)
    chunk, units, per = plan.chunk, plan.units, plan.out_per_unit
    written = {id(b) for b in _written(spec, args, kwargs)}
    packet = func.overloadpacket.__name__
    outs = None
    if plan.out_meta is not None:
        # (laid out as the big tensors, as plain torch lays out an elementwise op's result)
        outs = [host_result(plan.shape, d, stride=plan.out_stride, pinned=True) for d in plan.out_meta]
    partial: List = []
    retry = may_retry(spec)
    smallest = plan.aligns[-1]
    with held_on_host(plan.big + (outs or []), wait=False):
        start = 0
        while start < units:
            stop = min(start + chunk, units)
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
