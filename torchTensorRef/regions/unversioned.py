"""Writes that move no version counter, seen while a region's call runs.

Note [Unversioned writes]: a region finds what its call wrote by the version counters of
the plain tensors it gave the call (Note [Regions] in ``mechanism.py``). Two kinds of
write move no such counter, and a module in eval mode (in training mode its buffers count
as written anyway) that wrote its buffer by either lost the write under a budget: the block
was taken as unchanged, and its eviction dropped the device copy.

- PyTorch's in-place list ops (``torch._foreach_add_`` and the rest) write each tensor of
  their first list without moving its counter, on every device. The package wraps them
  (``integrations/patching.py``): while a region's call runs on this thread, the tensors of
  the list each one writes are recorded, and the region counts them as written. The
  compiler puts the functions in its graphs as they are: the wrapper only records, and a
  compiled graph is not a region's call.
- A write through ``tensor.data`` (``self.running.data.mul_(m)``) moves the counter of the
  alias ``.data`` made, not the tensor's. A region's first call with given shapes runs op
  by op (measured), where each aten op's schema says which of its arguments it writes in
  place: the blocks of the module's tensors it wrote there (``Measure.wrote``) count as
  written at every later call of the region (``Region.writes``). A module that starts
  writing a tensor only after its measured calls is not seen.
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
