"""Flow's period is one step of a loop whose steps hand state to the next (a decode step
extending a cache), in calls of any length: Note [State carried over a period] and Note
[The shortest period] in strategies/flow_learn.py."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import tensorsManager as tm
from torchTensorRef.strategies import Flow
from paired import assert_identical, budget, plain_torch

KIB = 1024


def weights():
    torch.manual_seed(0)
    return [torch.randn(32, 32) / 8 for _ in range(4)]  # 4 KiB each


def call(ws, prompt: int, steps: int):
    """A generate()-like call: a prefill of ``prompt`` rows, then ``steps`` steps, each reading
    the state (a cache) the step before extended."""
    h = torch.ones(prompt, 32)
    for w in ws:  # (the prefill: other ops than a step's)
        h = torch.relu(h @ w)
    state = h
    h = h[-1:]
    for _ in range(steps):
        for w in ws:
            h = torch.tanh(h @ w)
        state = torch.cat([state, h])  # handed to the next step
        h = h + state.mean(0, keepdim=True)
    return state


def ops_of_a_step(ws) -> int:
    """The manager's ops in one step (the difference between calls of one more step)."""
    start = tm.op_index
    call(ws, 3, 2)
    two = tm.op_index - start
    start = tm.op_index
    call(ws, 3, 3)
    return tm.op_index - start - two


CALLS = [(5, 6), (9, 8), (3, 10), (7, 7)]  # (a plan is compiled a few steps into a call)


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "learning"])
def test_the_period_is_one_step_in_calls_of_different_lengths(fresh_manager, plan):
    with plain_torch():
        plain = [call([w.to(tm.torch_device) for w in weights()], p, s) for p, s in CALLS]
    ws = [torchTensorRef.manage(w) for w in weights()]
    flow = Flow(plan=plan)
    tm.strategy = flow
    tm.budget = budget(10 * KIB)  # two of the four weights and the activations
    step = ops_of_a_step(ws)
    for (prompt, steps), expected in zip(CALLS, plain):
        out = call(ws, prompt, steps)
        assert flow.period == step  # not two steps (the state), nor a whole call
        assert (flow.plan is not None) == plan
        assert_identical(expected, out)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def train_like_step(ws, states, x):
    """A step whose end runs the same ops on the same long-lived tensors twice in a row, as
    AdamW's foreach step reads every parameter's step count once for each bias correction."""
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    for _ in range(2):
        for s in states:
            s.add_(1)
    return h.sum()


def test_a_stretch_that_repeats_within_a_step_does_not_keep_the_plan_from_compiling(fresh_manager):
    # Note [A look-alike inside the period]: the second pass over the states repeats the first
    # at a distance of one pass, for a whole window; the op after it does not. Taking that
    # distance as the period for one op must not restart the count of ops the real period
    # held, or the plan of a training step with AdamW is never compiled.
    def run(ws, states, x, steps):
        return [train_like_step(ws, states, x) for _ in range(steps)], states

    with plain_torch():
        dev = tm.torch_device
        plain, plain_states = run([w.to(dev) for w in weights()], [torch.zeros(64, device=dev) for _ in range(20)],
                                  torch.ones(2, 32, device=dev), 8)
    ws = [torchTensorRef.manage(w) for w in weights()]
    states = [torchTensorRef.manage(torch.zeros(64)) for _ in range(20)]
    x = torchTensorRef.manage(torch.ones(2, 32))
    flow = Flow()
    tm.strategy = flow
    tm.budget = budget(10 * KIB)  # two of the four weights, the states and the activations
    start = tm.op_index
    out, states = run(ws, states, x, 8)
    step = (tm.op_index - start) // 8
    assert flow.period == step
    assert flow.plan is not None
    for a, b in zip(plain + plain_states, out + states):
        assert_identical(a, b)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "learning"])
def test_the_history_stays_within_its_window_over_many_calls(fresh_manager, plan):
    # Note [Pruning the history]: what Flow keeps of the op sequence covers ``max_history``
    # ops (and the ops since the last prune) and the blocks alive, however long the program
    # runs; the records of dead blocks leave with the window, also those that leaving the
    # plan wrote again.
    ws = [torchTensorRef.manage(w) for w in weights()]
    flow = Flow(plan=plan, max_history=400)
    tm.strategy = flow
    tm.budget = budget(10 * KIB)
    with plain_torch():
        expected = call([w.to(tm.torch_device) for w in weights()], 7, 9)
    pruned = set()
    for i in range(30):
        prompt, steps = CALLS[i % len(CALLS)]
        call(ws, prompt, steps)
        n = tm.op_index
        learning = flow.learning
        kept = n - learning.pruned_at + max(flow.max_history, 2 * (flow.period or 0) + flow.lookahead + 8)
        assert min(learning.funcs) >= n - kept
        for bid in set(learning.uses) | set(learning.births):
            if tm.block(bid) is None:  # dead: kept only while a record of it is in the window
                last = max(learning.uses.get(bid, [-1])[-1], learning.births.get(bid, (-1, 0))[0])
                assert last >= n - kept, (bid, last, n - kept)
        pruned.add(learning.pruned_at)
    assert len(pruned) > 10  # (it pruned all along)
    assert flow.period is not None and (flow.plan is not None) == plan
    assert_identical(expected, call(ws, 7, 9))  # (what it kept still pages right)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def accumulate(ws, x, state, steps: int):
    """Steps through the weights, each adding its result to a state it hands to the next
    step (written at a step's end, read at the next one's end)."""
    for _ in range(steps):
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        state = state + h
    return state


@pytest.mark.parametrize("plan", [True, False], ids=["plan", "learning"])
def test_state_made_at_every_step_is_kept_rather_than_written_back(fresh_manager, plan):
    # Note [Dirty blocks cost two copies]: the state each step makes (dirty) is read again a
    # period later, a little farther ahead than any weight the steps cycle through (clean).
    # Evicting it costs a write-back and a fetch, a weight only its fetch: the weights go,
    # and the steps write nothing back (by distance alone, the state went at every step).
    with plain_torch():
        dev = tm.torch_device
        expected = [accumulate([w.to(dev) for w in weights()], torch.ones(2, 32, device=dev),
                               torch.zeros(2, 32, device=dev), steps) for steps in (8, 16)]
    ws = [torchTensorRef.manage(w) for w in weights()]
    x, zero = torchTensorRef.manage(torch.ones(2, 32)), torchTensorRef.manage(torch.zeros(2, 32))
    tm.strategy = Flow(plan=plan)
    tm.budget = budget(10 * KIB)  # two of the four weights and the activations
    accumulate(ws, x, zero, 16)  # (learns the period)
    stats = []
    for steps, plain in zip((8, 16), expected):
        tm.reset_stats()
        assert_identical(plain, accumulate(ws, x, zero, steps))
        stats.append(tm.stats())
        assert stats[-1]["peak_device_bytes"] <= tm.budget
    assert stats[1]["evictions"] - stats[0]["evictions"] >= 8  # (the weights do not fit: they cycle)
    assert stats[1]["writebacks"] <= stats[0]["writebacks"], stats  # (8 steps more, no write-back more)


def test_with_nothing_to_page_flow_keeps_no_record_of_the_tensors_a_loop_makes(fresh_manager):
    # Pass-through has no limit: nothing is learnt, and nothing prunes (Note [Pruning the
    # history]), so a record of each tensor made would grow for as long as the program runs.
    tm.device = "cpu"
    flow = Flow()
    tm.strategy = flow
    with torchTensorRef.disabled():
        expected = torch.zeros(32, 32) + weights()[0]
    w = torchTensorRef.manage(weights()[0])
    for _ in range(200):
        out = torch.zeros(32, 32) + w
    assert_identical(expected, out)
    learning = flow.learning
    assert (len(learning.births), len(learning.adopted), len(learning.released), len(learning.uses)) == (0, 0, 0, 0)
