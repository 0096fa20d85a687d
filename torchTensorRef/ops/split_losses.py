"""The negative log-likelihood over a vocabulary larger than the budget (Note [Losses over a
large vocabulary]), with the machinery of ``split.py``.

Note [Losses over a large vocabulary]: ``cross_entropy`` is ``log_softmax`` (split by rows,
``split_handlers.py``) then ``nll_loss``, which reads one value per row of its input: the
log-probability of the row's target. Its kernels, forward and backward, compute from those
values alone, in the order of the rows, whatever the number of columns. So where the
input does not fit, the values are picked from its host copy into a one-column input, the
targets renumbered to that column (ignored rows stay ignored), and the op runs on them:
the same kernel over the same values, so the same bits. The backward's result, as large as
the input and zero but at the targets, is made in host memory and given the one-column
result's values at the targets.

A class weight (``weight=``) is read per target class, which one column cannot carry: such
a call that does not fit is refused.
"""

from __future__ import annotations

import torch

from ..core.op_specs import OpSpec, implements
from ..core.tensor_ref import TensorRef, host_view
from .pieces import gathered_piece, held_on_host, host_result, settle, to_host
from .split import default, op_bytes, refuse, when_refused

aten = torch.ops.aten


def _host(ref) -> torch.Tensor:
    """Plain host values of ``ref`` (a TensorRef settled first, or a plain tensor)."""
    if isinstance(ref, TensorRef):
        settle([ref])
        return host_view(ref).detach()
    return ref.detach().cpu()


def _one_column(inputs: TensorRef, target, ignore_index: int):
    """(the targets' values of the rows of ``inputs`` as a one-column piece, the targets
    renumbered to it as a piece, the host targets)."""
    t = _host(target)
    keep = t != ignore_index
    picked = _host(inputs).gather(1, torch.where(keep, t, 0).unsqueeze(1))
    local = torch.where(keep, torch.zeros_like(t), t)
    return gathered_piece(picked.clone()), gathered_piece(local.clone()), t


@implements(aten.nll_loss_forward.default)
@when_refused
def nll_loss_forward(func, args, kwargs, spec: OpSpec, left: int):
    """``nll_loss`` on the targets' values alone when its input does not fit."""
    if kwargs or len(args) != 5 or args[2] is not None or args[0].dim() != 2 or not isinstance(args[0], TensorRef):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    inputs, target, _weight, reduction, ignore_index = args
    picked, local, _t = _one_column(inputs, target, ignore_index)
    return default(func, (picked, local, None, reduction, ignore_index), {}, spec)


@implements(aten.nll_loss_backward.default)
@when_refused
def nll_loss_backward(func, args, kwargs, spec: OpSpec, left: int):
    """The gradient at the targets, computed on one column and placed in a host result."""
    if kwargs or len(args) != 7 or args[3] is not None or args[1].dim() != 2 or not isinstance(args[1], TensorRef):
        raise refuse(spec.name, op_bytes(spec, args, kwargs), left)
    grad_output, inputs, target, _weight, reduction, ignore_index, total_weight = args
    t = _host(target)
    keep = t != ignore_index
    column = gathered_piece(torch.zeros((inputs.shape[0], 1), dtype=inputs.dtype))  # (its shape is read)
    local = gathered_piece(torch.where(keep, torch.zeros_like(t), t))
    part = to_host(default(func, (grad_output, column, local, None, reduction, ignore_index, total_weight), {}, spec))
    out = host_result(tuple(inputs.shape), inputs.dtype, zero=True)
    rows = keep.nonzero().squeeze(1)
    with held_on_host([out]):  # (its host copy stays while the host writes it)
        host_view(out)[rows, t[rows]] = part[rows, 0]
    return out
