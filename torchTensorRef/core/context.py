"""The one seam between the core and the layers above it.

The core (``TensorRef``, ``proxyInfo``) and the simulated device need two things they must
not import: the global manager that owns every block, and whether this thread is inside
``disabled()``. The layers that own them set them here: ``memory.manager`` installs the
manager when it is made, and ``integrations.plain.disabled`` enters and leaves the
plain-torch state through :func:`enter_plain` / :func:`exit_plain`. (The third thing, the
function that runs an op, ``ops.dispatch`` binds as ``TensorRef.__torch_dispatch__`` itself.)
Nothing else is registered here.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_manager = None


def install_manager(manager) -> None:
    """Make ``manager`` the one TensorRefs report to (``memory.manager`` does, at import)."""
    global _manager
    _manager = manager


def manager():
    """The global manager (``torchTensorRef.tensorsManager``)."""
    if _manager is None:
        raise RuntimeError("no tensorsManager installed: import torchTensorRef, not one of its modules alone")
    return _manager


# -- disabled(): plain torch in this thread -------------------------------------------------
# Note [Plain torch on autograd's threads]: the backward of device tensors runs on an autograd
# thread of that device (of CUDA's, of "sim"'s), not on the thread that called it, so a flag
# of the calling thread's did not reach a custom function's backward, a hook or a checkpoint's
# recomputation run there: inside ``disabled()`` they made managed TensorRefs, and a plain
# model's gradients became TensorRefs. ``disabled()``'s state is kept among PyTorch's
# thread-local Python objects, which its autograd engine gives the threads that run a
# backward for as long as they run it: there, as in the calling thread, a backward called
# inside ``disabled()`` is plain torch. It is erased, not set to ``None``, when the outermost
# scope ends: a thread must not end holding one, whose release then needs the interpreter's
# lock and can deadlock. A torch that cannot erase them (2.11) keeps the state in a plain
# thread-local, which autograd's threads do not see (``CARRIED`` is false there).

#: ``disabled()``'s state, ``(device,)`` (the innermost scope's), under this key
_KEY = "torchTensorRef.disabled"
_erase = getattr(torch._C, "_remove_obj_from_tls", None)
#: whether ``disabled()`` reaches the autograd threads running a backward called inside it
CARRIED = _erase is not None
#: whether a scope is open here (``is_disabled`` runs at every creation and module call:
#: where carried, one C call)
_open: Callable[[], bool]

if _erase is not None:
    _carried, _state_of, _keep, _remove = (torch._C._is_key_in_tls, torch._C._get_obj_in_tls,
                                           torch._C._stash_obj_in_tls, _erase)

    _open = functools.partial(_carried, _KEY)

    def _state() -> Optional[tuple]:
        return _state_of(_KEY) if _carried(_KEY) else None

    def _set(state: Optional[tuple]) -> None:
        if state is None:
            _remove(_KEY)
        else:
            _keep(_KEY, state)
else:
    _local = threading.local()

    def _state() -> Optional[tuple]:
        return getattr(_local, "state", None)

    def _open() -> bool:
        return getattr(_local, "state", None) is not None

    def _set(state: Optional[tuple]) -> None:
        _local.state = state


def is_disabled() -> bool:
    """Whether creation functions make plain tensors here: inside ``disabled()``, on an
    autograd thread running a backward called inside it (Note [Plain torch on autograd's
    threads]) or of plain tensors made under a mode marking plain torch, or in a DataLoader
    worker (its tensors cross a process boundary, as plain tensors)."""
    return _open() or torch.utils.data.get_worker_info() is not None or _plain_mode_carried()


def _plain_mode_carried() -> bool:
    """Whether a dispatch mode marking plain torch is active in this thread (a region's
    backward run op by op on "sim", ``memory.sim.allocation.PlainMode``, ``marks_plain``):
    PyTorch carries dispatch modes to autograd's threads too."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    return any(getattr(mode, "marks_plain", False) for mode in _get_current_dispatch_mode_stack())


def plain_device() -> Optional[torch.device]:
    """The device the innermost ``disabled(device)`` asked creation functions to default to."""
    state = _state()
    return state[0] if state is not None else None


def enter_plain(device: Optional[torch.device]) -> Optional[tuple]:
    """Start a ``disabled()`` scope; returns what :func:`exit_plain` restores."""
    previous = _state()
    _set((device,))
    return previous


def exit_plain(previous: Optional[tuple]) -> None:
    _set(previous)


def suspend_plain() -> Optional[tuple]:
    """Leave this thread's ``disabled()`` scopes for a while; returns what
    :func:`resume_plain` restores."""
    saved = _state()
    if saved is not None:
        _set(None)
    return saved


def resume_plain(saved: Optional[tuple]) -> None:
    _set(saved)
