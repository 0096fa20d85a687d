"""How many bytes of new tensors an op will allocate, known before it runs.

A strategy must make room for an op's results *before* the op runs, or the budget would
be exceeded while it runs. The size is found by running the op on ``meta`` tensors (no
data, no computation) and cached by the shapes and dtypes of the arguments, so a training
loop pays this once per distinct op call. Ops whose result size depends on the data
(``nonzero``, ``unique``) cannot run on meta: they estimate 0 and the manager makes room
after the op instead (see ``TensorsManager._finish``). A few CPU ops return a workspace
whose size the backend library decides when it runs, and their meta kernels report it
empty: those are measured once per shapes by running them on zeros in host memory.
"""

from __future__ import annotations

from typing import Dict, Hashable

import torch

from .. import raw
from .registry import OpSpec

_cache: Dict[Hashable, int] = {}
_Tensor = torch.Tensor
_META = torch.device("meta")
_MAX_CACHE = 100_000


def _key(values) -> tuple:
    """The cache key of an argument list: tensors by shape and dtype, the rest as they are."""
    out = []
    for v in values:
        if isinstance(v, _Tensor):
            out.append((v.shape, v.dtype))  # torch.Size hashes as the tuple it is
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


def _to_host_zeros(value):
    if isinstance(value, torch.Tensor):
        return raw.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="cpu").zero_()
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host_zeros(v) for v in value)
    return value


def _new_bytes(out, spec: OpSpec) -> int:
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes() if out.layout == torch.strided else 0
    if isinstance(out, (list, tuple)):
        return sum(_new_bytes(o, spec) for o in out)
    return 0


def _storage_nbytes(value) -> int:
    from ..tensor_ref import TensorRef

    if isinstance(value, TensorRef):
        return value._tr_block.nbytes
    return value.untyped_storage().nbytes()


def _views_another(t: torch.Tensor, metas) -> bool:
    """Whether ``t`` now shares another argument's storage (``set_``): that allocates nothing."""
    key = t.untyped_storage()._cdata
    return any(m is not t and m.untyped_storage()._cdata == key for m in metas)


def _growth(spec: OpSpec, args, kwargs, meta_args, meta_kwargs) -> int:
    """Bytes by which the op grows the tensors it writes (``resize_``, ``out=``)."""
    metas = [v for v in list(meta_args) + list(meta_kwargs.values()) if isinstance(v, torch.Tensor)]
    grown = 0
    for i, name in spec.write_args:
        before, after = (args[i], meta_args[i]) if i < len(args) else (kwargs.get(name), meta_kwargs.get(name))
        pairs = zip(before, after) if isinstance(before, (list, tuple)) else [(before, after)]
        for b, a in pairs:
            if isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and not _views_another(a, metas):
                grown += max(0, a.untyped_storage().nbytes() - _storage_nbytes(b))
    return grown


def estimate_output_bytes(spec: OpSpec, args, kwargs) -> int:
    """Bytes the op adds on the accelerator: the new (non-aliasing) tensors it returns, and
    the growth of the tensors it writes when it may resize them (``resize_``, ``out=``)."""
    if not spec.allocates and not spec.restrides:
        return 0  # views and in-place results allocate nothing
    try:
        # Growth depends on the written tensors' blocks, not only on shapes: not cached.
        key = None if spec.restrides else (spec, _key(args), _key(kwargs.items()) if kwargs else ())
        hash(key)
    except (TypeError, RuntimeError):  # unhashable arguments; nested tensors have no sizes
        key = None
    if key is not None:
        hit = _cache.get(key)
        if hit is not None:
            return hit
    try:
        if spec.func in _PROBED:
            out = spec.func(*_to_host_zeros(args), **{k: _to_host_zeros(v) for k, v in kwargs.items()})
        else:
            meta_args = _to_meta(args)
            meta_kwargs = {k: (_META if k == "device" else _to_meta(v)) for k, v in kwargs.items()}
            out = spec.func(*meta_args, **meta_kwargs)
        size = _new_bytes(out, spec) if spec.allocates else 0
        if spec.restrides and spec.func not in _PROBED:
            size += _growth(spec, args, kwargs, meta_args, meta_kwargs)
    except Exception:  # no meta kernel, or a data-dependent size
        size = 0
    if key is not None:
        if len(_cache) >= _MAX_CACHE:
            _cache.clear()
        _cache[key] = size
    return size
