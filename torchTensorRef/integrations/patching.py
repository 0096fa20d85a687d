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

import sys
import threading
from typing import Dict, Tuple

import torch
import wrapt
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..core import context, list_ops
from ..core.tensor_ref import TensorRef, saving, block_of, plain_values
from ..memory.manager import tensorsManager as _mgr
from ..ops import raw_kernels
from ..regions.mechanism import state as loops
from . import backward, checkpoint, compiler, creation, distributed, generation, optimizers, wrapped
from .manage import adopt
from .plain import disabled, probe_wrapper

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
#: torch functions wrapped for another reason than creation: saving writes TensorRefs as
#: plain tensors, compiling hides the manager's code from the compiler (Note [torch.compile])
SAVE_FUNCTIONS: Tuple[str, ...] = ("save",)
COMPILE_FUNCTIONS: Tuple[str, ...] = ("compile",)
#: creation functions whose result may share the memory of their input (a numpy array, a
#: buffer, a DLPack capsule): that memory stays writable from outside (Note [External bytes])
SHARING_FUNCTIONS = frozenset({"from_numpy", "frombuffer", "as_tensor", "asarray", "from_dlpack"})
#: functions that hand a tensor to a generator, which takes plain CPU byte tensors only: a
#: state restored from a checkpoint (``torch.load`` gives TensorRefs) is given as one
RNG_STATE_FUNCTIONS: Tuple[Tuple[str, str], ...] = (
    ("torch", "set_rng_state"), ("torch.random", "set_rng_state"),
    ("torch.cuda", "set_rng_state"), ("torch.cuda", "set_rng_state_all"),
    ("torch.cuda.random", "set_rng_state"), ("torch.cuda.random", "set_rng_state_all"),
)
#: where a CUDA graph capture begins and ends: ops on TensorRefs refuse to be captured, on
#: the fast path too (``"owner:Class"`` names a class of that module)
CAPTURE_METHODS: Tuple[Tuple[str, str], ...] = (
    ("torch.cuda.graphs:CUDAGraph", "capture_begin"), ("torch.cuda.graphs:CUDAGraph", "capture_end"),
)
#: ``Module._apply`` (``.to``, ``.cpu``, ``.cuda``, ``.half`` ...): parameters tied across
#: modules stay tied (``_apply_wrapper``)
MODULE_METHODS: Tuple[Tuple[str, str], ...] = (("torch.nn.modules.module:Module", "_apply"),)
#: functions that open checkpoints: whole tensors read through them stay on disk until used
#: (``checkpoint.py``); ``transformers.modeling_utils`` holds its own reference to it
LAZY_LOAD_FUNCTIONS: Tuple[Tuple[str, str], ...] = (
    ("safetensors", "safe_open"), ("transformers.modeling_utils", "safe_open"),
)
#: functions that only warm an allocator up, by allocating as much as the model at once:
#: pointless under the manager, which allocates within its budgets (and they would break them)
WARMUP_FUNCTIONS: Tuple[Tuple[str, str], ...] = (("transformers.modeling_utils", "caching_allocator_warmup"),)
#: where transformers' from_pretrained chooses a device map: the managed device's own, which
#: needs no accelerate (``checkpoint.device_map_wrapper``)
DEVICE_MAP_FUNCTIONS: Tuple[Tuple[str, str], ...] = (("transformers.modeling_utils", "check_and_set_device_map"),)
#: where a library probes for a ``torch.device`` context: ``disabled(device=...)`` is none
#: (Note [Probes for a device context] in ``plain.py``)
DEVICE_PROBE_FUNCTIONS: Tuple[Tuple[str, str], ...] = (
    ("transformers.modeling_utils", "get_torch_context_manager_or_global_device"),)
#: transformers' decoding loop: one region of its model where nothing is paged (Note
#: [Generation as one region] in ``generation.py``)
GENERATION_METHODS: Tuple[Tuple[str, str], ...] = (("transformers.generation.utils:GenerationMixin", "generate"),)
#: raw entry points that launch kernels outside the dispatcher (CUDA's jiterator), which would
#: read a TensorRef's empty wrapper: a launch on TensorRefs runs as a managed op on their
#: device copies (Note [Raw kernels] in ``raw_kernels.py``; absent from CPU builds of torch)
RAW_KERNEL_FUNCTIONS: Tuple[Tuple[str, str], ...] = raw_kernels.JITERATOR_FUNCTIONS
#: inputs those functions copy or return as they are (tensors are managed on their own)
_NOT_SHARED = (torch.Tensor, list, tuple, int, float, bool, complex)

_local = threading.local()
_patched = wrapped.PATCHED  # (module, name) -> (original, our wrapper)
_lock = threading.Lock()
_late_hooks: set = set()  # modules whose import runs ``_wrap_late`` (a hook cannot be removed)


#: torch's own modules that build tensors piecewise (``torch.empty(0).set_(storage)`` while
#: unpickling, for instance): their tensors stay plain, and ``torch.load`` adopts the result.
_PLAIN_CALLERS = frozenset({
    "torch._utils", "torch.serialization", "torch.storage", "torch._tensor",
    "torch._tensor_str", "torch.multiprocessing.reductions", "torch._weights_only_unpickler",
})
#: module prefixes of such callers: the above; torch's Python implementations of ops (meta
#: kernels, decompositions), whose tensors the dispatcher handles; and torch.utils.data,
#: whose samplers and seeds are CPU tensors drawn from CPU generators (``DataLoader(generator=...)``)
_PLAIN_PREFIXES = tuple(sorted(_PLAIN_CALLERS)) + (
    "torch._refs", "torch._prims", "torch._decomp", "torch._meta_registrations", "torch._subclasses",
    "torch.utils.data",
)


def _plain_call() -> bool:
    """Whether this creation must stay plain torch: disabled, torch building its own tensors,
    or a kernel written in Python (a custom op, a decomposition) computing inside a managed
    op, which holds the manager's lock: its tensors are the op's internals, on plain views."""
    return (context.is_disabled() or _mgr.lock._is_owned()
            or sys._getframe(2).f_globals.get("__name__", "").startswith(_PLAIN_PREFIXES))


#: callers whose tensors made without a device are CPU tensors, as in plain torch: PyTorch's
#: optimizers keep their step counters on the host on purpose (a kernel launch and a host
#: read per parameter and step cost more than the host's arithmetic), which torch >= 2.13
#: says with ``device="cpu"`` and earlier versions by naming no device (Note
#: [Default-device tensors] in ``ops/device_checks.py``)
_HOST_CALLERS = ("torch.optim",)


def _creation_wrapper(wrapped, instance, args, kwargs):
    args, kwargs = creation.plain_data(wrapped.__name__, args, kwargs)
    if kwargs.get("device") is None and sys._getframe(1).f_globals.get("__name__", "").startswith(_HOST_CALLERS):
        kwargs = dict(kwargs, device="cpu")
    if _plain_call():
        device = context.plain_device()
        # disabled(device=...), where torch would give no device of its own: a ``torch.device``
        # context inside it (transformers builds a model on "meta" before loading it) wins, and
        # a generator draws on its own device, as a managed factory given one does (``create``)
        generator = kwargs.get("generator")
        if (device is not None and kwargs.get("device") is None and wrapped in _takes_device()
                and creation.device_context() is None
                and (generator is None or generator.device.type == device.type)):
            kwargs = dict(kwargs, device=device)
        return wrapped(*args, **kwargs)
    out = creation.create(wrapped, args, kwargs)
    if loops.glue is not None and not loops.depth:
        loops.glue.track(out)  # (made under the manager's lock: Note [Loops on plain tensors])
    return out


def _sharing_wrapper(wrapped, instance, args, kwargs):
    args, kwargs = creation.plain_data(wrapped.__name__, args, kwargs)
    if _plain_call():
        return wrapped(*args, **kwargs)
    result = wrapped(*args, **kwargs)
    ref = adopt(result, host_only=_asks_cpu(kwargs))
    source = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(ref, TensorRef) and not isinstance(source, _NOT_SHARED):
        from ..memory.manager import tensorsManager

        tensorsManager.mark_external(block_of(ref))
    return ref


def _legacy_new(*args, **kwargs):
    """``torch.Tensor(data)``, the legacy constructor, with the TensorRefs inside a list of
    values given as their values (``plain_values``); its result stays a plain CPU tensor, as
    plain torch makes it. (``args[0]`` is the class; a signature of ``*args`` only is one the
    compiler's stand-in for ``torch.Tensor.__new__`` accepts.)"""
    if len(args) > 1:
        args = (args[0], plain_values(args[1])) + args[2:]
    return _BASE_NEW(*args, **kwargs)


_BASE_NEW = torch._C.TensorBase.__new__
#: ``torch.Tensor`` inherits ``__new__`` from its C base, whose attributes cannot be set:
#: ``patch()`` gives the class one of its own, which ``unpatch()`` deletes
_LEGACY_NEW = staticmethod(_legacy_new)


def _takes_device():
    """The creation functions ``torch.device(...)`` as a context manager would give a device."""
    from torch.utils._device import _device_constructors

    return _device_constructors()


def _asks_cpu(kwargs) -> bool:
    """Whether the call asks for the host, not the manager's device."""
    device = kwargs.get("device")
    return device is not None and _mgr.backend.is_host(torch.device(device))


def _save_wrapper(wrapped, instance, args, kwargs):
    with saving():
        return wrapped(*args, **kwargs)


def _rng_state_wrapper(wrapped, instance, args, kwargs):
    from ..core.tensor_ref import host_copy

    def plain(value):
        if isinstance(value, TensorRef):
            return host_copy(value)
        if isinstance(value, (list, tuple)):  # set_rng_state_all
            return type(value)(plain(v) for v in value)
        return value

    return wrapped(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})


def _capture_wrapper(wrapped, instance, args, kwargs):
    from ..memory.manager import tensorsManager

    if wrapped.__name__ == "capture_begin":
        result = wrapped(*args, **kwargs)
        tensorsManager.set_capturing(True)  # (once the capture really began)
        return result
    try:
        return wrapped(*args, **kwargs)
    finally:
        tensorsManager.set_capturing(False)


def _warmup_wrapper(wrapped, instance, args, kwargs):
    """Skipped under an accelerator manager (``WARMUP_FUNCTIONS``)."""
    from ..memory.manager import tensorsManager

    if context.is_disabled() or tensorsManager.backend.passthrough:
        return wrapped(*args, **kwargs)
    return None


def _apply_wrapper(wrapped, instance, args, kwargs):
    """``Module._apply`` keeping a parameter that several modules share one Parameter, and
    the gradient hooks of a parameter it swaps.

    Plain torch converts a parameter in place (``param.data = new``) where the new tensor's
    type allows it, so a tied parameter stays one. A conversion between a TensorRef and
    another device (``model.cpu()``, a plain model's ``.to("sim")``) is not in place: each
    module holding the parameter would get a Parameter of its own, and training would
    update the copies apart. Every slot that held one parameter gets the first slot's
    conversion. (Buffers are left as plain torch leaves them.)

    A parameter that becomes a wrapper subclass (a plain model's ``.to("sim")``, and any
    ``.to`` of one already there) is converted by ``torch.utils.swap_tensors``, which keeps
    its hook dicts and leaves the hooks autograd runs with the tensor swapped out: its
    gradient hooks never ran again (peft's OSF projects its gradients by them), where
    ``.data =`` keeps them on CUDA. They are registered again.
    """
    if getattr(_local, "applying", False):
        return wrapped(*args, **kwargs)  # (a submodule's, inside the outermost call)
    holders: Dict[int, list] = {}
    for module in instance.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module._parameters, name))
    _local.applying = True
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _local.applying = False
    for slots in holders.values():
        (first_table, first_name), rest = slots[0], slots[1:]
        for table, name in rest:
            table[name] = first_table[first_name]
        param = first_table[first_name]
        if param is not None and is_traceable_wrapper_subclass(param):
            _register_hooks_again(param)
    return result


def _register_hooks_again(t: torch.Tensor) -> None:
    """Register with autograd again the gradient hooks whose dicts ``t`` holds (setting a dict
    replaces what autograd runs with it)."""
    if t._backward_hooks:
        t._backward_hooks = t._backward_hooks
    hooks = getattr(t, "_post_accumulate_grad_hooks", None)
    if hooks:
        t._post_accumulate_grad_hooks = hooks


def _owner(name: str):
    """The module ``name``, or the class ``"module:Class"``; ``None`` if not loaded."""
    module_name, _, cls = name.partition(":")
    module = sys.modules.get(module_name)
    return getattr(module, cls, None) if cls and module is not None else module


def _attribute(owner, name: str):
    """``owner.name`` as stored: a class gives the function itself, not a bound wrapper."""
    return vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)


def _wrapper_for(name: str):
    if name in SAVE_FUNCTIONS:
        return _save_wrapper
    if name in COMPILE_FUNCTIONS:
        return compiler.compile_wrapper
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


def _wrap(targets) -> None:
    for module_name, name, how in targets:
        module = _owner(module_name)
        if (module_name, name) in _patched or not hasattr(module, name):
            continue
        original = _attribute(module, name)
        if original is None:
            continue  # (a class that inherits it: its base's is wrapped)
        wrapper = _FunctionWrapper(original, how)
        setattr(module, name, wrapper)
        _patched[module_name, name] = (original, wrapper)


def _targets():
    """(owner, name, wrapper function) of everything ``patch()`` wraps."""
    names = CREATION_FUNCTIONS + SAVE_FUNCTIONS + COMPILE_FUNCTIONS
    targets = [("torch", name, _wrapper_for(name)) for name in names]
    targets += [(module, name, _rng_state_wrapper) for module, name in RNG_STATE_FUNCTIONS]
    targets += [(owner, name, _capture_wrapper) for owner, name in CAPTURE_METHODS]
    targets += [(owner, name, distributed.wrapper_for(owner, name)) for owner, name in distributed.FUNCTIONS]
    targets += [(owner, name, checkpoint.safe_open_wrapper) for owner, name in LAZY_LOAD_FUNCTIONS]
    targets += [(owner, name, checkpoint.device_map_wrapper) for owner, name in DEVICE_MAP_FUNCTIONS]
    targets += [(owner, name, probe_wrapper) for owner, name in DEVICE_PROBE_FUNCTIONS]
    targets += [(owner, name, _warmup_wrapper) for owner, name in WARMUP_FUNCTIONS]
    targets += [(owner, name, _apply_wrapper) for owner, name in MODULE_METHODS]
    targets += [(owner, name, raw_kernels.jiterator_wrapper) for owner, name in RAW_KERNEL_FUNCTIONS]
    targets += [(owner, name, generation.generate_wrapper) for owner, name in GENERATION_METHODS]
    targets += [(owner, name, optimizers.step_wrapper) for owner, name in optimizers.STEP_METHODS]
    targets += [(owner, name, backward.guard_wrapper) for owner, name in backward.FUNCTIONS]
    return targets


#: modules imported on demand, after torch, whose functions are wrapped when they are imported
LATE_MODULES = distributed.LATE_MODULES + ("safetensors", "transformers.modeling_utils",
                                           "transformers.generation.utils")


def _wrap_late(module) -> None:
    """After ``import torch.distributed.fsdp`` (say): wrap its functions if torch is patched."""
    with _lock:
        if _patched:
            _wrap(_targets())


def patch() -> None:
    """Wrap torch's creation functions so they return TensorRefs (idempotent)."""
    with _lock:
        _wrap(_targets())
        # TensorRefs get the list implementations plain torch picks on their device (list
        # ops larger than the budget run in slices that fit): ``core/list_ops.py``.
        list_ops.admit(TensorRef)
        if "__new__" not in vars(torch.Tensor):
            torch.Tensor.__new__ = _LEGACY_NEW  # type: ignore[assignment]
            _patched["torch:Tensor", "__new__"] = (None, _LEGACY_NEW)
        compiler.hide_if_loaded()
    # Functions of modules torch imports only on demand are wrapped when they are imported
    # (outside the lock: for a module already imported the hook runs at once).
    for module_name in LATE_MODULES:
        if module_name not in _late_hooks:
            _late_hooks.add(module_name)
            wrapt.register_post_import_hook(_wrap_late, module_name)


def unpatch() -> None:
    """Restore torch's functions (idempotent); leaves alone any that others re-patched since."""
    with _lock:
        for (module_name, name), (original, wrapper) in list(_patched.items()):
            module = _owner(module_name)
            if _attribute(module, name) is wrapper:
                if original is None:
                    delattr(module, name)  # (inherited before: ``_LEGACY_NEW``)
                else:
                    setattr(module, name, original)
            del _patched[module_name, name]
        list_ops.withdraw(TensorRef)


def is_patched() -> bool:
    """Whether torch's creation functions currently return TensorRefs."""
    return bool(_patched)


__all__ = ["patch", "unpatch", "is_patched", "disabled", "CREATION_FUNCTIONS", "TensorRef"]
