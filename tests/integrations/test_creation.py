"""Where a tensor made from nothing goes (``integrations/creation.py``)."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.integrations import creation
from paired import device_type


def randn(*size, device=None, **kwargs):
    """``torch.randn`` as CUDA's gives it: a plain tensor of the device (on "sim" the
    device's own factories make TensorRefs)."""
    with torchTensorRef.disabled(device=device_type()):
        return torch.randn(*size, device=device, **kwargs)


ADOPT = creation.adopt


def adopt_as_cuda_does(t, memo=None, host_only=False):
    """``adopt``, and for a plain device tensor what the manager makes of one handed to it (a
    CUDA tensor; "sim" cannot adopt its own): a TensorRef on the device, which the program
    seems to have put there."""
    if not isinstance(t, torch.Tensor) or t.device.type != device_type():
        return ADOPT(t, memo, host_only)
    with torchTensorRef.disabled():
        values = t.cpu()
    return torchTensorRef.manage(values).to(tensorsManager.torch_device)


@pytest.mark.parametrize("named", [False, True])
def test_a_factory_s_device_tensor_is_the_program_s_own_only_where_it_named_the_device(monkeypatch, named):
    # On an H200, factories' results made without a device were adopted as tensors the
    # program put on the device: a CPU tensor beside them raised CUDA's device error where
    # plain torch, everything on the CPU, adds them, and a DataLoader worker's plain batch met
    # a model made without a device with that error
    if device_type() != "cuda":
        monkeypatch.setattr(creation, "adopt", adopt_as_cuda_does)
    kwargs = {"device": tensorsManager.torch_device} if named else {}
    made = creation.create(randn, (3,), kwargs)
    assert type(made) is TensorRef and made.device.type == device_type() and not block_of(made).host_only
    assert block_of(made).explicit is named
    cpu = torch.ones(3, device="cpu")
    if named:
        with pytest.raises(RuntimeError, match="same device"):
            made + cpu
    else:
        got = made + cpu  # (on the host, as plain torch runs it with both on the CPU)
        assert got.device.type == "cpu"
        with torchTensorRef.disabled():
            assert torch.equal(got, made.cpu() + 1)
