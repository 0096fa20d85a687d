"""Callbacks around every managed op: observe, veto, or hint moves (``add_callback``)."""

from __future__ import annotations

from ..core.errors import OpVetoedError


class OpCallback:
    """Handle of callbacks added with ``tensorsManager.add_callback``."""

    def __init__(self, manager, before, after):
        self.manager, self.before, self.after = manager, before, after

    def remove(self) -> None:
        """Stop calling these callbacks (idempotent)."""
        with self.manager._lock:
            if self in self.manager._callbacks:
                self.manager._callbacks.remove(self)
                self.manager._refresh_fast()


class Callbacks:
    """The ``TensorsManager`` methods for callbacks (it owns ``_callbacks`` and ``_lock``)."""

    def add_callback(self, before=None, after=None) -> "OpCallback":
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
        with self._lock:
            self._callbacks.append(handle)
            self._refresh_fast()
        return handle

    def _run_callbacks(self, when: str, ctx) -> None:
        for handle in list(self._callbacks):
            fn = handle.before if when == "before" else handle.after
            if fn is not None and fn(ctx) is False and when == "before":
                raise OpVetoedError(ctx.name)
