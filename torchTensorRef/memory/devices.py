"""Backends: what differs between CUDA, the simulated accelerator and the CPU pass-through.

A backend says where ops compute (``compute``), which device a TensorRef reports
(``declared``, see Note [Declared device]), how big the device is, how to allocate on it,
and which streams (``streams.py``) and pinned host memory (``pinned.py``) its copies use.
The copy protocol itself (``residency.py``) is the same code for every backend, so what
runs in CI on ``"sim"`` is what runs on a GPU.

Note [Declared device]: a TensorRef reports the device where its ops will run, not where
its bytes are now. Composite ops (scaled dot-product attention, autocast) pick kernels by
the reported device, and those kernels must match where the compute happens.
``proxyInfo.device`` tells where the bytes are. A block that lives only in host memory
(``Block.host_only``: a tensor made with ``device="cpu"``, the result of ``.cpu()``)
reports ``cpu``.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Callable, Optional, Union

import torch

from ..core import raw
from ..core.sizes import format_size
from .pinned import PinnedMemory
from .sim import device as sim_device
from .sim.caching import CachingAllocator
from .sim.pool import ALLOCATED, BufferPool
from .streams import CudaStreams, SimStreams

ACCEPTED_DEVICES = '"cpu" (pass-through), "sim" (simulated accelerator), "cuda" or "cuda:N"'
CPU = torch.device("cpu")
#: capacity of the simulated accelerator unless ``tensorsManager.sim_capacity`` says otherwise
SIM_CAPACITY_BYTES = 16 * 2**30

# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), default settings
_MIN_BLOCK = 512  # kMinBlockSize: every allocation is rounded up to a multiple of it
_SMALL_SIZE = 2**20  # kSmallSize: larger ones come from the large pool
_MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc: from here segments are rounded up to...
_ROUND_LARGE = 2 * 2**20  # ...kRoundLarge, and a rest of at most kSmallSize is not split off


def cuda_block_bytes(nbytes: int) -> int:
    """Device bytes PyTorch's CUDA caching allocator counts (``memory_allocated``) for an
    allocation of ``nbytes``: rounded up to a multiple of 512 bytes, and a large one (10 MiB
    and more) up to the 2 MiB of a new segment where the rest (1 MiB or less) is too small
    to be split off. A large allocation served from a cached block may hold up to 1 MiB
    more, which the device's next reading shows (Note [Budget on CUDA])."""
    if nbytes <= 0:
        return 0  # (no allocation at all)
    size = -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK
    if size >= _MIN_LARGE_ALLOC:
        segment = -(-size // _ROUND_LARGE) * _ROUND_LARGE
        if segment - size <= _SMALL_SIZE:
            return segment
    return size


def largest_within(nbytes: int, block_bytes: Callable[[int], int]) -> int:
    """The largest allocation that ``block_bytes`` (a backend's count of an allocation) counts
    as at most ``nbytes``: room kept as "all that is left" must not round up past it."""
    if nbytes <= 0:
        return 0
    if block_bytes(nbytes) <= nbytes:
        return nbytes
    size = nbytes // _MIN_BLOCK * _MIN_BLOCK
    if block_bytes(size) <= nbytes:
        return size
    return nbytes // _ROUND_LARGE * _ROUND_LARGE  # (a whole segment: counted as it is)


def cuda_allocated(device: torch.device) -> int:
    """``torch.cuda.memory_allocated(device)``, at a fraction of its cost: that one flattens
    every statistic of the allocator into a new sorted dict on each call, which made the
    manager's readings of the device a large share of a paged decoding step's time. This
    reads the one counter of the nested statistics that it flattens."""
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    if nested is None or device.type != "cuda" or device.index is None or not torch.cuda.is_initialized():
        return torch.cuda.memory_allocated(device)  # (0 before CUDA is initialized; not a CUDA device: raises)
    return nested(device.index)["allocated_bytes"]["all"]["current"]


class Backend:
    """The device-specific half of the copy protocol (``residency.py`` is the other half)."""

    name: str = "base"
    #: ops run on host copies and nothing ever moves
    passthrough: bool = False
    #: allocations are checked against ``capacity()`` here (the simulated device), not by a driver
    simulated: bool = False
    #: the device is fixed (only ``"cuda"`` without an index waits for its first use)
    resolved: bool = True
    #: plain CPU tensors may be the device's: the manager handed out a nested tensor, which
    #: "sim" keeps as a plain CPU one, as it does what is computed from it (Note [Plain CPU
    #: tensors] in ``ops/device_checks.py``)
    nested_results: bool = False
    #: its kernels are the host's (PyTorch's CPU kernels), which may compute an element by
    #: where it falls in their loops (Note [Cuts of host kernels] in ``ops/vector_loops.py``)
    host_kernels: bool = False

    def __init__(self, compute: torch.device, declared: torch.device):
        self.compute = compute
        self.declared = declared
        self.streams: Optional[Union[CudaStreams, SimStreams]] = None
        self.pinned: Optional[PinnedMemory] = None

    def resolve(self) -> None:
        """Fix the device at its first use (Note [Declared device]; ``CudaBackend``'s index)."""

    @property
    def kind(self) -> str:
        """``"cpu"``, ``"sim"`` or ``"cuda"``: what strategies may specialise on."""
        return self.name

    @property
    def plain_cpu_is_device(self) -> bool:
        """Whether a plain CPU tensor may be one of the device's (Note [Plain CPU tensors] in
        ``ops/device_checks.py``): once it handed out a nested tensor."""
        return self.nested_results

    def capacity(self) -> Optional[int]:
        """Bytes of the device usable by this process (``None``: unbounded)."""
        return None

    def in_use_elsewhere(self, managed_bytes: int) -> int:
        """Device bytes allocated beside the manager's blocks (workspaces, plain tensors)."""
        return 0

    def block_bytes(self, nbytes: int) -> int:
        """Device bytes an allocation of ``nbytes`` takes (what the budget plans for a
        block): the device's allocator rounds sizes up (``cuda_block_bytes``)."""
        return nbytes

    def dev_bytes(self, storage: torch.UntypedStorage) -> int:
        """Device bytes the allocator counts for ``storage``, a live device allocation (what
        the budget counts for a block): ``block_bytes`` of its size, or more where the
        allocator gave it a larger block (Note [Allocator slack])."""
        return self.block_bytes(storage.nbytes())

    def slack(self) -> int:
        """The most ``dev_bytes`` of a new allocation may exceed its ``block_bytes``."""
        return 0

    def track(self, storage: torch.UntypedStorage) -> None:
        """``storage`` is a new device allocation made by a kernel (the simulated device
        counts its live allocations; a driver does it for CUDA)."""

    def track_alias(self, storage: torch.UntypedStorage) -> None:
        """``storage`` is a range of a counted allocation (Note [Region groups]): no bytes
        of its own."""

    def warm_up(self, backward: bool = True) -> None:
        """Make the libraries allocate the device memory they keep for the life of the
        process (cuBLAS workspaces) for this thread and, with ``backward``, for autograd's
        device thread, so that the budget is checked against it before a kernel makes it
        (Note [Budget on CUDA])."""

    def note_kernel(self) -> None:
        """A kernel is about to run on the device on this thread (the simulated device's
        workspaces are made here)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` on the device (may raise ``torch.OutOfMemoryError``)."""
        return raw.empty(nbytes, dtype=raw.UINT8, device=self.compute)

    def release_cached(self) -> None:
        """Return cached free device memory to the driver (after an out-of-memory)."""

    def recycle(self, storage: torch.UntypedStorage, limit: int) -> bool:
        """The manager dropped ``storage``, a device copy: a device without a caching
        allocator of its own may keep it for reuse, up to ``limit`` bytes kept; whether it
        did. CUDA's allocator does this itself."""
        return False

    def freed_in_flight(self, storage: torch.UntypedStorage) -> None:
        """The manager dropped ``storage`` while a copy on a side stream still uses it: the
        device counts it free from now on, as CUDA's allocator does with a buffer recorded
        on another stream (it delays only its reuse: Note [Stream-ordered frees])."""

    def is_host(self, device: torch.device) -> bool:
        """Whether ``device``, asked for by a call, means the host and not this device
        (``"cpu"`` is the device of lenient ``"sim"``, whose copies are CPU tensors)."""
        return device.type == "cpu" and (self.passthrough or self.declared.type != "cpu")

    def is_device_output(self, t: torch.Tensor) -> bool:
        """Whether the kernel output ``t`` lives on this device (else: host, or another device)."""
        return t.device == self.compute

    def capturing(self) -> bool:
        """Whether a CUDA graph is being captured on the current stream."""
        return False

    def __repr__(self) -> str:
        return self.name


class PassthroughBackend(Backend):
    """``"cpu"``: TensorRefs are proxies over host tensors; nothing moves."""

    name = "cpu"
    passthrough = True

    def __init__(self):
        super().__init__(CPU, CPU)


class SimBackend(Backend):
    """``"sim"``: a separate accelerator simulated in host memory (Note [Strict sim]).

    Its blocks' device copies are host buffers, its kernels the CPU's, its copies deferred
    until waited on (Note [Pending copies]), its pinned memory emulated, and its memory
    ``capacity`` bytes, past which allocations raise ``torch.OutOfMemoryError``. Its
    allocator counts what CUDA's does (Note [Allocated bytes on sim]): every live allocation,
    the program's plain SimTensors included, and with ``rounding`` each at the size CUDA's
    caching allocator gives it (``tensorsManager.sim_rounding``). Where
    PyTorch cannot register a device (torch < 2.9), or when asked (``strict=False``:
    ``tensorsManager.sim_strict``), TensorRefs report ``cpu`` (``strict`` is ``False``) and
    the rest is unchanged: the device copies are then plain CPU tensors, whose ops cost what
    plain CPU torch's do (the form that times the manager's own cost).
    """

    name = "sim"
    simulated = True
    host_kernels = True
    pinned: PinnedMemory  # (emulated, always)

    def __init__(self, capacity: int = SIM_CAPACITY_BYTES, pinned_limit: Optional[int] = None,
                 workspace: int = 0, rounding: bool = False, strict: bool = True):
        device = sim_device.register() if strict else None
        super().__init__(CPU, device if device is not None else CPU)
        self.strict = device is not None
        self._capacity = capacity
        # (asked for the timing form, not poisoned; strict where it cannot be, still poisoned)
        self.streams = SimStreams(poison=strict)
        self.pinned = PinnedMemory(emulated=True, limit=pinned_limit)
        self.pool = BufferPool(0)
        #: bytes each thread's first kernel leaves allocated for good, as cuBLAS's workspace
        #: does on CUDA (``tensorsManager.sim_workspace``; 0: none)
        self.workspace = workspace
        self._workspace_keys: set = set()
        #: the device's live allocations, as ``torch.cuda.memory_allocated`` counts them
        self.allocated = ALLOCATED
        self.rounding = False
        self.set_rounding(rounding)

    @property
    def plain_cpu_is_device(self) -> bool:
        # (in the timing form its device tensors are plain CPU tensors, and so are plain ops'
        # results on them)
        return self.nested_results or not self.strict

    def capacity(self) -> Optional[int]:
        return self._capacity

    def set_capacity(self, nbytes: int) -> None:
        """The simulated device's memory is ``nbytes`` from now on."""
        self._capacity = nbytes

    def in_use_elsewhere(self, managed_bytes: int) -> int:
        # As CUDA's: what the device's allocator holds, less the manager's blocks
        allocated = self.allocated.total() + self.workspace * len(self._workspace_keys)
        return max(allocated - managed_bytes, 0)

    def block_bytes(self, nbytes: int) -> int:
        return cuda_block_bytes(nbytes) if self.rounding else nbytes

    def dev_bytes(self, storage: torch.UntypedStorage) -> int:
        if not self.rounding:
            return storage.nbytes()
        # (at least the rounding: the count of an allocation made while another backend,
        # built and not used, set the process's allocations to be counted as asked)
        return max(self.allocated.counted(storage), cuda_block_bytes(storage.nbytes()))

    def slack(self) -> int:
        return _SMALL_SIZE if self.rounding else 0

    def max_allocated(self) -> int:
        """The most bytes the device held at once since ``reset_peak()``, workspaces included
        (as ``torch.cuda.max_memory_allocated``)."""
        return self.allocated.peak() + self.workspace * len(self._workspace_keys)

    def reset_peak(self) -> None:
        self.allocated.reset_peak()

    def set_rounding(self, rounding: bool) -> None:
        """Count allocations at the sizes CUDA's allocator gives them (``True``) or as asked."""
        self.rounding = rounding
        self.allocated.block_bytes = self.block_bytes
        self.allocated.placement = PLACEMENT if rounding else None

    def track(self, storage: torch.UntypedStorage) -> None:
        self.allocated.track(storage)

    def track_alias(self, storage: torch.UntypedStorage) -> None:
        self.allocated.alias(storage)

    def set_workspace(self, nbytes: int) -> None:
        """Emulate workspaces of ``nbytes`` from now on (none made yet)."""
        self.workspace = nbytes
        self._workspace_keys.clear()

    def warm_up(self, backward: bool = True) -> None:
        if self.workspace:
            self._workspace_keys.add(workspace_key())
            if backward:
                self._workspace_keys.add("backward")

    def note_kernel(self) -> None:
        if self.workspace:
            self._workspace_keys.add(workspace_key())

    def allocate(self, nbytes: int) -> torch.Tensor:
        kept = self.pool.take(nbytes)
        buffer = kept if kept is not None else super().allocate(nbytes)
        self.allocated.track(buffer.untyped_storage())
        return buffer

    def recycle(self, storage: torch.UntypedStorage, limit: int) -> bool:
        self.pool.limit = limit
        kept = self.pool.give(storage)
        if kept:
            self.allocated.untrack(storage)  # (cached for reuse: not allocated, as on CUDA)
        return kept

    def freed_in_flight(self, storage: torch.UntypedStorage) -> None:
        self.allocated.freed(storage)  # (the stand-in copy holds it; the pool reuses it after)

    def release_cached(self) -> None:
        self.pool.clear()
        self.pinned.kept.clear()

    def is_device_output(self, t: torch.Tensor) -> bool:
        # The kernels are the CPU's: which outputs are the device's is decided by the op
        # (``OpContext.on_host``), not by the tensor.
        return True


#: where the simulated device places its allocations while it emulates CUDA's allocator
#: (one for the process, as its allocations are: Note [Allocator slack])
PLACEMENT = CachingAllocator()


def workspace_key() -> Union[str, int]:
    """Whose workspace a kernel uses: on CUDA one per thread's cuBLAS handle, and autograd
    runs every backward kernel of a device on that device's own thread."""
    return "backward" if torch._C._current_graph_task_id() >= 0 else threading.get_ident()


class CudaBackend(Backend):
    """``"cuda"`` / ``"cuda:N"``: a real GPU.

    ``"cuda"`` without an index is resolved at first use (``resolve()``), so that a script's
    ``torch.cuda.set_device(local_rank)``, or torchrun's ``LOCAL_RANK``, is honoured.
    """

    name = "cuda"

    def __init__(self, index: Optional[int], pinned_limit: Optional[int] = None):
        super().__init__(CPU, CPU)  # placeholders until resolve()
        self.index = index
        self.resolved = False
        self.pinned = PinnedMemory(emulated=False, limit=pinned_limit)
        #: (storage key, bytes counted) of the last large buffer ``allocate`` made
        self._counted = (0, 0)
        if index is not None:
            self.resolve()

    def target_index(self) -> int:
        """The index this backend uses or would use if resolved now (``LOCAL_RANK`` if set,
        else the current device)."""
        if self.index is not None:
            return self.index
        local = os.environ.get("LOCAL_RANK")
        return int(local) % torch.cuda.device_count() if local and local.isdigit() else torch.cuda.current_device()

    def resolve(self) -> None:
        """Fix the device index (``LOCAL_RANK`` if set, else the current device)."""
        if self.resolved:
            return
        index = self.target_index()
        self.index = index
        self.compute = self.declared = torch.device("cuda", index)
        self.streams = CudaStreams(self.compute)
        self.resolved = True

    def capacity(self) -> Optional[int]:
        # What this process may use: the free memory plus what its allocator holds already.
        free, _total = torch.cuda.mem_get_info(self.compute)
        return int(free) + torch.cuda.memory_reserved(self.compute)

    def in_use_elsewhere(self, managed_bytes: int) -> int:
        return max(cuda_allocated(self.compute) - managed_bytes, 0)

    block_bytes = staticmethod(cuda_block_bytes)

    def allocate(self, nbytes: int) -> torch.Tensor:
        if nbytes <= _SMALL_SIZE:
            return super().allocate(nbytes)  # (the small pool splits off every rest: no slack)
        # What the allocator counts for the buffer is what its counter grew by (the manager
        # allocates under its lock; a thread allocating beside it would only add to it).
        before = cuda_allocated(self.compute)
        buffer = super().allocate(nbytes)
        self._counted = (buffer.untyped_storage()._cdata, cuda_allocated(self.compute) - before)
        return buffer

    def dev_bytes(self, storage: torch.UntypedStorage) -> int:
        planned = cuda_block_bytes(storage.nbytes())
        key, counted = self._counted
        if key != storage._cdata:
            return planned  # (a kernel's result: its slack shows in the device's next reading)
        self._counted = (0, 0)
        return min(max(counted, planned), planned + _SMALL_SIZE)

    def slack(self) -> int:
        return _SMALL_SIZE

    def warm_up(self, backward: bool = True) -> None:
        # One small product, in plain torch: cuBLAS (and cuBLASLt, for a product with a
        # bias) allocate their workspace for this thread's handle and keep it; its backward
        # does the same on autograd's device thread, where every backward kernel runs.
        # (plain tensors from the unwrapped constructor: nothing here is managed)
        with torch.enable_grad():
            a = raw.empty(8, 8, device=self.compute).fill_(1.0).requires_grad_(backward)
            out = torch.addmm(a[0], a, a)
            if backward:
                out.sum().backward()
        torch.cuda.synchronize(self.compute)

    def release_cached(self) -> None:
        torch.cuda.empty_cache()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()


def make_backend(spec: Union[str, torch.device], sim_capacity: int = SIM_CAPACITY_BYTES,
                 pinned_limit: Optional[int] = None, sim_workspace: int = 0, sim_rounding: bool = False,
                 sim_strict: bool = True) -> Backend:
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
        backend = SimBackend(sim_capacity, pinned_limit, sim_workspace, sim_rounding, sim_strict)
        if sim_strict and not backend.strict:
            warnings.warn(f'device "sim" runs in its lenient form: {sim_device.unavailable_reason()}',
                          stacklevel=3)
        return backend
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
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {spec!r} does not exist: this machine has {torch.cuda.device_count()} "
                f"CUDA device(s) (accepted: {ACCEPTED_DEVICES})"
            )
        return CudaBackend(dev.index, pinned_limit)
    raise ValueError(f"device must be one of {ACCEPTED_DEVICES} (got: {spec!r})")


def default_device() -> str:
    """``"cuda"`` where CUDA is available, else ``"cpu"`` (pass-through)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def describe_capacity(backend: Backend) -> str:
    cap = backend.capacity()
    return "unbounded" if cap is None else format_size(cap)
