"""Ops the simulated device runs as composites, on TensorRefs, where the CPU's kernel refuses
what CUDA's takes (Note [Kernels CUDA has for more dtypes] in ``memory/sim/kernels.py``).

On strict ``"sim"`` a TensorRef reports the device, and code written for an accelerator
calls such an op on it as it would on CUDA; its composite then runs op by op, each op paged
as any other. Plain torch on ``"sim"`` (``SimTensor``) runs the same composite, so the two
give the same values; elsewhere (CUDA, the CPU, the lenient ``"sim"`` that reports the
CPU) the op runs as it is.
"""

from __future__ import annotations

from ..core.op_specs import OpSpec, implements
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.kernels import EMULATED, emulation
from .dispatch import run_unhandled


@implements(sorted(EMULATED, key=str))
def emulated(func, args, kwargs, spec: OpSpec):
    backend = _mgr.backend
    if getattr(backend, "strict", False) and not backend.passthrough:
        composite = emulation(func, args)
        if composite is not None:
            return composite(*args, **kwargs)
    return run_unhandled(func, args, kwargs, spec)
