"""What a region's call stores on modules (Note [Stores on modules]).

Note [Stores on modules]: a region's call runs on plain views of its module's tensors
(Note [Regions] in ``mechanism.py``). What its forward assigns to a module's attribute
(``self.cache = k``, ``self.alias = self.lin.weight.detach()``, a new buffer, a list of
tensors, a new submodule) would be one of those views or a new plain tensor: left there, it
would no longer follow its block once the block moved, and it would hold device memory
outside the manager. So while a region runs, ``nn.Module.__setattr__`` notes every
assignment, and once the call returned or raised each tensor assigned (or held by a list,
tuple or dict assigned, or by a module assigned) becomes a TensorRef, as what a call stores
in the objects it is given: a view given to the call is its TensorRef again, a view of a
block joins that block, anything else is a new block.

A view of a managed ``Parameter`` assigned to an attribute is registered as that
``Parameter``, as plain torch registers the parameter it was given; the call itself keeps
reading the view until it returns.

Replacing a submodule (``model.layers[0] = layer``, an adapter injected by a library), or
giving a module a tensor or a container of them to hold, is noted too: the regions' records
of which tensors their modules hold are read again (``structure``). Only for a module a
region has read (``watched``): a forward that builds a container of existing modules on each
call (Llama's ``self.layers[:n]`` slices its ModuleList into a new one) changes no region's
modules, and reading every region's modules again at each of its calls cost more than the
calls' own bookkeeping.
"""

from __future__ import annotations

import threading
import weakref

import torch

from ..core.tensor_ref import TensorRef

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_original_setattr = torch.nn.Module.__setattr__
_original_add_module = torch.nn.Module.add_module


class _Running(threading.local):
    call = None  # the ``scan.Call`` of the region running on this thread


running = _Running()
#: bumped whenever a watched module is given a submodule, a tensor or a container: regions
#: read their modules' tensors again
structure = [0]
#: the modules some region has read (``watch``): only their changes bump ``structure``
watched: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def watch(modules) -> None:
    """Bump ``structure`` from now on when one of ``modules`` changes what it holds."""
    watched.update(modules)


def _module_setattr(self, name, value):
    """``nn.Module.__setattr__``, noting what a region's call assigns (Note [Stores on modules])."""
    if isinstance(value, (torch.nn.Module, _Tensor, dict, list)) and self in watched:
        structure[0] += 1  # (a submodule, or a value a region's call may read: ``scan.held_values``)
    call = running.call
    if call is None:
        return _original_setattr(self, name, value)
    call.stores.append((self, name))
    if isinstance(value, _Tensor) and not isinstance(value, (_Parameter, TensorRef)):
        ref = given_for(call, value)
        if isinstance(ref, _Parameter):
            _original_setattr(self, name, ref)  # (registered as plain torch registers it)
            self._parameters[name] = value  # (the call computes on its view until it returns)
            call.restores.append((self._parameters, name, ref))
            return None
    return _original_setattr(self, name, value)


def _module_add_module(self, name, module):
    if self in watched:
        structure[0] += 1
    return _original_add_module(self, name, module)


def changes_state(call) -> bool:
    """Whether the call changed a module's own state: assigned one of its parameters,
    buffers or submodules, its class (a parametrization), or a tensor that needs gradients
    (kept on a module, it joins later graphs). A region whose calls do runs op by op from
    then on: a region gives its call a module's tensors as they were when the call began,
    and keeps the TensorRefs that need gradients as the inputs of the call's graph, where
    plain torch reads what the call itself assigned (Note [Stores on modules])."""
    for module, name in call.stores:
        d = module.__dict__
        if name == "__class__" or name in d.get("_parameters", ()) and not _aliases(d["_parameters"][name], call) \
                or name in d.get("_buffers", ()) or name in d.get("_modules", ()):
            return True
        value = d.get(name)
        if isinstance(value, _Tensor) and value.requires_grad and not _aliases(value, call):
            return True
    return False


def _aliases(value, call) -> bool:
    """Whether ``value`` is one of the TensorRefs the call reads (or ``None``): an alias."""
    return value is None or any(value is ref for ref in call.refs)


def given_for(call, value):
    """The TensorRef whose view ``value`` is, as given to ``call``; ``None`` if none."""
    for ref, given, _address, _version in call.views.values():
        if given is value:
            return ref
    return None


def stored(call) -> list:
    """``(container, key, tensor)`` of the plain tensors the call assigned to modules'
    attributes, or left in the lists, tuples, dicts and modules it assigned (a tuple is
    replaced by a list until wrapped: ``wrap_stored`` makes it a tuple again)."""
    out: list = []
    done = set()
    for module, name in call.stores:
        if (id(module), name) in done:
            continue
        done.add((id(module), name))
        d = module.__dict__
        for container in (d.get("_parameters"), d.get("_buffers"), d.get("_modules"), d):
            if container is not None and name in container:
                _plain_tensors(container, name, container[name], out, 3)
                break
    return out


def _plain_tensors(container, key, value, out: list, depth: int) -> None:
    if isinstance(value, _Tensor):
        if not isinstance(value, TensorRef):
            out.append((container, key, value))
    elif depth == 0:
        return
    elif isinstance(value, torch.nn.Module):
        for m in value.modules():
            for d in (m._parameters, m._buffers):
                for k, v in d.items():
                    _plain_tensors(d, k, v, out, 0)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _plain_tensors(value, i, v, out, depth - 1)
    elif isinstance(value, dict):
        for k, v in list(value.items()):
            _plain_tensors(value, k, v, out, depth - 1)
    elif value.__class__ is tuple and any(isinstance(v, _Tensor) for v in value):
        items = list(value)
        container[key] = items  # (a tuple again once wrapped: ``wrap_stored``)
        out.append((container, key, _TupleMark))
        for i, v in enumerate(items):
            _plain_tensors(items, i, v, out, depth - 1)


class _TupleMark:
    """Marks a tuple made a list while its tensors are wrapped."""


def wrap_stored(entries, wrap) -> None:
    """Replace each stored plain tensor with its TensorRef (``wrap``); a ``Parameter`` stays
    one, a leaf as plain torch's (a new module's weights made inside the call)."""
    tuples = []
    for container, key, value in entries:
        if value is _TupleMark:
            tuples.append((container, key))
        elif isinstance(value, _Parameter):
            # (a view the call was given is its TensorRef, the Parameter itself: ``self.alias
            # = self.lin.weight`` where the slot the view was given for holds another one)
            ref = wrap(value) if id(value) in wrap.given else wrap(value.detach())
            container[key] = ref if isinstance(ref, _Parameter) else _Parameter(ref, value.requires_grad)
        else:
            container[key] = wrap(value)
    for container, key in reversed(tuples):  # (inner tuples first)
        container[key] = tuple(container[key])


def install() -> None:
    """Note what regions' calls assign to modules (once)."""
    torch.nn.Module.__setattr__ = _module_setattr
    torch.nn.Module.add_module = _module_add_module


def uninstall() -> None:
    if torch.nn.Module.__setattr__ is _module_setattr:
        torch.nn.Module.__setattr__ = _original_setattr
    if torch.nn.Module.add_module is _module_add_module:
        torch.nn.Module.add_module = _original_add_module
