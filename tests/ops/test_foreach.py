"""List ops (``_foreach_*``, fused optimizers) larger than the budget run in slices that fit."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import OutOfBudgetError, TensorRef, strategies
from paired import assert_identical, budget, plain_torch

aten = torch.ops.aten
N, SIZE = 10, 256  # ten tensors of 1 KiB each
BUDGET = 5 * 1024 + 512  # one position of a fused AdamW step (four lists), a few of smaller ops


def _lists(count, seed=0):
    """``count`` lists of N float tensors: managed and plain (on their device), from the same seed."""
    torch.manual_seed(seed)
    managed = [[torch.rand(SIZE) + 1 for _ in range(N)] for _ in range(count)]
    with plain_torch():
        torch.manual_seed(seed)
        plain = [[torch.rand(SIZE) + 1 for _ in range(N)] for _ in range(count)]
    return managed, plain


def _same(managed, plain):
    assert len(managed) == len(plain)
    for m, p in zip(managed, plain):
        assert isinstance(m, TensorRef)
        assert_identical(p, m)


@pytest.fixture(params=strategies.NAMES)
def budgeted(request, fresh_manager):
    """Sets the budget when called: after the plain reference ran, whose tensors (plain CUDA
    tensors on a GPU) the device holds outside the manager, so that the budget covers them."""
    fresh_manager.strategy = request.param

    def arm():
        fresh_manager.budget = budget(BUDGET)
        fresh_manager.reset_stats()

    yield arm
    assert fresh_manager.stats()["peak_device_bytes"] <= BUDGET


@pytest.mark.parametrize("call", [
    lambda xs, ys, zs: aten._foreach_add_.List(xs, ys, alpha=2),
    lambda xs, ys, zs: aten._foreach_mul_.Scalar(xs, 3.0),
    lambda xs, ys, zs: aten._foreach_addcdiv_.Scalar(xs, ys, zs, value=0.5),
    lambda xs, ys, zs: aten._foreach_addcdiv_.ScalarList(xs, ys, zs, [float(i) for i in range(N)]),
    lambda xs, ys, zs: aten._foreach_lerp_.Scalar(xs, ys, 0.25),
], ids=["add_List", "mul_Scalar", "addcdiv_Scalar", "addcdiv_ScalarList", "lerp_Scalar"])
def test_in_place(budgeted, call):
    (xs, ys, zs), (pxs, pys, pzs) = _lists(3)
    with plain_torch():
        call(pxs, pys, pzs)
    budgeted()
    call(xs, ys, zs)
    _same(xs, pxs)
    _same(ys, pys)


def test_per_position_scalars_tensor(budgeted):
    # addcmul_.Tensor takes one scalar per position in a 1-D tensor: it is sliced with the
    # lists. The scalars are read on the host: a tensor of them on the device is refused, as
    # on CUDA (a plain CPU tensor in both runs).
    (xs, ys, zs), (pxs, pys, pzs) = _lists(3)
    with torchTensorRef.disabled():
        scalars = torch.arange(N, dtype=torch.float32)
    with plain_torch():
        aten._foreach_addcmul_.Tensor(pxs, pys, pzs, scalars)
    budgeted()
    aten._foreach_addcmul_.Tensor(xs, ys, zs, scalars)
    _same(xs, pxs)


@pytest.mark.parametrize("call", [
    lambda xs, ys: aten._foreach_mul.Scalar(xs, 3.0),
    lambda xs, ys: aten._foreach_add.List(xs, ys),
    lambda xs, ys: aten._foreach_sqrt.default(xs),
    lambda xs, ys: aten._foreach_norm.Scalar(xs),
], ids=["mul_Scalar", "add_List", "sqrt", "norm"])
def test_out_of_place(budgeted, call):
    (xs, ys), (pxs, pys) = _lists(2)
    with plain_torch():
        expected = call(pxs, pys)
    budgeted()
    out = call(xs, ys)
    _same(out, expected)
    _same(xs, pxs)


def test_amp_unscale_sees_every_slice(budgeted):
    # found_inf is shared by all slices: an inf in the last position must still set it.
    (grads,), (pgrads,) = _lists(1)
    with plain_torch():
        pgrads[-1][0] = float("inf")
        pfound = torch.zeros(1)
        aten._amp_foreach_non_finite_check_and_unscale_(pgrads, pfound, torch.full((1,), 0.5))
    grads[-1][0] = float("inf")
    found = torch.zeros(1)
    inv_scale = torch.full((1,), 0.5)
    budgeted()
    aten._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)
    _same(grads, pgrads)
    assert_identical(pfound, found)
    assert pfound.item() == 1.0


@pytest.mark.parametrize("options", [dict(foreach=True), dict(fused=True)], ids=["foreach", "fused"])
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_optimizer_steps(budgeted, optimizer, options):
    (params, grads), (pparams, pgrads) = _lists(2)
    kwargs = dict(lr=0.1, momentum=0.9) if optimizer == "SGD" else dict(lr=0.1)
    with plain_torch():
        pparams = [torch.nn.Parameter(p) for p in pparams]
        for p, g in zip(pparams, pgrads):
            p.grad = g
        popt = getattr(torch.optim, optimizer)(pparams, **kwargs, **options)
        for _ in range(2):
            popt.step()
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt = getattr(torch.optim, optimizer)(params, **kwargs, **options)
    budgeted()
    for _ in range(2):
        opt.step()
    _same(params, pparams)


def test_optimizer_step_under_a_host_budget_alone_runs_in_slices(fresh_manager, tmp_path):
    # No device budget, a host budget below the step's lists, Genoa (which sends every
    # tensor back to the host after its op): the tensors are read back from disk into host
    # copies, so the step (whole, on plain tensors, or its list ops) goes in parts that fit
    # the host budget too (all four lists at once were refused: "reading a tensor back from
    # disk needs ... of host memory").
    (params, grads), (pparams, pgrads) = _lists(2)
    with plain_torch():
        pparams = [torch.nn.Parameter(p) for p in pparams]
        for p, g in zip(pparams, pgrads):
            p.grad = g
        popt = torch.optim.AdamW(pparams, lr=0.1, foreach=True)
        for _ in range(2):
            popt.step()
    fresh_manager.strategy = "genoa"
    params = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=0.1, foreach=True)
    fresh_manager.offload_dir = tmp_path
    fresh_manager.host_budget = 2 * N * SIZE * 4  # (the lists are four times the weights)
    try:
        for _ in range(2):
            opt.step()
        assert fresh_manager.stats()["bytes_to_disk"] > 0
        _same(params, pparams)
    finally:
        fresh_manager.host_budget = None


def test_fits_whole_runs_as_one_op(fresh_manager):
    (xs, ys), _ = _lists(2)
    fresh_manager.budget = budget(2 * N * SIZE * 4)
    fresh_manager.reset_stats()
    aten._foreach_add_.List(xs, ys)
    assert fresh_manager.stats()["ops"] == 1


def test_position_too_large_runs_in_chunks(fresh_manager):
    # The last position alone (8 KiB of two lists) is larger than the budget: it runs in
    # chunks of its elements, with the bits of one call.
    (xs, ys), (pxs, pys) = _lists(2)
    torch.manual_seed(1)
    xs[-1], ys[-1] = torch.rand(4 * SIZE), torch.rand(4 * SIZE)
    with plain_torch():
        torch.manual_seed(1)
        pxs[-1], pys[-1] = torch.rand(4 * SIZE), torch.rand(4 * SIZE)
        aten._foreach_addcmul_.Scalar(pxs, pys, pys, value=0.5)
    fresh_manager.budget = budget(BUDGET)  # (after the plain reference, which it covers on a GPU)
    fresh_manager.reset_stats()
    aten._foreach_addcmul_.Scalar(xs, ys, ys, value=0.5)
    _same(xs, pxs)
    assert fresh_manager.stats()["peak_device_bytes"] <= BUDGET


@pytest.mark.parametrize("strategy, in_place", [("genoa", True), ("genoa", False), ("flow", True), ("flow", False)])
def test_chunks_land_in_the_host_copy_without_host_waits(fresh_manager, monkeypatch, strategy, in_place):
    # The pieces of a position larger than the budget alias its host copy, and the results
    # of an op that makes new tensors land in a big result's host copy (Note [Pieces] in
    # ops/pieces.py): each chunk's write-back lands there asynchronously and the host copy
    # waits for them, so the host does not wait once per chunk (it did: 6 times a call in
    # place, 16 out of place). Copies last two ops on "sim" (their destinations poison until
    # then): the next call's pieces, and reading the values, must see every chunk's bytes.
    # (Genoa writes an op's results back as it ends: a chunk's result is made with its range
    # of the big result as its host copy, or the host waited for each, 16 times a call.)
    monkeypatch.setattr(fresh_manager, "sim_copy_ops", 2)
    fresh_manager.strategy = strategy
    (xs, ys), (pxs, pys) = _lists(2)
    torch.manual_seed(1)
    xs[-1], ys[-1] = torch.rand(16 * SIZE), torch.rand(16 * SIZE)

    def call(xs, ys):
        if in_place:
            aten._foreach_addcmul_.Scalar(xs, ys, ys, value=0.5)
            return xs
        return aten._foreach_add.List(aten._foreach_mul.Scalar(xs, 0.5), ys)

    with plain_torch():
        torch.manual_seed(1)
        pxs[-1], pys[-1] = torch.rand(16 * SIZE), torch.rand(16 * SIZE)
        for _ in range(3):
            pxs = call(pxs, pys)
    fresh_manager.budget = budget(BUDGET)
    fresh_manager.reset_stats()
    for _ in range(3):
        xs = call(xs, ys)
    stats = fresh_manager.stats()
    assert stats["host_syncs"] == 0 and stats["writebacks"] >= 3 * 4  # (four chunks a call at least)
    _same(xs, pxs)
    assert fresh_manager.stats()["peak_device_bytes"] <= BUDGET


def test_position_that_cannot_be_chunked_fails_before_writing(fresh_manager):
    (xs, ys), (pxs, _pys) = _lists(2)
    xs[-1], ys[-1] = torch.ones(2 * SIZE, 2).t(), torch.ones(2, 2 * SIZE)  # not contiguous: no flat chunks
    fresh_manager.budget = budget(BUDGET)  # every position fits but the last (8 KiB)
    with pytest.raises(OutOfBudgetError, match="_foreach_add_"):
        aten._foreach_add_.List(xs, ys)
    _same(xs[:-1], pxs[:-1])  # no slice ran


@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_per_position_scalars_made_under_the_manager_are_read_on_the_host(fresh_manager, sliced):
    # Fixed: torch.arange under the manager gives a TensorRef of the device (plain torch on the
    # CPU gave a CPU tensor), which went to the kernel as a device tensor: CUDA's kernels
    # raise "Expected scalars to be on CPU" (as the strict "sim" now does). They get its host copy.
    (xs, ys, zs), (pxs, pys, pzs) = _lists(3)
    with plain_torch():
        host_scalars = torch.arange(N, dtype=torch.float32, device="cpu")
        aten._foreach_addcdiv_.Tensor(pxs, pys, pzs, host_scalars)
        expected = aten._foreach_addcmul.Tensor(pys, pzs, pxs, host_scalars)
    if sliced:
        fresh_manager.budget = budget(BUDGET)  # (after the plain reference: it covers its tensors on a GPU)
    scalars = torch.arange(N, dtype=torch.float32)
    assert isinstance(scalars, TensorRef) and scalars.device == fresh_manager.torch_device
    aten._foreach_addcdiv_.Tensor(xs, ys, zs, scalars)
    _same(xs, pxs)
    _same(aten._foreach_addcmul.Tensor(ys, zs, xs, scalars=scalars), expected)
    assert_identical(host_scalars, scalars)  # (read, not written)
    if sliced:
        assert fresh_manager.stats()["peak_device_bytes"] <= BUDGET


def test_per_position_scalars_on_the_device_are_refused_as_on_cuda(fresh_manager):
    # A plain tensor of the device (not one the manager made) is the program's own choice:
    # refused as plain torch on CUDA refuses it, on the strict "sim" too.
    (xs, ys, zs), _plain = _lists(3)
    with plain_torch():
        scalars = torch.arange(N, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="Expected scalars to be on CPU"):
        aten._foreach_addcmul_.Tensor(xs, ys, zs, scalars)
