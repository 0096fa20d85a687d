"""A call given plain tensors for a list of TensorRefs, as one op of the manager (an
optimizer's step: Note [Optimizer steps on plain tensors] in ``integrations/optimizers.py``).

Where a region (``mechanism.py``) swaps a module's parameters for plain views, this gives
the views to the caller's function, which puts them where the call reads them. The blocks
are made resident and pinned as one op's (``Step``), creation functions make plain tensors,
and after the call each TensorRef counts as written, its version counter moved as its
view's moved (as plain torch's tensor's would have: autograd's in-place checks read it).
Every one counts as written, not only those whose counters moved: a write no counter shows
(through ``.data``, by a raw kernel) would be a device copy lost at the next eviction.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch

from ..core import context
from ..core.tensor_ref import TensorRef, block_of, compute_view
from ..memory.manager import tensorsManager as _mgr
from ..memory.sim.allocation import PlainMode
from ..memory.sim.tensor import SimTensor
from ..ops.op_context import blocks_of_list
from .mechanism import state
from .op import RegionContext, RegionSpec, Wrapper
from .saved import move_versions
from .step import Step


def run_on_views(spec: RegionSpec, refs: Sequence[TensorRef], fn: Callable[[list, Callable], Any],
                 inside: Optional[int] = None, read: range = range(0)) -> Any:
    """``fn(views, adopt)`` as one op that may write each of ``refs``, ``views[i]`` a plain
    tensor of ``refs[i]``'s bytes (its device copy; a host-only block's host copy).
    ``adopt(t)`` gives back, for a tensor the call made or was given, its TensorRef (a view
    joins its TensorRef's block; anything else becomes a new block). ``fn`` must keep none
    of the views past its return. Under a budget, ``inside`` is the room kept beside the
    blocks for what the call allocates (measured by the caller); ``None``: no budget pages,
    and only the device's capacity bounds what the call allocates, as it bounds plain torch.
    ``read``: the positions of ``refs`` the call only reads (an optimizer's gradients): each
    counts as written only where its view's version counter moved.

    Raises:
        OutOfBudgetError: the blocks and ``inside`` do not fit the budget together; nothing
            changed.
    """
    mgr = _mgr
    with mgr.lock:
        mgr.drain()
        blocks = blocks_of_list([block_of(r) for r in refs])
        ctx = RegionContext(spec, blocks, [], (), {}, False)
        ctx.estimate = inside or 0
    step = Step(ctx, inside is not None)
    step.begin()
    backend = mgr.backend
    sim = getattr(backend, "strict", False) and not backend.passthrough
    try:
        with mgr.lock:
            views = [_view(r, sim) for r in refs]
    except BaseException:
        step.abort()
        raise
    versions = [None if v.is_inference() else v._version for v in views]
    wrap = Wrapper(mgr, ctx, {id(v): r for v, r in zip(views, refs)}, True)

    def adopt(t):
        with mgr.lock:
            return wrap(t)

    device = None if backend.passthrough else backend.declared
    state.depth += 1  # (the modules it calls run plain)
    previous = context.enter_plain(device)
    try:
        with PlainMode() if sim else contextlib.nullcontext():
            out = fn(views, adopt)
    except BaseException:
        _written(blocks, refs, views, versions, read)
        step.abort()
        raise
    finally:
        context.exit_plain(previous)
        state.depth -= 1
    _written(blocks, refs, views, versions, read)
    step.end(inside)
    return out


def _view(ref: TensorRef, sim: bool) -> torch.Tensor:
    view = compute_view(ref)  # (a host-only block's: its host copy)
    if sim and not block_of(ref).host_only:
        return SimTensor(view)  # (strict "sim": a device tensor, as torch sees it)
    return view


def _written(blocks, refs, views, versions, read: range = range(0)) -> None:
    """Each of ``refs`` (on ``blocks``, without repeats) marked written, its version moved
    as its view's moved; those at the positions ``read`` only where their versions moved
    (a block read alone stays clean: evicted, it is dropped, not written back)."""
    mgr = _mgr
    if read:
        clean = {block_of(refs[i]).id for i in read if versions[i] is not None and views[i]._version == versions[i]}
        clean.difference_update(block_of(r).id for i, r in enumerate(refs) if i not in read)
        if clean:
            blocks = [b for b in blocks if b.id not in clean]
    with mgr.lock:
        on_device = [b for b in blocks if not b.host_only]
        if len(on_device) != len(blocks):
            for b in blocks:
                if b.host_only:
                    mgr.host_written(b)
        mgr.mark_written(on_device)
    move_versions(zip(refs, views, versions))
