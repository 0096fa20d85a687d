"""The manager's counters and recordings: ``stats()``, ``reset_stats()``, ``recording()``.

A part of ``TensorsManager`` (``manager.py``).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch

from ..analysis.trace import Trace
from . import streams

#: the counters ``stats()`` reports and ``reset_stats()`` zeroes
STAT_KEYS = (
    "bytes_to_device", "bytes_to_host", "fetches", "writebacks", "evictions",
    "prefetches", "prefetch_hits", "prefetch_misses", "prefetches_unused", "prefetches_dropped",
    "host_syncs", "bytes_from_disk", "bytes_to_disk", "bytes_on_demand", "bytes_prefetched",
    "bytes_prefetched_ahead", "copies_to_device", "garbage_collections",
)


class Statistics:
    """What the manager counted, and recordings of what it does.

    Attributes:
        counters: the counts ``stats()`` reports and ``reset_stats()`` zeroes (``STAT_KEYS``).
        ops_at_reset: the manager's op count at the last reset.
    """


    def __init__(self, manager) -> None:
        self.m = manager
        self.counters: Dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self.ops_at_reset: int = 0

    def stats(self) -> dict:
        """Counters since the last ``reset_stats()`` and the current state.

        Keys: ``bytes_to_device``, ``bytes_to_host``, ``peak_device_bytes``,
        ``device_bytes``, ``ops``, ``evictions``, ``fetches``, ``writebacks``,
        ``prefetches``, ``prefetch_hits``, ``prefetch_misses``, ``prefetches_unused``,
        ``prefetches_dropped``, ``bytes_on_demand`` (brought to the device because an op
        needed them), ``bytes_prefetched`` (brought in by prefetches), ``bytes_prefetched_ahead``
        (of those, the bytes an op read that an earlier op's prefetch brought: the copy could
        overlap that op's work), ``copies_to_device`` (copies made to the device: a group's
        members take one, Note [Region groups]), ``host_syncs``, ``garbage_collections`` (reference
        cycles collected before refusing an op for room: Note [Garbage holding device memory]),
        ``budget``, ``device``, ``strategy``,
        ``tensors`` (live TensorRefs), ``tensors_on_device``, ``blocks``,
        ``blocks_on_device``, ``host_bytes`` (host copies of paged blocks, CPU tensors
        not counted), ``peak_host_bytes``, ``host_budget``, ``bytes_from_disk``,
        ``bytes_to_disk``, ``pinned_bytes``, ``pin_failures`` (pins PyTorch refused since the
        device was chosen: those host copies stay pageable, and are never prefetched),
        ``outside_bytes`` (device bytes allocated
        outside the manager at the last reading: Note [Budget on CUDA]),
        ``device_overshoot_bytes`` (the most the device held above the budget at an op's
        end, read there only with ``tensorsManager.check_device``); on CUDA also
        ``max_memory_allocated`` and ``max_memory_reserved`` (torch.cuda's, since the
        last ``reset_stats()``), and on ``"sim"`` ``max_memory_allocated`` (the most its
        allocator held at once since then: the manager's blocks, the program's plain
        tensors and the emulated workspaces).
        """
        m = self.m
        with m.lock:
            m.drain()
            acct, books, tier, backend = m.accounting, m.books, m.host_tier, m.backend
            out = dict(self.counters)
            out["ops"] = m.op_count - self.ops_at_reset
            out["peak_device_bytes"] = acct.peak
            out["worst_overshoot_bytes"] = acct.overshoot
            out["device_overshoot_bytes"] = acct.device_overshoot
            out["device_bytes"] = acct.resident
            out["budget"] = acct.limit
            out["device"] = m.device
            out["strategy"] = m.strategy.name
            out["blocks"] = len(books.blocks)
            out["blocks_on_device"] = len(books.resident)
            out["tensors"] = sum(b.refs for b in books.blocks.values())
            out["tensors_on_device"] = sum(b.refs for b in books.resident.values())
            out["host_bytes"] = tier.nbytes
            out["peak_host_bytes"] = tier.peak
            out["host_budget"] = tier.limit
            out["pinned_bytes"] = backend.pinned.used if backend.pinned is not None else 0
            out["pin_failures"] = backend.pinned.failed if backend.pinned is not None else 0
            out["outside_bytes"] = m.device_room.read_outside() if not backend.passthrough and not m.unresolved else 0
            if backend.simulated:
                out["max_memory_allocated"] = backend.max_allocated()
            if backend.name == "cuda" and backend.resolved:
                out["max_memory_allocated"] = torch.cuda.max_memory_allocated(backend.compute)
                out["max_memory_reserved"] = torch.cuda.max_memory_reserved(backend.compute)
            return out

    def reset(self) -> None:
        """Zero the counters; the peak restarts from the bytes in use now."""
        m = self.m
        with m.lock:
            self.counters = dict.fromkeys(STAT_KEYS, 0)
            self.ops_at_reset = m.op_count
            m.accounting.reset_peak()
            m.host_tier.peak = m.host_tier.nbytes
            backend = m.backend
            if backend.simulated:
                backend.reset_peak()
            if backend.name == "cuda" and backend.resolved:
                torch.cuda.reset_peak_memory_stats(backend.compute)

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished (``torch.cuda.synchronize`` for the pager)."""
        m = self.m
        with m.lock:
            m.device_room.retire(wait=True)
            m.host_tier.retire_spills(wait=True)
            for block in m.books.blocks.values():
                if block.host_pending is not None:
                    m.residency.wait_pending_host(block)

    @contextlib.contextmanager
    def recording(self, regions: bool = False) -> Iterator[Trace]:
        """Record block accesses, moves and resident bytes; yields a :class:`Trace`.

        ``regions``: module calls that are regions stay regions (one op each, its working
        set and the room it keeps for what it allocates inside as its accesses), for the
        offline reference at their granularity; by default every call runs op by op (the
        timeline model and the per-op reference model aten ops and their kernels).
        """
        m = self.m
        trace = Trace(m.device, m.accounting.limit)
        trace.regions = bool(regions)
        trace.block_bytes = m.backend.block_bytes
        with m.lock:
            m.drain()
            trace.initial = {b.id: (b.nbytes, b.dirty) for b in m.books.resident.values()}
            trace.initial_host = {b.id: (b.nbytes, False) for b in m.host_tier.hosted.values() if b.host_valid}
            previous, m.trace = m.trace, trace
            observer, streams.copy_observer = streams.copy_observer, trace.hidden
            m.refresh_fast()
        try:
            yield trace
        finally:
            with m.lock:
                trace.stop()
                m.trace = previous
                streams.copy_observer = observer
                m.refresh_fast()
