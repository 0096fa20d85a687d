"""``python -m torchTensorRef predict``: run a script on ``"sim"``, record its steady state, predict it on a GPU.

A step ends when the first module the script calls (its model) returns from a forward
(``--step-on forward``: one step per generated token, or per training iteration), or
after each ``optimizer.step()`` (``--step-on optimizer``). ``--steps A:B`` records steps A
to B-1 (the first is warm-up: allocations, pinning); as many steps after them run
unrecorded and timed, and our host time is taken from them (recording turns the fast
path off). The prediction is printed beside
the same steps predicted all-resident and, for inference, with accelerate's
``cpu_offload`` hooks (see ``docs/timeline.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import List, Optional, Tuple

import torch

from . import strategies
from .analysis import gpus, timeline
from .core.sizes import format_size
from .integrations.plain import disabled
from .memory.manager import tensorsManager


def proxy_entry_ns(trials: int = 300) -> float:
    """Host time per op that calling an op on a TensorRef adds before our code runs, in ns.

    The trace counts it as the program's (it comes before an op enters the manager); a
    plain program does not pay it. Measured here on the current device: the time between
    ops of a loop of ``neg`` on a TensorRef, against the same loop on a plain tensor less its
    kernel. ``predict(..., scenario="resident")`` subtracts it per op (``trace.entry_ns``).
    """
    def loop(x):
        start = time.perf_counter_ns()
        for _ in range(trials):
            torch.neg(x)
        return time.perf_counter_ns() - start

    with disabled():
        plain = torch.ones(8)
        loop(plain)
        plain_ns = loop(plain) / trials
    ref = torch.ones(8)
    loop(ref)
    with tensorsManager.recording() as trace:
        total = loop(ref)
    inside = sum(end - trace.entries.get(index, start) for index, _n, start, end in trace.ops)
    kernel = sum(k.end - k.start for k in trace.kernels.values()) / max(len(trace.kernels), 1)
    gap = (total - inside) / max(len(trace.ops), 1)
    return max(gap - max(plain_ns - kernel, 0.0), 0.0)


def parse_steps(text: str) -> Tuple[int, int]:
    """``"A:B"`` (steps A to B-1) or ``"N"`` (steps 1 to N: the first one is warm-up)."""
    try:
        if ":" in text:
            a, b = text.split(":")
            first, end = int(a), int(b)
        else:
            first, end = 1, 1 + int(text)
    except ValueError:
        first = end = -1
    if first < 0 or end <= first:
        raise ValueError(f'--steps must be "A:B" with 0 <= A < B, or a number of steps N >= 1 (got: {text!r})')
    return first, end


class StepRecorder:
    """Counts the script's steps and records the ones asked for, from torch's global hooks.

    ``timed=(C, D)``: steps C to D-1 are timed unrecorded, and again ``repeats - 1`` times
    ``every`` steps later (the same steps of the next ``generate()`` call, say); none may
    overlap the recorded ones. The trace gets the fastest complete repeat
    (``trace.set_unrecorded``), from which ``timeline.predict`` takes the host time; with no
    complete repeat (the script stopped before D), the steps of the first it completed.
    """

    def __init__(self, first: int, end: int, step_on: str = "forward", progress=None,
                 timed: Optional[Tuple[int, int]] = None, repeats: int = 1, every: int = 0):
        self.runs: List[Tuple[int, int]] = []  # the timed ranges
        if timed is not None:
            c, d = timed
            if repeats > 1 and every < d - c:
                raise ValueError(f"timed repeats must be at least {d - c} steps apart (got: every={every})")
            self.runs = [(c + k * every, d + k * every) for k in range(repeats)]
            for c, d in self.runs:
                if not (0 <= c < d and (d <= first or c >= end)):
                    raise ValueError(f"timed steps {c}:{d} must be a range apart from the recorded {first}:{end}")
        self.first, self.end, self.step_on = first, end, step_on
        #: per timed range, perf_counter_ns at its start and at the end of each step timed
        self.timed_at: List[List[int]] = [[] for _ in self.runs]
        self.progress = progress
        self.done = 0
        self.trace = None
        self._stack = contextlib.ExitStack()
        self._top = None
        self._depth = 0
        self._handles = []
        self._started = time.perf_counter()

    def __enter__(self):
        nn = torch.nn.modules.module
        self._handles = [nn.register_module_forward_pre_hook(self._pre), nn.register_module_forward_hook(self._post)]
        if self.step_on == "optimizer":
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handles.append(register_optimizer_step_post_hook(self._optimizer_step))
        if self.first == 0:
            self._start()
        self._time_steps()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._stack.close()
        best = self.unrecorded()
        if self.trace is not None and best is not None:
            self.trace.set_unrecorded(*best)

    def unrecorded(self) -> Optional[Tuple[int, int]]:
        """(steps, wall ns) of the fastest complete timed range, else of the first partial one."""
        done = [(len(at) - 1, at[-1] - at[0]) for at in self.timed_at if len(at) > 1]
        whole = [run for run, (c, d) in zip(done, self.runs) if run[0] == d - c]
        if whole:
            return min(whole, key=lambda run: run[1])
        return done[0] if done else None

    @property
    def timed_steps(self) -> int:
        """How many unrecorded steps the timing comes from."""
        best = self.unrecorded()
        return best[0] if best else 0

    def _time_steps(self) -> None:
        # (called after the recording stopped at this step: its end is not timed)
        for (c, d), at in zip(self.runs, self.timed_at):
            if c <= self.done <= d:
                at.append(time.perf_counter_ns())

    # -- hooks ------------------------------------------------------------------------------

    def _pre(self, module, _args):
        if self._depth == 0 and self._top is None:
            self._top = module
        self._depth += 1
        trace = tensorsManager.trace
        if trace is not None and trace is self.trace:
            params = list(module.parameters(recurse=False))
            if params:  # what an offloading hook copies in before this forward
                trace.module_calls.append((time.perf_counter_ns(), sum(p.numel() * p.element_size() for p in params),
                                           len(params)))

    def _post(self, module, _args, _out):
        self._depth = max(self._depth - 1, 0)
        if self.step_on == "forward" and self._depth == 0 and module is self._top:
            self._step()

    def _optimizer_step(self, _optimizer, _args, _kwargs):
        self._step()

    # -- steps ------------------------------------------------------------------------------

    def _step(self) -> None:
        self.done += 1
        if self.trace is not None and self.first < self.done <= self.end:
            self.trace.mark()
        if self.done == self.first:
            self._start()
        elif self.done == self.end:
            self._stack.close()
        self._time_steps()
        timed = ""
        if self.runs:
            timed = (f", {sum(max(len(at) - 1, 0) for at in self.timed_at)}/"
                     f"{sum(d - c for c, d in self.runs)} timed unrecorded")
        recorded = max(min(self.done, self.end) - self.first, 0)
        print(f"predict: step {self.done} done, {recorded}/{self.end - self.first} recorded{timed} "
              f"({time.perf_counter() - self._started:.1f} s)", file=self.progress or sys.stderr, flush=True)

    def _start(self) -> None:
        self.trace = self._stack.enter_context(tensorsManager.recording())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(gpus.names())
    parser.add_argument("--gpu", metavar="NAME", default="h100-pcie",
                        help=f"one of: {names}; or a JSON file of numbers (see docs/timeline.md); "
                             f"default: h100-pcie")
    parser.add_argument("--strategy", metavar="S", default=None, help=f"one of: {', '.join(strategies.NAMES)}")
    parser.add_argument("--budget", metavar="B", default=None,
                        help='accelerator bytes: an int or a size such as "512MiB"; default: no budget')
    parser.add_argument("--steps", metavar="A:B", default="1:3",
                        help="steps to record: A to B-1, or N for steps 1 to N (default: 1:3)")
    parser.add_argument("--step-on", choices=("forward", "optimizer"), default="forward",
                        help="a step ends when the model's forward returns (default), or after optimizer.step()")
    parser.add_argument("--half", action="store_true",
                        help="the script runs in fp32 for a bf16/fp16 program: predict with 16-bit bytes and peak")
    parser.add_argument("--host-scale", metavar="X", type=float, default=1.0,
                        help="multiply the measured host time by X (0.5: a host twice as fast as this one; "
                             "0: none of it, the schedule of kernels and copies alone)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the predictions as JSON")
    parser.add_argument("--chrome", metavar="PATH", default=None, help="write the predicted timeline as a Chrome trace")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def load_gpu(text: str):
    """A name of the table, or the path of a JSON file holding a dict of numbers."""
    if text.endswith(".json") and os.path.isfile(text):
        with open(text) as f:
            return gpus.resolve(json.load(f))
    return gpus.resolve(text)


def is_training(trace) -> bool:
    return any("backward" in name for _i, name, _s, _e in trace.ops)


def predictions(trace, gpu, steps: int, as_half: bool = False, host_scale: float = 1.0) -> dict:
    """The recorded run, all-resident and (inference) accelerate's cpu_offload, by label."""
    scenarios = {"torchTensorRef": "recorded", "all-resident": "resident"}
    if not is_training(trace):
        scenarios["accelerate cpu_offload"] = "cpu_offload"
    return {label: timeline.predict(trace, gpu, scenario=scenario, steps=steps, as_half=as_half,
                                    host_scale=host_scale)
            for label, scenario in scenarios.items()}


def table(results: dict) -> str:
    ms = 1e3
    lines = [f"{'':24s}{'step ms':>10s}{'compute':>10s}{'transfer':>10s}{'host':>10s}{'bound':>10s}"
             f"{'stall copy':>12s}{'stall host':>12s}"]
    for label, p in results.items():
        lines.append(f"{label:24s}{p.step_seconds * ms:10.3f}{p.compute_seconds * ms:10.3f}"
                     f"{p.transfer_seconds * ms:10.3f}{p.host_seconds * ms:10.3f}{p.bound_seconds * ms:10.3f}"
                     f"{p.stalls['copy'] * ms:12.3f}{p.stalls['host'] * ms:12.3f}")
    return "\n".join(lines)


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .running import run_script

    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r} is not a file")
    try:
        first, end = parse_steps(args.steps)
    except ValueError as e:
        parser.error(str(e))
    try:
        gpu = load_gpu(args.gpu)
    except (ValueError, TypeError) as e:
        parser.error(f"--gpu: {e}")
    if not args.host_scale >= 0:
        parser.error(f"--host-scale must be a number >= 0 (got: {args.host_scale})")
    tensorsManager.device = "sim"
    for name in ("strategy", "budget"):
        value = getattr(args, name)
        if value is not None:
            try:
                setattr(tensorsManager, name, value)
            except ValueError as e:
                parser.error(f"--{name}: {e}")
    entry = proxy_entry_ns()  # what a plain program would not pay per op
    # The steps after the recorded ones, as many, run unrecorded: our host time comes from them.
    with StepRecorder(first, end, args.step_on, timed=(end, 2 * end - first)) as recorder:
        code = run_script(args.script, args.args)
    trace = recorder.trace
    if trace is not None:
        trace.entry_ns = entry
    recorded = len(trace.marks) if trace is not None else 0
    if code != 0:
        return code
    if recorded == 0:
        print(f"predict: the script ran {recorder.done} step(s) (--step-on {args.step_on}); --steps "
              f"{args.steps} needs at least {first + 1}", file=sys.stderr)
        return 1
    if recorder.timed_steps == 0:
        print("predict: no step ran after the recorded ones: our host time is the recording's "
              "(the generic path, pessimistic; see docs/timeline.md)", file=sys.stderr)
    results = predictions(trace, gpu, recorded, args.half, args.host_scale)
    budget = tensorsManager.budget
    sys.stdout.flush()
    work = "training" if is_training(trace) else "inference"
    print(f"\npredicted on {gpu.name} ({gpu.link or 'link as given'}), {work}, {recorded} step(s) recorded on sim, "
          f"strategy {tensorsManager.strategy.name}, budget {format_size(budget) if budget is not None else 'none'}"
          f"{', as 16-bit' if args.half else ''}"
          f"{f', host time x {args.host_scale:g}' if args.host_scale != 1 else ''}:")
    ours = results["torchTensorRef"]
    if trace.unrecorded is not None:
        print(f"host time from {trace.unrecorded[0]} unrecorded step(s): x {ours.host_unrecorded_scale:.3f} "
              f"of the recording's")
    print(table(results))
    print(f"busiest lane: {', '.join(f'{label}: {p.bottleneck}' for label, p in results.items())}")
    print("(predicted by a model of the run, not measured: see docs/timeline.md)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({label: p.summary() for label, p in results.items()}, f, indent=1)
    if args.chrome:
        results["torchTensorRef"].save(args.chrome)
    return 0
