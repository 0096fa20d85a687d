"""The generic path every aten op on a TensorRef takes.

1. collect the TensorRefs among the arguments and their blocks;
2. ask the manager to make those blocks resident (the strategy decides what to evict);
3. run the op on plain views of the accelerator copies;
4. wrap the results: an in-place op returns its own argument, a result that shares an
   input's storage (a view) joins that input's block, anything else gets a new block;
5. let the strategy react (Genoa sends everything back to the host).

Note [Fast path]: most ops of a model that fits (pass-through, or Flow with no budget)
move nothing, and then the steps above only cost time. When the manager says nobody needs
to see the op (``TensorsManager._fast``: no callbacks, no recording, no fault injector,
and a strategy that does not need every op) and every TensorRef argument is resident,
``run_fast`` swaps the arguments for their plain views, runs the op and wraps its results
in one pass. Anything else (a block to fetch, a pending prefetch, a plain host tensor to
copy to the accelerator) is found before anything changed, and the generic path runs.
"""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from ..manager import tensorsManager as _mgr
from ..tensor_ref import TensorRef, compute_view, make_ref
from .registry import OpSpec, specs, spec_of

_SPECS = specs()

_Tensor = torch.Tensor
_strided = torch.strided


class OpContext:
    """One op in flight, as the manager and the strategy see it.

    Attributes:
        index: position of the op in the manager's op count.
        spec: the op's :class:`~torchTensorRef.ops.registry.OpSpec`.
        blocks: distinct blocks of the TensorRef arguments, in argument order.
        written: the blocks the op writes in place.
        outputs: new blocks the op created (filled in after it runs).
    """

    __slots__ = ("index", "spec", "blocks", "written", "outputs", "args", "kwargs", "_estimate", "_start")

    def __init__(self, spec, blocks, written, args, kwargs):
        self.index = -1
        self._start = 0  # set by the manager while recording
        self.spec = spec
        self.blocks = blocks
        self.written = written
        self.outputs = []
        self.args = args
        self.kwargs = kwargs
        self._estimate = None

    @property
    def name(self) -> str:
        return self.spec.name

    def output_estimate(self) -> int:
        """Bytes of new tensors the op will allocate (see ``output_size.py``)."""
        if self._estimate is None:
            from .output_size import estimate_output_bytes

            self._estimate = estimate_output_bytes(self.spec, self.args, self.kwargs)
        return self._estimate


def _collect(values, refs):
    for a in values:
        if isinstance(a, TensorRef):
            refs.append(a)
        elif a.__class__ is list or a.__class__ is tuple:
            for e in a:
                if isinstance(e, TensorRef):
                    refs.append(e)


def _blocks_of(refs):
    if len(refs) == 1:
        return [refs[0]._tr_block]
    return _blocks_of_list([r._tr_block for r in refs])


def _blocks_of_list(blocks):
    """``blocks`` without repeats, in order."""
    if len(blocks) < 2:
        return blocks
    seen = {}
    for b in blocks:
        seen.setdefault(b.id, b)
    return list(seen.values())


def _written_blocks(spec: OpSpec, args, kwargs):
    written = []
    for i, name in spec.write_args:
        a = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(a, TensorRef):
            written.append(a._tr_block)
        elif isinstance(a, (list, tuple)):
            written.extend(e._tr_block for e in a if isinstance(e, TensorRef))
    return written


def _swap(a, move_plain):
    """``a`` with TensorRefs replaced by plain views of their current copies."""
    if isinstance(a, TensorRef):
        return compute_view(a)
    if a.__class__ is list or a.__class__ is tuple:
        return a.__class__(_swap(e, move_plain) for e in a)
    if (move_plain is not None and isinstance(a, _Tensor) and a.device != move_plain and a.dim() > 0
            and a.device.type != "meta"):
        return a.to(move_plain)  # a plain host tensor joins an accelerator op
    return a


_NO_KWARGS: dict = {}


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """``TensorRef.__torch_dispatch__``: run aten ``func`` on arguments that include
    TensorRefs; return TensorRef results."""
    if kwargs is None:
        kwargs = _NO_KWARGS
    spec = _SPECS.get(id(func)) or spec_of(func)
    if spec.handler is not None:
        return spec.handler(func, args, kwargs, spec)
    if _mgr._fast and not spec.restrides:  # Note [Fast path]
        out = run_fast(func, args, kwargs, spec)
        if out is not _NOT_FAST:
            return out
    return run_generic(func, args, kwargs, spec)


_NOT_FAST = object()


class _NotResident(Exception):
    """An argument needs a move: the generic path must run the op."""


def _fast_view(a, blocks, live, move):
    # ``live``: pass-through, where ops run on the host copy itself
    if isinstance(a, TensorRef):
        b = a._tr_block
        if (b.dev is None and not live) or b.ready is not None or b.prefetched:
            raise _NotResident
        blocks.append(b)
        return a._tr_view if a._tr_gen == b.gen else compute_view(a)
    cls = a.__class__
    if cls is list or cls is tuple:
        for e in a:
            if isinstance(e, _Tensor):
                return cls([_fast_view(e, blocks, live, move) for e in a])
        return a  # sizes, dims: nothing to swap
    if move is not None and isinstance(a, _Tensor):
        raise _NotResident  # a plain host tensor must be copied to the accelerator first
    return a


def run_fast(func, args, kwargs, spec: OpSpec):
    """Run ``func`` on resident blocks only (Note [Fast path]); ``_NOT_FAST`` if it cannot."""
    mgr = _mgr
    with mgr._lock:
        if not mgr._fast:  # the settings change under the lock: read them under it
            return _NOT_FAST
        if mgr._dead:
            mgr._drain()
        live = mgr._backend.passthrough
        move = mgr._move_plain_to
        blocks = []
        cargs = []
        try:
            for a in args:  # _fast_view, unrolled for the common argument kinds
                if isinstance(a, TensorRef):
                    b = a._tr_block
                    if (b.dev is None and not live) or b.ready is not None or b.prefetched:
                        return _NOT_FAST
                    blocks.append(b)
                    cargs.append(a._tr_view if a._tr_gen == b.gen else compute_view(a))
                elif a.__class__ is list or a.__class__ is tuple or (move is not None and isinstance(a, _Tensor)):
                    cargs.append(_fast_view(a, blocks, live, move))
                else:
                    cargs.append(a)
            ckwargs = {k: _fast_view(v, blocks, live, move) for k, v in kwargs.items()} if kwargs else kwargs
        except _NotResident:
            return _NOT_FAST
        index = mgr._op_count
        mgr._op_count = index + 1
        for b in blocks:
            b.last_use = index
        if spec.write_args or not spec.one_result:
            # in-place ops and several results: the generic bookkeeping, without the moves
            written = _written_blocks(spec, args, kwargs) if spec.write_args else []
            ctx = OpContext(spec, _blocks_of_list(blocks), written, args, kwargs)
            ctx.index = index
            out = mgr._call(ctx, func, cargs, ckwargs)
            if written:
                _follow_resizes(spec, args, kwargs, cargs, ckwargs, ctx, mgr)
                mgr._mark_written(written)
            return _wrap_outputs(out, ctx, spec, args, kwargs, mgr)
        try:
            out = spec.call(*cargs, **ckwargs)
        except torch.OutOfMemoryError:
            if live:
                raise
            ctx = OpContext(spec, _blocks_of_list(blocks), [], args, kwargs)
            ctx.index = index
            out = mgr._recover_from_oom(ctx, func, cargs, ckwargs)
        if out.__class__ is not _Tensor:  # a list of tensors, a number
            ctx = OpContext(spec, _blocks_of_list(blocks), [], args, kwargs)
            ctx.index = index
            return _wrap_nested(out, ctx, mgr)
        if out.layout is not _strided or out.is_nested or out.is_meta:
            return out  # no single strided storage to page: as _wrap_one
        key = out.untyped_storage()._cdata
        for b in blocks:
            if b.dev_key == key:
                return make_ref(b, out, mgr._declared)  # a view: shares the input's block
        return make_ref(mgr._result_block(out, index), out, mgr._declared)


def run_generic(func, args, kwargs, spec: OpSpec):
    mgr = _mgr
    with mgr._lock:
        if mgr._dead:
            mgr._drain()
        refs = []
        _collect(args, refs)
        if kwargs:
            _collect(kwargs.values(), refs)
        blocks = _blocks_of(refs) if refs else []
        written = _written_blocks(spec, args, kwargs) if spec.write_args else []
        ctx = OpContext(spec, blocks, written, args, kwargs)
        mgr._prepare(ctx)
        move = mgr._move_plain_to
        cargs = [_swap(a, move) for a in args]
        ckwargs = {k: _swap(v, move) for k, v in kwargs.items()} if kwargs else {}
        out = mgr._call(ctx, func, cargs, ckwargs)
        if spec.restrides:
            _follow_restrides(spec, args, kwargs, cargs, ckwargs, ctx, mgr)
        elif written:
            _follow_resizes(spec, args, kwargs, cargs, ckwargs, ctx, mgr)
        if written:
            mgr._mark_written(written)
        if move is not None and spec.write_args:
            _copy_back_plain(spec, args, kwargs, cargs, ckwargs)
        result = _wrap_outputs(out, ctx, spec, args, kwargs, mgr)
        mgr._finish(ctx)
        return result


def _follow_restrides(spec, args, kwargs, cargs, ckwargs, ctx, mgr):
    # resize_, set_, t_ ... changed the geometry (or the storage) of the plain view they
    # wrote: give the TensorRef the same metadata, and its new storage a block.
    for i, name in spec.write_args:
        ref, view = (args[i], cargs[i]) if i < len(args) else (kwargs.get(name), ckwargs.get(name))
        if isinstance(ref, TensorRef):
            _follow_restride(ref, view, ctx, mgr)
        elif isinstance(ref, (list, tuple)):
            for r, v in zip(ref, view):
                if isinstance(r, TensorRef):
                    _follow_restride(r, v, ctx, mgr)


def _follow_resizes(spec, args, kwargs, cargs, ckwargs, ctx, mgr):
    # Some in-place ops resize their argument as an out= op would: x.addbmm_(b1, b2) turns
    # a (1,) x into (n, m), on a larger storage. Only a changed shape needs the full check.
    for i, name in spec.write_args:
        ref, view = (args[i], cargs[i]) if i < len(args) else (kwargs.get(name), ckwargs.get(name))
        if isinstance(ref, TensorRef) and ref.shape != view.shape:
            _follow_restride(ref, view, ctx, mgr)


def _follow_restride(ref, view, ctx, mgr):
    storage = view.untyped_storage()
    if storage._cdata != ref._tr_block.dev_key:
        source = next((b for b in ctx.blocks if b.dev_key == storage._cdata), None)
        new = make_ref(source, view, mgr._declared) if source is not None else mgr._adopt_output(view, ctx)
        mgr.rebind(ref, new)
    elif storage.nbytes() != ref._tr_block.nbytes:
        mgr._resized(ref._tr_block, storage.nbytes())  # resize_ grew the storage in place
    if ref.shape != view.shape or ref.stride() != view.stride() or ref.storage_offset() != view.storage_offset():
        with no_dispatch():
            torch.ops.aten.set_.source_Storage_storage_offset(
                ref, torch._C.TensorBase.untyped_storage(ref), view.storage_offset(), view.shape, view.stride())
    ref._tr_view, ref._tr_gen = view, ref._tr_block.gen


def _copy_back_plain(spec, args, kwargs, cargs, ckwargs):
    # A plain host tensor written by an accelerator op was written on its moved copy.
    for i, name in spec.write_args:
        orig, moved = (args[i], cargs[i]) if i < len(args) else (kwargs.get(name), ckwargs.get(name))
        if isinstance(orig, _Tensor) and not isinstance(orig, TensorRef) and moved is not orig:
            with torch.no_grad():
                orig.copy_(moved)


def _wrap_outputs(out, ctx, spec, args, kwargs, mgr):
    if isinstance(out, _Tensor):
        index = spec.return_args[0] if spec.return_args else None
        if index is not None:
            return args[index] if index < len(args) else kwargs[spec.func._schema.arguments[index].name]
        return _wrap_one(out, ctx, mgr)
    if isinstance(out, (list, tuple)):
        if spec.return_args and len(spec.return_args) == len(out) and out.__class__ is tuple:
            items = []
            for o, index in zip(out, spec.return_args):
                if index is not None:
                    name = spec.func._schema.arguments[index].name
                    items.append(args[index] if index < len(args) else kwargs[name])
                else:
                    items.append(_wrap_nested(o, ctx, mgr))
            return tuple(items)
        return _wrap_nested(out, ctx, mgr)
    return out


def _wrap_nested(out, ctx, mgr):
    if isinstance(out, _Tensor):
        return _wrap_one(out, ctx, mgr)
    if isinstance(out, (list, tuple)):
        return out.__class__(_wrap_nested(o, ctx, mgr) for o in out)
    return out


def _wrap_one(t, ctx, mgr):
    if isinstance(t, TensorRef) or t.layout is not _strided or t.is_nested or t.device.type == "meta":
        return t  # nested tensors have strided layout but no single storage to page
    key = t.untyped_storage()._cdata
    for b in ctx.blocks:
        if b.dev_key == key:
            return make_ref(b, t, mgr._declared)  # a view: shares the input's block
    return mgr._adopt_output(t, ctx)
