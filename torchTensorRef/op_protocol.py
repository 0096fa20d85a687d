"""What the manager does around one op: make room and fetch before it, account for after.

``ops.dispatch`` calls ``_prepare`` (budget check, callbacks, the strategy's ``before_op``,
evictions and fetches), ``_call`` (the op, with one retry after an out-of-memory error),
``_adopt_output`` for each new result and ``_finish`` (callbacks, the strategy's
``after_op``, the budget restored, the trace). The caller holds the manager's lock.
"""

from __future__ import annotations

import time

import torch

from .blocks import Block
from .errors import DeviceOutOfMemoryError, OutOfBudgetError
from .tensor_ref import TensorRef, make_ref


class OpProtocol:
    """The ``TensorsManager`` methods of the op protocol (state lives in the manager)."""

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
        nbytes = storage.nbytes()
        block = self._new_block(nbytes)
        block.from_op = True
        if self._backend.passthrough or not self._backend.is_device_output(t):
            self._set_host_only(block, storage)
        else:
            block.set_dev(storage)
            self._resident[block.id] = block
            # (_add_device_bytes inlined: this runs for every op's result)
            total = self._device_bytes = self._device_bytes + nbytes
            if total > self._peak:
                self._peak = total
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
