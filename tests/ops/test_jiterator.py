"""CUDA's jiterator on TensorRefs: its raw entry point runs as a managed op (Note [Raw kernels]).

The real entry point needs a GPU; here a stand-in computes the same elementwise kernels on
the plain tensors it is given, and refuses a TensorRef as the real one cannot take it (it
reads the wrapper's data pointer, which has no bytes: an illegal memory access on CUDA).
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.cuda.jiterator as jiterator

import torchTensorRef
from torchTensorRef import OutOfBudgetError, TensorRef, tensorsManager
from torchTensorRef.ops.raw_kernels import output_bytes
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, budget, plain_torch, values

ENTRY = "_cuda_jiterator_compile_and_launch_kernel"
ADD = "template <typename T> T add_kernel(T x, T y) { return x + y; }"
SCALED_ADD = "template <typename T> T scaled_add(T x, T y, T alpha) { return alpha * (x + y); }"
SUM_AND_PRODUCT = "template <typename T> void sum_and_product(T x, T y, T& s, T& p) { s = x + y; p = x * y; }"

launches = []


def fake_entry(code_string, kernel_name, return_by_ref, num_outputs, tensors, extra=None):
    """Stands for ``torch._C._cuda_jiterator_compile_and_launch_kernel``: sums (and, for two
    outputs, multiplies) its tensors elementwise, times the scalar ``alpha`` if given."""
    for t in tensors:
        assert type(t) is not TensorRef, f"kernel {kernel_name} was given a TensorRef"
    for v in (extra or {}).values():
        assert type(v) is not TensorRef, f"kernel {kernel_name} was given a TensorRef scalar"
    launches.append(kernel_name)
    total = functools.reduce(operator.add, tensors)
    alpha = (extra or {}).get("alpha")
    if alpha is not None:
        total = total * (alpha.item() if isinstance(alpha, torch.Tensor) else alpha)
    if num_outputs == 1:
        return total
    return (total, functools.reduce(operator.mul, tensors))


@pytest.fixture
def entry(monkeypatch):
    """``fake_entry`` in torch._C, wrapped by ``patch()`` as the real entry point is."""
    torchTensorRef.unpatch()  # (where torch has the real entry point, patch() wrapped it at import)
    monkeypatch.setattr(torch._C, ENTRY, fake_entry, raising=False)  # (CPU builds have none)
    torchTensorRef.patch()
    launches.clear()
    yield
    torchTensorRef.unpatch()  # before monkeypatch puts back what was there (fresh_manager patches again)


def jit(code: str, num_outputs: int = 1, **kwargs):
    if num_outputs == 1:
        fn = jiterator._create_jit_fn(code, **kwargs)
    else:
        fn = jiterator._create_multi_output_jit_fn(code, num_outputs, **kwargs)
    fn.is_cuda_available = True  # (it read torch.cuda.is_available() when made: this machine may have no GPU)
    return fn


def both(fn, seed: int = 0):
    """``fn()`` on plain torch of the managed device, then on TensorRefs, from one seed."""
    with plain_torch():
        torch.manual_seed(seed)
        plain = fn()
    torch.manual_seed(seed)
    return plain, fn()


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_jiterator_on_tensorrefs_runs_on_their_device_copies_within_the_budget(entry, strategy):
    # Used to hand the TensorRefs themselves to the raw kernel, which read their empty wrappers.
    tm = tensorsManager
    tm.strategy = strategy
    kernel = jit(ADD)
    managed = 3 * 1024  # the two inputs and the result, 1 KiB each
    plain, (a, b, other) = both(lambda: (torch.randn(256), torch.randn(256), torch.randn(256)))
    expected = kernel(plain[0], plain[1])  # (no TensorRef: the kernel is called as it is)
    tm.budget = budget(managed)
    other.toGPU()  # resident: the launch must evict it to fit its inputs and its result
    tm.reset_stats()
    out = kernel(a, b)
    assert type(out) is TensorRef and out.device == expected.device
    assert_identical(expected, out)
    stats = tm.stats()
    assert stats["ops"] == 1 and stats["evictions"] >= 1
    assert stats["worst_overshoot_bytes"] == 0 and stats["peak_device_bytes"] <= managed
    assert launches == ["add_kernel", "add_kernel"]
    for _ in range(3):  # a result is an input like any, and a launch repeats as one op would
        out, expected = kernel(out, a), kernel(expected, plain[0])
    assert_identical(expected, out)
    assert tm.stats()["worst_overshoot_bytes"] == 0


def test_multi_output_jiterator_gives_each_result_as_a_tensorref(entry):
    # Used to hand the TensorRefs to the raw kernel (the multi-output entry is the same one).
    kernel = jit(SUM_AND_PRODUCT, num_outputs=2)
    plain, (a, b) = both(lambda: (torch.randn(3, 5), torch.randn(5)))
    expected = kernel(*plain)
    tensorsManager.budget = budget(4096)
    out = kernel(a, b)
    assert isinstance(out, tuple) and len(out) == 2
    for got, want in zip(out, expected):
        assert type(got) is TensorRef and got.shape == want.shape
        assert_identical(want, got)
    assert block_of(out[0]) is not block_of(out[1])
    assert tensorsManager.stats()["worst_overshoot_bytes"] == 0


def test_a_launch_that_cannot_fit_the_budget_raises_before_the_kernel_runs(entry):
    # The room made for a launch counts its broadcast, promoted result: a (4, 1) float32 and
    # a (1, 8) float64 give a (4, 8) float64, 256 bytes beside the inputs' 16 + 64 (each
    # counted as the device's allocator gives it).
    kernel = jit(ADD)
    plain, (a, b) = both(lambda: (torch.randn(4, 1), torch.randn(1, 8, dtype=torch.float64)))
    expected = kernel(*plain)  # (before the budget, which covers the plain tensors on the device)
    assert output_bytes((a, b), 1) == 256
    need = sum(tensorsManager.block_bytes(n) for n in (16, 64, 256))
    tensorsManager.budget = budget(need - 1)
    with pytest.raises(OutOfBudgetError, match="jiterator.add_kernel"):
        kernel(a, b)
    assert launches == ["add_kernel"]  # (the plain launch only)
    tensorsManager.budget = budget(need)
    out = kernel(a, b)
    assert out.dtype == torch.float64
    assert_identical(expected, out)
    assert tensorsManager.stats()["worst_overshoot_bytes"] == 0


def test_a_tensorref_given_for_a_scalar_argument_reaches_the_kernel_as_a_number(entry):
    # The entry point reads a tensor scalar with item(); the kernel must not get the TensorRef.
    kernel = jit(SCALED_ADD, alpha=1.0)
    plain, (a, b, alpha) = both(lambda: (torch.randn(6), torch.randn(6), torch.tensor(2.5)))
    out = kernel(a, b, alpha=alpha)
    assert_identical(kernel(plain[0], plain[1], alpha=plain[2]), out)


def test_the_launch_is_an_op_callbacks_see(entry):
    seen = []
    handle = tensorsManager.add_callback(before=lambda op: seen.append(op.name))
    try:
        jit(ADD)(torch.ones(2), torch.ones(2))
    finally:
        handle.remove()
    assert seen == ["jiterator.add_kernel"]


def test_a_launch_on_tensorrefs_inside_a_managed_op_is_refused(entry):
    # Inside an op the manager holds its lock and that op's blocks: making room for the
    # launch could evict them, so it is refused with a TypeError rather than run.
    kernel = jit(ADD)
    a, b = torch.ones(2), torch.ones(2)
    refused = []

    def before(op):
        if op.name.startswith("aten.neg"):
            with pytest.raises(TypeError, match="inside a managed op"):
                kernel(a, b)
            refused.append(op.name)

    handle = tensorsManager.add_callback(before=before)
    try:
        torch.neg(a)
    finally:
        handle.remove()
    assert refused and launches == []


def test_unpatch_restores_the_raw_entry_point_and_patch_wraps_it_once(entry):
    wrapper = getattr(torch._C, ENTRY)
    assert wrapper is not fake_entry and wrapper.__wrapped__ is fake_entry
    torchTensorRef.patch()
    assert getattr(torch._C, ENTRY) is wrapper
    torchTensorRef.unpatch()
    assert getattr(torch._C, ENTRY) is fake_entry
    a = TensorRef(torch.ones(2))
    with pytest.raises(AssertionError, match="was given a TensorRef"):
        jit(ADD)(a, a)  # unwrapped, the kernel gets the wrapper itself
    torchTensorRef.patch()
    assert torch.equal(values(jit(ADD)(a, a)), torch.full((2,), 2.0, device=values(a).device))


@pytest.mark.cuda
def test_real_jiterator_on_tensorrefs_matches_plain_cuda():
    # Used to launch on the wrappers' empty storage: an illegal memory access, fatal to the process.
    tm = tensorsManager
    tm.device = "cuda"
    kernel = jiterator._create_jit_fn(ADD)
    with plain_torch():
        expected = kernel(torch.arange(1000.0), torch.linspace(-1, 1, 1000))
    a, b = torch.arange(1000.0), torch.linspace(-1, 1, 1000)
    out = kernel(a, b)
    assert type(out) is TensorRef and out.is_cuda
    assert_identical(expected, out)
    torch.cuda.synchronize()
