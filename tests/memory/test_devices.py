"""Tests of the backends: which device strings are accepted and how bytes are copied."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.memory.devices import CudaBackend, PassthroughBackend, SimBackend, make_backend
from torchTensorRef.core.tensor_ref import block_of
from paired import sim_only


@pytest.mark.parametrize("spec, kind", [("cpu", PassthroughBackend), ("CPU", PassthroughBackend),
                                        (torch.device("cpu"), PassthroughBackend), ("sim", SimBackend),
                                        (" Sim ", SimBackend)])
def test_make_backend(spec, kind):
    backend = make_backend(spec)
    assert type(backend) is kind
    assert backend.compute == torch.device("cpu")  # the simulated device computes with CPU kernels
    strict = kind is SimBackend and backend.strict
    assert backend.declared == (torch.device("sim", 0) if strict else torch.device("cpu"))
    assert backend.passthrough is (kind is PassthroughBackend)


@pytest.mark.parametrize("spec", ["gpu", "mps", "cuda0", "", 0, None, 1.0, "cuda:-1"])
def test_make_backend_rejects(spec):
    with pytest.raises(ValueError, match=r'device must be one of "cpu" \(pass-through\), "sim"'):
        make_backend(spec)


@sim_only
def test_sim_copies_are_real_copies():
    x = torch.arange(16.0)
    with torchTensorRef.disabled():
        expected = torch.arange(16.0)
    host = x.target  # held: the host copy's bytes stay where they are (a copy nobody holds may move to pinned memory)
    x.toGPU()
    assert x.target.data_ptr() != host.data_ptr()  # the "accelerator" copy is other memory
    assert torch.equal(x.target, expected)
    tensorsManager.pin(x)
    x.add_(1)
    x.toCPU()  # pinned: the write is copied back into the host copy
    tensorsManager.unpin(x)
    x.toCPU()
    assert x.target.data_ptr() == host.data_ptr()
    assert torch.equal(x.target, expected + 1) and torch.equal(host, expected + 1)


@sim_only
def test_sim_moves_bytes_and_keeps_values():
    x = torch.arange(12.0).reshape(3, 4)
    assert x.proxyInfo.device == "cpu" and not x.proxyInfo.on_device
    before = tensorsManager.stats()
    x.toGPU()
    assert x.proxyInfo.device == "sim" and x.proxyInfo.on_device
    assert x.device == tensorsManager.torch_device  # the declared device, where ops run: sim:0 (strict)
    # (counted as the device's allocator gives it: rounded up as CUDA's)
    assert (tensorsManager.stats()["device_bytes"]
            == before["device_bytes"] + tensorsManager.block_bytes(x.proxyInfo.nbytes))
    tensorsManager.pin(x)  # Genoa would send it back right after the next op
    x.mul_(2)
    assert x.proxyInfo.dirty and x.proxyInfo.pinned
    x.toCPU()  # pinned: written back, but stays
    assert x.proxyInfo.on_device and not x.proxyInfo.dirty
    tensorsManager.unpin(x)
    x.toCPU()
    assert not x.proxyInfo.on_device
    with torchTensorRef.disabled():
        expected = torch.arange(12.0).reshape(3, 4) * 2
    assert torch.equal(x.target, expected)
    assert tensorsManager.stats()["bytes_to_host"] == before["bytes_to_host"] + x.proxyInfo.nbytes


def test_cpu_pass_through_never_moves():
    tensorsManager.device = "cpu"
    x = torch.rand(10)
    y = (x * 2).toGPU()
    assert type(y) is TensorRef
    assert not y.proxyInfo.on_device and y.proxyInfo.device == "cpu"
    assert y.target.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert tensorsManager.stats()["bytes_to_device"] == 0


@pytest.mark.cuda
def test_cuda_backend_moves_to_the_gpu():
    tensorsManager.device = "cuda"
    assert isinstance(tensorsManager.backend, CudaBackend)
    x = torch.rand(256, 256)
    with torchTensorRef.disabled():
        expected = x.target.clone() @ x.target.clone()
    y = x @ x
    assert y.device.type == "cuda"
    torch.testing.assert_close(y.target.cpu(), expected)
    x.toGPU()
    assert x.proxyInfo.device.startswith("cuda") and x.target.is_cuda


@pytest.mark.cuda
def test_cuda_device_index_out_of_range():
    with pytest.raises(ValueError, match="does not exist"):
        tensorsManager.device = f"cuda:{torch.cuda.device_count()}"


def test_default_device_is_cuda_where_cuda_is_available(monkeypatch):
    # Defect: the default was pass-through, so model.cuda() gave TensorRefs reporting cpu.
    from torchTensorRef.memory.devices import default_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert default_device() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_graph_capture_of_tensorref_ops_is_refused_on_every_path(strategy):
    # Defect: a capture could bake in device addresses the manager frees later. Flow with no
    # budget takes the fast path, which must refuse too.
    tensorsManager.strategy = strategy
    x = torch.ones(4)
    x.toGPU()
    before = tensorsManager.op_index
    tensorsManager.set_capturing(True)
    try:
        with pytest.raises(RuntimeError, match="CUDA graph capture of ops on TensorRefs is not supported"):
            x + 1
        assert tensorsManager.op_index == before  # refused before anything changed
    finally:
        tensorsManager.set_capturing(False)
    assert (x + 1).tolist() == [2.0] * 4


def test_capture_begin_and_end_are_watched():
    graph_class = torch.cuda.graphs.CUDAGraph
    for name in ("capture_begin", "capture_end"):
        assert hasattr(getattr(graph_class, name), "__wrapped__")
    torchTensorRef.unpatch()
    assert not hasattr(graph_class.capture_begin, "__wrapped__")
    torchTensorRef.patch()
    assert hasattr(graph_class.capture_begin, "__wrapped__")


@pytest.mark.cuda
def test_cuda_graph_capture_of_tensorref_ops_raises():
    tensorsManager.device = "cuda"
    x = torch.ones(4)
    x.toGPU()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            x + 1
    assert not tensorsManager.capturing and (x + 1).tolist() == [2.0] * 4


@pytest.mark.cuda
def test_cuda_data_ptr_is_the_device_copy():
    # Defect: data_ptr() gave a host address for a tensor that says is_cuda.
    tensorsManager.device = "cuda"
    x = torch.arange(8.0)
    address = x.data_ptr()
    assert x.is_cuda and x.proxyInfo.on_device and address == block_of(x).dev.data_ptr()


@pytest.mark.cuda
def test_cuda_fp32_attention_training_with_dropout_matches_plain_torch():
    # Defect: the memory-efficient kernel returns its RNG seed and offset as CPU tensors;
    # made device blocks, its backward read them as host pointers.
    tensorsManager.device = "cuda"

    def step():
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", requires_grad=True) for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.2)
        out.sum().backward()
        return out, q.grad, k.grad, v.grad

    with torchTensorRef.disabled():
        plain = [t.detach().cpu() for t in step()]
    managed = [t.detach().cpu() for t in step()]
    for p, m in zip(plain, managed):
        assert torch.equal(p, m.target if isinstance(m, TensorRef) else m)
