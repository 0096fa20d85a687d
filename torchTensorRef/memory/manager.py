"""``tensorsManager``: the pager that moves TensorRef blocks between host and accelerator.

The manager is a facade over the parts it owns, each with its state declared in one place:
``settings`` (device, strategy, budget and the tiers' limits), ``accounting`` (the device
bytes counted against the budget, and their peaks), ``books`` (the live and resident
blocks, their births and deaths), ``device_room`` (readings of the device, room made within
the budget, allocations), ``residency`` (the copies between host and device), ``host_tier``
(host copies within the host budget, the disk below them), ``protocol`` (what happens
around one op), ``adoption`` (TensorRefs over existing bytes), ``statistics`` and
``callbacks``. The strategy only decides; the manager guarantees, around every op, that
the op's blocks are resident when it runs and that the device bytes stay within the
budget. All of it runs under one re-entrant lock (``lock``), because autograd runs
backward on other threads.

Its public methods serve three kinds of callers: programs (the documented API: settings,
``stats()``, explicit moves), strategies (what they read and the moves they ask for:
``docs/custom-strategy.md``) and the layers above (``ops``, ``regions``, ``integrations``:
the op protocol, the lock, the backend, readings of the device).
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable, Collection, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from ..analysis.trace import Trace
from ..core import context
from ..core.blocks import Block
from ..core.tensor_ref import TensorRef
from ..strategies import Strategy
from .accounting import Accounting
from .adoption import Adoption
from .callbacks import Callback, Callbacks, OpCallback
from .devices import Backend, PassthroughBackend, default_device
from .groups import Groups
from .host_tier import HostTier
from .lifetime import Books
from .moves import Moves
from .op_protocol import OpInFlight, OpProtocol
from .residency import Residency
from .room import Fault, Room
from .settings import Setting, Settings
from .statistics import Statistics


class TensorsManager:
    """The global pager; use the ``torchTensorRef.tensorsManager`` instance: set its
    ``device`` ("sim", "cuda", "cuda:1", "cpu": pass-through), ``strategy`` and ``budget``
    ("64MiB"), and the tensors the program makes are TensorRefs it pages."""

    device = Setting()
    torch_device = Setting()
    strategy = Setting()
    budget = Setting()
    sim_workspace = Setting()
    sim_rounding = Setting()
    sim_copy_ops = Setting()
    sim_strict = Setting()
    pinned_limit = Setting()
    sim_capacity = Setting()
    host_reserve = Setting()
    host_budget = Setting()
    offload_dir = Setting()
    check_device = Setting()

    def __init__(self) -> None:
        #: the one lock over the manager's state (re-entrant: autograd's threads run ops too)
        self.lock = threading.RLock()
        #: a child of the process that made this manager (Note [Forked workers])
        self.forked: bool = False
        #: the interpreter is shutting down: TensorRefs dying now release nothing
        self.exiting: bool = False
        #: copies, streams and allocations of the device in use
        self.backend: Backend = PassthroughBackend()
        #: the device managed tensors report (Note [Declared device])
        self.declared: torch.device = self.backend.declared
        #: "cuda" without an index, until the first tensor
        self.unresolved: bool = False
        #: a CUDA graph capture is under way (ops on TensorRefs refuse it)
        self.capturing: bool = False
        #: room had to be made by evicting since the budget or device was set; ``paged``: the same,
        #: until a loop evicted nothing (Note [Regions until the budget pages] in regions/__init__.py)
        self.pressured = self.paged = False
        #: whether ops may take the fast path (Note [Fast path] in ops/dispatch.py)
        self.fast: bool = False
        #: the strategy, when it sees the fast path's ops through its fast_op hooks
        self.fast_watch: Optional[Strategy] = None
        #: ops ever run: the index of the next op
        self.op_count: int = 0
        #: the recording in progress (``recording()``), or ``None``
        self.trace: Optional[Trace] = None
        self._fault_injector: Optional[Callable[[Fault], object]] = None
        self.accounting = Accounting()
        self.settings = Settings(self)
        self.statistics = Statistics(self)
        self.callbacks = Callbacks(self)
        self.books = Books(self)
        self.device_room = Room(self)
        self.residency = Residency(self)
        self.groups = Groups(self)
        self.host_tier = HostTier(self)
        self.protocol = OpProtocol(self)
        self.adoption = Adoption(self)
        self.moves = Moves(self)
        self.settings.strategy_value.attach(self)
        # For strategies, which look blocks up by id many times per op: the dicts' own get,
        # with no Python frame per call (neither dict is ever replaced).
        #: ``block(id)``: the live block with this id, or ``None``
        self.block = self.books.blocks.get
        #: ``resident_block(id)``: the resident block with this id, or ``None``
        self.resident_block = self.books.resident.get
        self.refresh_fast()

    # -- the fast path's switch ------------------------------------------------------------

    def refresh_fast(self) -> None:
        """Recompute ``fast``; every setting it depends on calls this when it changes."""
        strategy = self.settings.strategy_value
        watching = not self.backend.passthrough and strategy.needs_every_op()
        # A strategy that sees every op may still let the ops that move nothing skip the
        # generic path, telling it of them through its fast_op hooks.
        self.fast_watch = strategy if watching and strategy.follows_fast_ops() else None
        self.fast = (not self.callbacks.handles and self.trace is None and self._fault_injector is None
                     and not self.capturing and (not watching or self.fast_watch is not None)
                     # (emulated workspaces are made on the generic path)
                     and not getattr(self.backend, "workspace", 0))

    def hooks_changed(self) -> None:
        """The strategy's ``needs_every_op()`` or ``follows_fast_ops()`` changed its answer."""
        with self.lock:
            self.refresh_fast()

    def set_capturing(self, capturing: bool) -> None:
        """A CUDA graph capture began or ended (ops on TensorRefs refuse to be captured)."""
        with self.lock:
            self.capturing = capturing
            self.refresh_fast()

    def note_pressure(self) -> None:
        """Room had to be made by evicting: strategies that learn from every op start now."""
        self.paged = True  # (set wherever ``pressured`` is, and again after a loop cleared it)
        if not self.pressured:
            self.pressured = True
            self.refresh_fast()

    @property
    def fault_injector(self) -> Optional[Callable[[Fault], object]]:
        """Test hook: a callable(fault) called before every op and every device allocation.

        ``fault`` is a :class:`~torchTensorRef.memory.room.Fault` (``kind`` "op", "fetch", "prefetch",
        "writeback" or "create"); raising ``torch.OutOfMemoryError`` from it simulates the device running
        out of memory there. ``None`` to stop; anything else not callable raises ``TypeError``, changing nothing.
        """
        return self._fault_injector

    @fault_injector.setter
    def fault_injector(self, fn: Optional[Callable[[Fault], object]]) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"fault_injector must be a callable taking a Fault, or None (got: {fn!r}, not callable)")
        with self.lock:
            self._fault_injector = fn
            self.refresh_fast()

    # -- what strategies read (docs/custom-strategy.md) -------------------------------------

    @property
    def limit(self) -> Optional[int]:
        """The budget in force in bytes (the device's capacity when ``budget`` is ``None``)."""
        return self.accounting.limit

    @property
    def op_index(self) -> int:
        """Index of the next op."""
        return self.op_count

    @property
    def device_kind(self) -> str:
        """``"cpu"``, ``"sim"`` or ``"cuda"``."""
        return self.backend.kind

    @property
    def device_bytes(self) -> int:
        """Bytes of resident blocks now."""
        return self.accounting.resident

    @property
    def disk_blocks(self) -> int:
        """Live blocks with a copy on disk (strategies read ahead while there are any)."""
        return self.host_tier.disk_blocks

    @property
    def under_pressure(self) -> bool:
        """Whether room had to be made by evicting since the budget or device was set."""
        return self.pressured

    def is_accelerator(self, device: torch.device) -> bool:
        """Whether ``device`` is the manager's accelerator (``"cuda"`` matches ``"cuda:N"``)."""
        if self.backend.passthrough:
            return False
        if self.unresolved:
            self.resolve_device()
        declared = self.declared
        return device.type == declared.type and (device.index is None or device.index == declared.index)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under the budget without evicting anything."""
        return self.accounting.fits(nbytes)

    def in_use(self) -> int:
        """Device bytes counted against the budget now (``Accounting.in_use``)."""
        return self.accounting.in_use()

    def room(self) -> Optional[int]:
        """Accelerator bytes that still fit under the budget now; ``None`` when unlimited (a
        prefetch must fit in it, less what the op in flight will add)."""
        with self.lock:
            return self.accounting.room()

    def block_bytes(self, nbytes: int) -> int:
        """Device bytes a block of ``nbytes`` takes, as the budget plans it (``Backend.block_bytes``)."""
        return self.backend.block_bytes(nbytes)

    def alloc_bytes(self, nbytes: int) -> int:
        """Room a new block of ``nbytes`` needs (Note [Room for the allocator's slack])."""
        return self.accounting.room_for(self.backend.block_bytes(nbytes), nbytes)

    def prefetch_bytes(self, block: Block) -> int:
        """Room ``prefetch(block, group=True)`` takes: its group's where the group can come in
        with it (Note [Region groups] in ``groups.py``), else ``alloc_bytes(block.nbytes)``."""
        group = block.group
        if group is not None and self.groups.movable(group, None):
            return self.alloc_bytes(group.nbytes)
        return self.alloc_bytes(block.nbytes)

    def resident_blocks(self) -> Collection[Block]:
        """The blocks with a valid accelerator copy (for strategies)."""
        return self.books.resident.values()

    def all_resident(self) -> bool:
        """Whether every live block that can be resident (not host-only) is."""
        return self.books.all_resident()

    def outside_bytes(self) -> int:
        """Device bytes allocated now outside the manager's blocks: library workspaces (made
        first, as the budget setter does), the program's own device tensors. The budget
        covers them (Note [Budget on CUDA]): a budget must be larger. 0 on ``"cpu"``."""
        with self.lock:
            if self.backend.passthrough:
                return 0
            if self.unresolved:
                self.resolve_device()
            return self.device_room.warm_up()

    def fetch(self, block: Block, protect: Collection[int] = ()) -> None:
        """Give ``block`` a valid device copy now (no budget check: room is the caller's)."""
        self.residency.fetch(block, protect)

    def prefetch(self, block: Block, group: bool = False) -> bool:
        """Bring ``block`` (with ``group``: its group where it can) in ahead of use; whether it did."""
        return self.residency.prefetch(block, group)

    def evict(self, block: Block, protect: Optional[Collection[int]] = None) -> bool:
        """Drop ``block``'s device copy (written back if dirty); whether it did. With ``protect``
        (the op's block ids) a victim, its group with it (``Residency.evict_victim``)."""
        if protect is not None:
            return self.residency.evict_victim(block, protect)
        self.residency.evict(block)
        return True

    def sync_host(self, block: Block, record: bool = True) -> bool:
        """Make the host copy valid and readable now (keeping the device copy); whether it copied."""
        return self.residency.sync_host(block, record)

    def host_room(self) -> Optional[int]:
        """Host bytes that still fit under the host budget now; ``None`` when unlimited."""
        return self.host_tier.room()

    def host_copies(self) -> Iterator[Block]:
        """The blocks whose host copy may leave host memory now (for strategies)."""
        return self.host_tier.candidates(())

    def drop_host_copy(self, block: Block) -> bool:
        """Drop ``block``'s host copy if that is free; whether it did (for read-aheads)."""
        return self.host_tier.drop_host_copy(block)

    def read_ahead(self, block: Block) -> bool:
        """Start reading ``block`` from disk into host memory; whether it did."""
        return self.host_tier.read_ahead(block)

    # -- explicit moves (``moves.py``) -------------------------------------------------------

    def move_to_device(self, ref: TensorRef) -> None:
        """Make ``ref``'s block resident now, evicting others if the budget needs it."""
        self.moves.to_device(ref)

    def expose(self, ref: TensorRef) -> torch.Tensor:
        """``ref``'s device copy for code outside torch's ops (``data_ptr``), counted as written."""
        return self.moves.expose(ref)

    def write_view(self, ref: TensorRef) -> torch.Tensor:
        """A plain view of ``ref``'s device copy that its caller writes (the host copy is stale)."""
        return self.moves.write_view(ref)

    def move_to_host(self, ref: TensorRef) -> None:
        """Write ``ref``'s block back if needed and drop its accelerator copy."""
        self.moves.to_host(ref)

    def discard(self, ref: TensorRef) -> None:
        """``ref``'s bytes are rewritten before they are read again: free its device copy unsaved."""
        self.moves.discard(ref)

    def evict_all(self) -> None:
        """Send every unpinned block back to host memory (writing back what changed)."""
        self.moves.evict_all()

    def pin(self, tensor: TensorRef) -> None:
        """Keep ``tensor``'s block resident until ``unpin``; pins nest."""
        self.moves.pin(tensor)

    def unpin(self, tensor: TensorRef) -> None:
        """Undo one ``pin``."""
        self.moves.unpin(tensor)

    # -- statistics and callbacks -----------------------------------------------------------

    def stats(self) -> dict:
        """Counters since the last ``reset_stats()`` and the current state (``Statistics.stats``)."""
        return self.statistics.stats()

    def reset_stats(self) -> None:
        """Zero the counters; the peak restarts from the bytes in use now."""
        self.statistics.reset()

    def synchronize(self) -> None:
        """Wait until every copy in flight has finished (``torch.cuda.synchronize`` for the pager)."""
        self.statistics.synchronize()

    def recording(self, regions: bool = False) -> ContextManager[Trace]:
        """Record block accesses, moves and resident bytes; yields a ``Trace`` (``Statistics.recording``)."""
        return self.statistics.recording(regions)

    def add_callback(self, before: Optional[Callback] = None, after: Optional[Callback] = None) -> OpCallback:
        """Run ``before(op)`` / ``after(op)`` around every managed op; returns a handle (``Callbacks.add``)."""
        return self.callbacks.add(before, after)

    # -- tensors made over existing bytes -------------------------------------------------

    def manage_tensor(self, t: torch.Tensor, requires_grad: Optional[bool] = None, *, host_only: bool = False,
                      shared: bool = True) -> TensorRef:
        """A TensorRef over plain tensor ``t``'s bytes (``Adoption.manage_tensor``)."""
        return self.adoption.manage_tensor(t, requires_grad, host_only=host_only, shared=shared)

    def take_over(self, refs: Iterable[torch.Tensor]) -> int:
        """Blocks of ``refs`` whose plain tensors nobody holds become the manager's own."""
        return self.adoption.take_over(refs)

    def clone_ref(self, ref: TensorRef, memo: dict) -> TensorRef:
        """A deep copy of leaf ``ref`` with its own block (``copy.deepcopy``)."""
        return self.adoption.clone_ref(ref, memo)

    def rebind(self, ref: TensorRef, new: TensorRef) -> None:
        """Point ``ref`` at ``new``'s block (after ``ref.data = new``)."""
        self.adoption.rebind(ref, new)

    def new_device_tensor(self, size: Sequence[int], stride: Optional[Sequence[int]], dtype: Optional[torch.dtype],
                          memory_format: Optional[torch.memory_format] = None) -> TensorRef:
        """A new TensorRef on the device, within the budget (the device's ``empty`` kernels)."""
        return self.residency.new_device_tensor(size, stride, dtype, memory_format)

    def mark_external(self, block: Block, wait: bool = True, writes: bool = True) -> None:
        """One more holder of ``block``'s host bytes outside the manager (Note [External bytes]):
        off the device, its host copy current (waited for: ``wait``), its disk copy stale if it ``writes``."""
        with self.lock:
            self.books.mark_external(block)
            if block.spilling is not None:
                block.spilling.stale = True  # (the host copy stays: its holders view it)
            self.residency.evict(block)
            if wait or not block.host_valid:
                self.residency.sync_host(block)  # (read back from disk where it is there only)
            if writes:
                self.host_tier.disk_stale(block)

    def unmark_external(self, block: Block) -> None:
        """Undo one ``mark_external`` (counters only: it may run from a weakref callback)."""
        self.books.unmark_external(block)

    # -- the interface of the layers above (ops, regions, integrations) --------------------

    def drain(self) -> None:
        """Apply the deaths of TensorRefs queued meanwhile (the caller holds ``lock``)."""
        if self.books.dead:
            self.books.drain()

    def resolve_device(self) -> None:
        """Fix ``"cuda"``'s index at first use (Note [Declared device])."""
        with self.lock:
            if self.unresolved:
                self.backend.resolve()
                self.declared = self.backend.declared
                self.unresolved = False
                self.accounting.limit = self.settings.limit_for(self.settings.budget_value)
                self.refresh_fast()

    def use_backend(self, backend: Backend) -> None:
        """``backend`` is the device from now on (``Settings.set_device``, every block off the old one)."""
        self.backend = backend
        acct = self.accounting
        # (CUDA's and sim's allocators hold plain tensors beside ours: Note [Allocated bytes on sim])
        acct.elsewhere = not backend.passthrough
        acct.elsewhere_bytes = 0  # (a reading of the old device)
        acct.slack = backend.slack()
        acct.warmed = set()
        self.unresolved = backend.name == "cuda" and not backend.resolved
        self.declared = backend.declared
        self.pressured = self.paged = False

    def read_outside(self) -> int:
        """Device bytes allocated outside the manager, asked of the device now (the caller holds ``lock``)."""
        return self.device_room.read_outside()

    def make_room(self, nbytes: int, protect: Collection[int], op_name: str, allocated: int = 0, inside: int = 0):
        """Evict (the strategy's choice) until ``nbytes`` more fit in the budget; ``allocated``
        of them are allocated already, to become blocks (``Room.make``)."""
        self.device_room.make(nbytes, protect, op_name, allocated, inside)

    def record_top(self, top: int) -> None:
        """A step kept ``top`` bytes in use at once (a region's working set and its room): its peak and overshoot."""
        self.accounting.record_top(top)

    def prepare(self, ctx: OpInFlight) -> None:
        """Before op ``ctx``: budget, callbacks, strategy, room, fetches (``OpProtocol.prepare``)."""
        self.protocol.prepare(ctx)

    def call(self, ctx: OpInFlight, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Op ``ctx``'s kernel, with one retry after an out-of-memory error."""
        return self.protocol.call(ctx, func, args, kwargs)

    def finish(self, ctx: OpInFlight) -> None:
        """After op ``ctx``: callbacks, the strategy's ``after_op``, the budget restored, the trace."""
        self.protocol.finish(ctx)

    def op_raised(self, ctx: OpInFlight) -> None:
        """Op ``ctx`` raised after ``prepare``: what it writes counts as written."""
        self.protocol.raised(ctx)

    def mark_written(self, blocks: Iterable[Block]) -> None:
        """An op wrote ``blocks``' device copies: their host (and disk) copies are stale."""
        self.protocol.mark_written(blocks)

    def host_written(self, block: Block) -> None:
        """An op on the host wrote ``block``'s host copy: a device copy is stale now."""
        self.books.host_written(block)

    def adopt_output(self, t: torch.Tensor, ctx: OpInFlight, storage=None) -> TensorRef:
        """A new result ``t`` of op ``ctx`` as a TensorRef on a block of its own (``storage``: its untyped storage)."""
        return self.protocol.adopt_output(t, ctx, storage)

    def result_block(self, t: torch.Tensor, index: int, on_host: bool = False,
                     storage: Optional[torch.UntypedStorage] = None) -> Block:
        """A new block for the storage of ``t``, the result of op ``index``."""
        return self.protocol.result_block(t, index, on_host, storage)

    def recover_from_oom(self, ctx: OpInFlight, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Op ``ctx`` again after an out-of-memory error, what it does not use evicted."""
        return self.protocol.recover_from_oom(ctx, func, args, kwargs)

    def arrived(self, block: Block) -> None:
        """An op is about to read ``block``, brought in by a prefetch: ordered after its copy."""
        self.protocol.arrived(block)

    def resized(self, block: Block, nbytes: int) -> None:
        """``block``'s storage was resized in place (``resize_``) to ``nbytes``."""
        self.protocol.resized(block, nbytes)

    def new_block(self, nbytes: int) -> Block:
        """A new live block of ``nbytes`` (no copy yet)."""
        return self.books.new_block(nbytes)

    def host_storages(self) -> set:
        """Keys of the host storages of the paged blocks (a plain view of one is a host copy)."""
        return {b.host._cdata for b in self.host_tier.hosted.values() if b.host is not None}


tensorsManager = TensorsManager()
context.install_manager(tensorsManager)


atexit.register(setattr, tensorsManager, "exiting", True)  # (TensorRefs dying at exit release nothing)


def _initial_device() -> None:
    """On a machine with CUDA the manager starts on ``"cuda"`` (its index fixed at first use)."""
    if default_device() == "cuda":
        tensorsManager.device = "cuda"


_initial_device()
