"""``tensorsManager``: the pager that moves TensorRef blocks between host and accelerator.

The manager is a facade over the settings (``device``, ``strategy``, ``budget``,
``pinned_limit``, ``sim_capacity``), the statistics and the blocks' lifetime. The copy
protocol and the byte accounting are in ``residency.py``, what happens around one op in
``op_protocol.py``, adoption of existing tensors in ``adoption.py`` and callbacks in
``callbacks.py``, each mixed in. The strategy only decides; the manager guarantees, around
every op, that the op's blocks are resident when it runs and that the device bytes stay
within the budget. All of it runs under one re-entrant lock, because autograd runs
backward on other threads.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
from typing import Dict, List, Optional

import torch

from . import streams
from .adoption import Adoption
from ..core import context
from ..core.blocks import Block
from .callbacks import Callbacks, OpCallback
from .devices import Backend, PassthroughBackend, SIM_CAPACITY_BYTES, default_device, make_backend
from ..core.errors import BudgetBelowFloorError, OutOfBudgetError
from .disk import check_offload_dir
from .host_memory import HostMemoryWatch
from .host_tier import HostTier, return_freed_host_memory
from .op_protocol import OpProtocol
from .pinned import default_limit
from .residency import Residency
from ..core.sizes import parse_size
from ..strategies import DEFAULT, Strategy, by_name
from ..core.tensor_ref import TensorRef
from ..analysis.trace import Trace

#: device memory left free when ``budget=None`` on CUDA (allocator slack, kernels' workspaces)
CUDA_RESERVE_BYTES = 512 * 2**20

_STAT_KEYS = (
    "bytes_to_device", "bytes_to_host", "fetches", "writebacks", "evictions",
    "prefetches", "prefetch_hits", "prefetch_misses", "prefetches_unused", "prefetches_dropped",
    "host_syncs", "bytes_from_disk", "bytes_to_disk",
)


class TensorsManager(Residency, HostTier, OpProtocol, Adoption, Callbacks):
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
        self._sim_capacity = SIM_CAPACITY_BYTES
        self._sim_workspace = 0
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
        self._counters = dict.fromkeys(_STAT_KEYS, 0)
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
        simulates the device running out of memory there. ``None`` to stop.
        """
        return self._fault_injector

    @fault_injector.setter
    def fault_injector(self, fn) -> None:
        with self._lock:
            self._fault_injector = fn
            self._refresh_fast()

    # -- settings ------------------------------------------------------------------------

    @property
    def device(self) -> str:
        """``"cpu"`` (pass-through), ``"sim"``, ``"cuda"`` (until its first tensor) or ``"cuda:N"``."""
        b = self._backend
        if b.name == "cuda":
            return str(b.compute) if b.resolved else "cuda"
        return b.name

    @device.setter
    def device(self, value) -> None:
        with self._lock:
            current = self._backend
            if isinstance(value, str) and value.strip().lower() == self.device and current.name != "cuda":
                return  # (no new backend: "sim" would register nothing new, but keep its state)
            backend = make_backend(value, self._sim_capacity, self._pinned_limit,
                                   self._sim_workspace)  # ValueError: nothing changed
            self._drain()
            if current.name == backend.name and (
                    current.compute == backend.compute if backend.name != "cuda"
                    else current.target_index() == backend.target_index()):
                return  # the same device ("cuda" again, resolved or not): keep every block where it is
            self._retire_inflight(wait=True)
            for block in list(self._resident.values()):
                self._evict(block)
            self._retire_inflight(wait=True)
            old_declared = self._declared
            self._backend = backend
            self._elsewhere = backend.name == "cuda" or bool(getattr(backend, "workspace", 0))
            self._elsewhere_bytes = 0  # (a reading of the old device)
            self._warmed = set()  # workspace_key()s whose workspaces the device has made
            self._unresolved = backend.name == "cuda" and not backend.resolved
            self._declared = backend.declared
            live = [b for b in self._blocks.values() if not b.host_only]
            if live and old_declared != backend.declared and not self._unresolved:
                warnings.warn(
                    f"tensorsManager.device changed to {value!r} while {len(live)} managed storages "
                    f"are alive: existing TensorRefs keep reporting device {old_declared}; set the "
                    f"device before creating tensors", stacklevel=2)
            for block in self._blocks.values():
                block.dev_key = block.host._cdata if (backend.passthrough or block.host_only) and block.host is not None else 0
            self._pressured = False
            self._limit = self._compute_limit(self._budget)
            self._count_host_copies()
            self._strategy.device_changed()
            self._refresh_fast()

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` managed tensors report and their ops run for: ``cuda:N``
        (``"cuda"`` is resolved here if it was not yet), ``sim:0``, or ``cpu``."""
        if self._unresolved:
            self._resolve_device()
        return self._declared

    def _resolve_device(self) -> None:
        """Fix ``"cuda"``'s index at first use (Note [Declared device])."""
        with self._lock:
            if self._unresolved:
                self._backend.resolve()
                self._declared = self._backend.declared
                self._unresolved = False
                self._limit = self._compute_limit(self._budget)
                self._refresh_fast()

    @property
    def strategy(self) -> Strategy:
        """The paging policy: ``"genoa"``, ``"flow"`` or a :class:`~torchTensorRef.strategies.Strategy`."""
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
        """Accelerator bytes the process may have allocated: int, ``"512MiB"``, ``"6GB"``, or ``None``.

        ``None`` means what the device has: on ``"sim"`` its ``sim_capacity``; on CUDA the
        memory this process can use (free memory plus what its allocator holds), less
        ``CUDA_RESERVE_BYTES``, read again after each out-of-memory recovery. The budget
        covers every allocation the device sees (Note [Budget on CUDA]): the manager's
        blocks, copies in flight and, on CUDA, tensors and library workspaces allocated
        beside them. A budget at or below what is allocated outside the manager is refused.
        """
        return self._budget

    @budget.setter
    def budget(self, value) -> None:
        nbytes = parse_size(value, "budget")
        with self._lock:
            backend = self._backend
            if nbytes is not None and not backend.passthrough:
                if self._unresolved:
                    self._resolve_device()
                outside = self._warm_up()  # (what libraries keep allocated, known before it is checked)
                if outside and outside >= nbytes:
                    raise BudgetBelowFloorError(nbytes, outside, str(backend.declared))
            old = (self._budget, self._limit)
            self._budget = nbytes
            self._limit = self._compute_limit(nbytes)
            try:
                self._make_room(0, (), "tensorsManager.budget")
            except OutOfBudgetError:
                self._budget, self._limit = old
                raise
            finally:
                self._pressured = False
                self._refresh_fast()

    @property
    def sim_workspace(self) -> int:
        """Bytes the simulated device (``"sim"``) keeps allocated for each thread that ran a
        kernel on it (and once for autograd's backward), as cuBLAS's workspaces do on CUDA;
        default 0, or ``TORCHTENSORREF_SIM_WORKSPACE``. They count against the budget as
        CUDA's do (Note [Budget on CUDA]), so that a CPU machine shows what a GPU would."""
        return self._sim_workspace

    @sim_workspace.setter
    def sim_workspace(self, value) -> None:
        nbytes = parse_size(value, "sim_workspace", none=False)
        with self._lock:
            self._sim_workspace = nbytes
            if self._backend.simulated:
                self._backend.set_workspace(nbytes)
                self._elsewhere = bool(nbytes)
                self._warmed = set()
                self._read_outside()
                self._refresh_fast()

    def _compute_limit(self, budget: Optional[int]) -> Optional[int]:
        backend = self._backend
        if backend.passthrough:
            return budget
        if budget is not None:
            return budget
        if self._unresolved:
            return None  # known once the device is (at the first tensor)
        capacity = backend.capacity()
        if capacity is None or backend.simulated:
            return capacity
        return max(capacity - CUDA_RESERVE_BYTES, 0)

    @property
    def pinned_limit(self) -> int:
        """Most host bytes kept in pinned memory for asynchronous copies (default: a quarter of RAM)."""
        pinned = self._backend.pinned
        return pinned.limit if pinned is not None else self._pinned_limit

    @pinned_limit.setter
    def pinned_limit(self, value) -> None:
        nbytes = parse_size(value, "pinned_limit", none=False)
        with self._lock:
            self._pinned_limit = nbytes
            if self._backend.pinned is not None:
                self._backend.pinned.limit = nbytes

    @property
    def sim_capacity(self) -> int:
        """Memory of the simulated device (``"sim"``), default 16 GiB: past it, allocations fail."""
        return self._sim_capacity

    @sim_capacity.setter
    def sim_capacity(self, value) -> None:
        nbytes = parse_size(value, "sim_capacity", none=False)
        with self._lock:
            if self._backend.simulated and nbytes < self._device_bytes:
                raise ValueError(f"sim_capacity {nbytes} is below the {self._device_bytes} bytes in use on the device")
            self._sim_capacity = nbytes
            if self._backend.simulated:
                self._backend._capacity = nbytes
                self._limit = self._compute_limit(self._budget)
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

    # -- statistics and tracing -------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since the last ``reset_stats()`` and the current state.

        Keys: ``bytes_to_device``, ``bytes_to_host``, ``peak_device_bytes``,
        ``device_bytes``, ``ops``, ``evictions``, ``fetches``, ``writebacks``,
        ``prefetches``, ``prefetch_hits``, ``prefetch_misses``, ``prefetches_unused``,
        ``prefetches_dropped``, ``host_syncs``, ``budget``, ``device``, ``strategy``,
        ``tensors`` (live TensorRefs), ``tensors_on_device``, ``blocks``,
        ``blocks_on_device``, ``host_bytes`` (host copies of paged blocks, CPU tensors
        not counted), ``peak_host_bytes``, ``host_budget``, ``bytes_from_disk``,
        ``bytes_to_disk``, ``pinned_bytes``, ``outside_bytes`` (device bytes allocated
        outside the manager at the last reading: Note [Budget on CUDA]); on CUDA also
        ``max_memory_allocated`` and ``max_memory_reserved`` (torch.cuda's, since the
        last ``reset_stats()``).
        """
        with self._lock:
            self._drain()
            out = dict(self._counters)
            out["ops"] = self._op_count - self._ops_at_reset
            out["peak_device_bytes"] = self._peak
            out["worst_overshoot_bytes"] = self._overshoot
            out["device_bytes"] = self._device_bytes
            out["budget"] = self._limit
            out["device"] = self.device
            out["strategy"] = self._strategy.name
            out["blocks"] = len(self._blocks)
            out["blocks_on_device"] = len(self._resident)
            out["tensors"] = sum(b.refs for b in self._blocks.values())
            out["tensors_on_device"] = sum(b.refs for b in self._resident.values())
            out["host_bytes"] = self._host_bytes
            out["peak_host_bytes"] = self._peak_host
            out["host_budget"] = self._host_limit
            pinned = self._backend.pinned
            out["pinned_bytes"] = pinned.used if pinned is not None else 0
            out["outside_bytes"] = self._read_outside() if not self._backend.passthrough and not self._unresolved else 0
            if self._backend.name == "cuda" and self._backend.resolved:
                out["max_memory_allocated"] = torch.cuda.max_memory_allocated(self._backend.compute)
                out["max_memory_reserved"] = torch.cuda.max_memory_reserved(self._backend.compute)
            return out

    def reset_stats(self) -> None:
        """Zero the counters; the peak restarts from the bytes in use now."""
        with self._lock:
            self._counters = dict.fromkeys(_STAT_KEYS, 0)
            self._ops_at_reset = self._op_count
            self._peak = self._device_bytes + self._inflight_bytes
            self._peak_host = self._host_bytes
            self._overshoot = 0
            if self._backend.name == "cuda" and self._backend.resolved:
                torch.cuda.reset_peak_memory_stats(self._backend.compute)

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished (``torch.cuda.synchronize`` for the pager)."""
        with self._lock:
            self._retire_inflight(wait=True)
            self._retire_spills(wait=True)
            for block in self._blocks.values():
                if block.host_pending is not None:
                    self._wait_pending_host(block)

    @contextlib.contextmanager
    def recording(self):
        """Record block accesses, moves and resident bytes; yields a :class:`Trace`."""
        trace = Trace(self.device, self._limit)
        with self._lock:
            self._drain()
            trace.initial = {b.id: (b.nbytes, b.dirty) for b in self._resident.values()}
            trace.initial_host = {b.id: (b.nbytes, False) for b in self._hosted.values() if b.host_valid}
            previous, self._trace = self._trace, trace
            observer, streams.copy_observer = streams.copy_observer, trace.hidden
            self._refresh_fast()
        try:
            yield trace
        finally:
            with self._lock:
                trace.stop()
                self._trace = previous
                streams.copy_observer = observer
                self._refresh_fast()

    # -- explicit moves -------------------------------------------------------------------

    def move_to_device(self, ref: TensorRef) -> None:
        """Make ``ref``'s block resident now, evicting others if the budget needs it."""
        with self._lock:
            self._drain()
            block = ref._tr_block
            if self._backend.passthrough or block.dev is not None or block.external or block.host_only:
                return  # (an external block stays on the host: Note [External bytes])
            if self._limit is not None and block.nbytes + self._elsewhere_bytes > self._limit:
                outside = self._read_outside()  # (a reading of the device, not a stale one)
                if block.nbytes + outside > self._limit:
                    raise OutOfBudgetError("toGPU", block.nbytes + outside, self._limit, outside=outside)
            self._make_room(block.nbytes, (block.id,), "toGPU")
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

    @property
    def host_reserve(self) -> int:
        """Host bytes that must stay available; a copy that would eat into them raises
        ``HostMemoryError`` (default: 5% of RAM, at least 256 MiB)."""
        return self._host_watch.reserve

    @host_reserve.setter
    def host_reserve(self, value) -> None:
        nbytes = parse_size(value, "host_reserve", none=False)
        self._host_watch.reserve = nbytes

    @property
    def host_budget(self) -> Optional[int]:
        """Host bytes the manager's host copies may take: int, ``"24GiB"``, or ``None``.

        Past it, host copies go down to disk (Note [Three levels] in ``disk.py``): a clean
        one (its bytes are in a checkpoint file or a spill slot) is dropped, any other is
        written to the spill file in ``offload_dir`` first. ``None`` (the default) means no
        limit of the manager's own: host memory is then limited by what the system has
        (``host_reserve``). CPU tensors of the program (``device="cpu"``) are not counted.
        """
        return self._host_budget

    @host_budget.setter
    def host_budget(self, value) -> None:
        nbytes = parse_size(value, "host_budget")
        if nbytes is not None:
            return_freed_host_memory()
        with self._lock:
            old = (self._host_budget, self._host_limit)
            self._host_budget = self._host_limit = nbytes
            try:
                self._make_host_room(0, (), "tensorsManager.host_budget")
            except MemoryError:
                self._host_budget, self._host_limit = old
                raise
            if nbytes is not None:
                self._backend.release_cached()  # (buffers kept for reuse leave the process)

    @property
    def offload_dir(self) -> Optional[str]:
        """Folder of the spill file for host copies past ``host_budget`` (``None``: a temporary
        folder removed at exit). Checkpoint files are read where they are, never written.
        After a change, new spills go to the new folder; the old file is removed once the
        tensors spilled there are read back, written or freed."""
        return self._offload_dir

    @offload_dir.setter
    def offload_dir(self, value) -> None:
        path = None if value is None else check_offload_dir(value)  # ValueError: nothing changed
        with self._lock:
            if path == self._offload_dir:
                return
            self._retire_spills(wait=True)
            if self._spill_file is not None:
                self._spill_file.retire()  # (read from until its last slot is freed, then removed)
                self._spill_file = None
            self._offload_dir = path

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
            self._device_bytes -= block.nbytes

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
            self._device_bytes -= block.nbytes
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


def _initial_device() -> None:
    """On a machine with CUDA the manager starts on ``"cuda"`` (its index fixed at first use)."""
    if default_device() == "cuda":
        tensorsManager.device = "cuda"


_initial_device()
