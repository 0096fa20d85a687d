"""Flow: eviction by predicted next use, write-back of dirty blocks only, prefetch, pins, faults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import torchTensorRef
from torchTensorRef import DeviceOutOfMemoryError, OutOfBudgetError, tensorsManager as tm
from torchTensorRef.analysis.offline import reference_moves
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.strategies import Flow, Strategy, flow_prefetch
from torchTensorRef.strategies.flow_plan import loop_key
from paired import assert_identical, budget, outside, plain_torch, room_report, sim_only, small_sim_capacity, to_plain

KIB = 1024


@pytest.fixture
def flow(fresh_manager):
    strategy = Flow(lookahead=0)
    tm.strategy = strategy
    return strategy


def _cycle(tensors, rounds):
    for _ in range(rounds):
        for t in tensors:
            t.add_(1)


def _misses_per_two_rounds(strategy):
    tm.strategy = strategy
    a, b, c = (torch.zeros(256) for _ in range(3))  # 1 KiB each
    tm.budget = budget(2 * KIB)  # two of the three fit
    _cycle([a, b, c], 8)
    tm.reset_stats()
    _cycle([a, b, c], 2)
    fetches, period = tm.stats()["fetches"], getattr(strategy, "period", None)
    for t in (a, b, c):
        assert torch.equal(to_plain(t.clone()), to_plain(torch.full((256,), 10.0)))
    return fetches, period


@sim_only  # (the device's capacity is set: "sim"'s)
@small_sim_capacity
def test_with_no_budget_it_learns_nothing_until_the_capacity_makes_room():
    """With no budget nothing pages until the device is full: Flow records no op (ranking
    every block of every op was most of what a training step with nothing to move added),
    then learns the loop from the first eviction, and pages it as under a budget."""
    tm.strategy = "flow"
    flow = tm.strategy
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    weights = [torch.randn(64, 64) for _ in range(6)]

    def step(x, weights):
        y = x
        for w in weights:
            y = torch.tanh(y @ w)
        return y

    for _ in range(5):
        step(x, weights)
    assert not tm.under_pressure and not flow.learning.births and flow.period is None
    tm.evict_all()
    before = tm.sim_capacity
    try:
        tm.sim_capacity = outside() + 5 * tm.block_bytes(64 * 64 * 4)  # (five of the seven tensors)
        outs = [step(x, weights) for _ in range(8)]
        assert tm.under_pressure and flow.plan is not None and tm.stats()["evictions"] > 0
    finally:
        tm.sim_capacity = before
    with plain_torch():
        expected = step(to_plain(x), [to_plain(w) for w in weights])
    for out in outs:
        assert_identical(expected, out)


def test_evicts_the_block_used_farthest_in_the_future(fresh_manager):
    # Cycling over three blocks with room for two, evicting the block used farthest in the
    # future misses every other access; evicting the least recently used misses them all.
    assert _misses_per_two_rounds(Flow(lookahead=0)) == (3, 3)
    assert _misses_per_two_rounds(Strategy())[0] == 6  # the base class evicts by recency


@sim_only  # (the emulated workspaces are "sim"'s; on CUDA the test above is this one)
def test_ranks_small_blocks_against_its_share_not_the_workspaces_beside_it(fresh_manager):
    """On a GPU the budget also holds cuBLAS's workspaces, tens of MiB: a 1 KiB block with
    2 KiB of the budget to share is no "tiny block beside the budget", kept resident as a
    norm's weight would be. Ranked against the whole budget, every block of the cycle tied as
    "evict last", and Flow kept one of the three resident and missed the other two each
    round (four misses in two rounds on the H200, as here before), where the farthest next
    use misses every other access."""
    previous = tm.sim_workspace
    tm.sim_workspace = "33MiB"  # (an H100's, per thread: this one's and the backward's)
    try:
        tm.outside_bytes()  # (the workspaces made, as CUDA's first product makes them)
        assert tm.stats()["outside_bytes"] >= 66 * 2**20
        assert _misses_per_two_rounds(Flow(lookahead=0)) == (3, 3)
    finally:
        tm.budget = None
        tm.sim_workspace = previous


def test_falls_back_to_recency_when_the_sequence_changes(flow):
    a, b, c = (torch.zeros(256) for _ in range(3))
    tm.budget = budget(2 * KIB)
    _cycle([a, b, c], 8)
    assert flow.period == 3
    c.mul_(2)  # breaks the pattern (a different op where a.add_ was expected)
    assert flow.period is None
    resident = [t for t in (a, b, c) if t.proxyInfo.on_device]
    assert any(t is c for t in resident) and len(resident) == 2
    other = next(t for t in resident if t is not c)
    missing = next(t for t in (a, b) if t is not other)
    missing.add_(1)  # evicts the least recently used of the two resident: not c
    assert c.proxyInfo.on_device and not other.proxyInfo.on_device
    expected = {id(a): 8.0, id(b): 8.0, id(c): 16.0}
    expected[id(missing)] += 1
    for t in (a, b, c):
        assert torch.equal(to_plain(t.clone()), to_plain(torch.full((256,), expected[id(t)])))


def test_tensors_made_on_the_device_each_step_keep_the_period(flow):
    # A factory that fits is made on the device and filled by an op (arange's out=, full's
    # fill_) before the creation function returns: the block is new at each step, and
    # Flow must see it as born just before that op, or every step breaks the period.
    a, b, c = (torch.zeros(256) for _ in range(3))
    tm.budget = budget(4 * KIB)  # the three and two temporaries of 1 KiB do not fit together
    periods = []
    handle = tm.add_callback(after=lambda op: periods.append(flow.period))
    for _ in range(12):
        for t in (a, b, c):
            t.add_(torch.arange(256.0, device=t.device) + torch.full((256,), 2.0))
    handle.remove()
    assert tm.stats()["evictions"] > 0  # Flow had to choose
    found = periods.index(next(p for p in periods if p is not None))
    assert set(periods[found:]) == {periods[-1]}, "the period was lost and found again"
    for t in (a, b, c):
        assert torch.equal(to_plain(t.clone()), to_plain(12 * (torch.arange(256.0) + 2)))


def test_a_factory_is_the_same_op_whether_the_device_is_full_or_not(flow):
    # A factory whose tensor did not fit the free room was made on the host, with no op: a
    # generate() step that made its arange while the device was full ran one op fewer than
    # the step before, and Flow lost its period (integrations/creation.py)
    tm.budget = budget(4 * KIB)

    def ops_of_a_factory():
        names = []
        handle = tm.add_callback(before=lambda op: names.append(op.name))
        try:
            made = torch.arange(256.0)
        finally:
            handle.remove()
        return names, made

    roomy, first = ops_of_a_factory()  # the device empty
    assert first.proxyInfo.on_device
    del first
    tensors = [torch.zeros(256) for _ in range(4)]  # 1 KiB each
    for t in tensors:
        t.add_(1)  # all four resident: no free room left
    assert not tm.fits(tm.block_bytes(1 * KIB))
    full, made = ops_of_a_factory()
    # (on "sim" the device's empty kernel makes it and arange's out= fills it: an op; on CUDA
    # the factory's own kernel makes it, adopted: no op. Either way the same, on the device)
    assert full == roomy
    assert made.proxyInfo.on_device and tm.stats()["peak_device_bytes"] <= tm.budget
    with plain_torch():
        expected = torch.arange(256.0, device=tm.torch_device)
    assert_identical(expected, made)


def test_writes_back_only_dirty_blocks(flow):
    x, y = torch.ones(256), torch.ones(256)
    tm.budget = budget(1 * KIB + tm.block_bytes(8))  # one block plus a scalar result (as the allocator gives it)
    x.sum()  # x fetched, read only
    tm.reset_stats()
    y.add_(1)  # x must go: it is clean, so nothing is copied back
    assert tm.stats()["bytes_to_host"] == 0
    x.add_(1)  # y must go: it was written, so its bytes are copied back
    assert tm.stats()["bytes_to_host"] == 1 * KIB
    assert torch.equal(to_plain(y), to_plain(torch.full((256,), 2.0)))


def test_steady_state_moves_match_the_offline_reference(fresh_manager):
    tm.strategy = Flow(lookahead=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.rand(8, 64)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    managed = param_bytes // 2
    tm.budget = budget(managed)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    tm.reset_stats()
    with tm.recording() as trace:
        step()
    # (the reference gets the manager's room: the budget less what is outside the manager)
    ref = reference_moves(trace.accesses, managed, trace.initial, trace.created, trace.block_bytes)
    stats = tm.stats()
    assert tm.strategy.period is not None
    assert stats["peak_device_bytes"] <= managed
    assert stats["bytes_to_device"] <= 1.02 * ref["bytes_to_device"]
    assert stats["bytes_to_device"] + stats["bytes_to_host"] <= 1.10 * (ref["bytes_to_device"] + ref["bytes_to_host"])


def test_prefetches_blocks_of_upcoming_ops_before_they_run(fresh_manager):
    tm.strategy = Flow(lookahead=4, prefetch_evicts=True)
    weights = [torch.full((256,), float(i)) for i in range(6)]
    tm.budget = budget(4 * KIB)  # the running sum, one weight, the result, and one block to spare

    def step():
        acc = weights[0].clone()
        for w in weights[1:]:
            acc = acc + w
        return acc

    for _ in range(8):
        step()
    tm.reset_stats()
    with tm.recording() as trace:
        total = step()
    stats = tm.stats()
    assert stats["prefetches"] > 0 and stats["prefetch_hits"] > 0, room_report()
    assert stats["peak_device_bytes"] <= tm.budget
    # some copies in were done ahead: finished before the op preceding their first use began
    starts = sorted((start, index) for index, _name, start, _end in trace.ops)
    ahead = 0
    for kind, block, _n, _start, end in trace.moves:
        if kind != "to_device":
            continue
        ops_after = [index for start, index in starts if start >= end]
        uses = [i for i, b, _n2, _w in trace.accesses if b == block and ops_after and i >= ops_after[0]]
        if uses and ops_after[0] < min(uses):
            ahead += 1
    assert ahead > 0
    assert torch.equal(to_plain(total), to_plain(torch.full((256,), 15.0)))


def _mlp_step_bytes(strategy):
    tm.strategy = strategy
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.rand(8, 64)
    tm.budget = budget(sum(p.numel() * 4 for p in model.parameters()) // 2)
    for i in range(5):
        if i == 4:
            tm.reset_stats()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    stats = tm.stats()
    tm.budget = None
    return stats


def test_prefetching_into_free_memory_adds_no_traffic(fresh_manager):
    without = _mlp_step_bytes(Flow(lookahead=0))
    with_prefetch = _mlp_step_bytes(Flow(lookahead=6, prefetch_evicts=False))
    assert with_prefetch["prefetches"] > 0
    assert with_prefetch["bytes_to_device"] == without["bytes_to_device"]
    assert with_prefetch["bytes_to_host"] == without["bytes_to_host"]


@pytest.mark.parametrize("strategy", torchTensorRef.strategies.NAMES)
def test_pinned_block_stays_resident_under_pressure(fresh_manager, strategy):
    tm.strategy = strategy
    w, a, b = torch.ones(256), torch.zeros(256), torch.zeros(256)
    tm.budget = budget(3 * KIB)
    tm.pin(w)
    assert w.proxyInfo.pinned and w.proxyInfo.on_device
    for _ in range(3):
        a.add_(w)
        b.add_(w)
    assert w.proxyInfo.on_device
    tm.unpin(w)
    assert not w.proxyInfo.pinned
    with pytest.raises(ValueError, match="not pinned"):
        tm.unpin(w)
    assert torch.equal(to_plain(a), to_plain(torch.full((256,), 3.0)))


def test_pinning_more_than_the_budget_fails_cleanly(fresh_manager):
    tm.strategy = "flow"
    big = torch.zeros(1024)
    tm.budget = budget(1 * KIB)
    with pytest.raises(OutOfBudgetError, match="budget"):
        tm.pin(big)
    assert not big.proxyInfo.pinned and not big.proxyInfo.on_device


@pytest.mark.parametrize("strategy", torchTensorRef.strategies.NAMES)
def test_recovers_from_an_out_of_memory_by_evicting(fresh_manager, strategy):
    tm.strategy = strategy
    keep = [torch.ones(256) for _ in range(3)]
    for t in keep:
        t.toGPU()
    failures = []

    def fail_once(fault):
        if not failures and fault.kind == "op":
            failures.append(fault.name)
            raise torch.OutOfMemoryError("injected: another process took the memory")

    x = torch.full((256,), 2.0)
    tm.fault_injector = fail_once
    y = x * 3
    assert failures == ["aten.mul.Tensor"]
    assert not any(t.proxyInfo.on_device for t in keep)  # evicted to make room
    assert y.toCPU().tolist() == [6.0] * 256


def test_out_of_memory_that_persists_names_the_op(fresh_manager):
    def always(op):
        raise torch.OutOfMemoryError("injected")

    tm.strategy = "flow"
    x = torch.ones(16)
    tm.fault_injector = always
    with pytest.raises(DeviceOutOfMemoryError, match="aten.mul.Tensor"):
        x * 2


def test_flow_training_is_bit_identical_to_plain(fresh_manager):
    tm.strategy = "flow"

    def train(managed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.rand(16, 32)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in model.parameters()]

    with plain_torch():
        plain_losses, plain_params = train(False)
    tm.budget = budget(32 * KIB)  # parameters, grads and Adam state take 53 KiB
    losses, params = train(True)
    assert losses == plain_losses
    assert_identical(plain_params, params)
    assert tm.stats()["peak_device_bytes"] <= tm.budget
    assert tm.stats()["evictions"] > 0


def test_flow_rejects_bad_settings():
    with pytest.raises(ValueError, match="lookahead"):
        Flow(lookahead=-1)


def test_a_prefetch_evicts_as_asked_or_as_a_trial_decides_by_the_device(fresh_manager, monkeypatch):
    """By default each plan's trial decides (Note [Evicting for the next op]): by the time its
    periods take on CUDA, where copies overlap kernels, and by their bytes on "sim"; asked
    for, a prefetch always or never evicts, whatever the device."""
    calls = []
    begin = flow_prefetch.Trial.begin
    monkeypatch.setattr(flow_prefetch.Trial, "begin",
                        lambda self, plan, limit, timed=False: (calls.append(timed), begin(self, plan, limit, timed)))
    fresh_manager.budget = budget(64 * KIB)
    for kind in ("sim", "cuda"):
        flow = Flow()
        fresh_manager.strategy = flow
        with monkeypatch.context() as m:
            m.setattr(type(fresh_manager), "device_kind", property(lambda self: kind))
            flow.device_changed()
            assert flow.prefetch_evicts is None
            flow.learning.plan = SimpleNamespace(period=2, base=0, funcs=["a", "b"], key=loop_key(["a", "b"]))
            flow.prefetching.plan_compiled()
        flow.learning.plan = None
    fresh_manager.budget = None
    assert calls == [False, True]
    evicting = Flow(prefetch_evicts=True)
    fresh_manager.strategy = evicting
    assert evicting.prefetch_evicts is True
    assert Flow(prefetch_evicts=False).prefetch_evicts is False


def test_a_tiny_block_predicted_dead_is_evicted_after_the_weights(fresh_manager):
    """Writing back a vector nobody reads again costs a copy for no room: the weights,
    clean and needed later, go first."""
    fresh_manager.strategy = Flow()
    torch.manual_seed(0)
    ws = [torch.randn(64, 64) for _ in range(6)]  # 16 KiB each
    x = torch.randn(1, 64)
    with plain_torch():  # (the product on the device: CUDA's matmul is not the CPU's)
        expected = x.target.to(tm.torch_device)
        for w in ws:
            expected = expected @ w.target.to(tm.torch_device)
    expected = to_plain(expected)
    fresh_manager.budget = budget(4 * ws[0].proxyInfo.nbytes + 4096)
    kept = []

    def step():
        kept.clear()
        h = x
        for w in ws:
            h = h @ w
            kept.append(h)  # alive, never read again: predicted dead, and dirty
        return h.toCPU().target

    for _ in range(6):
        assert torch.allclose(step(), expected)
    assert fresh_manager.strategy.plan is not None
    fresh_manager.reset_stats()
    for _ in range(3):
        assert torch.allclose(step(), expected)
    stats = fresh_manager.stats()
    assert stats["evictions"] > 0  # the weights page
    assert stats["writebacks"] == 3  # ... and only the results asked for (toCPU) are written back


def test_a_tiny_block_needed_again_stays_while_the_weights_page(fresh_manager):
    """A bias or a norm's weight moved costs a copy's fixed cost for almost no room: while
    the large weights page through the budget, the tiny ones used every step stay (each
    block a region: its working set comes in whole, and room is made for all of it), unless
    they are in their region's group, which comes in with one copy (``test_groups.py``)."""
    from torchTensorRef import regions

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(64)
            self.up = torch.nn.Linear(64, 256)  # (weights of 64 KiB; biases, norm: 1 KiB and less)
            self.down = torch.nn.Linear(256, 64)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    def run(model, x):
        with torch.no_grad():
            return model(x)

    x = torch.randn(1, 64)
    torch.manual_seed(0)
    with plain_torch():
        plain = torch.nn.Sequential(*[Block() for _ in range(8)]).eval().to(tm.torch_device)
        expected = to_plain(run(plain, x.target.to(tm.torch_device)))
    fresh_manager.strategy = Flow()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block() for _ in range(8)]).eval()
    regions.no_region(model)
    for block in model:
        regions.region(block)
    weights = sum(p.proxyInfo.nbytes for p in model.parameters())
    fresh_manager.budget = budget(weights // 2)  # (a bias: under 1/256 of it)
    for _ in range(6):
        assert torch.equal(to_plain(run(model, x)), expected)
    assert fresh_manager.strategy.plan is not None
    tiny = [p for p in model.parameters() if p.proxyInfo.nbytes < 16 * KIB]
    large = [p for p in model.parameters() if p.proxyInfo.nbytes >= 16 * KIB]
    fetched = [block_of(p).fetches for p in tiny + large]
    fresh_manager.reset_stats()
    for _ in range(3):
        assert torch.equal(to_plain(run(model, x)), expected)
    now = [block_of(p).fetches for p in tiny + large]
    assert now[len(tiny):] != fetched[len(tiny):]  # the weights page
    # (no groups: a layer's, a quarter of the manager's share of the budget, is not small
    # beside it; the reference model's device bytes are outside the manager, no share of it)
    assert not any(block_of(p).group is not None for p in tiny + large)
    assert now[:len(tiny)] == fetched[:len(tiny)]  # ... the biases and norms stay
    assert fresh_manager.stats()["peak_device_bytes"] <= fresh_manager.budget
