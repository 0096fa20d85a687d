"""Pinned host memory: within ``pinned_limit``, accounted as PyTorch's pinned allocator
rounds, and never at the cost of memory the user shares with a TensorRef."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager as tm
from torchTensorRef.pinned import rounded


@pytest.fixture
def restore_limit():
    limit = tm.pinned_limit
    yield
    tm.pinned_limit = limit


@pytest.mark.parametrize("value, expected", [("1MiB", 2**20), (4096, 4096), (0, 0)])
def test_pinned_limit_accepts_sizes(restore_limit, value, expected):
    tm.pinned_limit = value
    assert tm.pinned_limit == expected


@pytest.mark.parametrize("value", [None, -1, "lots", 1.5])
def test_pinned_limit_rejects_bad_values_and_keeps_the_old_one(restore_limit, value):
    before = tm.pinned_limit
    with pytest.raises(ValueError, match="pinned_limit"):
        tm.pinned_limit = value
    assert tm.pinned_limit == before


def _written_back(n):
    """``n`` tensors of 1000 bytes whose host copies were written back from the device."""
    sources = [torch.full((250,), float(i)) for i in range(n)]
    results = [s + 1 for s in sources]  # Genoa writes each back into a new host copy: pinned, if room
    tm.synchronize()
    return results


def test_pinned_bytes_are_counted_rounded_and_given_back(restore_limit):
    tm.pinned_limit = "1MiB"
    start = tm.stats()["pinned_bytes"]
    tensors = _written_back(4)
    pinned = tm.stats()["pinned_bytes"] - start
    assert pinned == 4 * rounded(1000) == 4 * 1024  # the allocator's power-of-two sizes
    del tensors
    tm.synchronize()
    assert tm.stats()["pinned_bytes"] == start


def test_past_the_limit_copies_are_pageable_and_values_intact(restore_limit):
    tm.pinned_limit = 2 * 1024  # room for two of the four host copies
    start_syncs = tm.stats()["host_syncs"]
    tensors = _written_back(4)
    assert tm.stats()["pinned_bytes"] <= 2 * 1024
    for i, t in enumerate(tensors):
        t.mul_(2)  # fetched back: from pageable memory the host waits
        assert t.tolist() == [2.0 * (i + 1)] * 250
    assert tm.stats()["host_syncs"] > start_syncs


def test_a_tensorref_keeps_sharing_the_users_memory_while_paged(restore_limit):
    # Defect: re-homing host copies into pinned memory broke the sharing TensorRef(t)
    # promises. 8 KiB: a host copy this large is otherwise pinned when adopted.
    tm.pinned_limit = "1MiB"
    with torchTensorRef.disabled():
        plain = torch.zeros(2048)
    start = tm.stats()["pinned_bytes"]
    ref = TensorRef(plain)
    ref.add_(1)  # paged in, written, written back
    tm.synchronize()
    assert tm.stats()["pinned_bytes"] == start  # the user's memory stayed where it is
    assert plain.tolist() == [1.0] * 2048  # the user's tensor sees the write
    plain.fill_(5.0)
    assert ref.tolist() == [5.0] * 2048  # and the TensorRef sees the user's
