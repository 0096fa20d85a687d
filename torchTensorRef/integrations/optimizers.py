"""An optimizer step whose state does not fit the budget runs parameter by parameter group.

Note [Optimizer steps in parts]: ``torch.optim``'s list implementations update every
parameter with one op per formula term: AdamW's step is a ``_foreach_lerp_`` over all the
first moments, a ``_foreach_mul_`` and a ``_foreach_addcmul_`` over all the second moments,
a ``_foreach_sqrt`` of them, and so on. Where the parameters, gradients and moments do not
fit the budget together, each of those ops runs in slices that fit (``ops/foreach.py``), and
each streams its lists through the device: the moments are brought in and written back
once per op that reads them, not once per step. So the step of an optimizer that updates
each parameter on its own (the ``SLICED`` classes: no term mixes parameters) runs here as
several steps, each over a part of the parameters whose tensors fit half of the manager's
share of the budget, with every formula term applied to that part before the next: each
tensor is brought in once and written back once per step. The results are the same bits:
every term is elementwise per parameter, and a list op on a shorter list computes each
position as on the whole list.

The step runs whole where it is given a closure (it evaluates the loss: once per step),
where its class was stepped before ``torchTensorRef`` was imported (its hooks would run once
per part), and with nothing to page.
"""

from __future__ import annotations

import torch

from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr

#: optimizers whose step updates each parameter from its own gradient and state alone
SLICED = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta")
#: (owner, name) of the steps wrapped by ``patching.patch``
STEP_METHODS = tuple((f"torch.optim.{name.lower()}:{name}", "step") for name in SLICED)
#: the classes themselves: a subclass may mix parameters in a step of its own
_CLASSES = tuple(getattr(torch.optim, name) for name in SLICED)


def _bytes(t) -> int:
    if isinstance(t, TensorRef):
        return _mgr.block_bytes(block_of(t).nbytes)
    return 0


def _param_bytes(opt: torch.optim.Optimizer, p) -> int:
    """Bytes the step holds on the device for ``p``: it, its gradient and its state (before
    the first step, assumed twice the parameter: Adam's moments)."""
    state = opt.state.get(p)
    held = sum(_bytes(v) for v in state.values()) if state else 2 * _bytes(p)
    return _bytes(p) + _bytes(p.grad) + held


def parts(opt: torch.optim.Optimizer):
    """The parameter lists of each part, per group (Note [Optimizer steps in parts]);
    ``None`` where the step runs whole."""
    limit = _mgr.limit
    if _mgr.settings.budget_value is None or limit is None or _mgr.backend.passthrough or type(opt) not in _CLASSES:
        return None
    room = (limit - _mgr.accounting.elsewhere_bytes) // 2
    groups = [g["params"] for g in opt.param_groups]
    sizes = [[_param_bytes(opt, p) for p in ps] for ps in groups]
    if sum(map(sum, sizes)) <= room:
        return None
    out, part, held = [], [[] for _ in groups], 0
    for i, (ps, ns) in enumerate(zip(groups, sizes)):
        for p, n in zip(ps, ns):
            if held and held + n > room:
                out.append(part)
                part, held = [[] for _ in groups], 0
            part[i].append(p)
            held += n
    out.append(part)
    return out if len(out) > 1 else None


def step_wrapper(wrapped, instance, args, kwargs):
    """``Optimizer.step`` of a ``SLICED`` class: in parts where its state does not fit."""
    opt, rest = (instance, args) if instance is not None else (args[0] if args else None, args[1:])
    if (not isinstance(opt, torch.optim.Optimizer) or rest or kwargs.get("closure") is not None
            or getattr(wrapped, "hooked", False)):
        return wrapped(*args, **kwargs)
    split = parts(opt)
    if split is None:
        return wrapped(*args, **kwargs)
    groups = opt.param_groups
    whole = [g["params"] for g in groups]
    out = None
    try:
        for part in split:
            for g, ps in zip(groups, part):
                g["params"] = ps
            out = wrapped(*args, **kwargs)
    finally:
        for g, ps in zip(groups, whole):
            g["params"] = ps
    return out
