"""``disabled()``: plain torch in a scope, to compare managed tensors with.

Its state lives in ``core.context`` (the core and the simulated device read it); this is the
public context manager over it.
"""

from __future__ import annotations

import contextlib

import torch

from ..core import context
from ..memory.sim.allocation import PlainMode
from ..memory.sim.device import register
from ..memory.sim.tensor import NAME


@contextlib.contextmanager
def disabled(device=None):
    """Plain torch inside: creation functions return plain tensors (this thread only).

    Ops on existing TensorRefs are still managed, and their results are TensorRefs.

    Args:
        device: where the creation functions that take a ``device`` make their tensors when
            not told (``torch.zeros``, ``torch.randn``, ``torch.tensor`` ...): plain torch on
            an accelerator, to compare managed tensors with. Unlike ``torch.device(...)`` as a
            context manager, this installs no torch function mode, which would change what
            PyTorch's modules do (the fast paths of attention and transformer layers). A
            ``torch.device(...)`` context or ``torch.set_default_device`` in force gives its
            own device instead, as in plain torch (a model built on ``"meta"`` to be loaded).
    """
    if device is not None:
        if isinstance(device, str) and device.split(":")[0] == NAME and register() is None:
            device = "cpu"  # (no strict "sim" here: its tensors are CPU tensors)
        device = torch.device(device)
    previous = context.enter_plain(device)
    mode = PlainMode() if device is not None and device.type == NAME else contextlib.nullcontext()
    try:
        with mode:  # (plain tensors of the sim device are made in backward too)
            yield
    finally:
        context.exit_plain(previous)
