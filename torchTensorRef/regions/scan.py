"""Where a region call's tensors are: the TensorRefs among its arguments and in the plain
objects given to it (a key/value cache), and the tensors it left in them afterwards."""

from __future__ import annotations

import operator
from itertools import compress

import torch

from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.tensor import SimTensor

#: how deep objects among a call's arguments are searched for TensorRefs (cache -> layers
#: list -> layer -> tensor)
OBJECT_DEPTH = 4
#: most values looked at in objects per call (a large structure is not searched whole)
OBJECT_VALUES = 4096

_Tensor = torch.Tensor

class NotARegion(Exception):
    """This call cannot run as a region (raised before anything changed)."""


# Note [Tensors no scan finds]: a call's scan finds the TensorRefs among its arguments, its
# modules' parameters and buffers, and what its modules and the objects given to it hold; a
# module kept out of the module tree (peft's FRoD layers share their tuner's projection
# buffers by ``object.__setattr__``), a closure or a global may hold more. Inside a region
# such a tensor stays a TensorRef and its ops go op by op: the values are right, but with
# gradients the results computed from it and from the call's plain leaves are TensorRefs
# whose graph ends at those leaves, not at the parameters, so the region's node never sees
# them and the parameters' gradients were lost, silently. A measured call (the first with
# gradients always is one, as is the first after its module's submodules or tensors changed:
# ``Region.forget``) sees every block its ops read; one read that is neither the
# scan's nor made by the call makes the region run its calls with gradients op by op.
#
# Note [Plain tensors that need gradients]: a region's backward gives gradients to the
# TensorRefs its call was given, its inner graph's leaves, and to nothing else: a plain
# tensor that needs them (the parameters of a model built inside ``disabled()`` or before
# the import, called with managed inputs; a plain leaf among the arguments) got none, and
# its ``.grad`` stayed what it was, silently (from the second call with gradients: the
# first runs op by op); a call that read only such tensors and TensorRefs needing none
# was run without its graph, and its backward refused. A call that reads one with grad
# mode on is no region: found by the scan among its module's tensors, its arguments and
# what its objects hold, and by its measured call among the tensors its ops read (a
# closure's), after which its calls with gradients run op by op, where autograd sees every
# tensor, as in plain torch.


class Call:
    """One region call's TensorRefs and where they sit."""

    __slots__ = ("refs", "slots", "params", "objects", "held", "views", "shapes", "all_held", "kernel_written",
                 "nested", "stores", "restores", "held_objects", "arg_objects", "host_tensor", "plain_grad")

    def __init__(self):
        self.refs = []  # TensorRefs among the arguments, then the slots'
        self.slots = []  # (container, key, TensorRef): parameters, buffers, objects' attributes
        self.params = 0  # how many of the slots (the first) are the module's parameters and buffers
        self.objects = []  # (container, key, value) of the plain tensors objects held before
        self.held = 0  # bytes of the TensorRefs held by objects
        self.views = {}  # id(TensorRef) -> (TensorRef, view given to the call, its data_ptr, its version)
        self.shapes = []
        self.all_held = []  # every TensorRef the objects hold, in scan order (of which ``slots`` keeps some)
        self.kernel_written = ()  # TensorRefs the call may write with no version counter moving
        self.nested = False  # a nested tensor among the arguments (it has no shape)
        self.stores = []  # (module, attribute name) the call assigned (Note [Stores on modules])
        self.restores = []  # (dict, key, TensorRef) given back after the call, as ``slots``
        self.held_objects = []  # containers its modules hold (searched for what it stored after)
        self.arg_objects = []  # plain objects among its arguments (searched likewise)
        self.host_tensor = False  # a plain CPU tensor among the arguments (Note [Plain CPU tensors])
        self.plain_grad = False  # a plain tensor it reads needs gradients (Note [Plain tensors that need gradients])


def is_object(a) -> bool:
    return (hasattr(a, "__dict__") and not isinstance(a, (torch.nn.Module, type, torch.device))
            and not callable(a))


def scan_args(a, call: Call, seen: set, budget: list) -> None:
    """The TensorRefs among arguments ``a`` (containers walked, objects searched)."""
    if isinstance(a, _Tensor):
        if a.is_nested:
            call.nested = True
            return
        if isinstance(a, TensorRef):
            call.refs.append(a)
        else:
            if a.requires_grad:
                call.plain_grad = True
            if a.device.type == "cpu" and a.dim() and not isinstance(a, SimTensor):
                call.host_tensor = True
        call.shapes.append((tuple(a.shape), a.dtype))
    elif a.__class__ in (list, tuple) or isinstance(a, (list, tuple)):
        for e in a:
            scan_args(e, call, seen, budget)
    elif isinstance(a, dict):
        for e in a.values():
            scan_args(e, call, seen, budget)
    elif is_object(a):
        call.arg_objects.append(a)
        scan_object(a, call, seen, budget, OBJECT_DEPTH)


#: values never searched for tensors: no attributes, items or values to hold one
_LEAVES = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size})


def object_tensors(obj, seen: set, depth: int, budget: list) -> list:
    """``(container, key, tensor)`` of the tensors ``obj`` holds in its attributes, lists and
    dicts, searched ``depth`` levels down and through at most ``budget[0]`` values."""
    out: list = []
    _object_tensors(obj, seen, depth, budget, out)
    return out


#: what a value is to the search of an object, by its class: passed over, a tensor, or searched
_PASS, _TENSOR, _SEARCH = 0, 1, 2
_kinds: dict = dict.fromkeys(_LEAVES, _PASS)
_class_of = operator.attrgetter("__class__")
_first, _second = operator.itemgetter(0), operator.itemgetter(1)
#: classes kept in ``_kinds`` at most (classes made at run time would otherwise pile up)
_MOST_KINDS = 4096


def _kind(v) -> int:
    """What ``v`` is to the search, kept for its class (whether a value is a tensor, a list or
    dict, or an object: an instance with a ``__dict__``, not callable, not a module, type or
    device, is its class's answer)."""
    if isinstance(v, _Tensor):
        kind = _TENSOR
    elif isinstance(v, (list, dict)) or is_object(v):
        kind = _SEARCH
    else:
        kind = _PASS
    if len(_kinds) >= _MOST_KINDS:
        _kinds.clear()
        _kinds.update(dict.fromkeys(_LEAVES, _PASS))
    _kinds[v.__class__] = kind
    return kind


def _object_tensors(obj, seen: set, depth: int, budget: list, out: list) -> bool:
    """``object_tensors`` into ``out``; ``False`` once the budget is spent."""
    if id(obj) in seen or depth == 0:
        return True
    seen.add(id(obj))
    if isinstance(obj, list):
        container = obj
        values = tuple(obj)
        keys = range(len(values))
    else:
        container = obj if isinstance(obj, dict) else obj.__dict__
        items = tuple(container.items())  # (a snapshot: another thread may add to a shared object)
        keys, values = tuple(map(_first, items)), tuple(map(_second, items))
    n = len(values)
    if budget[0] < n:
        return _some_tensors(container, keys, values, seen, depth, budget, out)
    budget[0] -= n
    # (what each value is, by its class, in C loops: most of an object's values are passed
    # over, and this runs for every object given to every region call)
    kinds = list(map(_kinds.get, map(_class_of, values)))
    if None in kinds:
        kinds = [_kind(v) if kind is None else kind for kind, v in zip(kinds, values)]
    for i in compress(range(n), kinds):  # (the values that are tensors or searched)
        v = values[i]
        if kinds[i] == _TENSOR:
            out.append((container, keys[i], v))
        elif not _object_tensors(v, seen, depth - 1, budget, out):
            return False
    return True


def _some_tensors(container, keys, values, seen: set, depth: int, budget: list, out: list) -> bool:
    """``_object_tensors`` of the values of an object larger than what is left of the budget:
    one value at a time, until the budget is spent (``False``)."""
    for k, v in zip(keys, values):
        budget[0] -= 1
        if budget[0] < 0:
            return False
        kind = _kinds.get(v.__class__)
        if kind is None:
            kind = _kind(v)
        if kind == _TENSOR:
            out.append((container, k, v))
        elif kind == _SEARCH and not _object_tensors(v, seen, depth - 1, budget, out):
            return False
    return True


def scan_object(obj, call: Call, seen: set, budget: list, depth: int) -> None:
    # (the TensorRefs objects hold join ``call.refs`` in ``select_object_slots``, once the
    # region knows which of them its call uses)
    for container, k, v in object_tensors(obj, seen, depth, budget):
        if isinstance(v, TensorRef):
            call.slots.append((container, k, v))
        else:
            call.objects.append((container, k, v))
            if v.requires_grad:
                call.plain_grad = True


def select_object_slots(call: Call, used) -> None:
    """Keep of the TensorRefs held by objects those at the positions in ``used`` (``None``:
    all), and add them to the call's working set.

    A decoder layer is given the whole key/value cache but reads its own layer's tensors:
    the others stay TensorRefs in the cache during the call, out of its working set (one
    the call does read after all goes through the per-op path: correct, slower).
    """
    held = call.slots[call.params:]
    call.all_held = [v for _container, _k, v in held]
    if used is not None:
        held = [held[i] for i in used]
        call.slots[call.params:] = held
    for _container, _k, v in held:
        call.refs.append(v)
        call.held += block_of(v).nbytes


#: the attributes every module has (torch's own state): never a module's held values
_MODULE_STATE = frozenset(torch.nn.Module().__dict__)


def held_values(module: torch.nn.Module):
    """``(dict, name)`` of the attributes of ``module`` and its submodules that hold tensors
    or containers of them besides their parameters and buffers: a TensorRef a forward reads
    from there (a cache of its own, a tensor kept by a library) is part of its call's working
    set, as what the objects given to it hold."""
    out = []
    for m in module.modules():
        d = m.__dict__
        for name, v in d.items():
            if name not in _MODULE_STATE and isinstance(v, (_Tensor, dict, list)):
                out.append((d, name))
    return out


def parameter_slots(module: torch.nn.Module):
    """(dict, key) of every parameter and buffer of ``module`` and its submodules."""
    out = []
    for m in module.modules():
        for d in (m._parameters, m._buffers):
            for k in d:
                out.append((d, k))
    return out


def output_tensors(out):
    """The tensors among outputs ``out``, in lists, tuples and dicts (transformers' outputs)."""
    if isinstance(out, _Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from output_tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from output_tensors(o)


def collect_plain(out, given, found, seen) -> None:
    """Tensors among outputs ``out`` that are not TensorRefs."""
    if isinstance(out, _Tensor):  # (the common case, without the generators)
        if not isinstance(out, TensorRef) and id(out) not in given:
            found.append(out)
        return
    found.extend(t for t in output_tensors(out) if not isinstance(t, TensorRef) and id(t) not in given)


def collect_object(obj, given, stored, seen, before, depth, budget) -> None:
    """``(container, key, tensor)`` of the plain tensors ``obj`` holds that it did not hold
    before the call, or that are views given to the call."""
    for container, k, v in object_tensors(obj, seen, depth, budget):
        if not isinstance(v, TensorRef) and (id(v) in given or id(v) not in before):
            stored.append((container, k, v))


def scan_call(args, kwargs, slots, kernel_written, held=()) -> Call:
    """A call's TensorRefs: ``slots`` (a module's parameters and buffers), its arguments and
    what the objects among them hold, and what its modules hold besides (``held``:
    ``held_values``)."""
    call = Call()
    for d, k in slots:
        v = d.get(k)
        if isinstance(v, TensorRef):
            call.slots.append((d, k, v))
            call.refs.append(v)
        elif v is not None and v.requires_grad:
            call.plain_grad = True
    call.params = len(call.slots)
    call.kernel_written = kernel_written
    budget = [OBJECT_VALUES]
    seen: set = set()
    for a in args:
        scan_args(a, call, seen, budget)
    if kwargs:
        for a in kwargs.values():
            scan_args(a, call, seen, budget)
    for d, name in held:
        v = d.get(name)
        if isinstance(v, TensorRef):
            call.slots.append((d, name, v))
        elif isinstance(v, _Tensor):
            call.plain_grad = call.plain_grad or v.requires_grad
        elif v is not None:
            call.held_objects.append(v)
            scan_object(v, call, seen, budget, OBJECT_DEPTH)
    if call.nested:
        # (the encoder's fast path packs a padded batch: its layers' kernels take it as it is)
        raise NotARegion("a nested tensor among its arguments")
    backend = _mgr.backend
    if call.host_tensor and call.refs and not backend.passthrough and not backend.plain_cpu_is_device:
        # (op by op, the manager brings it to the device beside the model's tensors, as plain
        # torch runs them together; a region would give its kernels the CPU tensor as it is)
        raise NotARegion("a plain CPU tensor among its arguments")
    return call


def needs_grad(call: Call) -> bool:
    """Whether the call records gradients: grad mode on and a tensor it reads needs them."""
    if not torch.is_grad_enabled():
        return False
    return (call.plain_grad or any(t.requires_grad for t in call.refs)
            or any(t.requires_grad for _d, _k, t in call.slots[call.params:]))
