"""Ops over lists of tensors (``_foreach_*``, fused optimizers) run in slices that fit.

``torch.optim`` with ``foreach=True`` or ``fused=True``, ``clip_grad_norm_(foreach=True)``
and ``GradScaler.unscale_`` update every parameter in one op whose lists hold all the
parameters, gradients and optimizer states: more than the budget whenever the model is.
These ops treat each list position independently (the CPU kernels even loop over the
positions), so running them on consecutive slices of their lists gives the same result,
bit for bit. When the whole op fits the budget it takes the generic path unchanged; a
position whose tensors do not fit even alone runs in chunks of its elements
(``chunks.run_chunked``: elementwise positions exactly, norms and maxima combined).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..core import raw
from ..core.errors import OutOfBudgetError
from ..core.op_specs import OpSpec, implements
from ..memory.manager import tensorsManager as mgr
from . import chunks, split
from .dispatch import run_generic, run_unhandled
from .host_arguments import to_host
from .output_size import estimate_output_bytes

#: list ops outside the ``_foreach_`` family: fused optimizer steps (lists of parameters,
#: gradients and states) and AMP's unscale (the gradients, one shared ``found_inf``)
_LIST_OPS = frozenset({
    "_fused_adam", "_fused_adam_", "_fused_adamw", "_fused_adamw_", "_fused_sgd", "_fused_sgd_",
    "_fused_adagrad", "_fused_adagrad_",
    "_amp_foreach_non_finite_check_and_unscale", "_amp_foreach_non_finite_check_and_unscale_",
})


class _Layout:
    """Which arguments of one op are per-position (sliced) and how its results combine."""

    __slots__ = ("lists", "per_position_tensor", "returns_lists")

    def __init__(self, func):
        schema = func._schema
        #: (position, name) of list arguments (tensors, scalars): sliced when as long as ``self``
        self.lists: List[Tuple[int, str]] = []
        #: (position, name) of a 1-D tensor holding one scalar per position (``scalars``)
        self.per_position_tensor: Optional[Tuple[int, str]] = None
        for i, arg in enumerate(schema.arguments):
            if isinstance(arg.type, torch._C.ListType):
                self.lists.append((i, arg.name))
            elif arg.name == "scalars" and isinstance(arg.type, torch._C.TensorType):
                self.per_position_tensor = (i, arg.name)
        #: how many results there are, each a list (``_foreach_norm``) or none (in place)
        self.returns_lists = len(schema.returns)


def _foreach_ops():
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name
        if not name.startswith("aten::"):
            continue
        name = name[len("aten::"):]
        if not (name.startswith("_foreach_") or name in _LIST_OPS):
            continue
        if not any(isinstance(a.type, torch._C.ListType) and "Tensor" in str(a.type) for a in schema.arguments):
            continue
        packet = getattr(torch.ops.aten, name, None)
        overload = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
        if overload is not None:
            ops.append(overload)
    return ops


_layouts: Dict[object, _Layout] = {}


def _get(args, kwargs, index, name):
    return args[index] if index < len(args) else kwargs.get(name)


def _set(args, kwargs, index, name, value):
    if index < len(args):
        args[index] = value
    else:
        kwargs[name] = value


def _sliced(layout, n, args, kwargs, start, stop, scalars_slice):
    """``(args, kwargs)`` restricted to list positions ``start:stop``."""
    args, kwargs = list(args), dict(kwargs)
    for index, name in layout.lists:
        value = _get(args, kwargs, index, name)
        if isinstance(value, (list, tuple)) and len(value) == n:
            _set(args, kwargs, index, name, value[start:stop])
    if layout.per_position_tensor is not None:
        index, name = layout.per_position_tensor
        value = _get(args, kwargs, index, name)
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == n:
            _set(args, kwargs, index, name, scalars_slice(value, start, stop))
    return args, kwargs


def _meta_slice(value, start, stop):
    return raw.empty_strided((stop - start,), (1,), dtype=value.dtype, device="meta")


def _slices(spec, layout, n, args, kwargs, limit) -> List[Tuple[int, int, bool]]:
    """Consecutive position ranges ``(start, stop, alone)``, each as long as fits within
    ``limit`` together with the op's shared arguments; ``alone``: one position that does
    not fit by itself, to run in chunks of its tensors (``chunks.run_chunked``)."""
    per_position = []
    for index, name in layout.lists:
        value = _get(args, kwargs, index, name)
        if isinstance(value, (list, tuple)) and len(value) == n:
            per_position.append(value)
    shared_seen: set = set()
    sliced_ids = {id(v) for v in per_position}
    shared = split.refs_bytes([v for v in list(args) + list(kwargs.values()) if id(v) not in sliced_ids], shared_seen)
    slices, start, used = [], 0, shared
    for i in range(n):
        # A tensor repeated at several positions is counted at each: slices only get smaller.
        cost = split.refs_bytes([value[i] for value in per_position], set(shared_seen))
        if spec.allocates:
            cost += split.block_bytes(estimate_output_bytes(spec, *_sliced(layout, n, args, kwargs, i, i + 1,
                                                                           _meta_slice)))
        if shared + cost > limit:  # no slice can hold it: its tensors go in chunks
            if i > start:
                slices.append((start, i, False))
            slices.append((i, i + 1, True))
            start, used = i + 1, shared
            continue
        if i > start and used + cost > limit:
            slices.append((start, i, False))
            start, used = i, shared
        used += cost
    if start < n:
        slices.append((start, n, False))
    return slices


def run_in_slices(func, args, kwargs, spec: OpSpec):
    """The op on consecutive slices of its lists when all of it would exceed the budget."""
    if spec.host_args:  # (per-position scalars: read on the host, sliced there)
        args, kwargs = to_host(spec, args, kwargs)
    limit = split.room()
    host = mgr.host_tier.op_room()
    if host is not None:  # (a slice's tensors are read into host copies first, from disk)
        limit = host if limit is None else min(limit, host)
    layout = _layouts.get(func)
    if layout is None:
        layout = _layouts[func] = _Layout(func)
    first = _get(args, kwargs, *layout.lists[0]) if layout.lists else None
    if limit is None or not isinstance(first, (list, tuple)) or not first:
        return run_unhandled(func, args, kwargs, spec)
    n = len(first)
    need = split.refs_bytes(list(args) + list(kwargs.values()), set())
    if spec.allocates:
        need += estimate_output_bytes(spec, args, kwargs)
    if need <= limit:
        try:  # (whole: on the fast path where its lists are resident, as any op)
            return run_unhandled(func, args, kwargs, spec)
        except OutOfBudgetError:  # (the room was an estimate: see split.may_retry)
            if not split.may_retry(spec):
                raise

    results = []
    slices = _slices(spec, layout, n, args, kwargs, limit)
    if any(alone for _start, _stop, alone in slices):
        # Refused before any slice has written: a position that cannot be chunked.
        for start, stop, alone in slices:
            if alone:
                chunks.check_chunkable(func, *_sliced(layout, n, args, kwargs, start, stop, _meta_slice), spec, limit)
    for start, stop, alone in slices:
        results.extend(_run_slice(func, spec, layout, n, args, kwargs, start, stop, alone, limit))
    if layout.returns_lists == 0:
        return None
    if layout.returns_lists == 1:
        return [t for part in results for t in part]
    return tuple([t for part in results for t in part[k]] for k in range(layout.returns_lists))


def _run_slice(func, spec, layout, n, args, kwargs, start, stop, alone, limit) -> list:
    """The results of positions ``start:stop``; a slice that does not fit after all (the
    room was an estimate: ``split.may_retry``) runs as two halves, a position alone in chunks."""
    slice_args, slice_kwargs = _sliced(layout, n, args, kwargs, start, stop, lambda v, a, b: v[a:b])
    if alone:
        return [chunks.run_chunked(func, slice_args, slice_kwargs, spec, limit)]
    try:
        return [run_generic(func, slice_args, slice_kwargs, spec)]
    except OutOfBudgetError:
        if not split.may_retry(spec):
            raise
    del slice_args, slice_kwargs
    if stop - start == 1:
        left = split.room()
        return _run_slice(func, spec, layout, n, args, kwargs, start, stop, True, left if left is not None else limit)
    middle = (start + stop) // 2
    return (_run_slice(func, spec, layout, n, args, kwargs, start, middle, False, limit)
            + _run_slice(func, spec, layout, n, args, kwargs, middle, stop, False, limit))


implements(_foreach_ops())(run_in_slices)
