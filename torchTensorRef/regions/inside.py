"""What a region allocates inside: the peak bytes measured on a call, by argument shapes
(Note [Regions] in ``mechanism.py``).

Note [Calls larger than measured]: serving sends ``generate()`` calls of every prompt
length, and each step of the longest one yet is larger than any call measured (training
on batches padded to their longest sequence alike). Measured op by op, every such call
would cost the per-op path and break the period Flow learned (a layer's one op becomes its
seventy). A call within ``inside.GROWTH`` (in elements, dimension by dimension: ``growth``)
of a measured call of the same structure, needing gradients alike, runs as a region
instead: room is made for that call's peak grown as the square of the growth (attention's
scores grow with the square of a prompt) and as the objects' tensors grew, the call reads
the objects' tensors the measured one read, and a dispatch mode on its plain tensors (no
op of the manager) measures its peak, recorded for its shapes. An estimate can fall short
(a call allocating as the cube of its arguments): before each op whose results would take
the call past its room, the mode asks for more, and blocks outside the call are evicted
for it as for an op of the manager; where none is left to evict, the excess is reported as
``worst_overshoot_bytes``, as any excess over the budget. With gradients,
its backward's first run keeps the room a first run does (Note [Regions with gradients]
in ``training.py``).
"""

from __future__ import annotations

import weakref

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.op_specs import spec_of
from ..core.tensor_ref import TensorRef, block_of
from ..memory.sim.tensor import SimTensor
from ..ops.output_size import AllRoom, estimate_output_bytes
from ..ops.split_handlers import rows_by_choice

_Tensor = torch.Tensor


def measured(table: dict, key):
    """``table[key]`` (a measurement of a call with these shapes), or the least of those
    measured on calls whose every argument is at least as large (same dtypes and ranks, and
    gradients or not alike): what a call allocates grows with its arguments, so a larger
    call's measurement bounds a smaller one's (a batch of shorter sequences after a longer
    one). ``None`` where there is neither."""
    seen = table.get(key)
    if seen is not None or not table:
        return seen
    shapes, grad = key
    best = None
    for (other, other_grad), value in table.items():
        if other_grad != grad or len(other) != len(shapes):
            continue
        for (size, dtype), (bound, bound_dtype) in zip(shapes, other):
            if dtype != bound_dtype or len(size) != len(bound) or any(a > b for a, b in zip(size, bound)):
                break
        else:
            if best is None or value[1] < best[1]:
                best = value
    return best


#: a call larger than every measured one is estimated from the nearest measured call whose
#: arguments it exceeds by at most this factor (in elements); beyond it, it is measured op by op
GROWTH = 2.0


def growth(shapes, other):
    """How many times larger ``shapes`` are than ``other`` (in elements, the most of any
    argument, at least 1), where both have the same structure (kinds and ranks alike);
    ``None`` where they differ.

    Counted dimension by dimension: an argument is as large as the one measured grown to
    hold it in every dimension (a batch of two prompts of 3 after one of 6 grows 2x, not
    1x): what a call allocates follows its dimensions, not its count of elements (attention's
    scores, batch x heads x length x length, outgrow the tokens)."""
    if len(shapes) != len(other):
        return None
    times = 1.0
    for (size, kind), (was, was_kind) in zip(shapes, other):
        if kind != was_kind or len(size) != len(was):
            return None
        grown = 1.0
        for n, m in zip(size, was):
            if n > m:
                if m == 0:
                    return None
                grown *= n / m
        times = max(times, grown)
    return times


def numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


class Inside:
    """Bytes a region allocates inside: the measured peaks, by argument shapes; and which of
    the TensorRefs held by the objects it is given its call reads."""

    __slots__ = ("peaks", "uses")

    def __init__(self):
        self.peaks: dict = {}  # shapes -> (bytes held in objects then, peak bytes inside)
        #: (shapes, TensorRefs the objects held) -> positions of those the call read (a
        #: prefill's layers share their shapes, each given a cache one layer fuller)
        self.uses: dict = {}

    def used_objects(self, key, held: int):
        """Positions, among the ``held`` TensorRefs the call's objects hold, of those the
        measured call with these shapes read; ``None``: all (unmeasured, or the objects
        changed shape since)."""
        return self.uses.get((key, held))

    def learn_uses(self, key, held_refs, read: set) -> list:
        """Remember which of ``held_refs`` (the objects' TensorRefs, in scan order) the
        measured call read; returns their positions."""
        used = [i for i, v in enumerate(held_refs) if block_of(v).id in read]
        self.uses[(key, len(held_refs))] = used
        return used

    def estimate(self, key, held: int):
        """Bytes to make room for, or ``None``: measure this call."""
        seen = self.peaks.get(key)
        if seen is None:
            seen = measured(self.peaks, key)
            if seen is None:
                return None
            self.peaks[key] = seen  # (its bound, found at once next time: serving sees many shapes)
        held_then, peak = seen
        if held > 2 * max(held_then, 1):
            return None  # the objects' tensors (a cache) doubled: measure again
        return peak if held <= held_then else peak * held // max(held_then, 1)

    def record(self, key, held: int, peak: int) -> None:
        self.peaks[key] = (held, peak)

    def nearest(self, key, held_refs: int):
        """For a call without gradients that no measurement bounds (Note [Calls larger than
        measured]): ``(the measured shapes nearest below it, the growth factor)``, or
        ``None`` where no call measured with the objects holding ``held_refs`` TensorRefs
        has the same structure within ``GROWTH``."""
        shapes, grad = key
        if key in self.peaks:
            return (key, 1.0) if (key, held_refs) in self.uses else None  # (only its cache grew)
        best = None
        for other in self.peaks:
            other_shapes, other_grad = other
            if other_grad != grad or (other, held_refs) not in self.uses:
                continue
            times = growth(shapes, other_shapes)
            if times is not None and times <= GROWTH and (best is None or times < best[1]):
                best = (other, times)
        return best

    def grown(self, near, growth: float, held: int) -> int:
        """Bytes to make room for a call ``growth`` times larger than the one measured with
        shapes ``near``: its peak grown as the square of its arguments (attention's scores
        grow with the square of a sequence) and as its objects' tensors (a cache)."""
        held_then, peak = self.peaks[near]
        estimate = peak * growth * growth
        if held > held_then:
            estimate = estimate * held / max(held_then, 1)
        return int(estimate) + 1

    def learn_like(self, key, near, held_refs: int) -> None:
        """The call with shapes ``key`` read the objects' TensorRefs the one with ``near`` read."""
        self.uses[(key, held_refs)] = self.uses[(near, held_refs)]


class Measure(TorchDispatchMode):
    """Peak live bytes of the new blocks (and plain storages) the ops of a call allocate:
    ``peak`` with each counted as ``block_bytes`` counts it, the room it may take (the
    device's allocator rounds sizes up and may give a large one more:
    ``TensorsManager.alloc_bytes``), and ``counted_peak`` with each as the device counts it
    (``dev_bytes`` of its storage).

    With ``grow`` (a call larger than measured, run in ``room`` made from an estimate: Note
    [Calls larger than measured]), an op whose results would take the call past its room
    first asks ``grow(extra bytes, bytes held now, room)`` for more, as an op of the
    manager makes room before its kernel; where it is given, the room grows.

    With ``watch_grads`` (a call op by op with gradients), ``plain_grads`` says whether an op
    read a plain tensor needing gradients (Note [Plain tensors that need gradients] in
    ``scan.py``): op by op, every tensor the call made is a TensorRef."""

    def __init__(self, known, block_bytes, dev_bytes=None, grow=None, room: int = 0, watch_grads: bool = False):
        super().__init__()
        self.grow = grow
        self.room = room
        self.block_bytes = block_bytes
        self.dev_bytes = dev_bytes
        self.known = known  # ids of the blocks that are not the call's: its inputs'
        self.read: set = set()  # ids of the blocks the ops were given
        self.wrote: set = set()  # ids of the blocks the ops wrote in place (Note [Unversioned writes] in mechanism.py)
        self.live: dict = {}  # block id or storage key -> [bytes, its followers alive, bytes counted]
        self.now = self.counted_now = 0
        self.peak = self.counted_peak = 0
        self.ops = 0
        self.rows = rows_by_choice[0]
        self.watch_grads = watch_grads
        self.plain_grads = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        for a in tree_leaves((args, kwargs)):
            if isinstance(a, TensorRef):
                self.read.add(block_of(a).id)
            elif self.watch_grads and isinstance(a, _Tensor) and a.requires_grad and torch.is_grad_enabled():
                self.plain_grads = True
        if isinstance(func, OpOverload):  # (an operator of a higher order has no schema)
            spec = spec_of(func)
            if spec.write_args:
                self._writes(spec.write_args, args, kwargs)
            if self.grow is not None and spec.allocates:
                self._room_for(spec, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if isinstance(out, _Tensor):
            self.follow(out)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, _Tensor):
                    self.follow(o)
        return out

    def _room_for(self, spec, args, kwargs) -> None:
        """More room before an op whose results would outgrow the call's (results sized only
        by their run, ``AllRoom``, are counted once made, as the peak)."""
        need = estimate_output_bytes(spec, args, kwargs)
        extra = self.now + need - self.room
        if extra > 0 and not isinstance(need, AllRoom) and self.grow(extra, self.counted_now, self.room):
            self.room += extra

    def read_rows(self) -> bool:
        """Whether an ``index`` op read rows of a tensor alone since it began (Note [Regions
        that read rows] in ``__init__.py``)."""
        return rows_by_choice[0] != self.rows

    def _writes(self, writes, args, kwargs) -> None:
        """The blocks of the TensorRefs an op writes in place (``writes``: its ``OpSpec.write_args``)."""
        for i, name in writes:
            value = args[i] if i < len(args) else (kwargs or {}).get(name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, TensorRef):
                    self.wrote.add(block_of(t).id)

    def follow(self, t) -> None:
        """Count ``t``'s bytes (its block's, or its storage's) until they are freed: its
        block's when the last TensorRef followed dies, its storage's when the storage dies."""
        if isinstance(t, TensorRef):
            block = block_of(t)
            key, nbytes, counted, owner = block.id, block.nbytes, block.dev_bytes, t
        else:
            if t.__class__ is SimTensor:
                t = t.data_
            if t.layout is not torch.strided or t.is_meta or t.is_nested:
                return
            # (followed to its own death, not its tensor's: a storage's address is its key, and
            # one a tensor let go of with ``set_`` is free for the next allocation while that
            # tensor lives, which would then be counted as long as the tensor)
            owner = t.untyped_storage()
            key, nbytes, counted = owner._cdata, None, 0
        if key in self.known:
            return
        if nbytes is None:
            nbytes = owner.nbytes()
            if self.dev_bytes is not None:
                counted = self.dev_bytes(owner)
        nbytes = self.block_bytes(nbytes)
        counted = counted or nbytes
        entry = self.live.get(key)
        new = entry is None
        if new:
            entry = self.live[key] = [0, 0, 0]
        if nbytes > entry[0]:
            # (new, or grown: a storage resized in place)
            self.now += nbytes - entry[0]
            self.counted_now += counted - entry[2]
            entry[0], entry[2] = nbytes, counted
            if self.now > self.peak:
                self.peak = self.now
            if self.counted_now > self.counted_peak:
                self.counted_peak = self.counted_now
        if new or owner is t:  # (a storage once; each TensorRef of a block)
            entry[1] += 1
            # (the measure held weakly: a storage the program keeps, a cache's, must not keep
            # the measure, nor what it references, alive)
            weakref.finalize(owner, _died, weakref.ref(self), key)

    def died(self, key) -> None:
        """A follower of ``key`` died: its bytes are freed with the last."""
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
                self.now -= entry[0]
                self.counted_now -= entry[2]


def _died(measure: "weakref.ref[Measure]", key) -> None:
    m = measure()
    if m is not None:
        m.died(key)
