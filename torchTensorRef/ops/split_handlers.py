"""The ops that run in pieces when they are larger than the budget (Note [Pieces] in
``pieces.py``, and ``split.py``): ``embedding`` and its backward by rows, the elementwise
ops a training step runs on whole parameters and the activations by chunks (by rows where
they broadcast, and ``cat`` along an inner dimension), views of big tensors without moving
bytes, a whole tensor's norm by chunks (matrix products: ``split_products.py``;
convolutions: ``split_convolutions.py``; normalizations: ``split_norms.py``).

Each handler runs its op by the dispatcher's own paths first and splits it only where they
refuse it for the budget (``split.when_refused``); ``embedding`` also reads rows alone by choice.
"""

from __future__ import annotations

import math

import torch

from ..core.errors import OutOfBudgetError
from ..core.op_specs import OpSpec, implements, spec_of
from ..core.tensor_ref import TensorRef, block_of, host_copy, host_view
from ..memory.manager import tensorsManager as mgr
from .dispatch import run_generic, view_on_disk
from .output_size import estimate_output_bytes
from .result_bounds import to_meta
from .pieces import gathered_piece, held_on_host, host_result, in_groups, settle, to_host
from . import vector_loops
from .chunks import by_positions, run_chunked, tensors_of
from .split_on_host import cat_on_host
from .split import block_bytes, default, fits, op_bytes, refuse, room, when_refused

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
    return _renumbered(_host_values(indices))


def _renumbered(values: torch.Tensor):
    """``_remapped`` of indices read on the host (``values``)."""
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
    return reads_rows_alone(weight) and indices.numel() * _row_bytes(weight) <= ROWS_FRACTION * block_of(weight).nbytes


def _row_bytes(t) -> int:
    """Bytes of one row of ``t`` (one index of its leading dimension), from its shape: ``t[0]``
    would be an op, bringing ``t`` in."""
    return math.prod(t.shape[1:]) * t.element_size()


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
    with held_on_host([out]):  # (reading the part back must not make room by dropping it)
        host_view(out).index_copy_(0, rows, to_host(part))
    return out


#: how many ``index`` calls read their rows alone by choice, the tensor fitting: a region
#: whose measured call made one runs op by op from then on, while the budget pages, so that
#: its ``index`` reads the rows alone again (Note [Regions that read rows] in
#: ``regions/__init__.py``)
rows_by_choice = [0]


@implements(aten.index.Tensor)
def index(func, args, kwargs, spec: OpSpec):
    """``t[i]`` of a tensor's leading dimension by one tensor of integers, the rows named read
    alone as an embedding's are (Note [Rows of a table]), when ``t`` does not fit or they are
    a small part of it with no gradient to record: a mixture-of-experts layer decoding a
    token gathers the weights of the experts it routes the token to, from a parameter that
    stacks every expert's (transformers' ``batched_mm`` experts). An index that fits and is
    not read by rows pays nothing here: the dispatcher's paths run it first."""
    self = args[0]
    indices = args[1] if len(args) > 1 else None
    if (kwargs or not isinstance(self, TensorRef) or self.dim() < 2 or not isinstance(indices, (list, tuple))
            or len(indices) != 1 or not isinstance(indices[0], torch.Tensor)
            or indices[0].dtype not in (torch.int64, torch.int32)):  # (a mask's result is as large as its count)
        return default(func, args, kwargs, spec)
    if _rows_alone(self, indices[0]):
        return _index_rows(func, args, kwargs, spec, fits(spec, args, kwargs))
    return _index_when_refused(func, args, kwargs, spec)


def _index_rows(func, args, kwargs, spec: OpSpec, left):
    """``index`` by the rows it names, with ``left`` bytes of room where the tensor does not
    fit (``None``: it fits, and is read by rows by choice)."""
    self, (indices,) = args[0], args[1]
    values = _host_values(indices)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= self.shape[0]):
        return default(func, args, kwargs, spec)  # (from the end, or out of bounds: plain torch's own answer)
    rows, local = _renumbered(values)
    if left is None:
        rows_by_choice[0] += 1
    else:  # (the tensor does not fit: it leaves the device)
        settle([self])
        need = rows.numel() * _row_bytes(self) + block_of(local).nbytes + estimate_output_bytes(spec, args, kwargs)
        if need > left:
            return _gathered_on_host(self, values)
    with mgr.lock:
        mgr.sync_host(block_of(self))  # (settled: nothing to copy; else its device copy stays)
        table = host_view(self).detach().index_select(0, rows)
    return run_generic(func, [gathered_piece(table), [local]], {}, spec)


_index_when_refused = when_refused(_index_rows)


def _gathered_on_host(t: TensorRef, values: torch.Tensor) -> TensorRef:
    """``t[values]`` gathered from ``t``'s host copy into a result whose only copy is on the
    host, where the rows and the result do not fit the device's room together (a batch of
    tokens each gathering its experts): a gather copies bytes, the same bits wherever it
    runs, and the next op brings the result in as it brings any tensor in (or in pieces)."""
    out = host_result(tuple(values.shape) + tuple(t.shape[1:]), t.dtype)
    with held_on_host([out]), mgr.lock:  # (reading ``t`` back must not make room by dropping it)
        mgr.sync_host(block_of(t))
        flat = host_view(out).view(-1, *t.shape[1:])
        torch.index_select(host_view(t).detach(), 0, values.reshape(-1), out=flat)
    return out


# -- elementwise ops a training step runs on whole parameters -------------------------------

#: in-place and out-of-place elementwise ops that meet tensors as large as a parameter
#: (gradient accumulation, ``zero_grad(set_to_none=False)``, manual updates, a weight
#: normalized by its own statistic: ``w / w.std()``), and arithmetic with a number, as
#: autograd's formulas call it on activations' gradients (each element one correctly
#: rounded operation, by whichever loop computes it: the same bits in pieces)
POINTWISE = [
    aten.add_.Tensor, aten.add.Tensor, aten.sub_.Tensor, aten.sub.Tensor, aten.mul_.Tensor, aten.mul_.Scalar,
    aten.mul.Tensor, aten.div_.Tensor, aten.div.Tensor, aten.zero_.default, aten.fill_.Scalar, aten.lerp_.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.div_.Scalar, aten.add.Scalar, aten.add_.Scalar, aten.sub.Scalar,
    aten.sub_.Scalar, aten.rsub.Scalar,
]


#: elementwise ops whose results are exact (a choice, a sign, a comparison): the same bits
#: in pieces on every device; an attention's mask meets scores larger than a small budget
EXACT = [
    aten.where.self, aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor,
    aten.masked_fill_.Tensor, aten.relu.default, aten.relu_.default, aten.neg.default, aten.abs.default,
    aten.maximum.default, aten.minimum.default, aten.clamp.default, aten.clamp_.default, aten.logical_not.default,
    aten.threshold_backward.default,
    *(getattr(getattr(aten, name), overload) for name in ("eq", "ne", "lt", "le", "gt", "ge")
      for overload in ("Tensor", "Scalar")),
]


@implements(POINTWISE + EXACT)
@when_refused
def pointwise(func, args, kwargs, spec: OpSpec, left: int):
    """An elementwise op in chunks when its tensors do not fit together: ranges of their
    elements where they have one shape (0-d scalars aside), else ranges of the result's
    outer dimension (``torch.outer(a, b)`` as ``a[:, None] * b``), or each index of that
    dimension in turn where one of its positions does not fit (``_each_outer_index``)."""
    return _elementwise(func, args, kwargs, spec, left)


def _elementwise(func, args, kwargs, spec: OpSpec, left: int):
    tensors = list(tensors_of(list(args) + list(kwargs.values())))
    if not by_positions(tensors):
        return run_chunked(func, args, kwargs, spec, left)
    try:
        return run_chunked(func, args, kwargs, spec, left, broadcast=True)
    except OutOfBudgetError:
        return _each_outer_index(func, args, kwargs, spec, left)


def _each_outer_index(func, args, kwargs, spec: OpSpec, left: int):
    """A broadcasting elementwise op whose positions along the dimensions it is cut in do
    not fit one by one: the scores of one head, beside an attention mask given whole (it
    broadcasts along the heads) that varies along the rows the cut stops at. The op runs
    for each index of the result's outermost dimension longer than one (in the order of its
    bytes), each cut in turn (``_elementwise``: there the mask is cut with the scores'
    rows), its result copied into its place in a result in host memory laid out as one
    call's (the same elements by the same kernel: the same bits)."""
    meta = func(*to_meta(list(args)), **{k: to_meta(v) for k, v in kwargs.items()})
    longer = [i for i, n in enumerate(meta.shape) if n > 1] if isinstance(meta, torch.Tensor) else []
    if not longer:
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    d = max(longer, key=meta.stride)
    count, rank = meta.shape[d], meta.dim()

    def at(v, i):
        """``v``'s part at index ``i`` of the result's dimension ``d`` (all of it where it broadcasts there)."""
        if isinstance(v, TensorRef) and v.dim() >= rank - d and v.shape[d - rank] == count:
            return v.narrow(d - rank, i, 1)
        return v

    written = [a for a in args[:1] if spec.write_args and isinstance(a, TensorRef)]
    out = None if written else host_result(meta.shape, meta.dtype, stride=meta.stride())
    in_groups(out, d, count, 1, lambda i, _n: _elementwise(
        func, [at(a, i) for a in args], {k: at(v, i) for k, v in kwargs.items()}, spec, left))
    return written[0] if written else out


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
    """``cat`` when its tensors do not fit together: along an inner dimension, ranges of the
    result's outer dimension, each tensor cut alike (two halves of an embedding joined side
    by side); along its outermost one (outputs gathered batch by batch), in host memory."""
    tensors = args[0] if args else kwargs.get("tensors", ())
    shaped = [t for t in tensors if t.dim() != 1 or t.numel()]  # (1-d empty tensors: skipped by cat)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not shaped or not -shaped[0].dim() <= dim < shaped[0].dim() or not all(
            isinstance(t, TensorRef) for t in tensors):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    dim %= shaped[0].dim()
    if all(n == 1 for n in shaped[0].shape[:dim]):  # (its pieces' results would not be ranges)
        return cat_on_host(func, tensors, dim)
    return run_chunked(func, args, kwargs, spec, left, broadcast=True)


@implements(aten.stack.default)
@when_refused
def stack(func, args, kwargs, spec: OpSpec, left: int):
    """``stack`` when its tensors do not fit together (a rotary embedding's halves stacked on
    a last dimension): as ``cat`` of them each viewed with the new dimension, cut as ``cat``
    is (the same copies: one call's bits)."""
    tensors = args[0] if args else kwargs.get("tensors", ())
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if (not tensors or not all(isinstance(t, TensorRef) and t.shape == tensors[0].shape for t in tensors)
            or not -tensors[0].dim() - 1 <= dim <= tensors[0].dim()):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    dim %= tensors[0].dim() + 1
    joined = aten.cat.default
    return cat(joined, ([t.unsqueeze(dim) for t in tensors], dim), {}, spec_of(joined))


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
