"""What one aten op costs a GPU, taken from its arguments while a trace is recorded.

Per op: the FLOPs (PyTorch's own formulas from ``torch.utils.flop_counter`` where it has
one, a few more here for the attention kernels CPUs run), the bytes its kernel reads and
writes, whether it launches a kernel at all (a view does not), whether its math is 16-bit
(tensor cores) and whether the host waits for its result (``.item()``). Only shapes and
dtypes are read: the cost of recording is a few dictionary look-ups per op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.flop_counter import flop_registry

_HALF = (torch.float16, torch.bfloat16)

#: ops that gather rows of a large table: the kernel reads what it writes, not the table
_GATHERS = frozenset({"embedding", "index_select", "index", "_unsafe_index", "gather", "embedding_dense_backward"})

#: ops that only change metadata or make an empty tensor: nothing runs on the device
_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                        "lift_fresh", "detach", "alias", "_unsafe_view", "set_", "resize_"})

#: the host reads a device value: it waits for every kernel queued before
_HOST_READS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select",
                         "unique", "_unique2", "repeat_interleave"})


class Kernel(NamedTuple):
    """One op's kernel, as recorded (times in ns on the recording machine)."""

    start: int
    end: int
    flops: int
    nbytes: int
    half: bool      #: 16-bit floating-point math (a GPU runs it on tensor cores)
    launches: bool  #: a kernel runs on the device (a view or an ``empty`` launches none)
    sync: bool      #: the host waits for the result (``.item()``, a data-dependent shape)


def _tensors(values, out):
    for a in values:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            _tensors(a, out)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _attention_flops(name: str, args) -> int:
    # q (..., s, d) @ k^T (..., d, t) then @ v (..., t, dv): two matmuls forward; the backward
    # recomputes the scores and does four more.
    q, k = args[0], args[1]
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() < 2:
        return 0
    batch = q.numel() // (q.shape[-1] * q.shape[-2])
    forward = 4 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return forward * 5 // 2 if "backward" in name else forward


def flops_of(func, args, kwargs, out) -> int:
    """FLOPs of ``func(*args, **kwargs) -> out``; 0 where no formula is known."""
    formula = flop_registry.get(getattr(func, "overloadpacket", None))
    if formula is not None:
        try:
            return int(formula(*args, out_val=out, **kwargs))
        except Exception:  # (a formula that does not take this overload's arguments)
            return 0
    name = getattr(func, "__name__", "")
    if "scaled_dot_product" in name and "for_cpu" in name:
        return _attention_flops(name, args)
    return 0


def measure(func, args, kwargs, out, start: int, end: int) -> Kernel:
    """The :class:`Kernel` of an op that ran from ``start`` to ``end`` (ns)."""
    packet = getattr(func, "overloadpacket", None)
    base = packet.__name__ if packet is not None else getattr(func, "__name__", "")
    inputs = _tensors(list(args) + list(kwargs.values()) if kwargs else args, [])
    outputs = _tensors(out if isinstance(out, (list, tuple)) else (out,), [])
    launches = not (getattr(func, "is_view", False) or base in _NO_KERNEL)
    if not launches:
        nbytes = 0
    elif base in _GATHERS:
        written = sum(_nbytes(t) for t in outputs)
        indices = sum(_nbytes(t) for t in inputs if not t.is_floating_point())
        nbytes = 2 * written + indices
    else:
        nbytes = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
    half = any(t.dtype in _HALF for t in inputs + outputs)
    sync = base in _HOST_READS
    return Kernel(start, end, flops_of(func, args, kwargs, out) if launches else 0, nbytes, half, launches, sync)
