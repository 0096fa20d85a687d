"""The ``"sim"`` device: PyTorch's private-use backend, renamed, as a simulated accelerator.

Note [Strict sim]: CI has no GPU, so ``"sim"`` must make the code that CUDA runs fail where
it would fail on a GPU. Its TensorRefs therefore report a device of their own, ``sim:0``,
not ``cpu``: ``.device``, ``is_cpu``, ``.cpu()``, device-mismatch errors and every choice
PyTorch makes by device type (autocast, attention kernels) behave as for a separate
accelerator. The ops still compute with CPU kernels, on plain views of the blocks' copies
(the backend's ``compute`` device is the CPU), so values are bit-identical to plain torch
on the same device (``SimTensor``, below), and to plain torch on the CPU wherever PyTorch
picks the kernel by op and not by device type. Where it picks by device type, ``"sim"``
gets an accelerator's choice: ``scaled_dot_product_attention`` runs its math form there
(as on an accelerator without a fused kernel), not the CPU's fused kernel, and ``silu``'s
backward its generic formula; both differ from plain CPU torch in the last bits (up to
about 1e-6 at unit scale). The other half of the strictness (asynchronous copies whose
destination is unusable until waited on, pinned host memory, a finite capacity with
out-of-memory errors) lives in ``devices.py``.

This module registers the device with PyTorch once, the first time ``"sim"`` is chosen:

- ``torch.utils.rename_privateuse1_backend("sim")`` and a Python device guard, hooks and
  backend module (``torch.sim``), which needs torch >= 2.9;
- kernels for ``empty`` on the device, so ``torch.empty(..., device="sim")`` inside torch's
  own C++ code and ``cpu_tensor.to("sim")`` give TensorRefs;
- an autocast policy for the device, the CPU's own lists, so that
  ``torch.autocast("sim")`` casts what ``torch.autocast("cpu")`` would (and results stay
  bit-identical to the CPU reference).

Where registration is not possible (older torch, or another backend already renamed the
private-use device) ``"sim"`` falls back to its lenient form, whose TensorRefs report
``cpu``; :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import copy
import threading
from typing import Dict, Optional

import torch

from ...core import context, raw
from . import kernels as sim_kernels
from .. import streams

NAME = "sim"

_lock = threading.Lock()
_registered: Optional[torch.device] = None
_libraries = []  # torch.library registrations live as long as these objects

# -- autocast: the CPU policy (aten/src/ATen/autocast_mode.cpp), by (op, overload) -------------

#: ops whose floating-point inputs autocast casts to the lower precision (bfloat16 / float16)
LOWER_PRECISION = (
    "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
    "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
    "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
)
#: ops whose floating-point inputs autocast casts to float32
FLOAT32 = (
    "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int", "quantile",
    "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center", "cdist", "grid_sampler_2d",
    "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex", "cholesky",
    "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "max_pool3d",
    "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss", "cosine_embedding_loss",
    "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss", "smooth_l1_loss",
    "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div",
    "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2",
    "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
    "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank",
    "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor",
    "linalg_matrix_rank.atol_rtol_float", "linalg_solve", "linalg_cholesky", "linalg_svdvals",
    "linalg_eigvals", "linalg_eigvalsh", "linalg_inv", "linalg_householder_product", "linalg_tensorinv",
    "linalg_tensorsolve", "fake_quantize_per_tensor_affine", "geqrf", "_lu_with_info", "qr", "svd",
    "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d", "adaptive_max_pool3d",
    "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd", "linalg_eig",
    "linalg_eigh", "linalg_lstsq", "linalg_inv_ex",
)
#: ops whose floating-point inputs autocast casts to the widest of their types
PROMOTE = ("stack", "cat", "index_copy")


def unavailable_reason() -> Optional[str]:
    """Why the strict ``"sim"`` device cannot be registered here, or ``None`` if it can."""
    acc = getattr(torch._C, "_acc", None)
    if acc is None or not hasattr(acc, "register_python_privateuseone_device_guard"):
        return (f"torch {torch.__version__} cannot register a Python device (torch >= 2.9 can): "
                f'"sim" TensorRefs report device cpu')
    if torch.cuda.is_available():
        # Registered, the private-use device becomes the process's accelerator
        # (at::getAccelerator()), and from torch 2.8 on every CUDA backward then fails an
        # assertion in autograd's engine (opt_ready_stream && opt_parent_stream).
        return ('CUDA is available: registering the "sim" device would break CUDA\'s backward; '
                '"sim" TensorRefs report device cpu')
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", NAME):
        return (f"the private-use device is already taken by {name!r}: "
                f'"sim" TensorRefs report device cpu')
    return None


def registered() -> Optional[torch.device]:
    """The ``sim:0`` device once :func:`register` succeeded, else ``None``."""
    return _registered


def register() -> Optional[torch.device]:
    """Register the ``"sim"`` device with PyTorch (once); return ``sim:0``, or ``None``."""
    global _registered
    with _lock:
        if _registered is not None or unavailable_reason() is not None:
            return _registered
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() != NAME:  # (a reloaded module finds it done)
            _setup_privateuseone_for_python_backend(NAME, backend_module=_SimModule(), device_guard=_SimGuard())
            _register_factories()
            _register_autocast()
            sim_kernels.register()
            _report_backward_errors()
        # Optimizers choose their list (``_foreach``) implementation for exact tensors on an
        # accelerator and for the subclasses listed: plain tensors of "sim" must get CUDA's choice.
        from torch.optim import optimizer

        if SimTensor not in optimizer._foreach_supported_types:
            optimizer._foreach_supported_types.append(SimTensor)
        _registered = torch.device(NAME, 0)
        return _registered


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
    eval fast path). TensorRefs, whose CPU ones are known, refuse them (``_check_devices``).
    """

    # (no __slots__: module.to("sim") swaps a parameter with its SimTensor, which needs the
    # same slots)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, requires_grad: bool = False):
        inference = data.is_inference()
        if inference is not torch.is_inference_mode_enabled():
            # (a view made in inference mode of a normal tensor is normal: as the bytes, the wrapper)
            with torch.inference_mode(inference):
                return SimTensor.__new__(cls, data, requires_grad)
        if data.layout is torch.strided:
            t = torch.Tensor._make_wrapper_subclass(
                cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
                device=_registered, requires_grad=requires_grad)
        else:  # sparse (COO: the compressed layouts are not wrapped)
            t = torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=data.dtype, layout=data.layout,
                                                    device=_registered, requires_grad=requires_grad)
        if data.is_conj():
            torch._C._set_conj(t, True)  # conj() and neg views are lazy: the bit is the value
        if data.is_neg():
            torch._C._set_neg(t, True)
        t.data_ = data
        return t

    def __init__(self, data, requires_grad=False):
        pass

    # The subclass protocol of PyTorch's wrapper tensors: with it, ``module.to("sim")``
    # swaps each parameter with its SimTensor in place, as ``.data =`` does for CUDA (tied
    # weights stay tied; a new Parameter per module would untie them).
    def __tensor_flatten__(self):
        return ["data_"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return SimTensor(inner["data_"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from ...core.op_specs import spec_of

        kwargs = kwargs or {}
        target = kwargs.get("device")
        on_host = target is not None and torch.device(target).type == "cpu"
        try:
            out = func(*_unwrap(args), **_unwrap(kwargs))
        except Exception as e:
            if not in_backward():
                raise
            keep_for_backward(e)  # Note [Errors in backward on sim]
            return failed_result(func)
        if on_host:
            return out
        spec = spec_of(func)
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
                       for i in spec.return_args]
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
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new):
        # ``p.data = t`` copies t's metadata into p's C++ tensor, not the bytes this class holds
        torch._C.TensorBase.data.__set__(self, new)
        self.data_ = new.data_ if isinstance(new, SimTensor) else new

    def __reduce_ex__(self, protocol):
        # Saved as the plain CPU tensor of its values (as a TensorRef is), so that a file
        # holds plain tensors only and loads with weights_only=True anywhere.
        plain = self.data_.detach()
        plain.requires_grad_(self.requires_grad)
        attributes = _attributes(self)
        if getattr(self, "_is_param", False):
            plain = torch.nn.Parameter(plain, requires_grad=self.requires_grad)
        plain.__dict__.update(attributes)
        return plain.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
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


def _unwrap(value):
    if isinstance(value, SimTensor):
        return value.data_
    if isinstance(value, torch.device) and value.type == NAME:
        return torch.device("cpu")
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value


def _rewrap(out, args, kwargs):
    """Outputs as SimTensors: a view of an argument's bytes wraps the same bytes."""
    if isinstance(out, torch.Tensor) and not isinstance(out, SimTensor):
        if out.device.type == "cpu" and not out.is_meta and not out.is_nested:
            return SimTensor(out)
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, args, kwargs) for o in out)
    return out


class _SimGuard(torch._C._acc.DeviceGuard if hasattr(torch._C, "_acc") else object):
    """The device guard: the device is ``sim:0``, its streams and events are no-ops (PyTorch's).

    Defined here rather than PyTorch's dummy one: with that one, a C++ error in a backward
    op aborts the process (see Note [Errors in backward on sim]).
    """

    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class _SimModule:
    """``torch.sim``: what PyTorch asks of a device's backend module."""

    def is_available(self) -> bool:
        # Not to code that looks for "the" accelerator of the machine (``torch.accelerator``,
        # DataLoader's ``pin_memory``): on a machine without a GPU, scripts must behave as
        # they do without torchTensorRef. Tensors on "sim" work all the same.
        return False

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def manual_seed_all(self, seed: int) -> None:
        pass  # the simulated device computes with the CPU's kernels and generator

    def get_amp_supported_dtype(self):
        return [torch.float16, torch.bfloat16]

    def synchronize(self, device=None) -> None:
        """Wait for every pending copy (as ``torch.cuda.synchronize``)."""
        tensorsManager = context.manager()

        tensorsManager.synchronize()

    def memory_allocated(self, device=None) -> int:
        """Bytes of the device in use (as ``torch.cuda.memory_allocated``)."""
        tensorsManager = context.manager()

        return tensorsManager.stats()["device_bytes"]

    # Streams and events, for PyTorch code that orders its work with them (FSDP2): Note
    # [Streams of sim for PyTorch code] in ``streams.py``.
    Stream = streams.SimStream
    Event = streams.SimEvent

    def stream(self, stream) -> "streams.SimStreamContext":
        return streams.SimStreamContext(stream)

    def current_stream(self, device=None) -> "streams.SimStream":
        return streams.DEFAULT_STREAM

    def default_stream(self, device=None) -> "streams.SimStream":
        return streams.DEFAULT_STREAM

    def set_stream(self, stream) -> None:
        pass

    def __getattr__(self, name: str):
        raise AttributeError(f"module 'torch.{NAME}' has no attribute {name!r}")


def _register_factories() -> None:
    # The device's allocations: a new resident block of the manager, within its budget; where
    # torchTensorRef is disabled, a plain SimTensor (as plain torch makes plain CUDA tensors).
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (kernels for a device, not new ops)

    def empty_memory_format(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                            memory_format=None):
        return _empty(size, None, dtype, memory_format)

    def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
        return _empty(size, stride, dtype, None)

    def copy_from(src, dst, non_blocking=False):
        # Reached where PyTorch bypasses tensor subclasses (``torch.tensor(data, device="sim")``
        # converts its data with Python dispatch off): copy between the CPU bytes directly.
        _bytes_of(dst, written=True).copy_(_bytes_of(src, written=False))
        return dst

    def copy_from_and_resize(src, dst):
        if dst.shape != src.shape:
            raise RuntimeError(f"_copy_from_and_resize to a sim tensor of another shape ({tuple(dst.shape)} "
                               f"from {tuple(src.shape)}) is not supported")
        return copy_from(src, dst)

    def efficient_zero_tensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):
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


def _made_on_cpu(op):
    def kernel(*args, **kwargs):
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
    """Marks the ops run inside ``torchTensorRef.disabled(device="sim")``, on every thread.

    The device's ``empty`` kernel must know whether a new tensor is plain (a SimTensor) or
    managed, and backward runs on an autograd thread where ``disabled()``'s thread-local
    flag is not set; dispatch modes are carried to those threads.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
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


def _empty(size, stride, dtype, memory_format):
    tensorsManager = context.manager()

    if context.is_disabled() or getattr(_plain, "depth", 0) or tensorsManager._backend.name != NAME:
        if stride is None:
            plain = raw.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
        else:
            plain = raw.empty_strided(size, stride, dtype=dtype)
        return SimTensor(plain)
    try:
        return tensorsManager.new_device_tensor(size, stride, dtype, memory_format)
    except Exception as e:
        if not in_backward():
            raise
        keep_for_backward(e)  # Note [Errors in backward on sim]
        return FAILED


def _register_autocast() -> None:
    fallthrough = torch.library.Library("_", "IMPL")  # noqa: TOR901
    fallthrough.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    policies: Dict[str, tuple] = {"lower": LOWER_PRECISION, "float32": FLOAT32, "promote": PROMOTE}
    for policy, names in policies.items():
        for qualified in names:
            name, _, overload = qualified.partition(".")
            packet = getattr(torch.ops.aten, name, None)
            op = getattr(packet, overload or "default", None) if packet is not None else None
            if op is None:
                continue  # not in this torch version
            lib.impl(qualified, _autocast_kernel(op, policy), "AutocastPrivateUse1")
    _libraries.extend([fallthrough, lib])


# -- errors raised while autograd runs backward ------------------------------------------------
#
# Note [Errors in backward on sim]: PyTorch's Python-registered device guard calls into
# Python while the autograd engine unwinds a backward node that raised, and a Python error
# still pending at that moment aborts the process. So an error raised by torchTensorRef
# inside a backward op on the sim device (out of budget, a device mismatch) is not raised
# there: it is kept, the op returns ``FAILED``, which is no tensor, so the op fails in C++
# with no Python error pending, and ``backward()`` / ``autograd.grad()`` raise the kept
# error instead of the engine's. Other Python errors raised inside backward ops on sim (a
# tensor hook's, say) still abort. A GPU has a C++ device guard and needs none of this.


class _Failed:
    """What a backward op on sim returns when it failed (Note [Errors in backward on sim])."""

    def __repr__(self) -> str:
        return "<an error of torchTensorRef's, raised by backward()>"


FAILED = _Failed()


def failed_result(func):
    """What backward op ``func`` returns when it failed: ``FAILED``, or ``None`` for an op that
    returns nothing (an in-place ``_foreach_`` op, in an optimizer step run by a gradient hook),
    for which torch would raise on anything else, in Python, and abort."""
    return FAILED if func._schema.returns else None
_kept_errors: list = []
_kept_lock = threading.Lock()


def in_backward() -> bool:
    """Whether this thread is running a backward node of the autograd engine."""
    return torch._C._current_autograd_node() is not None


def keep_for_backward(error: BaseException) -> None:
    """Keep ``error`` to be raised by the ``backward()`` call that is running (Note [Errors in backward on sim])."""
    with _kept_lock:
        _kept_errors.append(error)


def _take_kept():
    with _kept_lock:
        kept = _kept_errors[0] if _kept_errors else None
        del _kept_errors[:]
    return kept


def _report_backward_errors() -> None:
    import torch.autograd
    import torch.autograd.graph

    original = torch.autograd.graph._engine_run_backward

    def run_backward(*args, **kwargs):
        with _kept_lock:
            del _kept_errors[:]
        try:
            result = original(*args, **kwargs)
        except Exception:
            kept = _take_kept()
            if kept is None:
                raise
            raise kept.with_traceback(kept.__traceback__) from None
        kept = _take_kept()
        if kept is not None:
            raise kept.with_traceback(kept.__traceback__)
        return result

    run_backward.__wrapped__ = original
    torch.autograd.graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward


_AUTOCAST_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(value) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == NAME and value.is_floating_point()
            and value.dtype is not torch.float64)


def _autocast_kernel(op, policy: str):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEY):
            if policy == "lower":
                dtype = torch.get_autocast_dtype(NAME)
            elif policy == "float32":
                dtype = torch.float32
            else:
                found = [v.dtype for v in _tensors(args, kwargs) if _eligible(v)]
                dtype = max(found, key=lambda d: torch.finfo(d).bits, default=None)
            if dtype is not None:
                args = tuple(_cast(a, dtype) for a in args)
                kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    kernel.__name__ = f"sim_autocast_{op.__name__.replace('.', '_')}"
    return kernel


def _tensors(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _cast(value, dtype):
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value
