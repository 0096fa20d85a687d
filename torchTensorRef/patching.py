"""Making torch's tensor-creating functions return TensorRefs, reversibly.

Dispatch sees every op that has a TensorRef argument, but not the creation of a tensor
from nothing (``torch.rand``, ``torch.zeros``, ``torch.load`` ...). Those functions are
wrapped with ``wrapt`` from the one table below. ``patch()`` remembers what it replaced
and does nothing the second time; ``unpatch()`` restores only what is still our wrapper.

Left alone, always: tensors on ``meta`` (``from_pretrained`` builds there first) and other
subclasses (fake tensors), non-strided layouts, tensors explicitly created on another
accelerator than the manager's, and everything in DataLoader worker processes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Dict, Tuple

import torch
import wrapt

from .tensor_ref import TensorRef, saving

#: torch functions that create tensors without a tensor input
CREATION_FUNCTIONS: Tuple[str, ...] = (
    "rand", "randn", "randint", "randperm", "normal", "poisson",
    "zeros", "ones", "empty", "empty_strided", "empty_permuted", "full",
    "arange", "range", "linspace", "logspace", "eye",
    "tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "from_file", "from_dlpack",
    "scalar_tensor", "tril_indices", "triu_indices",
    "bartlett_window", "blackman_window", "hamming_window", "hann_window", "kaiser_window",
    "load",
)
#: torch functions wrapped for another reason than creation
SAVE_FUNCTIONS: Tuple[str, ...] = ("save",)
#: creation functions whose result may share the memory of their input (a numpy array, a
#: buffer, a DLPack capsule): that memory stays writable from outside (Note [External bytes])
SHARING_FUNCTIONS = frozenset({"from_numpy", "frombuffer", "as_tensor", "asarray", "from_dlpack"})
#: inputs those functions copy or return as they are (tensors are managed on their own)
_NOT_SHARED = (torch.Tensor, list, tuple, int, float, bool, complex)

_local = threading.local()
_patched: Dict[str, Tuple[object, object]] = {}  # name -> (original, our wrapper)
_lock = threading.Lock()


def _is_disabled() -> bool:
    return getattr(_local, "depth", 0) > 0 or torch.utils.data.get_worker_info() is not None


def _adopt(obj, memo=None):
    """``obj`` with its plain tensors (also inside lists, tuples and dicts) made TensorRefs.

    A tensor found twice gives one TensorRef, twice (``memo``: id -> TensorRef).
    """
    if memo is None:
        memo = {}
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
            return obj  # a TensorRef already, or another subclass (fake tensors)
        if obj.layout is not torch.strided or obj.device.type == "meta":
            return obj
        from .manager import tensorsManager as mgr

        if obj.device.type != "cpu" and obj.device != mgr._backend.compute:
            return obj  # explicitly asked for another device than the managed one
        memo[id(obj)] = ref = mgr.manage_tensor(obj)
        return ref
    if isinstance(obj, dict):
        items = [(k, _adopt(v, memo)) for k, v in obj.items()]
        try:
            new = type(obj)()
        except TypeError:
            return obj
        new.update(items)
        if hasattr(obj, "_metadata"):
            new._metadata = obj._metadata  # state dicts carry version metadata
        return new
    if isinstance(obj, list) and type(obj) is list:
        return [_adopt(v, memo) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_adopt(v, memo) for v in obj)
    if isinstance(obj, torch.nn.Module):
        from .manage import manage

        return manage(obj)  # ``torch.load`` of a pickled module: its parameters and buffers
    return obj


#: torch's own modules that build tensors piecewise (``torch.empty(0).set_(storage)`` while
#: unpickling, for instance): their tensors stay plain, and ``torch.load`` adopts the result.
_PLAIN_CALLERS = frozenset({
    "torch._utils", "torch.serialization", "torch.storage", "torch._tensor",
    "torch._tensor_str", "torch.multiprocessing.reductions", "torch._weights_only_unpickler",
})


def _creation_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _is_disabled() or sys._getframe(1).f_globals.get("__name__") in _PLAIN_CALLERS:
        return result
    return _adopt(result)


def _sharing_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _is_disabled() or sys._getframe(1).f_globals.get("__name__") in _PLAIN_CALLERS:
        return result
    ref = _adopt(result)
    source = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(ref, TensorRef) and not isinstance(source, _NOT_SHARED):
        from .manager import tensorsManager

        tensorsManager.mark_external(ref._tr_block)
    return ref


def _save_wrapper(wrapped, instance, args, kwargs):
    with saving():
        return wrapped(*args, **kwargs)


def _wrapper_for(name: str):
    if name in SAVE_FUNCTIONS:
        return _save_wrapper
    return _sharing_wrapper if name in SHARING_FUNCTIONS else _creation_wrapper


class _FunctionWrapper(wrapt.FunctionWrapper):
    """A wrapt wrapper that ``copy`` treats as an atom, like the function it wraps.

    A bare wrapt proxy refuses ``copy.deepcopy``, which broke code that deep-copies tables
    holding ``torch.zeros`` (PyTorch's own OpInfo database does).
    """

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def patch() -> None:
    """Wrap torch's creation functions so they return TensorRefs (idempotent)."""
    with _lock:
        for name in CREATION_FUNCTIONS + SAVE_FUNCTIONS:
            if name in _patched or not hasattr(torch, name):
                continue
            original = getattr(torch, name)
            wrapper = _FunctionWrapper(original, _wrapper_for(name))
            setattr(torch, name, wrapper)
            _patched[name] = (original, wrapper)


def unpatch() -> None:
    """Restore torch's functions (idempotent); leaves alone any that others re-patched since."""
    with _lock:
        for name, (original, wrapper) in list(_patched.items()):
            if getattr(torch, name, None) is wrapper:
                setattr(torch, name, original)
            del _patched[name]


def is_patched() -> bool:
    """Whether torch's creation functions currently return TensorRefs."""
    return bool(_patched)


@contextlib.contextmanager
def disabled():
    """Plain torch inside: creation functions return plain tensors (this thread only).

    Ops on existing TensorRefs are still managed, and their results are TensorRefs.
    """
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


__all__ = ["patch", "unpatch", "is_patched", "disabled", "CREATION_FUNCTIONS", "TensorRef"]
