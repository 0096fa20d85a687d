"""A region call that needs gradients (Note [Regions with gradients]).

Note [Regions with gradients]: autograd cannot see through a region's plain tensors, so a
call that needs gradients builds its own graph inside and links it to the TensorRefs':

1. the parameters, buffers and arguments that require gradients are given to the call as
   plain leaves (views of their device copies), and the call runs with gradients on, under
   ``saved_tensors_hooks``: a tensor autograd saves that views a block of the working set
   (a weight, the input) is kept as that block and its geometry, not copied; any other (an
   activation) is kept as a plain tensor until the call returns, and then becomes a managed
   block, paged like any other;
2. the call's outputs that require gradients become TensorRefs, outputs of one autograd
   node (:class:`_Link`) whose inputs are the TensorRefs the leaves stand for. The inner
   graph is held by its edges only: no plain output, and no leaf's bytes (a leaf is emptied
   once the call returned), stay allocated outside the manager;
3. that node's backward is one more step of the pager: the blocks the saved tensors are on
   and the incoming gradients are made resident as one working set (with room for what the
   backward allocates, measured on its first run, op by op under a budget: Note [A first
   backward runs op by op] in ``step.py``), the inner graph runs on their plain views, and
   the gradients it gives for the leaves become TensorRefs, which autograd accumulates into
   the parameters' ``.grad`` as it would any other.

The inner graph is freed once the node ran, unless the backward keeps its graph (Note
[Keeping the inner graph]); a kept one goes when autograd frees the node's saved tensors: a
callback at the end of the backward looks.

Kernels are plain torch's, in plain torch's order, and nothing is recomputed: gradients are
bit for bit plain torch's on the same device (Note [Gradients summed inside a region]).
A tensor saved for backward that the program changes in place before the backward
is refused there, as plain torch refuses it.

Note [Saved while nothing pages]: with no budget the manager's limit is the device's
capacity, and until that has made it evict (``tensorsManager.paged``) nothing is paged: a
call's saved activations then stay plain tensors, kept by the inner graph as plain torch
keeps them, and its leaves keep their bytes, with no saved-tensor hooks (``Training.paged``
false, as in pass-through; Note [Saved leaves are watched] in ``saved.py``). Making each
activation a block after the call and a view of it again in backward took more host time
than the call's kernels on a small model (``benchmarks/train_parts.py``). A graph made so
holds device bytes outside the manager until its backward frees them, which the device's
readings count as outside bytes, as they count a program's plain tensors; a call made once
the manager has evicted makes blocks of them again. Under a budget the same holds for a call
whose needs (``Region._needs``: its working set, the room for its inside and its backward)
take at most ``PLAIN_SHARE`` of the manager's share: a budget the step fits in pays what no
budget pays. Its activations were allocated in the room the call kept for its inside, and
once it returns the device is read again, so that they count as outside bytes against the
budget until the backward frees them (a later reading finds them gone); any eviction reads
the device first. Until then a budget set below them is refused, as any budget below what
the device holds outside the manager (``BudgetBelowFloorError``). A larger call, whose plain
activations could leave too little room for the ops between it and its backward, makes
blocks of them, which those ops may evict. A strategy that sends blocks back after every op
(Genoa: ``Strategy.sends_back``) gets blocks always: plain tensors would keep on the device
what it sent back.

Note [Gradients summed inside a region]: autograd adds a tensor's gradient contributions one
by one, in the order their nodes run. Asked for one gradient per leaf, the inner graph would
sum the contributions from inside first, and autograd would add that sum to what the uses
outside the region gave before: c + (a + b) where plain torch computes (c + a) + b, the same
terms rounded in another order (a norm's input is also the residual, added outside it: as
regions of their own, norms made a Llama's parameters differ in the last bits). So the node
takes a leaf's TensorRef once per read, the inner graph's edges into that leaf
(:func:`_reads`, found when the call returns), and its backward gives each read's
contribution apart, recorded by hooks on the reading nodes in the order the inner graph runs
them, which is plain torch's: autograd adds them to the rest as plain torch would. The graph
is walked only where the call was given an argument that needs gradients (a walk of a whole
model's graph in Python costs a visible share of a training step): a parameter read
several times inside and also outside the region (a weight tied across its edge, or a
region called twice in one graph) still gets the sum.

Note [Gradients of gradients]: the node's backward runs the inner graph without recording
a graph of its own (its plain leaves are not the TensorRefs autograd differentiates), so a
backward with ``create_graph=True`` through a region (a gradient penalty, a Hessian-vector
product) would give gradients with no graph: the second-order terms silently lost. So the
first call of a region that needs gradients runs op by op (under a limit its measured call
does anyway), and a hook on its outputs' nodes sees whether its backward records a graph.
If it does, the region's calls with gradients run op by op from then on; if it does not,
or no backward came before the region's next call with gradients, they are regions. A
backward that records a graph through a region call after that raises, saying so, and the
region's later calls run op by op.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.autograd.graph import get_gradient_edge

from ..core import context, raw
from ..core.tensor_ref import TensorRef, compute_view, block_of
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim import backward_errors
from ..memory.sim.allocation import PlainMode
from ..memory.sim.tensor import SimTensor
from . import leaves
from .step import BackwardStep
from .saved import Saved, saved_hooks, sync_versions
from .scan import output_tensors

_Tensor = torch.Tensor


#: calls with gradients run op by op before a region without a backward seen becomes one
PROBES = 1


#: under a budget, a call with gradients whose needs take at most this share of the manager's
#: share keeps what it saves plain while nothing pages (Note [Saved while nothing pages])
PLAIN_SHARE = 0.5


def saves_blocks(mgr, limited: bool, needs: int) -> bool:
    """Whether a call with gradients makes blocks of what it saves (``limited``: the manager
    pages under a limit, the call is not on the host; ``needs``: the bytes the call needs
    resident at once, its backward's included), or keeps them plain while nothing pages
    (Note [Saved while nothing pages])."""
    if not limited or mgr.paged or mgr.strategy.sends_back:
        return limited
    if mgr.settings.budget_value is None:
        return False
    return needs > PLAIN_SHARE * mgr.accounting.share()


def probe_second_order(region) -> bool:
    """Whether this call of ``region``, which needs gradients, runs op by op to see whether
    its backward asks for gradients of the gradients (Note [Gradients of gradients])."""
    if region.second_order is None and region.probes >= PROBES:
        region.second_order = False  # (no backward came: calls with gradients, none taken)
    return region.second_order is None


def watch_backward(region, out) -> None:
    """Note in ``region.second_order`` whether the backward of ``out``'s nodes records a graph."""
    region.probes += 1

    def seen(_grad_outputs):
        region.second_order = region.second_order or torch.is_grad_enabled()  # (create_graph)

    nodes = {}
    for t in output_tensors(out):
        if t.grad_fn is not None:
            nodes[id(t.grad_fn)] = t.grad_fn
    for node in nodes.values():
        node.register_prehook(seen)


class Backwards:
    """The backward calls in flight, and how many keep their graph (Note [Keeping the inner graph]).

    Note [Keeping the inner graph]: a region's backward runs its inner graph with
    ``torch.autograd.grad``. Asked to retain that graph, the engine frees none of the
    tensors it saved as the backward goes, as plain torch's backward frees each node's: every
    activation stays allocated (under a budget, paged as a block) until the whole backward
    ends. So the inner graph is retained only where the backward running it keeps its own
    graph: ``torch.autograd.backward`` and ``grad`` (which ``Tensor.backward`` calls) are
    wrapped (``integrations/backward.py``) and say here, as long as they run, whether they
    keep it (``retain_graph``, which defaults to ``create_graph``). The engine may run the
    node on another thread than the caller's (a device's), and calls on several threads may
    overlap: the inner graph is freed only while every backward in flight frees its own, and
    kept where none is known (an engine started without the wrapped functions).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.keeping = 0

    @contextlib.contextmanager
    def call(self, keep: bool):
        """A backward call runs inside: ``keep``, whether it keeps its graph."""
        with self.lock:
            self.running += 1
            self.keeping += keep
        try:
            yield
        finally:
            with self.lock:
                self.running -= 1
                self.keeping -= keep

    def keep_graph(self) -> bool:
        """Whether a region's backward running now must keep its inner graph."""
        return self.keeping > 0 or self.running == 0


#: the backward calls in flight (the wrapped ``torch.autograd.backward`` and ``grad`` report them)
backwards = Backwards()


def foreign_hooks() -> bool:
    """Whether saved-tensor hooks of someone else are on (``torch.utils.checkpoint``): their
    saved tensors must be theirs, so such a call is not run as a region."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


class Training:
    """One call's inner graph: its leaves, its saved tensors, and the backward over them.

    Args:
        region: the :class:`~torchTensorRef.regions.mechanism.Region` (its backward's spec
            and measured room).
        key: the call's shapes (the backward's room is measured per key).
        sim: the call ran on ``SimTensor``s (strict "sim").
        paged: the manager pages under a limit; without one (pass-through, or no budget
            on a device that has no capacity), or with no budget before anything was evicted
            (Note [Saved while nothing pages]), the inner graph keeps what it saves and its
            leaves as plain torch would, with no hooks.
        inside: the room the forward kept for what it allocated inside.
    """

    def __init__(self, region, key, sim: bool, paged: bool = True, inside: int = 0):
        self.region = region
        self.key = key
        self.sim = sim
        self.paged = paged
        self.inside = inside
        self.refs = []  # the TensorRefs given as leaves, in order
        self.reads = []  # per leaf: the inner graph's (node, input) pairs that read it, where several do
        self.slots = 0  # node inputs: each leaf's TensorRef once per read (Note [Gradients summed inside a region])
        self.leaves = []  # their plain leaves
        self.leaf_edges = []
        self.by_storage = {}  # storage key of a working-set block -> a TensorRef of it
        self.by_op = False  # its backward runs on TensorRefs (Note [A first backward runs op by op])
        self.saved = []  # Saved, in the order the call saved them
        self.versions = []  # with nothing paged, its refs' versions as the leaves last saw them
        self.out_edges = []
        self.outputs = ()  # the node's outputs (TensorRefs)
        self.grad_bytes = ()  # bytes of the gradients its backward is given, one per output
        self.released = False

    # ---- the forward: leaves and saved tensors

    def leaf(self, ref: TensorRef, plain: torch.Tensor) -> torch.Tensor:
        """The plain leaf the call gets for ``ref`` (its view ``plain``)."""
        given = SimTensor(plain, requires_grad=True) if self.sim else plain.detach().requires_grad_()
        self.refs.append(ref)
        self.leaves.append(given)
        return given

    @contextlib.contextmanager
    def hooks(self):
        """Around the call: its saved-tensor hooks, and where an op of the manager ran inside it
        (on a TensorRef its scan did not find), its leaves watched (Note [Gradients past a
        region's node] in ``leaves.py``)."""
        ops = _mgr.op_count
        with saved_hooks(self) if self.paged else contextlib.nullcontext():
            yield
        if _mgr.op_count != ops:
            leaves.watch(self.leaves, self.refs, self.region)

    def _pack(self, t):
        if isinstance(t, TensorRef):
            return t  # (a TensorRef the region did not find: its ops went op by op)
        plain = t.data_ if t.__class__ is SimTensor else t
        if plain.layout is not torch.strided:
            return t
        geometry = (tuple(plain.size()), tuple(plain.stride()), plain.storage_offset())
        ref = self.by_storage.get(plain.untyped_storage()._cdata)
        if ref is not None:
            saved = Saved(ref, None, geometry)
            saved.watch, saved.seen = ((ref, ref._version),), (t, t._version)
        else:
            saved = Saved(None, plain.detach(), geometry)
        self.saved.append(saved)
        return saved

    def _unpack(self, saved):
        if saved.__class__ is not Saved:
            return saved
        stale = saved.stale(self.region.name)
        if stale is not None:
            return self._failed(RuntimeError(stale))
        if saved.plain is not None:
            plain = saved.plain  # (unpacked during the call itself: a double backward inside it)
        elif self.by_op:
            return saved.ref.as_strided(*saved.geometry)  # (Note [A first backward runs op by op] in step.py)
        else:
            size, stride, offset = saved.geometry
            plain = compute_view(saved.ref).as_strided(size, stride, offset)
        return SimTensor(plain) if self.sim else plain

    def activations(self):
        """The plain activations saved (to become blocks once the call returned)."""
        return [s.plain for s in self.saved if s.plain is not None]

    def adopted(self, wrap, outputs_by_storage: dict) -> None:
        """The call returned: each activation becomes a TensorRef (``wrap``), watched with
        the output sharing its bytes, and the leaves let go of their bytes."""
        for s in self.saved:
            s.saw_the_call_end()
            if s.plain is not None:
                plain = s.plain
                s.ref = wrap(plain)
                out = outputs_by_storage.get(plain.untyped_storage()._cdata)
                if out is not None:
                    s.watch = ((out, out._version),)
                s.plain = None
        self.by_storage = {}
        # (the reads of a leaf are found by walking the graph from its edge, only where an
        # argument is a leaf: in ``link``; the backward asks autograd for the leaves' own
        # gradients, their accumulators kept by the graph, emptied leaves or not)
        self.leaf_edges = [get_gradient_edge(leaf) for leaf in self.leaves] if self._walked() else []
        if not self.paged:
            # (nothing is evicted: a leaf's bytes are its block's for good; Note [Saved leaves
            # are watched])
            self.versions = [ref._version for ref in self.refs]
            return
        for leaf in self.leaves:
            if leaf.__class__ is SimTensor:
                leaf.data_ = leaf.data_.new_empty(0)
            else:
                leaf.data = leaf.data.new_empty(0)

    def link(self, plain_outputs, outputs) -> tuple:
        """Make ``outputs`` (TensorRefs of ``plain_outputs``) the outputs of the node."""
        self.out_edges = [get_gradient_edge(p) for p in plain_outputs]
        self.outputs = tuple(outputs)
        self.grad_bytes = [p.numel() * p.element_size() for p in plain_outputs]
        if self.leaf_edges:
            self.reads = _reads(self.leaf_edges, self.out_edges)
        else:
            self.reads = [()] * len(self.refs)
        inputs = []
        for ref, reads in zip(self.refs, self.reads):
            inputs += [ref] * max(1, len(reads))
        self.slots = len(inputs)
        linked = _Link.apply(self, *inputs)
        self.outputs = ()
        return linked if isinstance(linked, tuple) else (linked,)

    def _walked(self) -> bool:
        """Whether the inner graph is walked for each leaf's reads (Note [Gradients summed
        inside a region]): only where an argument is a leaf (a walk in Python costs a visible
        share of a step, and a parameter read several times inside and outside too is a tied
        weight across the region's edge)."""
        return any(not isinstance(r, torch.nn.Parameter) for r in self.refs)

    # ---- the backward

    def resident_need(self, size) -> int:
        """Bytes its backward must hold resident at once, before any room for what it
        allocates: the blocks its saved tensors are on and the gradients it is given
        (``size``: an allocation's bytes as the budget counts them)."""
        if self.released:
            return 0
        blocks = {}
        for s in self.saved:
            if s.ref is not None:
                blocks[block_of(s.ref).id] = block_of(s.ref)
        return sum(size(b.nbytes) for b in blocks.values() if not b.host_only) + sum(map(size, self.grad_bytes))

    def _failed(self, error: Exception):
        """Raise ``error``; on strict "sim", inside backward, keep it for ``backward()`` to
        raise and return what fails in C++ (Note [Errors in backward on sim])."""
        if self.sim and backward_errors.in_backward():
            backward_errors.keep_for_backward(error)
            return backward_errors.FAILED
        raise error

    def backward(self, node, grads):
        try:
            if torch.is_grad_enabled():  # (create_graph: Note [Gradients of gradients])
                self.region.second_order = True
                raise RuntimeError(
                    f"a backward with create_graph=True went through the region {self.region.name!r}, "
                    "whose backward records no graph: the gradients of these gradients would be lost. "
                    "Its later calls run op by op, so this step works when run again; to have it work the "
                    "first time, call torchTensorRef.no_region(module) before, or set "
                    "torchTensorRef.regions.train = False")
            with torch.no_grad():
                return self._backward(node, grads)
        except Exception as e:
            return (self._failed(e),) * self.slots

    def _backward(self, node, grads):
        if self.released:
            raise RuntimeError(
                f"Trying to backward through the region {self.region.name!r} a second time: its saved "
                "tensors were freed after the first backward. Specify retain_graph=True the first time")
        region = self.region
        given = [(e, g) for e, g in zip(self.out_edges, grads) if g is not None]
        if not given:
            return (None,) * self.slots
        if not self.paged:
            sync_versions(self.refs, self.leaves, self.versions)
        refs = [s.ref for s in self.saved if s.ref is not None]
        refs += [g for _e, g in given if isinstance(g, TensorRef)]
        keep = backwards.keep_graph()
        with BackwardStep(region, refs, self.key, self.inside, self.paged) as step:
            sim = self.sim and not step.by_op
            self.by_op = step.by_op

            def plain(g):
                if step.by_op or not isinstance(g, TensorRef):
                    return g
                v = compute_view(g)
                return SimTensor(v) if sim else v

            edges = [e for e, _g in given]
            plain_grads = [plain(g) for _e, g in given]
            mode = PlainMode() if sim else contextlib.nullcontext()
            # each read's contribution, in the order the inner graph gives them, where a leaf has several
            parts = [[] if len(reads) > 1 else None for reads in self.reads]
            hooks = [node.register_hook(functools.partial(_record, parts[i], j))
                     for i, reads in enumerate(self.reads) if len(reads) > 1 for node, j in reads]
            previous = None if step.by_op else context.enter_plain(step.device)
            try:
                with mode, step.meter():
                    out = torch.autograd.grad(edges, self.leaves, plain_grads, retain_graph=keep, allow_unused=True)
            finally:
                if not step.by_op:
                    context.exit_plain(previous)
                for h in hooks:
                    h.remove()
            plain_grads = None
            per_slot = []
            for g, reads, got in zip(out, self.reads, parts):
                if got is None:
                    per_slot.append(g)
                else:  # (``g``: None, the reads' hooks took its contributions)
                    per_slot += got + [None] * (len(reads) - len(got))
            out = parts = g = got = None
            result = step.results(per_slot)
            per_slot = None  # (its views go before the step ends: Note [Buffers still viewed] in memory/residency.py)
        if keep:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._release_if_freed(node))
        else:
            self.release()  # (its graph is freed: the activations it saved go now, not at the backward's end)
        return result

    def _release_if_freed(self, node) -> None:
        # (the node's saved tensor is gone once autograd freed the graph: retain_graph=False)
        try:
            node.saved_tensors
        except RuntimeError:
            self.release()

    def release(self) -> None:
        """Let the inner graph go (its saved activations' blocks with it)."""
        self.released = True
        self.out_edges = []
        self.reads = []  # (its nodes would keep the inner graph, and what it saved, alive)
        self.leaf_edges = []
        self.leaves = []
        self.saved = []


def _record(store: list, index: int, grad_inputs, _grad_outputs):
    """A reading node's hook: keep its contribution to the leaf, and let the inner graph not
    sum it (its sum would be more bytes, and is not used)."""
    g = grad_inputs[index]
    if g is None:
        return None
    store.append(g)
    return grad_inputs[:index] + (None,) + grad_inputs[index + 1:]


def _reads(leaf_edges, out_edges) -> list:
    """Per leaf, the inner graph's ``(node, input index)`` pairs whose gradient goes to it
    (in a node, in index order: the order autograd adds them)."""
    # (by id: a node's Python object is one while it lives, and ``seen`` keeps them alive)
    target = {id(e.node): i for i, e in enumerate(leaf_edges)}
    reads = [[] for _ in leaf_edges]
    seen, todo = {}, [e.node for e in out_edges]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in target:
            continue
        seen[id(node)] = node
        for j, (child, _nr) in enumerate(node.next_functions):
            if child is None:
                continue
            i = target.get(id(child))
            if i is not None:
                reads[i].append((node, j))
            else:
                todo.append(child)
    return reads


class _Link(torch.autograd.Function):
    """The autograd node standing for a region call's inner graph."""

    #: saved by each node: whether autograd freed its graph (not an input, written since maybe)
    freed = raw.empty(0)

    @staticmethod
    def forward(ctx, training: Training, *refs):
        ctx.training = training
        # (an output the loss does not read, a value stored on a module, gets no gradient:
        # made zeros, its graph would give its leaves zero gradients, plain torch none)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(_Link.freed)  # (Training._release_if_freed)
        return training.outputs

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(ctx.training.backward(ctx, grads))
