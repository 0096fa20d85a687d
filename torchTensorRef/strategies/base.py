"""The ``Strategy`` base class: the hooks a paging policy implements.

The manager calls the hooks around every op, holding its lock. A strategy decides; the
manager does: it calls ``manager.fetch(block)`` / ``manager.evict(block)`` and never
touches a block's copies itself. Whatever a strategy does, the manager guarantees the
op's own blocks are resident when the op runs and that the budget holds.

A strategy uses the manager through its public strategy interface only, each member
listed with what it does in ``docs/custom-strategy.md``: reads (``limit``, ``op_index``,
``under_pressure``, ``budget``, ``device_kind``, ``device_bytes``, ``disk_blocks``, ``room()``,
``in_use()``, ``fits(n)``, ``block_bytes(n)``, ``prefetch_bytes(block)``, ``block(id)``,
``resident_block(id)``, ``resident_blocks()``, ``all_resident()``, ``host_room()``,
``host_copies()``) and requests
(``evict``, ``fetch``, ``prefetch``, ``read_ahead``, ``drop_host_copy``, ``hooks_changed()``).

A minimal custom strategy (``docs/custom-strategy.md`` develops it)::

    from torchTensorRef.strategies import Strategy

    class WeightsStay(Strategy):
        '''Keep long-lived tensors on the accelerator; send op results back right away.'''
        name = "weights-stay"

        def after_op(self, op):
            for block in op.outputs:
                if block.resident and not block.pins:
                    self.manager.evict(block)

    tensorsManager.strategy = WeightsStay()
"""

from __future__ import annotations

from typing import Iterable, Optional


class Strategy:
    """Base paging policy. Subclass it and override the hooks you need.

    Hooks (``op`` is an :class:`~torchTensorRef.ops.op_context.OpContext` with ``index``,
    ``name``, ``spec``, ``blocks`` (inputs), ``written``, ``output_estimate()`` and, after the
    op, ``outputs``):

    - ``before_op(op)``: before the op's blocks are made resident (prefetch, plan).
    - ``before_run(op)``: its blocks are resident and it is about to run (prefetch).
    - ``after_op(op)``: after the op ran and its results were registered (evict, keep).
    - ``choose_victim(protect)``: the block to evict when room is needed, or ``None``.
    - ``on_release(block)``: a block died (no TensorRef views it any more).
    - ``on_adopt(block)``: a creation function made a new block (not an op).
    - ``device_changed()``: the manager's device changed.
    - ``attach(manager)`` / ``detach()``: the strategy was installed / replaced.
    - ``needs_every_op()``: whether the three per-op hooks must see every op.
    - ``follows_fast_ops()``, ``fast_op(...)``, ``after_fast_op(...)``: a cheaper way to see
      the ops that move nothing, for a strategy that knows what to expect (Flow's plan).
    - ``choose_host_victim(candidates, index)``, ``host_room_for(block, index)``: under a
      host budget, which host copy leaves host memory, and whether to keep one.

    The default victim is the least recently used unpinned resident block.
    """

    name = "base"
    #: whether tensors made by creation functions (``torch.zeros``, ``torch.arange`` ...) are
    #: made on the device when they fit without evicting anything; random ones always are
    #: (their numbers must come from the device's generator), and ``on_adopt`` may evict them
    new_tensors_on_device: bool = True
    #: whether the strategy sends blocks back to the host after their op, with no room asked
    #: for (Genoa): then nothing may keep their device bytes past a call, and a region's
    #: saved activations are blocks even with no budget (Note [Saved while nothing pages])
    sends_back: bool = False

    def __init__(self):
        self.manager = None

    def attach(self, manager) -> None:
        self.manager = manager

    def detach(self) -> None:
        self.manager = None

    def needs_every_op(self) -> bool:
        """Whether ``before_op``, ``before_run`` and ``after_op`` must see every op.

        ``False`` lets ops whose blocks are all resident skip them (and skip the manager's
        bookkeeping for them), which is what makes a model that fits run at nearly plain
        speed. The manager asks again whenever the budget, the device or the strategy
        changes; ``choose_victim``, ``on_release`` and ``on_adopt`` are always called.
        """
        return True

    @property
    def settled(self) -> bool:
        """Whether a loop the program repeats runs as it will from here on (``False`` while
        the strategy still learns it or tries choices on it): benchmarks of the steady state
        warm up until then. A strategy that learns nothing is settled from the start."""
        return True

    def follows_fast_ops(self) -> bool:
        """Whether, while ``needs_every_op()`` is ``True``, ops whose blocks are all resident
        and whose results fit may still take the fast path, reporting to ``fast_op`` and
        ``after_fast_op`` instead of the three per-op hooks. Ask the manager to call this
        again with ``manager.hooks_changed()`` when the answer changes.
        """
        return False

    def fast_op(self, index: int, func, blocks, reserved: int) -> bool:
        """Op ``index`` (its ``OpSpec`` ``func``, distinct ``blocks``, all resident) is about to
        take the fast path with ``reserved`` bytes of room kept for its results: ``False``
        sends it down the generic path instead, where every hook sees it (nothing changed yet).
        """
        return False

    def after_fast_op(self, index: int, outputs) -> None:
        """Op ``index`` took the fast path and created the blocks ``outputs`` (resident)."""

    def before_op(self, op) -> None:
        pass

    def before_run(self, op) -> None:
        """The op's blocks are resident and it is about to run (prefetch here)."""

    def after_op(self, op) -> None:
        pass

    def on_release(self, block) -> None:
        pass

    def device_changed(self) -> None:
        """``tensorsManager.device`` changed (every block was sent back to the host first)."""

    def on_adopt(self, block) -> None:
        """A creation function (``torch.zeros``, ``torch.load`` ...) made a new block."""

    def choose_victim(self, protect: Iterable[int]):
        """The resident, unpinned block not in ``protect`` (block ids) used least recently."""
        best: Optional[object] = None
        for block in self.manager.resident_blocks():
            if block.pins or block.id in protect:
                continue
            if best is None or block.last_use < best.last_use:
                best = block
        return best

    def choose_host_victim(self, candidates, index: int):
        """Which host copy leaves host memory when the host budget is full (``None``: none).

        ``candidates`` are the blocks whose host copy may go; ``index`` is the next op's.
        The default prefers copies that go for free (a stale one, or one whose bytes a disk
        copy holds), then the least recently used.
        """
        best = None
        best_key = None
        for block in candidates:
            key = (block.host_valid and block.disk is None, block.last_use)
            if best is None or key < best_key:
                best, best_key = block, key
        return best

    def host_room_for(self, block, index: int) -> bool:
        """Make host room for ``block``, leaving the device with its only other copy on disk,
        by dropping host copies that are free to drop; whether it did. The default does not:
        the block is read from disk when next needed."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
