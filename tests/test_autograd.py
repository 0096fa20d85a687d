"""Autograd, hooks, checkpointing, grad modes, optimizers and Parameters: managed vs plain."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils.checkpoint import checkpoint

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager

from paired import assert_identical, paging, run_both  # noqa: F401  (paging is a fixture)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def grads(module):
    return [p.grad for p in module.parameters()]


# -- backward -------------------------------------------------------------------------------

def test_backward_gives_the_same_gradients(paging):
    def run():
        m = mlp()
        x = torch.randn(4, 6, requires_grad=True)
        loss = m(x).pow(2).mean()
        loss.backward()
        return loss, x.grad, grads(m)

    assert_identical(*run_both(run))


def test_torch_func_per_sample_gradients_and_a_jacobian(paging):
    # (torch.func's transforms reach the manager as the plain ops of their batching rules:
    # per-sample gradients as Opacus computes them, a Jacobian through jacrev)
    def run():
        m = mlp()
        params = {k: v.detach() for k, v in m.named_parameters()}
        x, y = torch.randn(4, 6), torch.randn(4, 3)

        def loss(p, xi, yi):
            return (torch.func.functional_call(m, p, (xi.unsqueeze(0),)) - yi).pow(2).sum()

        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
        jacobian = torch.func.jacrev(lambda xi: torch.func.functional_call(m, params, (xi,)))(x[0])
        return [per_sample[k] for k in sorted(per_sample)] + [jacobian]

    assert_identical(*run_both(run))


def test_retain_graph_allows_a_second_backward_and_only_then(paging):
    def run():
        m = mlp()
        y = m(torch.randn(4, 6)).pow(2).sum()
        y.backward(retain_graph=True)
        y.backward()
        out = grads(m)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.backward()
        return out

    assert_identical(*run_both(run))


def test_autograd_grad_and_double_backward(paging):
    def run():
        x = torch.randn(5, requires_grad=True)
        y = (x.sin() * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.pow(2).sum().backward()
        return g, x.grad

    assert_identical(*run_both(run))


def test_writes_through_views_of_activations_are_differentiated(paging):
    def run():
        x = torch.randn(4, 5, requires_grad=True)
        y = x * 1
        y[1:3].mul_(2)
        y.t()[0].add_(y[:, 1].clone())
        (y * y).sum().backward()
        return y, x.grad

    assert_identical(*run_both(run))


def test_modifying_a_saved_tensor_is_detected(paging):
    def run():
        x = torch.randn(3, requires_grad=True)
        y = x.exp()
        y.add_(1)  # exp saved its result for backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        return y

    assert_identical(*run_both(run))


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


def test_custom_autograd_function(paging):
    def run():
        x = torch.randn(5, requires_grad=True)
        Square.apply(x).sum().backward()
        return x.grad

    assert_identical(*run_both(run))


def test_saved_tensors_hooks_see_and_return_tensor_refs(paging):
    def run():
        packed = []

        def pack(t):
            packed.append(type(t).__name__)
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m = mlp()
            y = m(torch.randn(4, 6)).sum()
        y.backward()
        return grads(m), len(packed)

    plain, managed = run_both(run)
    assert_identical(plain, managed)


# -- hooks ------------------------------------------------------------------------------------

def test_tensor_and_module_hooks(paging):
    def run():
        m = mlp()
        x = torch.randn(4, 6, requires_grad=True)
        seen = []
        x.register_hook(lambda g: g * 2)
        m[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        # (detached: a clone with its graph in ``seen``, which the weight's hook holds, is a
        # cycle through autograd's nodes that gc cannot free, in plain torch as here: the
        # plain run's device tensors would outlive the test, read as outside the manager)
        m[1].register_forward_pre_hook(lambda mod, inp: seen.append(inp[0].detach().clone()))
        m[1].register_forward_hook(lambda mod, inp, out: out * 3)
        m[2].register_full_backward_hook(lambda mod, gin, gout: seen.append((gin[0].clone(), gout[0].clone())))
        m[0].register_full_backward_pre_hook(lambda mod, gout: (gout[0] * 0.5,))
        m(x).sum().backward()
        return seen, x.grad, grads(m)

    plain, managed = run_both(run)
    assert_identical(plain, managed)
    assert type(managed[1]) is TensorRef


def test_hooks_receive_tensor_refs():
    kinds = []
    x = torch.randn(3, requires_grad=True)
    x.register_hook(lambda g: kinds.append(type(g)))
    (x * 2).sum().backward()
    assert kinds == [TensorRef]


# -- checkpointing and grad modes ---------------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint(use_reentrant, paging):
    def run():
        m = mlp()
        x = torch.randn(4, 6, requires_grad=True)
        y = checkpoint(lambda t: m[2](m[1](m[0](t))), x, use_reentrant=use_reentrant)
        y.pow(2).sum().backward()
        return y, x.grad, grads(m)

    assert_identical(*run_both(run))


def test_checkpoint_with_dropout_replays_the_same_randomness(paging):
    def run():
        layer = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5))
        x = torch.randn(4, 6, requires_grad=True)
        checkpoint(layer, x, use_reentrant=False).sum().backward()
        return x.grad, grads(layer)

    assert_identical(*run_both(run))


def test_no_grad(paging):
    def run():
        m = mlp()
        with torch.no_grad():
            y = m(torch.randn(4, 6))
        return y, y.requires_grad, y.grad_fn is None

    assert_identical(*run_both(run))


def test_inference_mode(paging):
    def run():
        m = mlp()
        with torch.inference_mode():
            y = m(torch.randn(4, 6))
            z = y * 2
        out = [y, z, y.is_inference(), y.requires_grad]
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            y.add_(1)  # outside inference mode: refused by torch
        return out

    plain, managed = run_both(run)
    assert_identical(plain, managed)
    assert type(managed[0]) is TensorRef and managed[2]


@pytest.mark.parametrize("op", ["list op", "one tensor"])
def test_a_write_to_a_saved_tensor_fails_its_backward_as_in_plain_torch(op, paging):
    # (Note [Versions of list writes]: a list op moved no counter of a TensorRef's, and the
    # backward ran on the written values where plain torch refuses)
    def run():
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3)
        y = (x * w).sum()
        before = w._version
        if op == "list op":
            torch._foreach_mul_([w], 2.0)
        else:
            w.mul_(2.0)
        moved = w._version - before
        try:
            y.backward()
        except RuntimeError as e:
            return moved, "modified by an inplace operation" in str(e)
        return moved, None

    plain, managed = run_both(run)
    assert plain == managed == (1, True)


def test_enable_grad_inside_no_grad(paging):
    def run():
        x = torch.randn(3, requires_grad=True)
        with torch.no_grad():
            with torch.enable_grad():
                y = (x * x).sum()
            z = x * 2
        y.backward()
        return x.grad, z.requires_grad

    assert_identical(*run_both(run))


# -- optimizers -----------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_nesterov_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adamw_amsgrad_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, foreach=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_give_bit_identical_parameters(name, paging):
    def run():
        m = mlp()
        opt = OPTIMIZERS[name](m.parameters())
        x = torch.randn(5, 6)
        for _ in range(4):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        state = [dict(s) for s in opt.state.values()]
        return [p.detach() for p in m.parameters()], state

    plain, managed = run_both(run)
    assert_identical(plain, managed)
    buffers = [v for s in managed[1] for v in s.values() if isinstance(v, torch.Tensor)]
    assert buffers and all(type(v) is TensorRef for v in buffers)  # optimizer state is paged too


def test_optimizer_state_dict_round_trip(paging):
    def run():
        m = mlp()
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        x = torch.randn(5, 6)
        m(x).sum().backward()
        opt.step()
        saved = opt.state_dict()
        opt2 = torch.optim.Adam(m.parameters(), lr=0.01)
        opt2.load_state_dict(saved)
        opt2.zero_grad()
        m(x).sum().backward()
        opt2.step()
        return [p.detach() for p in m.parameters()]

    assert_identical(*run_both(run))


# -- Parameters ------------------------------------------------------------------------------

def test_parameters_stay_parameters():
    m = mlp()
    for p in m.parameters():
        assert isinstance(p, torch.nn.Parameter) and type(p) is TensorRef and p.requires_grad
    assert len(list(m.parameters())) == 4
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    assert isinstance(frozen, torch.nn.Parameter) and not frozen.requires_grad


def test_tied_parameters_stay_one_object_and_one_block(paging):
    def run():
        m = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
        m[1].weight = m[0].weight
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        tokens = torch.tensor([1, 2, 3])
        for _ in range(3):
            opt.zero_grad()
            m(tokens).pow(2).sum().backward()
            opt.step()
        return m

    plain, managed = run_both(run)
    assert managed[0].weight is managed[1].weight
    assert len(list(managed.parameters())) == len(list(plain.parameters())) == 1
    assert_identical(plain[0].weight.detach(), managed[0].weight.detach())


def test_parameters_sharing_a_storage_share_a_block():
    base = torch.zeros(4, 3)
    a = torch.nn.Parameter(base[:2])
    b = torch.nn.Parameter(base[2:])
    assert a.proxyInfo.block_id == b.proxyInfo.block_id == base.proxyInfo.block_id
    with torch.no_grad():
        a.fill_(1)
    assert base.sum().item() == 6.0


@pytest.mark.xfail(strict=True, reason=(
    "PyTorch: for a tensor subclass, autograd rebuilds a view's grad_fn by replaying the "
    "view ops on its base instead of using as_strided, and the replay fails once the base's "
    "geometry was changed in place (unsqueeze_) under no_grad; PyTorch's own TwoTensor fails alike"))
def test_view_of_a_base_restrided_in_place_under_no_grad():
    def run():
        x = torch.ones(2, requires_grad=True)
        v = x.permute(0)
        with torch.no_grad():
            x.unsqueeze_(1)
        return v.grad_fn is not None

    plain, managed = run_both(run)
    assert plain == managed


def test_the_view_replay_limitation_is_pytorchs():
    # Keeps the expected failure above honest: the same program fails on PyTorch's own subclass.
    with torchTensorRef.disabled():
        x = TwoTensor(torch.ones(2), torch.ones(2)).requires_grad_()
        v = x.permute(0)
        with torch.no_grad():
            x.unsqueeze_(1)
        with pytest.raises(RuntimeError, match="number of dimensions"):
            v.grad_fn
    assert tensorsManager.stats()["ops"] == 0


_STEP_IN_BACKWARD = """
import torch, torchTensorRef
from torchTensorRef import OutOfBudgetError, tensorsManager as tm
tm.device = "sim"; tm.strategy = "flow"
m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
def step(p):
    # an in-place list op whose tensors do not fit together, on a transposed gradient: it
    # cannot run in pieces either (a non-contiguous position), so it raises
    g = p.grad.t().contiguous().t()  # (p.grad's values, with transposed strides)
    with torch.no_grad():
        torch._foreach_addcmul_([p], [g], [g.clone()], value=1e-3)
    p.grad = None
for p in m.parameters():
    p.register_post_accumulate_grad_hook(step)
x = torch.randn(8, 32)
# (beside the workspaces) forward and backward fit; the 4 KiB weight's step (12 KiB) does not
tm.budget = tm.outside_bytes() + 8192
try:
    m(x).sum().backward()
except OutOfBudgetError as e:
    print("raised:", e.op)
print("went on:", tuple(m(x).shape))
"""


def test_an_optimizer_step_out_of_budget_in_a_gradient_hook_is_raised_by_backward():
    # Fixed: on "sim" the in-place _foreach_ op that failed returned a placeholder where torch
    # expects None; torch raised in the hook's Python code and the process aborted (5 runs in 6).
    import subprocess
    import sys

    for _ in range(3):
        for attempt in range(2):
            run = subprocess.run([sys.executable, "-c", _STEP_IN_BACKWARD], capture_output=True, text=True, timeout=120)
            # (in CI, under load, the interpreter aborted at exit after the script had printed
            # both lines, "terminate called without an active exception": autograd's thread
            # for the device was still letting go of the backward's task as the interpreter
            # finalized. The package now waits for it at exit (Note [Autograd's device thread
            # at exit]); a run that aborts there anyway is run again, once; an abort before the
            # script's end is not.)
            at_exit = run.returncode == -6 and "went on: (8, 4)" in run.stdout
            if run.returncode == 0 or attempt or not at_exit:
                break
        assert run.returncode == 0, run.stderr[-2000:]
        assert "raised: aten._foreach_" in run.stdout and "went on: (8, 4)" in run.stdout
