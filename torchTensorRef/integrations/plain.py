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
    """Plain torch inside: creation functions return plain tensors (in this thread, and where
    torch allows, on the autograd threads running a backward called inside it: Note [Plain
    torch on autograd's threads] in ``core/context.py``; not in other threads it starts).

    Ops on existing TensorRefs are still managed, and their results are TensorRefs.

    Args:
        device: where the creation functions that take a ``device`` make their tensors when
            not told (``torch.zeros``, ``torch.randn``, ``torch.tensor`` ...): plain torch on
            an accelerator, to compare managed tensors with. Unlike ``torch.device(...)`` as a
            context manager, this installs no torch function mode, which would change what
            PyTorch's modules do (the fast paths of attention and transformer layers). A
            ``torch.device(...)`` context or ``torch.set_default_device`` in force gives its
            own device instead, as in plain torch (a model built on ``"meta"`` to be loaded),
            and a ``generator`` of another device draws on its own (a CPU generator gives a
            CPU tensor, as a managed factory given one draws its numbers on the host).
            Libraries that look for a device context (transformers' ``from_pretrained``,
            which would then load to that device with a device map, and ask for accelerate
            to do it) find none: they do what they do in plain torch without one (Note
            [Probes for a device context]).
    """
    if device is not None:
        if isinstance(device, str) and device.split(":")[0] == NAME and register() is None:
            device = "cpu"  # (no strict "sim" here: its tensors are CPU tensors)
        device = torch.device(device)
    previous = context.enter_plain(device)
    mode = PlainMode() if device is not None and device.type == NAME else contextlib.nullcontext()
    try:
        with mode:  # (marks the sim device's plain ops too, in backward as well)
            yield
    finally:
        context.exit_plain(previous)


# Note [Probes for a device context]: transformers decides where ``from_pretrained`` loads a
# model given no ``device_map`` by probing where ``torch.tensor([])`` lands: anywhere but
# ``torch.get_default_device()`` means a ``torch.device`` context is in force, which it
# honours with a one-device map, and without accelerate installed it refuses
# ("... requires `accelerate`"). Inside ``disabled(device=...)`` that probe lands on the
# device, so the same call raised or not, and loaded to the device or the CPU, by whether
# accelerate was installed. Such a probe (``patching.DEVICE_PROBE_FUNCTIONS``) runs with
# the device set aside: it sees what plain torch without a device context shows, and the
# model loads as it does there (on the CPU, or where a ``device_map`` says). Creations
# elsewhere inside ``disabled(device=...)`` still land on the device.
def probe_wrapper(wrapped, instance, args, kwargs):
    """A library's probe for a ``torch.device`` context, run with ``disabled()``'s device set
    aside (Note [Probes for a device context]): it is not such a context."""
    if context.plain_device() is None:
        return wrapped(*args, **kwargs)
    previous = context.enter_plain(None)  # (still disabled: plain tensors, made on the CPU)
    try:
        return wrapped(*args, **kwargs)
    finally:
        context.exit_plain(previous)
