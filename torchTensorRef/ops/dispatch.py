"""The generic path every aten op on a TensorRef takes.

1. collect the TensorRefs among the arguments and their blocks;
2. ask the manager to make those blocks resident (the strategy decides what to evict);
3. run the op on plain views of the accelerator copies;
4. wrap the results: an in-place op returns its own argument, a result that shares an
   input's storage (a view) joins that input's block, anything else gets a new block;
5. let the strategy react (Genoa sends everything back to the host).

Note [Fast path]: most ops of a model that fits (pass-through, or Flow with no budget)
move nothing, and then the steps above only cost time. When the manager says nobody needs
to see the op (``TensorsManager.fast``: no callbacks, no recording, no fault injector,
and a strategy that does not need every op) and every TensorRef argument is resident,
``run_fast`` swaps the arguments for their plain views, runs the op and wraps its results
in one pass; a block a prefetch brought in is resident too (the op is ordered after its
copy, as on the generic path). Anything else (a block to fetch, a plain host tensor to
copy to the accelerator) is found before anything changed, and the generic path runs.

Note [Plain views die under the lock]: both paths keep an op's plain views of its blocks'
device copies, and its kernel's results, in the locals of a function called under the
manager's lock, so they are gone before another thread can take it. Held by a frame that
outlives the lock, a view keeps the bytes of a copy that another thread's op then evicts
allocated, and that op's reading of the device counts them as outside the manager: a
budget that fits refused an op (four threads' backwards under Genoa, about one run in 125).
"""

from __future__ import annotations

import time

import torch

from ..core import raw
from ..core.op_specs import OpSpec, move_list_versions, spec_of, specs
from ..core.tensor_ref import TensorRef, compute_view, make_ref, block_of
from ..memory.manager import tensorsManager as _mgr
from ..memory.op_protocol import tight_result
from ..memory.room import is_out_of_memory
from ..memory.sim import backward_errors as sim_errors
from . import workers
from .device_checks import (bring_plain_tensors, check_devices, explicit_results, plain_device_tensor_among,
                            plain_tensor_among, runs_on_host)
from .op_context import (OpContext, blocks_of, blocks_of_list, collect_refs, compute_kwargs, follow_resizes,
                         follow_restrides, placement, swap_in, wrap_nested, wrap_one, wrap_outputs, written_blocks)
from .output_size import estimate_output_bytes, results_seen

_SPECS = specs()

_Tensor = torch.Tensor
_strided = torch.strided


_NO_KWARGS: dict = {}


def torch_dispatch(cls, func, types, args=(), kwargs=None):
    """``TensorRef.__torch_dispatch__``: run aten ``func`` on arguments that include
    TensorRefs; return TensorRef results."""
    if kwargs is None:
        kwargs = _NO_KWARGS
    spec = _SPECS.get(id(func)) or spec_of(func)
    if _mgr.forked and workers.in_worker():
        return workers.run_in_worker(func, args, kwargs)  # Note [Forked workers]
    try:
        if spec.handler is not None:
            out = spec.handler(func, args, kwargs, spec)
        else:
            out = run_unhandled(func, args, kwargs, spec)
        if spec.list_writes:
            move_list_versions(spec, args, kwargs, TensorRef)  # (Note [Versions of list writes])
        return out
    except BaseException as e:
        # (not only Exceptions: a KeyboardInterrupt or SystemExit from a callback or the fault
        # injector, left pending inside backward, aborts the process as any other error would)
        if getattr(_mgr.backend, "strict", False) and sim_errors.in_backward():
            sim_errors.keep_for_backward(e)  # Note [Errors in backward on sim]
            return sim_errors.failed_result(func)
        raise


def run_unhandled(func, args, kwargs, spec: OpSpec):
    """The paths of an op that needs nothing special: the fast path where it can (Note [Fast
    path]), a view of a block only on disk without reading it, else the generic path. A
    handler that finds an op needs nothing of it calls this too."""
    if _mgr.fast and not spec.restrides:
        out = run_fast(func, args, kwargs, spec)
        if out is not _NOT_FAST:
            return out
    if not spec.allocates and not spec.write_args and args and _only_on_disk(args[0]):
        return view_on_disk(func, args, kwargs)
    return run_generic(func, args, kwargs, spec)


_NOT_FAST = object()


def _only_on_disk(a) -> bool:
    if a.__class__ is not TensorRef:
        return False
    b = block_of(a)
    return b.dev is None and b.host is None and b.disk is not None


def view_on_disk(func, args, kwargs):
    """A view (``detach``, ``view``, ``t``, ``split`` ...) of a block whose only copy is on disk: its
    geometry comes from the op on a meta twin, and nothing is read (``nn.Parameter(w)`` of a
    weight loaded lazily runs ``detach``)."""
    ref = args[0]
    storage = raw.empty(block_of(ref).nbytes, dtype=raw.UINT8, device="meta").untyped_storage()
    meta = raw.typed_view(storage, ref.dtype, ref.size(), ref.stride(), ref.storage_offset())
    out = func(meta, *args[1:], **kwargs)
    outs = out if isinstance(out, (list, tuple)) else (out,)  # (``split``, ``unbind``: several views)
    if not outs or any(o.__class__ is not _Tensor or o.untyped_storage()._cdata != meta.untyped_storage()._cdata
                       for o in outs):
        return run_generic(func, args, kwargs, _SPECS.get(id(func)) or spec_of(func))  # not views of it
    mgr = _mgr
    with mgr.lock:
        block = block_of(ref)
        strategy = mgr.strategy
        ctx = None
        if not mgr.backend.passthrough and strategy.needs_every_op():
            # A strategy that learns the op sequence sees it as any op, wherever the block is
            # (else the sequence would change with where its blocks are, and no period repeat).
            ctx = OpContext(_SPECS.get(id(func)) or spec_of(func), [block], [], args, kwargs)
            ctx.index = mgr.op_count
            mgr.op_count += 1
            block.last_use = ctx.index
            strategy.before_op(ctx)
        # (meta views: no bytes to run on)
        views = [make_ref(block, o, mgr.declared, geometry_only=True) for o in outs]
        if ctx is not None:
            strategy.after_op(ctx)
        return views[0] if outs is not out else out.__class__(views)


class _NotResident(Exception):
    """An argument needs a move: the generic path must run the op."""


def _fast_view(a, blocks, live):
    # ``live``: pass-through, where ops run on the host copy itself
    if isinstance(a, TensorRef):
        b = block_of(a)
        if b.dev is None and not live:
            raise _NotResident
        blocks.append(b)
        return compute_view(a)
    cls = a.__class__
    if cls is list or cls is tuple:
        for e in a:
            if isinstance(e, _Tensor):
                return cls([_fast_view(e, blocks, live) for e in a])
        return a  # sizes, dims: nothing to swap
    if not live and isinstance(a, _Tensor):
        raise _NotResident  # a plain tensor: the generic path checks where it may go
    if not live and a.__class__ is torch.device:
        raise _NotResident  # a device argument: the generic path says where the result goes
    return a


def run_fast(func, args, kwargs, spec: OpSpec):
    """Run ``func`` on resident blocks only (Note [Fast path]); ``_NOT_FAST`` if it cannot."""
    mgr = _mgr
    with mgr.lock:
        out = _run_fast_locked(mgr, func, args, kwargs, spec)  # (Note [Plain views die under the lock])
        if mgr.settings.check_device_value and out is not _NOT_FAST:
            mgr.protocol.check_device()  # (as the generic path's ``finish`` does)
        return out


def _run_fast_locked(mgr, func, args, kwargs, spec: OpSpec):
    if not mgr.fast:  # the settings change under the lock: read them under it
        return _NOT_FAST
    if mgr.books.dead:
        mgr.drain()
    live = mgr.backend.passthrough
    blocks = []
    cargs = []
    try:
        for a in args:  # _fast_view, unrolled for the common argument kinds
            if isinstance(a, TensorRef):
                b = block_of(a)
                if b.dev is None and not live:
                    return _NOT_FAST
                blocks.append(b)
                cargs.append(compute_view(a))
            elif a.__class__ is list or a.__class__ is tuple or (not live and isinstance(a, _Tensor)):
                cargs.append(_fast_view(a, blocks, live))
            else:
                cargs.append(a)
        ckwargs = {k: _fast_view(v, blocks, live) for k, v in kwargs.items()} if kwargs else kwargs
    except _NotResident:
        return _NOT_FAST
    acct = mgr.accounting
    limit = acct.limit
    need = 0
    if limit is not None and spec.allocates and not live:
        # Room for the results without evicting: else the generic path makes it.
        # (in device bytes: each result as the device's allocator gives it)
        need = estimate_output_bytes(spec, args, kwargs)
        if need:
            if acct.resident + acct.elsewhere_bytes + need > limit:
                return _NOT_FAST
            if mgr.backend.simulated and acct.on_device() + need > mgr.backend.capacity():
                return _NOT_FAST  # the simulated device would run out: the generic path recovers
    watch = mgr.fast_watch
    if watch is not None:
        blocks = blocks_of_list(blocks)
        index = mgr.op_count
        if not watch.fast_op(index, spec, blocks, need):
            return _NOT_FAST
        out, outputs = _run_fast_op(mgr, func, args, kwargs, spec, cargs, ckwargs, blocks, live)
        watch.after_fast_op(index, outputs)
        return out
    return _run_fast_op(mgr, func, args, kwargs, spec, cargs, ckwargs, blocks, live)[0]


_NO_OUTPUTS = ()


def _run_fast_op(mgr, func, args, kwargs, spec, cargs, ckwargs, blocks, live):
    """The fast path's op, counted: (its result, the blocks it created)."""
    index = mgr.op_count
    mgr.op_count = index + 1
    for b in blocks:
        b.last_use = index
        if b.prefetched or b.dev_pending is not None:
            mgr.arrived(b)  # brought in by a prefetch: the op waits for its copy
    if spec.write_args or not spec.one_result:
        # in-place ops and several results: the generic bookkeeping, without the moves
        written = written_blocks(spec, args, kwargs) if spec.write_args else []
        ctx = OpContext(spec, blocks_of_list(blocks), written, args, kwargs)
        ctx.index = index
        out = mgr.call(ctx, func, cargs, ckwargs)
        if written:
            follow_resizes(spec, args, kwargs, cargs, ckwargs, ctx, mgr)
            mgr.mark_written(written)
        return wrap_outputs(out, ctx, spec, args, kwargs, mgr), ctx.outputs
    try:
        out = spec.call(*cargs, **ckwargs)
    except Exception as e:  # (cuBLAS and cuDNN report a failed allocation as a RuntimeError)
        if live or not is_out_of_memory(e):
            raise
        ctx = OpContext(spec, blocks_of_list(blocks), [], args, kwargs)
        ctx.index = index
        out = mgr.recover_from_oom(ctx, func, cargs, ckwargs)
    if out.__class__ is not _Tensor:  # a list of tensors, a number
        ctx = OpContext(spec, blocks_of_list(blocks), [], args, kwargs)
        ctx.index = index
        return wrap_nested(out, ctx, mgr), ctx.outputs
    if out.layout is not _strided or out.is_nested or out.is_meta:
        return out, _NO_OUTPUTS  # no single strided storage to page: as wrap_one
    storage = out.untyped_storage()
    key = storage._cdata
    for b in blocks:
        if b.dev_key == key:
            return make_ref(b, out, mgr.declared), _NO_OUTPUTS  # a view: shares the input's block
    if not live and out.device != mgr.backend.compute:
        ctx = OpContext(spec, blocks_of_list(blocks), [], args, kwargs)
        ctx.index = index
        return wrap_one(out, ctx, mgr), ctx.outputs  # a CPU result on CUDA (or another GPU's)
    acct = mgr.accounting
    limit = acct.limit
    if limit is not None and (mgr.backend.block_bytes(storage.nbytes()) + acct.resident
                              + acct.elsewhere_bytes > limit):
        # (only where it would pass the budget: the check costs every op's result more than it saves)
        tight = tight_result(out, storage)
        if tight is not out:
            out, storage = tight, tight.untyped_storage()
    block = mgr.protocol.result_block(out, index, storage=storage)
    for b in blocks:
        if b.explicit:  # (computed from the program's own device tensor: Note [Default-device tensors])
            block.explicit = True
            break
    return make_ref(block, out, mgr.declared), (block,)


def run_generic(func, args, kwargs, spec: OpSpec):
    mgr = _mgr
    with mgr.lock:
        return _run_generic_locked(mgr, func, args, kwargs, spec)  # (Note [Plain views die under the lock])


def _with_plain_tensors(mgr, spec: OpSpec, args, kwargs, refs, blocks):
    """An op's arguments, and their blocks, for plain tensors among them: the device read
    first where one is an accelerator tensor (Note [Plain device tensors are outside bytes]),
    CPU ones beside default-device TensorRefs brought in (Note [Plain CPU tensors])."""
    if mgr.accounting.limit is not None and plain_device_tensor_among(args, kwargs):
        mgr.device_room.read_outside()
    brought = bring_plain_tensors(spec, args, kwargs, blocks)
    if brought is None:
        return args, kwargs, blocks
    args, kwargs, new_refs = brought
    return args, kwargs, blocks_of(refs + new_refs)


def _run_generic_locked(mgr, func, args, kwargs, spec: OpSpec):
    if mgr.trace is not None:
        mgr.trace.entered = time.perf_counter_ns()  # our host time for this op starts here
    if mgr.books.dead:
        mgr.drain()
    if mgr.unresolved:
        # "cuda" set again with blocks alive: fixed (its index, its streams) before a fetch
        mgr.resolve_device()
    refs = []
    collect_refs(args, refs)
    if kwargs:
        collect_refs(kwargs.values(), refs)
    blocks = blocks_of(refs) if refs else []
    written = written_blocks(spec, args, kwargs) if spec.write_args else []
    backend = mgr.backend
    on_host = False if backend.passthrough else placement(kwargs, blocks, backend)
    if not on_host and mgr.books.host_only and not backend.passthrough:
        on_host = runs_on_host(spec, refs, args, kwargs)  # (Note [Default-device tensors])
    if not on_host and not backend.passthrough and plain_tensor_among(args, kwargs):
        args, kwargs, blocks = _with_plain_tensors(mgr, spec, args, kwargs, refs, blocks)
    ctx = OpContext(spec, blocks, written, args, kwargs, on_host)
    if getattr(backend, "strict", False) and not on_host:
        check_devices(spec, args, kwargs, backend.declared, blocks)
    mgr.prepare(ctx)
    if on_host:
        for b in blocks:
            mgr.sync_host(b)  # the op reads host copies: they must hold the current bytes
    cargs = [swap_in(a, on_host) for a in args]
    ckwargs = {k: swap_in(v, on_host) for k, v in kwargs.items()} if kwargs else {}
    if ckwargs and "device" in ckwargs and backend.declared != backend.compute:
        ckwargs = compute_kwargs(ckwargs, backend, spec, blocks)
    try:
        out = mgr.call(ctx, func, cargs, ckwargs)
    except BaseException:
        mgr.op_raised(ctx)
        raise
    if spec.restrides:
        follow_restrides(spec, args, kwargs, cargs, ckwargs, ctx, mgr)
    elif written:
        follow_resizes(spec, args, kwargs, cargs, ckwargs, ctx, mgr)
    if written:
        if on_host:
            for b in written:
                mgr.host_written(b)
        else:
            mgr.mark_written(written)
    result = wrap_outputs(out, ctx, spec, args, kwargs, mgr)
    if ctx.outputs and not on_host:
        explicit_results(ctx, args, kwargs)
        if ctx.estimate is not None:
            results_seen(ctx)  # (sizes known only now: Note [Sizes known after the op])
    # (the kernel's views go before the strategy evicts: a buffer still viewed stays
    # counted, Note [Buffers still viewed])
    del cargs, ckwargs, out
    mgr.finish(ctx)
    return result


# Every op on a TensorRef enters here directly (bound on the class: one Python frame less
# than a method that forwards; the core does not import this layer).
TensorRef.__torch_dispatch__ = classmethod(torch_dispatch)
