"""Where an elementwise op computed by the host's kernels may be cut and keep one call's bits.

Note [Cuts of host kernels]: a CUDA elementwise kernel computes every element by the same
code, wherever it falls, so any cut of its tensors gives the bits of one call. PyTorch's CPU
kernels (the ``"sim"`` device's) do not, for the ops whose vectorized and scalar forms round
differently (``sigmoid``, ``silu``, ``gelu`` with ``tanh``, ``pow`` among them on x86): a
kernel's loop computes each run of ``2 * Vec::size()`` elements with the vector form and the
run's remainder with the scalar one, and it does so once per range its ``parallel_for``
gives a thread. A tensor of ``numel`` elements run on ``threads`` threads is cut into
ranges of ``ceil(numel / threads)`` elements when ``numel`` exceeds the grain (32,768
elements for most kernels; ``gelu``'s grain is its size over the threads above 16,384), and
each range's last ``len % (2 * Vec::size())`` elements take the scalar form.

A piece gives those bits when (1) it lies within one such range of the whole call, (2) it
starts a multiple of a *step* after that range's start (``STEP_BYTES`` of its elements, a
multiple of any type's ``2 * Vec::size()``), and (3) its own call splits it the same way: it
is at most ``SERIAL`` elements (below every grain: one range), or a multiple of the step
times every thread count from 1 to ``threads`` (every range its ``parallel_for`` may make is
then a multiple of the step); a piece not ending its range must be a multiple of the step
too. Where the whole call's ranges depend on a grain this module does not know (more than
``SERIAL`` elements, at most ``(threads - 1) * GRAIN``), they matter only where they end off
the vector loop's runs: if every thread count the call may take ends them on a multiple of
the step, the whole call computes as one range would; else no cut is offered and the op is
refused. ``tests/ops/test_vector_loops.py`` checks these cuts against one call of the
host's own kernels, so a PyTorch that splits its loops otherwise fails there.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch

#: a piece starts a multiple of this many bytes of elements after its range's start: the
#: widest ``2 * Vec::size()`` of any type (two 512-bit vectors: 64 bf16 elements, 32 float32)
STEP_BYTES = 128
#: the grain of most of PyTorch's CPU elementwise kernels (``at::internal::GRAIN_SIZE``)
GRAIN = 32768
#: a piece of at most this many elements runs as one range whatever its kernel's grain
SERIAL = 2048


def _openmp() -> bool:
    """Whether ATen's ``parallel_for`` is OpenMP's (whose ranges this module models)."""
    return "OpenMP" in torch.__config__.parallel_info()


_OPENMP: Optional[bool] = None


def ranges(numel: int, threads: int, unit: int = STEP_BYTES) -> Optional[List[int]]:
    """The ends of the ranges one call over ``numel`` elements gives its threads (the last
    is ``numel``), or ``None`` where they depend on the kernel's grain. Ranges whose ends are
    multiples of ``unit`` (where the vector loop starts again anyway) count as one."""
    global _OPENMP
    if threads <= 1 or numel <= SERIAL:
        return [numel]
    if _OPENMP is None:
        _OPENMP = _openmp()
    if not _OPENMP:
        return None
    if numel > (threads - 1) * GRAIN:
        size = -(-numel // threads)
        return sorted({min(numel, t * size) for t in range(1, threads + 1)})
    # (fewer elements: how many threads the call takes hangs on its kernel's grain, at least
    # SERIAL; every count it may take must then end its ranges where the loop starts again)
    counts = range(2, min(threads, -(-numel // SERIAL)) + 1)
    return [numel] if all(-(-numel // n) % unit == 0 for n in counts) else None


def cutter(numel: int, threads: int, row: int = 1,
           step: int = STEP_BYTES) -> Optional[Callable[[int, int], int]]:
    """``stop(start, most)``: where the piece starting at ``start`` (a cut this function gave,
    or 0) ends, given at most ``most`` positions; 0 when ``most`` is too small. ``None``
    where the op cannot be cut (Note [Cuts of host kernels]).

    A position is one element (``row`` 1: the op's tensors are one range of bytes, which the
    kernel loops over as one run; ``step``: ``STEP_BYTES`` over their smallest element size,
    the default fits any), or a row of ``row`` elements of a result cut along its
    positions (tensors that broadcast or are laid out otherwise, each with its last dimension
    dense): the kernel then starts its vector loop again at each row, so a piece of whole rows
    needs no step, only the whole call's ranges falling between rows."""
    ends = ranges(numel, threads, step if row == 1 else row)
    if ends is None or any(e % row for e in ends):
        return None
    ends = [e // row for e in ends]
    align = step if row == 1 else 1
    whole = align * math.lcm(*range(1, threads + 1))
    serial = SERIAL // row

    def stop(start: int, most: int) -> int:
        end = next(e for e in ends if e > start)
        left = end - start
        if left <= most and (left <= serial or left % whole == 0):
            return end
        n = min(most, left) // whole * whole
        if n == 0:
            n = min(most, left, serial) // align * align
        return start + n if n else 0

    return stop
