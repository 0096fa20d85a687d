"""``tensorsManager``: the pager that moves TensorRef blocks between host and accelerator.

The manager is a facade over the parts it mixes in: its settings (``device``, ``strategy``,
``budget`` and the tiers' limits) in ``settings.py``, its counters and recordings in
``statistics.py``, the copy protocol and the byte accounting in ``residency.py``, the host
and disk tiers in ``host_tier.py``, what happens around one op in ``op_protocol.py``,
adoption of existing tensors in ``adoption.py`` and callbacks in ``callbacks.py``. What it
keeps itself: what strategies read, explicit moves, pinning and the blocks' lifetime. The strategy only decides; the manager guarantees, around
every op, that the op's blocks are resident when it runs and that the device bytes stay
within the budget. All of it runs under one re-entrant lock, because autograd runs
backward on other threads.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
from typing import Dict, List, Optional

import torch

from ..analysis.trace import Trace
from ..core import context
from ..core.blocks import Block
from ..core.errors import OutOfBudgetError
from ..core.tensor_ref import TensorRef
from ..strategies import DEFAULT, Strategy, by_name
from .adoption import Adoption
from .callbacks import Callbacks, OpCallback
from .devices import SIM_CAPACITY_BYTES, Backend, PassthroughBackend, default_device
from .host_memory import HostMemoryWatch
from .host_tier import HostTier
from .op_protocol import OpProtocol
from .pinned import default_limit
from .residency import Residency
from .settings import Settings
from .statistics import STAT_KEYS, Statistics


class TensorsManager(Settings, Statistics, Residency, HostTier, OpProtocol, Adoption, Callbacks):
    """The global pager; use the ``torchTensorRef.tensorsManager`` instance.

    Example::

        import torchTensorRef, torch
        tm = torchTensorRef.tensorsManager
        tm.device = "sim"          # or "cuda", "cuda:1", "cpu" (pass-through)
        tm.strategy = "genoa"
        tm.budget = "64MiB"
        x = torch.rand(1024, 1024)  # a TensorRef
        y = (x @ x).sum()
        print(tm.stats()["bytes_to_device"])
    """

    def __init__(self):
        self._lock = threading.RLock()
        self._forked = False  # a child of the process that made this manager (Note [Forked workers])
        self._exiting = False  # the interpreter is shutting down: TensorRefs dying now release nothing
        self._sim_capacity = SIM_CAPACITY_BYTES
        self._sim_workspace = 0
        self._sim_rounding = False
        self._sim_strict = True
        self._pinned_limit = default_limit()
        self._backend: Backend = PassthroughBackend()
        self._declared = self._backend.declared
        self._unresolved = False  # "cuda" without an index, until the first tensor
        self._elsewhere = False  # whether the device has allocations beside ours to ask about
        self._strategy: Strategy = by_name(DEFAULT)
        self._strategy.attach(self)
        self._budget: Optional[int] = None
        self._limit: Optional[int] = None  # the budget in force (None: the device's capacity)
        self._blocks: Dict[int, Block] = {}
        self._resident: Dict[int, Block] = {}
        # For strategies, which look blocks up by id many times per op: the dicts' own get,
        # with no Python frame per call (neither dict is ever replaced).
        #: ``block(id)``: the live block with this id, or ``None``
        self.block = self._blocks.get
        #: ``resident_block(id)``: the resident block with this id, or ``None``
        self.resident_block = self._resident.get
        self._by_host_storage: Dict[int, Block] = {}
        self._dead: List[Block] = []
        self._device_bytes = 0
        self._inflight: list = []  # (Pending, nbytes) of write-backs still running
        self._inflight_bytes = 0
        self._elsewhere_bytes = 0  # last reading of Backend.in_use_elsewhere (CUDA)
        self._warmed: set = set()  # workspace_key()s whose workspaces the device has made
        self._room_checks = 0
        self._peak = 0
        self._overshoot = 0  # most bytes ever in use above the budget (should stay 0)
        self._pressured = False  # something had to be evicted to make room
        self._op_count = 0  # ops ever run: the index of the next op
        self._ops_at_reset = 0
        self._counters = dict.fromkeys(STAT_KEYS, 0)
        self._trace: Optional[Trace] = None
        self._fault_injector = None
        self._callbacks: List[OpCallback] = []
        self._host_watch = HostMemoryWatch()
        self._host_watch.release = lambda: self._backend.release_cached()  # (on "sim": host memory)
        self._init_host_tier()
        self._external = 0  # live external blocks (Note [External bytes])
        self._host_only_blocks = 0
        self._capturing = False  # a CUDA graph capture is under way (ops on TensorRefs refuse it)
        #: whether ops may take the fast path (Note [Fast path] in ops/dispatch.py)
        self._fast = False
        self._fast_watch = None  # the strategy, when it sees fast ops through its fast_op hooks
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        """Recompute ``_fast``; every setting it depends on calls this when it changes."""
        strategy = self._strategy
        watching = not self._backend.passthrough and strategy.needs_every_op()
        # A strategy that sees every op may still let the ops that move nothing skip the
        # generic path, telling it of them through its fast_op hooks.
        self._fast_watch = strategy if watching and strategy.follows_fast_ops() else None
        self._fast = (not self._callbacks and self._trace is None and self._fault_injector is None
                      and not self._capturing and (not watching or self._fast_watch is not None)
                      # (emulated workspaces are made on the generic path: OpProtocol._before_kernel)
                      and not getattr(self._backend, "workspace", 0))

    def hooks_changed(self) -> None:
        """The strategy's ``needs_every_op()`` or ``follows_fast_ops()`` changed its answer."""
        with self._lock:
            self._refresh_fast()

    def _set_capturing(self, capturing: bool) -> None:
        """A CUDA graph capture began or ended (ops on TensorRefs refuse to be captured)."""
        with self._lock:
            self._capturing = capturing
            self._refresh_fast()

    def _pressure(self) -> None:
        """Room had to be made by evicting: strategies that learn from every op start now."""
        if not self._pressured:
            self._pressured = True
            self._refresh_fast()

    @property
    def fault_injector(self):
        """Test hook: a callable(fault) called before every op and every device allocation.

        ``fault`` is a :class:`~torchTensorRef.memory.residency.Fault` (``kind`` "op", "fetch",
        "prefetch", "writeback" or "create"); raising ``torch.OutOfMemoryError`` from it
        simulates the device running out of memory there. ``None`` to stop; anything else
        that cannot be called raises ``TypeError`` and changes nothing.
        """
        return self._fault_injector

    @fault_injector.setter
    def fault_injector(self, fn) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"fault_injector must be a callable taking a Fault, or None (got: {fn!r}, "
                            f"which is not callable)")
        with self._lock:
            self._fault_injector = fn
            self._refresh_fast()

    # -- what strategies read ---------------------------------------------------------------

    @property
    def limit(self) -> Optional[int]:
        """The budget in force in bytes (the device's capacity when ``budget`` is ``None``)."""
        return self._limit

    @property
    def op_index(self) -> int:
        """Index of the next op."""
        return self._op_count

    @property
    def device_kind(self) -> str:
        """``"cpu"``, ``"sim"`` or ``"cuda"``."""
        return self._backend.kind

    @property
    def device_bytes(self) -> int:
        """Bytes of resident blocks now."""
        return self._device_bytes

    @property
    def disk_blocks(self) -> int:
        """Live blocks with a copy on disk (strategies read ahead while there are any)."""
        return self._disk_blocks

    def is_accelerator(self, device: torch.device) -> bool:
        """Whether ``device`` is the manager's accelerator (``"cuda"`` matches ``"cuda:N"``)."""
        if self._backend.passthrough:
            return False
        if self._unresolved:
            self._resolve_device()
        declared = self._declared
        return device.type == declared.type and (device.index is None or device.index == declared.index)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget without evicting anything."""
        limit = self._limit
        return limit is None or (self._device_bytes + self._inflight_bytes + self._elsewhere_bytes + nbytes <= limit)

    def resident_blocks(self):
        """The blocks with a valid accelerator copy (for strategies)."""
        return self._resident.values()

    def all_resident(self) -> bool:
        """Whether every live block that can be resident (not host-only) is."""
        return len(self._resident) == len(self._blocks) - self._host_only_blocks

    @property
    def under_pressure(self) -> bool:
        """Whether room had to be made by evicting since the budget or device was set."""
        return self._pressured

    def outside_bytes(self) -> int:
        """Device bytes allocated now outside the manager's blocks: library workspaces (made
        first, as the budget setter does), the program's own device tensors. The budget
        covers them (Note [Budget on CUDA]): a budget must be larger. 0 on ``"cpu"``."""
        with self._lock:
            if self._backend.passthrough:
                return 0
            if self._unresolved:
                self._resolve_device()
            return self._warm_up()

    def room(self) -> Optional[int]:
        """Accelerator bytes that still fit under the budget now; ``None`` when unlimited.

        For strategies that bring blocks in ahead of time: ``fetch`` does not check the
        budget, so a prefetch must fit in ``room()`` (less what the op in flight will add).
        """
        with self._lock:
            limit = self._limit
            if limit is None:
                return None
            return max(limit - self._device_bytes - self._inflight_bytes - self._elsewhere_bytes, 0)

    # -- explicit moves -------------------------------------------------------------------

    def move_to_device(self, ref: TensorRef) -> None:
        """Make ``ref``'s block resident now, evicting others if the budget needs it."""
        with self._lock:
            self._drain()
            block = ref._tr_block
            if self._backend.passthrough or block.dev is not None or block.external or block.host_only:
                return  # (an external block stays on the host: Note [External bytes])
            size = self._backend.block_bytes(block.nbytes)
            if self._limit is not None and size + self._elsewhere_bytes > self._limit:
                outside = self._read_outside()  # (a reading of the device, not a stale one)
                if size + outside > self._limit:
                    raise OutOfBudgetError("toGPU", size + outside, self._limit, outside=outside)
            self._make_room(size, (block.id,), "toGPU")
            self.fetch(block, (block.id,))
            block.last_use = self._op_count

    def expose(self, ref: TensorRef) -> torch.Tensor:
        """``ref``'s device copy for code outside torch's ops (``data_ptr``): brought in,
        counted as written, and kept resident until room is needed."""
        with self._lock:
            view = self.write_view(ref)
            ref._tr_block.exposed = True
            return view

    def write_view(self, ref: TensorRef) -> torch.Tensor:
        """A plain view of ``ref``'s device copy (brought in) that its caller writes: the host
        copy is stale from now on. For code that writes a TensorRef's bytes without an op."""
        with self._lock:
            self.move_to_device(ref)
            block = ref._tr_block
            view = ref.target
            if not block.host_only and block.dev is not None:
                block.host_valid = False
                self._disk_stale(block)
            return view

    def move_to_host(self, ref: TensorRef) -> None:
        """Write ``ref``'s block back if needed and drop its accelerator copy."""
        with self._lock:
            block = ref._tr_block
            if not block.pins:
                self.evict(block)
            self.sync_host(block)
            self._retire_inflight()  # its write-back ended: its device bytes are free now

    def discard(self, ref: TensorRef) -> None:
        """``ref``'s bytes are rewritten before they are read again: free its accelerator copy
        without writing it back (FSDP2 frees its gathered parameters so between uses).

        The host copy is kept as the valid one (its stale bytes are never read); a block that
        has none yet is written back once to get it.
        """
        with self._lock:
            self._drain()
            block = ref._tr_block
            if block.dev is None or block.pins or block.host_only or block.external or block.host_shared:
                return
            if block.host is not None and block.host.nbytes() == block.nbytes:
                block.host_valid = True
            self.evict(block)

    def evict_all(self) -> None:
        """Send every unpinned block back to host memory (writing back what changed)."""
        with self._lock:
            self._drain()
            for block in [b for b in self._resident.values() if not b.pins]:
                self.evict(block)

    def pin(self, tensor: TensorRef) -> None:
        """Keep ``tensor``'s block resident until ``unpin``; pins nest."""
        if not isinstance(tensor, TensorRef):
            raise TypeError(f"pin needs a TensorRef (got: {type(tensor).__name__})")
        with self._lock:
            self.move_to_device(tensor)
            tensor._tr_block.pins += 1

    def unpin(self, tensor: TensorRef) -> None:
        """Undo one ``pin``."""
        if not isinstance(tensor, TensorRef):
            raise TypeError(f"unpin needs a TensorRef (got: {type(tensor).__name__})")
        with self._lock:
            block = tensor._tr_block
            if block.pins == 0:
                raise ValueError("unpin of a tensor that is not pinned")
            block.pins -= 1

    # -- blocks' lifetime ---------------------------------------------------------------

    def _new_block(self, nbytes: int) -> Block:
        if self._unresolved:
            self._resolve_device()
        block = Block(nbytes)
        # (a partial, not a lambda: one Python frame less for every TensorRef that dies)
        block.on_ref_dead = functools.partial(self._ref_died, block)
        self._blocks[block.id] = block
        return block

    def _ref_died(self, block: Block, _weakref=None) -> None:
        """Weakref callback: a TensorRef viewing ``block`` died.

        It may run anywhere (in the middle of an op, on an autograd thread), so the death is
        queued; it is applied at once when no op is in flight, so that a dead tensor's memory
        comes back when plain torch would free it, not at the next op (allocations then
        reuse it instead of taking fresh pages, and on an accelerator the budget sees it).
        """
        if self._exiting:
            return  # (the process ends: its memory goes with it, and the modules the release uses may be gone)
        self._dead.append(block)
        lock = self._lock
        if lock._is_owned() or not lock.acquire(blocking=False):
            return  # mid-op on this thread, or another thread holds the lock: the next op drains
        try:
            self._drain()
        finally:
            lock.release()

    def _host_written(self, block: Block) -> None:
        """An op on the host wrote ``block``'s host copy: a device copy is stale now."""
        self._disk_stale(block)
        if block.dev is not None and not block.host_only:
            block.host_valid = True
            block.dev_pending = None
            self._drop_dev(block)
            del self._resident[block.id]
            self._device_bytes -= self._backend.block_bytes(block.nbytes)

    def _set_host_only(self, block: Block, storage) -> None:
        """``storage`` is ``block``'s host copy, and the one ops run on if it is host-only (or pass-through)."""
        block.set_host(storage, True)
        if self._backend.passthrough or block.host_only:
            block.dev_key = storage._cdata  # (and not paged: not counted against the host budget)
        else:
            self._host_gained(block)

    def _drain(self) -> None:
        """Apply the TensorRef deaths the weakref callbacks queued; release dead blocks."""
        dead = self._dead
        while dead:
            block = dead.pop()
            block.refs -= 1
            if block.refs == 0 and block.alive:
                self._release(block)

    def mark_external(self, block: Block) -> None:
        """Note one more holder of ``block``'s host bytes outside the manager (Note [External bytes])."""
        with self._lock:
            if not block.external and block.alive:
                self._external += 1
            block.external += 1
            self.evict(block)
            self.sync_host(block)

    def unmark_external(self, block: Block) -> None:
        """Undo one ``mark_external`` (counters only: it may run from a weakref callback)."""
        block.external -= 1
        if not block.external and block.alive:
            self._external -= 1

    def _release(self, block: Block) -> None:
        if block.host_only:
            self._host_only_blocks -= 1
        if block.external:
            self._external -= 1  # (a late unmark_external sees the block dead)
        if block.dev is not None:
            del self._resident[block.id]
            self._device_bytes -= self._backend.block_bytes(block.nbytes)
            if self._trace is not None:
                self._trace.resized(time.perf_counter_ns(), self._device_bytes)
        if block.host is not None:
            self._forget_host(block)
            block.host = None
        if block.dev is not None:
            self._drop_dev(block)
        if block.disk is not None or block.spilling is not None:
            self._disk_stale(block)
        block.dev_pending = None
        block.alive = False
        block.on_ref_dead = None
        del self._blocks[block.id]
        self._strategy.on_release(block)


tensorsManager = TensorsManager()
context.install_manager(tensorsManager)


def _exiting() -> None:
    tensorsManager._exiting = True


atexit.register(_exiting)


def _initial_device() -> None:
    """On a machine with CUDA the manager starts on ``"cuda"`` (its index fixed at first use)."""
    if default_device() == "cuda":
        tensorsManager.device = "cuda"


_initial_device()
