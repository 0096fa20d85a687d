"""A region as one op of the manager: what the strategies see of it, the plain tensors a call
is given for its TensorRefs, and its results as TensorRefs (Note [Regions] in
``mechanism.py``)."""

from __future__ import annotations

import torch

from ..core.tensor_ref import TensorRef, block_of, compute_view, grad_alias, host_view
from ..memory.sim.tensor import NAME as SIM, SimTensor
from ..ops.op_context import OpContext, wrap_one
from .scan import Call

_Tensor = torch.Tensor

#: a SimTensor's own attributes, never its TensorRef's
_WRAPPER_ATTRIBUTES = frozenset({"data_"})
_MISSING = object()


def take_back_attributes(views) -> None:
    """Set on each TensorRef the attributes the call set on what it was given for it
    (``call.views``), as plain torch's call would have set them on the tensor itself."""
    for ref, given, _address, _version in views.values():
        got = given.__dict__
        if got:
            mine = ref.__dict__
            for k, v in got.items():
                if mine.get(k, _MISSING) is not v and k not in _WRAPPER_ATTRIBUTES:
                    mine[k] = v


#: the most calls a region lets pass before it tries again to make a group of its tensors
#: where it could not (fewer than two with current host copies of their own: tensors made
#: on the device have none until first evicted; or a group too large beside the budget):
#: each try reads every one of them, so the wait doubles from one call up to this
GROUP_RETRY = 32


class Grouping:
    """A region's group of its module's parameters and buffers, made under a budget (Note
    [Region groups] in ``memory/groups.py``), and made again when it is dissolved."""

    __slots__ = ("group", "wait", "backoff")

    def __init__(self) -> None:
        self.group = None
        self.wait = 0
        self.backoff = 1

    def refresh(self, mgr, call: Call) -> None:
        group = self.group
        if group is not None and not group.dissolved:
            return
        if self.wait:
            self.wait -= 1
            return
        self.group = group = mgr.groups.form([block_of(v) for _d, _k, v in call.slots[:call.params]])
        if group is None:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, GROUP_RETRY)
        else:
            self.backoff = 1


class RegionSpec:
    """What the op protocol and the strategies read of an op's spec, for a region (one per
    region: Flow keys its history on it)."""

    __slots__ = ("name",)
    restrides = False

    def __init__(self, name: str):
        self.name = name


class RegionContext(OpContext):
    """A region call (or its backward) as one op: its blocks and the room kept for what it
    allocates inside (``estimate``, always set by the caller)."""

    __slots__ = ()

    def record_inside(self, trace, nbytes: int) -> None:
        """In a trace recorded with regions, the room kept for the inside (``nbytes``) less
        the op's results (its accesses already) as one more block the op creates and writes:
        dead after it, the offline reference makes room for it and never moves it. Its id is
        negative: no block's."""
        nbytes -= sum(b.nbytes for b in self.outputs)
        if nbytes > 0:
            scratch = -1 - self.index
            trace.accesses.append((self.index, scratch, nbytes, True))
            trace.created.add(scratch)


def bytes_of(t):
    """The plain tensor holding a plain or ``SimTensor`` result's bytes; ``None`` for
    anything else (a TensorRef, not a tensor)."""
    if t.__class__ is SimTensor:
        return t.data_
    if isinstance(t, TensorRef) or not isinstance(t, _Tensor):
        return None
    return t


class Wrapper:
    """Outputs as TensorRefs: an input given back is that input, anything else is adopted."""

    def __init__(self, mgr, ctx, given, device_views, grad=False):
        self.mgr, self.ctx, self.given = mgr, ctx, given
        backend = mgr.backend
        #: a CPU tensor the call made on purpose on strict "sim" stays one, as plain torch's would
        self.cpu_stays = (device_views and not ctx.on_host and getattr(backend, "strict", False)
                          and backend.declared.type == SIM)
        self.grad = grad
        self.linked = []  # (plain output needing gradients, its TensorRef)

    def __call__(self, t):
        ref = self.given.get(id(t))
        if ref is not None:
            return ref
        plain = bytes_of(t)
        if plain is None:
            return t
        if self.cpu_stays and t.__class__ is not SimTensor and plain.is_cpu:
            return t
        if self.grad and t.requires_grad:
            for p, r in self.linked:
                if p is t:
                    return r
            ref = wrap_one(plain.detach(), self.ctx, self.mgr)
            self.linked.append((t, ref))
            return ref
        return wrap_one(plain, self.ctx, self.mgr)

    def given_back(self, out, inputs):
        """``out`` with its tensors on the inputs' storages (``inputs``: their keys) as
        TensorRefs, the new ones left plain (Note [Loops on plain tensors] in ``scope.py``)."""
        def keep(t):
            plain = bytes_of(t)
            if plain is None or (id(t) not in self.given and plain.untyped_storage()._cdata not in inputs):
                return t
            return self(t)
        return self.tree(out, keep)

    def tree(self, out, wrap=None):
        wrap = wrap or self
        if isinstance(out, _Tensor):
            return wrap(out)
        cls = out.__class__
        if cls is tuple or cls is list:
            return cls(self.tree(o, wrap) for o in out)
        if isinstance(out, tuple) and hasattr(out, "_fields"):
            return cls(*(self.tree(o, wrap) for o in out))
        if isinstance(out, dict):  # (ModelOutput is a dict whose items mirror its attributes)
            for k, v in list(out.items()):
                w = self.tree(v, wrap)
                if w is not v:
                    out[k] = w
            return out
        if isinstance(out, (list, tuple)):
            return cls(self.tree(o, wrap) for o in out)
        return out


class Giver:
    """The plain tensors a region call is given for its TensorRefs (``call.views``): views of
    their copies, leaves where the call needs gradients, ``SimTensor``s on strict "sim"."""

    __slots__ = ("views", "make", "training", "sim", "alias")

    def __init__(self, call: Call, on_host: bool, training, sim: bool):
        self.views = call.views
        self.make = host_view if on_host else compute_view
        self.training = training
        self.sim = sim
        #: a TensorRef needing gradients gets an alias kept with its cached view
        self.alias = training is None and not sim and not on_host

    def tree(self, a):
        """``a`` with each TensorRef, in tuples, lists and dicts, replaced by what the call gets."""
        if isinstance(a, TensorRef):
            return self.one(a)
        cls = a.__class__
        if cls is tuple or cls is list:
            return cls(self.tree(e) for e in a)
        if cls is dict:
            return {k: self.tree(v) for k, v in a.items()}
        return a

    def one(self, a: TensorRef):
        """What the call gets for the TensorRef ``a`` (the same view wherever it is given)."""
        entry = self.views.get(id(a))
        return entry[1] if entry is not None else self.new(a)

    def new(self, a: TensorRef):
        """What the call gets for the TensorRef ``a``, not given to it yet."""
        grad = a.requires_grad
        if grad and self.alias:
            # Note [Views need gradients as their tensors do]: with gradients off (the only way
            # a call that reads a tensor needing them is not a training call) the view still
            # says ``requires_grad`` as the tensor does, because kernels choose by it: matmul
            # folds a 3-d input into one matrix product where an operand needs gradients, and
            # runs batched products otherwise, whose last bits differ. (An alias: the view
            # itself is the one the per-op path runs ops on.) The alias is kept with the view
            # from call to call: made afresh for each of a module's parameters, it was a
            # third of what giving a call its views cost.
            plain, given = grad_alias(a)
        else:
            plain = self.make(a)
            training = self.training
            if training is not None:
                training.by_storage[plain.untyped_storage()._cdata] = a
            if training is not None and grad:
                given = training.leaf(a, plain)
            elif self.sim:
                given = SimTensor(plain, grad)
            elif grad:
                given = plain.detach().requires_grad_(True)  # (a host copy's view: see above)
            else:
                given = plain
        attributes = a.__dict__
        if attributes:
            # What a tensor carries is what the call reads of it, as in plain torch: torch's
            # ``_is_param`` mark (``isinstance(p, nn.Parameter)``) and its users' attributes.
            # Without the mark, code that moves a module's parameters by their kind (a
            # parametrization registered and removed in forward, peft's ``target_parameters``)
            # put the view back as a buffer, and the module lost the parameter, silently.
            # (``take_back_attributes`` gives the TensorRef what the call set.)
            given.__dict__.update(attributes)
        # (the version of what the call got: on "sim" the wrapper's counts the writes; an
        # inference tensor has none, and the call may write it: None)
        # (and where its bytes were: a call that rebinds it, ``given.data = t``, moves them)
        self.views[id(a)] = (a, given, plain.data_ptr(), None if given.is_inference() else given._version)
        return given
