"""Packed sequences: lengths and batch sizes stay in host memory, as CUDA kernels want them."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from paired import assert_identical, paging, plain_torch  # noqa: F401  (paging is a fixture)


@pytest.fixture(autouse=True)
def rnn_kernels_that_fit(request):
    """Under the small budget, the RNN's kernels of one step each: on CUDA cuDNN runs the
    whole RNN as one op, whose workspace alone is larger than that budget (refused, as
    docs/compatibility.md says); without a budget, cuDNN's where CUDA has it."""
    paging = request.getfixturevalue("paging") if "paging" in request.fixturenames else None
    with torch.backends.cudnn.flags(enabled=paging is None or paging.budget is None):
        yield


def packed_rnn(cell, lengths, enforce_sorted=True):
    """A packed batch of padded sequences through ``cell``, padded again; output, lengths, grads."""
    torch.manual_seed(0)
    rnn = cell(4, 5, batch_first=True)
    x = torch.randn(3, 6, 4, requires_grad=True)
    packed = pack_padded_sequence(x, lengths(), batch_first=True, enforce_sorted=enforce_sorted)
    out, _ = rnn(packed)
    padded, out_lengths = pad_packed_sequence(out, batch_first=True)
    padded.pow(2).sum().backward()
    return padded, out_lengths, packed.batch_sizes, x.grad, [p.grad for p in rnn.parameters()]


@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
@pytest.mark.parametrize("lengths_made", ["default", "cpu", "list"])
def test_packed_sequences_match_plain_torch(paging, cell, lengths_made):
    # Plain torch on an accelerator needs CPU lengths; a program written for the CPU makes
    # them with torch.tensor(...), which under the manager is an accelerator tensor.
    with plain_torch():
        plain = packed_rnn(cell, lambda: torch.tensor([6, 4, 2], device="cpu"))
    make = {"default": lambda: torch.tensor([6, 4, 2]), "cpu": lambda: torch.tensor([6, 4, 2], device="cpu"),
            "list": lambda: [6, 4, 2]}[lengths_made]
    managed = packed_rnn(cell, make)
    assert_identical(plain, managed)
    padded, out_lengths, batch_sizes = managed[:3]
    assert out_lengths.device.type == batch_sizes.device.type == "cpu"  # as CUDA gives them
    assert padded.device == paging.torch_device


def test_unsorted_lengths_sort_on_the_host(paging):
    with plain_torch():
        plain = packed_rnn(torch.nn.LSTM, lambda: torch.tensor([2, 6, 4], device="cpu"), enforce_sorted=False)
    managed = packed_rnn(torch.nn.LSTM, lambda: torch.tensor([2, 6, 4]), enforce_sorted=False)
    assert_identical(plain, managed)
