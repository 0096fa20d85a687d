"""Residency: moving blocks between host and device memory, and counting the device's bytes.

Every copy torchTensorRef makes goes through here, the same code for every backend:

- ``fetch``: a demand fetch, on the compute stream. From pinned host memory it is
  asynchronous for the host (the op queued next waits for it on the GPU, not in Python).
- ``prefetch``: a copy on a side stream from pinned memory, whose ``Pending`` the op that
  needs the block waits on (Note [Pending copies]). Never synchronous: a block whose host
  copy cannot be pinned is not prefetched, and an out-of-memory drops the prefetch.
- ``evict``: drops the device copy; a dirty block is written back first, on a copy stream
  into pinned memory, and the host copy is waited on only where it is read
  (``sync_host``: numpy, tolist, torch.save, toCPU) or re-fetched (ordered on the GPU).

Accounting: ``_device_bytes`` is the device bytes of resident blocks, each counted as the
device's allocator gives it (``block_bytes``: on CUDA and "sim" rounded up to 512 bytes);
``_inflight_bytes`` those of device copies still being written back (the allocator cannot
reuse them until the copy ends). Both count against the budget, and so does what else the
device has allocated (``Backend.in_use_elsewhere``). ``stats()["host_syncs"]`` counts every
time the protocol made the host wait for the device: a copy to or from pageable memory, or
a wait on a pending write-back that had not finished.

Note [Budget on CUDA]: the budget bounds what the device has allocated, the manager's
blocks and what it holds beside them (``_elsewhere_bytes``: libraries' workspaces, the
program's plain device tensors). cuBLAS keeps a workspace per thread's handle for the life
of the process (33 MiB on an H100), made at a thread's first product: so the budget setter
makes them first (``Backend.warm_up``: this thread and autograd's device thread) and refuses
a budget at or below them, and ``_make_room`` makes a new thread's before its first kernel,
then reads the device. Otherwise the device is read when an estimate does not fit and every
64th check (a reading costs more than an op). Blocks count what the allocator gives them
(``Backend.block_bytes``), not the bytes they hold: counted bare, every small block would
add up to 511 bytes to the device's reading of what is outside the manager, which goes
stale between readings, and real use would pass the budget. The op check, ``room()``, the slices of
multi-tensor ops and the overshoot count those bytes; what a kernel allocates and frees
inside one call, and the allocator's cache, are not counted (docs/concepts.md says what is
promised). ``"sim"`` emulates the workspaces (``SimBackend.workspace``).

An out-of-memory error from an allocation (a real one on CUDA, the capacity check on
``"sim"``) evicts every unpinned block the current op does not use, returns cached memory
to the driver and tries once more; a second failure raises ``DeviceOutOfMemoryError``.
"""

from __future__ import annotations

import time
from typing import Collection, Optional

import torch

from ..core import raw
from ..core.blocks import Block
from ..core.errors import DeviceOutOfMemoryError, OutOfBudgetError
from ..core.sizes import format_size
from .devices import workspace_key
from .sim.pool import MIN_BYTES as KEPT_MIN_BYTES

#: substrings of the errors libraries raise when their own device allocations fail
_OOM_MARKERS = ("out of memory", "ALLOC_FAILED", "CUBLAS_STATUS_NOT_INITIALIZED")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` reports a failed device allocation (cuBLAS and cuDNN raise RuntimeErrors)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MARKERS)


class Residency:
    """The ``TensorsManager`` methods that move blocks and count device bytes."""

    # -- accounting ------------------------------------------------------------------------

    def block_bytes(self, nbytes: int) -> int:
        """Device bytes a block of ``nbytes`` takes, as the budget counts it (the device's
        allocator rounds sizes up: ``Backend.block_bytes``). For strategies and op paths
        that weigh blocks against ``room()``."""
        return self._backend.block_bytes(nbytes)

    def _add_device_bytes(self, nbytes: int) -> None:
        self._device_bytes += nbytes
        used = self._device_bytes + self._inflight_bytes
        if used > self._peak:
            self._peak = used
        limit = self._limit
        if limit is not None and used + self._elsewhere_bytes - limit > self._overshoot:
            self._overshoot = used + self._elsewhere_bytes - limit  # (the budget covers both)

    def in_use(self) -> int:
        """Device bytes counted against the budget now: resident blocks, copies being written
        back and (CUDA) what else the device last said it holds. For strategies."""
        return self._device_bytes + self._inflight_bytes + self._elsewhere_bytes

    def _used_bytes(self) -> int:
        """Device bytes that count against the budget now (asking the device what else it holds)."""
        self._elsewhere_bytes = self._backend.in_use_elsewhere(self._device_bytes + self._inflight_bytes)
        return self._device_bytes + self._inflight_bytes + self._elsewhere_bytes

    def _warm_up(self) -> int:
        """Have the device make the workspaces of this thread and of the backward (once:
        each warm-up runs a product, which would raise the device's peak that ``stats()``
        reports), then read what it holds outside the manager (Note [Budget on CUDA])."""
        warmed = self._warmed
        key = workspace_key()
        if key not in warmed or "backward" not in warmed:
            self._backend.warm_up()
            warmed.update((key, "backward"))
        return self._read_outside()

    def _read_outside(self) -> int:
        """Device bytes allocated outside the manager, asked of the device now (and remembered).

        Write-backs known to have ended are forgotten first: the allocator frees their
        device copies, which the reading would otherwise subtract as still in flight (on
        CUDA it read 4000 bytes low). Asking does not finish a copy ("sim"'s stay deferred:
        their buffers are allocated until then, as counted)."""
        if self._inflight:
            kept = []
            for entry in self._inflight:
                if entry[0].done():
                    self._inflight_bytes -= entry[1]
                else:
                    kept.append(entry)
            self._inflight = kept
        self._used_bytes()
        return self._elsewhere_bytes

    def _retire_inflight(self, wait: bool = False) -> None:
        """Forget the write-backs that ended (on ``"sim"``: finish them); with ``wait``, all of them."""
        kept = []
        for pending, nbytes in self._inflight:
            if wait:
                self._wait_host(pending)
            elif not pending.retire():
                kept.append((pending, nbytes))
                continue
            self._inflight_bytes -= nbytes
        self._inflight = kept

    def _wait_host(self, pending) -> None:
        if not pending.done():
            self._counters["host_syncs"] += 1
        pending.wait_host()

    # -- making room ------------------------------------------------------------------------

    def _make_room(self, nbytes: int, protect, op_name: str, allocated: int = 0) -> None:
        """Evict (strategy's choice) until ``nbytes`` more fit in the budget; ``allocated`` of
        them are already allocated, to become blocks (a region's outputs): not outside too."""
        limit = self._limit
        if limit is None:
            return
        if self._unresolved:
            self._resolve_device()
        self._room_checks += 1
        if self._elsewhere:
            key = workspace_key()
            if key not in self._warmed:
                # A thread's first op: its workspaces are made (and counted) before its kernels.
                self._warmed.add(key)
                self._backend.warm_up(backward=False)
                self._used_bytes()
        if (self._device_bytes + self._inflight_bytes + self._elsewhere_bytes + nbytes <= limit
                and (not self._elsewhere or self._room_checks % 64)):
            return  # the common case: without asking the device (CUDA) what else it holds
        while True:
            if self._inflight:
                self._retire_inflight()  # finished write-backs give their bytes back (on "sim": all)
            used = self._used_bytes()
            taken = min(allocated, self._elsewhere_bytes)  # (a reading counts them outside the manager)
            self._elsewhere_bytes, used = self._elsewhere_bytes - taken, used - taken
            if used + nbytes <= limit:
                return
            victim = self._strategy.choose_victim(protect)
            if victim is not None:
                self._pressure()
                self.evict(victim)
                continue
            if self._inflight:
                self._retire_inflight(wait=True)  # nothing left to evict: wait for the copies
                continue
            pinned = sum(self._backend.block_bytes(b.nbytes) for b in self._resident.values() if b.pins)
            raise OutOfBudgetError(
                op_name, used + nbytes, limit,
                f"{format_size(pinned)} is pinned and the rest is in use by this op",
                outside=self._elsewhere_bytes,
            )

    def _recover_memory(self, protect) -> None:
        """After an out-of-memory error: free every device byte the current op does not need."""
        for block in [b for b in self._resident.values() if b.id not in protect and not b.pins]:
            self.evict(block)
        self._retire_inflight(wait=True)
        self._backend.release_cached()
        if self._budget is None:
            self._limit = self._compute_limit(None)  # another process may have taken memory

    def _device_alloc(self, nbytes: int, protect: Optional[Collection[int]], what: str) -> torch.Tensor:
        """A device buffer of ``nbytes``; on out-of-memory, recover (unless ``protect`` is ``None``) and retry once."""
        for attempt in (0, 1):
            try:
                self._inject(what, nbytes)
                backend = self._backend
                if backend.simulated:
                    self._check_capacity(backend.block_bytes(nbytes))
                return backend.allocate(nbytes)
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                if protect is None:
                    raise
                if attempt:
                    raise DeviceOutOfMemoryError(what, nbytes, self._free_estimate()) from e
                self._recover_memory(protect)
        raise AssertionError("unreachable")

    def _check_capacity(self, nbytes: int) -> None:
        """The simulated device's allocator: refuse what does not fit in its capacity."""
        capacity = self._backend.capacity()
        in_use = self._device_bytes + self._inflight_bytes + self._elsewhere_bytes
        if capacity is not None and in_use + nbytes > capacity:
            raise torch.OutOfMemoryError(
                f"sim: out of memory: tried to allocate {format_size(nbytes)}; the device has "
                f"{format_size(capacity)} of which {format_size(in_use)} is in use")

    def _free_estimate(self) -> int:
        capacity = self._backend.capacity()
        return 0 if capacity is None else max(capacity - self._used_bytes(), 0)

    def _inject(self, kind: str, nbytes: int, op=None) -> None:
        injector = self._fault_injector
        if injector is not None:
            injector(Fault(kind, nbytes, op))

    # -- moves ------------------------------------------------------------------------------

    def fetch(self, block: Block, protect: Collection[int] = ()) -> None:
        """Give ``block`` a valid device copy now (no budget check: see ``_make_room``).

        ``protect``: ids of the blocks the current op needs; an out-of-memory recovery
        never evicts them.
        """
        if block.dev is not None or block.host_only or self._backend.passthrough:
            return
        if not block.host_valid and block.disk is not None:
            self._load_host(block, protect)  # its bytes are only on disk
        start = time.perf_counter_ns()
        if self._backend.simulated:
            self._host_watch.reserve_bytes(block.nbytes)  # the simulated device is host memory
        dev = self._device_alloc(block.nbytes, set(protect) | {block.id}, "fetch")
        if block.host_pending is not None:
            block.host_pending.wait_compute()  # a write-back of these bytes is still running
        block.fetches += 1
        pinned, mode, src = self._backend.pinned, "ordered", None
        # Paged from pageable memory: pinned once, so later moves do not wait; else a small
        # one is staged (copied by the host, then asynchronously).
        if not pinned.is_pinned(block.host) and not (
                block.fetches > 1 and self._may_rehome(block) and self._pin_host(block)):
            src = raw.flat_bytes(block.host)
            staged = pinned.staged(src)
            if staged is not None:
                src = staged
            else:
                self._counters["host_syncs"] += 1  # from pageable memory the host waits
                mode = "blocking"
        self._backend.streams.copy_ordered(dev, src if src is not None else raw.flat_bytes(block.host))
        self._now_resident(block, dev, "to_device", start, mode)
        self._counters["fetches"] += 1

    def prefetch(self, block: Block) -> bool:
        """Bring ``block`` in ahead of use on a side stream (no budget check); whether it did.

        A block whose host copy cannot be pinned is skipped (the copy would make the host
        wait), and so is one that does not fit in the device: a prefetch never evicts for
        itself here (a strategy evicts first if it wants) and never fails the op it runs beside.
        """
        if block.dev is not None or block.host_only or block.external or self._backend.passthrough:
            return False
        if not block.host_valid and block.disk is not None:
            self.read_ahead(block)  # only on disk: the op will find it in host memory, or nearer
            return False
        if not self._backend.pinned.is_pinned(block.host) and not self._pin_host(block):
            return False
        start = time.perf_counter_ns()
        try:
            if self._backend.simulated:
                self._host_watch.reserve_bytes(block.nbytes)
            dev = self._device_alloc(block.nbytes, None, "prefetch")
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            self._counters["prefetches_dropped"] += 1
            return False
        if block.host_pending is not None:
            block.host_pending.wait_compute()
        block.dev_pending = self._backend.streams.copy_async(dev, raw.flat_bytes(block.host), prefetch=True)
        self._now_resident(block, dev, "to_device", start, "async")
        block.prefetched = True
        self._counters["prefetches"] += 1
        return True

    def _now_resident(self, block: Block, dev: torch.Tensor, move: str, start: int, mode: str) -> None:
        block.set_dev(dev.untyped_storage())
        self._resident[block.id] = block
        self._add_device_bytes(self._backend.block_bytes(block.nbytes))
        self._counters["bytes_to_device"] += block.nbytes
        if self._trace is not None:
            self._trace.move(move, block.id, block.nbytes, start, time.perf_counter_ns(), self._device_bytes, mode)

    def evict(self, block: Block) -> None:
        """Drop ``block``'s device copy, writing it back first if it is dirty."""
        if block.dev is None:
            return
        start = time.perf_counter_ns()
        if block.prefetched:  # brought in and never used
            block.prefetched = False
            self._counters["prefetches_unused"] += 1
        wrote = not block.clean or (block.host is None and self._keep_on_host(block))
        if wrote:
            self._write_back(block)
        block.dev_pending = None  # (a prefetch never waited on: its copy may still run, into memory we drop)
        block.exposed = False
        self._drop_dev(block)
        del self._resident[block.id]
        self._device_bytes -= self._backend.block_bytes(block.nbytes)
        self._counters["evictions"] += 1
        if self._trace is not None:
            self._trace.move("to_host", block.id, block.nbytes if wrote else 0, start,
                             time.perf_counter_ns(), self._device_bytes, _write_mode(block, wrote))

    _evict = evict

    def _drop_dev(self, block: Block) -> None:
        """Forget ``block``'s device copy; the device may keep its buffer for reuse
        (``Backend.recycle``, up to :meth:`_kept_limit`)."""
        storage = block.dev
        block.set_dev(None)
        if storage is None or block.nbytes < KEPT_MIN_BYTES:
            return  # (small buffers: the C allocator's fast case, and the per-op path)
        backend = self._backend
        start = time.perf_counter_ns()
        backend.recycle(storage, self._kept_limit())
        del storage
        if backend.simulated and self._trace is not None:
            # Keeping or freeing the simulated device's buffer is its allocator's work, not
            # the host's (a GPU's allocator keeps it for free): left out of the host's time.
            self._trace.hidden(start, time.perf_counter_ns())

    def _kept_limit(self) -> int:
        """Bytes of freed buffers a simulated allocator may keep for reuse: the budget (an
        eighth of the device's capacity without one), so that the simulated device's host
        memory stays within twice what the budget promises; none under a host budget, where
        freed memory must leave the process."""
        if self._host_limit or not self._backend.simulated:
            return 0  # (CUDA's allocators keep freed memory themselves)
        return self._budget or (self._backend.capacity() or 0) // 8

    def _write_back(self, block: Block) -> None:
        """Start copying ``block``'s device copy to its host copy (asynchronously into pinned memory)."""
        self._inject("writeback", block.nbytes)
        host = block.host
        if host is not None and not block.host_valid and self._may_rehome(block):
            host = None  # (stale, pageable and nobody else's: rewritten whole, into pinned memory)
        if host is None or host.nbytes() != block.nbytes:
            if block.host is not None:
                self._drop_host(block)
            self._make_host_room(block.nbytes, (block.id,), "writing a tensor back to host memory")
            self._host_watch.reserve_bytes(block.nbytes)
            buffer = self._backend.pinned.allocate(block.nbytes)
            if buffer is None:
                buffer = raw.empty(block.nbytes, dtype=raw.UINT8)
            host = buffer.untyped_storage()
            block.set_host(host, False)
            self._host_gained(block)
        dev = raw.flat_bytes(block.dev)
        if block.dev_pending is not None:
            block.dev_pending.wait_compute()
            block.dev_pending = None
        if self._backend.pinned.is_pinned(host) and not (block.external or block.host_shared):
            pending = self._backend.streams.copy_async(raw.flat_bytes(host), dev, prefetch=False)
            block.host_pending = pending
            held = self._backend.block_bytes(block.nbytes)  # (the device copy, until the copy ends)
            self._inflight.append((pending, held))
            self._inflight_bytes += held
        else:
            # Into pageable memory (the host waits), or into bytes others read directly.
            self._wait_pending_host(block)
            raw.flat_bytes(host).copy_(dev)
            self._counters["host_syncs"] += 1
        block.host_valid = True
        self._counters["bytes_to_host"] += block.nbytes
        self._counters["writebacks"] += 1

    def _wait_pending_host(self, block: Block) -> None:
        pending = block.host_pending
        if pending is not None:
            self._wait_host(pending)
            block.host_pending = None

    def sync_host(self, block: Block, record: bool = True) -> bool:
        """Make the host copy valid and readable now (keeping the device copy); whether it copied."""
        wrote = False
        if not block.host_valid and block.dev is None and block.disk is not None:
            self._load_host(block, (block.id,))
        if not block.host_valid and block.dev is not None:
            start = time.perf_counter_ns()
            self._write_back(block)
            wrote = True
            if record and self._trace is not None:
                self._trace.move("to_host", block.id, block.nbytes, start, time.perf_counter_ns(), self._device_bytes,
                                 _write_mode(block, wrote))
        if self._trace is not None and (wrote or block.host_pending is not None):
            self._trace.sync(time.perf_counter_ns(), block.id)  # the host reads these bytes now
        self._wait_pending_host(block)
        return wrote

    def _drop_host(self, block: Block) -> None:
        """``block`` has no host copy any more (it is stale, or another copy holds the bytes)."""
        self._forget_host(block)
        block.set_host(None, False)

    def _forget_host(self, block: Block) -> None:
        """``block`` stops using its host copy (accounting; the bytes go when no view holds them)."""
        host = block.host
        self._by_host_storage.pop(host._cdata, None)
        pinned = self._backend.pinned
        if pinned is not None:
            timed = pinned.emulated and self._trace is not None
            start = time.perf_counter_ns() if timed else 0
            pinned.freed(host, self._kept_limit())  # (the pool keeps no small buffer)
            if timed:
                # Keeping or freeing the buffer is the pinned allocator's work, which PyTorch's
                # does for free on a GPU machine (it keeps the buffer): not host time.
                self._trace.hidden(start, time.perf_counter_ns())
        block.host_pending = None
        self._host_lost(block)

    # -- new device tensors -----------------------------------------------------------------

    def new_device_tensor(self, size, stride, dtype, memory_format=None):
        """A new TensorRef on the device, within the budget (the device's ``empty`` kernels)."""
        from ..core.tensor_ref import make_ref

        dtype = dtype or torch.get_default_dtype()
        size = tuple(size)
        if stride is None:
            meta = raw.empty(size, dtype=dtype, device="meta", memory_format=memory_format or torch.contiguous_format)
            stride = meta.stride()
        nbytes = raw.storage_bytes(size, tuple(stride), dtype)
        with self._lock:
            self._drain()
            if self._backend.name != "sim":
                raise RuntimeError(
                    f'tensors on device "sim" need tensorsManager.device = "sim" (it is {self.device!r})')
            self._make_room(self._backend.block_bytes(nbytes), (), "empty")
            buffer = self._device_alloc(nbytes, (), "create")
            block = self._new_block(nbytes)
            block.set_dev(buffer.untyped_storage())
            self._resident[block.id] = block
            self._add_device_bytes(self._backend.block_bytes(nbytes))
            block.last_use = self._op_count
            view = raw.typed_view(block.dev, dtype, size, tuple(stride), 0)
            return make_ref(block, view, self._declared)


def _write_mode(block: Block, wrote: bool) -> str:
    """How a write-back just started copies, for the trace: only one into pinned memory is in flight."""
    if not wrote:
        return "drop"
    return "async" if block.host_pending is not None else "blocking"


class Fault:
    """What ``tensorsManager.fault_injector`` is called with, before each allocation and op.

    Attributes:
        kind: ``"op"`` (an op about to run), ``"fetch"``, ``"prefetch"``, ``"writeback"``
            or ``"create"`` (a device allocation about to be made).
        nbytes: bytes of the allocation (for ``"op"``: of the op's new results).
        op: the :class:`~torchTensorRef.ops.dispatch.OpContext` for ``"op"``, else ``None``.
        name: the op's name for ``"op"``, else ``kind``.
    """

    __slots__ = ("kind", "nbytes", "op")

    def __init__(self, kind: str, nbytes: int, op=None):
        self.kind, self.nbytes, self.op = kind, nbytes, op

    @property
    def name(self) -> str:
        return self.op.name if self.op is not None else self.kind

    def __repr__(self) -> str:
        return f"Fault({self.name}, {self.nbytes} bytes)"
