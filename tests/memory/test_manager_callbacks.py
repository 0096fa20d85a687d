"""Callbacks around every op: observe, veto, hint moves."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import OpVetoedError, tensorsManager as tm
from paired import budget


@pytest.mark.parametrize("device", ["sim", "cpu"])
def test_callbacks_see_every_op_in_order(fresh_manager, device):
    tm.device = device
    events = []
    handle = tm.add_callback(before=lambda op: events.append(("before", op.name)),
                             after=lambda op: events.append(("after", op.name, len(op.outputs))))
    x = torch.ones(4)
    (x * 2).sum()
    handle.remove()
    (x * 3).sum()  # no longer observed
    assert events == [
        ("before", "aten.mul.Tensor"), ("after", "aten.mul.Tensor", 1),
        ("before", "aten.sum.default"), ("after", "aten.sum.default", 1),
    ]
    handle.remove()  # idempotent


def test_a_before_callback_can_veto_an_op_and_nothing_changes(fresh_manager):
    x = torch.ones(4)
    ops_before = tm.stats()["ops"]
    handle = tm.add_callback(before=lambda op: op.name != "aten.mul_.Tensor")
    try:
        with pytest.raises(OpVetoedError, match="aten.mul_.Tensor"):
            x.mul_(5)
    finally:
        handle.remove()
    assert tm.stats()["ops"] == ops_before
    with torchTensorRef.disabled():
        assert torch.equal(x.clone().toCPU().target, torch.ones(4))


def test_a_callback_can_hint_moves(fresh_manager):
    w = torch.ones(256)
    tm.budget = budget(4096)
    handle = tm.add_callback(after=lambda op: tm.move_to_device(w))
    try:
        (torch.zeros(4) + 1).sum()
    finally:
        handle.remove()
    assert w.proxyInfo.on_device


def test_add_callback_rejects_bad_input(fresh_manager):
    with pytest.raises(ValueError, match="before and/or an after"):
        tm.add_callback()
    with pytest.raises(ValueError, match="must be callable"):
        tm.add_callback(before=3)
