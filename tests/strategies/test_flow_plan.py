"""Flow's plan: once the period repeated whole, Flow follows a compiled plan with the same
decisions as learning, and drops it as soon as the program does something else."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import tensorsManager as tm
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.strategies import Flow
from paired import assert_identical, budget, needs_fast_path, plain_torch, to_plain



def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4)])


def _train(model, steps, x, after_step=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(i)
    return losses


def _input():
    """The MLP's input: drawn on the host (from a generator of its own), then on the device."""
    return torch.rand(8, 64, generator=torch.Generator().manual_seed(1), device="cpu").to(tm.torch_device)


def _run(strategy, fraction, steps=8):
    """Steps of an MLP under ``strategy``: losses, parameters, bytes moved per step, plan per step."""
    tm.strategy = strategy
    model = _mlp()
    x = _input()
    tm.budget = budget(int(sum(p.numel() * 4 for p in model.parameters()) * fraction))
    per_step, plans = [], []

    def after_step(_i):
        stats = tm.stats()
        per_step.append(stats["bytes_to_device"] + stats["bytes_to_host"])
        plans.append(strategy.plan is not None)
        tm.reset_stats()

    tm.reset_stats()
    losses = _train(model, steps, x, after_step)
    tm.budget = None
    params = [p.detach().clone().toCPU().target for p in model.parameters()]
    return losses, params, per_step, plans


@pytest.mark.parametrize("fraction", [0.5, 0.7])
def test_following_the_plan_moves_the_bytes_learning_moves_and_matches_plain_torch(fresh_manager, fraction):
    with plain_torch():
        model = _mlp()
        plain_losses = _train(model, 8, _input())
        plain_params = to_plain([p.detach() for p in model.parameters()])
    learning = _run(Flow(plan=False), fraction)
    following = _run(Flow(), fraction)
    assert not any(learning[3])
    assert following[3][-3:] == [True] * 3  # compiled once the step repeated whole
    for losses, params, _bytes, _plans in (learning, following):
        assert losses == plain_losses
        assert_identical(plain_params, params)
    # The plan's decisions are learning's, or better: learning ranks a dirty block when it
    # was last used, the plan when room is needed (Note [Dirty blocks cost two copies]).
    followed = [i for i, on in enumerate(following[3]) if on and i > 0 and following[3][i - 1]]
    assert followed
    for i in followed:
        assert following[2][i] <= learning[2][i] * 1.02
    assert min(following[2][i] for i in followed) > 0  # the budget binds: there is paging to plan


def test_a_program_that_stops_following_the_plan_drops_it_and_learns_again(fresh_manager):
    flow = Flow()
    tm.strategy = flow
    a, b, c = (torch.zeros(256) for _ in range(3))  # 1 KiB each
    tm.budget = budget(2 * 1024 + 512)  # two of the three fit
    for _ in range(12):
        a.add_(1), b.add_(1), c.add_(1)
    assert flow.plan is not None and flow.period == 3
    c.mul_(2)  # not the op the plan has here
    assert flow.plan is None and flow.period is None
    for _ in range(12):
        a.sub_(1), c.sub_(1)  # a new loop, period 2
    assert flow.period == 2 and flow.plan is not None and flow.plan.period == 2
    assert torch.equal(to_plain(a), to_plain(torch.zeros(256)))
    assert torch.equal(to_plain(b), to_plain(torch.full((256,), 12.0)))
    assert torch.equal(to_plain(c), to_plain(torch.full((256,), 12.0)))


def test_the_plan_predicts_the_block_used_farthest_in_the_future(fresh_manager):
    # Three blocks cycled with room for two: Belady misses every other access, recency all.
    flow = Flow(lookahead=0)
    tm.strategy = flow
    a, b, c = (torch.zeros(256) for _ in range(3))
    tm.budget = budget(2 * 1024)
    for _ in range(8):
        a.add_(1), b.add_(1), c.add_(1)
    assert flow.plan is not None
    tm.reset_stats()
    for _ in range(2):
        a.add_(1), b.add_(1), c.add_(1)
    assert tm.stats()["fetches"] == 3
    assert flow.plan is not None  # followed throughout
    assert torch.equal(to_plain(b), to_plain(torch.full((256,), 10.0)))


def test_decoding_under_the_plan_gives_plain_torchs_tokens(fresh_manager):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        plain = transformers.LlamaForCausalLM(config).eval()
        ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(2))
        expected = plain.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        state = {k: v.clone() for k, v in plain.state_dict().items()}
    flow = Flow()
    tm.strategy = flow
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(state)
    tm.budget = budget(sum(p.numel() * 4 for p in model.parameters()) // 2)
    managed_ids = torch.tensor(ids.tolist())
    followed = []
    for _ in range(4):
        out = model.generate(managed_ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        followed.append(flow.plan is not None)
        assert out.toCPU().target.tolist() == expected.tolist()
    assert followed[-1] and tm.stats()["evictions"] > 0


class _Counting(Flow):
    """Flow, counting which hooks saw each op."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.generic, self.fast = 0, 0

    def before_op(self, op):
        self.generic += 1
        super().before_op(op)

    def fast_op(self, index, func, blocks, reserved):
        taken = super().fast_op(index, func, blocks, reserved)
        self.fast += taken
        return taken


@needs_fast_path
def test_ops_that_move_nothing_take_the_fast_path_while_the_plan_is_followed(fresh_manager):
    flow = _Counting()
    tm.strategy = flow
    model = _mlp()
    x = _input()
    tm.budget = budget(sum(p.numel() * 4 for p in model.parameters()) // 2)
    seen = []

    def after_step(i):
        if i == 4:  # steady state: count the last three steps
            assert flow.plan is not None
            flow.generic = flow.fast = 0
            tm.reset_stats()
        seen.append(flow.plan is not None)

    losses = _train(model, 8, x, after_step)
    stats = tm.stats()
    assert all(seen[4:]) and stats["evictions"] > 0
    assert flow.fast + flow.generic == stats["ops"]  # every op was seen, by one hook or the other
    assert flow.fast > stats["ops"] // 2  # most move nothing
    tm.budget = None
    with plain_torch():
        plain_losses = _train(_mlp(), 8, _input())
    assert losses == plain_losses


@needs_fast_path
def test_a_strategy_refusing_fast_ops_sees_every_op_in_its_hooks(fresh_manager):
    class Refuses(_Counting):
        def follows_fast_ops(self):
            return True  # offered the fast path, but refuses each op

        def fast_op(self, index, func, blocks, reserved):
            self.fast += 1
            return False

    flow = Refuses()
    tm.strategy = flow
    tensors = [torch.zeros(256) for _ in range(3)]  # 1 KiB each, room for two
    tm.budget = budget(2 * 1024)
    for _ in range(4):
        for t in tensors:
            t.add_(1)
    assert tm.under_pressure
    flow.generic = flow.fast = 0
    tm.reset_stats()
    for _ in range(4):
        for t in tensors:
            t.add_(1)
    assert flow.generic == tm.stats()["ops"] == 12
    assert flow.fast > 0  # resident ones were offered, and refused
    assert all(torch.equal(to_plain(t), to_plain(torch.full((256,), 8.0))) for t in tensors)


def test_victims_replayed_from_the_plan_are_the_ones_ranking_chooses(fresh_manager, monkeypatch):
    """Note [Victims replayed from the plan]: each victim taken again is one ranking would
    choose then (of the farthest rank), for a fraction of the rankings; a remembered victim
    that may not go now is not taken."""
    from torchTensorRef.strategies import flow_order

    rankings, replays, worse = [], [], []
    rank, again = flow_order.Order._plan_rank, flow_order.Order._again

    def counted(self, n):
        if self._ranking[0] != n:
            rankings.append(n)
        return rank(self, n)

    def checked(self, role, protect, n, worse_than, clean_only):
        block = again(self, role, protect, n, worse_than, clean_only)
        if block is not None:
            # what ranking would take now: the first that may go, from the farthest
            learning, share = self.learning, self.share()
            best = None
            for priority, bid, candidate in reversed(rank(self, n)):
                if (self.manager.resident_block(bid) is candidate and not candidate.pins
                        and bid not in protect and (candidate.clean or not clean_only)):
                    best = priority
                    break
            mine = flow_order._rank(block, n, learning.plan.next_use(block.id, n, learning.births,
                                                                       flow_order.DEAD), share)
            replays.append(n)
            if best is None or mine != best:
                worse.append((n, mine, best))
        return block

    monkeypatch.setattr(flow_order.Order, "_plan_rank", counted)
    monkeypatch.setattr(flow_order.Order, "_again", checked)
    with plain_torch():
        model = _mlp()
        plain_losses = _train(model, 12, _input())
    losses, _params, _bytes, plans = _run(Flow(), 0.5, steps=12)
    assert plans[-4:] == [True] * 4
    assert losses == plain_losses
    assert replays and not worse  # (each replayed victim ranked as far as ranking's own)
    assert len(replays) > len(set(rankings))  # (more victims replayed than rankings made)

    # A remembered victim pinned since is not taken: the ranking picks another. (Pinned as
    # ``tensorsManager.pin`` pins, without its fetch: an op the plan does not have would drop
    # the plan, and the victims remembered with it.)
    strategy = tm.strategy
    model = _mlp()
    params = list(model.parameters())
    tm.budget = budget(int(sum(p.numel() * 4 for p in params)))  # (the weights: with gradients and momenta, a third)
    pinned, evicted, refused = [], [], []

    def after_step(i):
        if i != 5:
            return
        assert strategy.plan is not None
        remembered = {role for chosen in strategy.order._chosen.values() for _t, _c, role, _n in chosen}
        weight = next(p for p in params if block_of(p).id in remembered and p.dim() == 2)
        block_of(weight).pins += 1
        pinned.append(block_of(weight))
        evict = tm.residency.evict
        monkeypatch.setattr(tm.residency, "evict", lambda block: (evicted.append(block.id), evict(block)))
        again = flow_order.Order._again

        def asked_again(self, role, *args):
            block = again(self, role, *args)
            if block is None and role == pinned[0].id:
                refused.append(role)
            return block

        monkeypatch.setattr(flow_order.Order, "_again", asked_again)

    try:
        _train(model, 11, _input(), after_step)
    finally:
        for block in pinned:
            block.pins -= 1
        tm.budget = None
    assert refused  # (the pinned weight was remembered as a victim, and not taken)
    assert evicted  # (there was paging, with other victims)
    assert pinned[0].id not in evicted
    assert strategy.plan is not None


def test_victims_ranking_confirms_are_trusted_longer_for_the_same_bytes(fresh_manager, monkeypatch):
    """Note [Victims replayed from the plan]: where ranking chooses the remembered victim
    again, it is trusted for more periods: a loop that repeats itself ranks less and less
    often, and moves the bytes it moved when every victim was ranked anew each ``REPLAYS``
    periods."""
    from torchTensorRef.strategies import flow_order

    rank, most_replays = flow_order.Order._plan_rank, flow_order.MOST_REPLAYS

    def runs(most):
        monkeypatch.setattr(flow_order, "MOST_REPLAYS", most)
        rankings = []

        def counted(self, n):
            if self._ranking[0] != n:
                rankings.append(n)
            return rank(self, n)

        monkeypatch.setattr(flow_order.Order, "_plan_rank", counted)
        # (prefetches evict nothing: on CUDA the trial would choose by time, run to run)
        losses, _params, per_step, plans = _run(Flow(prefetch_evicts=False), 0.5, steps=40)
        return losses, per_step, plans, len(rankings)

    with plain_torch():
        plain_losses = _train(_mlp(), 40, _input())
    fixed = runs(flow_order.REPLAYS)
    trusted = runs(most_replays)
    assert trusted[2][-30:] == [True] * 30  # (the plan followed)
    assert trusted[0] == fixed[0] == plain_losses
    assert trusted[1] == fixed[1]  # (the same bytes, step by step)
    assert 0 < trusted[3] < fixed[3] / 2


def test_a_loop_seen_before_is_followed_as_soon_as_its_period_is_found(fresh_manager):
    """Note [A loop seen before]: after an op outside the loop (a ``generate()`` call's prompt),
    the plan is compiled when the period is found again, not a period later."""
    strategy = Flow()
    tm.strategy = strategy
    torch.manual_seed(0)
    ws = [torch.randn(64, 64) * 0.1 for _ in range(4)]
    x = torch.randn(1, 64)
    tm.budget = budget(2 * ws[0].proxyInfo.nbytes + 4096)  # (two of the four weights)

    def ops_until_the_plan(limit=200):
        """Run the loop (a matmul and a tanh per weight) op by op until Flow follows a plan:
        the ops it took, and the last result."""
        y = x
        for i in range(limit):
            y = y @ ws[i // 2 % 4] if i % 2 == 0 else torch.tanh(y)
            if strategy.plan is not None and i % 2 == 1:
                return i + 1, y
        raise AssertionError("no plan")

    first, _y = ops_until_the_plan()
    x.add_(0)  # an op outside the loop: the plan is left
    assert strategy.plan is None
    again, y = ops_until_the_plan()
    assert again < first - 4  # (a whole period, 8 ops, less checking)
    with plain_torch():
        expected = x.target.to(tm.torch_device)
        for i in range(again):
            expected = expected @ ws[i // 2 % 4].target.to(tm.torch_device) if i % 2 == 0 else torch.tanh(expected)
    assert_identical(to_plain(y), to_plain(expected))
    tm.budget = None
