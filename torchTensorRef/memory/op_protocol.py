"""What the manager does around one op: make room and fetch before it, account for after.

``ops.dispatch`` calls ``_prepare`` (budget check, callbacks, the strategy's ``before_op``,
evictions and fetches), ``_call`` (the op, with one retry after an out-of-memory error),
``_adopt_output`` for each new result and ``_finish`` (callbacks, the strategy's
``after_op``, the budget restored, the trace). The caller holds the manager's lock.

An op *on the host* (``OpContext.on_host``: every TensorRef argument is a host-only block,
or it was asked for a CPU result with ``device="cpu"``) runs on host copies with no move,
no budget and no strategy, and its results are host-only blocks, as plain torch would make
CPU tensors.
"""

from __future__ import annotations

import time

import torch

from ..core import raw
from ..core.blocks import Block
from ..core.errors import DeviceOutOfMemoryError, OutOfBudgetError
from ..core.tensor_ref import TensorRef, make_ref
from .residency import is_out_of_memory

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


class OpProtocol:
    """The ``TensorsManager`` methods of the op protocol (state lives in the manager)."""

    def _prepare(self, ctx) -> None:
        backend = self._backend
        if ctx.on_host or backend.passthrough:
            if self._callbacks:
                self._run_callbacks("before", ctx)
            ctx.index = self._op_count
            self._op_count += 1
            return
        if self._capturing or backend.capturing():
            raise RuntimeError(_CAPTURE_ERROR.format(op=ctx.name))
        if self._inflight:
            self._retire_inflight()  # write-backs queued by earlier ops (on "sim": done by now)
        blocks = ctx.blocks
        limit = self._limit
        if ctx.spec.restrides and self._external:
            self._refuse_growing_external(ctx)
        if limit is not None:
            # Checked before anything changes: an op that cannot fit is not counted, the
            # strategy never sees it, and nothing is evicted for it.
            size = backend.block_bytes
            need = size(ctx.output_estimate())
            for b in blocks:
                if not b.host_only:
                    need += size(b.nbytes)
            if need + self._elsewhere_bytes > limit:
                outside = self._read_outside()  # (a reading of the device, not a stale one)
                if need + outside > limit:
                    raise OutOfBudgetError(ctx.name, need + outside, limit, outside=outside,
                                           detail=_MIDWAY if _in_backward() != -1 else "")
        if self._callbacks:
            self._run_callbacks("before", ctx)  # may veto: nothing has changed yet
        ctx.index = self._op_count
        self._op_count += 1
        self._strategy.before_op(ctx)
        missing = [b for b in blocks if b.dev is None and not b.host_only]
        protect = {b.id for b in blocks}
        try:
            if self._limit is not None:
                size = backend.block_bytes
                room = size(ctx.output_estimate())
                for b in missing:
                    room += size(b.nbytes)
                if room:
                    self._make_room(room, protect, ctx.name)
            for b in missing:
                self.fetch(b, protect)
        except BaseException as e:
            if self._op_count == ctx.index + 1:
                self._op_count = ctx.index  # the op did not run: it is not counted
            if isinstance(e, DeviceOutOfMemoryError) and e.op != ctx.name:
                # (a fetch knows only that it fetches: the error names the op the user ran)
                raise DeviceOutOfMemoryError(ctx.name, e.needed, e.available) from e.__cause__
            raise
        c = self._counters
        c["prefetch_misses"] += len(missing)
        index = ctx.index
        for b in blocks:
            b.last_use = index
            if b.prefetched or b.dev_pending is not None:
                self._arrived(b)
        self._strategy.before_run(ctx)
        if self._trace is not None:
            ctx._start = time.perf_counter_ns()  # type: ignore[attr-defined]

    def _arrived(self, block: Block) -> None:
        """An op is about to read ``block``, brought in by a prefetch: count the hit and
        order the op after the copy (the compute stream waits for it; the host does not)."""
        if block.prefetched:
            block.prefetched = False
            self._counters["prefetch_hits"] += 1
        if block.dev_pending is not None:
            block.dev_pending.wait_compute()
            block.dev_pending = None

    def _refuse_growing_external(self, ctx) -> None:
        # The op runs on the accelerator copy, which could grow; but the host bytes are shared
        # with numpy or a buffer (Note [External bytes]), which plain torch refuses to resize.
        if any(b.external for b in ctx.written) and ctx.output_estimate() > 0:
            raise RuntimeError(
                f"{ctx.name}: Trying to resize storage that is not resizable: its bytes are "
                f"shared with memory outside torch (a numpy array, a buffer); resize a copy instead")

    def _call(self, ctx, func, args, kwargs):
        if ctx.on_host or self._backend.passthrough:
            return func(*args, **kwargs)
        try:
            self._before_kernel(ctx)
            if self._trace is not None:
                return self._timed_call(ctx, func, args, kwargs)
            return func(*args, **kwargs)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
        return self._recover_from_oom(ctx, func, args, kwargs)

    def _timed_call(self, ctx, func, args, kwargs):
        # The kernel apart from the bookkeeping: on a GPU it runs on the device, not the host.
        start = time.perf_counter_ns()
        out = func(*args, **kwargs)
        self._trace.kernel(ctx.index, func, args, kwargs, out, start, time.perf_counter_ns())
        return out

    def _before_kernel(self, ctx) -> None:
        """Fault injection, and the simulated device's allocation of the op's results."""
        if self._fault_injector is not None:
            self._inject("op", ctx.output_estimate(), ctx)
        backend = self._backend
        if backend.simulated:
            backend.note_kernel()
            self._check_capacity(backend.block_bytes(ctx.output_estimate()))

    def _recover_from_oom(self, ctx, func, args, kwargs):
        # Another process, a library's workspace or the allocator's fragmentation took
        # memory: evict what this op does not use and try once more.
        self._recover_memory({b.id for b in ctx.blocks})
        try:
            self._before_kernel(ctx)
            return func(*args, **kwargs)
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            size = self._backend.block_bytes
            needed = sum(size(b.nbytes) for b in ctx.blocks if not b.host_only) + size(ctx.output_estimate())
            raise DeviceOutOfMemoryError(ctx.name, needed, self._free_estimate()) from e

    def _mark_written(self, blocks) -> None:
        if not self._backend.passthrough:
            for b in blocks:
                if not b.host_only:
                    b.host_valid = False
                    if b.disk is not None or b.spilling is not None:
                        self._disk_stale(b)

    def _adopt_output(self, t: torch.Tensor, ctx) -> TensorRef:
        if getattr(ctx.spec, "one_tensor", False):  # (results of one op may share a new storage)
            t = tight_result(t, t.untyped_storage())
        block = self._result_block(t, ctx.index, ctx.on_host)
        if block.dev is not None and self._trace is not None:
            self._trace.resized(time.perf_counter_ns(), self._device_bytes)
        ctx.outputs.append(block)
        return make_ref(block, t, self._declared)

    def _result_block(self, t: torch.Tensor, index: int, on_host: bool = False, storage=None) -> Block:
        """A new block for the storage of ``t``, the result of op ``index`` (``storage``:
        ``t.untyped_storage()``, when the caller has it already)."""
        if storage is None:
            storage = t.untyped_storage()
        nbytes = storage.nbytes()
        block = self._new_block(nbytes)
        block.from_op = True
        backend = self._backend
        if backend.passthrough:
            self._set_host_only(block, storage)
        # (the backend first: ``t.device.type`` costs a microsecond, and only CUDA needs it)
        elif on_host or backend.name == "cuda" and t.device.type == "cpu":
            block.host_only = True  # a CPU result (Note [Declared device])
            self._host_only_blocks += 1
            self._set_host_only(block, storage)
        else:
            block.set_dev(storage)
            self._resident[block.id] = block
            if backend.simulated:
                backend.track(storage)  # (made by a CPU kernel: Note [Allocated bytes on sim])
            # (_add_device_bytes inlined: this runs for every op's result)
            total = self._device_bytes = self._device_bytes + backend.block_bytes(nbytes)
            if total + self._inflight_bytes > self._peak:
                self._peak = total + self._inflight_bytes
            limit = self._limit
            if limit is not None and total + self._inflight_bytes + self._elsewhere_bytes - limit > self._overshoot:
                self._overshoot = total + self._inflight_bytes + self._elsewhere_bytes - limit
            block.last_use = index
        return block

    def _resized(self, block: Block, nbytes: int) -> None:
        """``block``'s storage was resized in place (``resize_``) to ``nbytes``."""
        self._disk_stale(block)
        if block.dev is not None:
            size = self._backend.block_bytes
            self._add_device_bytes(size(nbytes) - size(block.nbytes))
            if self._backend.simulated:
                self._backend.track(block.dev)  # (resized in place: counted at its new size)
            if block.host is not None:  # the host copy has the old size: drop it
                self._drop_host(block)
            if self._trace is not None:
                self._trace.resized(time.perf_counter_ns(), self._device_bytes)
        if block.id in self._hosted:
            self._host_bytes += nbytes - block.nbytes
        block.nbytes = nbytes

    def _op_raised(self, ctx) -> None:
        """The op raised after ``_prepare``: what it writes counts as written (a kernel may
        have written part of it before raising, as plain torch keeps), and blocks whose bytes
        are shared outside torch go back to the host, as after any op (Note [External
        bytes]): kept resident, a later write through a numpy array was not seen."""
        if self._backend.passthrough or ctx.on_host:
            return
        if ctx.written:
            self._mark_written(ctx.written)
        if self._external:
            self._send_external_home(ctx)

    def _send_external_home(self, ctx) -> None:
        """After an op: its blocks whose bytes are shared outside torch leave the device,
        even if pinned (Note [External bytes])."""
        for b in ctx.blocks:
            if b.external and b.dev is not None:
                self.evict(b)

    def _finish(self, ctx) -> None:
        if self._callbacks:
            self._run_callbacks("after", ctx)
        if self._backend.passthrough or ctx.on_host:
            return
        self._strategy.after_op(ctx)
        if self._external:  # (checked here: this runs for every op)
            self._send_external_home(ctx)
        if self._limit is not None and self._device_bytes + self._inflight_bytes + self._elsewhere_bytes > self._limit:
            # The op's results were larger than estimated (its overshoot is recorded): room is
            # made as far as evicting gives it. The op ran and its results are kept: the
            # device's reading still counts the kernel's own references to them (freed when
            # the op returns), which no eviction can give back.
            try:
                self._make_room(0, (), ctx.name)
            except OutOfBudgetError:
                pass
        trace = self._trace
        if trace is not None:
            written = {b.id for b in ctx.written}
            index = ctx.index
            for b in ctx.blocks:
                if not b.host_only:
                    trace.accesses.append((index, b.id, b.nbytes, b.id in written))
            for b in ctx.outputs:
                if not b.host_only:
                    trace.accesses.append((index, b.id, b.nbytes, True))
                    trace.created.add(b.id)
            trace.op(index, ctx.name, getattr(ctx, "_start", 0), time.perf_counter_ns())


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
