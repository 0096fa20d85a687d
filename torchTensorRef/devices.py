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

#: most host memory pinned for asynchronous copies (page-locked memory is scarce)
PINNED_LIMIT_BYTES = 8 * 2**30

ACCEPTED_DEVICES = '"cpu" (pass-through), "sim" (simulated accelerator), "cuda" or "cuda:N"'


class Backend:
    """Copies and memory queries for one kind of accelerator."""

    name: str = "base"
    #: ops run on host copies and nothing ever moves
    passthrough: bool = False

    def __init__(self, compute: torch.device, declared: torch.device):
        self.compute = compute
        self.declared = declared

    def to_device(self, host: torch.Tensor, asynchronous: bool = False):
        """A new accelerator copy of the flat uint8 ``host`` buffer, and its ready event.

        With ``asynchronous`` the copy may still be running when this returns; the event
        (``None`` when the copy is complete) must be waited on before an op reads it.
        """
        raise NotImplementedError

    def wait(self, event) -> None:
        """Make the compute stream wait for ``event`` (from an asynchronous ``to_device``)."""

    def release_cached(self) -> None:
        """Return cached free accelerator memory to the device (after an out-of-memory)."""

    def pinned_copy(self, host: torch.UntypedStorage) -> Optional[torch.UntypedStorage]:
        """A page-locked copy of ``host`` for asynchronous prefetches, or ``None``."""
        return None

    def host_freed(self, host: torch.UntypedStorage) -> None:
        """A block's host copy was dropped (to account pinned memory)."""

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

    def to_device(self, host, asynchronous=False):
        return host.clone(), None

    def to_host(self, dev, host):
        if host is None:
            return dev.clone()
        host.copy_(dev)
        return host


class CudaBackend(Backend):
    """``"cuda"``: a real GPU; host copies live in ordinary host memory."""

    name = "cuda"

    def __init__(self, device: torch.device, pinned_limit: int = None):
        super().__init__(device, device)
        self.pinned_limit = PINNED_LIMIT_BYTES if pinned_limit is None else pinned_limit
        self.pinned_bytes = 0

    def to_device(self, host, asynchronous=False):
        dev = raw.empty(host.numel(), dtype=raw.UINT8, device=self.compute)
        if not (asynchronous and host.is_pinned()):
            dev.copy_(host)  # from pageable memory a copy is synchronous anyway
            return dev, None
        # Copy on the side stream, after the allocation is visible to it; the memory must
        # not be reused by the compute stream before the copy ends (record_stream).
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(self.compute))
        with torch.cuda.stream(side):
            dev.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        dev.record_stream(side)
        return dev, event

    def _side_stream(self):
        stream = getattr(self, "_stream", None)
        if stream is None:
            stream = self._stream = torch.cuda.Stream(self.compute)
        return stream

    def wait(self, event):
        torch.cuda.current_stream(self.compute).wait_event(event)

    def release_cached(self):
        torch.cuda.empty_cache()

    def pinned_copy(self, host):
        if host.is_pinned() or self.pinned_bytes + host.nbytes() > self.pinned_limit:
            return None
        pinned = self.new_host(host.nbytes())
        if not pinned.is_pinned():
            return None
        pinned.copy_(raw.flat_bytes(host))
        return pinned.untyped_storage()

    def host_freed(self, host):
        if host.is_pinned():
            self.pinned_bytes -= host.nbytes()

    def new_host(self, nbytes):
        # Pinned host copies let prefetches run asynchronously; bounded (see PINNED_LIMIT_BYTES).
        if self.pinned_bytes + nbytes <= self.pinned_limit:
            try:
                host = raw.empty(nbytes, dtype=raw.UINT8, pin_memory=True)
                self.pinned_bytes += nbytes
                return host
            except RuntimeError:
                pass  # pinning failed (locked-memory limits): pageable memory still works
        return raw.empty(nbytes, dtype=raw.UINT8)

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
