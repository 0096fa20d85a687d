"""``disabled()``: plain torch in a scope, and on a device with ``disabled(device=...)``."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from paired import assert_identical, plain_torch
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.core import context
from conftest import TEST_DEVICE

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2)


@pytest.fixture
def saved_llama(tmp_path):
    """A tiny Llama's checkpoint folder, written by plain torch on the CPU."""
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(tmp_path)
    return tmp_path


def placement(model) -> set:
    return {(type(t).__name__, t.device.type) for t in list(model.parameters()) + list(model.buffers())}


@pytest.mark.parametrize("accelerate", [False, True], ids=["without-accelerate", "with-accelerate"])
def test_from_pretrained_inside_disabled_on_the_device_loads_as_plain_torch_without_a_device_context(
        saved_llama, accelerate, monkeypatch):
    # Inside disabled(device=...) transformers' probe for a torch.device context found one (its
    # torch.tensor([]) landed on the device): without accelerate from_pretrained raised
    # "Using a `device_map`, `tp_plan`, `torch.device` context manager ... requires `accelerate`",
    # and with it the model was loaded to the device by worker threads, where disabled() does not
    # reach, as managed TensorRefs instead of plain tensors.
    from transformers.integrations import accelerate as hf_accelerate

    if not accelerate:
        monkeypatch.setattr(hf_accelerate, "is_accelerate_available", lambda: False)
    elif not hf_accelerate.is_accelerate_available():
        pytest.skip("accelerate is not installed")
    with torchTensorRef.disabled():  # plain torch, no device context: the CPU
        expected = transformers.LlamaForCausalLM.from_pretrained(saved_llama)
    with plain_torch():  # disabled(device=<the managed device>)
        model = transformers.LlamaForCausalLM.from_pretrained(saved_llama)
        made = torch.zeros(2)
    assert placement(model) == placement(expected) == {("Parameter", "cpu"), ("Tensor", "cpu")}
    assert_identical(dict(expected.state_dict()), dict(model.state_dict()))
    assert_identical(expected.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
    # creations inside still land on the device, as plain tensors
    assert made.device.type == tensorsManager.torch_device.type and type(made) is not TensorRef


_STAYS = "this torch cannot erase a thread's carried objects: disabled() stays in its thread"


@pytest.mark.parametrize("device", [
    pytest.param(None, marks=pytest.mark.xfail(not context.CARRIED, strict=True, reason=_STAYS)),
    # (disabled(device="sim") enters a dispatch mode, which PyTorch carries: on CUDA none)
    pytest.param("test device", marks=pytest.mark.xfail(
        not context.CARRIED and not TEST_DEVICE.startswith("sim"), strict=True, reason=_STAYS)),
], ids=["no-device", "device"])
def test_a_backward_run_inside_disabled_makes_plain_tensors_on_autograd_s_device_thread(device):
    # The backward of device tensors runs on an autograd thread of that device, where a flag of
    # the calling thread's does not reach: a custom function's backward, a hook, a checkpoint's
    # recomputation there made managed TensorRefs inside disabled() (the gradients of a plain
    # model became TensorRefs), unless disabled(device=...) had entered a dispatch mode.
    import threading

    made, threads = [], []

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            threads.append(threading.current_thread())
            made.append(torch.full(g.shape, 2.0, device=g.device))  # (a device named: CUDA's thread too)
            return g * made[-1]

    where = tensorsManager.torch_device if device else None
    with torchTensorRef.disabled(device=where):
        w = torch.arange(4.0, device=tensorsManager.torch_device).requires_grad_()
        Twice.apply(w).sum().backward()
        expected = torch.full((4,), 2.0, device=tensorsManager.torch_device)
    if tensorsManager.torch_device.type != "cpu":
        assert threads[0] is not threading.current_thread()  # (the device's autograd thread)
    assert type(made[0]) is not TensorRef and type(w.grad) is not TensorRef
    assert_identical(expected, w.grad)
