"""Recording what the manager does: block accesses per op, moves and resident bytes.

``trace.accesses`` is the contract: ``(op_index, block_id, nbytes, write)`` for every
storage block an op touches on the accelerator, in execution order. ``trace.save(path)``
writes a Chrome trace (open it in Perfetto or chrome://tracing).

What a timeline needs besides (``timeline.py`` replays it on a modelled GPU) is kept in
side tables keyed like the contract's: ``kernels`` (each op's own kernel time, FLOPs and
bytes), ``move_modes`` (how each move copied), ``syncs`` (where the host waited for the
device outside an op), ``hidden_copies`` (copies ``"sim"`` deferred and ran later on the
host) and ``marks`` (step boundaries).
"""

from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional, Tuple

from . import op_cost

Access = Tuple[int, int, int, bool]

#: how a move copied (``Trace.move_modes``): "async" on a side stream the host does not
#: wait for (prefetches, write-backs to pinned memory); "ordered" on the compute stream,
#: from pinned memory (the host does not wait, the ops after it do); "blocking" from or to
#: pageable memory (the host waits until the bytes arrived); "drop" a clean eviction.
MOVE_MODES = ("async", "ordered", "blocking", "drop")


class Trace:
    """What happened while ``tensorsManager.recording()`` was active."""

    def __init__(self, device: str, budget):
        self.device = device
        self.budget = budget
        #: recorded with module regions on (``recording(regions=True)``): a region is one op
        self.regions = False
        self.accesses: List[Access] = []
        #: (op_index, name, start_ns, end_ns)
        self.ops: List[tuple] = []
        #: (kind "to_device" | "to_host", block_id, nbytes, start_ns, end_ns)
        self.moves: List[tuple] = []
        #: (time_ns, device_bytes) after each change
        self.resident: List[tuple] = []
        #: blocks resident when recording started: {block_id: (nbytes, dirty)}
        self.initial: dict = {}
        #: blocks with a valid host copy when recording started: {block_id: (nbytes, False)}
        self.initial_host: dict = {}
        #: blocks created by ops while recording (they need no copy in)
        self.created: set = set()
        #: {block_id: its group} for the blocks read while in a region group (Note [Region
        #: groups]), a group named by its first member's id: the offline reference at group
        #: granularity (``reference_moves(..., groups=trace.groups)``)
        self.groups: Dict[int, int] = {}
        #: the device bytes a block of ``nbytes`` takes, as the budget counted it (the
        #: allocator's rounding): for the offline reference (``reference_moves``)
        self.block_bytes = None
        #: op_index -> Kernel: the op's own kernel call, timed apart from the bookkeeping
        self.kernels: Dict[int, op_cost.Kernel] = {}
        #: one per entry of ``moves``: a :data:`MOVE_MODES` value
        self.move_modes: List[str] = []
        #: (time_ns, block_id) where the host waited for the device outside an op
        self.syncs: List[tuple] = []
        #: (start_ns, end_ns) of copies the simulated device deferred and the host ran later
        #: (on a GPU a copy engine runs them: not host time)
        self.hidden_copies: List[tuple] = []
        #: (kind "from_disk" | "to_disk", block_id, nbytes, start_ns, end_ns): the disk tier's
        #: reads and writes (a write's end is when it was queued: it runs on the disk thread)
        self.disk: List[tuple] = []
        #: step boundaries (time_ns) set by whoever drives the recording (the ``predict`` runner)
        self.marks: List[int] = []
        #: (time_ns, nbytes, tensors) per module call: the weights an offloading hook would copy
        self.module_calls: List[tuple] = []
        #: when the op in flight entered the manager (its start in ``ops`` is after its fetches)
        self.entered = 0
        #: op_index -> time the op entered the manager
        self.entries: Dict[int, int] = {}
        #: host ns per op that entering a TensorRef costs before the manager sees the op
        #: (``predict_run.proxy_entry_ns``; 0 until someone measures it)
        self.entry_ns = 0.0
        #: ns spent measuring kernels' costs (inside ``kernels[i].end``): the recording's own
        #: time, which an unrecorded run does not spend
        self.measure_ns = 0
        #: (steps, wall ns) of the same steps run without recording (``set_unrecorded``)
        self.unrecorded: Optional[Tuple[int, int]] = None
        self.t0 = time.perf_counter_ns()
        self.t_end: Optional[int] = None

    # -- recording (called by the manager, holding its lock) -----------------------------

    def op(self, index: int, name: str, start: int, end: int) -> None:
        self.ops.append((index, name, start, end))
        if self.entered:
            self.entries[index] = self.entered
            self.entered = 0

    def grouped(self, block) -> None:
        """``block``, read by an op, is a member of a region group."""
        self.groups[block.id] = block.group.members[0].id

    def kernel(self, index: int, func, args, kwargs, out, start: int, end: int) -> None:
        """The op's kernel ran from ``start`` to ``end``: keep that and what it costs a GPU."""
        kernel = op_cost.measure(func, args, kwargs, out, start, end)
        # Measuring is the recording's cost, not the op's: it counts as kernel time, which
        # the timeline leaves out of the host's.
        now = time.perf_counter_ns()
        self.measure_ns += now - end
        self.kernels[index] = kernel._replace(end=now)

    def move(self, kind: str, block_id: int, nbytes: int, start: int, end: int, device_bytes: int,
             mode: Optional[str] = None) -> None:
        self.moves.append((kind, block_id, nbytes, start, end))
        self.resident.append((end, device_bytes))
        if mode is None:
            mode = "drop" if nbytes == 0 else "ordered"
        self.move_modes.append(mode)

    def disk_move(self, kind: str, block_id: int, nbytes: int, start: int, end: int) -> None:
        self.disk.append((kind, block_id, nbytes, start, end))

    def sync(self, when: int, block_id: int) -> None:
        """The host waited for the device to read ``block_id``'s bytes (outside an op)."""
        self.syncs.append((when, block_id))

    def hidden(self, start: int, end: int) -> None:
        self.hidden_copies.append((start, end))

    def mark(self) -> None:
        """A step ends now (``timeline.predict`` divides by the number of steps)."""
        self.marks.append(time.perf_counter_ns())

    def set_unrecorded(self, steps: int, wall_ns: int) -> None:
        """The same steps as the recorded ones took ``wall_ns`` in all when run unrecorded.

        Recording turns the fast path off; ``timeline.predict`` takes our host time from
        this run instead. Only on ``"sim"``: there kernels and copies run on the host thread,
        so the wall time less the recorded device work is host time.
        """
        if self.device != "sim":
            raise ValueError(f"an unrecorded run's host time is only known on 'sim' (this trace is on {self.device!r})")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or not wall_ns > 0:
            raise ValueError(f"steps must be a positive int and wall_ns positive (got: {steps!r}, {wall_ns!r})")
        self.unrecorded = (steps, int(wall_ns))

    def stop(self) -> None:
        self.t_end = time.perf_counter_ns()

    def resized(self, when: int, device_bytes: int) -> None:
        """Resident bytes changed without a move: an op's result was made or freed on the accelerator."""
        self.resident.append((when, device_bytes))

    # -- reading -------------------------------------------------------------------------

    def bytes_moved(self) -> dict:
        """Total bytes moved each way while recording."""
        out = {"to_device": 0, "to_host": 0}
        for kind, _b, nbytes, _s, _e in self.moves:
            out[kind] += nbytes
        return out

    def chrome_events(self) -> list:
        def us(ns):
            return (ns - self.t0) / 1000.0

        events = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"torchTensorRef ({self.device})"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "ops"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "moves"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 3, "args": {"name": "disk"}},
        ]
        for index, name, start, end in self.ops:
            events.append({"name": name, "cat": "op", "ph": "X", "pid": 1, "tid": 1,
                           "ts": us(start), "dur": max(us(end) - us(start), 0.001), "args": {"index": index}})
        for kind, block_id, nbytes, start, end in self.moves:
            events.append({"name": kind, "cat": "move", "ph": "X", "pid": 1, "tid": 2,
                           "ts": us(start), "dur": max(us(end) - us(start), 0.001),
                           "args": {"block": block_id, "bytes": nbytes}})
        for kind, block_id, nbytes, start, end in self.disk:
            events.append({"name": kind, "cat": "disk", "ph": "X", "pid": 1, "tid": 3,
                           "ts": us(start), "dur": max(us(end) - us(start), 0.001),
                           "args": {"block": block_id, "bytes": nbytes}})
        for when, nbytes in self.resident:
            events.append({"name": "resident bytes", "ph": "C", "pid": 1, "ts": us(when),
                           "args": {"device_bytes": nbytes}})
        return events

    def save(self, path) -> str:
        """Write a Chrome trace JSON to ``path``; return the path."""
        path = os.fspath(path)
        with open(path, "w") as f:
            json.dump({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms",
                       "otherData": {"device": self.device, "budget": self.budget,
                                     "accesses": len(self.accesses)}}, f)
        return path

    def __repr__(self) -> str:
        return f"Trace(ops={len(self.ops)}, accesses={len(self.accesses)}, moves={len(self.moves)})"
