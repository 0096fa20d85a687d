"""Ops that read only their input's shape, dtype and strides (``empty_like``, ``new_zeros`` ...).

The generic path would bring the input's bytes to the accelerator for nothing (and under a
tight budget evict something for them). These run on a ``meta`` stand-in of the input with
the device made explicit, so only the result takes accelerator memory.
"""

from __future__ import annotations

import torch

from ..core import raw
from ..core.tensor_ref import TensorRef
from .dispatch import run_generic
from ..core.op_specs import aten, implements

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
    stand_in = raw.empty_strided(source.size(), source.stride(), dtype=source.dtype, device=_META)
    kwargs = dict(kwargs)
    if kwargs.get("device") is None:
        kwargs["device"] = source.device  # the declared device: a CPU tensor's result stays on the CPU
    return run_generic(func, (stand_in,) + tuple(args[1:]), kwargs, spec)
