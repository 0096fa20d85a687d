"""The ops that run in pieces when they are larger than the budget (Note [Pieces] in
``pieces.py``, and ``split.py``): ``embedding`` and its backward by rows, ``mm`` by
tiles of its output, the elementwise ops a training step runs on whole parameters by
chunks (by rows where they broadcast, and ``cat`` along an inner dimension), views of big
tensors without moving bytes, and a whole tensor's norm by chunks.

Each handler runs its op by the dispatcher's own paths first and splits it only where they
refuse it for the budget (``split.when_refused``); ``embedding`` also reads rows alone by choice.
"""

from __future__ import annotations

import torch

from ..core.errors import OutOfBudgetError
from ..core import raw
from ..core.op_specs import OpSpec, implements, spec_of
from ..core.tensor_ref import TensorRef, block_of, host_copy, host_view
from ..memory.manager import tensorsManager as mgr
from .dispatch import run_generic, view_on_disk
from .output_size import estimate_output_bytes
from .pieces import gathered_piece, held_on_host, host_result, settle, to_host
from . import vector_loops
from .chunks import by_positions, run_chunked, tensors_of
from .split import block_bytes, chunk_elements, default, fits, op_bytes, refs_bytes, refuse, room, when_refused

aten = torch.ops.aten


# -- embedding ------------------------------------------------------------------------------

def _host_values(ref) -> torch.Tensor:
    if not isinstance(ref, TensorRef):
        # (a plain device tensor too: a loop on plain tensors gives its ids as they are,
        # Note [Loops on plain tensors] in ``regions/scope.py``)
        return ref.detach().to("cpu", copy=True)
    with mgr.lock:
        mgr.sync_host(block_of(ref))
        return host_view(ref).detach().clone()


def _remapped(indices):
    """(the distinct rows the indices name, the indices renumbered into them, as a piece)."""
    values = _host_values(indices)
    rows, inverse = torch.unique(values, sorted=True, return_inverse=True)
    return rows, gathered_piece(inverse.to(values.dtype).reshape(values.shape))


#: an embedding whose rows take at most this fraction of its table reads them alone, table
#: fitting or not, where the table has at least ``ROWS_MIN_TABLE`` bytes (Note [Rows of a table])
ROWS_FRACTION = 1 / 8
#: the host waits for indices computed on the device (a round trip of tens of microseconds,
#: and the device's queue drained): worth it for a table whose copy takes longer (a copy
#: of 4 MiB takes over a hundred microseconds on a host-to-device link)
ROWS_MIN_TABLE = 4 << 20


def reads_rows_alone(weight) -> bool:
    """Whether an embedding of the table ``weight`` reads the rows it needs alone, given few
    enough of them (Note [Rows of a table]): a table of ``ROWS_MIN_TABLE`` bytes or more,
    under a budget, with no gradient to record."""
    if (not isinstance(weight, TensorRef) or mgr.settings.budget_value is None or mgr.limit is None
            or mgr.backend.passthrough):
        return False
    if torch.is_grad_enabled() and weight.requires_grad:
        return False  # (training: the table is read and written whole by the step anyway)
    block = block_of(weight)
    return not block.host_only and block.nbytes >= ROWS_MIN_TABLE


def _rows_alone(weight: TensorRef, indices) -> bool:
    """Note [Rows of a table]: under a budget, with no gradient to record, an embedding whose
    rows are few reads them from the table's host copy instead of bringing the whole table
    in. Decoding reads one row per step: brought in whole, a 32,000-token table of a 1.1B
    Llama (131 MB of bf16) would be moved for each token, or hold a share of the budget the
    layers need. The host reads the indices to gather the rows: where the device computed
    them (the last token), it waits for them, as ``.item()`` would, which a decoding loop
    does at each step anyway; so a table smaller than ``ROWS_MIN_TABLE`` is read whole.
    Whether an op reads its rows alone hangs on its sizes, not on where the table is at the
    time, so that a loop's ops stay the same from step to step (Flow's period). The table's
    device copy, if any, stays (an output layer may share it)."""
    row = weight.shape[1] * weight.element_size()
    return reads_rows_alone(weight) and indices.numel() * row <= ROWS_FRACTION * block_of(weight).nbytes


@implements(aten.embedding.default)
def embedding(func, args, kwargs, spec: OpSpec):
    """The rows the indices name, read alone when the table does not fit or when they are a
    small part of it with no gradient to record (Note [Rows of a table])."""
    weight = args[0]
    if not isinstance(weight, TensorRef) or kwargs or weight.dim() != 2:
        return default(func, args, kwargs, spec)
    left = fits(spec, args, kwargs)
    if left is None and not _rows_alone(weight, args[1]):
        return default(func, args, kwargs, spec)
    rows, local = _remapped(args[1])
    if left is not None:  # (the table does not fit: it leaves the device)
        settle([weight])
        need = rows.numel() * weight.shape[1] * weight.element_size() + block_of(local).nbytes
        need += estimate_output_bytes(spec, args, kwargs)
        if need > left:
            raise refuse(spec.name, need, left)
    with mgr.lock:
        mgr.sync_host(block_of(weight))  # (settled: nothing to copy; else its device copy stays)
        table = host_view(weight).detach().index_select(0, rows)
    # padding_idx changes only the backward: the forward is a gather
    return run_generic(func, [gathered_piece(table), local, -1] + list(args[3:]), {}, spec)


@implements(aten.embedding_dense_backward.default)
@when_refused
def embedding_dense_backward(func, args, kwargs, spec: OpSpec, left: int):
    """The gradient of the rows the indices name, placed in a full-size host gradient."""
    if kwargs:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    grad, indices, num_weights, padding_idx, scale = args
    rows, local = _remapped(indices)
    hits = (rows == padding_idx).nonzero()
    local_padding = int(hits[0, 0]) if padding_idx >= 0 and hits.numel() else -1
    part = run_generic(func, [grad, local, rows.numel(), local_padding, scale], {}, spec)
    out = host_result((num_weights, grad.shape[-1]), grad.dtype, zero=True)
    host_view(out).index_copy_(0, rows, to_host(part))
    return out


# -- matrix products ------------------------------------------------------------------------

def _columns(plain: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of a plain host matrix as a new tensor, dense in the same order."""
    return plain[:, start:stop].clone(memory_format=torch.preserve_format)


#: tile widths: each output element is one dot product whatever the tile, so any width
#: gives the bits of one call; wide tiles are cheaper
_TILE_ALIGNS = (64, 8, 1)


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
        width = chunk_elements(sum(pieces), a_bytes, left, n, spec.name, _TILE_ALIGNS, pieces)
        return _tiles(func, a, b, width, n, columns=True, bias=bias)
    pieces = (k * a.element_size(), n * out_size)
    height = chunk_elements(sum(pieces), b_bytes + bias_bytes, left, m, spec.name, _TILE_ALIGNS, pieces)
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


def _in_order(view: torch.Tensor) -> torch.Tensor:
    """A dense host copy of plain ``view`` laid out in the order of its strides: a part of a
    transposed matrix stays transposed, so the BLAS reads each piece as it read the whole."""
    order = sorted(range(view.dim()), key=lambda d: -view.stride(d))
    laid = raw.empty([view.shape[d] for d in order], dtype=view.dtype)
    copy = laid.permute([order.index(d) for d in range(view.dim())])
    return copy.copy_(view)


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
    step = chunk_elements(sum(per_unit), fixed, left, units, name, _TILE_ALIGNS, per_unit)
    return [(slice(i, i + 1),) + ((slice(s, min(s + step, units)), slice(None)) if dim == 1
                                  else (slice(None), slice(s, min(s + step, units))))
            for i in range(count) for s in range(0, units, step)]


def _part(t: TensorRef, at: int, tile, count: int, kept: dict):
    """The part of settled operand ``t`` (position ``at`` in (bias, a, b)) that ``tile`` of
    the output reads: ``t`` itself where that is all of it, else a piece (the previous
    tile's, where it read the same part)."""
    batch, rows, columns = tile
    index = (batch if t.shape[0] == count else slice(None),
             rows if at != 2 and t.shape[1] != 1 else slice(None),
             columns if at != 1 and t.shape[2] != 1 else slice(None))
    if all(s == slice(None) or (s.start, s.stop) == (0, size) for s, size in zip(index, t.shape)):
        return t
    key = tuple((s.start, s.stop) for s in index)
    if at in kept and kept[at][0] == key:
        return kept[at][1]
    piece = gathered_piece(_in_order(host_view(t).detach()[index]))
    kept[at] = (key, piece)
    return piece


# -- elementwise ops a training step runs on whole parameters -------------------------------

#: in-place and out-of-place elementwise ops that meet tensors as large as a parameter
#: (gradient accumulation, ``zero_grad(set_to_none=False)``, manual updates, a weight
#: normalized by its own statistic: ``w / w.std()``)
POINTWISE = [
    aten.add_.Tensor, aten.add.Tensor, aten.sub_.Tensor, aten.sub.Tensor, aten.mul_.Tensor, aten.mul_.Scalar,
    aten.mul.Tensor, aten.div_.Tensor, aten.div.Tensor, aten.zero_.default, aten.fill_.Scalar, aten.lerp_.Scalar,
]


#: elementwise ops whose results are exact (a choice, a sign, a comparison): the same bits
#: in pieces on every device; an attention's mask meets scores larger than a small budget
EXACT = [
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor,
    aten.masked_fill_.Tensor, aten.relu.default, aten.relu_.default, aten.neg.default, aten.abs.default,
    aten.maximum.default, aten.minimum.default, aten.clamp.default, aten.clamp_.default, aten.logical_not.default,
    *(getattr(getattr(aten, name), overload) for name in ("eq", "ne", "lt", "le", "gt", "ge")
      for overload in ("Tensor", "Scalar")),
]


@implements(POINTWISE + EXACT)
@when_refused
def pointwise(func, args, kwargs, spec: OpSpec, left: int):
    """An elementwise op in chunks when its tensors do not fit together: ranges of their
    elements where they have one shape (0-d scalars aside), else ranges of the result's
    outer dimension (``torch.outer(a, b)`` as ``a[:, None] * b``)."""
    tensors = list(tensors_of(list(args) + list(kwargs.values())))
    return run_chunked(func, args, kwargs, spec, left, broadcast=by_positions(tensors))


def _overloads(names):
    """The overloads of ``names`` (``"pow.Tensor_Scalar"``) this PyTorch has."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return found


#: elementwise ops whose host kernels may round an element by where it falls in their vector
#: loops (activations and their backward, transcendental functions): a network's activation
#: larger than a small budget meets them (a UNet's GEGLU, a sin-cos position embedding)
ROUNDED = _overloads([
    "sin", "cos", "exp", "log", "sqrt", "rsqrt", "reciprocal", "erf", "sigmoid", "tanh", "gelu", "silu",
    "softplus", "mish", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "gelu_backward", "silu_backward",
    "sigmoid_backward", "tanh_backward", "softplus_backward", "mish_backward", "sigmoid_", "tanh_", "silu_",
    "gelu_", "exp_", "mish_",
])


@implements(ROUNDED)
@when_refused
def rounded(func, args, kwargs, spec: OpSpec, left: int):
    """An elementwise op in chunks as ``pointwise``; on a device computing with the host's
    kernels, cut where those compute each element as one call does (Note [Cuts of host
    kernels] in ``vector_loops.py``), else refused."""
    tensors = list(tensors_of(list(args) + list(kwargs.values())))
    positions = by_positions(tensors)
    cutter = None
    if mgr.backend.host_kernels:
        if positions and any(t.dim() and t.shape[-1] != 1 and t.stride(-1) != 1 for t in tensors):
            # (the kernel would loop along another dimension than the rows it is cut in)
            raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
        threads = torch.get_num_threads()
        step = vector_loops.STEP_BYTES // min(t.element_size() for t in tensors)
        cutter = lambda numel, row: vector_loops.cutter(numel, threads, row, step)  # noqa: E731
    return run_chunked(func, args, kwargs, spec, left, broadcast=positions, cutter=cutter)


@implements(aten.cat.default)
@when_refused
def cat(func, args, kwargs, spec: OpSpec, left: int):
    """``cat`` along an inner dimension when its tensors do not fit together: ranges of the
    result's outer dimension, each tensor cut alike (two halves of an embedding joined side
    by side); along its outermost dimension it is refused."""
    tensors = args[0] if args else kwargs.get("tensors", ())
    shaped = [t for t in tensors if t.dim() != 1 or t.numel()]  # (1-d empty tensors: skipped by cat)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not shaped or not -shaped[0].dim() <= dim < shaped[0].dim():
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    dim %= shaped[0].dim()
    if all(n == 1 for n in shaped[0].shape[:dim]):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)  # (its pieces' results are not ranges)
    return run_chunked(func, args, kwargs, spec, left, broadcast=True)


#: what ``_to_copy`` may be asked besides a dtype and stay a same-device elementwise conversion
_CONVERSION_ONLY = {"dtype": lambda v: True, "non_blocking": lambda v: True, "copy": lambda v: True,
                    "layout": lambda v: v in (None, torch.strided), "pin_memory": lambda v: not v,
                    "memory_format": lambda v: v in (None, torch.preserve_format, torch.contiguous_format)}


#: ``to`` itself, which reaches the manager undecomposed on inference tensors: the overloads
#: whose device, if any, is a keyword
_TO = (aten.to.dtype, aten.to.dtype_layout)


@implements([aten._to_copy.default, aten.copy_.default, aten.clone.default, *_TO])
@when_refused
def conversion(func, args, kwargs, spec: OpSpec, left: int):
    """A copy or dtype conversion on the device (``clone()``, ``.to(torch.float32)``,
    ``p.copy_(master)``) in chunks when its tensors do not fit together; a copy to or from
    another device is refused as the usual path refuses it."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    device = kwargs.get("device")
    same_device = all(isinstance(t, TensorRef) and t.device == tensors[0].device for t in tensors) and (
        device is None or torch.device(device) == tensors[0].device)
    if not same_device or func in _TO and not estimate_output_bytes(spec, args, kwargs):
        # (a copy to or from the host counts only one side; a ``to`` that converts nothing
        # returns its argument, which a copy in chunks would not be)
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    options = all(_CONVERSION_ONLY.get(k, lambda v: False)(v) for k, v in kwargs.items() if k != "device")
    if not options or any(t.shape != tensors[0].shape for t in tensors):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    kwargs = {k: v for k, v in kwargs.items() if k != "device"}  # (the same device: each chunk's)
    # (``contiguous()`` of a dense view: a contiguous result, cut along its positions; every
    # tensor here is a TensorRef, ``same_device`` says so)
    relaid = kwargs.get("memory_format") is torch.contiguous_format and not tensors[0].is_contiguous()
    return run_chunked(func, args, kwargs, spec, left, broadcast=relaid or by_positions(tensors))


#: ops that compute each row of their last dimension alone: the position of their ``dim``
_ROW_OPS = {aten._log_softmax.default: 1, aten._softmax.default: 1, aten._safe_softmax.default: 1,
            aten._log_softmax_backward_data.default: 2, aten._softmax_backward_data.default: 2}


@implements(list(_ROW_OPS))
@when_refused
def rows(func, args, kwargs, spec: OpSpec, left: int):
    """(log-)softmax over the last dimension, and its backward, in chunks of whole rows
    (the logits of a large vocabulary)."""
    at = _ROW_OPS[func]
    first = args[0]
    if kwargs or first.dim() == 0 or args[at] % first.dim() != first.dim() - 1:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)  # another dimension: not rows
    args = list(args)
    args[at] = -1  # (each piece is a matrix of rows)
    return run_chunked(func, args, kwargs, spec, left, row=first.shape[-1])


# -- views of tensors larger than the budget -------------------------------------------------

#: view ops a training step applies to whole parameters (``linear`` transposes its weight),
#: and those that take parts of a tensor (``chunk``: the halves of a gated activation's
#: projection, which the elementwise ops cut along their positions)
VIEWS = [
    aten.t.default, aten.transpose.int, aten.view.default, aten.detach.default, aten.alias.default,
    aten.permute.default, aten.unsqueeze.default, aten.expand.default, aten._unsafe_view.default,
    aten._conj.default, aten._neg_view.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.unbind.int, aten.squeeze.dim,
    aten.squeeze.default,
]


@implements(VIEWS)
def view(func, args, kwargs, spec: OpSpec):
    """A view of a tensor that does not fit: its geometry, with no bytes moved (the
    dispatcher's view of a block on disk, which reads nothing)."""
    base = args[0] if args else None
    block = block_of(base) if isinstance(base, TensorRef) else None
    # (cheapest first: a resident block, or one that fits the budget, is the common case;
    # room() reads the pins of every resident block)
    if (block is None or block.dev is not None or mgr.settings.budget_value is None or mgr.limit is None
            or block.nbytes + mgr.accounting.elsewhere_bytes <= mgr.limit):
        return default(func, args, kwargs, spec)
    left = room()
    if left is None or block_bytes(block.nbytes) <= left:
        try:
            return default(func, args, kwargs, spec)
        except OutOfBudgetError:
            pass  # (the room was a reading that moved; a view writes nothing: none is lost)
    return view_on_disk(func, args, kwargs)


@implements(aten._local_scalar_dense.default)
@when_refused
def scalar(func, args, kwargs, spec: OpSpec, left: int):
    """``item()`` of a tensor that does not fit (an element of a view of one): read from its
    host copy, the host waiting for it to be current, as ``item()`` waits for the device."""
    ref = args[0]
    if kwargs or len(args) != 1 or not isinstance(ref, TensorRef):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    return host_copy(ref).item()


@implements(aten.linalg_vector_norm.default)
@when_refused
def vector_norm(func, args, kwargs, spec: OpSpec, left: int):
    """The norm of a whole tensor that does not fit: the norm of its chunks' norms."""
    whole = (len(args) < 3 or args[2] is None) and kwargs.get("dim") is None
    keepdim = (len(args) > 3 and args[3]) or kwargs.get("keepdim", False)
    if not whole or keepdim:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    return run_chunked(func, args, kwargs, spec, left)
