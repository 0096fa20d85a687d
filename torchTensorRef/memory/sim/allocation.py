"""The simulated device's allocations: its factory kernels and the plain mode.

``torch.empty(..., device="sim")`` (and every allocation PyTorch's own C++ code makes on the
device) reaches the kernels registered here: a new resident block of the manager within its
budget, or, where torchTensorRef is disabled or inside :class:`PlainMode`, a plain
``SimTensor`` (as plain torch makes plain CUDA tensors). Registered once, by ``register()``
(``device.py``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.types import Device

from ...core import context, raw
from ...core.tensor_ref import block_of
from .backward_errors import FAILED, failed_result, in_backward, keep_for_backward
from .tensor import NAME, SimTensor

_libraries: List[torch.library.Library] = []  # torch.library registrations live as long as these objects


def register_factories() -> None:
    # The device's allocations: a new resident block of the manager, within its budget; where
    # torchTensorRef is disabled, a plain SimTensor (as plain torch makes plain CUDA tensors).
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kernels for a device, not new ops)

    def empty_memory_format(size: Sequence[int], *, dtype: Optional[torch.dtype] = None,
                            layout: Optional[torch.layout] = None, device: Device = None,
                            pin_memory: Optional[bool] = None,
                            memory_format: Optional[torch.memory_format] = None) -> Tensor:
        return _empty(size, None, dtype, memory_format)

    def empty_strided(size: Sequence[int], stride: Sequence[int], *, dtype: Optional[torch.dtype] = None,
                      layout: Optional[torch.layout] = None, device: Device = None,
                      pin_memory: Optional[bool] = None) -> Tensor:
        return _empty(size, stride, dtype, None)

    def copy_from(src: Tensor, dst: Tensor, non_blocking: bool = False) -> Tensor:
        # Reached where PyTorch bypasses tensor subclasses (``torch.tensor(data, device="sim")``
        # converts its data with Python dispatch off): copy between the CPU bytes directly.
        _bytes_of(dst, written=True).copy_(_bytes_of(src, written=False))
        return dst

    def copy_from_and_resize(src: Tensor, dst: Tensor) -> Tensor:
        if dst.shape != src.shape:
            raise RuntimeError(f"_copy_from_and_resize to a sim tensor of another shape ({tuple(dst.shape)} "
                               f"from {tuple(src.shape)}) is not supported")
        return copy_from(src, dst)

    def efficient_zero_tensor(size: Sequence[int], *, dtype: Optional[torch.dtype] = None,
                              layout: Optional[torch.layout] = None, device: Device = None,
                              pin_memory: Optional[bool] = None) -> Tensor:
        return _empty(size, None, dtype, None).zero_()  # (a plain zero tensor: the same values)

    lib.impl("_efficientzerotensor", efficient_zero_tensor, "PrivateUse1")
    # Factories whose only kernels are per backend (no composite of ops the device has):
    # made by the CPU's kernel and copied to the device, as their CUDA kernels make them there.
    for name in _CPU_MADE_FACTORIES:
        packet, _, overload = name.partition(".")
        lib.impl(name, _made_on_cpu(getattr(getattr(torch.ops.aten, packet), overload or "default")), "PrivateUse1")
    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    lib.impl("_copy_from_and_resize", copy_from_and_resize, "PrivateUse1")
    _libraries.append(lib)


#: factories with no kernel the simulated device can run (per-backend kernels only)
_CPU_MADE_FACTORIES = ("tril_indices", "triu_indices", "kaiser_window", "kaiser_window.periodic",
                       "kaiser_window.beta")


def _made_on_cpu(op: OpOverload) -> Callable[..., Tensor]:
    def kernel(*args: Any, **kwargs: Any) -> Tensor:
        made = op(*args, **dict(kwargs, device=torch.device("cpu")))
        return _empty(made.size(), made.stride(), made.dtype, None).copy_(made)

    return kernel


def _bytes_of(t: torch.Tensor, written: bool) -> torch.Tensor:
    """The plain CPU tensor holding ``t``'s values (a TensorRef's device copy, brought in)."""
    from ...core.tensor_ref import TensorRef

    if isinstance(t, SimTensor):
        return t.data_
    if isinstance(t, TensorRef):
        tensorsManager = context.manager()

        return tensorsManager.write_view(t) if written else t.target
    return t


class PlainMode(torch.utils._python_dispatch.TorchDispatchMode):
    """Marks the ops run inside ``torchTensorRef.disabled(device="sim")``, on every thread
    (dispatch modes are carried to autograd's threads): the device's ``empty`` kernel makes
    their new tensors plain (SimTensors), and an error one raises in a backward is kept for
    the caller (Note [Errors in backward on sim])."""

    marks_plain = True  # (core.context.is_disabled looks for it)

    def __torch_dispatch__(self, func: OpOverload, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        _plain.depth = getattr(_plain, "depth", 0) + 1
        try:
            return func(*args, **(kwargs or {}))
        except Exception as e:
            if not in_backward():
                raise
            keep_for_backward(e)  # Note [Errors in backward on sim]
            return failed_result(func)
        finally:
            _plain.depth -= 1


_plain = threading.local()


def _empty(size: Sequence[int], stride: Optional[Sequence[int]], dtype: Optional[torch.dtype],
           memory_format: Optional[torch.memory_format]):  # (a tensor, or FAILED in a backward)
    tensorsManager = context.manager()

    plain_depth: int = getattr(_plain, "depth", 0)
    if context.is_disabled() or plain_depth or tensorsManager.backend.name != NAME:
        if stride is None:
            plain = raw.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
        else:
            plain = raw.empty_strided(size, stride, dtype=dtype)
        return SimTensor(plain)
    try:
        ref = tensorsManager.new_device_tensor(size, stride, dtype, memory_format)
        # (an allocation on the device named: ``cpu_tensor.to("sim")``, ``torch.empty(..., device="sim")``
        # in torch's code; the creation functions say which of theirs are default-device tensors)
        block_of(ref).explicit = True
        return ref
    except Exception as e:
        if not in_backward():
            raise
        keep_for_backward(e)  # Note [Errors in backward on sim]
        return FAILED
