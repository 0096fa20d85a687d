"""Where an elementwise op over the host's kernels is cut (``ops/vector_loops.py``): every
cut it offers gives the bits of one call of PyTorch's own CPU kernels, at each thread count."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef.ops import vector_loops

aten = torch.ops.aten

#: ops whose vector and scalar forms round differently on x86 (sigmoid, silu, gelu with tanh,
#: softplus, pow) and ops that do not, in float and half types
OPS = {
    "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "softplus": torch.nn.functional.softplus,
    "pow": lambda x: x.abs() ** 1.7, "rsqrt": lambda x: torch.rsqrt(x.abs() + 1e-3), "sin": torch.sin,
    "gelu-tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),  # (its own grain)
    "gelu_backward": lambda x: aten.gelu_backward(x * 0.5, x, approximate="tanh"),
}


@pytest.fixture(autouse=True)
def host_tensors():
    """Plain CPU tensors, whatever the suite's device: the host's own kernels are what these
    tests are about (an accelerator's give one call's bits for any cut)."""
    with torchTensorRef.disabled():
        yield


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _bounds(cut, numel, most):
    bounds = [0]
    while bounds[-1] < numel:
        stop = cut(bounds[-1], most)
        assert bounds[-1] < stop <= bounds[-1] + most
        bounds.append(stop)
    return bounds


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [2048, 30720, 32768, 100003, 262144 + 77])
def test_cuts_give_one_calls_bits_on_the_host(threads, count, numel):
    torch.set_num_threads(count)
    torch.manual_seed(numel)
    for dtype in (torch.float32, torch.bfloat16):
        cut = vector_loops.cutter(numel, count, step=vector_loops.STEP_BYTES // dtype.itemsize)
        if cut is None:  # (the whole call's ranges hang on a grain: 100003 elements on 4 threads)
            assert count > 1 and vector_loops.SERIAL < numel <= (count - 1) * vector_loops.GRAIN
            continue
        x = torch.randn(numel).to(dtype)
        # (1000 on four threads: fewer than a multiple of every thread count, so pieces of at
        # most SERIAL elements)
        for most in ((1000,) if count == 4 else ()) + (2 * vector_loops.SERIAL + 1, 10**7):
            bounds = _bounds(cut, numel, most)
            for name, op in OPS.items():
                pieces = torch.cat([op(x[a:b]) for a, b in zip(bounds, bounds[1:])])
                assert torch.equal(pieces, op(x)), (name, dtype, most)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("rows, width", [(3000, 100), (611, 250)])
def test_cuts_in_rows_give_one_calls_bits_on_the_host(threads, count, rows, width):
    # (tensors laid out otherwise, or broadcast: a GEGLU's gate, one half of a projection,
    # in gelu's backward; a power with one exponent per column)
    torch.set_num_threads(count)
    cut = vector_loops.cutter(rows * width, count, width)
    if cut is None:  # (the whole call's ranges end within a row, or hang on a grain)
        ends = vector_loops.ranges(rows * width, count)
        assert ends is None or any(e % width for e in ends)
        return
    torch.manual_seed(rows)
    projection, grad = torch.randn(rows, 2 * width), torch.randn(rows, width)
    exponent = torch.rand(width) + 0.5
    gate = projection[:, width:]
    ops = {"gelu_backward": lambda r: aten.gelu_backward(grad[r], gate[r], approximate="tanh"),
           "silu_backward": lambda r: aten.silu_backward(grad[r], gate[r]),
           "pow": lambda r: grad[r].abs() ** exponent}
    for most in (333, 10**7):
        bounds = _bounds(cut, rows, most)
        for name, op in ops.items():
            pieces = torch.cat([op(slice(a, b)) for a, b in zip(bounds, bounds[1:])])
            assert torch.equal(pieces, op(slice(None))), (name, most)


def test_naive_cuts_would_not_give_them(threads):
    # (the test above can fail: ranges of 4096 elements, as any cut on CUDA, round otherwise
    # on two threads where the whole call's ranges are not multiples of the vector loop)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    x = torch.randn(3 * 65536 + 1000)
    pieces = torch.cat([torch.sigmoid(x[s:s + 4096]) for s in range(0, x.numel(), 4096)])
    assert not torch.equal(pieces, torch.sigmoid(x))
    # (nor pieces of 333 rows of 100 elements, whose own calls split them within a row)
    gate, grad = torch.randn(3000, 200)[:, 100:], torch.randn(3000, 100)
    pieces = torch.cat([aten.silu_backward(grad[s:s + 333], gate[s:s + 333]) for s in range(0, 3000, 333)])
    assert not torch.equal(pieces, aten.silu_backward(grad, gate))


def test_no_cut_where_the_ranges_hang_on_the_grain():
    assert vector_loops.cutter(40000, 3) is None
    assert vector_loops.ranges(5000, 1) == [5000] and vector_loops.ranges(2000, 8) == [2000]
    assert vector_loops.ranges(100001, 2) == [50001, 100001]
    # (a UNet's GEGLU at 256 KiB: 32,768 elements, one range or two of 16,384 alike)
    assert vector_loops.ranges(32768, 2) == [32768] and vector_loops.ranges(30720, 4) == [30720]
    assert vector_loops.ranges(32768, 3) is None


def test_too_few_elements_for_a_cut_ends_nothing():
    cut = vector_loops.cutter(100001, 2)
    assert cut(0, 100) == 0  # (fewer than a step: the caller refuses the op)
    assert cut(50001 // 128 * 128, 4096) == 50001  # (a range's end within reach)
