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
so are ops with no meta kernel at all.

The estimate is in device bytes as the budget counts them: each new storage at the size the
device's allocator gives it (``tensorsManager.block_bytes``: CUDA rounds every allocation
up to 512 bytes), so an op with several results is not undercounted by up to 511 bytes a
result. The cache keeps the storages' own sizes: the rounding is the device's, applied per call.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable

import torch

from ..core import raw
from ..core.op_specs import OpSpec
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.tensor import SimTensor

_cache: Dict[Hashable, tuple] = {}  # key -> (new storages' sizes, written tensors' sizes after)
_Tensor = torch.Tensor
_META = torch.device("meta")
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


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return raw.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=_META)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


#: CPU-only ops whose meta kernel returns an empty workspace (oneDNN sizes it at run time)
_PROBED = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.data_ if t.__class__ is SimTensor else t


def _to_host_zeros(value):
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        return _plain(value).detach().clone()  # sparse: the same indices (result sizes follow them)
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
    from ..core.tensor_ref import TensorRef, block_of

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


# Note [Data-dependent sizes]: the bound of each op whose result size depends on its data,
# from the arguments' shapes alone where one exists (reading the data would make the host
# wait for the device). Two ops have no such bound: ``bincount`` (the largest value plus
# one) and ``repeat_interleave`` with tensor repeats (their sum). Their kernels read those
# values themselves before allocating (CUDA's too, unless ``output_size`` is given), so the
# bound reads them first: the same wait, one op earlier. Those bounds depend on values, so
# they are never cached. An op that still outgrows its estimate (a custom op whose meta
# kernel is wrong) makes the manager make room after it ran, and the peak may pass the
# budget by the difference (``stats()["worst_overshoot_bytes"]`` records it).

def _itemsize(t: torch.Tensor) -> int:
    return t.element_size()


def _bound_index(args, kwargs) -> int:
    # A k-dim boolean mask selects at most all of its elements: as k long indices of that
    # length, which the meta kernel sizes.
    self, indices = args[0], args[1]
    long_indices = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            long_indices += [raw.empty_strided((index.numel(),), (1,), dtype=torch.long, device=_META)] * index.dim()
        else:
            long_indices.append(_to_meta(index))
    out = torch.ops.aten.index.Tensor(_to_meta(self), long_indices)
    return out.numel() * _itemsize(self)


def _bound_masked_select(args, kwargs) -> int:
    self, mask = args[0], args[1]
    return torch.broadcast_shapes(self.shape, mask.shape).numel() * _itemsize(self)


def _bound_nonzero(args, kwargs) -> int:
    return args[0].numel() * max(args[0].dim(), 1) * 8


def _bound_ctc_loss(args, kwargs) -> tuple:
    # The loss per sequence, and log_alpha of (batch, time, 2 * longest target + 1): the
    # longest target is at most the targets' width, or all of them when concatenated.
    log_probs, targets = args[0], args[1]
    batch = log_probs.size(1) if log_probs.dim() == 3 else 1
    longest = targets.size(-1) if targets.dim() == 2 else targets.numel()
    itemsize = _itemsize(log_probs)
    return (batch * itemsize, batch * log_probs.size(0) * (2 * longest + 1) * itemsize)


def _values(t: torch.Tensor) -> torch.Tensor:
    """The current values of ``t`` as a plain tensor (waiting for copies in flight)."""
    from ..core.tensor_ref import TensorRef

    if isinstance(t, TensorRef):
        return t.target
    return _plain(t)


def _bound_repeat_interleave(args, kwargs) -> int:
    # repeat_interleave(repeats, *, output_size=None): sum(repeats) int64 indices.
    size = kwargs.get("output_size")
    if size is None:
        size = int(_values(args[0]).sum()) if args[0].numel() else 0
    return size * 8


def _bound_bincount(args, kwargs) -> int:
    # bincount(self, weights=None, minlength=0): max(self) + 1 counts, int64 or the weights'
    # floating type (at most 8 bytes each).
    self = args[0]
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    length = int(_values(self).max()) + 1 if self.numel() else 0
    return max(length, minlength) * 8


def _unique_bound(flags_at: tuple):
    """The bound of a ``unique`` variant: every element distinct; the inverse indices and
    the counts (int64) only when asked (``flags_at``: their argument positions)."""

    def bound(args, kwargs) -> tuple:
        self = args[0]
        asked = [8 * self.numel() for i in flags_at if (args[i] if i < len(args) else False)]
        return (self.numel() * _itemsize(self), *asked)

    return bound


_BOUNDS: Dict[object, Callable] = {}
#: ids of the ops whose bound reads values (Note [Data-dependent sizes]): never cached by
#: shapes (ids: ``OpOverload.__hash__`` is Python code, and this is asked for every op)
_READS_VALUES = set()
#: ops whose meta kernel runs but cannot know the size (it would read a tensor's values)
#: ops whose meta kernel sizes what they write too small (``_native_batch_norm_legit``'s out=
#: variants: the meta kernel leaves the out tensors as given, the host kernel gives them new
#: storage, which the budget then held twice for a moment): sized by their bounds instead
#: ``_embedding_bag``'s kernels lay out its bookkeeping results as they need (the CPU's
#: gives ``max_indices`` a result in every mode and ``offset2bag`` one more element), and its
#: meta kernel as the CPU's does not: sized by a bound of all four
_META_TOO_SMALL = frozenset(op for op in (
    torch.ops.aten._ctc_loss.Tensor,
    getattr(torch.ops.aten._native_batch_norm_legit, "out", None),
    getattr(torch.ops.aten._native_batch_norm_legit, "no_stats_out", None),
    torch.ops.aten._embedding_bag.default,
) if op is not None)


def _bound_batch_norm_out(args, kwargs) -> tuple:
    """Its three results whole: the output (as the input) and the saved mean and inverse
    deviation (one per channel, in at least float32)."""
    x = args[0]
    channels = x.shape[1] if x.dim() > 1 else 1
    stat = channels * max(x.element_size(), 4)
    return (x.numel() * x.element_size(), stat, stat)


def _bound_embedding_bag(args, kwargs) -> tuple:
    """Its four results whole: the bags' sums (bags x embedding size), ``offset2bag`` (one
    per index, and one more), ``bag_size`` (one per bag) and ``max_indices`` (one per bag
    and embedding column, as in max mode)."""
    weight, indices, offsets = args[0], args[1], args[2]
    include_last = args[5] if len(args) > 5 else kwargs.get("include_last_offset", False)
    bags = indices.shape[0] if indices.dim() == 2 else offsets.shape[0] - bool(include_last)
    dim = weight.shape[1]
    index = indices.element_size()
    return (bags * dim * weight.element_size(), (indices.numel() + 1) * index, bags * index, bags * dim * index)


def _register_bounds() -> None:
    aten = torch.ops.aten
    pairs = [
        # (an out= variant's bound is its result's: more than the out tensor grows by)
        ("index", ("Tensor", "Tensor_out"), _bound_index),
        ("masked_select", ("default", "out"), _bound_masked_select),
        ("nonzero", ("default", "out"), _bound_nonzero),
        ("argwhere", ("default",), _bound_nonzero),
        # (self, sorted, return_inverse[, return_counts]), (self, return_inverse, return_counts, dim) ...
        ("_unique", ("default",), _unique_bound((2,))),
        ("_unique2", ("default",), _unique_bound((2, 3))),
        ("unique_dim", ("default",), _unique_bound((3, 4))),
        ("unique_consecutive", ("default",), _unique_bound((1, 2))),
        ("unique_dim_consecutive", ("default",), _unique_bound((2, 3))),
        ("_ctc_loss", ("Tensor",), _bound_ctc_loss),
        ("_native_batch_norm_legit", ("out", "no_stats_out"), _bound_batch_norm_out),
        ("_embedding_bag", ("default",), _bound_embedding_bag),
        ("repeat_interleave", ("Tensor",), _bound_repeat_interleave),
        ("bincount", ("default",), _bound_bincount),
    ]
    for name, overloads, bound in pairs:
        packet = getattr(aten, name, None)
        for overload in overloads:
            op = getattr(packet, overload, None) if packet is not None else None
            if op is not None:
                _BOUNDS[op] = bound
                if bound in (_bound_repeat_interleave, _bound_bincount):
                    _READS_VALUES.add(id(op))


_register_bounds()


def _size_without_meta(spec: OpSpec, args, kwargs) -> int:
    """The op's new bytes (device bytes) when its meta kernel cannot size them."""
    return _device_bytes(_sizes_without_meta(spec, args, kwargs))


def _sizes_without_meta(spec: OpSpec, args, kwargs):
    """The sizes of the op's new storages when its meta kernel cannot size them (an int
    for one, a tuple for each).

    A data-dependent op gets its upper bound. An op with no meta kernel (the simulated
    device's fused RNN cells, custom ops) is run once on host zeros of the same shapes,
    unless it draws random numbers (that would move the generator's state). Else 0: the
    manager catches up after the op.
    """
    bound = _BOUNDS.get(spec.func)
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
        return 0
    return _new_sizes(out)


def estimate_output_bytes(spec: OpSpec, args, kwargs) -> int:
    """Bytes the op adds on the accelerator: the new (non-aliasing) tensors it returns, and
    the growth of the tensors it writes when it may resize them (``resize_``, ``out=``)."""
    if not spec.allocates and not spec.restrides:
        return 0  # views and in-place results allocate nothing
    key = None
    # The cache holds what depends on shapes alone: the new bytes, and for an op that may
    # resize what it writes, those tensors' sizes after it (their growth depends on their
    # blocks too, and is worked out per call).
    if id(spec.func) not in _READS_VALUES:
        try:
            key = (spec, _key(args), _key(kwargs.items()) if kwargs else ())
            if spec.restrides:  # (a written tensor's size after the op follows its strides too)
                key += (tuple(t.stride() for t in _written(spec, args, kwargs) if isinstance(t, _Tensor)),)
            hit = _cache.get(key)  # (hashing raises for unhashable arguments)
        except (TypeError, RuntimeError):  # unhashable arguments; nested tensors have no sizes
            key = None
        else:
            if hit is not None:
                sizes, sizes_after = hit
                size = _device_bytes(sizes)
                return size + _growth(spec, args, kwargs, sizes_after) if sizes_after else size
    sizes_after = ()
    try:
        if spec.func in _META_TOO_SMALL:
            raise LookupError(spec.name)  # sized by its bound
        inputs = None
        if spec.func in _PROBED:
            out = spec.func(*_to_host_zeros(args), **{k: _to_host_zeros(v) for k, v in kwargs.items()})
        else:
            meta_args = _to_meta(args)
            meta_kwargs = {k: (_META if k == "device" else _to_meta(v)) for k, v in kwargs.items()}
            out = spec.func(*meta_args, **meta_kwargs)
            # A result sharing an input's storage is a view, whatever the schema says
            # (``_unsafe_view`` has no alias annotation): it allocates nothing.
            inputs = {t.untyped_storage()._cdata for t in _meta_tensors(meta_args, meta_kwargs)}
        sizes = _new_sizes(out, inputs) if spec.allocates else 0
        if spec.restrides and spec.func not in _PROBED:
            sizes_after = _sizes_after(spec, meta_args, meta_kwargs)
    except Exception:  # no meta kernel, or a data-dependent size
        sizes, sizes_after = _sizes_without_meta(spec, args, kwargs), ()
    if key is not None:
        if len(_cache) >= _MAX_CACHE:
            _cache.clear()
        _cache[key] = (sizes, sizes_after)
    size = _device_bytes(sizes)
    return size + _growth(spec, args, kwargs, sizes_after) if sizes_after else size
