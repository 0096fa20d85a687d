"""A loop on plain tensors whose module calls page (Note [Loops on plain tensors]).

Note [Loops on plain tensors]: under a budget the model does not fit at once, so
``generate()`` cannot be one region (Note [Generation as one region] in
``integrations/generation.py``). Its loop ran op by op between its model's calls: a few
dozen small ops per token (the next token picked, the ids and the mask grown), each through
the per-op path, which cost as much host time as the layers' regions. Such a call (a method
given to ``run_method``, without gradients) runs as a *scope* instead:

1. the TensorRefs among its arguments (the ids, the mask) are made resident and pinned for
   the call, which gets plain views of them; its code runs on plain tensors, as a region's,
   and creation functions make plain tensors;
2. its module calls are still considered as regions: each pages its own working set (its
   module's tensors, the TensorRefs among its arguments and objects) and gives its new
   outputs back plain. A call measured op by op runs as it would outside the loop (what it
   makes and keeps, a cache's tensors, are blocks). A module that is no region runs in the
   loop, its submodules considered in turn;
3. what the loop's own code holds (its ops' results, the regions' outputs) is plain device
   memory outside the manager, for which room is kept (``Accounting.reserved``, counted as
   held outside the manager besides the device's reading, which may count some of it too):
   the most it held in a call with no larger sizes (``inside.measured`` of its tensors'
   shapes and its size settings). A call with no such measurement runs op by op, its first
   with a new structure, measured by a dispatch mode (``Glue``) that follows the live bytes
   its own ops and its regions' results take; a call up to ``GROWTH`` larger than a measured
   one runs as a scope guarded by that mode, which sizes each op's results before it runs
   (``ops.output_size``) and has room made for what passes the room kept;
4. where the room to keep, or the most any of its calls took, is more than
   ``MOST_OF_SHARE`` of the manager's share of the budget, the call runs op by op, as
   before: there its tensors are blocks the manager can page;
5. the call's results come back as TensorRefs, as a region's.
"""

from __future__ import annotations

import threading

import torch
from torch._ops import OpOverload

from ..core import context
from ..core.errors import OutOfBudgetError
from ..core.op_specs import spec_of
from ..core.tensor_ref import TensorRef, block_of
from ..memory.manager import tensorsManager as _mgr
from ..ops.op_context import blocks_of_list
from ..ops.output_size import estimate_output_bytes
from .mechanism import state
from .inside import GROWTH, Measure, growth, measured
from .op import Giver, RegionContext, RegionSpec, Wrapper, bytes_of
from .scan import collect_plain, scan_call
from .step import Step

_Tensor = torch.Tensor


class Glue(Measure):
    """The ops of a scope's own code and the live bytes of what they make (and of what its
    regions give it), to their peak (Note [Loops on plain tensors]).

    ``guard``: the scope runs on plain tensors, and each op is sized before it runs, room
    kept for it first; else the call runs op by op (its first with given sizes), measured.
    """

    def __init__(self, scope: "Scope", guard: bool):
        super().__init__(set(), _mgr.backend.block_bytes)
        self.scope = scope
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (the manager's own work, under its lock, is not the call's: fetches, copies)
        if not isinstance(func, OpOverload) or _mgr.lock._is_owned() or not spec_of(func).allocates:
            return func(*args, **kwargs)
        if self.guard:
            if _managed(args, kwargs):
                return func(*args, **kwargs)  # (an op of the manager keeps the budget itself)
            need = self.now + estimate_output_bytes(spec_of(func), args, kwargs)
            if need > self.peak:
                self.peak = need
                if need > self.scope.reserve:
                    self.scope.keep(need)
        out = func(*args, **kwargs)
        self.track(out)
        return out

    def track(self, out) -> None:
        """Follow the tensors among ``out`` (in tuples, lists and dicts) until they die."""
        if isinstance(out, _Tensor):
            self.follow(out)
        elif isinstance(out, (list, tuple)):
            for o in out:
                self.track(o)
        elif isinstance(out, dict):
            for o in out.values():
                self.track(o)


#: the settings of ``generate()`` that size what its loop makes (arguments, or a generation
#: config's attributes)
SIZE_SETTINGS = ("max_new_tokens", "max_length", "num_beams", "num_return_sequences")
#: a scope runs where the room its code's tensors take is at most this share of the
#: manager's share of the budget; else op by op, where those tensors are blocks it can page
MOST_OF_SHARE = 1 / 8


def _key(call, args, kwargs) -> tuple:
    """A call's key for ``inside.measured``: its tensors' shapes, and its size settings as
    sizes (more new tokens make larger ids)."""
    sizes = list(call.shapes)
    values = dict(kwargs) if kwargs else {}
    for a in list(args) + list(values.values()):
        if type(a).__name__ == "GenerationConfig":
            for name in SIZE_SETTINGS:
                values.setdefault(name, getattr(a, name, None))
    for name in SIZE_SETTINGS:
        v = values.get(name)
        if type(v) is int:
            sizes.append(((v,), name))
    return tuple(sizes), False


def settings_key(args, kwargs, configs=()) -> tuple:
    """Every setting a call is given besides its tensors (plain values, and a generation
    config's attributes that are plain values), and those of ``configs`` (objects whose
    attributes are settings: a model's configs, whose defaults the call reads): calls with
    equal settings and tensor shapes make tensors of the same sizes (more new tokens, hidden
    states returned: more bytes)."""
    items = [(i, a) for i, a in enumerate(args)] + sorted((kwargs or {}).items())
    out = []
    for name, v in items:
        if type(v).__name__ == "GenerationConfig":
            out.append((name, _attributes(v)))
        elif _plain(v):
            out.append((name, v))
    out.extend(_attributes(c) for c in configs if c is not None)
    return tuple(out)


def _attributes(obj) -> tuple:
    return tuple(sorted((k, a) for k, a in vars(obj).items() if _plain(a)))


def _plain(v) -> bool:
    return v is None or type(v) in (int, float, bool, str, torch.dtype, torch.device)


def _nearest(peaks: dict, key):
    """``(peak, growth)`` of the measured call of the same structure that ``key`` exceeds
    least, by at most ``GROWTH`` in elements; ``None`` where there is none."""
    best = None
    for other, (_held, peak) in peaks.items():
        times = growth(key[0], other[0])
        if times is not None and times <= GROWTH and (best is None or times < best[1]):
            best = (peak, times)
    return best


def _managed(args, kwargs) -> bool:
    for a in args:
        if isinstance(a, TensorRef) or (a.__class__ in (list, tuple) and any(isinstance(e, TensorRef) for e in a)):
            return True
    return any(isinstance(v, TensorRef) for v in kwargs.values())


class Scope:
    """A method's calls (``generate``) as loops on plain tensors whose module calls page."""

    def __init__(self, name: str):
        self.spec = RegionSpec(name)
        #: room kept for the plain tensors the running call's code makes
        self.reserve = 0
        #: call key -> (0, the most room its code's tensors took), as ``inside.measured`` reads it
        self.peaks: dict = {}
        self.running = threading.Lock()  # held by the call running as the scope

    def keep(self, nbytes: int) -> None:
        """Keep ``nbytes`` of room for the loop's own tensors (evicting for the growth)."""
        mgr = _mgr
        grow = nbytes - self.reserve
        with mgr.lock:
            mgr.make_room(grow, (), self.spec.name)
            mgr.accounting.reserve(grow)
        self.reserve = nbytes

    def run(self, fn, args, kwargs):
        """``fn(*args, **kwargs)`` as a scope where its code's tensors were measured (or a
        call like it was) and take little of the budget; op by op otherwise, the first time
        measured. One call at a time runs as the scope (another thread's goes op by op)."""
        call = scan_call(args, kwargs, (), ())
        if not call.refs or not self.running.acquire(blocking=False):
            return fn(*args, **kwargs)  # (nothing of the manager's to give it, or busy)
        try:
            key = _key(call, args, kwargs)
            seen = measured(self.peaks, key)
            near = _nearest(self.peaks, key) if seen is None else None
            if seen is None and near is None:
                return self._measured(fn, args, kwargs, key)
            blocks = self._room(call, key, seen, near)
            if blocks is None:
                return fn(*args, **kwargs)
            return self._as_scope(fn, args, kwargs, call, blocks, key, seen is None)
        finally:
            self.running.release()

    def _room(self, call, key, seen, near):
        """Sets the room to keep for the call's loop (``seen``: its measurement, else ``near``:
        the nearest measured call and the growth); returns its blocks, or ``None`` where it
        runs op by op."""
        mgr = _mgr
        if seen is None:
            # (grown as its ids and mask grow; ``Glue`` keeps more room where it needs more)
            reserve = int(near[0] * near[1]) + 1
        else:
            reserve = seen[1]
        with mgr.lock:
            mgr.drain()
            blocks = blocks_of_list([block_of(r) for r in call.refs])
            # (weighed by the most any of its calls took: calls of every size then go one way,
            # and Flow's period with them)
            most = max(reserve, max(peak for _held, peak in self.peaks.values()))
            large = most > MOST_OF_SHARE * mgr.accounting.share()
        if large:
            self.peaks.setdefault(key, (0, reserve))  # (the later calls go op by op too)
        if large or any(b.host_only for b in blocks):
            return None
        self.reserve = reserve
        return blocks

    def _as_scope(self, fn, args, kwargs, call, blocks, key, guard: bool):
        mgr = _mgr
        reserve = self.reserve
        ctx = RegionContext(self.spec, blocks, [], args, kwargs, False)
        ctx.estimate = reserve
        step = Step(ctx, True)
        try:
            step.begin()  # (its arguments resident, and room for its code's tensors)
        except OutOfBudgetError:
            self.reserve = 0
            return fn(*args, **kwargs)  # (nothing changed: op by op, as any code)
        with mgr.lock:
            for b in blocks:
                b.pins += 1  # (its code holds their plain views: Note [Loops on plain tensors])
            mgr.accounting.reserve(reserve)
        step.end(reserve)
        try:
            out = self._loop(mgr, call, fn, args, kwargs, guard)
            if guard:
                self.peaks[key] = (0, self.reserve)
        finally:
            with mgr.lock:
                for b in blocks:
                    b.pins -= 1
                mgr.accounting.reserve(-self.reserve)
            self.reserve = 0
        with mgr.lock:
            return self._results(mgr, ctx, call, out)

    def _measured(self, fn, args, kwargs, key):
        """The call op by op, as any code, measuring what its own code's tensors take."""
        glue = Glue(self, False)
        outer, state.glue = state.glue, glue
        try:
            with glue:
                out = fn(*args, **kwargs)
        finally:
            state.glue = outer
        self.peaks[key] = (0, glue.peak)
        return out

    def _loop(self, mgr, call, fn, args, kwargs, guard: bool):
        """The call on plain tensors; with ``guard``, its ops sized as they run (``Glue``)."""
        sim = getattr(mgr.backend, "strict", False)
        give = Giver(call, False, None, sim).tree
        cargs = [give(a) for a in args]
        ckwargs = {k: give(v) for k, v in kwargs.items()} if kwargs else {}
        previous = context.enter_plain(mgr.backend.declared)
        glue = Glue(self, True) if guard else None
        outer = state.scope, state.glue
        state.scope, state.glue = True, glue
        try:
            if glue is None:
                return fn(*cargs, **ckwargs)
            with glue:
                return fn(*cargs, **ckwargs)
        finally:
            state.scope, state.glue = outer
            context.exit_plain(previous)

    def _results(self, mgr, ctx, call, out):
        """The call's results as TensorRefs (room made for the new ones), its written
        arguments marked."""
        given, written = {}, []
        for ref, view, _address, version in call.views.values():
            given[id(view)] = ref
            if version is None or view._version != version:
                written.append(block_of(ref))
        if written:
            mgr.mark_written(blocks_of_list(written))
        found: list = []
        collect_plain(out, given, found, set())
        size = mgr.backend.block_bytes
        fresh = {}
        for t in found:
            plain = bytes_of(t)
            if plain is not None and plain.device == mgr.backend.compute:
                s = plain.untyped_storage()
                fresh[s._cdata] = size(s.nbytes())
        nbytes = sum(fresh.values())
        if nbytes:
            mgr.make_room(nbytes, set(), self.spec.name, allocated=nbytes)
        wrapped = Wrapper(mgr, ctx, given, True).tree(out)
        out = None
        if nbytes:
            mgr.read_outside()  # (the results are blocks now, not outside)
        return wrapped
