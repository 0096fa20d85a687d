"""Where a tensor made from nothing goes: ``torch.zeros``, ``torch.randn``, ``torch.tensor``, ``torch.load``.

The creation functions patched by ``patching.py`` land here. Under an accelerator manager,
torch behaves as if the accelerator were the default device, with the budget kept:

- ``device="cpu"`` gives a CPU tensor (a host-only block), another device than the
  manager's is left alone, and no device (or the manager's) gives an accelerator tensor;
- a *factory* (``zeros``, ``arange``, ``randn`` ...) makes its tensor directly on the
  device, after room is made for it, where the strategy keeps new tensors there or
  ``device`` names the accelerator, and the random ones and windows always, so that their
  numbers come from the device's generator and arithmetic, as they would under
  ``torch.set_default_device`` (and as the in-place initialisers of ``nn.Module`` do, since
  they are ops on the device); ``torch.normal``, which no default device reaches, draws on
  the host unless ``device`` names the accelerator; one
  larger than the whole budget is made in host memory (a random one from the CPU's
  generator: on ``"sim"`` the same numbers) and brought in when used. Whether a factory
  is an op on the device does not hang on how full the device happens to be: a loop's
  ops stay the same from step to step, which Flow's period needs (a ``generate()`` step
  whose ``arange`` was made on the host, the device being full at that moment, lost the
  period);
- tensors made from data (``tensor``, ``as_tensor``, ``from_numpy`` ...) and
  ``torch.load`` are made in host memory and brought in when an op needs them, even when
  ``device`` or ``map_location`` names the accelerator: nothing reaches the device without
  room made for it first.

A tensor made with the accelerator named (``device=``, a ``torch.device`` context,
``set_default_device``) is the program's own device tensor (*explicit*); one made without a
device is its default-device tensor, which ops mixed with CPU tensors run on the host (Note
[Default-device tensors] in ``ops/device_checks.py``).

A device allocation that fails with an out-of-memory error evicts every unpinned block,
empties the allocator's cache and is tried once more.
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.errors import DeviceOutOfMemoryError
from ..core.tensor_ref import TensorRef, block_of, plain_values
from ..memory.manager import tensorsManager as mgr
from ..memory.room import is_out_of_memory
from .manage import adopt

#: creation functions whose result depends only on their (non-tensor) arguments
FACTORIES = frozenset({
    "rand", "randn", "randint", "randperm", "normal", "zeros", "ones", "empty", "empty_strided",
    "empty_permuted", "full", "arange", "range", "linspace", "logspace", "eye", "scalar_tensor",
    "tril_indices", "triu_indices", "bartlett_window", "blackman_window", "hamming_window",
    "hann_window", "kaiser_window",
})
#: factories whose numbers depend on the device that makes them, its generator's (random
#: ones) or its arithmetic's (windows, whose cosines CUDA computes to other last bits than the
#: CPU): made on the device, as ``torch.set_default_device`` makes them
ON_DEVICE = frozenset({"rand", "randn", "randint", "randperm", "bartlett_window", "blackman_window",
                       "hamming_window", "hann_window", "kaiser_window"})
#: factories no default device reaches (``torch.normal`` is not among the constructors a
#: ``torch.device`` context gives its device to): made without a device, they draw on the
#: host from the CPU's generator, as plain torch under ``set_default_device`` does
NO_DEFAULT_DEVICE = frozenset({"normal"})
#: creation functions that read their values from data, a nested list or tuple of which may
#: hold tensors: ``(name, the data's keyword)``
DATA_FUNCTIONS = {"tensor": "data", "as_tensor": "data", "asarray": "obj"}


def plain_data(name: str, args, kwargs):
    """``args`` and ``kwargs`` with the TensorRefs inside the data of ``torch.tensor([a, b])``
    (or ``as_tensor``, ``asarray``) given as plain host copies of their values
    (``core.tensor_ref.plain_values``)."""
    key = DATA_FUNCTIONS.get(name)
    if key is None:
        return args, kwargs
    if args:
        data = plain_values(args[0])
        if data is not args[0]:
            args = (data,) + tuple(args[1:])
    elif key in kwargs:
        data = plain_values(kwargs[key])
        if data is not kwargs[key]:
            kwargs = dict(kwargs, **{key: data})
    return args, kwargs


def create(fn, args, kwargs):
    """Call the creation function ``fn`` as torch would with the accelerator as default device."""
    device = kwargs.get("device")
    if device is None and getattr(fn, "__name__", "") not in NO_DEFAULT_DEVICE:
        default = _get_default_device()  # ``with torch.device("meta"):``, ``set_default_device``
        if default.type != "cpu":
            device = default
    if device is not None:
        device = torch.device(device)
    result = _create(fn, args, kwargs, device)
    if device is not None and result.__class__ is TensorRef and mgr.is_accelerator(device):
        # the accelerator named (a device context too): the program's own device tensor; made
        # without a device, a default-device tensor (Note [Default-device tensors])
        block_of(result).explicit = True
    return result


def _create(fn, args, kwargs, device):
    _adopt = adopt
    name = getattr(fn, "__name__", "")
    if device is not None:
        if mgr.backend.is_host(device):
            return _adopt(fn(*args, **kwargs), host_only=True)
        if device.type == "meta" or not mgr.is_accelerator(device):
            return _adopt(fn(*args, **kwargs))  # another device: left alone (see _adopt)
    if name == "load":
        args, kwargs = _load_on_host(mgr, args, kwargs)
        result = fn(*args, **kwargs)
        source = args[0] if args else kwargs.get("f")
        if kwargs.get("mmap") and isinstance(source, (str, os.PathLike)) and not mgr.backend.passthrough:
            from .checkpoint import tie_mmapped

            tied = tie_mmapped(result, source)  # the bytes stay in the file until used
            if tied is not None:
                return tied
        return _adopt(result)
    if mgr.backend.passthrough:
        return _adopt(fn(*args, **kwargs))
    if (name in FACTORIES and "out" not in kwargs and kwargs.get("layout") in (None, torch.strided)
            and not _tensor_arguments(args, kwargs) and (device is not None or name not in NO_DEFAULT_DEVICE)):
        generator = kwargs.get("generator")
        if generator is None or mgr.is_accelerator(generator.device):
            nbytes = _bytes_of(fn, args, kwargs)
            if ((name in ON_DEVICE or device is not None or mgr.strategy.new_tensors_on_device)
                    and (mgr.fits(mgr.block_bytes(nbytes)) or _fits_the_budget(mgr, nbytes))):
                return _on_device(mgr, fn, args, kwargs, nbytes, f"torch.{name}")
    if device is not None:
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}  # made on the host, fetched when used
    return _adopt(fn(*args, **kwargs))


def _fits_the_budget(mgr, nbytes: int) -> bool:
    """Whether a tensor of ``nbytes`` fits in the budget with everything else evicted: the
    budget also covers what the device holds outside the manager (workspaces, the program's
    own device tensors), read now, and the allocator's rounding (Note [Budget on CUDA])."""
    if mgr.limit is None:
        return True
    with mgr.lock:
        limit = mgr.limit
        return limit is None or mgr.block_bytes(nbytes) + mgr.read_outside() <= limit


def _get_default_device() -> torch.device:
    """The device creation functions use when none is named (``torch.get_default_device``
    without its probe tensor, which would come back here)."""
    device = device_context()
    return _CPU if device is None else device


def device_context():
    """The device of the innermost ``with torch.device(...)`` or ``torch.set_default_device``
    in force, or ``None``: torch gives it to creation functions that name none."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return torch.device(mode.device)
    return None


_CPU = torch.device("cpu")


def _tensor_arguments(args, kwargs) -> bool:
    return any(isinstance(a, torch.Tensor) for a in list(args) + list(kwargs.values()))


def _bytes_of(fn, args, kwargs) -> int:
    """Bytes the call will allocate, from the same call on ``meta`` (no data, no work),
    cached by its arguments (``torch.arange`` on meta runs a Python decomposition, dearer
    than the op, for calls a decode loop repeats with the same values)."""
    meta = {k: v for k, v in kwargs.items() if k not in ("generator", "pin_memory", "requires_grad")}
    try:
        key = (fn, args, tuple(meta.items()))
        nbytes = _bytes_cache.get(key)  # (hashing raises for unhashable arguments: a list)
    except TypeError:
        key = nbytes = None
    if nbytes is None:
        meta["device"] = "meta"
        nbytes = fn(*args, **meta).untyped_storage().nbytes()
        if key is not None:
            if len(_bytes_cache) >= _BYTES_CACHE_SIZE:
                _bytes_cache.clear()
            _bytes_cache[key] = nbytes
    return nbytes


_bytes_cache: dict = {}
_BYTES_CACHE_SIZE = 10_000


def _on_device(mgr, fn, args, kwargs, nbytes: int, what: str):
    _adopt = adopt
    kwargs = dict(kwargs)
    with mgr.lock:
        mgr.drain()
        # (torch_device resolves "cuda" first: the first tensor after ``device = "cuda"`` was
        # made on the CPU, from the CPU's generator)
        kwargs["device"] = mgr.torch_device
        with _disable_current_modes():  # (evicting copies bytes: a mode the program entered, FSDP2's
            # FakeTensorMode, must not see the manager's own copies)
            mgr.make_room(mgr.block_bytes(nbytes), (), what)  # (as the device's allocator counts it)
        for attempt in (0, 1):
            try:
                if not mgr.backend.simulated:
                    mgr.device_room.inject("create", nbytes)  # (on "sim" the device's empty kernel does)
                result = fn(*args, **kwargs)
                if isinstance(result, TensorRef):  # made by the sim device's empty kernel
                    mgr.strategy.on_adopt(block_of(result))
                else:  # a plain device tensor, as CUDA's factories make (a fake one stays plain)
                    result = _adopt(result)
                if isinstance(result, TensorRef):
                    # (both took it for a tensor the program put on the device; ``create``
                    # marks it so where the program named it: Note [Default-device tensors])
                    block_of(result).explicit = False
                return result
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                if attempt:
                    raise DeviceOutOfMemoryError(what, nbytes, mgr.device_room.free_estimate()) from e
                mgr.device_room.recover(())
    raise AssertionError("unreachable")


def _load_on_host(mgr, args, kwargs):
    """``torch.load``'s arguments with no ``map_location``, or the accelerator's, made the CPU."""
    if mgr.backend.passthrough:
        return args, kwargs
    positional = len(args) > 1
    location = args[1] if positional else kwargs.get("map_location")
    if location is None or isinstance(location, (str, torch.device)) and mgr.is_accelerator(torch.device(location)):
        if positional:
            args = (args[0], "cpu") + tuple(args[2:])
        else:
            kwargs = dict(kwargs)
            kwargs["map_location"] = "cpu"
    return args, kwargs
