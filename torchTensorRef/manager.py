"""``tensorsManager``: the pager that moves TensorRef blocks between host and accelerator.

It owns the backend (``device``), the paging policy (``strategy``) and the ``budget``,
tracks every live block and its copies, does every move and keeps the statistics. The
strategy only decides; the manager guarantees, around every op, that the op's blocks are
resident when it runs and that resident bytes stay within the budget. All of it runs under
one re-entrant lock, because autograd runs backward on other threads.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Dict, List, Optional

import torch

from . import raw
from .adoption import Adoption
from .blocks import Block
from .callbacks import Callbacks, OpCallback
from .devices import Backend, PassthroughBackend, make_backend
from .errors import OutOfBudgetError
from .host_memory import HostMemoryWatch
from .op_protocol import OpProtocol
from .sizes import format_size, parse_size
from .strategies import DEFAULT, Strategy, by_name
from .tensor_ref import TensorRef
from .trace import Trace

#: accelerator memory left free when ``budget=None`` on CUDA (allocator slack, kernels' workspaces)
CUDA_RESERVE_BYTES = 512 * 2**20

_STAT_KEYS = (
    "bytes_to_device", "bytes_to_host", "fetches", "writebacks", "evictions",
    "prefetches", "prefetch_hits", "prefetch_misses",
)


class TensorsManager(OpProtocol, Adoption, Callbacks):
    """The global pager; use the ``torchTensorRef.tensorsManager`` instance.

    Settings, statistics, explicit moves and blocks' lifetime are here; the op protocol
    (``op_protocol.py``), adoption of existing tensors (``adoption.py``) and callbacks
    (``callbacks.py``) are mixed in from their own modules.

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
        self._backend: Backend = PassthroughBackend()
        self._declared = self._backend.declared
        self._move_plain_to: Optional[torch.device] = None
        self._strategy: Strategy = by_name(DEFAULT)
        self._strategy.attach(self)
        self._budget: Optional[int] = None
        self._limit: Optional[int] = None  # the budget in force (CUDA: free memory when None)
        self._blocks: Dict[int, Block] = {}
        self._resident: Dict[int, Block] = {}
        self._by_host_storage: Dict[int, Block] = {}
        self._dead: List[Block] = []
        self._device_bytes = 0
        self._peak = 0
        self._op_count = 0  # ops ever run: the index of the next op
        self._ops_at_reset = 0
        self._counters = dict.fromkeys(_STAT_KEYS, 0)
        self._trace: Optional[Trace] = None
        self._fault_injector = None
        self._callbacks: List[OpCallback] = []
        self._host_watch = HostMemoryWatch()
        self._external = 0  # live external blocks (Note [External bytes])
        #: whether ops may take the fast path (Note [Fast path] in ops/dispatch.py)
        self._fast = False
        self._refresh_fast()

    def _refresh_fast(self) -> None:
        """Recompute ``_fast``; every setting it depends on calls this when it changes."""
        self._fast = (not self._callbacks and self._trace is None and self._fault_injector is None
                      and (self._backend.passthrough or not self._strategy.needs_every_op()))

    @property
    def fault_injector(self):
        """Test hook: a callable(op) that may raise ``torch.OutOfMemoryError``, or ``None``."""
        return self._fault_injector

    @fault_injector.setter
    def fault_injector(self, fn) -> None:
        with self._lock:
            self._fault_injector = fn
            self._refresh_fast()

    # -- settings ------------------------------------------------------------------------

    @property
    def device(self) -> str:
        """``"cpu"`` (pass-through), ``"sim"``, or ``"cuda:N"``."""
        b = self._backend
        return str(b.compute) if b.name == "cuda" else b.name

    @device.setter
    def device(self, value) -> None:
        backend = make_backend(value)  # raises ValueError before anything changes
        with self._lock:
            self._drain()
            old = self._backend
            if old.name == backend.name and old.compute == backend.compute:
                return
            for block in list(self._resident.values()):
                self._evict(block)
            if self._blocks and old.declared != backend.declared:
                warnings.warn(
                    f"tensorsManager.device changed from {self.device!r} to {value!r} while "
                    f"{len(self._blocks)} managed storages are alive: existing TensorRefs keep "
                    f"reporting device {old.declared}; set the device before creating tensors",
                    stacklevel=2,
                )
            self._backend = backend
            self._declared = backend.declared
            self._move_plain_to = backend.compute if backend.name == "cuda" else None
            for block in self._blocks.values():
                block.dev_key = block.host._cdata if backend.passthrough and block.host is not None else 0
            self._limit = self._compute_limit(self._budget)
            self._strategy.device_changed()
            self._refresh_fast()

    @property
    def strategy(self) -> Strategy:
        """The paging policy: ``"genoa"`` or a :class:`~torchTensorRef.strategies.Strategy`."""
        return self._strategy

    @strategy.setter
    def strategy(self, value) -> None:
        if isinstance(value, Strategy):
            new = value
        elif isinstance(value, str):
            new = by_name(value)
        elif isinstance(value, type) and issubclass(value, Strategy):
            raise ValueError(f"strategy must be an instance, not the class {value.__name__}: use {value.__name__}()")
        else:
            new = by_name(value)  # raises the ValueError naming what is accepted
        with self._lock:
            self._strategy.detach()
            self._strategy = new
            new.attach(self)
            self._refresh_fast()

    @property
    def budget(self) -> Optional[int]:
        """Accelerator bytes the manager may use: int, ``"512MiB"``, ``"6GB"``, or ``None``.

        ``None`` means unlimited on ``"sim"`` and, on CUDA, the free memory when it was set
        minus ``CUDA_RESERVE_BYTES``.
        """
        return self._budget

    @budget.setter
    def budget(self, value) -> None:
        nbytes = parse_size(value, "budget")
        with self._lock:
            old = (self._budget, self._limit)
            self._budget = nbytes
            self._limit = self._compute_limit(nbytes)
            try:
                self._make_room(0, (), "tensorsManager.budget")
            except OutOfBudgetError:
                self._budget, self._limit = old
                raise
            finally:
                self._refresh_fast()

    def _compute_limit(self, budget: Optional[int]) -> Optional[int]:
        if budget is not None or self._backend.passthrough:
            return budget
        free = self._backend.free_bytes()
        if free is None:
            return None
        return max(free + self._device_bytes - CUDA_RESERVE_BYTES, 0)

    # -- statistics and tracing -------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since the last ``reset_stats()`` and the current state.

        Keys: ``bytes_to_device``, ``bytes_to_host``, ``peak_device_bytes``,
        ``device_bytes``, ``ops``, ``evictions``, ``fetches``, ``writebacks``, ``budget``,
        ``device``, ``strategy``, ``tensors`` (live TensorRefs), ``tensors_on_device``,
        ``blocks``, ``blocks_on_device``, ``host_bytes``.
        """
        with self._lock:
            self._drain()
            out = dict(self._counters)
            out["ops"] = self._op_count - self._ops_at_reset
            out["peak_device_bytes"] = self._peak
            out["device_bytes"] = self._device_bytes
            out["budget"] = self._limit
            out["device"] = self.device
            out["strategy"] = self._strategy.name
            out["blocks"] = len(self._blocks)
            out["blocks_on_device"] = len(self._resident)
            out["tensors"] = sum(b.refs for b in self._blocks.values())
            out["tensors_on_device"] = sum(b.refs for b in self._resident.values())
            out["host_bytes"] = sum(b.nbytes for b in self._blocks.values() if b.host is not None)
            return out

    def reset_stats(self) -> None:
        """Zero the counters; the peak restarts from the bytes resident now."""
        with self._lock:
            self._counters = dict.fromkeys(_STAT_KEYS, 0)
            self._ops_at_reset = self._op_count
            self._peak = self._device_bytes

    @contextlib.contextmanager
    def recording(self):
        """Record block accesses, moves and resident bytes; yields a :class:`Trace`."""
        trace = Trace(self.device, self._limit)
        with self._lock:
            self._drain()
            trace.initial = {b.id: (b.nbytes, b.dirty) for b in self._resident.values()}
            previous, self._trace = self._trace, trace
            self._refresh_fast()
        try:
            yield trace
        finally:
            with self._lock:
                self._trace = previous
                self._refresh_fast()

    def resident_blocks(self):
        """The blocks with a valid accelerator copy (for strategies)."""
        return self._resident.values()

    def room(self) -> Optional[int]:
        """Accelerator bytes that still fit under the budget now; ``None`` when unlimited.

        For strategies that bring blocks in ahead of time: ``fetch`` does not check the
        budget, so a prefetch must fit in ``room()`` (less what the op in flight will add).
        """
        with self._lock:
            limit = self._limit
            return None if limit is None else max(limit - self._device_bytes, 0)

    # -- explicit moves -------------------------------------------------------------------

    def move_to_device(self, ref: TensorRef) -> None:
        """Make ``ref``'s block resident now, evicting others if the budget needs it."""
        with self._lock:
            self._drain()
            block = ref._tr_block
            if self._backend.passthrough or block.dev is not None or block.external:
                return  # (an external block stays on the host: Note [External bytes])
            if self._limit is not None and block.nbytes > self._limit:
                raise OutOfBudgetError("toGPU", block.nbytes, self._limit)
            self._make_room(block.nbytes, (block.id,), "toGPU")
            self.fetch(block)
            block.last_use = self._op_count

    def move_to_host(self, ref: TensorRef) -> None:
        """Write ``ref``'s block back if needed and drop its accelerator copy."""
        with self._lock:
            block = ref._tr_block
            if block.pins:
                self.sync_host(block)
            else:
                self.evict(block)

    @property
    def host_reserve(self) -> int:
        """Host bytes that must stay available; a copy that would eat into them raises
        ``HostMemoryError`` (default: 5% of RAM, at least 256 MiB)."""
        return self._host_watch.reserve

    @host_reserve.setter
    def host_reserve(self, value) -> None:
        nbytes = parse_size(value, "host_reserve")
        if nbytes is None:
            raise ValueError('host_reserve must be a size such as "1GiB" or an int >= 0 (got: None)')
        self._host_watch.reserve = nbytes

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

    # -- block moves (for strategies; the caller holds the lock) ------------------------

    def fetch(self, block: Block, asynchronous: bool = False) -> None:
        """Give ``block`` a valid accelerator copy (no budget check: see ``_make_room``)."""
        if block.dev is not None or self._backend.passthrough:
            return
        start = time.perf_counter_ns()
        if asynchronous and block.host_valid and not block.external:
            pinned = self._backend.pinned_copy(block.host)
            if pinned is not None:  # re-home the host copy once, so prefetches overlap compute
                self._by_host_storage.pop(block.host._cdata, None)
                block.set_host(pinned, True)
        if self._backend.name == "sim":
            self._host_watch.reserve_bytes(block.nbytes)  # the simulated device is host memory
        host = raw.flat_bytes(block.host)
        try:
            dev, block.ready = self._backend.to_device(host, asynchronous)
        except torch.OutOfMemoryError:
            # The accelerator is fuller than our accounting says (another process): evict
            # what no op is using right now and try once more.
            self._evict_all_unpinned(protect=(block.id,))
            dev, block.ready = self._backend.to_device(host, asynchronous)
        block.set_dev(dev.untyped_storage())
        self._resident[block.id] = block
        self._add_device_bytes(block.nbytes)
        c = self._counters
        c["bytes_to_device"] += block.nbytes
        c["fetches"] += 1
        if self._trace is not None:
            self._trace.move("to_device", block.id, block.nbytes, start, time.perf_counter_ns(), self._device_bytes)

    def prefetch(self, block: Block) -> None:
        """Fetch ``block`` ahead of use (asynchronously where the backend can); no budget check."""
        if block.dev is not None or self._backend.passthrough or block.external:
            return
        self.fetch(block, asynchronous=True)
        block.prefetched = True
        self._counters["prefetches"] += 1

    def evict(self, block: Block) -> None:
        """Drop ``block``'s accelerator copy, writing it back first if it is dirty."""
        if block.dev is None:
            return
        start = time.perf_counter_ns()
        wrote = self.sync_host(block, record=False)
        block.set_dev(None)
        del self._resident[block.id]
        self._device_bytes -= block.nbytes
        self._counters["evictions"] += 1
        if self._trace is not None:
            self._trace.move("to_host", block.id, block.nbytes if wrote else 0, start,
                             time.perf_counter_ns(), self._device_bytes)

    _evict = evict

    def sync_host(self, block: Block, record: bool = True) -> bool:
        """Make the host copy valid (keeping the accelerator copy); return whether it copied."""
        if block.host_valid or block.dev is None:
            return False
        if block.host is None:
            self._host_watch.reserve_bytes(block.nbytes)
        start = time.perf_counter_ns()
        host = self._backend.to_host(raw.flat_bytes(block.dev),
                                     raw.flat_bytes(block.host) if block.host is not None else None)
        if block.host is None:
            block.set_host(host.untyped_storage(), True)
        else:
            block.host_valid = True
        c = self._counters
        c["bytes_to_host"] += block.nbytes
        c["writebacks"] += 1
        if record and self._trace is not None:
            self._trace.move("to_host", block.id, block.nbytes, start, time.perf_counter_ns(), self._device_bytes)
        return True

    def _add_device_bytes(self, nbytes: int) -> None:
        self._device_bytes += nbytes
        if self._device_bytes > self._peak:
            self._peak = self._device_bytes

    def _make_room(self, nbytes: int, protect, op_name: str) -> None:
        """Evict (strategy's choice) until ``nbytes`` more fit in the budget."""
        limit = self._limit
        if limit is None:
            return
        while self._device_bytes + nbytes > limit:
            victim = self._strategy.choose_victim(protect)
            if victim is None:
                pinned = sum(b.nbytes for b in self._resident.values() if b.pins)
                raise OutOfBudgetError(
                    op_name, self._device_bytes + nbytes, limit,
                    f"{format_size(pinned)} is pinned and the rest is in use by this op",
                )
            self.evict(victim)

    # -- blocks' lifetime ---------------------------------------------------------------

    def _new_block(self, nbytes: int) -> Block:
        block = Block(nbytes)
        died = self._ref_died
        block.on_ref_dead = lambda _wr, b=block: died(b)
        self._blocks[block.id] = block
        return block

    def _ref_died(self, block: Block) -> None:
        """Weakref callback: a TensorRef viewing ``block`` died.

        It may run anywhere (in the middle of an op, on an autograd thread), so the death is
        queued; it is applied at once when no op is in flight, so that a dead tensor's memory
        comes back when plain torch would free it, not at the next op (allocations then
        reuse it instead of taking fresh pages, and on an accelerator the budget sees it).
        """
        self._dead.append(block)
        lock = self._lock
        if lock._is_owned() or not lock.acquire(blocking=False):
            return  # mid-op on this thread, or another thread holds the lock: the next op drains
        try:
            self._drain()
        finally:
            lock.release()

    def _set_host_only(self, block: Block, storage) -> None:
        block.set_host(storage, True)
        if self._backend.passthrough:
            block.dev_key = storage._cdata

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

    def unmark_external(self, block: Block) -> None:
        """Undo one ``mark_external`` (counters only: it may run from a weakref callback)."""
        block.external -= 1
        if not block.external and block.alive:
            self._external -= 1

    def _release(self, block: Block) -> None:
        if block.external:
            self._external -= 1  # (a late unmark_external sees the block dead)
        if block.dev is not None:
            del self._resident[block.id]
            self._device_bytes -= block.nbytes
            if self._trace is not None:
                self._trace.resized(time.perf_counter_ns(), self._device_bytes)
        if block.host is not None:
            self._by_host_storage.pop(block.host._cdata, None)
            self._backend.host_freed(block.host)
            block.host = None
        if block.dev is not None:
            block.set_dev(None)
        block.alive = False
        block.on_ref_dead = None
        del self._blocks[block.id]
        self._strategy.on_release(block)

tensorsManager = TensorsManager()
