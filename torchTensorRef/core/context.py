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

import threading
from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_manager = None
_local = threading.local()


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
def is_disabled() -> bool:
    """Whether creation functions make plain tensors here: inside ``disabled()``, on an
    autograd thread running the backward of plain tensors made there, or in a DataLoader
    worker (its tensors cross a process boundary, as plain tensors)."""
    return (getattr(_local, "depth", 0) > 0 or torch.utils.data.get_worker_info() is not None
            or _plain_mode_carried())


def _plain_mode_carried() -> bool:
    """Whether a dispatch mode marking plain torch is active in this thread.

    ``disabled()``'s flag is thread-local, and backward runs on an autograd thread per
    device; PyTorch carries dispatch modes to those threads, so ``disabled(device="sim")``
    enters one (``memory.sim.allocation.PlainMode``, ``marks_plain``) and a creation in a
    Python backward there (``torch.empty`` in an ``autograd.Function``) stays plain too.
    """
    if not torch._C._len_torch_dispatch_stack():
        return False
    return any(getattr(mode, "marks_plain", False) for mode in _get_current_dispatch_mode_stack())


def plain_device() -> Optional[torch.device]:
    """The device the innermost ``disabled(device)`` asked creation functions to default to."""
    return getattr(_local, "device", None)


def enter_plain(device: Optional[torch.device]) -> Optional[torch.device]:
    """Start a ``disabled()`` scope; returns what :func:`exit_plain` restores."""
    previous = getattr(_local, "device", None)
    _local.depth = getattr(_local, "depth", 0) + 1
    _local.device = device
    return previous


def exit_plain(previous: Optional[torch.device]) -> None:
    _local.depth -= 1
    _local.device = previous


def suspend_plain() -> tuple:
    """Leave this thread's ``disabled()`` scopes for a while; returns what
    :func:`resume_plain` restores."""
    saved = getattr(_local, "depth", 0), getattr(_local, "device", None)
    _local.depth, _local.device = 0, None
    return saved


def resume_plain(saved: tuple) -> None:
    _local.depth, _local.device = saved
