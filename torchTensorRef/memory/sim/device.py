"""The ``"sim"`` device: PyTorch's private-use backend, renamed, as a simulated accelerator.

Note [Strict sim]: CI has no GPU, so ``"sim"`` must make the code that CUDA runs fail where
it would fail on a GPU. Its TensorRefs therefore report a device of their own, ``sim:0``,
not ``cpu``: ``.device``, ``is_cpu``, ``.cpu()``, device-mismatch errors and every choice
PyTorch makes by device type (autocast, attention kernels) behave as for a separate
accelerator. The ops still compute with CPU kernels, on plain views of the blocks' copies
(the backend's ``compute`` device is the CPU), so values are bit-identical to plain torch
on the same device (``SimTensor``, in ``tensor.py``), and to plain torch on the CPU
wherever PyTorch picks the kernel by op and not by device type. Where it picks by device
type, ``"sim"`` gets an accelerator's choice: ``scaled_dot_product_attention`` runs its
math form there (as on an accelerator without a fused kernel), not the CPU's fused kernel,
and ``silu``'s backward its generic formula; both differ from plain CPU torch in the last
bits (up to about 1e-6 at unit scale). The other half of the strictness (asynchronous
copies whose destination is unusable until waited on, pinned host memory, a finite capacity
with out-of-memory errors) lives in ``devices.py``.

This module registers the device with PyTorch once, the first time ``"sim"`` is chosen:

- ``torch.utils.rename_privateuse1_backend("sim")`` and a Python device guard, hooks and
  backend module (``torch.sim``), which needs torch >= 2.9;
- kernels for ``empty`` on the device, so ``torch.empty(..., device="sim")`` inside torch's
  own C++ code and ``cpu_tensor.to("sim")`` give TensorRefs (``allocation.py``);
- an autocast policy for the device, the CPU's own lists, so that
  ``torch.autocast("sim")`` casts what ``torch.autocast("cpu")`` would (and results stay
  bit-identical to the CPU reference; ``autocast.py``);
- the report of errors raised inside backward ops (``backward_errors.py``);
- ``torch.Generator(device="sim")`` (Note [Generators of sim]).

Where registration is not possible (older torch, or another backend already renamed the
private-use device) ``"sim"`` falls back to its lenient form, whose TensorRefs report
``cpu``; :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

import torch
from torch.types import Device

from ...core import context, list_ops
from .. import streams
from . import kernels as sim_kernels
from . import tensor as sim_tensor
from .allocation import register_factories
from .autocast import register_autocast
from .backward_errors import report_backward_errors
from .tensor import NAME, SimTensor

_lock = threading.Lock()


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
    return sim_tensor.registered_device


def register() -> Optional[torch.device]:
    """Register the ``"sim"`` device with PyTorch (once); return ``sim:0``, or ``None``."""
    with _lock:
        if sim_tensor.registered_device is not None or unavailable_reason() is not None:
            return sim_tensor.registered_device
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        if torch._C._get_privateuse1_backend_name() != NAME:  # (a reloaded module finds it done)
            _setup_privateuseone_for_python_backend(NAME, backend_module=_SimModule(), device_guard=_SimGuard())
            register_factories()
            register_autocast()
            sim_kernels.register()
            report_backward_errors()
            _install_generators()
        # Plain tensors of "sim" must get the list (``_foreach``) implementations plain
        # tensors get on CUDA.
        list_ops.admit(SimTensor)
        sim_tensor.registered_device = torch.device(NAME, 0)
        return sim_tensor.registered_device


#: the base of a Python device guard, where this torch has one
_DeviceGuard: Any = torch._C._acc.DeviceGuard if hasattr(torch._C, "_acc") else object


class _SimGuard(_DeviceGuard):
    """The device guard: the device is ``sim:0``, its streams and events are no-ops (PyTorch's).

    Defined here rather than PyTorch's dummy one: with that one, a C++ error in a backward
    op aborts the process (see Note [Errors in backward on sim] in
    ``backward_errors.py``).
    """

    def type_(self) -> torch._C._autograd.DeviceType:
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

    # (its random ops without a generator draw from the CPU's default one: its state is the
    # device's, as ``torch.random.fork_rng(device_type="sim")`` saves and restores it)
    def get_rng_state(self, device: Device = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Device = None) -> None:
        torch.set_rng_state(new_state)

    def get_amp_supported_dtype(self) -> List[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def synchronize(self, device: Device = None) -> None:
        """Wait for every pending copy (as ``torch.cuda.synchronize``)."""
        tensorsManager = context.manager()

        tensorsManager.synchronize()

    def memory_allocated(self, device: Device = None) -> int:
        """Bytes of the device in use (as ``torch.cuda.memory_allocated``)."""
        tensorsManager = context.manager()

        return tensorsManager.stats()["device_bytes"]

    # Streams and events, for PyTorch code that orders its work with them (FSDP2): Note
    # [Streams of sim for PyTorch code] in ``streams.py``.
    Stream = streams.SimStream
    Event = streams.SimEvent

    def stream(self, stream: Optional[streams.SimStream]) -> streams.SimStreamContext:
        return streams.SimStreamContext(stream)

    def current_stream(self, device: Device = None) -> streams.SimStream:
        return streams.DEFAULT_STREAM

    def default_stream(self, device: Device = None) -> streams.SimStream:
        return streams.DEFAULT_STREAM

    def set_stream(self, stream: streams.SimStream) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"module 'torch.{NAME}' has no attribute {name!r}")


# Note [Generators of sim]: the simulated device computes with the CPU's kernels, whose random
# ops draw from CPU generators; its own generator is therefore one: a CPU generator, seeded,
# stepped and saved as the CPU's (``torch.randn(n, generator=g, device="sim")`` draws the
# numbers the CPU does from a CPU generator seeded alike), that reports ``sim:0`` as its
# device, so that code choosing by ``generator.device`` (the creation functions under the
# manager) treats it as the device's. PyTorch makes a private-use device's generators in C++
# only (``PrivateUse1HooksInterface::getNewGenerator``, which a Python backend cannot provide:
# ``torch.Generator(device="sim")`` raised NotImplementedError), so the registration names
# ``torch.Generator`` a subclass of PyTorch's class that makes one for "sim" and PyTorch's own
# generator for any other device; every generator is an instance of it, as before.
_TorchGenerator = torch._C.Generator
#: the metaclass of PyTorch's generators (pybind11's)
_TorchGeneratorType: Any = type(_TorchGenerator)


class _GeneratorType(_TorchGeneratorType):
    """The type of what ``torch.Generator`` names once "sim" is registered."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is not Generator:
            return super().__call__(*args, **kwargs)  # (a subclass: SimGenerator, or the user's own)
        if _names_sim(args, kwargs):
            return SimGenerator()
        return _TorchGenerator(*args, **kwargs)

    def __instancecheck__(cls, instance: object) -> bool:
        if cls is Generator:
            return isinstance(instance, _TorchGenerator)
        return super().__instancecheck__(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        if cls is Generator:
            return issubclass(subclass, _TorchGenerator)
        return super().__subclasscheck__(subclass)


class Generator(_TorchGenerator, metaclass=_GeneratorType):
    """``torch.Generator``: PyTorch's generator, and the simulated device's for ``device="sim"``."""


Generator.__module__, Generator.__qualname__ = "torch", "Generator"


class SimGenerator(Generator):
    """A random number generator of the simulated device (Note [Generators of sim])."""

    # (the stubs declare PyTorch's ``device`` a writable attribute; it is read-only there too)
    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device(NAME, 0)

    def clone_state(self) -> "SimGenerator":
        clone = SimGenerator()
        clone.set_state(self.get_state())
        return clone

    def __reduce__(self) -> tuple:
        # (PyTorch's rebuilds a CPU generator: the state is the CPU's, the class says "sim")
        return SimGenerator, (), _TorchGenerator.__reduce__(self)[2]


def _names_sim(args: tuple, kwargs: dict) -> bool:
    """Whether ``torch.Generator(*args, **kwargs)`` asks for the simulated device."""
    device = kwargs.get("device", args[0] if args else None)
    if not isinstance(device, (str, torch.device)):
        return False
    device = torch.device(device)
    if device.type != NAME:
        return False
    if device.index not in (None, 0):
        raise RuntimeError(f'"{NAME}" has one device, {NAME}:0 (got: torch.Generator(device={str(device)!r}))')
    return True


def _install_generators() -> None:
    # (torch's name rebound to a subclass of the class it names: the stubs say it is a class)
    torch.Generator = Generator  # type: ignore[misc]
