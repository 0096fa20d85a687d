"""Module regions: a module call as one step of the pager (Note [Regions] in ``mechanism.py``).

Note [Module regions]: the package wraps ``torch.nn.Module.__call__`` (at import). A call
made outside any region, on a module that is a region (below), runs through
:meth:`Region.run`: its parameters, buffers and tensor inputs are made resident as one
working set, its forward runs on plain device tensors with no per-op interception, and its
outputs come back as TensorRefs. The modules it calls inside run plain. A call that needs
gradients is a region too: its inner graph is linked to the TensorRefs' by one autograd node
whose backward is another step of the pager (Note [Regions with gradients] in
``training.py``; ``train = False`` sends such calls op by op). A call that cannot
be a region (its working set does not fit the budget, it holds host-only tensors, it runs
inside a managed op or under another's saved-tensor hooks) runs as before, op by op, and its
submodules' calls are considered in turn. While the manager records a trace
(``tensorsManager.recording()``) every call runs op by op: the trace's consumers (the
offline optimum, the GPU timeline) model aten ops and their kernels; with
``recording(regions=True)`` regions stay regions, for the offline optimum at their granularity.

Which modules are regions:

- ``region(module)`` / ``no_region(module)`` say so for one module (``auto(module)``
  forgets it); a forced region is still run op by op where it cannot be one;
- otherwise, automatically, the outermost modules whose parameters and buffers take at
  most ``fraction`` of the manager's share of the budget (the budget less what the device
  holds outside the manager; all of them with no budget, or on "cpu"), as ZeRO-3
  pages at module granularity: under a tight budget the decoder layers, or their attention
  and MLP, not every Linear. With nothing to move (no budget, or pass-through), a module
  whose measured call (Note [Regions]) ran fewer than ``min_ops`` aten ops is not one: its
  ops on the fast path cost less than a region's boundary. Under a budget, with gradients
  off, every op outside a region takes the manager's generic path, dearer than the
  boundary, so a module with tensors of its own and few ops (the head's Linear, a norm)
  is a region there too; but not an embedding of a large table, whose op reads the rows
  it needs from the table's host copy instead of the whole table (Note [Rows of a table]
  in ``ops/split_handlers.py``). A module
  holding a compiled region (``compile_region``) is not one: the compiled region is its own.

``enabled`` (default ``True``) switches regions off for the whole process, whatever the
manager's settings.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch
from torch.nn.modules import module as _hooks

from ..core import context
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr
from ..ops.split_handlers import reads_rows_alone
from . import stores
from .mechanism import NotARegion, Region, in_region, state
from .scan import held_values, parameter_slots
from .scope import Scope, settings_key
from .threads import callers

#: regions on or off, for the whole process
enabled = True
#: a module whose parameters and buffers take at most this fraction of the manager's share
#: of the budget is a region (once the budget pages: Note [Regions until the budget pages])
fraction = 0.5
#: whether the size rule makes regions under a budget too (``region(m)`` always does). A
#: layer's whole working set is resident at once, which leaves less of the budget to the
#: weights kept from step to step: regions move somewhat more bytes than the per-op path
#: and cost far less host time (docs/benchmarks/README.md, "Regions' settings, as
#: measured"). ``False`` gives the per-op path under any budget, for the fewest bytes.
under_budget = True
#: whether a call that needs gradients can be a region (Note [Regions with gradients] in
#: ``training.py``); ``False``: such calls go op by op
train = True
#: a module whose measured call ran fewer aten ops is not a region unless forced: the
#: region's own work at its boundary would cost more than the ops it saves on the fast
#: path. Under a budget, with gradients off, a module with tensors of its own is a region
#: whatever its ops: there an op outside a region takes the generic path, dearer than a
#: region's boundary (the embedding, the head's Linear and the last norm of a decoder).
#: With gradients the rule stands: a region's backward has no op-by-op fallback, and a tiny
#: one's is more boundary than work
min_ops = 8

_original_call = torch.nn.Module.__call__
#: modules that wrap another and must see its calls: torch.compile's (the compiler traces
#: them; the module inside may be a region)
_WRAPPERS = frozenset(("OptimizedModule",))
#: wrappers whose module runs op by op inside them: DistributedDataParallel (its reducer
#: follows the forward and the autograd graph of the parameters it wraps, which a region's
#: inner graph hides from it), FullyShardedDataParallel (FSDP1 swaps its flat parameters'
#: views in with ``param.data = view`` during the call, which a region's plain views would
#: take) and DataParallel (its forward waits on threads that call modules: Note [Regions
#: and threads])
_OP_BY_OP_WRAPPERS = frozenset(("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel"))

#: modules whose call is one embedding op: where its op reads the rows it needs from the
#: table's host copy instead of the table (a large table, under a budget with gradients off:
#: Note [Rows of a table] in ``ops/split_handlers.py``), they run op by op
_ROW_READERS = (torch.nn.Embedding,)


# Note [Regions that read rows]: inside a region its ops run on plain views of its working set,
# made resident whole; op by op, ``index`` of a large tensor by a few rows (a mixture of
# experts gathering the weights of the experts a token is routed to from a parameter stacking
# every expert's) reads those rows alone from the host copy, with no gradient to record (Note
# [Rows of a table] in ``ops/split_handlers.py``). With its layers as regions, decoding a
# mixture of experts brought every expert of a layer in for each token, to use two. A region
# whose measured call (op by op) read rows so (``split_handlers.rows_by_choice`` moved) is
# marked (``reads_rows``), and its calls with gradients off run op by op while the budget
# pages: the module's own submodules are considered in turn, so that the layer's attention
# stays a region and its experts' gathers read rows.


class _Wrapped(threading.local):
    depth = 0  # calls of _OP_BY_OP_WRAPPERS in progress on this thread


_wrapped = _Wrapped()

_override: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_info: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: bumped when modules are compiled into regions (a module holding one is not a region)
generation = [0]


def region(module: torch.nn.Module) -> torch.nn.Module:
    """Run ``module``'s calls as regions whatever its size (where they can be one); returns it."""
    _check(module, "region")
    _override[module] = True
    return module


def no_region(module: torch.nn.Module) -> torch.nn.Module:
    """Never run ``module``'s calls as regions (its submodules may be); returns it."""
    _check(module, "no_region")
    _override[module] = False
    return module


def auto(module: torch.nn.Module) -> torch.nn.Module:
    """Let the size rule decide for ``module`` again; returns it."""
    _check(module, "auto")
    _override.pop(module, None)
    return module


def _check(module, name) -> None:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"regions.{name} takes an nn.Module (got: {type(module).__name__})")


class _ModuleInfo:
    """A module's region and what its size rule needs (recomputed when its tensors change)."""

    __slots__ = ("region", "methods", "slots", "dicts", "sizes", "generation", "compiled", "nbytes", "bytes_key",
                 "modules", "buffers", "held", "layout")

    def __init__(self, module):
        self.region = Region(f"region {type(module).__name__}")
        self.methods = {}  # name -> the Region of its calls (``run_method``)
        self.slots = []
        self.dicts = ()  # its modules' parameter and buffer dicts
        self.sizes = ()  # their lengths, when last read
        self.generation = -1
        self.compiled = False
        self.nbytes = 0  # (``_tensor_bytes``, as of ``bytes_key``)
        self.bytes_key = None
        self.modules = ()
        self.buffers = ()  # (submodule, or None for the module itself; its buffers) where it has some
        self.held = ()  # (dict, name) of the tensors and containers its modules hold besides
        self.layout = None  # its submodules and the names of their tensors, when last read

    def kernel_written(self, module) -> list:
        """The buffers of the modules in training mode: a batch norm's kernel updates its
        running statistics in place without moving their version counters, by which a
        region finds what its call wrote (Note [Module regions])."""
        out = []
        for m, d in self.buffers:
            if (m or module).training:
                out.extend(v for v in d.values() if v is not None)
        return out

    def refresh(self, module) -> None:
        """The slots and bytes, if the module's tensors changed since they were read."""
        # (the lengths of its modules' parameter and buffer dicts as when last read, compared
        # in one C loop: this runs at every call of every module)
        if self.generation == generation[0] + stores.structure[0] and tuple(map(len, self.dicts)) == self.sizes:
            return
        stores.watch(module.modules())
        self.slots = parameter_slots(module)
        self.bytes_key = None
        layout = (tuple(map(id, module.modules())), tuple((id(d), k) for d, k in self.slots))
        if self.layout is not None and layout != self.layout:
            for r in (self.region, *self.methods.values()):
                if isinstance(r, Region):  # (not a method's Scope, nor False: seen once)
                    r.forget()
        self.layout = layout
        self.held = held_values(module)
        self.dicts = tuple(d for m in module.modules() for d in (m._parameters, m._buffers))
        self.sizes = tuple(map(len, self.dicts))
        self.generation = generation[0] + stores.structure[0]  # (both only grow)
        # (its submodules only: held by the value of a weak dict keyed by the module itself,
        # the module would keep its own entry alive)
        self.modules = tuple(module.modules())[1:]
        self.buffers = tuple((m if m is not module else None, m._buffers) for m in module.modules() if m._buffers)
        self.compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in self.modules)

    def hooked(self, module) -> bool:
        """Whether a module of the region has forward or backward hooks: they must see the
        TensorRefs, as they would without regions, not the plain tensors inside (but for
        inert ones: Note [Inert capture hooks])."""
        for m in (module,) + self.modules:
            if m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks or (
                    m._forward_hooks and not _capture_inert(m._forward_hooks)):
                return True
        return bool(_hooks._global_forward_hooks or _hooks._global_forward_pre_hooks
                    or _hooks._global_backward_hooks or _hooks._global_backward_pre_hooks)


# Note [Inert capture hooks]: the first call of a transformers model that asks for hidden
# states or attentions installs forward hooks on its layers that capture them, and they stay:
# counted as hooks, they sent every later call op by op. They do nothing while no call is
# collecting (``_active_collector``, set by the forward that returns what they capture):
# such hooks count as absent where none is collecting when a region starts. A region whose
# own call starts collecting (the model's forward inside it) gets the plain tensors its
# call computed back in its outputs, which it wraps as any output; a layer's region started
# while its model's forward collects still runs op by op.
_CAPTURE = ("transformers.utils.output_capturing", "output_capturing_hook")


def _capture_inert(hooks) -> bool:
    """Whether ``hooks`` (a module's forward hooks) are transformers' output-capturing hooks
    alone, with no call collecting what they capture (Note [Inert capture hooks])."""
    for h in hooks.values():
        if getattr(h, "__module__", None) != _CAPTURE[0] or getattr(h, "__name__", None) != _CAPTURE[1]:
            return False
    try:
        collecting = sys.modules[_CAPTURE[0]]._active_collector.get()  # type: ignore[attr-defined]
    except (KeyError, AttributeError):
        return False  # (another version: counted as hooks)
    return collecting is None or (isinstance(collecting, dict)
                                  and not any(isinstance(v, list) for v in collecting.values()))


def _tensor_bytes(info: _ModuleInfo) -> int:
    """Device bytes of the module's tensors, each as the budget counts it (rounded up as the
    device's allocator rounds it), to weigh against the manager's share. Read again when its
    tensors, the device or a block's size changed (``Books.changes``): the size rule
    asks it at every call of every module, the whole model's included."""
    key = (info.generation, _mgr.books.changes, id(_mgr.backend))  # (the id: an old device is not kept)
    if info.bytes_key == key:
        return info.nbytes
    size = _mgr.backend.block_bytes
    seen = set()
    total = 0
    for d, k in info.slots:
        v = d.get(k)
        b = (block_of(v) if isinstance(v, TensorRef) else None)
        if b is not None and b.id not in seen:
            seen.add(b.id)
            total += size(b.nbytes)
    info.nbytes, info.bytes_key = total, key
    return total


# Note [Regions until the budget pages]: the size rule (``fraction``) leaves room beside a
# region for the blocks kept from call to call and for the next region's prefetch. Until
# room has had to be made by evicting (``tensorsManager.paged``, cleared when the budget or
# device is set, and set where setting the budget evicts: it does not fit what is
# resident), nothing pages and that room serves nothing: with gradients off, a module whose
# tensors fit the manager's share is a region, as with no budget, and the outermost one (a
# decoder's whole forward, or its ``generate()`` call) is one op a call instead of one per
# layer. A call whose working set and measured inside do not fit is still no region
# (``Region._estimate``): it runs as it is, its submodules considered in turn, and the room
# it makes by evicting brings the rule back. With gradients the rule stands: a region's
# backward has no op-by-op fallback, and its bound before it is measured
# (``Region._needs``) would refuse the whole model at most budgets.
#
# Pressure that passed (a large tensor of the program's made and freed, a first call's
# measuring) would otherwise keep every later call paged, one region per layer, with nothing
# moving: a loop on plain tensors (``run_method`` under a budget that paged) that evicted
# nothing (to make room or to prefetch) clears ``paged``, and the next call of the method is one region again where it
# fits. A model's forward called in a loop of the program's own keeps the rule of a budget
# that pages once it has.

def _too_large(info: _ModuleInfo) -> bool:
    """The size rule, under a budget: whether the module's tensors take more than ``fraction``
    of the manager's share of it, or, until the budget pages with gradients off, more than
    the whole share (Note [Regions until the budget pages])."""
    share = _mgr.accounting.share()
    sized = _mgr.paged or torch.is_grad_enabled()
    return _tensor_bytes(info) > (fraction if sized else 1.0) * share


def _module_call(self, *args, **kwargs):
    """``nn.Module.__call__``: the call as a region where it is one (Note [Module regions])."""
    # (compiling first: dynamo inlines this function into graphs and must see no more of it)
    if torch.compiler.is_compiling() or not enabled or state.depth or _wrapped.depth \
            or self._compiled_call_impl is not None or (context.is_disabled() and not state.scope) \
            or (_mgr.trace is not None and not _mgr.trace.regions) or self.__class__.__name__ in _WRAPPERS:
        return _original_call(self, *args, **kwargs)
    if self.__class__.__name__ in _OP_BY_OP_WRAPPERS:
        _wrapped.depth += 1
        try:
            return _original_call(self, *args, **kwargs)
        finally:
            _wrapped.depth -= 1
    forced = _override.get(self)
    if forced is False:
        return _original_call(self, *args, **kwargs)
    callers.enter()  # (Note [Regions and threads])
    try:
        return _call(self, forced, args, kwargs)
    finally:
        callers.leave()


def _module_info(module) -> _ModuleInfo:
    info = _info.get(module)
    if info is None:
        info = _info[module] = _ModuleInfo(module)
    info.refresh(module)
    return info


#: the level of the innermost torch.func transform running (``None``: none)
_transform_level = getattr(torch._C._functorch, "maybe_current_level", lambda: None)


def _call(self, forced, args, kwargs):
    info = _module_info(self)
    # (inside torch.func's transforms, grad, vmap, jacrev, the module's ops must reach the
    # transform one by one, and the manager's own allocations made from Python here, a
    # group's pinned buffer, would become the transform's wrapped tensors)
    if info.compiled or _transform_level() is not None:
        return _original_call(self, *args, **kwargs)
    if forced is None:
        limit = _mgr.limit
        # (the size rule weighs the manager's share: what the device holds outside it, the
        # program's own tensors and libraries' workspaces, is not room for a region)
        paged = limit is not None and not _mgr.backend.passthrough
        if paged and ((_mgr.settings.budget_value is not None and not under_budget) or _too_large(info)):
            return _original_call(self, *args, **kwargs)
        if isinstance(self, _ROW_READERS) and reads_rows_alone(self.weight):
            return _original_call(self, *args, **kwargs)  # (its op reads its rows alone: Note [Rows of a table])
        if paged and info.region.reads_rows and not torch.is_grad_enabled():
            return _original_call(self, *args, **kwargs)  # (Note [Regions that read rows])
        ops = info.region.ops
        if ops is not None and ops < min_ops and not (
                paged and _mgr.settings.budget_value is not None and info.slots and not torch.is_grad_enabled()):
            return _original_call(self, *args, **kwargs)
    # (asked after the size rule: a model too large to be one region, whose walk of its
    # modules is the longest, is not walked at each call)
    if info.hooked(self):
        return _original_call(self, *args, **kwargs)
    return _as_region(self, info, info.region, lambda *a, **k: _original_call(self, *a, **k), args, kwargs,
                      train=train)


def _as_region(module, info: _ModuleInfo, region: Region, fn, args, kwargs, **options):
    """``fn(*args, **kwargs)`` as ``region`` where it can be one (``_try_region``); else as it is."""
    out = _try_region(module, info, region, fn, args, kwargs, **options)
    if out is _NOT_A_REGION:
        return fn(*args, **kwargs)
    if state.glue is not None:
        state.glue.track(out)  # (what a loop on plain tensors holds: Note [Loops on plain tensors])
    return out


#: ``_try_region``'s answer where the call could not be one region
_NOT_A_REGION = object()


def _try_region(module, info: _ModuleInfo, region: Region, fn, args, kwargs, **options):
    """``fn(*args, **kwargs)`` as ``region`` with ``module``'s tensors swapped in, where this
    thread may swap them (no other is inside a module call) and the call can be a region;
    else ``_NOT_A_REGION``, nothing run."""
    if not callers.claim():
        return _NOT_A_REGION
    try:
        return region.run(fn, args, kwargs, info.slots, kernel_written=info.kernel_written(module), held=info.held,
                          **options)
    except NotARegion:
        return _NOT_A_REGION
    finally:
        callers.release()


def run_method(module: torch.nn.Module, name: str, fn, args, kwargs):
    """``fn(*args, **kwargs)``, the method ``name`` of ``module`` that computes on the module's
    tensors and its arguments alone (transformers' ``generate``: Note [Generation as one
    region] in ``integrations/generation.py``), as one region where it can be one, else as
    it is. With nothing to page (no budget, or pass-through) it is one region; no room is
    kept for what the method allocates inside: only the device's capacity bounds it, as it
    bounds plain torch (and the manager's peak does not count it). Under a budget that has
    not paged it is one region too, room kept for what it allocates inside (``_whole``);
    else, or where that does not fit, it runs as a loop on plain tensors whose module calls
    are regions of their own (Note [Loops on plain tensors] in ``scope.py``)."""
    if torch.compiler.is_compiling() or not enabled or state.depth or state.scope or state.glue is not None \
            or _wrapped.depth or context.is_disabled() or _mgr.trace is not None or _override.get(module) is False:
        return fn(*args, **kwargs)
    callers.enter()  # (Note [Regions and threads])
    try:
        info = _module_info(module)
        if info.compiled or info.hooked(module) or module._compiled_call_impl is not None:
            return fn(*args, **kwargs)
        if _mgr.settings.budget_value is not None and not _mgr.backend.passthrough:
            if not _mgr.paged:
                out = _whole(module, info, name, fn, args, kwargs)
                if out is not _NOT_A_REGION:
                    return out
            scope = info.methods.get((name, "scope"))
            if scope is None:
                scope = info.methods[(name, "scope")] = Scope(f"{name} {type(module).__name__}")
            # (any eviction: Flow's prefetches evict ahead of the room a region makes)
            evictions = _mgr.statistics.counters["evictions"]
            out = scope.run(fn, args, kwargs)
            if _mgr.statistics.counters["evictions"] == evictions:
                _mgr.paged = False  # (the budget no longer pages: Note [Regions until the budget pages])
            return out
        region = info.methods.get(name)
        if region is None:
            region = info.methods[name] = Region(f"{name} {type(module).__name__}")
        return _as_region(module, info, region, fn, args, kwargs, train=False, room=False)
    finally:
        callers.leave()


#: the most regions of a method kept by settings (``_whole``)
MOST_SETTINGS = 16


def _whole(module, info: _ModuleInfo, name: str, fn, args, kwargs):
    """A method's call under a budget that has not paged (Note [Regions until the budget
    pages]) as one region, room kept for what a call with these shapes and settings
    allocated (measured op by op); ``_NOT_A_REGION`` where it cannot be one (it then runs as a
    scope). One region per settings: two calls of one shape may differ in what they make
    (more new tokens, hidden states returned). The first call with given settings runs as a
    scope, and the second is measured: settings that never repeat (a new number of tokens
    each call) are never measured op by op."""
    if _too_large(info):
        return _NOT_A_REGION  # (not measured op by op only to find it pages)
    configs = (getattr(module, "generation_config", None), getattr(module, "config", None))
    key = (name, "whole", settings_key(args, kwargs, configs))
    region = info.methods.get(key)
    if region is None:
        whole = [k for k in info.methods if len(k) == 3 and k[1] == "whole"]
        if len(whole) >= MOST_SETTINGS:
            for k in whole:
                del info.methods[k]
        info.methods[key] = False  # (seen once)
        return _NOT_A_REGION
    if region is False:
        region = info.methods[key] = Region(f"{name} {type(module).__name__}")
    return _try_region(module, info, region, fn, args, kwargs, train=False)


def install() -> None:
    """Wrap ``nn.Module.__call__`` and ``__setattr__`` (once)."""
    if torch.nn.Module.__call__ is not _module_call:
        torch.nn.Module.__call__ = _module_call
    stores.install()


def uninstall() -> None:
    """Give ``nn.Module.__call__`` and ``__setattr__`` back."""
    if torch.nn.Module.__call__ is _module_call:
        torch.nn.Module.__call__ = _original_call
    stores.uninstall()


install()

__all__ = ["enabled", "fraction", "under_budget", "train", "region", "no_region", "auto", "in_region", "Region",
           "NotARegion", "run_method", "install", "uninstall"]
