"""A region: one call (a module's forward, a compiled function) that the manager runs as one op.

Note [Regions]: the per-op path (``ops/dispatch.py``) pays the proxy's Python on every aten
op. A region pays it once per call, at its boundary, as the op protocol does around one
aten op (``memory/op_protocol.py``):

1. its TensorRefs are its op's blocks: a module's parameters and buffers, the TensorRefs
   among the call's arguments (in tuples, lists and dicts), and those held by plain objects
   among them (a key/value cache: attributes, lists and dicts, a few levels deep). With
   room for what the call allocates inside (measured, see below), ``prepare`` makes them
   resident as one working set within the budget, and the strategy sees one op;
2. the blocks are pinned and the call runs on plain views of their device copies (the
   parameters, buffers and object attributes are swapped for their views for the duration
   of the call, arguments are passed as views), with creation functions making plain
   tensors: no per-op interception;
3. an input whose view the call wrote (its version counter moved, or it is a buffer of a
   module in training mode: batch norm's kernels update the running statistics without
   moving their counters, or an inference tensor, made under ``torch.inference_mode()``,
   which has no counter, or a tensor of its module its measured call wrote: Note
   [Unversioned writes]) is marked written; each output, and each new tensor the call stored
   in an object it was given, becomes a TensorRef (a view of an input joins its block,
   anything else is a new resident block), room being made for the new ones first;
4. the swapped slots get their TensorRefs back, the blocks are unpinned and ``finish``
   lets the strategy react, as after any op.

What the call allocates inside (its intermediates and outputs) is measured the first time
the region runs with given argument shapes under a budget: that call runs op by op (so it
keeps the budget, as any code does) under a dispatch mode that follows the live bytes of the
blocks and storages its ops create, to their peak. Later calls with the same shapes, or no
larger ones (``inside.measured``), run as regions and make room for that peak, scaled by the
growth of the tensors held in objects (a cache that grows each step), and measure again when
those have doubled (larger calls: Note [Calls larger than measured] in ``inside.py``); a
working set whose peak does not fit beside it runs op by op. The manager's peak counts the
working set plus the room kept for the inside.

Autograd cannot see through a region (the call runs on plain views, not on the TensorRefs
autograd tracks): a call that needs gradients builds its own graph inside, linked to the
TensorRefs' by one autograd node whose backward is a step of the pager too (Note [Regions
with gradients] in ``training.py``).

Note [Unversioned writes]: a write through ``tensor.data`` (``self.running.data.mul_(m)``)
moves the version counter of the alias ``.data`` made, not the tensor's. A module in eval
mode (in training mode its buffers count as written anyway) that wrote its buffer so lost
the write under a budget: the block was taken as unchanged, and its eviction dropped the
device copy. A region's first call with given shapes runs op by op, measured, where each
aten op's schema says which of its arguments it writes in place: the blocks of the module's
tensors it wrote there (``Measure.wrote``) count as written at every later call of the
region (``Region.writes``). A module that starts writing a tensor so only after its measured
calls is not seen, nor is a kernel writing through a raw pointer. (In-place list ops move
the counters of what they write: Note [Versions of list writes] in ``core/op_specs.py``.)
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode, _pop_mode_temporarily

from ..core import context
from ..core.blocks import id_mark
from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import block_of
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.allocation import PlainMode
from ..memory.sim.tensor import SimTensor
from ..ops.op_context import blocks_of_list, wrap_one
from .inside import Inside, Measure, measured
from .op import Giver, Grouping, RegionContext, RegionSpec, Wrapper, bytes_of, take_back_attributes
from . import reentrant, stores
from .step import Plan, Step
from .scan import (OBJECT_DEPTH, NotARegion, OBJECT_VALUES, Call, collect_object, collect_plain, needs_grad,
                   scan_call, select_object_slots)
from .saved import move_versions
from .training import Training, foreign_hooks, probe_second_order, saves_blocks, watch_backward

class _State(threading.local):
    depth = 0  # regions running on this thread
    #: a loop on plain tensors runs on this thread (Note [Loops on plain tensors] in ``scope.py``)
    scope = False
    #: the ``Glue`` following the ops of such a loop (or of its first call, op by op), or None
    glue = None


state = _State()


def in_region() -> bool:
    """Whether a region is running on this thread (its code runs on plain tensors)."""
    return state.depth > 0


def _out_of_glue():
    """A region called from a loop on plain tensors runs without its ``Glue`` mode: its ops
    are the region's (Note [Loops on plain tensors] in ``scope.py``)."""
    glue = state.glue
    return _pop_mode_temporarily() if glue is not None and _current_mode() is glue else contextlib.nullcontext()


class Region:
    """One region: its spec (one op to the strategies) and what it measured.

    Args:
        name: the op's name (``stats()``, recordings, errors).
        device_views: the call gets tensors of the declared device ("sim": ``SimTensor``s,
            so that the code sees the device plain torch would); ``False``: plain views of
            the copies the kernels run on (a compiled graph on "sim" is compiled for the CPU).
        strict: refuse (``OutOfBudgetError``, ``RuntimeError``) where a region cannot run,
            instead of raising :class:`NotARegion` for the caller to run the call op by op.
        measure: measure what the call allocates inside with a dispatch mode; ``False`` (a
            compiled graph, which no dispatch mode may watch, and whose kernels allocate
            their intermediates as an aten op does its workspace): room is made for its
            outputs only, as large as the last call's with the same shapes.
    """

    def __init__(self, name: str, device_views: bool = True, strict: bool = False, measure: bool = True):
        self.spec = RegionSpec(name)
        self.backward_spec = RegionSpec(name + " backward")
        #: shapes -> (bytes of its backward's blocks, peak bytes allocated inside), on its first run
        self.backward_peaks: dict = {}
        self.device_views = device_views
        self.strict = strict
        self.measure = measure
        self.inside = Inside()
        self.ops = None  # ops of the last measured call (a call of few ops is cheaper op by op)
        #: whether a backward of its calls recorded a graph (Note [Gradients of gradients]
        #: in ``training.py``; ``None``: no backward seen yet)
        self.second_order = None
        self.probes = 0  # calls with gradients run op by op to see their backward
        self.mutates = False  # a call changed its module's own state (Note [Stores on modules]): op by op since
        self.unseen = False  # a measured call read what no scan finds: op by op with gradients (scan.py)
        self.reentrant = False  # a measured call ran a reentrant checkpoint: likewise (reentrant.py)
        self.writes: set = set()  # blocks of its tensors a measured call wrote (Note [Unversioned writes])
        #: its module's tensors as one group, under a budget (Note [Region groups] in memory/groups.py)
        self.grouping = Grouping()
        self.reads_rows = False  # a measured call read rows alone (Note [Regions that read rows] in __init__.py)

    @property
    def name(self) -> str:
        return self.spec.name

    def forget(self) -> None:
        """Its module's submodules or tensors changed (an adapter injected): what its calls
        read and allocate is measured again, with gradients too (Note [Tensors no scan finds])."""
        self.inside, self.backward_peaks, self.second_order, self.probes, self.reentrant = Inside(), {}, None, 0, False

    def run(self, fn, args, kwargs, slots=(), grad_error=None, train=True, kernel_written=(), room=True, held=()):
        """``fn(*args, **kwargs)`` as one op, with ``slots`` (``(dict, key)``: a module's
        parameters and buffers) swapped for plain views during the call. A call that needs
        gradients raises ``RuntimeError(grad_error)`` where given, and is not a region
        without ``train``. ``kernel_written``: TensorRefs the call may write without moving
        their version counters (batch norm's running statistics), counted as written.
        ``room=False``: no room is measured or made for what the call allocates inside (with
        no budget, where only the device's capacity bounds it, as it bounds plain torch).
        ``held``: ``(dict, name)`` of what the module holds besides (``scan.held_values``).

        Raises:
            NotARegion: (not ``strict``) the call needs gradients, does not fit the budget,
                has host-only blocks or runs inside a managed op; nothing changed.
            RuntimeError: (``strict``) where it would raise ``NotARegion``, saying why.
        """
        try:
            return self._call(fn, args, kwargs, slots, grad_error, train, kernel_written, room, held)
        except NotARegion as e:
            if self.strict:
                raise RuntimeError(f"{self.name} cannot run as one op of the manager: {e}") from None
            raise

    def _call(self, fn, args, kwargs, slots, grad_error, train, kernel_written, room, held):
        if self.mutates:
            raise NotARegion("its calls change its module's own tensors or structure")
        call = scan_call(args, kwargs, slots, kernel_written, held)
        grad = needs_grad(call)
        key = (tuple(call.shapes), grad)
        near, held_refs = self._select_held(call, key)
        if not call.refs:
            return fn(*args, **kwargs)  # nothing managed: the call as it is
        learn, probe = self._check_grad(call, key, grad_error, train) if grad else (False, False)
        if _mgr.lock._is_owned():
            raise NotARegion("inside a managed op")  # its blocks must stay where they are
        plan = self._plan(call, key, grad, args, kwargs, room)
        plan.near, plan.held_refs = near, held_refs
        if plan.limited and room:
            self._estimate(plan, call)
        if plan.measure or learn or probe:
            return self._measured(_mgr, call, fn, args, kwargs, key, grad)
        return self._as_step(plan, call, fn, args, kwargs)

    def _select_held(self, call: Call, key):
        """Which of the TensorRefs the call's objects hold join its working set (Note [Calls
        larger than measured]); returns the nearest measured call and how many they held."""
        held_refs = len(call.slots) - call.params
        used = self.inside.used_objects(key, held_refs)
        near = None
        if self.measure and (used is None or key in self.inside.peaks):
            near = self.inside.nearest(key, held_refs)
            if near is not None:
                used = self.inside.used_objects(near[0], held_refs)
        select_object_slots(call, used)
        return near, held_refs

    def _check_grad(self, call: Call, key, grad_error, train):
        """Whether a call that needs gradients runs op by op first (``learn``: which object's
        tensors it reads; ``probe``: Note [Gradients of gradients]); raises where it cannot be
        a region."""
        if grad_error is not None:
            raise RuntimeError(grad_error)
        if self.unseen or call.plain_grad or self.reentrant:  # (the Notes of scan.py and reentrant.py)
            raise NotARegion("it reads tensors no scan finds or plain ones needing gradients, or checkpoints")
        if not train or not self.measure:
            raise NotARegion("needs gradients")
        if self.second_order:
            raise NotARegion("gradients of its gradients were asked")
        if foreign_hooks():
            raise NotARegion("saved-tensor hooks of another are on (checkpointing)")
        learn = False
        for _d, _k, t in call.slots[call.params:]:
            if t.requires_grad:
                if self.inside.used_objects(key, len(call.all_held)) is not None:
                    raise NotARegion("an object it is given holds a tensor it reads that needs gradients")
                learn = True  # (unmeasured: which of them it reads is not known yet)
                break
        return learn, probe_second_order(self)

    def _plan(self, call: Call, key, grad: bool, args, kwargs, room: bool) -> Plan:
        """The call as one op: its blocks, where it runs, whether its peak counts against a budget."""
        mgr = _mgr
        with mgr.lock:
            mgr.drain()
            blocks = blocks_of_list([block_of(r) for r in call.refs])
            passthrough = mgr.backend.passthrough
            host = [b for b in blocks if b.host_only]
            on_host = not passthrough and bool(blocks) and len(host) == len(blocks)
            if host and not on_host or on_host and not self.strict:
                raise NotARegion("host-only blocks")  # the per-op path says where each op runs
            ctx = RegionContext(self.spec, blocks, [], args, kwargs, on_host)
            ctx.estimate = 0
            paged = mgr.limit is not None and not passthrough
            if paged and not on_host:
                self.grouping.refresh(mgr, call)
            return Plan(ctx, key, grad, on_host, paged, paged and not on_host)

    def _estimate(self, plan: Plan, call: Call) -> None:
        """The room the call needs for what it allocates inside (``plan.ctx.estimate``), or
        ``plan.measure``: it runs op by op first to measure it."""
        mgr = _mgr
        key, near = plan.key, plan.near
        est = self.inside.estimate(key, call.held)
        if est is None and near is not None:
            est = self.inside.grown(near[0], near[1], call.held)
            plan.meter = True
        if est is None and not self.measure:
            est = 0  # (its outputs, once seen)
        elif est is None:
            plan.measure = True
            est = 0
        elif not self.strict:
            with mgr.lock:
                needs = self._needs(sum([b.nbytes for b in plan.ctx.blocks]), est, key if plan.grad else None)
                # (the last reading of what the device holds beside the manager may count
                # plain tensors since adopted or freed: read it again before refusing)
                limit = mgr.limit
                if needs + mgr.accounting.elsewhere_bytes > limit and needs + mgr.read_outside() > limit:
                    raise NotARegion("larger than the budget")
        plan.ctx.estimate = est

    def _as_step(self, plan: Plan, call: Call, fn, args, kwargs):
        """The call as one step of the pager (Note [Region steps] in ``step.py``)."""
        mgr = _mgr
        ctx = plan.ctx
        if mgr.host_tier.limit is not None and not mgr.host_tier.holds(sum([b.nbytes for b in ctx.blocks])):
            raise NotARegion("larger than the host budget")  # (its blocks come through host copies)
        step = Step(ctx, plan.limited)
        try:
            step.begin(plan.on_host)
        except OutOfBudgetError as e:
            if not self.strict and type(e) is OutOfBudgetError:
                raise NotARegion("larger than the budget") from e
            raise
        # (only a budget weighs a call's needs against its share: Note [Saved while nothing pages])
        weigh = plan.grad and mgr.settings.budget_value is not None
        needs = self._needs(sum([b.nbytes for b in ctx.blocks]), ctx.estimate, plan.key) if weigh else 0
        training = Training(self, plan.key, self.device_views and getattr(mgr.backend, "strict", False),
                            saves_blocks(mgr, plan.paged, needs), ctx.estimate) if plan.grad else None
        meter = Measure({b.dev_key for b in ctx.blocks}, mgr.alloc_bytes, mgr.backend.dev_bytes,
                        step.grow if plan.limited else None, ctx.estimate) if plan.meter else None
        try:
            out = self._run(mgr, call, fn, args, kwargs, plan.on_host, training, meter)
        except BaseException:
            # (what the call wrote before raising stays written, and what it stored on its
            # modules or objects is kept, as plain torch keeps both)
            with mgr.lock:
                try:
                    self._finish_outputs(mgr, ctx, call, None, plan.on_host, training)
                finally:
                    step.abort()
            raise
        try:
            with mgr.lock:
                wrapped, out_bytes = self._finish_outputs(mgr, ctx, call, out, plan.on_host, training)
                out = None  # (not kept past the lock: Note [Plain views die under the lock] in ops/dispatch.py)
                call.views.clear()  # (nor the views it was given: Note [Buffers still viewed] in memory/residency.py)
        except BaseException:
            step.abort()
            raise
        step.end(self._inside(plan, call, meter, out_bytes))
        return wrapped

    def _inside(self, plan: Plan, call: Call, meter, out_bytes: int):
        """What the call allocated inside, recorded for its shapes; ``None`` where its outputs
        were counted as they joined the books (a region that measures nothing)."""
        key, near = plan.key, plan.near
        if not self.measure:
            self.inside.record(key, call.held, out_bytes)
            inside = None
        elif meter is not None:
            self.inside.record(key, call.held, meter.peak)
            inside = max(meter.room, meter.counted_peak)
        else:
            inside = plan.ctx.estimate
        if near is not None and near[0] != key:
            self.inside.learn_like(key, near[0], plan.held_refs)  # (found at once next time)
        return inside

    def _needs(self, need: int, inside: int, grad_key) -> int:
        """Bytes the call needs resident at once: its working set and room; with gradients
        (``grad_key``: its shapes) its backward's too, once measured, or until then a bound: the
        weights saved, activations, gradients in and out (Note [Regions with gradients])."""
        if grad_key is None:
            return need + inside
        seen = measured(self.backward_peaks, grad_key)
        if seen is None:
            return 2 * need + 3 * inside
        return max(need + inside, seen[0] + seen[1])

    def _measured(self, mgr, call: Call, fn, args, kwargs, key, grad: bool = False):
        """The call op by op (within the budget, as any code), measuring what its ops allocate
        (what it needs inside as a region); with ``grad``, whether its backward asks for more."""
        meter = Measure({block_of(r).id for r in call.refs}, mgr.alloc_bytes, watch_grads=grad)
        mark, checkpoints = id_mark(), reentrant.runs()  # (blocks the call makes have larger ids)
        state.depth += 1  # (its modules run plain: their ops are measured with the rest)
        running, stores.running.call = stores.running.call, call  # (what it assigns: Note [Stores on modules])
        # (called from a loop on plain tensors, it runs as it would outside one: what it
        # makes and keeps, a cache's tensors, are blocks: Note [Loops on plain tensors])
        outside = context.suspend_plain() if state.scope else None
        try:
            with _out_of_glue(), meter:
                out = fn(*args, **kwargs)
        finally:
            if outside is not None:
                context.resume_plain(outside)
            stores.running.call = running
            state.depth -= 1
            self._note_stores(call)
        self.reads_rows = self.reads_rows or meter.read_rows()
        if grad:
            watch_backward(self, out)
            self.reentrant = self.reentrant or reentrant.runs() != checkpoints
        if meter.wrote:
            self.writes.update(meter.wrote.intersection(block_of(v).id for _d, _k, v in call.slots))
        held = call.all_held
        self.unseen = self.unseen or meter.plain_grads or any(
            b < mark for b in meter.read.difference(block_of(t).id for t in call.refs + held))
        used = self.inside.learn_uses(key, held, meter.read)
        self.inside.record(key, sum(block_of(held[i]).nbytes for i in used), meter.peak)
        self.ops = meter.ops
        return out

    def _note_stores(self, call: Call) -> None:
        """A call that changed its module's state makes the region run op by op from now on."""
        if call.stores and stores.changes_state(call):
            self.mutates = True

    def _run(self, mgr, call: Call, fn, args, kwargs, on_host: bool, training=None, meter=None):
        backend = mgr.backend
        sim = self.device_views and getattr(backend, "strict", False) and not on_host
        giver = Giver(call, on_host, training, sim)
        give = giver.tree
        cargs = [give(a) for a in args]
        ckwargs = {k: give(v) for k, v in kwargs.items()} if kwargs else {}
        device = None if on_host or backend.passthrough else backend.declared
        views = call.views
        state.depth += 1
        previous = context.enter_plain(device)
        running, stores.running.call = stores.running.call, call  # (Note [Stores on modules])
        try:
            new = giver.new  # (every slot holds a TensorRef: ``scan_call``; ``Giver.one`` inlined)
            for d, k, v in call.slots:
                entry = views.get(id(v))
                d[k] = entry[1] if entry is not None else new(v)
            if not sim and training is None and meter is None and state.glue is None:
                return fn(*cargs, **ckwargs)  # (no context to enter: the call as it is)
            plain_mode = PlainMode() if sim else contextlib.nullcontext()
            hooks = training.hooks() if training is not None else contextlib.nullcontext()
            with _out_of_glue(), plain_mode, hooks, meter if meter is not None else contextlib.nullcontext():
                return fn(*cargs, **ckwargs)
        finally:
            stores.running.call = running
            context.exit_plain(previous)
            state.depth -= 1
            for d, k, v in call.slots + call.restores:
                try:
                    now = d[k]
                except (KeyError, IndexError):
                    continue  # (the call took it out: nothing to give back)
                if now is views[id(v)][1]:
                    d[k] = v
            take_back_attributes(views)
            self._note_stores(call)

    def _given_back(self, mgr, ctx, call: Call):
        """The views the call was given, by id, with their TensorRefs; and the blocks it wrote.

        A view the call rebound (``param.data = t``: peft's merges, FSDP's flat parameters)
        gives its TensorRef the new bytes, as plain torch's tensor has them; the region runs
        op by op from then on (Note [Stores on modules])."""
        views = call.views
        given, written, changed, moved = {}, [], None, []
        writes = self.writes
        for ref, view, address, version in views.values():
            given[id(view)] = ref
            if version is None or view._version != version or writes and block_of(ref).id in writes:
                written.append(block_of(ref))
                if version is not None and view._version != version:
                    moved.append((ref, view, version))  # (its TensorRef's version moves too)
            now = view.data_ if view.__class__ is SimTensor else view
            if now.data_ptr() != address or now.shape != ref.shape:
                changed = changed or []
                changed.append((ref, now))
        if changed:
            self.mutates = True
            for ref, now in changed:
                ref.data = wrap_one(now.detach(), ctx, mgr)
        for ref in call.kernel_written:
            if id(ref) in views:
                written.append(block_of(ref))
        move_versions(moved)
        return given, written

    def _finish_outputs(self, mgr, ctx, call: Call, out, on_host: bool, training=None):
        mgr.accounting.give_back()  # (before its results are counted: Note [Room kept while a region runs])
        given, written = self._given_back(mgr, ctx, call)
        if written:
            ctx.written = blocks_of_list(written)
            if on_host:
                for b in ctx.written:
                    mgr.host_written(b)
            else:
                mgr.mark_written(ctx.written)
        inputs = {b.dev_key for b in ctx.blocks}
        fresh = {}
        # the new tensors: outputs, and what the call stored in the objects it was given
        # (called from a loop on plain tensors, its outputs stay plain: Note [Loops on plain
        # tensors] in ``scope.py``)
        plain_out = state.scope and not state.depth
        before = {id(v) for _c, _k, v in call.objects}
        found = []
        if not plain_out:
            collect_plain(out, given, found, set())
        stored = []
        seen: set = set()
        for obj in call.arg_objects + call.held_objects:
            collect_object(obj, given, stored, seen, before, OBJECT_DEPTH, [OBJECT_VALUES])
        on_modules = stores.stored(call) if call.stores else ()
        compute = mgr.backend.compute
        size = mgr.backend.block_bytes  # (each as the budget counts it: the allocator's rounding)
        activations = training.activations() if training is not None else []
        for t in found + [v for _c, _k, v in stored] + [v for _c, _k, v in on_modules] + activations:
            t = bytes_of(t)
            if (t is not None and t.layout is torch.strided and (t.device == compute or on_host)):
                s = t.untyped_storage()
                if s._cdata not in inputs:
                    fresh[s._cdata] = size(s.nbytes())
        nbytes = sum(fresh.values())
        paged = nbytes and not on_host and mgr.limit is not None and not mgr.backend.passthrough
        readings = mgr.accounting.readings
        if paged:
            mgr.make_room(nbytes, {b.id for b in ctx.blocks}, ctx.name, allocated=nbytes)
        wrap = Wrapper(mgr, ctx, given, self.device_views, training is not None)
        for container, k, v in stored:
            container[k] = wrap(v)
        stores.wrap_stored(on_modules, wrap)
        wrapped = wrap.tree(out) if not plain_out else wrap.given_back(out, inputs)
        if training is not None:
            linked = wrap.linked
            by_storage = {bytes_of(p).untyped_storage()._cdata: r for p, r in linked}
            training.adopted(lambda t: wrap_one(t, ctx, mgr), by_storage)
            if linked:
                # (the node's outputs are these same TensorRefs, now with its grad_fn)
                training.link([p for p, _r in linked], [r for _p, r in linked])
        if plain_out or mgr.accounting.readings != readings or (
                training is not None and not training.paged and mgr.settings.budget_value is not None):
            # A reading of the device in ``make_room`` counted the new tensors, allocated and
            # not yet blocks, as outside the manager; kept, that reading made the next calls
            # look larger than the budget (a decoder layer ran op by op): read it again (and
            # the activations a plain graph holds: Note [Saved while nothing pages]).
            mgr.read_outside()
        return wrapped, nbytes

