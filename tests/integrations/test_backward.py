"""Backwards refused before they run (Note [Refused before a backward runs] in
integrations/backward.py): the graph stays whole, so the advice of the error can be followed."""

from __future__ import annotations

import warnings

import pytest
import torch

from torchTensorRef import OutOfBudgetError, regions, tensorsManager as tm
from paired import budget, plain_torch, sim_only


@pytest.fixture(autouse=True)
def forced_regions():
    previous = regions.enabled, regions.min_ops, regions.under_budget
    regions.enabled, regions.min_ops, regions.under_budget = True, 0, True
    yield
    regions.enabled, regions.min_ops, regions.under_budget = previous


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
                                 for _ in range(3)])


def loss_of(m, x):
    return m(x).square().mean()


def plain_grads():
    """The gradients of four steps' losses summed, on plain torch on the device."""
    with plain_torch():
        m = model().to(tm.torch_device)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(tm.torch_device)
        for _ in range(4):
            loss_of(m, x).backward()
        return [p.grad.cpu() for p in m.parameters()]


def managed_steps(limit):
    """A managed model that took three steps under ``limit``, and the loss of a fourth forward."""
    m = model()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    tm.budget = limit
    for _ in range(3):
        loss_of(m, x).backward()
    return m, loss_of(m, x)


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_budget_lowered_below_a_region_s_backward_is_refused_before_anything_runs(strategy):
    # the region's backward refused the lower budget after the loss's nodes had run: raising
    # the budget back and calling backward() again gave "Trying to backward through the
    # graph a second time", the advice of the error could not be followed
    tm.strategy = strategy
    weights = 3 * 2 * (32 * 32 + 32) * 4
    m, loss = managed_steps(budget(weights))
    assert tm.stats()["ops"] > 0
    tm.budget = budget(weights // 4)  # (the loss's own nodes fit, its regions' backward do not)
    with pytest.raises(OutOfBudgetError, match="refused before the backward ran") as info:
        loss.backward()
    assert " backward needs " in str(info.value) and str(info.value).startswith("op region ")
    tm.budget = budget(weights)
    loss.backward()
    for p, expected in zip(m.parameters(), plain_grads()):
        torch.testing.assert_close(p.grad.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("refused", ["whole", "in pieces"])
def test_an_op_refused_inside_a_backward_says_the_backward_stopped_midway(refused):
    # an op of the per-op path refused inside a backward advised only to raise the budget,
    # after which the same backward could not run again; so did an op split into pieces that
    # could not be made small enough (its own refusal)
    regions.enabled = False
    tm.strategy = "flow"
    if refused == "whole":  # (a LayerNorm's backward is not split)
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        tm.budget = budget(64 * 1024)
        loss = loss_of(m, x)
        tm.budget = budget(12 * 1024)
        detail = "refused inside a backward"
    else:
        weights = 3 * 2 * (32 * 32 + 32) * 4
        m, loss = managed_steps(budget(weights))
        tm.budget = budget(2 * 1024)
        detail = "cannot be split into smaller pieces; .*; refused inside a backward"
    with pytest.raises(OutOfBudgetError, match=detail) as info:
        loss.backward()
    assert "run the forward and backward again" in str(info.value)


@sim_only  # (where CUDA is available "sim" runs in its lenient form only: no device changes)
@pytest.mark.parametrize("first,then", [("cpu", "sim"), ("sim", "cpu"), ("sim", "lenient")])
def test_a_backward_after_the_device_changed_is_refused_and_runs_once_it_is_back(first, then):
    # a graph recorded on one device ran its backward on another: from "cpu" to "sim" an op
    # midway refused the mix of devices (the graph then half consumed), on CUDA the engine's
    # own assert (opt_ready_stream && opt_parent_stream); now a clear error with nothing run,
    # and the backward works once the device is set back
    tm.device = first
    m, loss = managed_steps(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the device changes with TensorRefs alive)
        if then == "lenient":
            tm.sim_strict = False
        else:
            tm.device = then
        with pytest.raises(RuntimeError, match="backward of a graph recorded on .*nothing has run"):
            loss.backward()
        tm.sim_strict = True
        tm.device = first
    loss.backward()
    for p, expected in zip(m.parameters(), plain_grads()):
        torch.testing.assert_close(p.grad.cpu(), expected, rtol=0, atol=0)


def test_at_exit_the_package_waits_for_what_autograd_s_device_thread_began():
    # (Note [Autograd's device thread at exit]: a backward whose node is still running on the
    # device's thread holds the drain back until it ends)
    import threading

    from torchTensorRef.integrations import backward

    if tm.backend.declared.type == "cpu":
        pytest.skip("no thread of autograd's own: the device's backward runs on the caller's thread")
    started, release, drained = threading.Event(), threading.Event(), threading.Event()

    class Held(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            started.set()
            release.wait(30)
            return g

    w = torch.nn.Parameter(torch.randn(4))
    first = threading.Thread(target=lambda: Held.apply(w).sum().backward(), daemon=True)
    first.start()
    assert started.wait(30), "the first backward did not start"
    drain = threading.Thread(target=lambda: (backward.finish_device_thread(), drained.set()), daemon=True)
    drain.start()
    assert not drained.wait(0.5), "the drain ended while the device's thread was still in the first backward"
    release.set()
    assert drained.wait(30), "the drain did not end once the device's thread was free"
    first.join(30)
    drain.join(30)
    assert torch.equal(w.grad.cpu(), torch.ones(4))
