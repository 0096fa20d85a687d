"""What the generic path knows about one op while it runs (``OpContext``), and the steps it
shares with the fast path, multi-tensor ops, collectives and raw kernels: finding the
blocks among the arguments, swapping TensorRefs for their plain device views, and wrapping
the results again (a view joins its input's block, a written argument follows its new
geometry, anything else is a new block).
"""

from __future__ import annotations

import torch

from ..core import raw
from ..core.op_specs import OpSpec
from ..core.tensor_ref import TensorRef, block_of, compute_view, host_view, make_ref, set_view
from ..memory.sim.tensor import SimTensor
from .output_size import estimate_output_bytes

_Tensor = torch.Tensor
_strided = torch.strided


class OpContext:
    """One op in flight, as the manager and the strategy see it.

    Attributes:
        index: position of the op in the manager's op count.
        spec: the op's :class:`~torchTensorRef.core.op_specs.OpSpec`.
        blocks: distinct blocks of the TensorRef arguments, in argument order.
        written: the blocks the op writes in place.
        outputs: new blocks the op created (filled in after it runs).
        on_host: the op runs on host copies and makes host-only results (Note [Declared
            device] in ``devices.py``).
    """

    __slots__ = ("index", "spec", "blocks", "written", "outputs", "args", "kwargs", "on_host", "estimate",
                 "start", "_explicit", "_made", "_made_upto")

    def __init__(self, spec, blocks, written, args, kwargs, on_host=False):
        self.index = -1
        self.on_host = on_host
        #: when the op started, set by the manager while recording
        self.start = 0
        self.spec = spec
        self.blocks = blocks
        self.written = written
        self.outputs = []
        self.args = args
        self.kwargs = kwargs
        #: bytes of the new tensors it allocates, once known (``output_estimate``)
        self.estimate = None
        self._explicit = None
        self._made = None  # (device storage key -> block, for ``outputs[:_made_upto]``)
        self._made_upto = 0

    @property
    def name(self) -> str:
        return self.spec.name

    def output_on(self, key: int):
        """The first of ``outputs`` on the device storage ``key``, or ``None``. Outputs are
        indexed as they come, whoever adopted them (a result, a resized argument's new
        storage): an op with many results looks each up once, not in a scan of the others."""
        made = self._made
        if made is None:
            made = self._made = {}
        outputs = self.outputs
        for b in outputs[self._made_upto:]:
            made.setdefault(b.dev_key, b)
        self._made_upto = len(outputs)
        return made.get(key)

    def explicit(self) -> bool:
        """Whether a block of the op's arguments is explicit, and so are its results (Note
        [Default-device tensors] in ``device_checks.py``)."""
        if self._explicit is None:
            # (a loop, not ``any`` over a generator: a region's op has a block per tensor)
            self._explicit = False
            for b in self.blocks:
                if b.explicit:
                    self._explicit = True
                    break
        return self._explicit

    def output_estimate(self) -> int:
        """Bytes of new tensors the op will allocate (see ``output_size.py``)."""
        if self.estimate is None:
            self.estimate = estimate_output_bytes(self.spec, self.args, self.kwargs)
        return self.estimate


def collect_refs(values, refs):
    for a in values:
        if isinstance(a, TensorRef):
            refs.append(a)
        elif a.__class__ is list or a.__class__ is tuple:
            for e in a:
                if isinstance(e, TensorRef):
                    refs.append(e)


def blocks_of(refs):
    if len(refs) == 1:
        return [block_of(refs[0])]
    return blocks_of_list([block_of(r) for r in refs])


def blocks_of_list(blocks):
    """``blocks`` without repeats, in order."""
    if len(blocks) < 2:
        return blocks
    return list(dict.fromkeys(blocks))  # (a block hashes by identity: one per id)


def written_blocks(spec: OpSpec, args, kwargs):
    written = []
    for i, name in spec.write_args:
        a = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(a, TensorRef):
            written.append(block_of(a))
        elif isinstance(a, (list, tuple)):
            written.extend(block_of(e) for e in a if isinstance(e, TensorRef))
    return written


def swap_in(a, on_host):
    """``a`` with TensorRefs replaced by plain views of the copies the op runs on (and the
    plain tensors of the sim device by their bytes)."""
    if isinstance(a, TensorRef):
        return host_view(a) if on_host else compute_view(a)
    if a.__class__ is list or a.__class__ is tuple:
        return a.__class__(swap_in(e, on_host) for e in a)
    if a.__class__ is SimTensor:
        return a.data_
    return a


def placement(kwargs, blocks, backend) -> bool:
    """Whether the op runs on the host: it was asked for a host result, or has only CPU tensors."""
    target = kwargs.get("device") if kwargs else None
    if target is not None:
        return backend.is_host(torch.device(target))
    for b in blocks:  # (a loop: no generator per op)
        if not b.host_only:
            return False
    return bool(blocks)


def compute_kwargs(kwargs, backend, spec: OpSpec, blocks):
    """``kwargs`` with the declared device (``sim``) replaced by where the kernels run.

    ``to`` a host tensor's block (a host-only one), asked for the declared device, copies:
    on the device where the kernels run, the host, it would return its argument, and the
    result would be the host tensor where the device's own ``to`` gives a device tensor
    (``to`` reaches the manager whole under ``inference_mode``)."""
    target = kwargs.get("device")
    if target is not None and torch.device(target).type == backend.declared.type != backend.compute.type:
        kwargs = dict(kwargs)
        kwargs["device"] = backend.compute
        if spec.func.overloadpacket is _TO and any(b.host_only for b in blocks):
            kwargs["copy"] = True
    return kwargs


_TO = torch.ops.aten.to


def follow_restrides(spec, args, kwargs, cargs, ckwargs, ctx, mgr):
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


def follow_resizes(spec, args, kwargs, cargs, ckwargs, ctx, mgr):
    # Some in-place ops resize their argument as an out= op would: x.addbmm_(b1, b2) turns
    # a (1,) x into (n, m), on a larger storage. Only a changed shape needs the full check.
    for i, name in spec.write_args:
        ref, view = (args[i], cargs[i]) if i < len(args) else (kwargs.get(name), ckwargs.get(name))
        if isinstance(ref, TensorRef) and ref.shape != view.shape:
            _follow_restride(ref, view, ctx, mgr)


def _follow_restride(ref, view, ctx, mgr):
    storage = view.untyped_storage()
    if storage._cdata != block_of(ref).dev_key:
        source = next((b for b in ctx.blocks if b.dev_key == storage._cdata), None)
        new = make_ref(source, view, mgr.declared) if source is not None else mgr.adopt_output(view, ctx)
        mgr.rebind(ref, new)
    elif storage.nbytes() != block_of(ref).nbytes:
        mgr.resized(block_of(ref), storage.nbytes())  # resize_ grew the storage in place
    if ref.shape != view.shape or ref.stride() != view.stride() or ref.storage_offset() != view.storage_offset():
        raw.set_geometry(ref, view)
    set_view(ref, view)


def wrap_outputs(out, ctx, spec, args, kwargs, mgr):
    if isinstance(out, _Tensor):
        index = spec.return_args[0] if spec.return_args else None
        if index is not None:
            return args[index] if index < len(args) else kwargs[spec.func._schema.arguments[index].name]
        return wrap_one(out, ctx, mgr)
    if isinstance(out, (list, tuple)):
        if spec.return_args and len(spec.return_args) == len(out) and out.__class__ is tuple:
            items = []
            for i, (o, index) in enumerate(zip(out, spec.return_args)):
                if index is not None:
                    name = spec.func._schema.arguments[index].name
                    items.append(args[index] if index < len(args) else kwargs[name])
                elif i in spec.host_results:
                    items.append(o)  # a plain CPU tensor, as CUDA makes it (registry._HOST_RESULTS)
                else:
                    items.append(wrap_nested(o, ctx, mgr))
            return tuple(items)
        return wrap_nested(out, ctx, mgr)
    return out


def wrap_nested(out, ctx, mgr):
    if isinstance(out, _Tensor):
        return wrap_one(out, ctx, mgr)
    if isinstance(out, (list, tuple)):
        return out.__class__(wrap_nested(o, ctx, mgr) for o in out)
    return out


def wrap_one(t, ctx, mgr):
    if isinstance(t, TensorRef) or t.is_meta:  # (not ``t.device.type``: that costs a microsecond)
        return t
    if t.layout is not _strided or t.is_nested:
        # No single storage to page (sparse, nested): a plain tensor of the device, unmanaged.
        if t.layout is torch.sparse_coo and mgr.backend.declared.type == "sim" and not ctx.on_host:
            return SimTensor(t)
        if t.is_nested and mgr.backend.simulated:
            mgr.backend.nested_results = True  # (Note [Plain CPU tensors] in ``device_checks.py``)
        return t
    if not t.is_cpu and t.device != mgr.backend.compute:
        return t  # explicitly sent to another device than the manager's: not managed
    storage = t.untyped_storage()
    key = storage._cdata
    for b in ctx.blocks:
        if b.dev_key == key:
            return make_ref(b, t, mgr.declared)  # a view: shares the input's block
    if ctx.outputs:
        b = ctx.output_on(key)
        if b is not None:
            return make_ref(b, t, mgr.declared)  # shares the storage of another of its results
    ref = mgr.adopt_output(t, ctx, storage)
    if ctx.explicit():
        block_of(ref).explicit = True
    return ref

