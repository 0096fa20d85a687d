"""TensorRefs and plain "sim" tensors choose torch's list (``_foreach``) implementations as
plain tensors of the device do (``torchTensorRef/core/list_ops.py``).

Defect: gradient clipping (``clip_grad_norm_``) took its one-op-per-tensor way for TensorRef
gradients where plain CUDA torch takes ``_foreach_norm``, whose sums round differently on a
GPU: trained parameters differed from plain CUDA torch's by one float32 rounding."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef.core import list_ops
from paired import assert_identical, plain_torch, run_both


@pytest.fixture
def list_norms(monkeypatch):
    """The number of ``torch._foreach_norm`` calls made so far, as a one-item list."""
    calls = [0]
    original = torch._foreach_norm

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    return calls


def _clip_a_step():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model(torch.randn(8, 16)).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    return norm, [p.grad for p in model.parameters()]


def test_gradient_clipping_takes_the_list_implementation_plain_torch_takes_on_the_device(list_norms):
    with plain_torch():
        _clip_a_step()
    plain_calls = list_norms[0]
    _clip_a_step()
    # plain tensors of an accelerator take the list way (CUDA's, and "sim"'s as CUDA's)
    assert (plain_calls, list_norms[0] - plain_calls) == (1, 1)


def test_clipped_gradients_equal_plain_torch_s(fresh_manager):
    plain, managed = run_both(lambda: _clip_a_step())
    assert_identical(plain, managed)


def test_unpatching_withdraws_tensor_refs_from_the_list_implementations():
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    lists = (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types)
    assert all(torchTensorRef.TensorRef in types for types in lists)
    torchTensorRef.unpatch()
    try:
        assert not any(torchTensorRef.TensorRef in types for types in lists)
        list_ops.withdraw(torchTensorRef.TensorRef)  # (idempotent)
    finally:
        torchTensorRef.patch()
    assert all(types.count(torchTensorRef.TensorRef) == 1 for types in lists)
