"""Arguments that accelerator kernels read in host memory: the lengths of packed sequences,
the per-position scalars of list ops.

CUDA's ``_pack_padded_sequence`` takes ``lengths`` only as a CPU tensor, and so do
``_foreach_addcmul`` and ``_foreach_addcdiv`` their ``scalars`` ("Expected scalars to be on
CPU"). A program written for plain torch makes them with ``torch.tensor(...)`` or
``torch.arange(...)``: a CPU tensor there, an accelerator TensorRef under the manager. The
kernel gets the host copy instead, as plain torch would have had it (the positions are
``OpSpec.host_args``). (The results CUDA makes in host memory are in
``op_specs._HOST_RESULTS``.)
"""

from __future__ import annotations

from ..core.op_specs import aten, implements
from ..core.tensor_ref import TensorRef, block_of
from .dispatch import run_generic


def _on_device(value) -> bool:
    return isinstance(value, TensorRef) and not block_of(value).host_only


def to_host(spec, args, kwargs):
    """``(args, kwargs)`` with each TensorRef among ``spec.host_args`` that is not a host
    tensor replaced by its host copy (a host-only TensorRef)."""
    for index, name in spec.host_args:
        if index < len(args):
            if _on_device(args[index]):
                args = tuple(args[:index]) + (args[index].to("cpu"),) + tuple(args[index + 1:])
        elif _on_device(kwargs.get(name)):
            kwargs = dict(kwargs)
            kwargs[name] = kwargs[name].to("cpu")
    return args, kwargs


@implements([aten._pack_padded_sequence.default])
def pack_padded_sequence(func, args, kwargs, spec):
    args, kwargs = to_host(spec, args, kwargs)
    return run_generic(func, args, kwargs, spec)
