"""What the manager does around one op: make room and fetch before it, account for after.

``ops.dispatch`` calls ``prepare`` (budget check, callbacks, the strategy's ``before_op``,
evictions and fetches), ``call`` (the op, with one retry after an out-of-memory error),
``adopt_output`` for each new result and ``finish`` (callbacks, the strategy's
``after_op``, the budget restored, the trace). The caller holds the manager's lock.

An op *on the host* (``OpContext.on_host``: every TensorRef argument is a host-only block,
or it was asked for a CPU result with ``device="cpu"``) runs on host copies with no move,
no budget and no strategy, and its results are host-only blocks, as plain torch would make
CPU tensors.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterable, List, Optional, Protocol

import torch

from ..core import raw
from ..core.blocks import Block
from ..core.errors import DeviceOutOfMemoryError, OutOfBudgetError
from ..core.tensor_ref import TensorRef, make_ref
from .room import is_out_of_memory

_CAPTURE_ERROR = (
    "{op}: CUDA graph capture of ops on TensorRefs is not supported: the manager moves and frees "
    "their device memory between ops, so a captured graph would replay on addresses that are no "
    "longer theirs. Capture plain tensors, or use torch.compile without CUDA graphs "
    '(mode="default" or "max-autotune-no-cudagraphs")')


#: why a refusal inside a backward cannot be retried (Note [Refused before a backward runs]
#: in ``integrations/backward.py``)
_MIDWAY = ("refused inside a backward: the nodes that ran before it freed their saved tensors and accumulated "
           "their gradients, so raise the budget, zero the gradients and run the forward and backward again")
_in_backward = torch._C._current_graph_task_id


def midway() -> str:
    """Why an op refused now cannot simply be retried, where a backward is running; ``""``
    elsewhere (every refusal of an op says it: the protocol's and a split's)."""
    return _MIDWAY if _in_backward() != -1 else ""


class OpInFlight(Protocol):
    """An op in flight as the manager reads it: ``ops.op_context.OpContext`` (a layer above,
    which fills it) and a region's step (``regions.op``) are such ops."""

    index: int
    start: int
    on_host: bool
    #: the op's ``OpSpec`` (``core.op_specs``), or a region's spec
    spec: Any
    blocks: List[Block]
    written: List[Block]
    outputs: List[Block]

    @property
    def name(self) -> str: ...

    def output_estimate(self) -> int: ...


class _Landing(threading.local):
    #: (host storage, its block, dtype, the op's spec) where this thread's next such op's one
    #: new result lands (Note [Pieces] in ``ops/pieces.py``), or None
    range: Optional[tuple] = None


class OpProtocol:
    """What the manager does around one op (``prepare``, ``call``, ``finish`` or ``raised``)."""


    def __init__(self, manager) -> None:
        self.m = manager
        self._landing = _Landing()

    @contextlib.contextmanager
    def landing(self, host: torch.UntypedStorage, parent: Block, dtype: torch.dtype, spec):
        """The one new result of the op of ``spec`` run inside (on the device) gets ``host``,
        a range of ``parent``'s host copy, as its host copy when it is adopted, where it has
        that range's bytes and ``dtype``: its write-back, whenever its strategy evicts it,
        lands there (asynchronously where ``host`` is pinned, ``parent``'s host copy waiting
        for it). The caller checks where the result's bytes went (``Block.host_parent``)."""
        landing = self._landing
        landing.range = (host, parent, dtype, spec)
        try:
            yield
        finally:
            landing.range = None

    def _land(self, block: Block, t: torch.Tensor, spec, landing: tuple) -> None:
        host, parent, dtype, expected = landing
        if spec is not expected:
            return  # (another op run on its way: a plain tensor brought to the device)
        self._landing.range = None  # (one result: a second is not the one expected)
        if (t.dtype == dtype and host.nbytes() == block.nbytes and t.storage_offset() == 0
                and t.is_contiguous()):
            block.set_host(host, False)
            block.host_shared = True  # (never re-homed: the bytes are ``parent``'s)
            block.host_parent = parent

    def prepare(self, ctx: OpInFlight) -> None:
        """Before an op: the budget checked, callbacks, the strategy's ``before_op``, room made
        and the op's blocks fetched. Nothing changes when it refuses."""
        m = self.m
        backend = m.backend
        if ctx.on_host or backend.passthrough:
            if m.callbacks.handles:
                m.callbacks.run("before", ctx)
            ctx.index = m.op_count
            m.op_count += 1
            return
        if m.capturing or backend.capturing():
            raise RuntimeError(_CAPTURE_ERROR.format(op=ctx.name))
        if m.accounting.pending:
            m.device_room.retire()  # copies queued by earlier ops (on "sim": done by now)
        if m.accounting.kept:
            m.accounting.give_back()  # (an op inside this thread's region step: Note [Room kept while a region runs])
        if ctx.spec.restrides and m.books.external:
            self._refuse_growing_external(ctx)
        if m.accounting.limit is not None:
            self._check_fits(ctx)
        if m.callbacks.handles:
            m.callbacks.run("before", ctx)  # may veto: nothing has changed yet
        ctx.index = m.op_count
        m.op_count += 1
        if ctx.spec.restrides:
            for b in ctx.written:
                if b.group is not None:
                    m.groups.detach(b)  # (its storage may grow: a range of a group's buffer cannot)
        m.strategy.before_op(ctx)
        missing = self._bring_in(ctx)
        m.statistics.counters["prefetch_misses"] += missing
        index = ctx.index
        for b in ctx.blocks:
            b.last_use = index
            if b.prefetched or b.dev_pending is not None:
                self.arrived(b)
        m.strategy.before_run(ctx)
        if m.trace is not None:
            ctx.start = time.perf_counter_ns()

    def _check_fits(self, ctx: OpInFlight) -> None:
        """Refuse an op whose blocks and results cannot fit the budget together: checked before
        anything changes, so an op that cannot fit is not counted, the strategy never sees it,
        and nothing is evicted for it."""
        m = self.m
        acct = m.accounting
        limit = acct.limit
        size = m.backend.block_bytes
        need = size(ctx.output_estimate())
        missing = 0
        for b in ctx.blocks:
            if b.dev is None and not b.host_only:
                missing += size(b.nbytes)
        if need + missing + acct.resident + acct.elsewhere_bytes <= limit:
            return  # (it fits as things stand, its resident blocks counted in ``resident``)
        for b in ctx.blocks:
            if b.dev is not None and not b.host_only:
                need += size(b.nbytes)
        need += missing
        if need + acct.elsewhere_bytes > limit:
            outside = m.device_room.read_outside()  # (a reading of the device, not a stale one)
            if need + outside > limit and m.device_room.collect_garbage():
                outside = acct.elsewhere_bytes
            if need + outside > limit:
                raise OutOfBudgetError(ctx.name, need + outside, limit, outside=outside,
                                       detail=midway())

    def _bring_in(self, ctx: OpInFlight) -> int:
        """Room for the op's missing blocks and results, then the blocks fetched; how many were missing."""
        m = self.m
        missing = [b for b in ctx.blocks if b.dev is None and not b.host_only]
        room = 0
        if m.accounting.limit is not None:
            size = m.backend.block_bytes
            room = size(ctx.output_estimate())
            for b in missing:
                room += size(b.nbytes)
        if not missing and not room:
            return 0  # (the common case of a step with nothing to move)
        protect = {b.id for b in ctx.blocks}
        try:
            if room:
                m.device_room.make(room, protect, ctx.name)
            for b in missing:
                m.residency.fetch(b, protect)
        except BaseException as e:
            if m.op_count == ctx.index + 1:
                m.op_count = ctx.index  # the op did not run: it is not counted
            if isinstance(e, DeviceOutOfMemoryError) and e.op != ctx.name:
                # (a fetch knows only that it fetches: the error names the op the user ran)
                raise DeviceOutOfMemoryError(ctx.name, e.needed, e.available) from e.__cause__
            raise
        return len(missing)

    def arrived(self, block: Block) -> None:
        """An op is about to read ``block`` (its ``last_use`` set), brought in by a prefetch:
        count the hit, and its bytes as brought in ahead where an earlier op issued the
        prefetch; order the op after the copy (the compute stream waits for it; the host does
        not)."""
        if block.arrived():
            counters = self.m.statistics.counters
            counters["prefetch_hits"] += 1
            if block.last_use >= block.prefetch_op:
                counters["bytes_prefetched_ahead"] += block.nbytes

    def _refuse_growing_external(self, ctx: OpInFlight) -> None:
        # The op runs on the accelerator copy, which could grow; but the host bytes are shared
        # with numpy or a buffer (Note [External bytes]), which plain torch refuses to resize.
        if any(b.external for b in ctx.written) and ctx.output_estimate() > 0:
            raise RuntimeError(
                f"{ctx.name}: Trying to resize storage that is not resizable: its bytes are "
                f"shared with memory outside torch (a numpy array, a buffer); resize a copy instead")

    def call(self, ctx: OpInFlight, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The op's kernel, with one retry after an out-of-memory error."""
        m = self.m
        if ctx.on_host or m.backend.passthrough:
            return func(*args, **kwargs)
        try:
            self._before_kernel(ctx)
            if m.trace is not None:
                return self._timed_call(ctx, func, args, kwargs)
            return func(*args, **kwargs)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
        return self.recover_from_oom(ctx, func, args, kwargs)

    def _timed_call(self, ctx: OpInFlight, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # The kernel apart from the bookkeeping: on a GPU it runs on the device, not the host.
        start = time.perf_counter_ns()
        out = func(*args, **kwargs)
        self.m.trace.kernel(ctx.index, func, args, kwargs, out, start, time.perf_counter_ns())
        return out

    def _before_kernel(self, ctx: OpInFlight) -> None:
        """Fault injection, and the simulated device's allocation of the op's results."""
        m = self.m
        if m.fault_injector is not None:
            m.device_room.inject("op", ctx.output_estimate(), ctx)
        backend = m.backend
        if backend.simulated:
            backend.note_kernel()
            m.device_room.check_capacity(backend.block_bytes(ctx.output_estimate()))

    def recover_from_oom(self, ctx: OpInFlight, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The op again after an out-of-memory error: another process, a library's workspace
        or the allocator's fragmentation took memory; what this op does not use is evicted."""
        m = self.m
        m.device_room.recover({b.id for b in ctx.blocks})
        try:
            self._before_kernel(ctx)
            return func(*args, **kwargs)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            size = m.backend.block_bytes
            needed = sum(size(b.nbytes) for b in ctx.blocks if not b.host_only) + size(ctx.output_estimate())
            raise DeviceOutOfMemoryError(ctx.name, needed, m.device_room.free_estimate()) from e

    def mark_written(self, blocks: Iterable[Block]) -> None:
        """An op wrote ``blocks``' device copies: their host (and disk) copies are stale."""
        m = self.m
        if not m.backend.passthrough:
            for b in blocks:
                if not b.host_only:
                    b.written_on_device()
                    if b.disk is not None or b.spilling is not None:
                        m.host_tier.disk_stale(b)

    def adopt_output(self, t: torch.Tensor, ctx: OpInFlight,
                     storage: Optional[torch.UntypedStorage] = None) -> TensorRef:
        """A new result ``t`` of the op as a TensorRef on a block of its own (``storage``:
        ``t.untyped_storage()``, when the caller has it already)."""
        if getattr(ctx.spec, "one_tensor", False):  # (results of one op may share a new storage)
            tight = tight_result(t, storage if storage is not None else t.untyped_storage())
            if tight is not t:
                t, storage = tight, None
        m = self.m
        block = self.result_block(t, ctx.index, ctx.on_host, storage)
        if block.dev is not None:
            landing = self._landing.range
            if landing is not None:
                self._land(block, t, ctx.spec, landing)
            if m.trace is not None:
                m.trace.resized(time.perf_counter_ns(), m.accounting.resident)
        ctx.outputs.append(block)
        return make_ref(block, t, m.declared)

    def result_block(self, t: torch.Tensor, index: int, on_host: bool = False,
                     storage: Optional[torch.UntypedStorage] = None) -> Block:
        """A new block for the storage of ``t``, the result of op ``index`` (``storage``:
        ``t.untyped_storage()``, when the caller has it already)."""
        if storage is None:
            storage = t.untyped_storage()
        nbytes = storage.nbytes()
        m = self.m
        books = m.books
        block = books.new_block(nbytes)
        block.from_op = True
        backend = m.backend
        if backend.passthrough:
            books.set_host_only(block, storage)
        # (the backend first: ``t.device.type`` costs a microsecond, and only CUDA needs it)
        elif on_host or backend.name == "cuda" and t.device.type == "cpu":
            block.host_only = True  # a CPU result (Note [Declared device])
            books.host_only += 1
            books.set_host_only(block, storage)
        else:
            # (``Books.made_resident`` inlined: this runs for every op's result)
            block.set_dev(storage)
            books.resident[block.id] = block
            if backend.simulated:
                backend.track(storage)  # (made by a CPU kernel: Note [Allocated bytes on sim])
            planned = backend.block_bytes(nbytes)
            block.dev_bytes = backend.dev_bytes(storage) if m.accounting.slack else planned
            m.accounting.add(block.dev_bytes, planned)
            block.last_use = index
        return block

    def resized(self, block: Block, nbytes: int) -> None:
        """``block``'s storage was resized in place (``resize_``) to ``nbytes``."""
        m = self.m
        m.books.changes += 1
        m.host_tier.disk_stale(block)
        if block.dev is not None:
            if m.backend.simulated:
                m.backend.track(block.dev)  # (resized in place: counted at its new size)
            counted = m.backend.dev_bytes(block.dev)
            m.accounting.add(counted - block.dev_bytes)
            block.dev_bytes = counted
            if block.host is not None:  # the host copy has the old size: drop it
                m.residency.drop_host(block)
            if m.trace is not None:
                m.trace.resized(time.perf_counter_ns(), m.accounting.resident)
        if block.id in m.host_tier.hosted:
            m.host_tier.nbytes += nbytes - block.nbytes
        block.nbytes = nbytes

    def raised(self, ctx: OpInFlight) -> None:
        """The op raised after ``prepare``: what it writes counts as written (a kernel may
        have written part of it before raising, as plain torch keeps), and blocks whose bytes
        are shared outside torch go back to the host, as after any op (Note [External
        bytes]): kept resident, a later write through a numpy array was not seen."""
        if self.m.backend.passthrough or ctx.on_host:
            return
        if ctx.written:
            self.mark_written(ctx.written)
        if self.m.books.external:
            self._send_external_home(ctx)

    def _send_external_home(self, ctx: OpInFlight) -> None:
        """After an op: its blocks whose bytes are shared outside torch leave the device,
        even if pinned (Note [External bytes])."""
        for b in ctx.blocks:
            if b.external and b.dev is not None:
                self.m.residency.evict(b)

    def finish(self, ctx: OpInFlight) -> None:
        """After an op: callbacks, the strategy's ``after_op``, the budget restored, the trace."""
        m = self.m
        if m.callbacks.handles:
            m.callbacks.run("after", ctx)
        if m.backend.passthrough or ctx.on_host:
            return
        m.strategy.after_op(ctx)
        if m.books.external:  # (checked here: this runs for every op)
            self._send_external_home(ctx)
        if not m.accounting.fits(0):
            # The op's results were larger than estimated (its overshoot is recorded): room is
            # made as far as evicting gives it. The op ran and its results are kept: the
            # device's reading still counts the kernel's own references to them (freed when
            # the op returns), which no eviction can give back.
            try:
                m.device_room.make(0, (), ctx.name)
            except OutOfBudgetError:
                pass
        if m.settings.check_device_value:
            self.check_device()
        if m.trace is not None:
            self._record(ctx)

    def check_device(self) -> None:
        """Record how far above the budget the device's own count is now (everything it has
        allocated: the manager's blocks, the buffers copies use, what is outside)."""
        m = self.m
        acct = m.accounting
        if acct.limit is not None:
            over = m.backend.in_use_elsewhere(0) - acct.limit
            if over > acct.device_overshoot:
                acct.device_overshoot = over

    def _record(self, ctx: OpInFlight) -> None:
        trace = self.m.trace
        written = {b.id for b in ctx.written}
        index = ctx.index
        for b in ctx.blocks:
            if not b.host_only:
                trace.accesses.append((index, b.id, b.nbytes, b.id in written))
                if b.group is not None and not b.group.dissolved:
                    trace.grouped(b)
        for b in ctx.outputs:
            if not b.host_only:
                trace.accesses.append((index, b.id, b.nbytes, True))
                trace.created.add(b.id)
        trace.op(index, ctx.name, ctx.start, time.perf_counter_ns())


def tight_result(t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """``t``, a new result on ``storage``, or a copy of it holding only the bytes it views.

    A CPU kernel may hand back a small result viewing the larger buffer it computed in
    (``mse_loss``'s mean is a 0-dim view of the unreduced loss), which a GPU kernel frees:
    kept whole, the block would hold bytes nobody made room for, past the budget.
    """
    nbytes = storage.nbytes()
    if nbytes <= t.numel() * t.element_size():
        return t  # (the common case: one product per result)
    if nbytes <= raw.storage_bytes(t.size(), t.stride(), t.dtype) + t.storage_offset() * t.element_size():
        return t  # (strided over all of it)
    return t.clone()
