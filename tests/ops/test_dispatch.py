"""Regression tests for op-level bugs the OpInfo sweep found (``ops/``, ``tensor_ref.py``).

Each compares a TensorRef with plain torch on the test device (``paired.plain_torch``):
``SimTensor``s on "sim", plain CUDA tensors on CUDA, so both runs use the same kernels.
Values are compared as CPU copies of both sides (a TensorRef's bytes may be on either).
"""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import torchTensorRef
from paired import ROOT, budget, outside, plain_torch, sim_only, tiny_room, values
from torchTensorRef import TensorRef
from torchTensorRef.strategies import NAMES


@pytest.fixture(params=NAMES)
def strategy(request, fresh_manager):
    fresh_manager.strategy = request.param
    return request.param


def _pair(*shape, dtype=torch.float32, seed=0):
    """A plain tensor of the test device and a TensorRef over an independent copy of its values.

    (The plain one was a CPU tensor: on CUDA its results differed from the TensorRef's in the
    last bit (other kernels), and ``torch.equal`` refused a CUDA and a CPU tensor.)
    """
    with torchTensorRef.disabled():
        g = torch.Generator().manual_seed(seed)
        cpu = torch.randn(*shape, generator=g, dtype=dtype)
        ref = TensorRef(cpu.clone())
    return _on_test_device(cpu), ref


def _on_test_device(cpu: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the test device (plain torch's) holding the values of ``cpu``."""
    with plain_torch():
        return torch.empty(cpu.shape, dtype=cpu.dtype).copy_(cpu)


def _same(managed: torch.Tensor, plain: torch.Tensor) -> bool:
    """Same dtype, shape and bits, compared as CPU copies of both sides."""
    a, b = values(managed).cpu(), values(plain).cpu()
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b)


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
    var.abs_()
    rvar.abs_()
    expected = torch.native_batch_norm(x, None, None, mean, var, True, 0.3, 1e-5)
    fresh_manager.budget = budget(tiny_room(3 * x.nbytes))  # (six tensors, as the allocator gives them)
    got = torch.native_batch_norm(rx, None, None, rmean, rvar, True, 0.3, 1e-5)
    for r in (rmean, rvar):
        r.toCPU()  # a clean eviction would have lost the update
    assert _same(rmean, mean) and _same(rvar, var)
    for g, e in zip(got, expected):
        assert _same(g, e)


def test_conj_view_keeps_its_conjugate_bit(strategy):
    # x.conj() is a lazy view whose value is in its conjugate bit; the TensorRef wrapper and
    # the plain views rebuilt after a move lost the bit, so conj() returned x unchanged.
    x, rx = _pair(6, dtype=torch.complex64)
    ry = rx.conj()
    assert ry.is_conj()
    assert _same(ry.resolve_conj(), x.conj().resolve_conj())
    assert _same(ry * 2, x.conj() * 2)
    assert _same(copy.deepcopy(ry).resolve_conj(), x.conj().resolve_conj())


def test_neg_view_keeps_its_negative_bit(strategy):
    # x.conj().imag is a lazy negative view: its value is in the negative bit, lost like conj's.
    x, rx = _pair(6, dtype=torch.complex64)
    imag = rx.conj().imag
    assert imag.is_neg()
    assert _same(imag + 0, x.conj().imag + 0)


def test_plain_conj_tensor_is_managed_with_its_bit(strategy):
    # TensorRef(t) of a plain conj view must keep t's value, not its base's.
    with torchTensorRef.disabled():
        t = torch.randn(5, dtype=torch.complex64).conj()
    r = TensorRef(t)
    r.toGPU()
    r.toCPU()
    assert _same(r + 0, _on_test_device(t) + 0)


def test_in_place_op_that_resizes_its_argument(strategy, fresh_manager):
    # x.addbmm_(b1, b2) resizes a (1,) x to (5, 5) on a larger storage, as out= ops do; the
    # TensorRef kept shape (1,) and a 4-byte block, and evicting it failed on the size mismatch.
    x, rx = _pair(1, seed=4)
    b1, rb1 = _pair(2, 5, 3, seed=5)
    b2, rb2 = _pair(2, 3, 5, seed=6)
    x.addbmm_(b1, b2)
    fresh_manager.budget = budget(tiny_room(4 * (b1.nbytes + b2.nbytes)))
    out = rx.addbmm_(rb1, rb2)
    assert out is rx and rx.shape == x.shape
    rx.toCPU()
    assert rx.proxyInfo.nbytes == x.untyped_storage().nbytes()
    assert _same(rx, x)
    assert _same(rx + 1, x + 1)


@pytest.mark.parametrize("op", [
    lambda host, b: torch.equal(host, b),
    lambda host, b: host + b,
    lambda host, b: b * host,
    lambda host, b: torch.cat([b, host]),
    lambda host, b: b.add_(host),
], ids=["equal", "add", "mul", "cat", "add_"])
def test_a_view_of_a_host_copy_beside_a_tensorref_is_refused_as_on_cuda(strategy, op):
    # On "sim" a tensor's .target on the host (a plain CPU tensor) was let through beside
    # device TensorRefs, which CUDA refuses: tests compared them and failed only on a GPU.
    a, b = torch.ones(64), torch.full((64,), 2.0)
    host = a.toCPU().target  # a plain view of a's host copy
    assert host.device.type == "cpu"
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        op(host, b)
    assert _same(b, torch.full((64,), 2.0))


def test_what_accelerators_take_from_the_host_still_runs_beside_a_tensorref(strategy):
    # (the refusal above must leave alone what CUDA kernels accept: a 0-dim CPU tensor, a
    # copy from the host, CPU indices)
    with torchTensorRef.disabled():
        scalar, index = torch.tensor(3.0), torch.tensor([2, 0])
    src = torch.arange(4.0)
    host = src.toCPU().target  # (src kept: a view of a live block's host copy)

    def run(make):
        b = make()
        return [b * scalar, torch.empty(4).copy_(host) + b, b[index]]

    with plain_torch():
        expected = run(lambda: torch.full((4,), 2.0))
    got = run(lambda: torch.full((4,), 2.0))
    assert all(_same(g, e) for g, e in zip(got, expected))


class _ReadingLock:
    """The manager's lock, reading what the device holds outside the manager each time the
    thread lets it go (the reading another thread's op would take next)."""

    def __init__(self, inner, manager):
        self._inner, self._manager = inner, manager
        self._depth = 0
        self.readings = []

    def _is_owned(self):
        return self._inner._is_owned()

    def __enter__(self):
        self._inner.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if not self._depth:
            m = self._manager
            self.readings.append(m.backend.in_use_elsewhere(m.accounting.resident))
        self._inner.release()
        return False


def test_an_op_keeps_no_plain_view_of_a_copy_once_it_lets_the_lock_go(fresh_manager, monkeypatch):
    # (Note [Plain views die under the lock]: Genoa evicts an op's blocks as it ends; a view of
    # their device copies still held when the lock is free was counted as outside the manager
    # by the next thread's op, which then refused a budget that fits)
    fresh_manager.strategy = "genoa"
    x, w = torch.rand(256), torch.rand(256)
    gc.collect()
    fresh_manager.budget = budget("16KiB")
    floor = outside()
    lock = _ReadingLock(fresh_manager.lock, fresh_manager)
    monkeypatch.setattr(fresh_manager, "lock", lock)
    y = x * w
    z = torch.addcmul(y, x, w)
    monkeypatch.undo()
    assert lock.readings
    assert max(lock.readings) == floor, lock.readings
    with plain_torch():
        px, pw = _on_test_device(values(x).cpu()), _on_test_device(values(w).cpu())
        expected = torch.addcmul(px * pw, px, pw)
    assert _same(z, expected)


# A model whose backward runs on autograd's device thread ("sim"), where a hook raises the
# interrupt at its second call; then a second backward, compared with plain torch's gradients.
_INTERRUPTED_BACKWARD = textwrap.dedent("""
    import json, sys
    import torch
    import torchTensorRef
    from torchTensorRef import tensorsManager as tm

    hook, error = sys.argv[1], {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit,
                                 "RuntimeError": RuntimeError}[sys.argv[2]]
    tm.device = "sim"
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        x = torch.randn(3, 8)
        model(x).sum().backward()
        expected = [p.grad.tolist() for p in model.parameters()]
        model.zero_grad()
    torchTensorRef.manage(model)
    x = torchTensorRef.manage(x)
    loss = model(x).sum()
    calls = []

    def interrupt(_what):
        calls.append(1)
        if len(calls) == 2:
            raise error("interrupted")

    if hook == "fault_injector":
        tm.fault_injector = interrupt
    else:
        handle = tm.add_callback(before=interrupt)
    try:
        loss.backward()
        raised = None
    except BaseException as e:
        raised = type(e).__name__
    tm.fault_injector = None
    if hook == "callback":
        handle.remove()
    model.zero_grad()
    model(x).sum().backward()
    got = [p.grad.cpu().tolist() for p in model.parameters()]
    print(json.dumps({"raised": raised, "got": got, "expected": expected}))
""")


@sim_only
@pytest.mark.parametrize("hook", ["fault_injector", "callback"])
@pytest.mark.parametrize("error", ["KeyboardInterrupt", "SystemExit", "RuntimeError"])
def test_an_interrupt_raised_inside_backward_reaches_the_caller(hook, error):
    # A KeyboardInterrupt (or SystemExit) from a fault injector or a callback inside an op of
    # backward on "sim" aborted the process ("terminate called without an active exception"):
    # only Exceptions were kept for backward() to raise.
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_BACKWARD, hook, error], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["raised"] == error
    for got, expected in zip(result["got"], result["expected"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))
