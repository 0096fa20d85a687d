"""The offline reference: what an all-knowing pager would move for a recorded trace.

Given the accesses of a recorded step (``Trace.accesses``) and a budget, simulate Belady's
rule with write-back costs: before each op its blocks must be resident; when room is
needed, evict the block whose next use is farthest in the future, knowing the whole trace.
Evicting a clean block, or one never used again, is free; a dirty one is written back.
Flow is measured against this on the same trace. With blocks of different sizes this is
close to, not provably, the least traffic: a pager can beat it by a little.

Below host memory (the disk tier), the reference for disk traffic is the same rule on one
memory as large as the device and host budgets together (``reference_disk_moves``): a pager
with two levels of that total size cannot read less from disk than an all-knowing one with
a single level that size.

The trace is one step of a loop, so blocks that existed before it (weights, optimizer
state) are used again in the next step: their next use after their last access is their
first access plus the trace's length. Blocks the step created are dead after their last
access.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Callable, Dict, Iterable, Optional, Tuple

from ..core.errors import OutOfBudgetError

INF = float("inf")


def reference_moves(
    accesses: Iterable[Tuple[int, int, int, bool]],
    budget: int,
    initial: Optional[Dict[int, Tuple[int, bool]]] = None,
    created: Iterable[int] = (),
    block_bytes: Optional[Callable[[int], int]] = None,
) -> dict:
    """Bytes the offline reference moves for ``accesses`` under ``budget``.

    Args:
        accesses: ``(op_index, block_id, nbytes, write)`` in execution order.
        budget: accelerator bytes.
        initial: blocks resident when the trace starts, ``{block_id: (nbytes, dirty)}``.
        created: blocks created by the trace's ops (they need no copy in).
        block_bytes: the device bytes a block of ``nbytes`` takes, as the budget counts it
            (``Trace.block_bytes``: CUDA's allocator rounds sizes up, and so does "sim" with
            ``sim_rounding``); by default ``nbytes``. Moves are counted in ``nbytes``.

    Returns:
        ``{"bytes_to_device", "bytes_to_host", "peak_device_bytes", "ops"}``.
    """
    ops: Dict[int, Dict[int, Tuple[int, bool]]] = {}
    order = []
    for op, block, nbytes, write in accesses:
        if op not in ops:
            ops[op] = {}
            order.append(op)
        prev = ops[op].get(block)
        ops[op][block] = (nbytes, write or (prev is not None and prev[1]))
    created = set(created)
    length = len(order)
    uses = defaultdict(list)  # block -> positions (0..length-1) of ops using it
    for pos, op in enumerate(order):
        for block in ops[op]:
            uses[block].append(pos)
    cursor = defaultdict(int)

    def next_use(block, pos):
        lst = uses.get(block)
        if not lst:
            return INF
        i = cursor[block]
        while i < len(lst) and lst[i] <= pos:
            i += 1
        cursor[block] = i
        if i < len(lst):
            return lst[i]
        return INF if block in created else lst[0] + length  # the next step uses it again

    size = block_bytes or (lambda n: n)
    resident: Dict[int, Tuple[int, bool]] = dict(initial or {})
    used = sum(size(n) for n, _d in resident.values())
    heap = []  # (-next_use, clean_first, block)
    current = {}

    def push(block, pos):
        nu = next_use(block, pos)
        current[block] = nu
        heapq.heappush(heap, (-nu, resident[block][1], block))

    for block in resident:
        push(block, -1)
    to_device = to_host = 0
    peak = used
    seen = set(resident)
    for pos, op in enumerate(order):
        needed = ops[op]
        need = sum(size(n) for b, (n, _w) in needed.items() if b not in resident)
        total = sum(size(n) for n, _w in needed.values())
        if total > budget:
            raise OutOfBudgetError(f"op #{op}", total, budget)
        skipped = []
        while used + need > budget:
            nu_neg, _dirty, victim = heapq.heappop(heap)
            if victim not in resident or current.get(victim) != -nu_neg:
                continue
            if victim in needed:
                skipped.append((nu_neg, _dirty, victim))
                continue
            nbytes, dirty = resident.pop(victim)
            used -= size(nbytes)
            if dirty and -nu_neg != INF:
                to_host += nbytes
        for entry in skipped:
            heapq.heappush(heap, entry)
        for block, (nbytes, write) in needed.items():
            if block not in resident:
                if not (block in created and block not in seen):
                    to_device += nbytes
                resident[block] = (nbytes, False)
                used += size(nbytes)
            seen.add(block)
            if write:
                resident[block] = (nbytes, True)
        peak = max(peak, used)
        for block in needed:
            push(block, pos)
    return {"bytes_to_device": to_device, "bytes_to_host": to_host, "peak_device_bytes": peak, "ops": length}


def reference_disk_moves(trace, budget: int, host_budget: int) -> dict:
    """Bytes an all-knowing pager reads from and writes to disk for ``trace`` (a recorded
    step) with ``budget`` device bytes and ``host_budget`` host bytes: ``{"bytes_from_disk",
    "bytes_to_disk"}``, a lower bound for any pager of those two levels."""
    initial = dict(trace.initial_host)
    initial.update(trace.initial)
    moves = reference_moves(trace.accesses, budget + host_budget, initial, trace.created)
    return {"bytes_from_disk": moves["bytes_to_device"], "bytes_to_disk": moves["bytes_to_host"]}
