"""The manager's counters and recordings: ``stats()``, ``reset_stats()``, ``recording()``.

A mixin of ``TensorsManager`` (``manager.py``).
"""

from __future__ import annotations

import contextlib

import torch

from ..analysis.trace import Trace
from . import streams

#: the counters ``stats()`` reports and ``reset_stats()`` zeroes
STAT_KEYS = (
    "bytes_to_device", "bytes_to_host", "fetches", "writebacks", "evictions",
    "prefetches", "prefetch_hits", "prefetch_misses", "prefetches_unused", "prefetches_dropped",
    "host_syncs", "bytes_from_disk", "bytes_to_disk",
)


class Statistics:
    """What the manager counted, and recordings of what it does."""


    def stats(self) -> dict:
        """Counters since the last ``reset_stats()`` and the current state.

        Keys: ``bytes_to_device``, ``bytes_to_host``, ``peak_device_bytes``,
        ``device_bytes``, ``ops``, ``evictions``, ``fetches``, ``writebacks``,
        ``prefetches``, ``prefetch_hits``, ``prefetch_misses``, ``prefetches_unused``,
        ``prefetches_dropped``, ``host_syncs``, ``budget``, ``device``, ``strategy``,
        ``tensors`` (live TensorRefs), ``tensors_on_device``, ``blocks``,
        ``blocks_on_device``, ``host_bytes`` (host copies of paged blocks, CPU tensors
        not counted), ``peak_host_bytes``, ``host_budget``, ``bytes_from_disk``,
        ``bytes_to_disk``, ``pinned_bytes``, ``outside_bytes`` (device bytes allocated
        outside the manager at the last reading: Note [Budget on CUDA]); on CUDA also
        ``max_memory_allocated`` and ``max_memory_reserved`` (torch.cuda's, since the
        last ``reset_stats()``), and on ``"sim"`` ``max_memory_allocated`` (the most its
        allocator held at once since then: the manager's blocks, the program's plain
        tensors and the emulated workspaces).
        """
        with self._lock:
            self._drain()
            out = dict(self._counters)
            out["ops"] = self._op_count - self._ops_at_reset
            out["peak_device_bytes"] = self._peak
            out["worst_overshoot_bytes"] = self._overshoot
            out["device_bytes"] = self._device_bytes
            out["budget"] = self._limit
            out["device"] = self.device
            out["strategy"] = self._strategy.name
            out["blocks"] = len(self._blocks)
            out["blocks_on_device"] = len(self._resident)
            out["tensors"] = sum(b.refs for b in self._blocks.values())
            out["tensors_on_device"] = sum(b.refs for b in self._resident.values())
            out["host_bytes"] = self._host_bytes
            out["peak_host_bytes"] = self._peak_host
            out["host_budget"] = self._host_limit
            pinned = self._backend.pinned
            out["pinned_bytes"] = pinned.used if pinned is not None else 0
            out["outside_bytes"] = self._read_outside() if not self._backend.passthrough and not self._unresolved else 0
            if self._backend.simulated:
                out["max_memory_allocated"] = self._backend.max_allocated()
            if self._backend.name == "cuda" and self._backend.resolved:
                out["max_memory_allocated"] = torch.cuda.max_memory_allocated(self._backend.compute)
                out["max_memory_reserved"] = torch.cuda.max_memory_reserved(self._backend.compute)
            return out

    def reset_stats(self) -> None:
        """Zero the counters; the peak restarts from the bytes in use now."""
        with self._lock:
            self._counters = dict.fromkeys(STAT_KEYS, 0)
            self._ops_at_reset = self._op_count
            self._peak = self._device_bytes + self._inflight_bytes
            self._peak_host = self._host_bytes
            self._overshoot = 0
            if self._backend.simulated:
                self._backend.reset_peak()
            if self._backend.name == "cuda" and self._backend.resolved:
                torch.cuda.reset_peak_memory_stats(self._backend.compute)

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished (``torch.cuda.synchronize`` for the pager)."""
        with self._lock:
            self._retire_inflight(wait=True)
            self._retire_spills(wait=True)
            for block in self._blocks.values():
                if block.host_pending is not None:
                    self._wait_pending_host(block)

    @contextlib.contextmanager
    def recording(self, regions: bool = False):
        """Record block accesses, moves and resident bytes; yields a :class:`Trace`.

        ``regions``: module calls that are regions stay regions (one op each, its working
        set and the room it keeps for what it allocates inside as its accesses), for the
        offline reference at their granularity; by default every call runs op by op (the
        timeline model and the per-op reference model aten ops and their kernels).
        """
        trace = Trace(self.device, self._limit)
        trace.regions = bool(regions)
        trace.block_bytes = self._backend.block_bytes
        with self._lock:
            self._drain()
            trace.initial = {b.id: (b.nbytes, b.dirty) for b in self._resident.values()}
            trace.initial_host = {b.id: (b.nbytes, False) for b in self._hosted.values() if b.host_valid}
            previous, self._trace = self._trace, trace
            observer, streams.copy_observer = streams.copy_observer, trace.hidden
            self._refresh_fast()
        try:
            yield trace
        finally:
            with self._lock:
                trace.stop()
                self._trace = previous
                streams.copy_observer = observer
                self._refresh_fast()
