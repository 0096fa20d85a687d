"""Ops larger than the budget, split where the math allows.

An op whose own tensors do not fit the budget together cannot run as one kernel. Some can
run as several kernels on *pieces* of their tensors, each piece small enough:

- elementwise ops (and each position of a list op): consecutive chunks of the flattened
  tensors; every element is computed by the same kernel from the same inputs, so the bits
  are those of one call (activations on the host's kernels: cut where those compute each
  element as one call does, Note [Cuts of host kernels] in ``vector_loops.py``);
- elementwise ops that broadcast (``torch.outer``, a bias added to every row), and ``cat``
  along an inner dimension: ranges of the result's outer dimensions, each tensor as long
  there cut alike, the others given whole, in the order of dimensions of the result's
  layout (pieces of views whose positions interleave gathered on the host);
- ``cat`` along its outermost dimension, a constant pad, the backward of a slice or a
  select: by copies of host copies into a result made in host memory (``split_on_host.py``);
- reductions (``_foreach_norm``, ``_foreach_max``): one result per chunk, then combined
  (max and min exactly; a 2-norm as the norm of the chunks' norms: equal up to rounding,
  not bit for bit, since one kernel sums in another order);
- ``embedding``: only the rows the indices name are read; its backward
  (``embedding_dense_backward``) computes the gradient of those rows and places them in a
  full-size gradient kept in host memory;
- ``mm``: tiles of the output's columns (or rows), each reading the matching columns of
  the second operand (rows of the first); every output element is one dot product as in
  one call; ``bmm`` and ``baddbmm`` in groups of batch elements, and one element larger
  than the room in tiles of its output's rows (or columns) as ``mm``; a convolution in
  groups of its output channels, its backward in groups of output channels (the weight's
  gradient) and of input channels (the input's) (``split_convolutions.py``), GroupNorm's
  forward in groups of samples;
- ``softmax`` and ``log_softmax`` over the last dimension, and their backward: chunks of
  whole rows (each row is computed alone, by the same kernel, whatever the other rows).

Each runs on *pieces* of its big tensors (Note [Pieces] in ``pieces.py``).

The handlers of those ops are in ``split_handlers.py``; elementwise ops and list positions
run in chunks by ``chunks.run_chunked`` (from ``foreach.py`` for the list ops).

What cannot be split (a matrix product whose two operands are both too large, a
reduction of other kinds) raises ``OutOfBudgetError`` naming
the op and the smallest budget that works.
"""

from __future__ import annotations

from typing import Optional, Sequence


from ..core.errors import OutOfBudgetError
from ..core.op_specs import OpSpec
from ..core.tensor_ref import TensorRef, block_of
from ..memory import op_protocol
from ..memory.manager import tensorsManager as mgr
from . import dispatch
from .output_size import estimate_output_bytes

#: chunks are multiples of this many elements (and start at such multiples): the kernels'
#: vector loops then split every chunk as they split the whole tensor
ALIGN = 4096
#: the smallest chunk when room is short (still a multiple of any vector width)
MIN_ALIGN = 64


# -- room and sizes ----------------------------------------------------------------------

def room() -> Optional[int]:
    """Bytes one op may hold on the device now: the budget less what the device holds
    outside the manager and the blocks pinned there; ``None`` without a budget."""
    limit = mgr.limit
    if limit is None or mgr.backend.passthrough:
        return None
    with mgr.lock:
        pinned = sum(b.dev_bytes for b in mgr.books.resident.values() if b.pins)
        return limit - mgr.read_outside() - pinned


def block_bytes(nbytes: int) -> int:
    """Device bytes an allocation of ``nbytes`` may take, as the budget counts it: the
    device's allocator rounds sizes up (512 bytes on CUDA, more for large ones) and may give
    a large one a larger block (Note [Room for the allocator's slack]), so pieces sized by
    their exact bytes would not fit the room they were cut for."""
    return mgr.alloc_bytes(nbytes)


def refs_bytes(values, seen=None) -> int:
    """Device bytes of the distinct blocks of the TensorRefs among ``values`` (one level of
    lists), host-only blocks excepted; ``seen`` (block ids) is updated."""
    seen = set() if seen is None else seen
    total = 0
    for v in values:
        if isinstance(v, TensorRef):
            b = block_of(v)
            if b.id not in seen and not b.host_only:
                seen.add(b.id)
                total += block_bytes(b.nbytes)
        elif isinstance(v, (list, tuple)):
            total += refs_bytes(v, seen)
    return total


def op_bytes(spec: OpSpec, args, kwargs, out_bytes: Optional[int] = None) -> int:
    """What the op needs resident at once: its TensorRefs' blocks and its new results
    (``out_bytes`` where the caller knows them, else estimated from its schema)."""
    need = refs_bytes(list(args) + list(kwargs.values()))
    if out_bytes is not None:
        need += out_bytes
    elif spec.allocates:
        need += estimate_output_bytes(spec, args, kwargs)
    return need


def refuse(name: str, smallest: int, left: int):
    """``OutOfBudgetError`` for an op that needs ``smallest`` bytes of room where ``left`` is left."""
    outside = mgr.limit - left
    midway = op_protocol.midway()
    return OutOfBudgetError(name, smallest + outside, mgr.limit,
                            f"it cannot be split into smaller pieces; a budget of "
                            f"{smallest + outside} bytes runs it" + (f"; {midway}" if midway else ""), outside=outside)


def default(func, args, kwargs, spec: OpSpec):
    """The dispatcher's own paths for an op that fits (a view of a block on disk reads nothing)."""
    return dispatch.run_unhandled(func, args, kwargs, spec)


def fits(spec: OpSpec, args, kwargs, out_bytes: Optional[int] = None) -> Optional[int]:
    """``None`` when the op fits (or there is no budget), else the room left (``out_bytes``:
    as in :func:`op_bytes`).

    Without a budget nothing is split: the device's capacity is then the limit, and checking
    every add and view against it cost more than it ever saved (``benchmarks/op_paths.py``).
    """
    limit = mgr.limit
    if mgr.settings.budget_value is None or limit is None or mgr.backend.passthrough:
        return None
    need = op_bytes(spec, args, kwargs, out_bytes)
    if need + mgr.accounting.elsewhere_bytes <= limit:
        return None  # the common case, without reading the device or the pins
    left = room()
    if left is None or need <= left:
        return None
    return left


def when_refused(split_fn):
    """The handler of an op that runs whole by the dispatcher's own paths and, where they
    refuse it for the budget, as ``split_fn(func, args, kwargs, spec, left)`` with the room
    ``left``. The generic path refuses before the op changes anything (``may_retry``), so
    the op that fits, nearly every call, pays no check of its own bytes here."""
    def handler(func, args, kwargs, spec: OpSpec):
        try:
            return default(func, args, kwargs, spec)
        except OutOfBudgetError:
            left = fits(spec, args, kwargs) if may_retry(spec) else None
            if left is None:
                raise
        return split_fn(func, args, kwargs, spec, left)
    handler.__name__ = handler.__qualname__ = split_fn.__name__
    handler.__doc__ = split_fn.__doc__
    return handler


def chunk_elements(per_element: int, fixed: int, left: int, numel: int, name: str,
                   aligns=(ALIGN, MIN_ALIGN), pieces: Sequence[int] = ()) -> int:
    """Elements per chunk so that ``fixed`` and a chunk's pieces fit in ``left``, a multiple
    of the first of ``aligns`` that fits (or all ``numel``). ``pieces``: the bytes per
    element of each piece a chunk allocates on its own (default: one of ``per_element``),
    or ``(bytes per element, extra bytes)`` for a piece of ``n`` elements that holds
    ``n * size + extra`` (a window of a view's positions: from its first position to what
    its last spans); each is counted as the device's allocator rounds it (:func:`block_bytes`)."""
    sizes = [p if isinstance(p, tuple) else (p, 0) for p in pieces] or [(per_element, 0)]
    extra = sum(e for _size, e in sizes)

    def need(n: int) -> int:
        return fixed + sum(block_bytes(max(n * size + e, 0)) for size, e in sizes)

    for align in aligns:
        n = min(numel, (left - fixed - extra) // max(per_element, 1))
        if n < numel:
            n = n // align * align
        while n > 0 and need(n) > left:  # (the rounding of the pieces' sizes)
            n = (n - 1) // align * align
        if n > 0:
            return n
    raise refuse(name, need(min(numel, aligns[-1])), left)


def may_retry(spec: OpSpec) -> bool:
    """Whether a piece of the op that raised ``OutOfBudgetError`` can be run again, smaller.

    The room a piece was cut for is an estimate (what the device holds outside the manager
    moves, the allocator rounds). The generic path raises before the kernel when the op's
    blocks do not fit, so nothing was written; an op that writes in place *and* returns new
    tensors could have raised after its kernel, while its results were adopted: it is not
    run twice."""
    return not (spec.write_args and spec.allocates)
