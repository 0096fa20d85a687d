"""Pieces: the parts of tensors larger than the budget that an op split for it runs on
(``split.py``).

Note [Pieces]: a piece is a TensorRef of its own, with a block of its own, so the manager
moves it, counts it and keeps it within the budget as any tensor. A big tensor is first
*settled* (its device copy written back and dropped): its host copy is then the only one
and holds its current bytes. A piece read from it aliases a range of that host copy (no
copy; a ``from_dlpack`` view whose storage is exactly that range) or, for rows and columns
that are not one range, gathers them; a piece written in place aliases its range, and its
write-back lands in the big tensor's host copy. A big result is made in host memory and
filled from the pieces' results.

The elementwise ops' chunks (``run_chunked``) keep the host from waiting once per chunk: the
big tensors are settled without waiting for their write-backs, a piece is fetched once the
write-back of the range it aliases ended (ordered on the device, ``host_pending``), and a
piece written in place, or a chunk's one new result (given its range of the big result as
its host copy when the op makes it: ``landing``, so that Genoa's write-back as the op ends
lands there too), is written back into that range asynchronously where the host copy is
pinned (big results are made in pinned memory).
The big tensor's host copy then waits for those copies (``Block.host_parent``,
``streams.Copies``): whoever reads it, an op on the device or the host, waits for them
first, and its buffer is not given back before they end (they write views of it that
PyTorch's pinned allocator does not see used).
"""

from __future__ import annotations

import contextlib
from typing import Collection, Optional, Sequence

import torch

from ..core import raw
from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import TensorRef, host_view, block_of
from ..memory.manager import tensorsManager as mgr
from ..memory.streams import joined


def settle(refs: Sequence[TensorRef], wait: bool = True) -> None:
    """Give each of ``refs``' blocks a current host copy and no device copy; without
    ``wait``, the write-back making it current may still run (``host_pending``)."""
    with mgr.lock:
        for ref in refs:
            block = block_of(ref)
            if block.host_only:
                continue
            if block.pins and block.dev is not None:
                raise OutOfBudgetError(f"a pinned tensor of {block.nbytes} bytes", block.nbytes, mgr.limit,
                                       "unpin it to let ops larger than the budget run in pieces")
            mgr.evict(block)
            if wait or not block.host_valid:
                mgr.sync_host(block)


@contextlib.contextmanager
def held_on_host(refs: Sequence[TensorRef], wait: bool = True, read: Collection[int] = ()):
    """Settle ``refs`` and keep their host copies where they are while pieces alias them
    (without ``wait``, their write-backs may still run: only pieces read them, on the device).
    ``read``: the ids of those of ``refs`` that the pieces only read.

    Their blocks are external meanwhile (Note [External bytes] in ``core/blocks.py``): no
    device copy of them is kept between the pieces' ops, and their host copies are never
    re-homed or dropped. Without it a strategy could move a host copy into pinned memory to
    prefetch it, or drop one a disk copy holds, and the pieces' writes (or the results
    copied in) would land in the old copy. A block written has no disk copy then; one only
    read keeps it (the host tier need not write it again).
    """
    settle(refs, wait)
    written: dict = {}  # block id -> (block, whether a piece of it is written)
    for r in refs:
        b = block_of(r)
        if not b.host_only:
            written[id(b)] = (b, id(r) not in read or written.get(id(b), (b, False))[1])
    for block, writes in written.values():
        mgr.mark_external(block, wait, writes)
    try:
        yield
    finally:
        for block, _writes in written.values():
            mgr.unmark_external(block)


def _manage(plain: torch.Tensor) -> TensorRef:
    return mgr.manage_tensor(plain, requires_grad=False, shared=True)


def flat_host(ref: TensorRef) -> torch.Tensor:
    """The settled, dense ``ref`` as a flat plain view of its host copy, in the order of its
    bytes (its elements' order where it is contiguous)."""
    v = host_view(ref).detach()
    return v.view(-1) if v.is_contiguous() else v.as_strided((v.numel(),), (1,), v.storage_offset())


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one range of its bytes, each once: contiguous, or its
    dimensions in another order (a transpose of a contiguous tensor)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def alias_piece(ref: TensorRef, start: int, stop: int, geometry=None) -> TensorRef:
    """A piece over elements ``start:stop`` (in the order of its bytes) of settled dense
    ``ref``, aliasing its host bytes: fetched once ``ref``'s write-back ends, and written
    back into them asynchronously, ``ref``'s host copy waiting for it. With ``geometry``
    (sizes, strides): over elements ``start:stop`` of settled ``ref``'s storage counted from
    its first element, seen with that geometry (positions of a view that is not dense)."""
    if geometry is None:
        plain = raw.alias(flat_host(ref)[start:stop])
    else:
        v = host_view(ref).detach()
        plain = raw.alias(v.as_strided((stop - start,), (1,), v.storage_offset() + start)).as_strided(*geometry)
    piece = _manage(plain)
    parent, block = block_of(ref), block_of(piece)
    block.host_parent = parent
    if parent.host_pending is not None:
        block.host_pending = joined(None, parent.host_pending)  # (its fetch waits: on the device)
    return piece


def gathered_piece(plain: torch.Tensor) -> TensorRef:
    """A piece holding ``plain`` (host values gathered from a settled tensor)."""
    return _manage(plain)


def write_back(pieces) -> None:
    """Written pieces' bytes go to the host copies they alias; their device copies go."""
    with mgr.lock:
        for p in pieces:
            if isinstance(p, TensorRef):
                mgr.evict(block_of(p))


def to_host(result: TensorRef) -> torch.Tensor:
    """The values of a piece's result as a plain view of its (current) host copy."""
    with mgr.lock:
        mgr.sync_host(block_of(result))
        return host_view(result).detach()


@contextlib.contextmanager
def landing(outs, start: int, stop: int, spec):
    """Around a chunk's op: its one new result gets elements ``start:stop`` (in the order of
    their bytes) of settled dense ``outs[0]``'s host copy as its own host copy when it is
    made, so that its write-back lands there whenever its strategy evicts it (Genoa as the
    op ends); yields that range (a storage) to give :func:`land`, or ``None`` (no result,
    or several: their order of adoption is not checked)."""
    if outs is None or len(outs) != 1:
        yield None
        return
    out = outs[0]
    host = raw.alias(flat_host(out)[start:stop]).untyped_storage()
    with mgr.protocol.landing(host, block_of(out), out.dtype, spec):
        yield host


def land(result, out: TensorRef, start: int, stop: int, host=None) -> None:
    """A piece's result written into elements ``start:stop`` (in the order of its bytes) of
    settled dense ``out``. A result made with that range as its host copy (``host``, from
    :func:`landing`) is written back there (asynchronously where it is pinned, ``out``'s host
    copy waiting for it), if it is not already; any other is copied there by the host."""
    block = block_of(result) if isinstance(result, TensorRef) else None
    if block is not None and host is not None and block.host is host:
        if block.dev is not None:
            with mgr.lock:
                mgr.evict(block)
        return
    flat_host(out)[start:stop].copy_(to_host(result).reshape(-1))


def in_groups(out: Optional[TensorRef], dim: int, count: int, step: int, run) -> None:
    """``run(start, n)`` for each group of ``step`` indices of ``out``'s dimension ``dim``
    (the op on that group's parts of its tensors), its result copied into its place in
    ``out``, a result in host memory; ``out`` ``None``: the op writes in place, nothing is
    copied."""
    fill_in_groups([(out, dim, 1)], count, step, lambda start, n: (run(start, n),))


def fill_in_groups(outs, count: int, step: int, run, first=None) -> None:
    """``run(start, n)`` for each group of ``step`` of an op's ``count`` units (the op on
    those units' parts), each of the results it gives copied into its place: ``outs`` holds
    per result ``(TensorRef in host memory, its dimension cut, indices of it per unit)``, the
    TensorRef ``None`` where nothing is copied. ``first``: a list holding the first group's
    results, already computed (taken from it: no group's results outlive their copy)."""
    with held_on_host([o for o, _d, _p in outs if o is not None]):
        wholes = [(host_view(o), d, per) if o is not None else None for o, d, per in outs]
        for start in range(0, count, step):
            n = min(step, count - start)
            results = first.pop() if first else run(start, n)
            for whole, result in zip(wholes, results):
                if whole is not None:
                    view, d, per = whole
                    view.narrow(d, start * per, n * per).copy_(to_host(result))
            del results


def host_result(size, dtype, zero: bool = False, stride=None, pinned: bool = False) -> TensorRef:
    """A new TensorRef whose only copy is in host memory (a big result), contiguous or with
    ``stride``; in pinned memory where asked and some is left (pieces' results are written
    back into it asynchronously: :func:`land`)."""
    size = tuple(size)
    plain = _pinned_empty(size, dtype, stride) if pinned else None
    if plain is None:
        plain = raw.empty(size, dtype=dtype) if stride is None else raw.empty_strided(size, stride, dtype=dtype)
    if zero:
        plain.zero_()
    ref = mgr.manage_tensor(plain, requires_grad=False, shared=False)
    return ref


def _pinned_empty(size: tuple, dtype: torch.dtype, stride) -> Optional[torch.Tensor]:
    pinned = mgr.backend.pinned
    if stride is None:
        stride = raw.empty(size, dtype=dtype, device="meta").stride()
    nbytes = raw.storage_bytes(size, stride, dtype)
    buffer = pinned.allocate(nbytes) if pinned is not None and nbytes else None
    return None if buffer is None else buffer.view(dtype).as_strided(size, tuple(stride))
