"""Matrix products larger than the budget, in tiles of their output (Note
[Pieces] in ``pieces.py``, and ``split.py``): ``mm`` and ``addmm`` by columns (or rows),
``bmm`` and ``baddbmm`` by groups of batch elements and, within an element, by rows (or
columns), ``_grouped_mm`` by groups of experts, a batched triangular solve by groups of
its matrices (convolutions: ``split_convolutions.py``). Every output element is one
dot product over the same inputs as in one call: equal within rounding, not always bit for
bit, since the BLAS chooses its kernel and how it blocks the inner dimension by the shape
it is given (on the CPU as on CUDA: ``docs/concepts.md``)."""

from __future__ import annotations

import torch

from ..core import raw
from ..core.op_specs import OpSpec, implements, spec_of
from ..core.tensor_ref import TensorRef, block_of, host_view
from .dispatch import run_generic
from .pieces import gathered_piece, held_on_host, host_result, in_groups, settle, to_host
from .result_bounds import to_meta
from .split import block_bytes, chunk_elements, default, op_bytes, refs_bytes, refuse, when_refused

aten = torch.ops.aten


def _columns(plain: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of a plain host matrix as a new tensor, dense in the same order."""
    return plain[:, start:stop].clone(memory_format=torch.preserve_format)


#: tile widths: each output element is one dot product whatever the tile, so any width
#: does; wide tiles are cheaper
TILE_ALIGNS = (64, 8, 1)


@implements(aten.mm.default)
@when_refused
def mm(func, args, kwargs, spec: OpSpec, left: int):
    """``a @ b`` in tiles of the output's columns (or rows) when it does not fit."""
    if kwargs:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    a, b = args
    return _matmul_tiles(func, args, kwargs, spec, left, a, b, None)


@implements(aten.addmm.default)
@when_refused
def addmm(func, args, kwargs, spec: OpSpec, left: int):
    """``bias + a @ b`` (a ``Linear`` with a bias) in tiles as ``mm``, each with its part of a
    bias of one value per column."""
    bias, a, b = args if len(args) == 3 else (None, None, None)
    if kwargs or not (isinstance(bias, TensorRef) and bias.dim() == 1 and bias.shape[0] == b.shape[-1]):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    return _matmul_tiles(func, args, kwargs, spec, left, a, b, bias)


def _matmul_tiles(func, args, kwargs, spec: OpSpec, left: int, a, b, bias):
    if not (isinstance(a, TensorRef) and isinstance(b, TensorRef)):
        return default(func, args, kwargs, spec)
    a_bytes, b_bytes = refs_bytes([a]), refs_bytes([b])
    bias_bytes = refs_bytes([bias]) if bias is not None else 0
    m, k = a.shape
    n = b.shape[1]
    out_size = a.element_size()
    if a_bytes <= b_bytes:
        # Tiles of columns: all of a, then b[:, j:j+w], the bias's [j:j+w] and out[:, j:j+w] per tile.
        pieces = (k * b.element_size(), m * out_size) + ((bias.element_size(),) if bias is not None else ())
        width = chunk_elements(sum(pieces), a_bytes, left, n, spec.name, TILE_ALIGNS, pieces)
        return _tiles(func, a, b, width, n, columns=True, bias=bias)
    pieces = (k * a.element_size(), n * out_size)
    height = chunk_elements(sum(pieces), b_bytes + bias_bytes, left, m, spec.name, TILE_ALIGNS, pieces)
    return _tiles(func, a, b, height, m, columns=False, bias=bias)


def _tiles(func, a, b, step, count, columns: bool, bias=None):
    spec = spec_of(func)
    tiled = b if columns else a
    settle([tiled] + ([bias] if bias is not None and columns else []))
    whole = host_view(tiled).detach()
    out = host_result((a.shape[0], b.shape[1]), a.dtype)  # (mm takes one dtype)
    with held_on_host([out]):
        out_host = host_view(out)
        for start in range(0, count, step):
            stop = min(start + step, count)
            if columns:
                piece = gathered_piece(_columns(whole, start, stop))
                operands = [a, piece]
                if bias is not None:
                    operands.insert(0, gathered_piece(host_view(bias).detach()[start:stop].clone()))
                result = run_generic(func, operands, {}, spec)
                out_host[:, start:stop].copy_(to_host(result))
            else:
                piece = gathered_piece(whole[start:stop].clone(memory_format=torch.preserve_format))
                operands = [piece, b] if bias is None else [bias, piece, b]
                result = run_generic(func, operands, {}, spec)
                out_host[start:stop].copy_(to_host(result))
            del piece, result, operands
    return out


def in_order(view: torch.Tensor) -> torch.Tensor:
    """A dense host copy of plain ``view`` laid out in the order of its strides: a part of a
    transposed matrix stays transposed, so the BLAS reads each piece as it read the whole."""
    order = sorted(range(view.dim()), key=lambda d: -view.stride(d))
    laid = raw.empty([view.shape[d] for d in order], dtype=view.dtype)
    copy = laid.permute([order.index(d) for d in range(view.dim())])
    return copy.copy_(view)


def part_of(t: TensorRef, dim: int, start: int, n: int) -> TensorRef:
    """A piece holding indices ``start`` to ``start + n`` of settled ``t``'s dimension
    ``dim``, gathered from its host copy in the order of its strides (``in_order``)."""
    return gathered_piece(in_order(host_view(t).detach().narrow(dim, start, n)))


#: the positions of a batched product's operands (bias, a, b) that a tile of its output's
#: rows (dimension 1) or columns (2) cuts: the bias and ``a`` by rows, the bias and ``b`` by columns
_CUT_BY = {1: (True, True, False), 2: (True, False, True)}


@implements([aten.bmm.default, aten.baddbmm.default])
@when_refused
def bmm(func, args, kwargs, spec: OpSpec, left: int):
    """A batched product (attention's scores and their use) when it does not fit: in groups
    of whole batch elements, or, where one element is larger than the room, element by
    element in tiles of its output's rows (or columns) as ``mm``. Each output element is one
    dot product, as in one call."""
    bias, (a, b) = (None, args) if func is aten.bmm.default else (args[0], args[1:3])
    operands = (bias, a, b)
    refs = [t for t in operands if t is not None]
    if (len(args) != (2 if bias is None else 3) or not all(isinstance(t, TensorRef) and t.dim() == 3 for t in refs)
            or any(t.shape[0] not in (1, a.shape[0]) for t in refs)
            or bias is not None and (bias.shape[1] not in (1, a.shape[1]) or bias.shape[2] not in (1, b.shape[2]))):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    count, n, m = a.shape[0], a.shape[1], b.shape[2]
    batched = [t for t in refs if t.shape[0] == count]
    shared = refs_bytes([t for t in refs if t.shape[0] != count])  # (broadcast over the batch: whole)
    pieces = [t.numel() // count * t.element_size() for t in batched] + [n * m * a.element_size()]
    if count > 1 and shared + sum(block_bytes(p) for p in pieces) <= left:
        step = chunk_elements(sum(pieces), shared, left, count, spec.name, (1,), pieces)
        tiles = [(slice(s, min(s + step, count)), slice(None), slice(None)) for s in range(0, count, step)]
    else:
        tiles = _element_tiles(operands, count, n, m, left, spec.name)
    settle(refs)
    out = host_result((count, n, m), a.dtype)
    kept: dict = {}  # operand position -> (its part's index, the piece): reused by the next tile
    with held_on_host([out]):
        out_host = host_view(out)
        for tile in tiles:
            parts = [None if t is None else _part(t, at, tile, count, kept) for at, t in enumerate(operands)]
            result = run_generic(func, [p for p in parts if p is not None], kwargs, spec)
            out_host[tile].copy_(to_host(result))
            del parts, result
    return out


def _element_tiles(operands, count: int, n: int, m: int, left: int, name: str):
    """Tiles of each batch element's output rows (or, where ``b`` is the larger operand, its
    columns) small enough for ``left``: the operands a tile cuts come in parts, the others
    whole (an element of them, where they have one per element)."""
    bias, a, b = operands
    dim = 1 if a.shape[1] * a.shape[2] * a.element_size() >= b.shape[1] * b.shape[2] * b.element_size() else 2
    units = (n, m)[dim - 1]
    fixed, per_unit = 0, [(n + m - units) * a.element_size()]  # (the result's part: a row or a column)
    for t, cut in zip(operands, _CUT_BY[dim]):
        if t is None:
            continue
        element = t.numel() // t.shape[0] * t.element_size()
        if cut and t.shape[dim] == units:
            per_unit.append(element // units)
        else:
            fixed += refs_bytes([t]) if t.shape[0] != count else block_bytes(element)
    step = chunk_elements(sum(per_unit), fixed, left, units, name, TILE_ALIGNS, per_unit)
    return [(slice(i, i + 1),) + ((slice(s, min(s + step, units)), slice(None)) if dim == 1
                                  else (slice(None), slice(s, min(s + step, units))))
            for i in range(count) for s in range(0, units, step)]


def _part(t: TensorRef, at: int, tile, count: int, kept: dict):
    """The part of settled operand ``t`` (position ``at`` in (bias, a, b)) that ``tile`` of
    the output reads: ``t`` itself where that is all of it and of its block, else a piece
    (the previous tile's, where it read the same part). (A view of a larger block, one slice
    of an attention's values, would bring all its block in: its part is gathered.)"""
    batch, rows, columns = tile
    index = (batch if t.shape[0] == count else slice(None),
             rows if at != 2 and t.shape[1] != 1 else slice(None),
             columns if at != 1 and t.shape[2] != 1 else slice(None))
    if (all(s == slice(None) or (s.start, s.stop) == (0, size) for s, size in zip(index, t.shape))
            and block_bytes(block_of(t).nbytes) <= block_bytes(t.numel() * t.element_size())):
        return t
    key = tuple((s.start, s.stop) for s in index)
    if at in kept and kept[at][0] == key:
        return kept[at][1]
    piece = gathered_piece(in_order(host_view(t).detach()[index]))
    kept[at] = (key, piece)
    return piece


# -- grouped products (a mixture of experts' experts, all in one call) ----------------------

#: tile widths of a grouped product's weight gradient: its kernel wants rows of a multiple
#: of 16 bytes
_GROUPED_ALIGNS = (64, 16)


@implements(aten._grouped_mm.default)
@when_refused
def grouped_mm(func, args, kwargs, spec: OpSpec, left: int):
    """Every expert's product in one call (``_grouped_mm`` with ``offs``, the cumulative end
    of each expert's rows: transformers' experts) when it does not fit, in groups of whole
    experts: each group's rows and weights, its offsets counted from its first row. The
    forward (and input gradient) ``(rows, in) @ (experts, in, out)``, one expert larger than
    the room in tiles of its rows; the weight gradient ``(in, rows) @ (rows, out)`` giving
    ``(experts, in, out)``, one expert larger than the room in tiles of its columns. Each
    output element is one dot product over the same values, as in one call; rows after the
    last expert's, which the kernel does not compute, are zero."""
    a, b = args[:2]
    rest = dict(zip(("offs", "bias", "out_dtype"), args[2:]), **kwargs)
    offs = rest.pop("offs", None)
    if (rest.get("bias") is not None or set(rest) - {"bias", "out_dtype"}
            or not all(isinstance(t, TensorRef) for t in (a, b, offs))
            or a.dim() != 2 or b.dim() not in (2, 3) or offs.dim() != 1):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    weights_grad = b.dim() == 2
    out_dtype = rest.get("out_dtype") or a.dtype
    settle([a, b, offs])
    whole_a, whole_b, whole_offs = (host_view(t).detach() for t in (a, b, offs))
    ends = whole_offs.tolist()
    out = host_result((len(ends), a.shape[0], b.shape[1]) if weights_grad else (a.shape[0], b.shape[2]),
                      out_dtype, zero=True)
    options = {"out_dtype": rest["out_dtype"]} if "out_dtype" in rest else {}
    with held_on_host([out]):
        out_host = host_view(out)
        for first, stop, rows, columns in _expert_tiles(a, b, offs, ends, out_dtype, left, spec.name):
            parts = [whole_a[:, rows] if weights_grad else whole_a[rows],
                     whole_b[rows, columns] if weights_grad else whole_b[first:stop]]
            parts = [gathered_piece(in_order(p)) for p in parts]
            parts.append(gathered_piece((whole_offs[first:stop] - rows.start).clamp_(0, rows.stop - rows.start)))
            result = run_generic(func, parts, options, spec)
            (out_host[first:stop, :, columns] if weights_grad else out_host[rows]).copy_(to_host(result))
            del parts, result
    return out


def _expert_tiles(a, b, offs, ends, out_dtype, left: int, name: str):
    """(first expert, stop, rows, columns) of each call of ``grouped_mm``: consecutive
    experts while their pieces fit ``left``; one expert larger than that in tiles of its
    rows (the forward) or of its result's columns (the weight gradient, a sum over rows)."""
    weights_grad = b.dim() == 2
    ka, kb = a.element_size(), b.element_size()
    ko = torch.empty((), dtype=out_dtype).element_size()
    inner, width = a.shape[1 - weights_grad], b.shape[-1]
    offs_bytes = block_bytes(offs.element_size())

    def sizes(experts: int, rows: int):
        """(bytes per row, bytes per column, bytes fixed) of the pieces of ``experts``."""
        if weights_grad:  # (pieces ``(inner, rows)`` and ``(rows, width)``, a result of ``experts``)
            return (inner * ka, width * kb), (rows * kb, experts * inner * ko), experts * inner * width * ko
        return (inner * ka, width * ko), (), experts * inner * width * kb

    def need(experts: int, rows: int) -> int:
        per_row, _per_column, fixed = sizes(experts, rows)
        return sum(block_bytes(rows * p) for p in per_row) + block_bytes(fixed) + block_bytes(experts * offs_bytes)

    tiles, first, whole = [], 0, slice(None)
    starts = [0] + ends[:-1]
    while first < len(ends):
        stop, count = first + 1, ends[first] - starts[first]
        if count == 0:  # (an expert given no rows computes nothing: its result stays zero)
            pass
        elif need(1, count) > left:  # one expert larger than the room
            per_row, per_column, _ = sizes(1, count)
            if weights_grad:
                step = chunk_elements(sum(per_column), block_bytes(count * inner * ka) + offs_bytes, left, width,
                                      name, _GROUPED_ALIGNS, per_column)
                tiles += [(first, stop, slice(starts[first], ends[first]), slice(c, c + step))
                          for c in range(0, width, step)]
            else:
                step = chunk_elements(sum(per_row), block_bytes(inner * width * kb) + offs_bytes, left, count,
                                      name, TILE_ALIGNS, per_row)
                tiles += [(first, stop, slice(r, min(r + step, ends[first])), whole)
                          for r in range(starts[first], ends[first], step)]
        else:
            while stop < len(ends) and need(stop + 1 - first, ends[stop] - starts[first]) <= left:
                stop += 1
            if ends[stop - 1] > starts[first]:  # (experts given no rows compute nothing)
                tiles.append((first, stop, slice(starts[first], ends[stop - 1]), whole))
        first = stop
    return tiles


# -- triangular solves (a gated delta rule's chunks) ----------------------------------------

@implements(aten.linalg_solve_triangular.default)
@when_refused
def solve_triangular(func, args, kwargs, spec: OpSpec, left: int):
    """A batched triangular solve when it does not fit: in groups of the outermost batch
    dimension of its result longer than one (an operand broadcast along it given whole),
    each matrix solved by itself as in one call, the groups' results copied into their
    places in a result in host memory."""
    operands = args[:2]
    if len(args) != 2 or not all(isinstance(t, TensorRef) for t in operands):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    meta = func(*to_meta(list(operands)), **kwargs)
    rank = meta.dim()
    d = next((i for i in range(rank - 2) if meta.shape[i] > 1), None)
    if d is None:  # (one matrix: its columns' solves are not cut apart)
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    count = meta.shape[d]
    cut = [t.dim() >= rank - d and t.shape[d - rank] == count for t in operands]
    pieces = [t.numel() // count * t.element_size() for t, c in zip(operands, cut) if c]
    pieces.append(meta.numel() // count * meta.element_size())
    shared = refs_bytes([t for t, c in zip(operands, cut) if not c])
    step = chunk_elements(sum(pieces), shared, left, count, spec.name, (1,), pieces)
    settle(list(operands))
    out = host_result(meta.shape, meta.dtype, stride=meta.stride())
    in_groups(out, d, count, step, lambda start, n: run_generic(
        func, [part_of(t, d - rank, start, n) if c else t for t, c in zip(operands, cut)], kwargs, spec))
    return out
