"""Compiled regions: a function or module compiled by ``torch.compile`` that the manager
runs as one op.

Note [Compiled regions]: the manager cannot run inside a compiled graph (Note
[torch.compile] in ``compiler.py``), so a region is compiled for plain tensors and the
manager works at its boundary, as it does around one aten op (``op_protocol.py``):

1. the region's TensorRefs (in its arguments, and the parameters and buffers of a module)
   are its op's blocks: ``_prepare`` refuses the call with ``OutOfBudgetError`` if they
   and the region's outputs cannot fit in the budget together, makes room and fetches
   them as one working set, and the strategy sees one op;
2. the blocks are pinned and the compiled code runs on their plain views (a module's
   parameters and buffers are swapped for their views during the call), with creation
   functions making plain tensors (``disabled()``);
3. an input whose view the compiled code wrote (its version counter moved) is marked
   written; each output becomes a TensorRef (a view of an input joins its block, anything
   else is a new resident block), room being made for the new ones first;
4. the blocks are unpinned and ``_finish`` lets the strategy react, as after any op.

The outputs' size is known after the first call with given input shapes; from then on it
is part of the working set checked and made room for before the call. The compiled code's
intermediate tensors are allocated by the compiled kernels outside the manager's books, as
an aten op's temporary workspace is: the budget counts the region's inputs and outputs.

Autograd cannot see through a region (the compiled code runs on plain views, not on the
TensorRefs autograd tracks), so a call that would need gradients is refused.
"""

from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from ..memory.manager import tensorsManager as _mgr
from ..ops.dispatch import OpContext, _blocks_of, _blocks_of_list, _wrap_one
from .plain import disabled
from ..core.tensor_ref import TensorRef, compute_view, host_view


class _RegionSpec:
    """What the op protocol and the strategies read of an op's spec, for a region (one per
    region: Flow keys its history on it)."""

    __slots__ = ("name",)
    restrides = False

    def __init__(self, name: str):
        self.name = name


class _RegionContext(OpContext):
    __slots__ = ("estimate",)

    def output_estimate(self) -> int:
        return self.estimate


_GRAD_ERROR = (
    "{name}: a compiled region runs inference only, and {what} requires grad with grad mode on: "
    "the compiled code runs on plain views of the TensorRefs, which autograd does not connect "
    "to them, so no gradient would reach them. Call it under torch.no_grad() or "
    "torch.inference_mode(), or use torch.compile without compile_region (its ops then run "
    "eagerly through the manager, gradients included)")


class CompiledRegion:
    """A function or module compiled by ``torch.compile`` that the manager runs as one op
    (Note [Compiled regions]). Made by :func:`compile_region`."""

    def __init__(self, target, compile_kwargs: dict):
        self.module = target if isinstance(target, torch.nn.Module) else None
        self.compiled = torch.compile(target, **compile_kwargs)
        label = type(target).__name__ if self.module is not None else getattr(target, "__qualname__", repr(target))
        self.spec = _RegionSpec(f"compiled region {label}")
        self._out_bytes: dict = {}  # output bytes of the last call, by input shapes

    @property
    def name(self) -> str:
        return self.spec.name

    def __call__(self, *args, **kwargs):
        module = self.module
        slots = []  # (dict, key, TensorRef) of the module's parameters and buffers
        if module is not None:
            for m in module.modules():
                for d in (m._parameters, m._buffers):
                    for k, v in d.items():
                        if isinstance(v, TensorRef):
                            slots.append((d, k, v))
        leaves = pytree.tree_leaves((args, kwargs))
        refs = [a for a in leaves if isinstance(a, TensorRef)] + [v for _d, _k, v in slots]
        if torch.is_grad_enabled():
            for t in refs + [a for a in leaves if isinstance(a, torch.Tensor)]:
                if t.requires_grad:
                    raise RuntimeError(_GRAD_ERROR.format(name=self.name, what="an input or parameter"))
        mgr = _mgr
        with mgr._lock:
            if mgr._dead:
                mgr._drain()
            blocks = _blocks_of(refs) if refs else []
            on_host = not mgr._backend.passthrough and bool(blocks) and all(b.host_only for b in blocks)
            ctx = _RegionContext(self.spec, blocks, [], args, kwargs, on_host)
            key = tuple((tuple(a.shape), a.dtype) for a in leaves if isinstance(a, torch.Tensor))
            ctx.estimate = self._out_bytes.get(key, 0)
            mgr._prepare(ctx)
            for b in blocks:
                b.pins += 1
            try:
                out, nbytes = self._run(ctx, args, kwargs, slots, on_host)
            finally:
                for b in blocks:
                    b.pins -= 1
            self._out_bytes[key] = nbytes
            mgr._finish(ctx)
            return out

    def _run(self, ctx, args, kwargs, slots, on_host):
        mgr = _mgr
        view = host_view if on_host else compute_view
        if on_host:
            for b in ctx.blocks:
                mgr.sync_host(b)  # the region reads the host copies
        views = {}

        def swap(a):
            if isinstance(a, TensorRef):
                entry = views.get(id(a))
                if entry is None:
                    v = view(a)
                    entry = views[id(a)] = (a, v, v._version)
                return entry[1]
            return a

        cargs, ckwargs = pytree.tree_map(swap, (args, kwargs))
        module = self.module
        own = module is not None and module._compiled_call_impl is self
        try:
            for d, k, v in slots:
                d[k] = swap(v)
            if own:
                module._compiled_call_impl = None  # the compiled module calls itself: not this again
            with disabled():
                out = self.compiled(*cargs, **ckwargs)
        finally:
            if own:
                module._compiled_call_impl = self
            for d, k, v in slots:
                d[k] = v
        written = [ref._tr_block for ref, v, version in views.values() if v._version != version]
        if written:
            ctx.written = _blocks_of_list(written)
            if on_host:
                for b in ctx.written:
                    mgr._host_written(b)
            else:
                mgr._mark_written(ctx.written)
        # Room for the new outputs before they join the books (inputs are pinned).
        inputs = {b.dev_key for b in ctx.blocks}
        compute = mgr._backend.compute
        fresh = {}
        for t in pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and not isinstance(t, TensorRef) and t.layout is torch.strided
                    and t.device == compute):
                s = t.untyped_storage()
                if s._cdata not in inputs:
                    fresh[s._cdata] = s.nbytes()
        nbytes = sum(fresh.values())
        if nbytes and not on_host and mgr._limit is not None:
            mgr._make_room(nbytes, {b.id for b in ctx.blocks}, ctx.name)
        wrapped = pytree.tree_map(
            lambda t: _wrap_one(t, ctx, mgr) if isinstance(t, torch.Tensor) else t, out)
        return wrapped, nbytes


def compile_region(target, **compile_kwargs):
    """Compile ``target`` (a function or an ``nn.Module``) with ``torch.compile(target,
    **compile_kwargs)`` and run each call as one op of the manager (Note [Compiled regions]).

    The TensorRefs it reads (its arguments, and a module's parameters and buffers) are made
    resident together within the budget and the compiled code runs on them at compiled
    speed; its outputs are TensorRefs. Inference only: a call that needs gradients raises.

    A module is compiled in place, as ``Module.compile()`` does, and returned (its calls,
    hooks included, go through the region); a function gives a new function.

    Raises (when called):
        OutOfBudgetError: the region's inputs and outputs do not fit in the budget together.
        RuntimeError: grad mode is on and an input or parameter requires grad.
    """
    region = CompiledRegion(target, compile_kwargs)
    if region.module is not None:
        target._compiled_call_impl = region
        return target

    @functools.wraps(target)
    def run(*args, **kwargs):
        return region(*args, **kwargs)

    run.region = region
    return run
