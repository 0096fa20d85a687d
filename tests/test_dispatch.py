"""Regression tests for op-level bugs the OpInfo sweep found (``ops/``, ``tensor_ref.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef
from torchTensorRef.strategies import NAMES


@pytest.fixture(params=NAMES)
def strategy(request, fresh_manager):
    fresh_manager.strategy = request.param
    return request.param


def _pair(*shape, dtype=torch.float32, seed=0):
    """A plain tensor and a TensorRef over an independent copy of it."""
    with torchTensorRef.disabled():
        g = torch.Generator().manual_seed(seed)
        plain = torch.randn(*shape, generator=g, dtype=dtype)
        ref = TensorRef(plain.clone())
    return plain, ref


def test_patched_creation_functions_deepcopy_as_themselves():
    # copy.deepcopy(torch.zeros) raised "object proxy must define __deepcopy__()" once
    # torch was patched, so PyTorch's OpInfo database could not even be imported.
    assert copy.deepcopy(torch.zeros) is torch.zeros
    assert copy.copy(torch.rand) is torch.rand
    table = copy.deepcopy({"make": torch.ones, "n": [1, 2]})
    assert table["make"] is torch.ones


def test_native_batch_norm_running_stats_are_written_back(strategy, fresh_manager):
    # native_batch_norm updates running_mean/var in place without a (a!) schema annotation:
    # the update was made on the accelerator copy, never marked dirty, and dropped on eviction.
    x, rx = _pair(4, 3, 5, seed=1)
    mean, rmean = _pair(3, seed=2)
    var, rvar = _pair(3, seed=3)
    with torchTensorRef.disabled():
        var.abs_()
    rvar = TensorRef(var.clone())
    expected = torch.native_batch_norm(x, None, None, mean, var, True, 0.3, 1e-5)
    fresh_manager.budget = 3 * x.nbytes
    got = torch.native_batch_norm(rx, None, None, rmean, rvar, True, 0.3, 1e-5)
    for r in (rmean, rvar):
        r.toCPU()  # a clean eviction would have lost the update
    assert torch.equal(rmean.target, mean) and torch.equal(rvar.target, var)
    for g, e in zip(got, expected):
        assert torch.equal(g.target, e)


def test_conj_view_keeps_its_conjugate_bit(strategy):
    # x.conj() is a lazy view whose value is in its conjugate bit; the TensorRef wrapper and
    # the plain views rebuilt after a move lost the bit, so conj() returned x unchanged.
    x, rx = _pair(6, dtype=torch.complex64)
    ry = rx.conj()
    assert ry.is_conj()
    assert torch.equal(ry.target.resolve_conj(), x.conj().resolve_conj())
    assert torch.equal((ry * 2).target, x.conj() * 2)
    assert torch.equal(copy.deepcopy(ry).target.resolve_conj(), x.conj().resolve_conj())


def test_neg_view_keeps_its_negative_bit(strategy):
    # x.conj().imag is a lazy negative view: its value is in the negative bit, lost like conj's.
    x, rx = _pair(6, dtype=torch.complex64)
    imag = rx.conj().imag
    assert imag.is_neg()
    assert torch.equal((imag + 0).target, x.conj().imag + 0)


def test_plain_conj_tensor_is_managed_with_its_bit(strategy):
    # TensorRef(t) of a plain conj view must keep t's value, not its base's.
    with torchTensorRef.disabled():
        t = torch.randn(5, dtype=torch.complex64).conj()
    r = TensorRef(t)
    r.toGPU()
    r.toCPU()
    assert torch.equal((r + 0).target, t + 0)


def test_in_place_op_that_resizes_its_argument(strategy, fresh_manager):
    # x.addbmm_(b1, b2) resizes a (1,) x to (5, 5) on a larger storage, as out= ops do; the
    # TensorRef kept shape (1,) and a 4-byte block, and evicting it failed on the size mismatch.
    x, rx = _pair(1, seed=4)
    b1, rb1 = _pair(2, 5, 3, seed=5)
    b2, rb2 = _pair(2, 3, 5, seed=6)
    x.addbmm_(b1, b2)
    fresh_manager.budget = 4 * (b1.nbytes + b2.nbytes)
    out = rx.addbmm_(rb1, rb2)
    assert out is rx and rx.shape == x.shape
    rx.toCPU()
    assert rx.proxyInfo.nbytes == x.untyped_storage().nbytes()
    assert torch.equal(rx.target, x)
    assert torch.equal((rx + 1).target, x + 1)
