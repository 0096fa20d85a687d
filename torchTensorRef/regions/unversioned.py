"""Writes that move no version counter, seen while a region's call runs.

Note [Unversioned writes]: a region finds what its call wrote by the version counters of
the plain tensors it gave the call (Note [Regions] in ``mechanism.py``). PyTorch's in-place
list ops (``torch._foreach_add_`` and the rest) write each tensor of their first list
without moving its counter, on every device. A call that updated its module's buffer with
one (a module in eval mode: those in training mode have their buffers counted as written
anyway) lost the update under a budget: the block was taken as unchanged, and its eviction
dropped the device copy. So the package wraps those functions (``integrations/patching.py``):
while a region's call runs on this thread, the tensors of the list each one writes are
recorded, and the region counts them as written. The compiler puts the functions in its
graphs as they are: the wrapper only records, and a compiled graph is not a region's call.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

#: torch's in-place list ops: each writes the tensors of its first argument
FUNCTIONS = tuple(sorted(n for n in dir(torch) if n.startswith("_foreach_") and n.endswith("_")))


class _Recording(threading.local):
    ids: Optional[set] = None  # ids of the tensors written while a region's call runs


_recording = _Recording()


def start() -> Optional[set]:
    """Record from now on, on this thread; returns what :func:`stop` restores."""
    previous = _recording.ids
    _recording.ids = set()
    return previous


def stop(previous: Optional[set]) -> set:
    """The ids of the tensors written since :func:`start`, which returned ``previous``."""
    ids = _recording.ids
    _recording.ids = previous
    return ids if ids is not None else set()


def wrapper(wrapped, instance, args, kwargs):
    """An in-place list op: its written tensors recorded where a region's call runs."""
    out = wrapped(*args, **kwargs)
    ids = _recording.ids
    if ids is not None:
        written = args[0] if args else kwargs.get("self")
        if isinstance(written, (list, tuple)):
            ids.update(map(id, written))
    return out
