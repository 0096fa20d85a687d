"""Backends that hide the differences between CUDA, the simulated accelerator and the CPU.

A backend knows three things: where ops compute (``compute``), which device a TensorRef
reports (``declared``, see Note [Declared device]) and how to copy a block's bytes between
host and accelerator. The strategies and the manager only talk to this small interface, so
the same code runs on ``"sim"`` in CI and on a GPU.

Note [Declared device]: a TensorRef reports the device where its ops will run, not where
its bytes are now. Composite ops (scaled dot-product attention, autocast) pick kernels by
the reported device, and those kernels must match where the compute happens.
``proxyInfo.device`` tells where the bytes are.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import raw

ACCEPTED_DEVICES = '"cpu" (pass-through), "sim" (simulated accelerator), "cuda" or "cuda:N"'


class Backend:
    """Copies and memory queries for one kind of accelerator."""

    name: str = "base"
    #: ops run on host copies and nothing ever moves
    passthrough: bool = False

    def __init__(self, compute: torch.device, declared: torch.device):
        self.compute = compute
        self.declared = declared

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Return a new accelerator copy of the flat uint8 ``host`` buffer."""
        raise NotImplementedError

    def to_host(self, dev: torch.Tensor, host: Optional[torch.Tensor]) -> torch.Tensor:
        """Copy the flat ``dev`` buffer into ``host`` (allocated when ``None``); return it."""
        raise NotImplementedError

    def new_host(self, nbytes: int) -> torch.Tensor:
        return raw.empty(nbytes, dtype=raw.UINT8)

    def free_bytes(self) -> Optional[int]:
        """Free accelerator memory, or ``None`` when unbounded."""
        return None

    def is_device_output(self, t: torch.Tensor) -> bool:
        """Whether an op's output ``t`` lives in accelerator memory."""
        return True

    def __repr__(self) -> str:
        return self.name


class PassthroughBackend(Backend):
    """``"cpu"``: TensorRefs are proxies over host tensors; nothing moves."""

    name = "cpu"
    passthrough = True

    def __init__(self):
        cpu = torch.device("cpu")
        super().__init__(cpu, cpu)


class SimBackend(Backend):
    """``"sim"``: host memory accounted as a separate accelerator; every move is a real copy."""

    name = "sim"

    def __init__(self):
        cpu = torch.device("cpu")
        super().__init__(cpu, cpu)

    def to_device(self, host):
        return host.clone()

    def to_host(self, dev, host):
        if host is None:
            return dev.clone()
        host.copy_(dev)
        return host


class CudaBackend(Backend):
    """``"cuda"``: a real GPU; host copies live in ordinary host memory."""

    name = "cuda"

    def __init__(self, device: torch.device):
        super().__init__(device, device)

    def to_device(self, host):
        dev = raw.empty(host.numel(), dtype=raw.UINT8, device=self.compute)
        dev.copy_(host, non_blocking=host.is_pinned())
        return dev

    def to_host(self, dev, host):
        if host is None:
            host = self.new_host(dev.numel())
        host.copy_(dev)  # synchronous: the host copy must be complete before it is read
        return host

    def free_bytes(self):
        free, _total = torch.cuda.mem_get_info(self.compute)
        return int(free)

    def is_device_output(self, t):
        return t.device.type == "cuda"


def make_backend(spec) -> Backend:
    """Build the backend for a ``tensorsManager.device`` value.

    Raises:
        ValueError: for an unknown device, or CUDA asked for where there is none.
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise ValueError(f"device must be one of {ACCEPTED_DEVICES} (got: {spec!r})")
    text = spec.strip().lower()
    if text == "cpu":
        return PassthroughBackend()
    if text == "sim":
        return SimBackend()
    if text == "cuda" or text.startswith("cuda:"):
        try:
            dev = torch.device(text)
        except RuntimeError as e:
            raise ValueError(f"device must be one of {ACCEPTED_DEVICES} (got: {spec!r})") from e
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {spec!r} needs CUDA, which is not available here; "
                f'use "sim" to simulate an accelerator, or "cpu" (accepted: {ACCEPTED_DEVICES})'
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r} does not exist: this machine has {torch.cuda.device_count()} "
                f"CUDA device(s) (accepted: {ACCEPTED_DEVICES})"
            )
        return CudaBackend(torch.device("cuda", index))
    raise ValueError(f"device must be one of {ACCEPTED_DEVICES} (got: {spec!r})")
