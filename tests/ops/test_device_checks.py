"""Tensors made without a device beside CPU tensors, and the device errors of explicit ones
(Note [Default-device tensors] in ``torchTensorRef/ops/device_checks.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchTensorRef
from conftest import TEST_DEVICE
from paired import (assert_identical, device_type, paging, plain_torch, timing_form_of_sim,  # noqa: F401
                    to_plain)  # (paging is a fixture)
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.core.tensor_ref import block_of

CPU = torch.device("cpu")
SAME_DEVICE = "Expected all tensors to be on the same device"


def _host_only(t) -> bool:
    return isinstance(t, TensorRef) and block_of(t).host_only


def _checks(out, expected):
    """What test code does with a model's output and values made without a device."""
    host = out.detach().cpu()
    return [torch.allclose(host, expected, atol=1e3), host - expected, torch.cat([host, expected]),
            torch.where(host > 0, host, expected), (host == expected).sum(), torch.maximum(expected, host)]


def test_tensors_made_without_a_device_meet_cpu_results_as_in_plain_torch(paging):
    # expected = torch.tensor([...]) is the manager's accelerator tensor and out.cpu() a CPU
    # one: torch.allclose(out.cpu(), expected) raised "Expected all tensors to be on the same
    # device ... sim:0 and cpu", where plain torch has both on the CPU.
    def run():
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 3)
        out = layer(torch.randn(5, 4))
        expected = torch.tensor([[0.5, -0.25, 1.0]] * 5)
        return out, expected

    with plain_torch():  # the same program in plain torch on the device, its CPU tensors on the CPU
        out, expected = run()
        plain = _checks(out, expected.cpu())
    out, expected = run()
    managed = _checks(out, expected)
    assert_identical(plain, managed)
    assert expected.device.type == device_type()  # made without a device: on the accelerator
    assert all(r.device == CPU for r in managed[1:]) and all(_host_only(r) for r in managed[1:])
    assert managed[0] is True
    assert (managed[1].numpy() == plain[1].numpy()).all()  # CPU tensors: numpy reads them


def test_a_tensor_made_without_a_device_written_by_host_ops_stays_on_the_accelerator(paging):
    def run():
        total = torch.zeros(3)
        for i in range(3):
            total += (torch.arange(3.0) * i).cpu()  # an op mixing it with a CPU tensor, on the host
        return total * 2, (total * 2).device

    with torchTensorRef.disabled():  # plain torch on the CPU: both tensors are CPU tensors there
        plain = run()
    managed = run()
    assert_identical(plain[0], managed[0])
    assert managed[1].type == device_type() and not _host_only(managed[0])


@pytest.mark.parametrize("made", [
    lambda: torch.rand(3, 3, device=device_type()),
    lambda: torch.rand(3, 3).to(device_type()),
    lambda: torch.rand(3, 3).to(device=torch.device(device_type())),
    lambda: torch.rand(3, 3, device=device_type()) * 2,
    lambda: torch.zeros_like(torch.rand(3, 3, device=device_type())),
    lambda: torch.rand(3, 3, device="cpu").to(device_type()),
    lambda: torch.nn.Linear(3, 3).to(device_type()).weight,
], ids=["device=", ".to(device) of one made without", ".to(device=)", "computed from one", "zeros_like of one",
        ".to(device) of a CPU tensor", "module.to(device)"])
@pytest.mark.parametrize("op", [
    lambda x, c: x + c,
    lambda x, c: x @ c,
    lambda x, c: torch.cat([x, c]),
    lambda x, c: c.add_(x),
], ids=["add", "matmul", "cat", "add_ cpu"])
def test_tensors_the_program_put_on_the_device_fail_beside_cpu_tensors_as_on_cuda(made, op):
    x = made()
    c = torch.rand(3, 3, device="cpu")
    before = c.target.clone()
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        op(x.detach(), c)
    assert torch.equal(c.target, before)


def test_in_a_device_context_tensors_are_the_programs_own():
    with torch.device(device_type()):
        x = torch.rand(3, 3)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x + torch.rand(3, 3, device="cpu")


def test_unmodified_model_code_stays_on_the_accelerator(paging):
    # (what must not change: tensors made without a device are managed and paged on the device)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    y = layer(x) * torch.tensor(2.0, device="cpu")  # a 0-dim CPU tensor is a scalar
    rows = y[torch.tensor([1, 0], device="cpu")]  # indexing takes CPU indices
    for t in (layer.weight, x, y, rows):
        assert t.device.type == device_type() and not _host_only(t)


def test_a_gradient_pulled_to_the_host_warns_and_matches_plain_torch():
    def run():
        w = torch.nn.Parameter(torch.arange(9.0).reshape(3, 3) / 7)
        c = torch.arange(9.0, device="cpu").reshape(3, 3) - 4
        (w * c).sum().backward()
        return w.grad

    with torchTensorRef.disabled():  # plain torch on the CPU, where all of it runs
        expected = run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad = run()
    assert any("runs on the host" in str(w.message) for w in caught)
    assert_identical(expected, grad)


def test_optimizer_step_counters_are_cpu_tensors_as_in_plain_torch():
    # torch < 2.13 makes Adam's step counters without a device: the manager put them on the
    # accelerator, where plain torch keeps them on the CPU (a kernel launch and a host read per
    # parameter and step)
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    steps = [s["step"] for s in optimizer.state.values()]
    assert [(s.device, s.item()) for s in steps] == [(CPU, 1.0)] * 2


def _plain_cpu(*size, requires_grad=False):
    """A plain CPU tensor the manager does not hold (as a DataLoader's worker gives)."""
    with torchTensorRef.disabled():
        return torch.rand(*size, generator=torch.Generator().manual_seed(1), requires_grad=requires_grad)


@pytest.mark.parametrize("op", [
    lambda x, c: x + c,
    lambda x, c: x @ c,
    lambda x, c: torch.cat([x, c]),
], ids=["add", "matmul", "cat"])
def test_a_plain_cpu_tensor_beside_the_programs_device_tensor_fails_as_on_cuda(op):
    # "sim" took it as the device's: torch.rand(3, 3, device="sim") + a plain CPU tensor ran,
    # where CUDA raises
    x = torch.rand(3, 3, device=device_type())
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        op(x, _plain_cpu(3, 3))


def _host_copy_view(kept):
    t = torch.rand(3, 3)
    kept.append(t)
    tensorsManager.evict_all()
    return t.target  # (a view of its host copy: a CPU tensor, on CUDA too)


@pytest.mark.parametrize("make", [lambda kept: _plain_cpu(3, 3, requires_grad=True), _host_copy_view],
                         ids=["requires grad", "a host copy's view"])
def test_a_plain_cpu_tensor_that_cannot_be_brought_fails_beside_tensors_made_without_a_device(make):
    # (brought, the first one's gradient would go to the tensor made for it)
    x = torch.rand(3, 3)
    kept: list = []
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x + make(kept)


def test_a_plain_cpu_tensor_an_op_writes_is_left_as_it_was():
    x = torch.rand(3, 3)
    c = _plain_cpu(3, 3)
    before = c.clone()
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        c.add_(x)
    assert torch.equal(c, before)


def test_a_plain_cpu_batch_meets_a_model_made_without_a_device_on_the_accelerator(paging):
    # A DataLoader's worker gives plain CPU batches, and its process collates TensorRefs made
    # without a device: both run on the accelerator (on CUDA the plain batch raised "Expected
    # all tensors to be on the same device")
    def run(batch):
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 4)
        return torch.cat([layer(batch), batch @ layer.weight.t()])

    batch = _plain_cpu(5, 3)
    with plain_torch():
        expected = run(batch.to(device_type()))
    out = run(batch)
    assert_identical(expected, out)
    assert isinstance(out, TensorRef) and out.device.type == device_type() and not _host_only(out)
    assert not block_of(out).explicit  # (made without a device, as the model)


@pytest.mark.skipif(TEST_DEVICE != "sim", reason="the timing form is sim's")
def test_the_timing_form_of_sim_takes_a_plain_cpu_tensor_for_the_device_s():
    # There the device's copies are plain CPU tensors, and so are plain ops' results on them
    # (generate()'s own loop under a budget that pages): each was adopted and copied in anew,
    # as a DataLoader worker's batch is, 1,208 copies a decoding call of an 8-layer Llama at
    # 100% of its weights where strict "sim" and CUDA make 32
    with timing_form_of_sim():
        tensorsManager.strategy = "flow"
        x = torch.arange(4.0)  # made without a device
        x.add_(0)  # (brought in)
        batch = _plain_cpu(4)
        before = tensorsManager.stats()
        out = x * batch
        after = tensorsManager.stats()
        assert (after["tensors"], after["fetches"]) == (before["tensors"] + 1, before["fetches"])  # (its result)
        with torchTensorRef.disabled():
            assert torch.equal(out.cpu(), torch.arange(4.0) * batch)


def test_plain_device_tensors_meet_tensor_refs_in_plain_torch():
    # "sim"'s plain tensors gave their bytes, plain CPU tensors, to a TensorRef's op beside
    # them: cross_entropy(plain logits, managed targets), which CUDA runs
    target = torch.tensor([0, 2, 1], device=device_type())
    with plain_torch():
        logits = torch.arange(9.0, device=device_type()).reshape(3, 3) / 4
        loss = torch.nn.functional.cross_entropy(logits, target)
        expected = torch.nn.functional.cross_entropy(logits, to_plain(target).to(device_type()))
    assert_identical(expected, loss)


def test_a_plain_device_tensor_given_to_an_op_is_counted_before_room_is_made_for_it(monkeypatch):
    # A plain device tensor the manager never saw (torch's indexing makes the index of x[[0, 1]]
    # on x's device, outside the manager, on CUDA) is outside bytes the last reading of the
    # device missed: the op reads the device before making room, or the device holds more
    # than the budget once the op's result is made.
    tm = tensorsManager
    tm.strategy = "flow"
    monkeypatch.setattr(tm, "check_device", True)  # (restored after the test)
    a, b, c = torch.randn(1024), torch.randn(1024), torch.randn(1024)  # 4 KiB each, on the device
    tm.budget = tm.outside_bytes() + tm.block_bytes(4096) * 4
    tm.reset_stats()
    with torchTensorRef.disabled(device=tm.torch_device):
        p = torch.randn(1024)  # plain, on the device: 4 KiB the manager has not read
    got = a + p
    assert tm.stats()["device_overshoot_bytes"] == 0
    with plain_torch():
        expected = to_plain(a).to(device_type()) + p
    assert_identical(expected, got)
    del b, c


def test_new_tensor_is_made_where_its_tensor_is_and_as_the_program_chose():
    # torch's own new_tensor built the tensor in C++: on CUDA a plain device tensor outside the
    # manager, on "sim" a TensorRef the program seemed to have put on the device itself, which
    # then refused a CPU tensor that plain torch (everything on the CPU) adds to it
    made_without = torch.randn(2).new_tensor([1.0, 2.0])
    assert type(made_without) is TensorRef and made_without.dtype == torch.float32
    got = made_without + torch.ones(2, device="cpu")
    assert got.device.type == "cpu"
    with torchTensorRef.disabled():
        assert torch.equal(got, torch.tensor([2.0, 3.0]))
    named = torch.randn(2, device=tensorsManager.torch_device).new_tensor([1, 2])
    assert type(named) is TensorRef and named.dtype == torch.float32  # (its tensor's dtype)
    with pytest.raises(RuntimeError, match="same device"):
        named + torch.ones(2, device="cpu")  # the program's own device tensor: CUDA's error
    on_host = torch.ones(2, device="cpu").new_tensor([3.0])
    assert on_host.device.type == "cpu"


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_a_cpu_tensor_moved_to_the_device_is_there_as_in_plain_torch(mode):
    # diffusers' randn_tensor draws on the CPU with a CPU generator, then moves to the device.
    # Under inference_mode ``to`` reaches the manager whole: "sim" refused the CPU argument,
    # and, let through, ran it on the host where it returned its argument, a host tensor.
    context = getattr(torch, mode)
    device = tensorsManager.torch_device

    def run():
        with context():
            t = torch.randn(2, 8, generator=torch.Generator().manual_seed(0), device="cpu")
            return t, [t.to(device), t.to(device, torch.float64), t.to(device, copy=True)]

    with plain_torch():
        plain_source, expected = run()
    source, got = run()
    assert _host_only(source)
    for g, e in zip(got, expected):
        assert (g.device, g.dtype, g.shape, g.is_inference()) == (e.device, e.dtype, e.shape, e.is_inference())
        assert not _host_only(g) and block_of(g) is not block_of(source)
        assert torch.equal(to_plain(g), to_plain(e))
