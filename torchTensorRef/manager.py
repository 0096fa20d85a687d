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
from .blocks import Block
from .devices import Backend, PassthroughBackend, make_backend
from .errors import DeviceOutOfMemoryError, OpVetoedError, OutOfBudgetError
from .host_memory import HostMemoryWatch
from .sizes import format_size, parse_size
from .strategies import DEFAULT, Strategy, by_name
from .tensor_ref import TensorRef, compute_view, make_ref, user_attributes, with_math_bits
from .trace import Trace

#: accelerator memory left free when ``budget=None`` on CUDA (allocator slack, kernels' workspaces)
CUDA_RESERVE_BYTES = 512 * 2**20

_STAT_KEYS = (
    "bytes_to_device", "bytes_to_host", "fetches", "writebacks", "evictions",
    "prefetches", "prefetch_hits", "prefetch_misses",
)


class TensorsManager:
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

    def add_callback(self, before=None, after=None) -> "OpCallback":
        """Run ``before(op)`` / ``after(op)`` around every managed op; returns a handle.

        ``op`` is the op in flight (``op.name``, ``op.index``, ``op.blocks``, ``op.args``
        and, after, ``op.outputs``). A ``before`` callback that returns ``False`` vetoes the
        op: it raises ``OpVetoedError`` before anything changes. Callbacks may hint moves
        (``tensorsManager.pin``, ``tensor.toGPU()``, ``tensor.toCPU()``). Remove with
        ``handle.remove()``.

        Example::

            seen = []
            handle = tensorsManager.add_callback(before=lambda op: seen.append(op.name))
            ...
            handle.remove()
        """
        if before is None and after is None:
            raise ValueError("add_callback needs a before and/or an after callable (got neither)")
        for name, fn in (("before", before), ("after", after)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be callable (got: {type(fn).__name__})")
        handle = OpCallback(self, before, after)
        with self._lock:
            self._callbacks.append(handle)
            self._refresh_fast()
        return handle

    def _run_callbacks(self, when: str, ctx) -> None:
        for handle in list(self._callbacks):
            fn = handle.before if when == "before" else handle.after
            if fn is not None and fn(ctx) is False and when == "before":
                raise OpVetoedError(ctx.name)

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

    # -- the op protocol (called by ops.dispatch, holding the lock) ---------------------

    def _prepare(self, ctx) -> None:
        blocks = ctx.blocks
        limit = self._limit
        if ctx.spec.restrides and self._external and not self._backend.passthrough:
            self._refuse_growing_external(ctx)
        if limit is not None and not self._backend.passthrough:
            # Checked before anything changes: an op that cannot fit is not counted, the
            # strategy never sees it, and nothing is evicted for it.
            need = ctx.output_estimate()
            for b in blocks:
                need += b.nbytes
            if need > limit:
                raise OutOfBudgetError(ctx.name, need, limit)
        if self._callbacks:
            self._run_callbacks("before", ctx)  # may veto: nothing has changed yet
        ctx.index = self._op_count
        self._op_count += 1
        if self._backend.passthrough:
            return
        self._strategy.before_op(ctx)
        missing = [b for b in blocks if b.dev is None]
        limit = self._limit
        if limit is not None:
            estimate = ctx.output_estimate()
            room = estimate
            for b in missing:
                room += b.nbytes
            if room:
                self._make_room(room, {b.id for b in blocks}, ctx.name)
        c = self._counters
        for b in missing:
            self.fetch(b)
        c["prefetch_misses"] += len(missing)
        index = ctx.index
        for b in blocks:
            b.last_use = index
            if b.prefetched:
                b.prefetched = False
                c["prefetch_hits"] += 1
            if b.ready is not None:
                self._backend.wait(b.ready)
                b.ready = None
        self._strategy.before_run(ctx)
        if self._trace is not None:
            ctx._start = time.perf_counter_ns()  # type: ignore[attr-defined]

    def _refuse_growing_external(self, ctx) -> None:
        # The op runs on the accelerator copy, which could grow; but the host bytes are shared
        # with numpy or a buffer (Note [External bytes]), which plain torch refuses to resize.
        if any(b.external for b in ctx.written) and ctx.output_estimate() > 0:
            raise RuntimeError(
                f"{ctx.name}: Trying to resize storage that is not resizable: its bytes are "
                f"shared with memory outside torch (a numpy array, a buffer); resize a copy instead")

    def _call(self, ctx, func, args, kwargs):
        try:
            if self._fault_injector is not None:
                self._fault_injector(ctx)
            return func(*args, **kwargs)
        except torch.OutOfMemoryError:
            if self._backend.passthrough:
                raise
        return self._recover_from_oom(ctx, func, args, kwargs)

    def _recover_from_oom(self, ctx, func, args, kwargs):
        # Another process (or the allocator's fragmentation) took memory: evict what this op
        # does not use and try once more.
        self._evict_all_unpinned(protect={b.id for b in ctx.blocks})
        try:
            if self._fault_injector is not None:
                self._fault_injector(ctx)
            return func(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            free = self._backend.free_bytes() or 0
            raise DeviceOutOfMemoryError(ctx.name, sum(b.nbytes for b in ctx.blocks) + ctx.output_estimate(), free) from e

    def _evict_all_unpinned(self, protect) -> None:
        for block in [b for b in self._resident.values() if b.id not in protect and not b.pins]:
            self.evict(block)
        self._backend.release_cached()

    def _mark_written(self, blocks) -> None:
        if not self._backend.passthrough:
            for b in blocks:
                b.host_valid = False

    def _adopt_output(self, t: torch.Tensor, ctx) -> TensorRef:
        block = self._result_block(t, ctx.index)
        if block.dev is not None and self._trace is not None:
            self._trace.resized(time.perf_counter_ns(), self._device_bytes)
        ctx.outputs.append(block)
        return make_ref(block, t, self._declared)

    def _result_block(self, t: torch.Tensor, index: int) -> Block:
        """A new block for the storage of ``t``, the result of op ``index``."""
        storage = t.untyped_storage()
        block = self._new_block(storage.nbytes())
        block.from_op = True
        if self._backend.passthrough or not self._backend.is_device_output(t):
            self._set_host_only(block, storage)
        else:
            block.set_dev(storage)
            self._resident[block.id] = block
            self._add_device_bytes(block.nbytes)
            block.last_use = index
        return block

    def _resized(self, block: Block, nbytes: int) -> None:
        """``block``'s storage was resized in place (``resize_``) to ``nbytes``."""
        if block.dev is not None:
            self._add_device_bytes(nbytes - block.nbytes)
            if block.host is not None:  # the host copy has the old size: drop it
                self._by_host_storage.pop(block.host._cdata, None)
                block.set_host(None, False)
            if self._trace is not None:
                self._trace.resized(time.perf_counter_ns(), self._device_bytes)
        block.nbytes = nbytes

    def _finish(self, ctx) -> None:
        if self._callbacks:
            self._run_callbacks("after", ctx)
        if self._backend.passthrough:
            return
        self._strategy.after_op(ctx)
        if self._external:
            for b in ctx.blocks:
                if b.external and b.dev is not None:
                    self.evict(b)  # even if pinned: Note [External bytes]
        if self._limit is not None and self._device_bytes > self._limit:
            self._make_room(0, (), ctx.name)  # the op's results were larger than estimated
        trace = self._trace
        if trace is not None:
            written = {b.id for b in ctx.written}
            index = ctx.index
            for b in ctx.blocks:
                trace.accesses.append((index, b.id, b.nbytes, b.id in written))
            for b in ctx.outputs:
                trace.accesses.append((index, b.id, b.nbytes, True))
                trace.created.add(b.id)
            trace.op(index, ctx.name, getattr(ctx, "_start", 0), time.perf_counter_ns())

    # -- blocks' lifetime ---------------------------------------------------------------

    def _new_block(self, nbytes: int) -> Block:
        block = Block(nbytes)
        dead = self._dead
        block.on_ref_dead = lambda _wr, b=block: dead.append(b)
        self._blocks[block.id] = block
        return block

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
        block.set_dev(None)
        block.host = None
        block.alive = False
        block.on_ref_dead = None
        del self._blocks[block.id]
        self._strategy.on_release(block)

    # -- bringing tensors under management ----------------------------------------------

    def manage_tensor(self, t: torch.Tensor, requires_grad: Optional[bool] = None):
        """A TensorRef over plain tensor ``t``'s bytes (shared, not copied).

        A ``Parameter`` stays a ``Parameter``; a TensorRef is returned as is. Tensors on
        another accelerator than the manager's are copied to host memory first.

        Raises:
            ValueError: for tensors that cannot be managed (meta, sparse, other subclasses).
        """
        if isinstance(t, TensorRef):
            return t
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise ValueError(f"only plain torch.Tensor can be managed (got: {type(t).__name__})")
        if t.layout is not torch.strided or t.device.type == "meta":
            raise ValueError(
                f"only strided tensors with data can be managed (got: layout={t.layout}, device={t.device})"
            )
        rg = t.requires_grad if requires_grad is None else requires_grad
        ref = self._wrap_plain(t.detach(), rg)
        if isinstance(t, torch.nn.Parameter):
            ref = torch.nn.Parameter(ref, requires_grad=rg)
        if t.__dict__:
            ref.__dict__.update(t.__dict__)  # attributes users set (transformers marks parameters)
        return ref

    def _wrap_plain(self, t: torch.Tensor, requires_grad: bool) -> TensorRef:
        with self._lock:
            self._drain()
            backend = self._backend
            on_device = (not backend.passthrough and t.device == backend.compute
                         and backend.is_device_output(t) and backend.name != "sim")
            if not on_device and t.device.type != "cpu":
                t = t.to("cpu")
            storage = t.untyped_storage()
            key = storage._cdata
            block = self._by_host_storage.get(key) if not on_device else None
            if block is None:
                block = self._new_block(storage.nbytes())
                if on_device:
                    block.set_dev(storage)
                    self._resident[block.id] = block
                    self._add_device_bytes(block.nbytes)
                else:
                    self._set_host_only(block, storage)
                    self._by_host_storage[key] = block
                self._strategy.on_adopt(block)
            # t views the block's storage unless an existing block's current copy is elsewhere
            current = block.dev if block.dev is not None else block.host
            view = t if current is storage else compute_view_of(block, t)
            return make_ref(block, view, self._declared, requires_grad=requires_grad)

    def clone_ref(self, ref: TensorRef, memo: dict):
        """A deep copy of leaf ``ref`` with its own block (``copy.deepcopy``)."""
        with self._lock:
            block = ref._tr_block
            key = ("torchTensorRef.block", block.id)
            new_block = memo.get(key)
            if new_block is None:
                self.sync_host(block)
                self._host_watch.reserve_bytes(block.nbytes)
                storage = raw.flat_bytes(block.host).clone().untyped_storage()
                new_block = self._new_block(block.nbytes)
                self._set_host_only(new_block, storage)
                memo[key] = new_block
            view = with_math_bits(raw.typed_view(new_block.host, ref.dtype, ref.size(), ref.stride(),
                                                 ref.storage_offset()), ref)
            new = make_ref(new_block, view, self._declared, requires_grad=ref.requires_grad)
        if getattr(ref, "_is_param", False):
            new = torch.nn.Parameter(new, requires_grad=ref.requires_grad)
        import copy

        if ref.grad is not None:
            new.grad = copy.deepcopy(ref.grad, memo)
        for name, value in user_attributes(ref).items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def rebind(self, ref: TensorRef, new: TensorRef) -> None:
        """Point ``ref`` at ``new``'s block (after ``ref.data = new``)."""
        with self._lock:
            old = ref._tr_block
            block = new._tr_block
            # Count the new view first: ``p.data = p`` (Module.to on a tied parameter that
            # already has the dtype) rebinds a block to itself and must not release it.
            block.refs += 1
            ref._tr_wr = None  # the old liveness weakref goes, and its callback with it
            old.refs -= 1
            if old.refs == 0 and old.alive:
                self._release(old)
            ref._tr_block = block
            ref._tr_view = compute_view(new)
            ref._tr_gen = block.gen
            import weakref

            ref._tr_wr = weakref.ref(ref, block.on_ref_dead)


class OpCallback:
    """Handle of callbacks added with ``tensorsManager.add_callback``."""

    def __init__(self, manager: TensorsManager, before, after):
        self.manager, self.before, self.after = manager, before, after

    def remove(self) -> None:
        """Stop calling these callbacks (idempotent)."""
        with self.manager._lock:
            if self in self.manager._callbacks:
                self.manager._callbacks.remove(self)
                self.manager._refresh_fast()


def compute_view_of(block: Block, t: torch.Tensor) -> torch.Tensor:
    storage = block.dev if block.dev is not None else block.host
    return with_math_bits(raw.typed_view(storage, t.dtype, t.size(), t.stride(), t.storage_offset()), t)


tensorsManager = TensorsManager()
