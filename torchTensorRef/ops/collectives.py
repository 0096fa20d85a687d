"""torch.distributed's collectives (``c10d`` ops) on TensorRefs.

Note [Collectives]: ``dist.all_reduce``, DDP's bucket all-reduce and FSDP2's all-gather
reach the dispatcher as ``c10d`` ops whose tensors come in lists, or lists of lists, that
the generic path does not look into. This handler makes every block of those tensors
resident, runs the op on plain views of the accelerator copies (on ``"sim"`` these are CPU
tensors, so the ``gloo`` backend takes them; on CUDA they are CUDA tensors for ``nccl``),
marks the tensors the op writes (its first argument) as written, and gives back the
TensorRefs the caller passed. The op is waited for before the handler returns: an
asynchronous collective still writing into a block the strategy evicts next would lose
its result. The ``Work`` returned is therefore already complete, and waiting on it again
costs nothing.

The functional collectives (``_c10d_functional``: DTensor's ``full_tensor`` and
redistributions) return new tensors, registered to be waited on later. They take the generic
path, with each result waited for before the manager adopts it (``_functional``). Their
results are not wrapped in ``AsyncCollectiveTensor``, which would wait on first use: an
``AsyncCollectiveTensor`` holds its tensor inside and has no bytes of its own to page.
"""

from __future__ import annotations

import torch
import torch.distributed  # noqa: F401  (registers the c10d ops)
import torch.distributed._functional_collectives  # noqa: F401  (registers _wrap_tensor_autograd)

from ..core.op_specs import implements
from ..core.tensor_ref import TensorRef, compute_view
from ..memory.manager import tensorsManager as _mgr

_Tensor = torch.Tensor

#: c10d ops that write none of their tensors
_READ_ONLY = ("send", "barrier", "monitored_barrier_", "check_for_nan")


def _c10d_ops():
    ops = []
    packets = getattr(torch.ops, "c10d", None)
    if packets is None:
        return ops
    for name in ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_", "allgather_",
                 "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                 "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
                 "alltoall_", "alltoall_base_", "gather_", "scatter_", "send", "recv_",
                 "recv_any_source_", "barrier", "monitored_barrier_"):
        packet = getattr(packets, name, None)
        if packet is not None:
            ops.extend(getattr(packet, o) for o in packet.overloads())
    return ops


def _refs(value, out):
    if isinstance(value, TensorRef):
        out.append(value)
    elif value.__class__ is list or value.__class__ is tuple:
        for e in value:
            _refs(e, out)


def swap_in(value, plain_to_ref):
    if isinstance(value, TensorRef):
        view = compute_view(value)
        plain_to_ref[id(view)] = value
        return view
    if value.__class__ is list or value.__class__ is tuple:
        return value.__class__(swap_in(e, plain_to_ref) for e in value)
    return value


def _unswap(value, plain_to_ref, views):
    if isinstance(value, _Tensor):
        ref = plain_to_ref.get(id(value))
        if ref is not None:
            return ref
        for view, ref in views:  # a new Python object for the same tensor
            if (value.data_ptr() == view.data_ptr() and value.shape == view.shape
                    and value.stride() == view.stride() and value.dtype == view.dtype):
                return ref
        return value
    if value.__class__ is list or value.__class__ is tuple:
        return value.__class__(_unswap(e, plain_to_ref, views) for e in value)
    return value


def _wait(out):
    if isinstance(out, tuple):
        for o in out:
            _wait(o)
    elif hasattr(out, "wait") and not isinstance(out, _Tensor):
        out.wait()


@implements(_c10d_ops())
def collective(func, args, kwargs, spec):
    """Run a c10d op on the accelerator copies of its TensorRefs (Note [Collectives])."""
    from .op_context import OpContext, blocks_of

    mgr = _mgr
    with mgr.lock:
        if mgr.books.dead:
            mgr.drain()
        refs = []
        for a in list(args) + list((kwargs or {}).values()):
            _refs(a, refs)
        blocks = blocks_of(refs) if refs else []
        written = []
        if args and func.overloadpacket.__name__ not in _READ_ONLY:
            first = []
            _refs(args[0], first)
            written = blocks_of(first) if first else []
        ctx = OpContext(spec, blocks, written, args, kwargs or {})
        ctx.estimate = 0  # collectives write into tensors their caller allocated
        mgr.prepare(ctx)
        plain_to_ref = {}
        cargs = [swap_in(a, plain_to_ref) for a in args]
        ckwargs = {k: swap_in(v, plain_to_ref) for k, v in (kwargs or {}).items()}
        views = [(compute_view(r), r) for r in refs]
        out = mgr.call(ctx, func, cargs, ckwargs)
        _wait(out)
        mgr.mark_written(written)
        result = _unswap(out, plain_to_ref, views)
        mgr.finish(ctx)
        return result


def _functional_ops():
    ops = []
    packets = getattr(torch.ops, "_c10d_functional", None)
    if packets is None:
        return ops
    for name in ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
                 "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
                 "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single",
                 "broadcast", "broadcast_"):
        packet = getattr(packets, name, None)
        if packet is not None:
            ops.extend(getattr(packet, o) for o in packet.overloads())
    return ops


@implements(_functional_ops())
def functional_collective(func, args, kwargs, spec):
    """A functional collective on TensorRefs: the generic path, its results waited for first."""
    from .dispatch import run_generic

    def waited(*cargs, **ckwargs):
        out = func(*cargs, **ckwargs)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, _Tensor):
                torch.ops._c10d_functional.wait_tensor.default(t)
        return out

    waited.__name__ = str(func)
    return run_generic(waited, args, kwargs, spec)


_WRAP = getattr(torch.ops._c10d_functional, "_wrap_tensor_autograd", None)


@implements([_WRAP.default] if _WRAP is not None else [])
def no_async_wrapper(func, args, kwargs, spec):
    """``_wrap_tensor_autograd``: a view of the TensorRef, already waited for (Note [Collectives])."""
    return torch.ops.aten.alias.default(args[0] if args else kwargs["input"])
