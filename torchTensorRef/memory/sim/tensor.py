"""The simulated device's plain tensors: ``SimTensor`` and its dispatch.

A ``SimTensor`` wraps the plain CPU tensor of its bytes and reports ``sim:0``: its ops run on
those bytes with CPU kernels and their results are wrapped again (Note [Strict sim] in
``device.py``). This module also holds the device's name and, once ``device.register()``
succeeded, the device object SimTensors report.
"""

from __future__ import annotations

import copy
from typing import Any, List, Optional, Tuple

import torch
from torch._ops import OpOverload

from ...core import raw
from ...core.tensor_ref import TensorRef
from .backward_errors import failed_result, in_backward, keep_for_backward
from .kernels import EMULATED, emulation
from .pool import ALLOCATED

NAME = "sim"

#: ``sim:0`` once ``register()`` (``device.py``) succeeded, else ``None``: the device a
#: SimTensor reports (set there, read by ``registered()``)
registered_device: Optional[torch.device] = None


class SimTensor(torch.Tensor):
    """A plain tensor on the simulated device, that torchTensorRef does not manage.

    What ``torch.zeros(..., device="sim")`` or ``cpu_tensor.to("sim")`` give where
    torchTensorRef is disabled (``torchTensorRef.disabled()``), as plain torch gives plain
    CUDA tensors: its ops run at once on its CPU bytes, with the device's semantics (it
    reports ``sim:0``, PyTorch picks kernels for it as for any accelerator). Tests compare
    TensorRefs on ``"sim"`` with it, as they compare
    TensorRefs on CUDA with plain CUDA tensors.

    Unlike a CUDA tensor it takes a plain CPU tensor beside it: a nested tensor on the
    device is a plain CPU one (no wrapper can hold it), and its buffers and dense results
    meet SimTensors in ops that have only device tensors on CUDA (``TransformerEncoder``'s
    eval fast path). TensorRefs, whose CPU ones are known, refuse them (``check_devices``).
    """

    # (no __slots__: module.to("sim") swaps a parameter with its SimTensor, which needs the
    # same slots)
    #: the plain CPU tensor holding its bytes
    data_: torch.Tensor
    # (torch's stubs type the impl as a plain function, the attribute as a classmethod)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        inference = data.is_inference()
        if inference is not torch.is_inference_mode_enabled():
            # (a view made in inference mode of a normal tensor is normal: as the bytes, the wrapper)
            with torch.inference_mode(inference):
                return SimTensor.__new__(cls, data, requires_grad)
        if data.layout is torch.strided:
            ALLOCATED.track(data.untyped_storage())  # (the device holds it: Note [Allocated bytes on sim])
            t = torch.Tensor._make_wrapper_subclass(
                cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
                device=registered_device, requires_grad=requires_grad)
        else:  # sparse (COO: the compressed layouts are not wrapped)
            t = torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=data.dtype, layout=data.layout,
                                                    device=registered_device, requires_grad=requires_grad)
        if data.is_conj():
            torch._C._set_conj(t, True)  # conj() and neg views are lazy: the bit is the value
        if data.is_neg():
            torch._C._set_neg(t, True)
        t.data_ = data
        return t

    def __init__(self, data: torch.Tensor, requires_grad: bool = False) -> None:
        pass

    # The subclass protocol of PyTorch's wrapper tensors: with it, ``module.to("sim")``
    # swaps each parameter with its SimTensor in place, as ``.data =`` does for CUDA (tied
    # weights stay tied; a new Parameter per module would untie them).
    def __tensor_flatten__(self) -> Tuple[List[str], None]:
        return ["data_"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: None, outer_size: Any, outer_stride: Any) -> SimTensor:
        return SimTensor(inner["data_"])

    # (torch declares it by assigning a plain function, which mypy reads as an instance method)
    @classmethod
    def __torch_dispatch__(cls, func: OpOverload, types: Any, args: tuple = (),  # type: ignore[override]
                           kwargs: Optional[dict] = None) -> Any:
        from ...core.op_specs import move_list_versions, spec_of

        if len(types) > 1 and any(issubclass(t, TensorRef) for t in types):
            # A TensorRef among the arguments: its dispatch runs the op, with this tensor as
            # the plain device tensor it is (unwrapped here, it would be a plain CPU one).
            return NotImplemented
        kwargs = kwargs or {}
        if func in EMULATED:
            composite = emulation(func, args)
            if composite is not None:
                return composite(*args, **kwargs)  # (Note [Kernels CUDA has for more dtypes] in kernels.py)
        target = kwargs.get("device")
        on_host = target is not None and torch.device(target).type == "cpu"
        try:
            if not on_host and (_host_tensor_among(args) or _host_tensor_among(kwargs.values())):
                _refuse_host_tensors(func)
            out = func(*_unwrap(args), **_unwrap(kwargs))
        except Exception as e:
            if not in_backward():
                raise
            keep_for_backward(e)  # Note [Errors in backward on sim]
            return failed_result(func)
        if on_host:
            return out
        spec = spec_of(func)
        if spec.list_writes:
            move_list_versions(spec, args, kwargs, SimTensor)  # (Note [Versions of list writes])
        if spec.write_args:  # resize_, t_, out=, addbmm_ ...: the wrappers follow their bytes' new geometry
            for i, name in spec.write_args:
                arg = args[i] if i < len(args) else kwargs.get(name)
                for a in (arg if isinstance(arg, (list, tuple)) else (arg,)):
                    if isinstance(a, SimTensor) and (a.shape != a.data_.shape or a.stride() != a.data_.stride()
                                                     or a.storage_offset() != a.data_.storage_offset()):
                        raw.set_geometry(a, a.data_)
        if spec.host_results:  # small results CUDA makes in host memory
            return tuple(o if i in spec.host_results else _rewrap(o, args, kwargs) for i, o in enumerate(out))
        if spec.return_args and all(i is not None for i in spec.return_args):
            # in place: the very tensors written are returned
            written = [args[i] if i < len(args) else kwargs[spec.func._schema.arguments[i].name]
                       for i in spec.return_args if i is not None]  # (every one is: the filter types it)
            return written[0] if len(written) == 1 else tuple(written)
        return _rewrap(out, args, kwargs)

    def __repr__(self, *, tensor_contents=None):
        if not getattr(self, "_is_param", False):
            return torch._tensor_str._str(self, tensor_contents=tensor_contents)
        # a Parameter prints as a plain Parameter does (PyTorch wraps subclasses' text otherwise)
        del self._is_param
        try:
            return "Parameter containing:\n" + torch._tensor_str._str(self, tensor_contents=tensor_contents)
        finally:
            self._is_param = True

    def tolist(self):
        return self.data_.tolist()

    @property
    def data(self) -> torch.Tensor:
        return raw.TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # ``p.data = t`` copies t's metadata into p's C++ tensor, not the bytes this class holds
        raw.TENSOR_DATA.__set__(self, new)
        self.data_ = new.data_ if isinstance(new, SimTensor) else new

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Saved as the plain CPU tensor of its values (as a TensorRef is), so that a file
        # holds plain tensors only and loads with weights_only=True anywhere.
        plain = self.data_.detach()
        plain.requires_grad_(self.requires_grad)
        attributes = _attributes(self)
        if getattr(self, "_is_param", False):
            plain = torch.nn.Parameter(plain, requires_grad=self.requires_grad)
        plain.__dict__.update(attributes)
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> SimTensor:
        if id(self) in memo:
            return memo[id(self)]
        new = SimTensor(self.data_.clone(), requires_grad=self.requires_grad)
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        new.__dict__.update(copy.deepcopy(_attributes(self), memo))  # users' attributes
        if getattr(self, "_is_param", False):
            new._is_param = True
        return new

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.data_.untyped_storage()  # the device's bytes (in host memory)

    def data_ptr(self) -> int:
        return self.data_.data_ptr()

    def numpy(self, *, force: bool = False):
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
                        f"copy the tensor to host memory first.")

    def __format__(self, format_spec: str) -> str:
        # as a plain tensor: a 0-dim one formats as its value, a Parameter never does
        if self.dim() == 0 and not getattr(self, "_is_param", False):
            return self.item().__format__(format_spec)
        return object.__format__(self, format_spec)


def _attributes(t: SimTensor) -> dict:
    """What users set on ``t`` (not its bytes, nor the Parameter flag)."""
    return {k: v for k, v in t.__dict__.items() if k not in ("data_", "_is_param")}


# PyTorch prints a subclass with its class name where a plain tensor prints "tensor(": a
# SimTensor is a plain tensor of its device, and prints as one.
SimTensor.__name__ = "tensor"


def _unwrap(value: Any) -> Any:
    if isinstance(value, SimTensor):
        return value.data_
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _rewrap(out: Any, args: tuple, kwargs: dict) -> Any:
    """Outputs as SimTensors: a view of an argument's bytes wraps the same bytes."""
    if isinstance(out, torch.Tensor) and not isinstance(out, SimTensor):
        if out.device.type == "cpu" and not out.is_meta and not out.is_nested:
            return SimTensor(out)
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, args, kwargs) for o in out)
    return out


def _host_tensor_among(values) -> bool:
    """Whether a plain CPU tensor of at least one dimension is among ``values`` (one level of
    lists): a CUDA kernel takes a 0-dim one as a scalar, and refuses the others."""
    for a in values:
        for t in (a if a.__class__ is list or a.__class__ is tuple else (a,)):
            if (isinstance(t, torch.Tensor) and not isinstance(t, SimTensor) and t.dim() and t.device.type == "cpu"
                    and t.layout is torch.strided and not t.is_nested):
                return True
    return False


def _refuse_host_tensors(func: OpOverload) -> None:
    """CUDA's error for a CPU tensor beside device tensors, where its kernel would raise it:
    not for the copies and indexing ops that take host tensors, an op's host arguments
    (``lengths`` of a packed sequence), once the device has nested results (on "sim" a plain
    CPU tensor, and what is computed from it, Note [Plain CPU tensors]), nor inside one of
    the manager's ops, whose device copies are plain CPU tensors on "sim" (its dispatch
    checks their devices: ``ops/device_checks.py``)."""
    from ...core import context
    from ...core.op_specs import TAKES_CPU_TENSORS, spec_of

    manager = context.manager()
    if (func.overloadpacket.__name__ in TAKES_CPU_TENSORS or spec_of(func).host_args
            or manager.backend.nested_results or manager.lock._is_owned()):
        return
    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                       f"{registered_device} and cpu! (when checking the arguments of {func})")
