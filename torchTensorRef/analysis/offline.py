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
from typing import Callable, Dict, Hashable, Iterable, Optional, Set, Tuple

from ..core.errors import OutOfBudgetError

INF = float("inf")


def reference_moves(
    accesses: Iterable[Tuple[int, Hashable, int, bool]],
    budget: int,
    initial: Optional[Dict[Hashable, Tuple[int, bool]]] = None,
    created: Iterable[Hashable] = (),
    block_bytes: Optional[Callable[[int], int]] = None,
    groups: Optional[Dict[Hashable, Hashable]] = None,
    ahead: int = 0,
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
        groups: ``{block_id: group}`` (``Trace.groups``): the reference at group granularity.
            A group's blocks come in and leave together, as one unit taking their rooms
            together, brought in where any of them is needed; a write-back still writes
            only the blocks written, as the manager's does (Note [Region groups]). A block
            not in it is a unit of its own.
        ahead: the reference for a pager whose copies overlap compute: the blocks of the
            next ``ahead`` ops that exist already are resident while an op runs too (where
            they fit beside its own), as a copy issued that many ops before its use needs
            their room then. By default the blocks of each op alone.

    Returns:
        ``{"bytes_to_device", "bytes_to_host", "peak_device_bytes", "ops"}``.
    """
    size = block_bytes or (lambda n: n)
    unit_of = (groups or {}).get
    members: Dict[Hashable, Dict[Hashable, int]] = defaultdict(dict)  # unit -> {block: nbytes}
    ops: Dict[int, Dict[Hashable, Set[Hashable]]] = {}  # op -> {unit: blocks written}
    order = []
    for op, block, nbytes, write in accesses:
        if op not in ops:
            ops[op] = {}
            order.append(op)
        unit = unit_of(block, block)
        members[unit][block] = nbytes
        written = ops[op].setdefault(unit, set())
        if write:
            written.add(block)
    for block, (nbytes, _dirty) in (initial or {}).items():
        members[unit_of(block, block)].setdefault(block, nbytes)
    created = set(created)
    unit_room = {u: sum(size(n) for n in m.values()) for u, m in members.items()}
    dead_after = {u for u, m in members.items() if created.issuperset(m)}  # (made by the step)
    length = len(order)
    uses = defaultdict(list)  # unit -> positions (0..length-1) of ops using it
    for pos, op in enumerate(order):
        for unit in ops[op]:
            uses[unit].append(pos)
    cursor: Dict[Hashable, int] = defaultdict(int)

    def next_use(unit, pos):
        lst = uses.get(unit)
        if not lst:
            return INF
        i = cursor[unit]
        while i < len(lst) and lst[i] <= pos:
            i += 1
        cursor[unit] = i
        if i < len(lst):
            return lst[i]
        return INF if unit in dead_after else lst[0] + length  # the next step uses it again

    # unit -> its blocks whose device copy is newer than the host's
    resident: Dict[Hashable, Set[Hashable]] = {}
    for block, (_nbytes, dirty) in (initial or {}).items():
        dirty_blocks = resident.setdefault(unit_of(block, block), set())
        if dirty:
            dirty_blocks.add(block)
    used = sum(unit_room[u] for u in resident)
    heap = []  # (-next_use, clean first, unit)
    current = {}

    def push(unit, pos):
        nu = next_use(unit, pos)
        current[unit] = nu
        heapq.heappush(heap, (-nu, bool(resident[unit]), unit))

    for unit in resident:
        push(unit, -1)
    to_device = to_host = 0
    peak = used
    seen = {b for u in resident for b in members[u]}
    for pos, op in enumerate(order):
        needed = ops[op]
        total = sum(unit_room[u] for u in needed)
        if total > budget:
            raise OutOfBudgetError(f"op #{op}", total, budget)
        if ahead:
            needed = _with_next(needed, total, budget, [ops[o] for o in order[pos + 1:pos + 1 + ahead]],
                                unit_room, members, created, seen)
        need = sum(unit_room[u] for u in needed if u not in resident)
        skipped = []
        while used + need > budget:
            entry = nu_neg, _dirty, victim = heapq.heappop(heap)
            if victim not in resident or current.get(victim) != -nu_neg:
                continue
            if victim in needed:
                skipped.append(entry)
                continue
            dirty = resident.pop(victim)
            used -= unit_room[victim]
            if -nu_neg != INF:
                to_host += sum(members[victim][b] for b in dirty)
        for entry in skipped:
            heapq.heappush(heap, entry)
        for unit, written in needed.items():
            if unit not in resident:
                to_device += sum(n for b, n in members[unit].items() if not (b in created and b not in seen))
                resident[unit] = set()
                used += unit_room[unit]
            seen.update(members[unit])
            resident[unit] |= written
        peak = max(peak, used)
        for unit in needed:
            push(unit, pos)
    return {"bytes_to_device": to_device, "bytes_to_host": to_host, "peak_device_bytes": peak, "ops": length}


def _with_next(needed: dict, total: int, budget: int, later: list, unit_room: dict, members: dict,
               created: set, seen: set) -> dict:
    """``needed`` (an op's units: blocks written) with the units of the ``later`` ops that
    exist already (none of them written by this op), where they fit in ``budget`` beside it."""
    out = dict(needed)
    for units in later:
        for u in units:
            if u not in out and any(b in seen or b not in created for b in members[u]):
                total += unit_room[u]
                out[u] = set()
    return out if total <= budget else needed


def reference_disk_moves(trace, budget: int, host_budget: int) -> dict:
    """Bytes an all-knowing pager reads from and writes to disk for ``trace`` (a recorded
    step) with ``budget`` device bytes and ``host_budget`` host bytes: ``{"bytes_from_disk",
    "bytes_to_disk"}``, a lower bound for any pager of those two levels."""
    initial = dict(trace.initial_host)
    initial.update(trace.initial)
    moves = reference_moves(trace.accesses, budget + host_budget, initial, trace.created)
    return {"bytes_from_disk": moves["bytes_to_device"], "bytes_to_disk": moves["bytes_to_host"]}
