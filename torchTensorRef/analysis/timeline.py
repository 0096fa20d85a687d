"""A recorded trace replayed on a modelled GPU: how long a step would take there.

``predict(trace, gpu="h100-pcie")`` walks the trace in recorded order over four lanes:

- **host**: the measured time between kernels and copies, ours (from an op's entry into
  the manager to its end) and the program's (between ops), plus a modelled launch cost
  per kernel and per copy; the kernels' and copies' own time on the recording machine is
  left out (on a GPU they run on the device). Where the trace has an unrecorded run of the
  same steps (``trace.set_unrecorded``), the measured host time is scaled to that run's
  (:func:`unrecorded_scale`): recording turns the fast path off;
- **compute**: one kernel per op that launches one, lasting the roofline
  ``max(FLOPs / peak, bytes / memory bandwidth, launch floor)``;
- **host-to-device** and **device-to-host**: one copy engine each way, at the link's pinned
  or pageable rate.

Synchronization follows the protocol (``streams.py``): a prefetch runs beside the compute
stream and only the op that reads its block waits for it; a pinned fetch is ordered on the
compute stream (later kernels wait, the host does not); a copy from or to pageable memory
makes the host wait until it is done; a write-back starts after the kernels queued before
it; ``.item()`` and the host reading a block wait for the device.

What it leaves out is in ``docs/timeline.md`` (Limits).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from typing import Dict, List, Optional, Union

from . import gpus
from .gpus import GPU
from .trace import Trace

#: host time to launch one kernel (PyTorch eager on CUDA) and to queue one copy, seconds
LAUNCH_HOST = 5e-6
COPY_HOST = 5e-6
#: the shortest a kernel takes on the device, and the fixed cost of one copy, seconds
LAUNCH_FLOOR = 2.5e-6
COPY_LATENCY = 10e-6

LANES = ("host", "compute", "host-to-device", "device-to-host")
SCENARIOS = ("recorded", "resident", "cpu_offload")


@dataclasses.dataclass
class Prediction:
    """A predicted run; ``*_seconds`` are per step, lanes busy time.

    ``stalls`` is the time the compute lane waited with work to do: ``"copy"`` for a copy
    its kernel needed, ``"host"`` for the host to launch it. ``host_unrecorded_scale`` is
    the factor from the recorded host time to the unrecorded run's (:func:`unrecorded_scale`;
    1 when the trace has none). ``bound_lane`` names the lane that sets
    ``bound_seconds``; ``bottleneck`` the busiest lane. ``host_wait_seconds`` is the time
    the host waited for the device (``.item()``, copies from or to pageable memory).
    """

    gpu: GPU
    scenario: str
    steps: int
    step_seconds: float
    compute_seconds: float
    transfer_seconds: float
    host_seconds: float
    host_ours_seconds: float
    host_program_seconds: float
    host_unrecorded_scale: float
    bound_seconds: float
    stalls: Dict[str, float]
    host_wait_seconds: float
    flops: float
    bytes_to_device: float
    bytes_to_host: float
    kernels: int
    events: List[tuple] = dataclasses.field(default_factory=list, repr=False)

    @property
    def bound_lane(self) -> str:
        """The lane of ``bound_seconds``: "compute", "host-to-device" or "device-to-host"."""
        up = self.bytes_to_device / self.gpu.copy_rate(True, True)
        down = self.bytes_to_host / self.gpu.copy_rate(False, True)
        return max((self.compute_seconds, "compute"), (up, "host-to-device"), (down, "device-to-host"))[1]

    @property
    def bottleneck(self) -> str:
        """The busiest lane of the predicted step (what bounds it): one of :data:`LANES`."""
        lanes = self.lanes
        return max(LANES, key=lambda lane: lanes[lane])

    @property
    def lanes(self) -> Dict[str, float]:
        """Busy seconds per step of each lane."""
        busy = defaultdict(float)
        for lane, _name, _start, dur in self.events:
            busy[lane] += dur
        return {lane: busy[lane] / self.steps for lane in LANES}

    def summary(self) -> dict:
        """The figures as a JSON-ready dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("gpu", "events")}
        out["gpu"] = self.gpu.name
        out["bound_lane"] = self.bound_lane
        out["bottleneck"] = self.bottleneck
        return out

    def save(self, path) -> str:
        """Write the predicted timeline as a Chrome trace (lanes host, compute,
        host-to-device, device-to-host); return the path."""
        path = os.fspath(path)
        events = [{"name": "process_name", "ph": "M", "pid": 1,
                   "args": {"name": f"predicted on {self.gpu.name} ({self.scenario})"}}]
        for tid, lane in enumerate(LANES, 1):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
        tids = {lane: tid for tid, lane in enumerate(LANES, 1)}
        for lane, name, start, dur in self.events:
            events.append({"name": name, "ph": "X", "pid": 1, "tid": tids[lane],
                           "ts": start * 1e6, "dur": max(dur * 1e6, 0.001)})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"prediction": self.summary()}}, f)
        return path

    def __str__(self) -> str:
        ms = 1e3
        return (f"{self.gpu.name} ({self.scenario}): {self.step_seconds * ms:.3f} ms/step "
                f"[compute {self.compute_seconds * ms:.3f}, transfer {self.transfer_seconds * ms:.3f}, "
                f"host {self.host_seconds * ms:.3f}, bound {self.bound_seconds * ms:.3f}, "
                f"stalls copy {self.stalls['copy'] * ms:.3f} host {self.stalls['host'] * ms:.3f}; "
                f"busiest lane: {self.bottleneck}]")


def predict(trace: Trace, gpu: Union[str, GPU, dict] = "h100-pcie", *, scenario: str = "recorded",
            steps: Optional[int] = None, as_half: bool = False, pinned: bool = False,
            host_scale: float = 1.0, unrecorded: bool = True) -> Prediction:
    """Replay ``trace`` on ``gpu``.

    Args:
        trace: from ``tensorsManager.recording()`` on ``"sim"`` (or a GPU).
        gpu: a name of :func:`torchTensorRef.analysis.gpus.names`, a :class:`~torchTensorRef.analysis.gpus.GPU`
            or a dict of numbers (see ``gpus.resolve``).
        scenario: ``"recorded"`` (what the trace did), ``"resident"`` (everything on the
            GPU: no moves, none of our host time) or ``"cpu_offload"`` (accelerate's hooks:
            each module's weights copied before its forward, from ``trace.module_calls``).
        steps: steps in the trace; default ``len(trace.marks)`` or 1.
        as_half: the trace was recorded in fp32 for a bf16 program (a CPU without fast
            bf16): halve every byte count and use the 16-bit peak.
        pinned: for ``"cpu_offload"``, whether the weights are in pinned memory.
        host_scale: the measured host time is multiplied by this: 0.5 for a host twice as
            fast as the recording machine's (the modelled launch costs are not scaled); 0
            leaves it all out, ours and the program's: what the schedule of kernels and
            copies allows, with only the launch costs on the host.
        unrecorded: for ``"recorded"``, when the trace has an unrecorded run of the same
            steps (``trace.unrecorded``), scale the recorded host time to that run's
            (:func:`unrecorded_scale`); ``False`` keeps the recording's (the generic path).
    """
    spec = gpus.resolve(gpu)
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}: accepted are {', '.join(SCENARIOS)}")
    if steps is None:
        steps = max(len(trace.marks), 1)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int (got: {steps!r})")
    if isinstance(host_scale, bool) or not isinstance(host_scale, (int, float)) or not host_scale >= 0:
        raise ValueError(f"host_scale must be a number >= 0 (got: {host_scale!r})")
    measured = 1.0
    if unrecorded and scenario == "recorded" and trace.unrecorded is not None:
        measured = unrecorded_scale(trace, steps)
    replay = _Replay(trace, spec, scenario, 0.5 if as_half else 1.0, as_half, pinned)
    replay.host_scale = host_scale
    replay.measured = measured
    replay.run()
    return replay.prediction(steps)


def unrecorded_scale(trace: Trace, steps: Optional[int] = None) -> float:
    """The factor from the recorded host time to that of the same steps run unrecorded.

    Recording runs every op through the generic path (and costs host time of its own);
    unrecorded, resident ops take the fast path and Flow follows its plan. On ``"sim"``
    kernels and copies run on the host thread, so per step the unrecorded run's host time
    is its wall time less the device work the recording measured:
    ``host = wall / unrecorded steps - (span - recorded host - measuring) / steps``, and the
    factor is ``host / recorded host`` (ours and the program's together: recording slows
    both). Applied to each gap of the trace, it keeps which op spends the time.
    """
    if trace.unrecorded is None:
        raise ValueError("the trace has no unrecorded run (trace.set_unrecorded)")
    steps = steps or max(len(trace.marks), 1)
    base = _Replay(trace, gpus.resolve("h100-pcie"), "recorded", 1.0, False, False)
    base.run()  # (the host time measured does not depend on the GPU)
    recorded = (base.ours + base.program) / steps
    if recorded <= 0:
        return 1.0
    end = trace.t_end if trace.t_end is not None else base.last
    device = ((end - trace.t0) - trace.measure_ns) / 1e9 / steps - recorded
    run_steps, wall_ns = trace.unrecorded
    host = wall_ns / 1e9 / run_steps - device
    return max(host, 0.0) / recorded


class _Replay:
    """The lanes' clocks while walking the trace (seconds on the modelled GPU)."""

    def __init__(self, trace, gpu, scenario, scale, as_half, pinned):
        self.trace, self.gpu, self.scenario = trace, gpu, scenario
        self.scale, self.as_half, self.pinned = scale, as_half, pinned
        self.host = self.compute = self.up = self.down = self.stream_copy = 0.0
        self.ready: Dict[int, float] = {}        # block -> its side-stream copy in ends
        self.written: Dict[int, float] = {}      # block -> its write-back ends
        self.events: List[tuple] = []
        self.stalls = {"copy": 0.0, "host": 0.0}
        self.host_wait = self.ours = self.program = self.flops = 0.0
        self.bytes = {"to_device": 0.0, "to_host": 0.0}
        self.kernels = 0
        self.host_scale = self.measured = 1.0
        self.last = trace.t0
        self.entry = getattr(trace, "entry_ns", 0.0) / 1e9

    # -- the walk ---------------------------------------------------------------------------

    def points(self) -> list:
        """Everything the trace did, as (time_ns, order, kind, payload), in recorded order."""
        t = self.trace
        out = []
        for index, name, start, end in t.ops:
            entered = t.entries.get(index, start)
            out.append((entered, 0, "enter", index))
            k = t.kernels.get(index)
            if k is not None:
                out.append((k.start, 2, "kernel", (index, name, k)))
            out.append((end, 4, "exit", index))
        for start, end in t.hidden_copies:
            out.append((start, 1, "hidden", end))
        for i, move in enumerate(t.moves):  # (in every scenario: a copy's time is not host time)
            mode = t.move_modes[i] if i < len(t.move_modes) else "ordered"
            out.append((move[3], 1, "move", (move, mode)))
        if self.scenario == "recorded":
            for when, block in t.syncs:
                out.append((when, 3, "sync", block))
        elif self.scenario == "cpu_offload":
            for when, nbytes, count in t.module_calls:
                out.append((when, 1, "hook", (nbytes, count)))
        out.sort(key=lambda p: (p[0], p[1]))
        return out

    def run(self) -> None:
        t = self.trace
        blocks = defaultdict(set)
        for index, block, _n, _w in t.accesses:
            blocks[index].add(block)
        last = t.t0
        inside = False
        unit = self.host_scale * self.measured / 1e9
        for when, _order, kind, payload in self.points():
            gap = max(when - last, 0) * unit
            if inside:
                self.ours += gap
                if self.scenario == "recorded":
                    self._host(gap, "torchTensorRef")
            else:
                if kind == "enter" and self.scenario != "recorded":
                    gap = max(gap - self.entry * self.host_scale, 0.0)  # a plain program does not enter a TensorRef
                self.program += gap
                self._host(gap, "program")
            if kind == "enter":
                inside = True
            elif kind == "exit":
                inside = False
            elif kind == "kernel":
                index, name, k = payload
                self._kernel(name, k, blocks.get(index, ()))
                when = max(when, k.end)  # the kernel's own time on this machine is not host time
            elif kind == "move":
                move, mode = payload
                if self.scenario == "recorded":
                    self._move(move, mode)
                if mode != "drop":  # (dropping a clean copy is bookkeeping: host time)
                    when = max(when, move[4])
            elif kind == "hidden":
                when = max(when, payload)  # a deferred simulated copy: a copy engine's time
            elif kind == "sync":
                self._wait_host(self.written.get(payload, 0.0))
            elif kind == "hook":
                nbytes, count = payload
                for _ in range(count):
                    self._copy_in(None, nbytes * self.scale / count, "blocking", self.pinned)
            last = max(last, when)
        self.last = last
        end = t.t_end if t.t_end is not None else last
        tail = max(end - last, 0) * unit
        self.program += tail
        self._host(tail, "program")

    # -- lanes ------------------------------------------------------------------------------

    def _host(self, seconds: float, name: str) -> None:
        if seconds > 0:
            self.events.append(("host", name, self.host, seconds))
            self.host += seconds

    def _wait_host(self, until: float) -> None:
        if until > self.host:
            self.host_wait += until - self.host
            self.host = until

    def _kernel(self, name: str, k, blocks) -> None:
        if not k.launches:
            return
        self._host(LAUNCH_HOST, "launch")
        nbytes = k.nbytes * self.scale
        gpu = self.gpu
        duration = max(k.flops / gpu.peak_flops(k.half or self.as_half), nbytes / gpu.memory_bandwidth, LAUNCH_FLOOR)
        copies = max([self.stream_copy] + [self.ready.pop(b) for b in blocks if b in self.ready])
        ready = max(self.host, self.compute)
        start = max(ready, copies)
        if start > self.compute:  # the device was idle: for the host, then for a copy
            self.stalls["host"] += max(min(self.host, start) - self.compute, 0.0)
            self.stalls["copy"] += start - max(ready, self.compute)
        self.compute = start + duration
        self.events.append(("compute", name, start, duration))
        self.flops += k.flops
        self.kernels += 1
        if k.sync:
            self._wait_host(self.compute)

    def _move(self, move, mode: str) -> None:
        kind, block, nbytes, _start, _end = move
        if mode == "drop" or nbytes == 0:
            return
        if kind == "to_device":
            self._copy_in(block, nbytes * self.scale, mode, mode != "blocking")
        else:
            self._copy_out(block, nbytes * self.scale, mode)

    def _copy_in(self, block, nbytes: float, mode: str, pinned: bool) -> None:
        self._host(COPY_HOST, "copy launch")
        duration = COPY_LATENCY + nbytes / self.gpu.copy_rate(True, pinned)
        earliest = max(self.host, self.written.get(block, 0.0))
        if mode == "async":  # a side stream: only the op that reads the block waits
            start = max(earliest, self.up)
            self.ready[block] = start + duration
        else:  # on the compute stream: after the kernels queued before it, before those after
            start = max(earliest, self.up, self.compute)
            self.stream_copy = start + duration
        self.up = start + duration
        self.events.append(("host-to-device", f"{mode} {_size(nbytes)}", start, duration))
        self.bytes["to_device"] += nbytes
        if mode == "blocking":
            self._wait_host(self.up)

    def _copy_out(self, block, nbytes: float, mode: str) -> None:
        self._host(COPY_HOST, "copy launch")
        duration = COPY_LATENCY + nbytes / self.gpu.copy_rate(False, mode != "blocking")
        start = max(self.host, self.compute, self.down)  # after the kernels that wrote it
        self.down = start + duration
        self.written[block] = self.down
        self.events.append(("device-to-host", f"{mode} {_size(nbytes)}", start, duration))
        self.bytes["to_host"] += nbytes
        if mode == "blocking":
            self._wait_host(self.down)

    # -- result -----------------------------------------------------------------------------

    def prediction(self, steps: int) -> Prediction:
        busy = defaultdict(float)
        for lane, _n, _s, dur in self.events:
            busy[lane] += dur
        total = max(self.host, self.compute, self.up, self.down, self.stream_copy)
        gpu = self.gpu
        compute = busy["compute"] / steps
        bound = max(compute, self.bytes["to_device"] / steps / gpu.copy_rate(True, True),
                    self.bytes["to_host"] / steps / gpu.copy_rate(False, True))
        return Prediction(
            gpu=gpu, scenario=self.scenario, steps=steps, step_seconds=total / steps,
            compute_seconds=compute,
            transfer_seconds=(busy["host-to-device"] + busy["device-to-host"]) / steps,
            host_seconds=busy["host"] / steps,
            host_ours_seconds=(self.ours if self.scenario == "recorded" else 0.0) / steps,
            host_program_seconds=self.program / steps, bound_seconds=bound,
            host_unrecorded_scale=self.measured,
            stalls={k: v / steps for k, v in self.stalls.items()}, host_wait_seconds=self.host_wait / steps,
            flops=self.flops / steps, bytes_to_device=self.bytes["to_device"] / steps,
            bytes_to_host=self.bytes["to_host"] / steps, kernels=self.kernels // steps, events=self.events)


def _size(nbytes: float) -> str:
    from ..core.sizes import format_size

    return format_size(int(nbytes))
