"""Devices of an op's arguments, checked as the accelerator's kernels would.

On ``"sim"`` (strict) and on CUDA, an op whose tensors are on the accelerator and on the
host fails in plain torch; the manager, which moves blocks itself, must not hide that
from the user's code, nor refuse what the accelerator's kernels accept (CPU scalars,
indices of some ops). Tensors the program made without a device are the exception: mixed
with CPU tensors, their ops run on the host, as in plain torch (Note [Default-device tensors]).

Note [Default-device tensors]: under an accelerator manager a tensor made without a device
(``torch.randn(3)``, ``torch.tensor([...])``, a module's parameters) is the program's
*default-device* tensor: the manager places it on the accelerator and it reports the
accelerator, as under ``torch.set_default_device`` (PyTorch chooses kernels, autocast and
optimizer implementations by the device a tensor reports, and model code makes new tensors
on ``x.device``). In plain torch those tensors are CPU tensors, and code that mixes them with
CPU tensors runs (``torch.allclose(out.cpu(), expected)`` with ``expected`` made without a
device); under the manager it failed with CUDA's device error. So an op that mixes
default-device tensors with CPU tensors runs on the host, as plain torch runs it with
everything on the CPU, and its results are CPU tensors. Tensors the program put on the
accelerator itself are *explicit* (``Block.explicit``): made with a device named
(``device=x.device`` too), in a ``torch.device`` context or under ``set_default_device``,
moved with ``.to(device)`` / ``.cuda()`` (``TensorRef.to``, bound here: such a call on a
tensor already there returns it without an op), a plain accelerator tensor given to an op,
and whatever an op computes from one of these. Mixed with CPU tensors they fail as on CUDA.
"CPU tensors" are the manager's host-only ones (``device="cpu"``, ``.cpu()``, results on the
host) of at least one dimension: a 0-dim one is a scalar, which accelerator kernels take.
Plain CPU tensors the manager does not hold are brought to the accelerator (Note [Plain CPU
tensors]), and the ops whose accelerator kernels take CPU tensors (``TAKES_CPU_TENSORS``:
copies, indexing) run there.

Note [Plain device tensors are outside bytes]: a plain accelerator tensor given to an op is
the program's, outside the manager, and the manager reads what the device holds outside it
only now and then (a reading costs more than an op): one made since the last reading, such as
the index tensor torch's indexing makes on the indexed tensor's device for ``x[[0, 1]]`` (on
CUDA a plain tensor; on "sim" its empty kernel makes a TensorRef), would be missed, and room
made for the op's results without it, so that the device held more than the budget once they
were made. An op with such an argument reads the device before room is made for it.

Note [Plain CPU tensors]: a plain CPU tensor the manager does not hold (a batch from a
DataLoader's worker process, a tensor made under ``disabled()``) beside default-device
TensorRefs is managed for the op (``bring_plain_tensors``): the op runs on the accelerator, as
it does on the batches a DataLoader collates in the program's own process, which are
default-device TensorRefs. Beside the program's own device tensors it is CUDA's error, on
"sim" as on CUDA; so it is where the op writes it, where it requires grad (its gradient
would go to the TensorRef made for it, not to it), and for a plain view of a block's host copy
(``.target`` of a tensor on the host). One exception on "sim": a nested tensor of the device
is a plain CPU tensor there (no wrapper can hold one), and so is what is computed from it
(``TransformerEncoder``'s eval fast path), which is the device's on a GPU; once the manager has
handed out a nested tensor (``Backend.nested_results``), plain CPU tensors are let through as
the device's. In sim's timing form (``sim_strict = False``) the device's copies are plain CPU
tensors, and so are plain ops' results on them (``generate()``'s own loop under a budget
that pages): there a plain CPU tensor is taken for the device's, by ops and by regions
alike, as CUDA uses its plain device tensors as they are, where each was adopted and copied
in anew (or the loop's layers ran op by op). ``Backend.plain_cpu_is_device`` says when.
"""

from __future__ import annotations

import sys
import warnings

import torch

from ..core.op_specs import TAKES_CPU_TENSORS
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.tensor import SimTensor

_Tensor = torch.Tensor
_strided = torch.strided


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


def check_devices(spec, args, kwargs, declared, blocks) -> None:
    """On the strict ``"sim"``: refuse CPU tensors beside accelerator TensorRefs where CUDA kernels do.

    Refused: a CPU TensorRef, and a plain CPU tensor (those that ``bring_plain_tensors`` did
    not bring): on CUDA both are CPU tensors, and ``cuda_t + cpu_t`` raises. A 0-dim CPU
    tensor is a scalar, which accelerator kernels accept (Note [Strict sim] in
    ``memory/sim/device.py``); so do the copies and indexing ops of ``TAKES_CPU_TENSORS``.
    Once the device has nested results, plain CPU tensors other than views of host copies
    are let through (Note [Plain CPU tensors]).
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
            if not block_of(a).host_only:
                continue
        elif (cls is SimTensor or isinstance(a, (TensorRef, SimTensor)) or a.layout is not _strided
              or a.is_nested or a.device.type != "cpu"):
            continue  # (a managed Parameter, a sim Parameter: the device's; sparse: no host copy's view)
        elif _mgr.backend.nested_results:  # (it may be the device's: Note [Plain CPU tensors])
            if hosted is None:  # (only for a plain CPU argument: rare, and the blocks are many)
                hosted = _mgr.host_storages()
            if a.untyped_storage()._cdata not in hosted:
                continue
        if spec.func.overloadpacket.__name__ in TAKES_CPU_TENSORS:
            return
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{declared} and cpu! (when checking the arguments of {spec.name})")


def plain_tensor_among(args, kwargs) -> bool:
    """Whether an op's arguments (one level of lists) hold a tensor that is not a TensorRef."""
    return _plain_tensor_in(args) or bool(kwargs and _plain_tensor_in(kwargs.values()))


def bring_plain_tensors(spec, args, kwargs, blocks):
    """Plain CPU tensors beside default-device TensorRefs, as TensorRefs the op brings to the
    accelerator (Note [Plain CPU tensors]); ``blocks``: those of the TensorRef arguments.

    Returns ``(args, kwargs, refs)`` with them replaced and the new TensorRefs, or ``None``
    where there is none to bring.
    """
    backend = _mgr.backend
    if backend.plain_cpu_is_device or spec.func.overloadpacket.__name__ in TAKES_CPU_TENSORS:
        return None
    for b in blocks:
        if b.explicit:
            return None  # the program's device tensor beside a CPU one: CUDA's error
    if plain_device_tensor_among(args, kwargs):
        return None  # (a plain accelerator tensor: as above)
    kept = {id(args[i] if i < len(args) else kwargs.get(name)) for i, name in (*spec.write_args, *spec.host_args)}
    brought: list = []
    hosted = None  # (the host copies' keys, looked up once, for the first plain tensor)

    def bring(a):
        nonlocal hosted
        if (a.__class__ is not _Tensor or a.dim() == 0 or a.requires_grad or a.layout is not _strided
                or a.is_nested or a.device.type != "cpu" or id(a) in kept):
            return a
        if hosted is None:
            hosted = _mgr.host_storages()
        if a.untyped_storage()._cdata in hosted:
            return a  # ``.target`` of a tensor on the host: a CPU tensor on CUDA too
        ref = _mgr.manage_tensor(a)
        brought.append(ref)
        return ref

    def each(a):
        if id(a) in kept:
            return a  # (written, or read in host memory: a list's elements too)
        if a.__class__ is list or a.__class__ is tuple:
            return a.__class__(bring(e) if isinstance(e, _Tensor) else e for e in a)
        return bring(a) if isinstance(a, _Tensor) else a

    args = tuple(each(a) for a in args)
    if kwargs:
        kwargs = {k: each(v) for k, v in kwargs.items()}
    return (args, kwargs, brought) if brought else None


def _check_host_args(spec, args, kwargs, declared) -> tuple:
    """Refuse a device tensor where the accelerator's kernel reads the argument in host
    memory (``OpSpec.host_args``), as CUDA's kernels do; the manager gives them host copies
    of TensorRefs first (``host_arguments.to_host``). Returns those arguments."""
    found = []
    for index, name in spec.host_args:
        a = args[index] if index < len(args) else kwargs.get(name)
        on_device = (not block_of(a).host_only) if isinstance(a, TensorRef) else isinstance(a, SimTensor)
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


# -- default-device tensors (Note [Default-device tensors]) ----------------------------------
def runs_on_host(spec, refs, args, kwargs) -> bool:
    """Whether an op that mixes default-device TensorRefs with CPU TensorRefs runs on the host.

    Asked on the generic path, where the manager holds CPU TensorRefs and the op was not
    placed on the host already; ``refs``: the op's TensorRef arguments.
    """
    if kwargs and kwargs.get("device") is not None:
        return False  # (the device asked for places the op)
    host = default = None
    for r in refs:
        b = block_of(r)
        if b.host_only:
            if host is None and r.dim():  # (0-dim: a scalar, which accelerator kernels take)
                host = r
        elif b.explicit:
            return False  # the program's own device tensor beside a CPU one: CUDA's error
        elif default is None:
            default = r
    if host is None or default is None or spec.func.overloadpacket.__name__ in TAKES_CPU_TENSORS:
        return False
    if plain_device_tensor_among(args, kwargs):
        return False  # (a plain accelerator tensor: the program's choice of device)
    if any(r.requires_grad and not block_of(r).host_only for r in refs):
        warnings.warn(
            f"{spec.name} mixes accelerator tensors made without a device with a CPU tensor: it runs on "
            f"the host, as plain torch on the CPU would, and so do the ops on its results and their "
            f"gradients; move the CPU tensor with .to(device) to keep the work on the accelerator",
            stacklevel=_caller_level())
    return True


def _caller_level() -> int:
    """The ``stacklevel`` of the program's frame that ran the op: the first outside torch and
    this package, for a warning issued where ``_caller_level`` is called."""
    frame, level = sys._getframe(2), 2
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _INTERNAL:
        frame, level = frame.f_back, level + 1
    return level


_INTERNAL = ("torch", "torchTensorRef")


def explicit_results(ctx, args, kwargs) -> None:
    """Mark the new results of an op on the device explicit where the program chose the device:
    an explicit argument, a device named, or a plain accelerator tensor among its arguments."""
    if not (ctx.explicit() or _names_the_device(kwargs) or plain_device_tensor_among(args, kwargs)):
        return
    for b in ctx.outputs:
        b.explicit = True


def _names_the_device(kwargs) -> bool:
    target = kwargs.get("device") if kwargs else None
    return target is not None and _mgr.is_accelerator(torch.device(target))


def plain_device_tensor_among(args, kwargs) -> bool:
    """Whether a plain accelerator tensor (a ``SimTensor``, a plain CUDA tensor) is an
    argument (one level of lists)."""
    if not _plain_tensor_in(args) and not (kwargs and _plain_tensor_in(kwargs.values())):
        return False
    for a in _tensor_args(args, kwargs):
        if not isinstance(a, TensorRef) and (isinstance(a, SimTensor) or a.device.type not in ("cpu", "meta")):
            return True
    return False


_tensor_to = torch.Tensor.to
_tensor_cuda = torch.Tensor.cuda


def _to(self, *args, **kwargs):
    """``Tensor.to`` of a TensorRef: ``.to(device)`` of a default-device tensor, which returns it
    as it is, makes it the program's choice of device (explicit)."""
    out = _tensor_to(self, *args, **kwargs)
    if out is self:
        block = block_of(self)
        if not (block.explicit or block.host_only) and _names_a_device(args, kwargs):
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is not None and _mgr.is_accelerator(device):
                block.explicit = True
    return out


def _cuda(self, *args, **kwargs):
    """``Tensor.cuda`` of a TensorRef: as ``_to``, for a tensor already on the GPU."""
    out = _tensor_cuda(self, *args, **kwargs)
    if out is self and not block_of(self).host_only:
        block_of(self).explicit = True
    return out


def _names_a_device(args, kwargs) -> bool:
    """Whether ``.to(*args, **kwargs)`` may name a device (``.to(dtype)`` names none)."""
    if kwargs.get("device") is not None:
        return True
    for a in args:
        if a.__class__ is not torch.dtype and a.__class__ is not bool:
            return True
    return False


TensorRef.to = _to
TensorRef.cuda = _cuda
