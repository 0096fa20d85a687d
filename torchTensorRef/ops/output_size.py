"""How many bytes of new tensors an op will allocate, known before it runs.

A strategy must make room for an op's results *before* the op runs, or the budget would
be exceeded while it runs. The size is found by running the op on ``meta`` tensors (no
data, no computation) and cached by the shapes and dtypes of the arguments, so a training
loop pays this once per distinct op call. Ops whose result size depends on the data
(boolean indexing, ``nonzero``, ``unique``, ``masked_select`` ...) cannot run on meta: they
get room for an upper bound of their results, the size they would have were every mask
element true and every element distinct (Note [Data-dependent sizes]), and the block made
for the real, smaller result counts from then on. A few CPU ops return a workspace
whose size the backend library decides when it runs, and their meta kernels report it
empty: those are measured once per shapes by running them on zeros in host memory, and
so are ops with no meta kernel at all. What no kernel can size ahead is sized by the op's
first run (Note [Sizes known after the op]).

The estimate is in device bytes as the budget counts them: each new storage at the size the
device's allocator gives it (``tensorsManager.block_bytes``: CUDA rounds every allocation
up to 512 bytes), so an op with several results is not undercounted by up to 511 bytes a
result. The cache keeps the storages' own sizes: the rounding is the device's, applied per call.
"""

from __future__ import annotations

from typing import Dict, Hashable

import torch

from ..core import raw
from ..core.op_specs import OpSpec
from ..core.tensor_ref import TensorRef, block_of
from ..memory.devices import largest_within
from ..memory.manager import tensorsManager as _mgr
from .result_bounds import BOUNDS, META, META_TOO_SMALL, READS_VALUES, plain, to_meta

_cache: Dict[Hashable, tuple] = {}  # key -> (new storages' sizes, written tensors' sizes after)
_Tensor = torch.Tensor
_MAX_CACHE = 100_000


def _key(values) -> tuple:
    """The cache key of an argument list: tensors by shape, strides and dtype, the rest as they are."""
    out = []
    for v in values:
        if isinstance(v, _Tensor):
            # (strides too: a result laid out like an input with gaps, select_scatter's, takes
            # the gaps' bytes; keyed by shape alone, a contiguous call's size was reused for it)
            out.append((v.shape, v.stride(), v.dtype))  # torch.Size hashes as the tuple it is
        elif v.__class__ is list or v.__class__ is tuple:
            out.append(_key(v))
        else:
            out.append(v)
    return tuple(out)


#: CPU-only ops whose meta kernel returns an empty workspace (oneDNN sizes it at run time)
_PROBED = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})


def _to_host_zeros(value):
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        return plain(value).detach().clone()  # sparse: the same indices (result sizes follow them)
    if isinstance(value, torch.Tensor):
        return raw.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="cpu").zero_()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host_zeros(v) for v in value)
    return value


def _new_sizes(out, seen=None) -> tuple:
    """Bytes of each new storage of the (strided) tensors in ``out``, in order: results
    viewing one storage (``_transform_bias_rescale_qkv``'s) are one allocation."""
    if isinstance(out, torch.Tensor):
        if out.layout != torch.strided:
            return ()
        storage = out.untyped_storage()
        if seen is not None:
            if storage._cdata in seen:
                return ()
            seen.add(storage._cdata)
        return (storage.nbytes(),)
    if isinstance(out, (list, tuple)):
        seen = set() if seen is None else seen
        return tuple(n for o in out for n in _new_sizes(o, seen))
    return ()


def _meta_tensors(args, kwargs):
    """The strided tensors among ``args`` and ``kwargs`` (one level of lists)."""
    for v in list(args) + list(kwargs.values()):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                yield t


def _device_bytes(sizes) -> int:
    """Device bytes of allocations of ``sizes`` (an int: one allocation), each as the
    device's allocator gives it. Room is made for one allocation's slack (``Room.make``);
    several large ones add the slack the others may get (Note [Room for the allocator's
    slack])."""
    block_bytes = _mgr.backend.block_bytes
    if sizes.__class__ is int:
        return block_bytes(sizes)
    total = large = 0
    slack = _mgr.accounting.slack
    for n in sizes:
        total += block_bytes(n)
        large += n > slack
    return total + slack * (large - 1) if large > 1 and slack else total


def _storage_nbytes(value) -> int:
    if isinstance(value, TensorRef):
        return block_of(value).nbytes
    return value.untyped_storage().nbytes()


def _views_another(t: torch.Tensor, metas) -> bool:
    """Whether ``t`` now shares another argument's storage (``set_``): that allocates nothing."""
    key = t.untyped_storage()._cdata
    return any(m is not t and m.untyped_storage()._cdata == key for m in metas)


def _written(spec: OpSpec, args, kwargs):
    """The tensors the op writes and may resize (``resize_``, ``out=``), in order."""
    for i, name in spec.write_args:
        value = args[i] if i < len(args) else kwargs.get(name)
        yield from (value if isinstance(value, (list, tuple)) else (value,))


def _sizes_after(spec: OpSpec, meta_args, meta_kwargs) -> tuple:
    """Storage bytes of each written tensor after the op ran on meta (``None``: not a tensor,
    or it now views another argument's storage, which allocates nothing). It depends on the
    arguments' shapes only: cached with the op's new bytes."""
    metas = [v for v in list(meta_args) + list(meta_kwargs.values()) if isinstance(v, torch.Tensor)]
    return tuple(a.untyped_storage().nbytes() if isinstance(a, torch.Tensor) and not _views_another(a, metas)
                 else None for a in _written(spec, meta_args, meta_kwargs))


def _growth(spec: OpSpec, args, kwargs, sizes_after: tuple) -> int:
    """Bytes by which the op grows the tensors it writes: their sizes after it, less the
    storage they have now (which depends on their blocks, so it is not cached)."""
    grown = 0
    block_bytes = _mgr.backend.block_bytes  # (a storage that grows is a new allocation)
    for before, after in zip(_written(spec, args, kwargs), sizes_after):
        if after is not None and isinstance(before, torch.Tensor):
            now = _storage_nbytes(before)
            if after > now:  # (at least its own bytes: a growth within one rounded size still grows)
                grown += max(block_bytes(after) - block_bytes(now), after - now)
    return grown




def _sizes_without_meta(spec: OpSpec, args, kwargs):
    """The sizes of the op's new storages when its meta kernel cannot size them (an int
    for one, a tuple for each), or ``None``: known only once it ran.

    A data-dependent op gets its upper bound. An op with no meta kernel (the simulated
    device's fused RNN cells, custom ops) is run once on host zeros of the same shapes,
    unless it draws random numbers (that would move the generator's state: 0, the manager
    catches up after the op); one with no host kernel either (a CUDA-only op) is sized by
    its first run (Note [Sizes known after the op]).
    """
    bound = BOUNDS.get(spec.func)
    if bound is not None:
        try:
            return bound(args, kwargs) or 0  # (an int: one result; a tuple: each)
        except Exception:  # arguments the bound does not understand
            return 0
    if torch.Tag.nondeterministic_seeded in spec.func.tags or not spec.allocates:  # (out=: sized by meta)
        return 0
    try:
        out = spec.func(*_to_host_zeros(args), **{k: ("cpu" if k == "device" else _to_host_zeros(v))
                                                   for k, v in kwargs.items()})
    except Exception:  # no host kernel either
        return None
    return _new_sizes(out)


# Note [Sizes known after the op]: some ops' results have sizes only their kernel knows.
# cuDNN's RNN returns a reserve for its backward that the library sizes (its meta kernel
# says 0 bytes), and an op with neither a meta nor a host kernel (``_cudnn_rnn_backward``, a
# custom CUDA op) cannot be run ahead to see. Under a budget, the first call of such an op
# with given shapes keeps all the room the budget leaves beside its own blocks, as a
# region's first backward does, and the sizes its results then had are kept for its later
# calls with those shapes. An op whose results come out larger than estimated (a meta
# kernel that is wrong) passed the budget by the difference, which ``stats()`` records
# (``worst_overshoot_bytes``); its later calls with those shapes are sized by that run. With
# no budget nothing is kept for them: the device's capacity bounds them, as it bounds plain
# torch.

#: ids of the ops whose new bytes no kernel can size ahead (Note [Sizes known after the op])
_UNKNOWN_AHEAD = {id(op) for op in (getattr(getattr(torch.ops.aten, name, None), "default", None)
                                    for name in ("_cudnn_rnn", "miopen_rnn")) if op is not None}
#: ids of the ops whose results came out larger than estimated at least once
_OUTGREW: set = set()
#: (op, arguments' key) -> the sizes of the new storages such an op made when it ran
_measured: Dict[Hashable, tuple] = {}


class AllRoom(int):
    """An estimate that is all the room the budget leaves: the op's results are sized by its run."""

    __slots__ = ()


def sized_after_the_op(op) -> None:
    """Size ``op``'s results by its first run with given shapes, not ahead (Note [Sizes
    known after the op]): an op whose kernel sizes its results as it runs (a library's
    workspace) where its meta kernel cannot."""
    _UNKNOWN_AHEAD.add(id(op))


def _key_of(spec: OpSpec, args, kwargs) -> tuple:
    """The key of an op call by its arguments' shapes (raises for unhashable arguments)."""
    key = (spec, _key(args), _key(kwargs.items()) if kwargs else ())
    if spec.restrides:  # (a written tensor's size after the op follows its strides too)
        key += (tuple(t.stride() for t in _written(spec, args, kwargs) if isinstance(t, _Tensor)),)
    hash(key)
    return key


def _measured_bytes(spec: OpSpec, args, kwargs):
    """The device bytes an earlier run of the op with these shapes made, or ``None``."""
    try:
        sizes = _measured.get(_key_of(spec, args, kwargs))
    except (TypeError, RuntimeError):
        return None
    return None if sizes is None else _device_bytes(sizes)


def _all_room(args, kwargs) -> AllRoom:
    """All the room the budget leaves beside the op's own blocks (none with no budget)."""
    mgr = _mgr
    if mgr.settings.budget_value is None or mgr.limit is None or mgr.backend.passthrough:
        return AllRoom(0)
    size = mgr.backend.block_bytes
    own = {}
    for v in list(args) + list(kwargs.values()):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, TensorRef):
                b = block_of(t)
                if not b.host_only:
                    own[b.id] = size(b.nbytes)
    # (asked of the device, as a region's first backward asks; counted as the device counts
    # it, so that the op's check does not round it past the budget)
    with mgr.lock:  # (a loop on plain tensors sizes its ops outside it)
        left = mgr.limit - mgr.read_outside() - sum(own.values())
        return AllRoom(largest_within(mgr.accounting.within(left), size))


def results_seen(ctx) -> None:
    """After an op ran under a budget (``ctx``: its ``OpContext``, estimated): the sizes of its
    results kept where they were known only now, or came out larger than estimated."""
    estimate = ctx.estimate
    fid = id(ctx.spec.func)
    if estimate.__class__ is AllRoom:
        _UNKNOWN_AHEAD.add(fid)  # (no kernel could size it, and it ran)
    elif fid not in _UNKNOWN_AHEAD:
        total = 0
        for b in ctx.outputs:
            if not b.host_only:  # (a CPU result takes no device bytes)
                total += b.nbytes
        if total <= estimate:
            return
        _OUTGREW.add(fid)
    try:
        key = _key_of(ctx.spec, ctx.args, ctx.kwargs)
    except (TypeError, RuntimeError):
        return
    sizes = tuple(b.nbytes for b in ctx.outputs if not b.host_only)
    seen = _measured.get(key)
    if seen is None or sum(sizes) > sum(seen):
        if len(_measured) >= _MAX_CACHE:
            _measured.clear()
        _measured[key] = sizes


def estimate_output_bytes(spec: OpSpec, args, kwargs) -> int:
    """Bytes the op adds on the accelerator: the new (non-aliasing) tensors it returns, and
    the growth of the tensors it writes when it may resize them (``resize_``, ``out=``)."""
    if not spec.allocates and not spec.restrides:
        return 0  # views and in-place results allocate nothing
    fid = id(spec.func)
    if fid in _UNKNOWN_AHEAD or _OUTGREW and fid in _OUTGREW:  # (Note [Sizes known after the op])
        seen = _measured_bytes(spec, args, kwargs)
        if seen is not None:
            return seen
        if fid in _UNKNOWN_AHEAD:
            return _all_room(args, kwargs)
    key = None
    # The cache holds what depends on shapes alone: the new bytes, and for an op that may
    # resize what it writes, those tensors' sizes after it (their growth depends on their
    # blocks too, and is worked out per call).
    if id(spec.func) not in READS_VALUES:
        try:
            key = _key_of(spec, args, kwargs)
            hit = _cache.get(key)
        except (TypeError, RuntimeError):  # unhashable arguments; nested tensors have no sizes
            key = None
        else:
            if hit is not None:
                sizes, sizes_after = hit
                size = _device_bytes(sizes)
                return size + _growth(spec, args, kwargs, sizes_after) if sizes_after else size
    sizes_after = ()
    try:
        if spec.func in META_TOO_SMALL:
            raise LookupError(spec.name)  # sized by its bound
        inputs = None
        if spec.func in _PROBED:
            out = spec.func(*_to_host_zeros(args), **{k: _to_host_zeros(v) for k, v in kwargs.items()})
        else:
            meta_args = to_meta(args)
            meta_kwargs = {k: (META if k == "device" else to_meta(v)) for k, v in kwargs.items()}
            out = spec.func(*meta_args, **meta_kwargs)
            # A result sharing an input's storage is a view, whatever the schema says
            # (``_unsafe_view`` has no alias annotation): it allocates nothing.
            inputs = {t.untyped_storage()._cdata for t in _meta_tensors(meta_args, meta_kwargs)}
        sizes = _new_sizes(out, inputs) if spec.allocates else 0
        if spec.restrides and spec.func not in _PROBED:
            sizes_after = _sizes_after(spec, meta_args, meta_kwargs)
    except Exception:  # no meta kernel, or a data-dependent size
        sizes, sizes_after = _sizes_without_meta(spec, args, kwargs), ()
        if sizes is None:
            return _all_room(args, kwargs)  # (not cached: known once it ran, if it runs)
    if key is not None:
        if len(_cache) >= _MAX_CACHE:
            _cache.clear()
        _cache[key] = (sizes, sizes_after)
    size = _device_bytes(sizes)
    return size + _growth(spec, args, kwargs, sizes_after) if sizes_after else size
