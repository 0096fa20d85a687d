"""Errors raised inside backward ops on the simulated device: kept, and raised by ``backward()``.

Why they cannot be raised where they happen is Note [Errors in backward on sim], below. The
ops that may fail inside backward (``SimTensor``'s dispatch, the plain mode, the device's
allocations, the managed dispatch) catch their error, keep it with :func:`keep_for_backward`
and return :func:`failed_result`; ``register()`` (``device.py``) wraps autograd's engine
with :func:`report_backward_errors`, which raises the kept error.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional

import torch
from torch._ops import OpOverload

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


def failed_result(func: OpOverload) -> Optional[_Failed]:
    """What backward op ``func`` returns when it failed: ``FAILED``, or ``None`` for an op that
    returns nothing (an in-place ``_foreach_`` op, in an optimizer step run by a gradient hook),
    for which torch would raise on anything else, in Python, and abort."""
    return FAILED if func._schema.returns else None


_kept_errors: List[BaseException] = []
_kept_lock = threading.Lock()


def in_backward() -> bool:
    """Whether this thread is running a backward node of the autograd engine."""
    return torch._C._current_autograd_node() is not None


def keep_for_backward(error: BaseException) -> None:
    """Keep ``error`` to be raised by the ``backward()`` call that is running (Note [Errors in backward on sim])."""
    with _kept_lock:
        _kept_errors.append(error)


def _take_kept() -> Optional[BaseException]:
    with _kept_lock:
        kept = _kept_errors[0] if _kept_errors else None
        del _kept_errors[:]
    return kept


def report_backward_errors() -> None:
    import torch.autograd
    import torch.autograd.graph

    original = torch.autograd.graph._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
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

    # (an attribute set on a function, as functools.wraps sets it: the stubs know none)
    run_backward.__wrapped__ = original  # type: ignore[attr-defined]
    torch.autograd.graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward
