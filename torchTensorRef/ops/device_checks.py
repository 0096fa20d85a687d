"""Devices of an op's arguments, checked as the accelerator's kernels would.

On ``"sim"`` (strict) and on CUDA, an op whose tensors are on the accelerator and on the
host fails in plain torch; the manager, which moves blocks itself, must not hide that
from the user's code, nor refuse what the accelerator's kernels accept (CPU scalars,
indices of some ops).
"""

from __future__ import annotations

import torch

from ..core.tensor_ref import TensorRef
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.tensor import SimTensor

_Tensor = torch.Tensor
_strided = torch.strided


#: ops whose accelerator kernels accept CPU tensors of any size among their arguments
_TAKES_CPU_TENSORS = frozenset({
    "copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "index", "_unsafe_index", "index_put",
    "index_put_", "_index_put_impl_", "_unsafe_index_put", "_pack_padded_sequence", "_pad_packed_sequence",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "set_", "lift_fresh", "lift_fresh_copy",
})


def _plain_tensor_in(values) -> bool:
    """Whether ``values`` (arguments, one level of lists) hold a tensor that is not a TensorRef."""
    for a in values:
        if isinstance(a, TensorRef):
            continue
        if a.__class__ is list or a.__class__ is tuple:
            for e in a:
                if isinstance(e, _Tensor) and not isinstance(e, TensorRef):
                    return True
        elif isinstance(a, _Tensor):
            return True
    return False


def _check_devices(spec, args, kwargs, declared, blocks) -> None:
    """On the strict ``"sim"``: refuse CPU tensors beside accelerator TensorRefs where CUDA kernels do.

    Refused: a CPU TensorRef, and a plain view of a block's host copy (what ``.target`` gives
    for a tensor that is on the host): on CUDA both are CPU tensors, and ``cuda_t + cpu_t``
    raises. A 0-dim CPU tensor is a scalar, which accelerator kernels accept (Note [Strict
    sim] in ``memory/sim/device.py``); so do the copies and indexing ops of ``_TAKES_CPU_TENSORS``.
    Other plain CPU tensors are let through: on the simulated device the results of ops the
    manager does not page (nested tensors, and the dense tensors computed from them, as in
    ``TransformerEncoder``'s eval fast path) are plain CPU tensors that are the device's on a
    GPU, and nothing tells them apart from a program's own CPU tensors.
    """
    host_args = ()
    if spec.host_args:
        host_args = _check_host_args(spec, args, kwargs, declared)
    for b in blocks:  # (``blocks``: those of the TensorRef arguments)
        if b.host_only:
            break
    else:
        if not _plain_tensor_in(args) and not (kwargs and _plain_tensor_in(kwargs.values())):
            return  # the common case: only TensorRefs on the device, nothing to look for
    hosted = None
    for a in _tensor_args(args, kwargs):
        if a.dim() == 0 or any(a is h for h in host_args):  # (a host argument belongs there)
            continue
        cls = a.__class__
        if cls is TensorRef:
            if not a._tr_block.host_only:
                continue
        elif (cls is SimTensor or isinstance(a, (TensorRef, SimTensor)) or a.layout is not _strided
              or a.is_nested or a.device.type != "cpu"):
            continue  # (a managed Parameter, a sim Parameter: the device's; sparse: no host copy's view)
        else:
            if hosted is None:  # (only for a plain CPU argument: rare, and the blocks are many)
                hosted = {b.host._cdata for b in _mgr._hosted.values() if b.host is not None}
            if a.untyped_storage()._cdata not in hosted:
                continue
        if spec.func.overloadpacket.__name__ in _TAKES_CPU_TENSORS:
            return
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{declared} and cpu! (when checking the arguments of {spec.name})")


def _check_host_args(spec, args, kwargs, declared) -> tuple:
    """Refuse a device tensor where the accelerator's kernel reads the argument in host
    memory (``OpSpec.host_args``), as CUDA's kernels do; the manager gives them host copies
    of TensorRefs first (``host_arguments.to_host``). Returns those arguments."""
    found = []
    for index, name in spec.host_args:
        a = args[index] if index < len(args) else kwargs.get(name)
        on_device = (not a._tr_block.host_only) if isinstance(a, TensorRef) else isinstance(a, SimTensor)
        if on_device:
            raise RuntimeError(f"Expected {name} to be on CPU, got {declared} instead. "
                               f"(when checking the arguments of {spec.name})")
        found.append(a)
    return tuple(found)


def _tensor_args(args, kwargs):
    for a in list(args) + (list(kwargs.values()) if kwargs else []):
        if isinstance(a, _Tensor):
            yield a
        elif a.__class__ is list or a.__class__ is tuple:
            for e in a:
                if isinstance(e, _Tensor):
                    yield e
