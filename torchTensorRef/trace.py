"""Recording what the manager does: block accesses per op, moves and resident bytes.

``trace.accesses`` is the contract: ``(op_index, block_id, nbytes, write)`` for every
storage block an op touches on the accelerator, in execution order. ``trace.save(path)``
writes a Chrome trace (open it in Perfetto or chrome://tracing).
"""

from __future__ import annotations

import json
import os
import time
from typing import List, Tuple

Access = Tuple[int, int, int, bool]


class Trace:
    """What happened while ``tensorsManager.recording()`` was active."""

    def __init__(self, device: str, budget):
        self.device = device
        self.budget = budget
        self.accesses: List[Access] = []
        #: (op_index, name, start_ns, end_ns)
        self.ops: List[tuple] = []
        #: (kind "to_device" | "to_host", block_id, nbytes, start_ns, end_ns)
        self.moves: List[tuple] = []
        #: (time_ns, device_bytes) after each change
        self.resident: List[tuple] = []
        #: blocks resident when recording started: {block_id: (nbytes, dirty)}
        self.initial: dict = {}
        #: blocks created by ops while recording (they need no copy in)
        self.created: set = set()
        self.t0 = time.perf_counter_ns()

    # -- recording (called by the manager, holding its lock) -----------------------------

    def op(self, index: int, name: str, start: int, end: int) -> None:
        self.ops.append((index, name, start, end))

    def move(self, kind: str, block_id: int, nbytes: int, start: int, end: int, device_bytes: int) -> None:
        self.moves.append((kind, block_id, nbytes, start, end))
        self.resident.append((end, device_bytes))

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
        ]
        for index, name, start, end in self.ops:
            events.append({"name": name, "cat": "op", "ph": "X", "pid": 1, "tid": 1,
                           "ts": us(start), "dur": max(us(end) - us(start), 0.001), "args": {"index": index}})
        for kind, block_id, nbytes, start, end in self.moves:
            events.append({"name": kind, "cat": "move", "ph": "X", "pid": 1, "tid": 2,
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
