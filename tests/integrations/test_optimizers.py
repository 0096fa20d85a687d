"""An optimizer step whose state does not fit the budget runs in parts of the parameters
(Note [Optimizer steps in parts] in torchTensorRef/integrations/optimizers.py): the same
parameters as plain torch on the same device, bit for bit, with each tensor brought in and
written back once per step instead of once per formula term. With nothing to page, a step
runs as one op on plain tensors (Note [Optimizer steps on plain tensors]), bit for bit too."""

from __future__ import annotations

import io

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager as tm
from torchTensorRef.integrations import optimizers
from paired import assert_identical, budget, plain_torch

KIB = 1024
SHAPES = [(64, 64)] * 8 + [(64,)] * 4  # 8 x 16 KiB weights and 4 biases: 129 KiB


def params(seed: int = 0):
    torch.manual_seed(seed)
    return [torch.randn(*s) / 8 for s in SHAPES]


def grads(step: int):
    torch.manual_seed(100 + step)
    return [torch.randn(*s) for s in SHAPES]


OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam-per-parameter": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "two-groups": lambda ps: torch.optim.AdamW([{"params": ps[:6]}, {"params": ps[6:], "lr": 1e-3}], lr=1e-2,
                                               foreach=True),
}


def counted_parts():
    """The parts each step ran in (1: whole), counted until ``optimizers.parts`` is restored."""
    split = []
    real = optimizers.parts

    def counting(opt):
        out = real(opt)
        split.append(1 if out is None else len(out))
        return out

    optimizers.parts = counting
    return split, real


def train(ps, make, steps: int = 3):
    """``steps`` steps of ``make(ps)`` on fixed gradients; the bytes each step moved."""
    opt = make(ps)
    moved = []
    for step in range(steps):
        with torch.no_grad():
            for p, g in zip(ps, grads(step)):
                p.grad = g.to(p.device)
        tm.reset_stats()
        opt.step()
        stats = tm.stats()
        moved.append((stats["bytes_to_device"], stats["bytes_to_host"]))
    return ps, opt, moved


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_step_in_parts_gives_plain_torch_s_parameters_and_moves_each_tensor_once(fresh_manager, name):
    with plain_torch():
        dev = tm.torch_device
        expected, _, _ = train([p.to(dev).requires_grad_() for p in params()], OPTIMIZERS[name])
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    tm.strategy = "flow"
    tm.budget = budget(96 * KIB)  # the parameters alone do not fit, with gradients and state
    split, real_parts = counted_parts()
    try:
        managed, opt, moved = train(ps, OPTIMIZERS[name])
    finally:
        optimizers.parts = real_parts
    assert_identical([p.detach() for p in expected], [p.detach() for p in managed])
    assert min(split) > 1  # (every step ran in parts)
    assert tm.stats()["peak_device_bytes"] <= tm.budget
    # Steady state: each parameter, gradient and state tensor comes in about once, and goes
    # back about once (a gradient the step has not reached yet may be written back to make
    # room for the part before it; a per-parameter loop's temporaries may push a tensor of
    # its part out once: 10% more on torch 2.11 with CUDA's rounding). The list ops without
    # parts moved 2.9x this (AdamW), 1.7x (SGD).
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim())
    weights = sum(p.numel() * p.element_size() for p in managed)
    once = 2 * weights + state + 4 * KIB  # (the step counts: a few scalars)
    to_device, to_host = moved[-1]
    assert to_device <= 1.25 * once
    assert to_host <= 1.25 * once


@pytest.mark.parametrize("views,paged", [(True, True), (True, False), (False, True)],
                         ids=["regions, the budget pages", "regions, nothing paged yet", "op by op"])
def test_a_step_takes_parts_of_an_eighth_of_the_share_only_on_views_where_the_budget_pages(
        fresh_manager, monkeypatch, views, paged):
    # (516 KiB of parameters, gradients and state: more than an eighth of a 2 MiB budget, at
    # most half of it; op by op, and until the budget pages, parts take half the share)
    monkeypatch.setattr(torchTensorRef.regions, "enabled", views)
    with plain_torch():
        dev = tm.torch_device
        expected, _, _ = train([p.to(dev).requires_grad_() for p in params()], OPTIMIZERS["adamw-foreach"], 4)
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    tm.strategy = "flow"
    tm.budget = budget(2048 * KIB)
    if paged:
        tm.note_pressure()  # (as room made by evicting does)
    split, real_parts = counted_parts()
    try:
        managed, _, _ = train(ps, OPTIMIZERS["adamw-foreach"], 4)
    finally:
        optimizers.parts = real_parts
    assert (min(split) > 1) if views and paged else split == [1] * 4
    assert_identical([p.detach() for p in expected], [p.detach() for p in managed])
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def test_a_step_with_a_closure_runs_whole(fresh_manager):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    tm.budget = budget(96 * KIB)
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = sum((p * p).sum() for p in ps)
        loss.backward()
        return loss

    opt.step(closure)
    assert len(calls) == 1  # (the loss is evaluated once, not once per part)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def test_the_step_s_hooks_run_once_per_step(fresh_manager):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    tm.budget = budget(96 * KIB)
    opt = torch.optim.AdamW(ps, lr=1e-2, foreach=True)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    for p, g in zip(ps, grads(0)):
        p.grad = g
    assert optimizers.parts(opt) is not None  # (it runs in parts)
    opt.step()
    assert seen == ["pre", "post"]
    assert all(len(g["params"]) for g in opt.param_groups)  # (the groups are whole again)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


# -- Note [Optimizer steps on plain tensors] ----------------------------------------------------

PLAIN_STEP_OPTIMIZERS = {
    **OPTIMIZERS,
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),  # (no state at all)
    "nadam-per-parameter": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=False),
    "adagrad-foreach": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=True),
    "rmsprop-default": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
}


def counted_steps():
    """The steps that ran on plain tensors, counted while the context is open."""
    calls = []
    real = optimizers.run_on_views

    def counting(*args):
        calls.append(1)
        return real(*args)

    optimizers.run_on_views = counting
    return calls, real


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
@pytest.mark.parametrize("name", list(PLAIN_STEP_OPTIMIZERS))
def test_a_step_with_nothing_to_page_runs_on_plain_tensors_as_plain_torch(fresh_manager, name, strategy):
    steps = 4
    make = PLAIN_STEP_OPTIMIZERS[name]
    with plain_torch():
        dev = tm.torch_device
        plain_ps = [p.to(dev).requires_grad_() for p in params()]
        expected, plain_opt, _ = train(plain_ps, make, steps)
    tm.strategy = strategy
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    calls, real = counted_steps()
    try:
        managed, opt, _ = train(ps, make, steps)
    finally:
        optimizers.run_on_views = real
    assert len(calls) == steps - 1  # (the first step makes the state: op by op)
    assert_identical([p.detach() for p in expected], [p.detach() for p in managed])
    assert_identical([dict(plain_opt.state[p]) for p in plain_ps], [dict(opt.state[p]) for p in managed])
    assert all(type(p) is TensorRef and type(p.grad) is TensorRef for p in managed)
    assert all(type(v) is TensorRef for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert [p._version for p in managed] == [p._version for p in expected]  # (autograd's in-place checks)
    # Genoa wrote every block back after the step: the host copies hold what the step wrote
    tm.evict_all()
    assert_identical([p.detach() for p in expected], [p.detach() for p in managed])


def test_the_step_on_plain_tensors_is_one_op_of_the_manager(fresh_manager):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    _, opt, _ = train(ps, OPTIMIZERS["adamw-foreach"], 2)
    for p, g in zip(ps, grads(5)):
        p.grad = g
    before = tm.stats()["ops"]
    state_dicts = [opt.state[p] for p in ps]
    opt.step()
    assert tm.stats()["ops"] - before == 1
    assert all(opt.state[p] is s for p, s in zip(ps, state_dicts))  # (the same dicts, the same parameters)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], ps))


def test_a_parameter_without_a_gradient_is_left_as_it_is(fresh_manager):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    managed, opt, _ = train(ps, OPTIMIZERS["adamw-foreach"], 2)
    frozen = managed[0].detach().clone()
    managed[0].grad = None
    calls, real = counted_steps()
    try:
        opt.step()  # (what it steps changed: op by op, and remembered)
        opt.step()  # (on plain tensors again)
    finally:
        optimizers.run_on_views = real
    assert calls == [1]
    assert torch.equal(managed[0].detach(), frozen)
    assert type(managed[0]) is TensorRef and managed[0].grad is None


@pytest.mark.parametrize("why", ["closure", "tensor argument", "tensor learning rate", "plain gradient"])
def test_a_step_the_manager_cannot_give_plain_tensors_runs_op_by_op(fresh_manager, why):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    lr = torch.tensor(1e-2) if why == "tensor learning rate" else 1e-2
    _, opt, _ = train(ps, lambda ps: torch.optim.AdamW(ps, lr=lr, foreach=False), 2)
    if why == "plain gradient":
        with torchTensorRef.disabled(device=tm.torch_device):
            ps[0].grad = torch.ones(ps[0].shape, device=tm.torch_device)
    calls, real = counted_steps()
    try:
        if why == "closure":
            opt.step(lambda: None)
        elif why == "tensor argument":
            # (as GradScaler calls a fused step: AdamW's own step takes no such argument, so
            # the step given to the wrapper records what it was given)
            given = []
            optimizers.step_wrapper(lambda **kwargs: given.append(kwargs), opt, (), {"found_inf": torch.zeros(())})
            assert len(given) == 1 and type(given[0]["found_inf"]) is TensorRef
        else:
            opt.step()
    finally:
        optimizers.run_on_views = real
    assert calls == []


def test_an_error_inside_the_step_leaves_the_optimizer_as_it_was(fresh_manager):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    _, opt, _ = train(ps, OPTIMIZERS["adamw-foreach"], 2)
    groups = [list(g["params"]) for g in opt.param_groups]
    state = {id(p): dict(opt.state[p]) for p in ps}
    betas = opt.param_groups[0]["betas"]
    opt.param_groups[0]["betas"] = (0.9,)  # (the step reads two)
    calls, real = counted_steps()
    try:
        with pytest.raises(ValueError):
            opt.step()
    finally:
        opt.param_groups[0]["betas"] = betas
        optimizers.run_on_views = real
    assert calls == [1]
    assert all(a is b for g, h in zip(opt.param_groups, groups) for a, b in zip(g["params"], h))
    assert all(type(p.grad) is TensorRef for p in ps)
    assert all(opt.state[p][k] is v for p in ps for k, v in state[id(p)].items())
    assert all(b.pins == 0 for b in tm.books.blocks.values())
    opt.step()  # (and it steps again)


@pytest.mark.parametrize("kib", [None, 4], ids=["no budget", "paging"])
def test_a_training_loop_as_users_write_it_steps_on_plain_tensors_as_plain_torch(fresh_manager, kib):
    # default AdamW (the device's choice of kernels), gradients zeroed both ways and clipped
    # op by op, a scheduler, the optimizer saved and restored midway; under a budget, the
    # model and the step page
    def loop():
        dev = tm.torch_device
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dev)
        for i in range(8):
            opt.zero_grad(set_to_none=i % 2 == 0)
            m(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            sched.step()
            if i == 3:
                saved = io.BytesIO()
                torch.save(opt.state_dict(), saved)
                saved.seek(0)
                opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
                opt.load_state_dict(torch.load(saved))
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        return [p.detach() for p in m.parameters()], opt

    with plain_torch():
        expected, _ = loop()
    tm.strategy = "flow"
    tm.budget = None if kib is None else budget(kib * KIB)
    tm.reset_stats()
    calls, real = counted_steps()
    try:
        managed, opt = loop()
    finally:
        optimizers.run_on_views = real
    if kib is None:
        assert len(calls) == 6  # (all but the first step of each optimizer, which makes its state)
    else:
        # (and the second, which measures what each part allocates inside)
        assert len(calls) == 4 * len(optimizers.parts(opt)) > 4
        assert tm.stats()["evictions"] > 0 and tm.stats()["peak_device_bytes"] <= tm.budget
    assert_identical(expected, managed)
    assert all(type(v) is TensorRef for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


# -- Note [Optimizer steps under a budget] ------------------------------------------------------

@pytest.mark.parametrize("fits", [False, True], ids=["in parts", "whole"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_steady_step_under_a_budget_runs_each_part_on_plain_tensors_as_plain_torch(fresh_manager, name, fits):
    steps = 5
    with plain_torch():
        dev = tm.torch_device
        plain_ps = [p.to(dev).requires_grad_() for p in params()]
        expected, plain_opt, _ = train(plain_ps, OPTIMIZERS[name], steps)
    tm.strategy = "flow"
    tm.budget = budget((8192 if fits else 256) * KIB)  # (129 KiB of parameters: 4x that with state)
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    calls, real = counted_steps()
    split, real_parts = counted_parts()
    try:
        managed, opt, moved = train(ps, OPTIMIZERS[name], steps)
    finally:
        optimizers.run_on_views = real
        optimizers.parts = real_parts
    assert (split[-1] == 1) == fits and len(set(split[2:])) == 1
    # (the first step makes the state, the second measures what each part allocates inside)
    assert len(calls) == (steps - 2) * split[-1]
    assert_identical([p.detach() for p in expected], [p.detach() for p in managed])
    assert_identical([dict(plain_opt.state[p]) for p in plain_ps], [dict(opt.state[p]) for p in managed])
    assert [p._version for p in managed] == [p._version for p in expected]
    assert tm.stats()["peak_device_bytes"] <= tm.budget
    assert all(b.pins == 0 for b in tm.books.blocks.values())


def test_a_step_on_plain_tensors_leaves_the_gradients_it_read_clean(fresh_manager):
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    tm.strategy = "flow"
    tm.budget = budget(8192 * KIB)
    _, opt, _ = train(ps, OPTIMIZERS["adamw-foreach"], 3)
    for p, g in zip(ps, grads(7)):
        p.grad = g
    tm.evict_all()  # (every gradient's host copy current: evicted now, it would be dropped)
    calls, real = counted_steps()
    try:
        opt.step()
    finally:
        optimizers.run_on_views = real
    assert calls == [1]
    assert all(p.proxyInfo.dirty for p in ps)  # (written on the device)
    assert not any(p.grad.proxyInfo.dirty for p in ps)  # (read alone)
    tm.reset_stats()
    tm.evict_all()
    written_back = sum(p.numel() * p.element_size() for p in ps)
    assert tm.stats()["bytes_to_host"] < written_back + sum(  # (the parameters and state, not the gradients)
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim()) + 4 * KIB


def test_a_part_whose_room_does_not_fit_runs_op_by_op(fresh_manager):
    with plain_torch():
        dev = tm.torch_device
        expected, _, _ = train([p.to(dev).requires_grad_() for p in params()], OPTIMIZERS["adamw-foreach"], 4)
    ps = [torchTensorRef.manage(p).requires_grad_() for p in params()]
    tm.strategy = "flow"
    tm.budget = budget(256 * KIB)
    opt = OPTIMIZERS["adamw-foreach"](ps)
    real = optimizers.run_on_views
    refused = []

    def refusing(*args):
        try:
            return real(*args)
        except torchTensorRef.OutOfBudgetError:
            refused.append(1)
            raise

    optimizers.run_on_views = refusing
    try:
        for step in range(4):
            if step == 3:  # (measured: each part asks for more room than the whole budget)
                peaks = optimizers._peaks[opt]
                for key in peaks:
                    peaks[key] = tm.budget
            with torch.no_grad():
                for p, g in zip(ps, grads(step)):
                    p.grad = g.to(p.device)
            opt.step()
    finally:
        optimizers.run_on_views = real
    assert len(refused) == len(optimizers._peaks[opt]) > 1
    assert_identical([p.detach() for p in expected], [p.detach() for p in ps])
    assert all(b.pins == 0 for b in tm.books.blocks.values())
    assert tm.stats()["peak_device_bytes"] <= tm.budget
