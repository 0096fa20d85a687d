"""An optimizer step whose state does not fit the budget runs parameter by parameter group.

Note [Optimizer steps in parts]: ``torch.optim``'s list implementations update every
parameter with one op per formula term: AdamW's step is a ``_foreach_lerp_`` over all the
first moments, a ``_foreach_mul_`` and a ``_foreach_addcmul_`` over all the second moments,
a ``_foreach_sqrt`` of them, and so on. Where the parameters, gradients and moments do not
fit the budget together, each of those ops runs in slices that fit (``ops/foreach.py``), and
each streams its lists through the device: the moments are brought in and written back once
per op that reads them, not once per step. So the step of an optimizer that updates each
parameter on its own (the ``SLICED`` classes: no term mixes parameters) runs here as several
steps, each over a part of the parameters whose tensors fit an eighth of the manager's share
of the budget (half where the step runs op by op: regions off, a trace or a compile), with
every formula term applied to that part before the next: each tensor is brought in once and
written back once per step. The results are the same bits: every term is elementwise per
parameter, and a list op on a shorter list computes each position as on the whole list.

The step runs whole where it is given a closure (it evaluates the loss: once per step),
where its class was stepped before ``torchTensorRef`` was imported (its hooks would run once
per part), and where it fits an eighth of the manager's share.

Note [Optimizer steps on plain tensors]: with nothing to page (no budget, or pass-through),
each of a step's list ops would still take the manager's path for every op, as the forward
did before regions: AdamW's step is some twenty such ops per parameter group. The step of a
``SLICED`` class runs instead as one op of the manager (``regions.views_call``): its
parameters, gradients and state are made resident and pinned together, the step runs on
plain tensors of their bytes (its parameter lists and its state swapped for the duration
of the call, keyed by the plain parameters), and what it wrote is marked written, with the
version counters plain torch's would have. It does so once the optimizer is in its steady
state: the parameters with gradients, and the names in their state, are those the previous
step left. A first step makes the state, and tensors made inside a step are new blocks: it
runs op by op, as does a step given a closure or a tensor (GradScaler's scale, to a fused
step), one whose groups hold tensors (a tensor learning rate), or one with a tensor that is
not a TensorRef.

Note [Optimizer steps under a budget]: under a budget, each part of a step (the whole step
where it fits an eighth of the manager's share, or half of it until the budget has paged,
as regions' size rule: Note [Regions until the budget pages]) runs on plain tensors the same way, as one
op whose blocks are made resident within the budget with room beside them for what the
step allocates inside (AdamW's square roots of its second moments, as large as the part's
parameters): op by op, a step is some ten list ops per part and an ``item()`` per parameter
for each bias correction, each taking the manager's path. That room is measured: in its
steady state a part first runs op by op under a dispatch mode that follows the bytes its
ops allocate (``regions.inside.Measure``, as a region's first call), and from the next step
on it runs on plain tensors with that peak kept as room. A part whose blocks and room do
not fit as things stand runs op by op. The gradients count as written only where their
version counters moved: a gradient the step read alone stays as clean as op by op, and an
eviction drops it instead of writing it back.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch

from .. import regions
from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr
from ..regions.inside import Measure
from ..regions.op import RegionSpec
from ..regions.views_call import run_on_views

#: optimizers whose step updates each parameter from its own gradient and state alone
SLICED = ("Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta")
#: (owner, name) of the steps wrapped by ``patching.patch``
STEP_METHODS = tuple((f"torch.optim.{name.lower()}:{name}", "step") for name in SLICED)
#: the classes themselves: a subclass may mix parameters in a step of its own
_CLASSES = tuple(getattr(torch.optim, name) for name in SLICED)
#: what each optimizer's last step left (``_shape``): a step that finds the same runs on
#: plain tensors (Note [Optimizer steps on plain tensors])
_left: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
#: under a budget, each part's parameters (their ids) -> the peak bytes its step allocated
#: inside, measured op by op (Note [Optimizer steps under a budget])
_peaks: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict]" = weakref.WeakKeyDictionary()
#: the op the strategies see for a step on plain tensors (Flow keys its history on it)
_STEP = RegionSpec("optimizer step")


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
    # (where the step may run on plain tensors under a budget that pages, an eighth of the
    # share: a part, the room for what its step allocates inside (as large as its
    # parameters) and the next part, prefetched beside it, take a third of it, leaving the
    # rest to what the strategy keeps from step to step; larger parts moved more bytes, as
    # each is resident whole. Until the budget pages, half: nothing is kept or prefetched
    # for later, and each part is an op's host work. Op by op only each list op's tensors
    # are resident at once, and half the share means fewer ops)
    room = _mgr.accounting.share() // (8 if _views_allowed() and _mgr.paged else 2)
    host = _mgr.host_tier.op_room()
    if host is not None:  # (a part's tensors are read from disk into host copies first)
        room = min(room, host)
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
    """``Optimizer.step`` of a ``SLICED`` class: in parts where its state does not fit, on
    plain tensors in its steady state (Notes [Optimizer steps on plain tensors], [Optimizer
    steps under a budget])."""
    opt, rest = (instance, args) if instance is not None else (args[0] if args else None, args[1:])
    if (not isinstance(opt, torch.optim.Optimizer) or rest or kwargs.get("closure") is not None
            or getattr(wrapped, "hooked", False) or type(opt) not in _CLASSES):
        return wrapped(*args, **kwargs)
    if not _views_allowed():
        return _in_parts(opt, wrapped, args, kwargs, False)
    shape = _shape(opt)
    steady = shape is not None and _left.get(opt) == shape and not _tensor_among(kwargs)
    if _mgr.backend.passthrough or _mgr.settings.budget_value is None:
        # (nothing to page: whole; what ``_left`` holds stays after a step on plain tensors,
        # so a state name the step added makes the next step op by op)
        whole = steady and _fits_host_budget(opt)
        out = _on_plain_tensors(opt, wrapped, args, kwargs) if whole else wrapped(*args, **kwargs)
    else:
        out = _in_parts(opt, wrapped, args, kwargs, steady)
    if not steady:
        _left[opt] = _shape(opt)  # (a step op by op may have made state)
    return out


def _fits_host_budget(opt: torch.optim.Optimizer) -> bool:
    """Whether the step's tensors fit the host budget together: on plain tensors, as one
    op, they are all read into host copies first; else it runs op by op, its list ops in
    slices that fit."""
    host = _mgr.host_tier
    return host.limit is None or host.holds(sum(_param_bytes(opt, p) for g in opt.param_groups for p in g["params"]))


def _views_allowed() -> bool:
    """Whether a step may run on plain tensors as one op of the manager."""
    return (regions.enabled and _mgr.trace is None and not _mgr.lock._is_owned()
            and not torch.compiler.is_compiling())


def _tensor_among(kwargs) -> bool:
    # (a tensor among its arguments, as GradScaler gives a fused step its scale: op by op)
    return any(isinstance(v, torch.Tensor) for v in kwargs.values())


def _in_parts(opt: torch.optim.Optimizer, wrapped, args, kwargs, steady: bool):
    """The step part by part (``parts``; one part where it fits whole): a part on plain
    tensors where the optimizer is ``steady`` and what that part allocates inside was
    measured; else op by op, measured where ``steady``."""
    split = parts(opt)
    groups = opt.param_groups
    whole = [g["params"] for g in groups]
    peaks = _peaks.setdefault(opt, {}) if steady else None
    out = None
    try:
        for part in split or (whole,):
            for g, ps in zip(groups, part):
                g["params"] = ps
            if not steady:
                out = wrapped(*args, **kwargs)
                continue
            key = tuple(id(p) for ps in part for p in ps)
            inside = peaks.get(key)
            if inside is not None:
                try:
                    out = _on_plain_tensors(opt, wrapped, args, kwargs, inside)
                    continue
                except OutOfBudgetError:
                    pass  # (its blocks and room do not fit as things stand: nothing changed)
            meter = Measure(_blocks_of(opt), _mgr.alloc_bytes)  # (what it writes in place is not new)
            with meter:
                out = wrapped(*args, **kwargs)
            peaks[key] = meter.peak
    finally:
        for g, ps in zip(groups, whole):
            g["params"] = ps
    return out


def _blocks_of(opt: torch.optim.Optimizer) -> set:
    """Ids of the blocks of the step's parameters, gradients and state."""
    state = opt.state
    out = set()
    for g in opt.param_groups:
        for p in g["params"]:
            s = state.get(p)
            for t in (p, p.grad, *(s.values() if s else ())):
                if isinstance(t, TensorRef):
                    out.add(block_of(t).id)
    return out


def _shape(opt: torch.optim.Optimizer):
    """Each parameter, whether it has a gradient and its state's names; ``None`` where a
    tensor of the step is not a TensorRef or a group holds one (the step runs op by op)."""
    state = opt.state
    out = []
    for g in opt.param_groups:
        if g.get("differentiable"):
            return None  # (its step is part of a graph: on the TensorRefs autograd tracks)
        for k, v in g.items():
            if k != "params" and isinstance(v, torch.Tensor):
                return None
        for p in g["params"]:
            grad = p.grad
            if not isinstance(p, TensorRef) or grad is not None and not isinstance(grad, TensorRef):
                return None
            s = state.get(p)
            if s:
                for v in s.values():
                    if isinstance(v, torch.Tensor) and not isinstance(v, TensorRef):
                        return None
            out.append((p, grad is not None, tuple(s) if s else ()))
    return tuple(out)


def _on_plain_tensors(opt: torch.optim.Optimizer, wrapped, args, kwargs, inside=None):
    groups, state = opt.param_groups, opt.state
    # (a parameter without a gradient is not given: the step passes it by, as a TensorRef)
    params = [p for g in groups for p in g["params"] if p.grad is not None]
    # (each state looked up once: a tensor hashes in Python, and the step is per tensor)
    states = [state.get(p) for p in params]
    entries = [(i, k, v) for i, s in enumerate(states) if s for k, v in s.items() if isinstance(v, TensorRef)]
    refs = params + [p.grad for p in params] + [v for _i, _k, v in entries]
    n = len(params)

    def step(views, adopt):
        plain = dict(zip(map(id, params), views))
        mine = [dict(s) if s else {} for s in states]  # (what the step sees, by parameter)
        for view, grad in zip(views, views[n:2 * n]):
            view.grad = grad
        for (i, k, _v), view in zip(entries, views[2 * n:]):
            mine[i][k] = view
        swapped = defaultdict(dict, zip(views, mine))
        whole = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [plain.get(id(p), p) for p in g["params"]]
            opt.state = swapped
            return wrapped(*args, **kwargs)
        finally:
            opt.state = state
            for g, ps in zip(groups, whole):
                g["params"] = ps
            given = dict(zip(map(id, views), refs))
            for p, view, s in zip(params, views, states):
                view.grad = None
                if s is None:
                    s = state[p]
                # (what the step assigned to its state: a view given back is its TensorRef)
                for k, v in swapped[view].items():
                    ref = given.get(id(v))
                    if ref is not None:
                        if s.get(k) is not ref:
                            s[k] = ref
                    else:
                        s[k] = adopt(v) if isinstance(v, torch.Tensor) else v

    return run_on_views(_STEP, refs, step, inside, range(n, 2 * n))
