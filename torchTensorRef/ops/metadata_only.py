"""Ops that read only their input's shape, dtype and strides (``empty_like``, ``new_zeros`` ...).

The generic path would bring the input's bytes to the accelerator for nothing (and under a
tight budget evict something for them). These run on a ``meta`` stand-in of the input with
the device made explicit, so only the result takes accelerator memory.

A filled result larger than the room the budget leaves (AdamW's moments of an embedding
table at a tenth of the weights) is made in host memory instead, as a block whose only copy
is on the host: it is paged in pieces by the ops that use it (``split.py``). Random fills
are not: their bits come from the device's generator, which the host's would not reproduce.
"""

from __future__ import annotations

import torch

from ..core import raw
from ..core.op_specs import aten, implements
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as mgr
from . import split
from .dispatch import run_generic, run_unhandled

_META = torch.device("meta")


@implements([
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.rand_like.default, aten.rand_like.generator,
    aten.randn_like.default, aten.randn_like.generator, aten.randint_like.default,
    aten.randint_like.low_dtype, aten.randint_like.generator,
    aten.randint_like.low_generator_dtype, aten.randint_like.Tensor,
    aten.randint_like.Tensor_generator,
    aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default,
])
def metadata_only(func, args, kwargs, spec):
    source = args[0]
    if not isinstance(source, TensorRef):
        return run_generic(func, args, kwargs, spec)
    if (mgr.fast and func in _FILLS and kwargs.get("device") is None
            and mgr.settings.budget_value is None
            and (block_of(source).dev is not None or mgr.backend.passthrough)):
        # Nothing to bring in and no budget to weigh: the fill runs on the resident copy, by
        # the fast path (a meta stand-in costs a hundred times the op: its meta kernels are
        # Python). Random fills stay below: the device's generator draws them. Where the fast
        # path is closed (callbacks, recording) the stand-in keeps the source out of the op's
        # blocks: a fill does not read it.
        return run_unhandled(func, args, kwargs, spec)
    stand_in = raw.empty_strided(source.size(), source.stride(), dtype=source.dtype, device=_META)
    kwargs = dict(kwargs)
    named = kwargs.get("device") is not None
    if not named:
        kwargs["device"] = source.device  # the declared device: a CPU tensor's result stays on the CPU
    out = None
    if func in _FILLS and torch.device(kwargs["device"]) == mgr.declared:
        out = _made_on_host(func, stand_in, args, kwargs)
    if out is None:
        out = run_generic(func, (stand_in,) + tuple(args[1:]), kwargs, spec)
    if isinstance(out, TensorRef) and not block_of(out).host_only:
        # made like the source, not on a device the program named: a default-device tensor's
        # result is one too (Note [Default-device tensors] in ``device_checks.py``)
        named = named and mgr.is_accelerator(torch.device(kwargs["device"]))
        block_of(out).explicit = block_of(source).explicit or named
    return out


#: the deterministic fills: the same bits made on the host as on the device
_FILLS = frozenset({
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default,
})


def _made_on_host(func, stand_in, args, kwargs):
    """The result made in host memory when it is larger than the room the budget leaves
    (``None`` when it fits, or without a budget)."""
    left = split.room()
    if left is None:
        return None
    meta = func(stand_in, *args[1:], **dict(kwargs, device=_META))
    if meta.untyped_storage().nbytes() <= left:
        return None
    host = func(raw.empty_strided(stand_in.size(), stand_in.stride(), dtype=stand_in.dtype),
                *args[1:], **dict(kwargs, device="cpu"))
    return mgr.manage_tensor(host, shared=False)
