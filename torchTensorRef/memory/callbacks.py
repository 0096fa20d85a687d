"""Callbacks around every managed op: observe, veto, or hint moves (``add_callback``)."""

from __future__ import annotations

from typing import Callable, List, Optional

from ..core.errors import OpVetoedError
from .op_protocol import OpInFlight


#: a callback: called with the op in flight; a ``before`` callback returning ``False`` vetoes it
Callback = Callable[[OpInFlight], object]


class OpCallback:
    """Handle of callbacks added with ``tensorsManager.add_callback``."""

    def __init__(self, callbacks: "Callbacks", before: Optional[Callback], after: Optional[Callback]) -> None:
        self.callbacks, self.before, self.after = callbacks, before, after

    def remove(self) -> None:
        """Stop calling these callbacks (idempotent)."""
        self.callbacks.remove(self)


class Callbacks:
    """The callbacks added with ``add_callback``, run around every managed op.

    Attributes:
        handles: the callbacks in force, in the order they were added.
    """


    def __init__(self, manager) -> None:
        self.m = manager
        self.handles: List[OpCallback] = []

    def add(self, before: Optional[Callback] = None, after: Optional[Callback] = None) -> OpCallback:
        """Run ``before(op)`` / ``after(op)`` around every managed op; returns a handle.

        ``op`` is the op in flight (``op.name``, ``op.index``, ``op.blocks``, ``op.args``
        and, after, ``op.outputs``). A ``before`` callback that returns ``False`` vetoes the
        op: it raises ``OpVetoedError`` before anything changes. Callbacks may hint moves
        (``tensorsManager.pin``, ``tensor.toGPU()``, ``tensor.toCPU()``). Remove with
        ``handle.remove()``.

        Example::

            seen = []
            handle = tensorsManager.add_callback(before=lambda op: seen.append(op.name))
            ...
            handle.remove()
        """
        if before is None and after is None:
            raise ValueError("add_callback needs a before and/or an after callable (got neither)")
        for name, fn in (("before", before), ("after", after)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable (got: {type(fn).__name__})")
        handle = OpCallback(self, before, after)
        with self.m.lock:
            self.handles.append(handle)
            self.m.refresh_fast()
        return handle

    def remove(self, handle: OpCallback) -> None:
        """Stop calling ``handle``'s callbacks (idempotent)."""
        with self.m.lock:
            if handle in self.handles:
                self.handles.remove(handle)
                self.m.refresh_fast()

    def run(self, when: str, ctx: OpInFlight) -> None:
        """The ``before`` or ``after`` callbacks of op ``ctx``; a ``before`` returning ``False`` vetoes it."""
        for handle in list(self.handles):
            fn = handle.before if when == "before" else handle.after
            if fn is not None and fn(ctx) is False and when == "before":
                raise OpVetoedError(ctx.name)
