"""Arguments that accelerator kernels read in host memory: the lengths of packed sequences.

CUDA's ``_pack_padded_sequence`` takes ``lengths`` only as a CPU tensor, and a program
written for plain torch makes it with ``torch.tensor(...)``: a CPU tensor there, an
accelerator TensorRef under the manager. The kernel gets the host copy instead, as plain
torch would have had it. (The results CUDA makes in host memory are in
``registry._HOST_RESULTS``.)
"""

from __future__ import annotations

from ..core.op_specs import aten, implements
from ..core.tensor_ref import TensorRef
from .dispatch import run_generic


@implements([aten._pack_padded_sequence.default])
def pack_padded_sequence(func, args, kwargs, spec):
    if len(args) > 1 and isinstance(args[1], TensorRef) and not args[1]._tr_block.host_only:
        args = (args[0], args[1].to("cpu")) + tuple(args[2:])
    elif isinstance(kwargs.get("lengths"), TensorRef) and not kwargs["lengths"]._tr_block.host_only:
        kwargs = dict(kwargs, lengths=kwargs["lengths"].to("cpu"))
    return run_generic(func, args, kwargs, spec)
