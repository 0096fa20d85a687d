"""Kernels the simulated device needs that the CPU lacks: the fused RNN cells, and a
histogram of integers.

PyTorch's LSTM and GRU run on a non-CPU device through fused cell ops
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``) that only CUDA implements. The
simulated device computes with CPU kernels, so these are their CPU kernels, written from
the cells' equations with the CUDA kernels' conventions (the gate order, and a workspace of
the activated gates that backward reuses). Registered once, when ``"sim"`` is registered.

Note [Kernels CUDA has for more dtypes]: an op the CPU runs for some dtypes only, where
CUDA's kernel takes more, made code written for an accelerator fail on "sim" where it runs
on CUDA: transformers' mixture-of-experts layers count the tokens routed to each expert with
``torch.histc`` of an integer tensor on any device but the CPU, and the CPU's ``histc``
takes floating point only. Such an op is not given a CPU kernel (plain CPU torch must keep
refusing it); the device runs it as a composite of ops the CPU has (``emulation``), on
plain device tensors (``SimTensor``'s dispatch) and on TensorRefs alike (``ops/device_kernels.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

_library: Optional[torch.library.Library] = None


def register() -> None:
    global _library
    if _library is not None:
        return
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 (CPU kernels of existing ops)
    for name, fn in (("_thnn_fused_lstm_cell", lstm_cell), ("_thnn_fused_lstm_cell_backward_impl", lstm_cell_backward),
                     ("_thnn_fused_gru_cell", gru_cell), ("_thnn_fused_gru_cell_backward", gru_cell_backward)):
        if hasattr(torch.ops.aten, name):
            lib.impl(name, fn, "CPU")
    _library = lib


def histc_of_integers(input: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:
    """``torch.histc`` of an integer tensor as CUDA's kernel computes it: the limits taken as
    the input's type (its extremes where they are equal, widened by one each way where those
    are too), elements outside them not counted, and an element's bin found in integer
    arithmetic, ``(value - low) * bins // (high - low)``, the top limit in the last bin; the
    counts in the input's dtype."""
    if bins <= 0:
        raise RuntimeError(f"bins must be > 0, but got {bins} for histc")
    values = input.reshape(-1).to(torch.int64)
    low, high = int(min), int(max)
    if low == high and values.numel():
        low, high = int(values.min()), int(values.max())
    if low == high:
        low, high = low - 1, high + 1
    if low > high:
        raise RuntimeError("max must be larger than min")
    inside = values[(values >= low) & (values <= high)]
    index = ((inside - low) * bins).div(high - low, rounding_mode="floor").clamp(max=bins - 1)
    return torch.bincount(index, minlength=bins).to(input.dtype)


def emulation(func, args: tuple):
    """The composite that runs ``func`` on the device where the CPU's kernel refuses what
    CUDA's takes (Note [Kernels CUDA has for more dtypes]), or ``None``."""
    if func is _HISTC and args and not args[0].is_floating_point() and args[0].device.type != "cpu":
        return histc_of_integers  # (not of a host tensor: the CPU's kernel refuses it in plain torch)
    return None


_HISTC = torch.ops.aten.histc.default
#: the ops ``emulation`` may answer for (a set, to ask once per op)
EMULATED = frozenset({_HISTC})


def _gates(input_gates: Tensor, hidden_gates: Tensor, input_bias: Optional[Tensor],
           hidden_bias: Optional[Tensor]) -> Tensor:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        assert hidden_bias is not None  # (aten passes both biases or neither)
        gates = gates + input_bias + hidden_bias
    return gates


def lstm_cell(input_gates: Tensor, hidden_gates: Tensor, cx: Tensor, input_bias: Optional[Tensor] = None,
              hidden_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """``(hy, cy, workspace)``; the workspace holds the activated gates i, f, g, o."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat((i, f, g, o), 1)


def lstm_cell_backward(grad_hy: Optional[Tensor], grad_cy: Optional[Tensor], cx: Tensor, cy: Tensor, workspace: Tensor,
                       has_bias: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(grad_gates, grad_cx, grad_bias)`` of :func:`lstm_cell`."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_hy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    grad_c = grad_hy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        grad_c = grad_c + grad_cy
    grad_gates = torch.cat((grad_c * g * i * (1 - i), grad_c * cx * f * (1 - f), grad_c * i * (1 - g * g),
                            grad_hy * tanh_cy * o * (1 - o)), 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, grad_c * f, grad_bias


def gru_cell(input_gates: Tensor, hidden_gates: Tensor, hx: Tensor, input_bias: Optional[Tensor] = None,
             hidden_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(hy, workspace)``; the workspace holds r, z, n, hx and the hidden part of n's gate."""
    if input_bias is not None:
        assert hidden_bias is not None  # (as in _gates)
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, i_n = input_gates.chunk(3, 1)
    hr, hz, h_n = hidden_gates.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (i_n + r * h_n).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat((r, z, n, hx, h_n), 1)


def gru_cell_backward(grad_hy: Tensor, workspace: Tensor,
                      has_bias: bool) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)``."""
    r, z, n, hx, h_n = workspace.chunk(5, 1)
    grad_n = grad_hy * (1 - z) * (1 - n * n)
    grad_z = grad_hy * (hx - n) * z * (1 - z)
    grad_r = grad_n * h_n * r * (1 - r)
    grad_input = torch.cat((grad_r, grad_z, grad_n), 1)
    grad_hidden = torch.cat((grad_r, grad_z, grad_n * r), 1)
    if has_bias:
        return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)
    return grad_input, grad_hidden, grad_hy * z, None, None
