"""A pytest plugin: on CUDA, what the device held beyond the manager's count when it went over the budget.

    TORCHTENSORREF_TEST_DEVICE=cuda TORCHTENSORREF_CHECK_DEVICE=1 PYTHONPATH=. \\
        python -m pytest -p benchmarks.overshoot_plugin TESTS

Under ``torch.cuda.memory._record_memory_history``, at the first op of each test whose end
finds ``memory_allocated`` above the budget, it lists the live allocations that hold none of
the manager's resident blocks, with the frames that made them: what its count of the device
missed (a plain tensor torch made on the device, a kernel's buffer kept past its call).
Lines start with ``overshoot:``; pytest shows them with a failing test's output, and with
``TORCHTENSORREF_OVERSHOOT_LOG`` set they are appended to that file too. Without CUDA it
does nothing.
"""

from __future__ import annotations

import bisect
import os
from typing import Iterable, List

import torch

from benchmarks.cuda_peak import SHOWN, where
from torchTensorRef.memory import op_protocol

#: frames shown: the package's, the benchmarks' and the tests'
FRAMES = SHOWN + ("tests",)
_finish = op_protocol.OpProtocol.finish
_reported: set = set()


def unmanaged(segments: Iterable[dict], managed: Iterable[int]) -> List[dict]:
    """The live blocks of a ``torch.cuda.memory._snapshot()``'s ``segments`` whose address
    range holds none of the ``managed`` pointers (a group's members are views into one
    allocation), in address order."""
    pointers = sorted(managed)
    out = []
    for segment in segments:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            start = block["address"]
            i = bisect.bisect_left(pointers, start)
            if i == len(pointers) or pointers[i] >= start + block["size"]:
                out.append(block)
    return sorted(out, key=lambda b: b["address"])


def _report(protocol, ctx, over: int) -> None:
    m = protocol.m
    managed = [b.dev.data_ptr() for b in m.books.resident.values() if b.dev is not None]
    missed = unmanaged(torch.cuda.memory._snapshot()["segments"], managed)
    lines = [f"overshoot: {over} bytes over the budget after {ctx.name} in "
             f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}; {len(missed)} allocations hold no resident block:"]
    lines += [f"overshoot:   {b['size']:>10} bytes (asked {b.get('requested_size')}) {where(b, 5, FRAMES)}"
              for b in missed]
    print("\n".join(lines), flush=True)
    log = os.environ.get("TORCHTENSORREF_OVERSHOOT_LOG")
    if log:
        with open(log, "a") as f:
            f.write("\n".join(lines) + "\n")


def _finish_and_look(protocol, ctx) -> None:
    _finish(protocol, ctx)
    acct = protocol.m.accounting
    if acct.limit is None or protocol.m.backend.name != "cuda":
        return
    over = protocol.m.backend.in_use_elsewhere(0) - acct.limit
    test = os.environ.get("PYTEST_CURRENT_TEST")
    if over > 0 and test not in _reported:
        _reported.add(test)
        _report(protocol, ctx, over)


def pytest_configure(config) -> None:
    if torch.cuda.is_available():
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        op_protocol.OpProtocol.finish = _finish_and_look


def pytest_unconfigure(config) -> None:
    op_protocol.OpProtocol.finish = _finish
