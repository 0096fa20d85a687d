"""Slices and chunks of ops larger than the budget fit the room as the budget counts it.

Two things can make a piece cut for the room not fit when it runs: the device's allocator
rounds each allocation up (CUDA's to 512 bytes; ``tensorsManager.sim_rounding`` makes
"sim" count so), and the room itself is a reading of what the device holds outside the
manager, which moves. Pieces are sized with the rounding, and a piece that still does not
fit runs again smaller (``ops.split.may_retry``): the results are plain torch's either way.
"""

from __future__ import annotations

import pytest
import torch

from torchTensorRef import TensorRef, strategies
from torchTensorRef.core.op_specs import spec_of
from torchTensorRef.ops import foreach, split
from torchTensorRef.core.tensor_ref import block_of
from paired import assert_identical, budget, plain_torch, to_plain

aten = torch.ops.aten


@pytest.fixture
def rounding(fresh_manager):
    """The device counts allocations as CUDA's caching allocator gives them."""
    if fresh_manager.torch_device.type == "sim":
        fresh_manager.sim_rounding = True
    yield fresh_manager
    fresh_manager.sim_rounding = False


def _lists(n, size, seed=0):
    torch.manual_seed(seed)
    managed = [[torch.rand(size) + 1 for _ in range(n)] for _ in range(2)]
    with plain_torch():
        torch.manual_seed(seed)
        plain = [[torch.rand(size) + 1 for _ in range(n)] for _ in range(2)]
    return managed, plain


def test_slices_of_small_tensors_are_sized_as_the_allocator_rounds_them(rounding):
    # 64 positions of two 16-byte tensors: 32 bytes each by their sizes, 1 KiB as allocated.
    (xs, ys), _ = _lists(64, 4)
    rounding.budget = budget(8 * 1024)
    func = aten._foreach_add_.List
    limit = split.room()
    slices = foreach._slices(spec_of(func), foreach._Layout(func), 64, [xs, ys], {"alpha": 2}, limit)
    assert len(slices) > 1 and not any(alone for _start, _stop, alone in slices)
    for start, stop, _alone in slices:
        assert split.refs_bytes([xs[start:stop], ys[start:stop]]) <= limit
    assert split.refs_bytes([xs, ys]) == 64 * 2 * split.block_bytes(16)


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_list_op_under_rounding_matches_plain_torch_within_the_budget(rounding, strategy):
    rounding.strategy = strategy
    (xs, ys), (pxs, pys) = _lists(64, 4)
    with plain_torch():
        aten._foreach_addcmul_.Scalar(pxs, pys, pys, value=0.5)
    share = 8 * 1024
    rounding.budget = budget(share)
    rounding.reset_stats()
    aten._foreach_addcmul_.Scalar(xs, ys, ys, value=0.5)
    for m, p in zip(xs, pxs):
        assert isinstance(m, TensorRef)
        assert_identical(p, m)
    assert rounding.stats()["peak_device_bytes"] <= share


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_slices_cut_for_too_much_room_run_again_smaller(fresh_manager, monkeypatch, strategy):
    # A reading of the room that is too high (what is outside the manager grew since): the
    # slices cut for it do not fit, and run as halves until they do, with plain torch's bits.
    fresh_manager.strategy = strategy
    (xs, ys), (pxs, pys) = _lists(16, 256)
    with plain_torch():
        aten._foreach_lerp_.Scalar(pxs, pys, 0.25)
        norms = aten._foreach_norm.Scalar(pxs, 2)
    share = 4 * 1024 + 512
    fresh_manager.budget = budget(share)
    fresh_manager.reset_stats()
    real_room = split.room
    monkeypatch.setattr(split, "room", lambda: real_room() + 16 * 1024)
    aten._foreach_lerp_.Scalar(xs, ys, 0.25)
    managed_norms = aten._foreach_norm.Scalar(xs, 2)
    for m, p in zip(xs, pxs):
        assert_identical(p, m)
    for m, p in zip(managed_norms, norms):
        assert_identical(p, m)
    assert fresh_manager.stats()["peak_device_bytes"] <= share


def test_a_chunk_cut_for_too_much_room_runs_again_smaller(fresh_manager, monkeypatch):
    # One position larger than the room: chunks of its elements; a chunk cut for a room
    # that is not there is cut again, smaller, before anything is written.
    fresh_manager.strategy = "genoa"
    (xs, ys), (pxs, pys) = _lists(1, 64 * 1024)
    with plain_torch():
        aten._foreach_mul_.List(pxs, pys)
    share = 128 * 1024
    fresh_manager.budget = budget(share)
    fresh_manager.reset_stats()
    real_room = split.room
    monkeypatch.setattr(split, "room", lambda: real_room() + 256 * 1024)
    aten._foreach_mul_.List(xs, ys)
    assert_identical(pxs[0], xs[0])
    assert fresh_manager.stats()["peak_device_bytes"] <= share


def test_an_op_that_writes_and_returns_new_tensors_is_not_run_twice():
    # (batch norm writes its running statistics and returns new tensors: its results are
    # adopted after its kernel, so an error there comes after the writes)
    assert not split.may_retry(spec_of(aten._native_batch_norm_legit.default))
    assert split.may_retry(spec_of(aten._foreach_add_.List))  # (in place: raises before writing)
    assert split.may_retry(spec_of(aten._foreach_add.List))  # (new results from unchanged inputs)


def test_a_view_cut_for_too_much_room_moves_nothing(fresh_manager, monkeypatch):
    # The transpose of a weight larger than the room: its geometry alone, whatever the room
    # reading said (a view writes nothing, so a failed attempt to bring it in loses nothing).
    from torchTensorRef.ops import split_handlers

    torch.manual_seed(0)
    w = torch.rand(64, 256)
    with plain_torch():
        torch.manual_seed(0)
        plain_w = torch.rand(64, 256)
    share = 32 * 1024
    fresh_manager.budget = budget(share)
    fresh_manager.evict_all()
    fresh_manager.reset_stats()
    real_room = split.room
    monkeypatch.setattr(split_handlers, "room", lambda: real_room() + 64 * 1024)
    wt = w.t()
    assert fresh_manager.stats()["bytes_to_device"] == 0
    assert wt.shape == (256, 64) and block_of(wt) is block_of(w)
    assert torch.equal(to_plain(wt), to_plain(plain_w.t()))  # (read from the host copy)
    assert fresh_manager.stats()["peak_device_bytes"] <= share


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_ops_that_fit_run_whole_without_sizing_themselves(fresh_manager, monkeypatch, strategy):
    # An op that might need pieces is sized (``split.fits``) only once the generic path
    # refuses it for the budget: every call of an op that fits ran that sizing before, about
    # a fifth of a small add's time on the per-op path.
    fresh_manager.strategy = strategy
    torch.manual_seed(0)
    a, b, w, bias = torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 32), torch.randn(32)
    with plain_torch():
        torch.manual_seed(0)
        pa, pb, pw, pbias = torch.randn(16, 32), torch.randn(16, 32), torch.randn(32, 32), torch.randn(32)

    def run(a, b, w, bias):
        return [a + b, torch.addmm(bias, a, w), a @ w, a.clone(), torch.softmax(a, -1), torch.cat([a, b], -1),
                a.mul_(0.5), torch.outer(bias, bias)]

    with plain_torch():  # (first: a library's workspaces, made by its first call, are outside bytes then)
        expected = run(pa, pb, pw, pbias)
    fresh_manager.budget = budget(64 * 1024)
    sized = []
    real_fits = split.fits
    monkeypatch.setattr(split, "fits", lambda *a, **k: sized.append(a[0].name) or real_fits(*a, **k))
    got = run(a, b, w, bias)
    assert sized == []
    for g, e in zip(got, expected):
        assert_identical(e, g)
    # (too large for the budget: sized, then split)
    big = torch.randn(256, 128)
    with plain_torch():
        expected = to_plain(big) * 2
    assert_identical(expected, big * 2)
    assert sized == ["aten.mul.Tensor"]
