"""Flow's prefetches: evicting for the next op where a trial of the plan finds it costs few
bytes (Note [Evicting for the next op] in ``strategies/flow_prefetch.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchTensorRef import regions, tensorsManager as tm
from torchTensorRef.strategies import Flow, flow_prefetch
from torchTensorRef.strategies.flow_plan import loop_key
from torchTensorRef.strategies.flow_prefetch import EVICTING_BYTES, MEASURED, Trial
from paired import assert_identical, budget, plain_torch, to_plain

WIDTH = 64
LAYERS = 8


def _stack(layers=LAYERS):
    """Residual MLP blocks (seeded) of 129 KiB each, run in a cycle."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
        for _ in range(layers)])


def _forward(model, x, update=False):
    for layer in model:
        x = x + layer(x)
    if update:  # as an optimizer step does: every weight written, so every block is dirty
        for p in model.parameters():
            p.mul_(0.999)
    return x


def _steady(strategy, fraction, as_regions=False, layers=LAYERS, calls=40, measured=10, attached=None,
            update=False):
    """``measured`` forwards after ``calls``, under ``strategy`` at ``fraction`` of the weights
    of ``layers`` layers (``attached(strategy)`` once it is the manager's), each forward
    followed by an update of every weight where ``update``: (outputs, stats of the measured
    forwards)."""
    tm.strategy = strategy
    if attached is not None:
        attached(strategy)
    model = _stack(layers)
    x = torch.rand(1, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu").to(tm.torch_device)
    previous = regions.enabled, regions.under_budget
    if as_regions:
        regions.enabled = regions.under_budget = True
        for layer in model:
            regions.region(layer)
    tm.budget = budget(int(fraction * sum(p.numel() * 4 for p in model.parameters())))
    try:
        with torch.no_grad():
            for _ in range(calls):
                _forward(model, x, update)
            tm.reset_stats()
            out = [to_plain(_forward(model, x, update)) for _ in range(measured)]
        return out, tm.stats()
    finally:
        tm.budget = None
        regions.enabled, regions.under_budget = previous


def _plain(layers=LAYERS, calls=0, measured=1, update=False):
    """Plain torch's outputs of the ``measured`` forwards after ``calls`` (as ``_steady``)."""
    with plain_torch():
        model = _stack(layers)
        x = torch.rand(1, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu").to(tm.torch_device)
        with torch.no_grad():
            for _ in range(calls):
                _forward(model, x, update)
            return [to_plain(_forward(model, x, update)) for _ in range(measured)]


@pytest.fixture
def by_bytes(monkeypatch):
    """The trial decides by bytes on every device (on CUDA it decides by time, which these
    tests cannot fix in advance)."""
    begin = Trial.begin
    monkeypatch.setattr(Trial, "begin", lambda self, plan, limit, timed=False: begin(self, plan, limit, False))


@pytest.mark.parametrize("as_regions", [False, True], ids=["per op", "regions"])
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_flow_evicts_for_the_next_op_where_it_moves_no_more_bytes(fresh_manager, by_bytes, fraction, as_regions):
    expected = _plain()[0]
    free_only, free_stats = _steady(Flow(prefetch_evicts=False), fraction, as_regions)
    flow = Flow()
    auto, auto_stats = _steady(flow, fraction, as_regions)
    for out in free_only + auto:
        assert_identical(out, expected)
    trial = flow.prefetching.trial
    assert trial.chosen == {trial.key: True}  # (kept after its trial)
    assert free_stats["bytes_prefetched_ahead"] < 0.1 * free_stats["bytes_to_device"]  # (the device is full)
    assert auto_stats["bytes_prefetched_ahead"] >= 0.95 * auto_stats["bytes_to_device"] > 0
    assert auto_stats["bytes_to_device"] <= EVICTING_BYTES * free_stats["bytes_to_device"]


@pytest.mark.parametrize("as_regions", [False, True], ids=["per op", "regions"])
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_flow_evicts_dirty_blocks_for_the_next_op_too(fresh_manager, by_bytes, fraction, as_regions):
    # Training writes every weight each step: only clean blocks made room for a prefetch,
    # so the next op's blocks were fetched when it needed them (about half the bytes).
    expected = _plain(calls=40, measured=10, update=True)
    free_only, free_stats = _steady(Flow(prefetch_evicts=False), fraction, as_regions, update=True)
    flow = Flow()
    auto, auto_stats = _steady(flow, fraction, as_regions, update=True)
    assert_identical(free_only, expected)
    assert_identical(auto, expected)
    trial = flow.prefetching.trial
    assert trial.chosen == {trial.key: True}
    assert auto_stats["bytes_prefetched_ahead"] >= 0.95 * auto_stats["bytes_to_device"] > 0
    assert auto_stats["bytes_to_device"] <= EVICTING_BYTES * free_stats["bytes_to_device"]


def test_flow_prefetches_into_free_memory_only_where_evicting_costs_more_bytes(fresh_manager, by_bytes, monkeypatch):
    """Evicting for the next op moves about the bytes here (the trial above): with a limit the
    evicting way cannot meet, Flow goes back to filling free memory only."""
    monkeypatch.setattr(flow_prefetch, "EVICTING_BYTES", 0.5)
    expected = _plain()[0]
    free_only, free_stats = _steady(Flow(prefetch_evicts=False), 0.5, as_regions=True)
    flow = Flow()
    auto, auto_stats = _steady(flow, 0.5, as_regions=True)
    for out in free_only + auto:
        assert_identical(out, expected)
    trial = flow.prefetching.trial
    assert trial.chosen == {trial.key: False}
    assert auto_stats["bytes_to_device"] == free_stats["bytes_to_device"]
    assert auto_stats["bytes_prefetched_ahead"] == free_stats["bytes_prefetched_ahead"]


def _plan(funcs, base=0):
    return SimpleNamespace(period=len(funcs), base=base, funcs=funcs, key=loop_key(funcs))


def _periods(trial, n, moved, each, count):
    """``count`` periods of ``each`` bytes from op ``n`` (``moved`` so far): (n, moved) after."""
    for _ in range(count):
        n, moved = n + 4, moved + each
        trial.period_began(n, 4, moved)
    return n, moved


def test_the_trial_measures_each_way_and_remembers_its_choice():
    trial = Trial()
    plan = _plan(["a", "b", "c", "d"], base=100)
    trial.begin(plan, limit=1000)
    assert not trial.evicts and trial.due == 104  # (the first op after the compiled period)
    trial.period_began(104, 4, 0)
    n, moved = _periods(trial, 104, 0, 50, 1)  # a period to settle
    n, moved = _periods(trial, n, moved, 100, MEASURED - 1)  # measured: free memory only
    assert not trial.evicts and trial.due == n + 4
    n, moved = _periods(trial, n, moved, 100, 1)
    assert trial.evicts  # evicting from here on: a period to settle, then measured
    n, moved = _periods(trial, n, moved, 300, 1)
    n, moved = _periods(trial, n, moved, int(EVICTING_BYTES * 100), MEASURED)
    assert trial.evicts and trial.due > 1 << 40  # (at most EVICTING_BYTES times the bytes: kept)

    trial.begin(_plan(["c", "d", "a", "b"], base=900), limit=1000)  # the same loop, begun elsewhere
    assert trial.evicts and trial.due > 1 << 40
    trial.begin(plan, limit=2000)  # another budget: tried again
    assert not trial.evicts and trial.due == 104


@pytest.mark.parametrize("free, evicting, evicts", [(100, 111, False), (100, 110, True), (0, 0, False)])
def test_the_trial_keeps_evicting_only_within_its_bytes(free, evicting, evicts):
    trial = Trial()
    trial.begin(_plan(["a", "b", "c", "d"]), limit=1000)
    trial.period_began(4, 4, 0)
    n, moved = _periods(trial, 4, 0, 7, 1)
    n, moved = _periods(trial, n, moved, free, MEASURED)
    if free:
        n, moved = _periods(trial, n, moved, 7, 1)
        n, moved = _periods(trial, n, moved, evicting, MEASURED)
    assert trial.due > 1 << 40  # (decided)
    assert trial.evicts is evicts


@pytest.mark.parametrize("free_seconds, evicting_seconds, evicts", [(1.0, 0.9, True), (1.0, 1.0, False)])
def test_on_a_gpu_the_trial_keeps_the_faster_way_whatever_its_bytes(free_seconds, evicting_seconds, evicts):
    """Timed (CUDA), the evicting way is kept where its periods took less time, even for twice
    the bytes: the copies overlap the kernels there."""
    trial = Trial()
    trial.begin(_plan(["a", "b", "c", "d"]), limit=1000, timed=True)
    n, moved, now = 4, 0, 0.0
    # (bytes, seconds) of each period ending at a boundary: none yet, the settling period, the
    # measured periods into free memory, settling, the measured periods evicting
    periods = ([(0, 0.0), (7, 0.5)] + [(100, free_seconds)] * MEASURED + [(7, 0.5)]
               + [(200, evicting_seconds)] * MEASURED)
    for nbytes, seconds in periods:
        moved, now = moved + nbytes, now + seconds
        trial.period_began(n, 4, moved, now)
        n = trial.due
    assert trial.due > 1 << 40  # (decided)
    assert trial.evicts is evicts


def test_a_later_plan_of_the_loop_goes_on_with_the_trial():
    """Each ``generate()`` call compiles a plan of its own, for fewer periods than a trial."""
    trial = Trial()
    loop = ["a", "b", "c", "d"]
    trial.begin(_plan(loop), limit=1000)
    trial.period_began(4, 4, 0)
    n, moved = _periods(trial, 4, 0, 100, 1 + MEASURED - 1)  # settled, then all but one measured
    trial.end()  # the program left the plan
    assert not trial.evicts and trial.due > 1 << 40
    trial.begin(_plan(loop, base=500), limit=1000)
    assert not trial.evicts  # (still measuring into free memory)
    trial.period_began(504, 4, moved)
    n, moved = _periods(trial, 504, moved, 1000, 1)  # a period to settle: not counted
    n, moved = _periods(trial, n, moved, 100, 1)
    assert trial.evicts
    trial.end()
    trial.begin(_plan(loop, base=900), limit=1000)
    assert trial.evicts  # (measuring the evicting way)
    trial.period_began(904, 4, moved)
    n, moved = _periods(trial, 904, moved, 1000, 1)
    n, moved = _periods(trial, n, moved, 200, MEASURED)
    assert not trial.evicts and trial.due > 1 << 40  # twice the bytes: prefetches fill free memory only


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_while_learning_flow_evicts_for_the_next_op_as_the_last_plan_chose(fresh_manager, fraction):
    """Between plans (a ``generate()`` call's prompt and first tokens) Flow predicts by the
    period it knows, and prefetches as the last plan's trial chose. (A Flow that never
    compiles a plan learns all along: its trial's choice is set here.)"""
    expected = _plain()[0]
    free = Flow(plan=False)
    free_only, free_stats = _steady(free, fraction)
    learning = Flow(plan=False)

    def chose_to_evict(flow):
        flow.prefetching.trial.last = True  # (as if a plan's trial had chosen to evict)

    evicting, evicting_stats = _steady(learning, fraction, attached=chose_to_evict)
    for out in free_only + evicting:
        assert_identical(out, expected)
    assert free.period is not None and learning.period is not None and learning.plan is None
    assert free_stats["bytes_prefetched_ahead"] < 0.1 * free_stats["bytes_to_device"]
    assert evicting_stats["bytes_prefetched_ahead"] >= 0.95 * evicting_stats["bytes_to_device"] > 0
    assert evicting_stats["bytes_to_device"] <= EVICTING_BYTES * free_stats["bytes_to_device"]


@pytest.mark.parametrize("evicts", [None, False], ids=["tried", "fixed"])
def test_flow_settles_once_it_follows_its_plan_and_chose_how_to_prefetch_for_it(fresh_manager, by_bytes, evicts):
    # (benchmarks of the steady state warm up until ``Strategy.settled``: measured while Flow
    # learnt the loop or tried both ways of prefetching, a step was neither)
    flow = Flow(prefetch_evicts=evicts)
    tm.strategy = flow
    model = _stack()
    x = torch.rand(1, WIDTH, generator=torch.Generator().manual_seed(1), device="cpu").to(tm.torch_device)
    with torch.no_grad():
        _forward(model, x)
        assert flow.settled  # (no budget: nothing to learn)
        tm.budget = budget(int(0.5 * sum(p.numel() * 4 for p in model.parameters())))
        seen = []
        for _ in range(30):  # (a forward is one period of the loop)
            _forward(model, x)
            seen.append((flow.plan is not None, flow.settled))
    planned = next(i for i, (plan, _settled) in enumerate(seen) if plan)
    settled = next(i for i, (_plan, s) in enumerate(seen) if s)
    assert planned >= 1 and all(plan for plan, _s in seen[planned:])
    # tried: the rest of the period the plan was compiled in, a period to settle, MEASURED
    # into free memory, one more to settle, MEASURED evicting
    assert settled == planned + (2 * MEASURED + 3 if evicts is None else 0)
    assert all(s for _plan, s in seen[settled:])
    # what it chose (here: evicting for the next op moves no more bytes) or was told
    assert flow.evicts_ahead is (evicts is None)
    assert Flow(prefetch_evicts=True).evicts_ahead and not Flow().evicts_ahead  # (no plan yet: not evicting)
