"""Room within the budget beside what the device holds outside the manager (``memory/room.py``)."""

from __future__ import annotations

import gc

import pytest
import torch

import torchTensorRef
from torchTensorRef import OutOfBudgetError, tensorsManager
from torchTensorRef.memory import room
from torchTensorRef.memory.accounting import READ_EVERY

from paired import assert_identical, budget, plain_torch

KiB = 1024


@pytest.fixture
def no_automatic_collection():
    """Python's cycle collector runs only where asked, so a cycle lives until the manager
    collects it; Flow, which keeps what fits resident, so that an op must make room. These
    programs hold device bytes beyond the budget on purpose, until the manager reads the
    device (a program's plain tensors are read only then): no check of the device after
    each op (``check_device``, which CI turns on)."""
    tm = tensorsManager
    previous = tm.check_device
    tm.strategy, tm.check_device = "flow", False
    gc.collect()
    gc.disable()
    yield
    gc.enable()
    tm.budget, tm.check_device = None, previous


def _garbage(nbytes):
    """A plain device tensor of ``nbytes`` that only a reference cycle holds."""
    with torchTensorRef.disabled():
        cycle = [torch.empty(nbytes, dtype=torch.uint8, device=tensorsManager.torch_device)]
    cycle.append(cycle)


def _program():
    a = torch.arange(1024, dtype=torch.float32)  # 4 KiB, kept resident while it fits
    b = torch.arange(2048, dtype=torch.float32).cumsum(0)  # 8 KiB beside its 8 KiB source, whole
    return a + 1, b


def test_device_tensors_only_cycles_hold_are_collected_before_an_op_is_refused(no_automatic_collection):
    # A cycle's device tensor stays allocated until the collector runs, and the device
    # counts it: the manager read it as outside bytes and refused an op that fits.
    tm = tensorsManager
    with plain_torch():
        expected = _program()
    tm.budget = budget(16 * KiB)
    tm.reset_stats()
    _garbage(12 * KiB)
    out = _program()
    assert_identical(out, expected)
    assert tm.stats()["garbage_collections"] >= 1
    assert tm.stats()["peak_device_bytes"] <= 16 * KiB


def test_what_live_tensors_hold_is_still_refused_and_a_useless_collection_waits(no_automatic_collection):
    tm = tensorsManager
    tm.budget = budget(16 * KiB)
    tm.reset_stats()
    with torchTensorRef.disabled():
        held = torch.empty(12 * KiB, dtype=torch.uint8, device=tm.torch_device)  # live: not garbage
    with pytest.raises(OutOfBudgetError, match="outside the manager"):
        _program()
    assert tm.stats()["garbage_collections"] == 1
    # the collection freed nothing: the next refusals within COLLECT_BACKOFF checks collect none
    with pytest.raises(OutOfBudgetError):
        _program()
    assert tm.stats()["garbage_collections"] == 1
    assert tm.device_room.backoff == room.COLLECT_BACKOFF
    del held


def test_a_budget_over_what_only_cycles_hold_outside_is_accepted(no_automatic_collection):
    # A program drops its plain copy of a model and sets a budget below it: the copy, in a
    # cycle, still counted as outside the manager and the budget was refused as below it.
    tm = tensorsManager
    floor = tm.outside_bytes()
    _garbage(64 * KiB)
    tm.budget = floor + 16 * KiB
    assert tm.budget == floor + 16 * KiB
    assert tm.outside_bytes() == floor


def test_the_device_is_read_at_the_same_ops_of_a_program_whatever_ran_before():
    # The device is read every so many checks even where the count fits; counted from the
    # budget set, a program under a budget reads it, and so decides, at the same ops
    # whatever the process ran before (the serving tests' Flow periods depended on it).
    tm = tensorsManager

    def readings(earlier_ops: int) -> int:
        tm.budget = None
        x = torch.ones(16)
        for _ in range(earlier_ops):
            x = x + 1
        tm.budget = budget(64 * KiB)
        before = tm.accounting.readings
        y = torch.ones(16)
        for _ in range(3 * READ_EVERY // 2):
            y = y * 1
        return tm.accounting.readings - before

    assert [readings(n) for n in (0, READ_EVERY // 2, 1)] == [readings(0)] * 3
