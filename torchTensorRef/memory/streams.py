"""Streams and events: asynchronous copies on CUDA, and their stand-in on ``"sim"``.

Note [Pending copies]: a copy that overlaps compute (a prefetch, a write-back) runs on a
stream of its own and hands back a :class:`Pending`. Its destination must not be read
before the pending copy is waited on: ``wait_compute()`` orders the compute stream after it
(no host wait) and ``wait_host()`` blocks the host until it is done. On CUDA these are
events. On ``"sim"`` the copy does not happen until it is waited on, and until then its
destination holds a poison pattern (every byte 0xFF: NaN in every floating-point type), so
a missing wait shows as wrong values in tests instead of a race that passes by luck.

The device buffer a pending copy reads or writes is kept from reuse until the copy ends
(``record_stream`` on CUDA; the stand-in holds a reference).

Note [Copies that outlast their op]: on a GPU a copy on a side stream ends when the copy
engine gets to it, often after the op that issued it and the next ones have been queued,
so the manager plans rooms, readings and evictions while copies are in flight. The
stand-in ends a copy when it is waited on or, by default, when room is next made
(``SimPending.retire``): on "sim" nothing is in flight when the manager plans, and what
depends on copies in flight never ran on a CPU. With ``tensorsManager.sim_copy_ops = n``
(``TORCHTENSORREF_SIM_COPY_OPS``) a copy lasts ``n`` of the manager's ops unless waited on
before: its destination stays poison, its buffers stay held, and asking whether it ended
says no until then, as CUDA's events do.
"""

from __future__ import annotations

import time
from typing import Callable, Literal, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

#: what an unfinished simulated copy leaves in its destination
POISON = 0xFF

#: called with (start_ns, end_ns) of each deferred simulated copy while a trace is recorded:
#: the host ran it, but on a GPU a copy engine would (``Trace.hidden``)
copy_observer: Optional[Callable[[int, int], None]] = None


class Pending:
    """A copy in flight (Note [Pending copies])."""

    __slots__ = ()
    #: whether the host can wait for it to end (a copy can; a view the program holds cannot)
    waitable = True
    #: whether its destination is a view PyTorch's pinned allocator does not see used (``Copies``)
    untracked = False

    def wait_compute(self) -> None:
        """Make later work on the compute stream wait for the copy (the host does not wait)."""
        raise NotImplementedError

    def wait_host(self) -> None:
        """Block the host until the copy is done."""
        raise NotImplementedError

    def done(self) -> bool:
        """Whether the copy is known to have finished (asking does not wait)."""
        raise NotImplementedError

    def retire(self) -> bool:
        """Whether the copy finished, for accounting; the stand-in finishes it now."""
        return self.done()

    def buffer_users(self) -> int:
        """Tensors viewing its device buffer that the copy keeps until it ends (the stand-in's
        one view on "sim"; none on CUDA, where ``record_stream`` keeps the buffer)."""
        return 0


class Copies(Pending):
    """Copies into ranges of one host copy, waited on together: the write-backs of the pieces
    of a tensor split for an op (Note [Pieces] in ``ops/pieces.py``). They read other blocks'
    device buffers, never the device buffer of the block whose ``host_pending`` this is, and
    their destinations are views the pinned allocator does not follow (``untracked``)."""

    __slots__ = ("parts",)
    #: its copies write views of a host buffer that PyTorch's pinned allocator does not see
    #: used: the buffer is not freed before they end (``Residency.forget_host``)
    untracked = True

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def wait_compute(self) -> None:
        for part in self.parts:
            part.wait_compute()

    def wait_host(self) -> None:
        for part in self.parts:
            part.wait_host()
        self.parts = []

    def done(self) -> bool:
        self.parts = [part for part in self.parts if not part.done()]
        return not self.parts


def joined(earlier: Optional[Pending], copy: Pending) -> Copies:
    """``earlier`` (a host copy's pending copies, or ``None``) and ``copy``, waited on together
    (those that ended are let go: a tensor updated in pieces at every step keeps a few)."""
    if isinstance(earlier, Copies):
        earlier.done()
        earlier.parts.append(copy)
        return earlier
    if earlier is None or earlier.done():
        return Copies([copy])
    return Copies([earlier, copy])


class CudaPending(Pending):
    __slots__ = ("event", "device")

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait_compute(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait_host(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


class SimPending(Pending):
    """A simulated copy: done when first waited on, or once its op clock reaches ``due``
    (Note [Copies that outlast their op]); its destination is poison until then."""

    __slots__ = ("dst", "src", "clock", "due")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, clock: Optional[Callable[[], int]] = None,
                 due: int = 0):
        self.dst: Optional[torch.Tensor] = dst
        self.src: Optional[torch.Tensor] = src
        self.clock = clock
        self.due = due

    def _finish(self) -> None:
        dst, src = self.dst, self.src
        if dst is not None and src is not None:  # (set together, cleared together)
            observer = copy_observer
            start = time.perf_counter_ns() if observer is not None else 0
            if torch._C._len_torch_dispatch_stack():
                # (a copy engine's work, done whenever it is asked about: a dispatch mode the
                # program entered since, FSDP2's FakeTensorMode, must not see it)
                with _disable_current_modes():
                    dst.copy_(src)
            else:
                dst.copy_(src)
            self.dst = self.src = None
            if observer is not None:
                observer(start, time.perf_counter_ns())

    wait_compute = _finish
    wait_host = _finish

    def done(self) -> bool:
        clock = self.clock
        if clock is not None and self.src is not None and clock() >= self.due:
            self._finish()  # (the emulated copy engine got to it)
        return self.src is None

    def retire(self) -> bool:
        if self.clock is not None:
            return self.done()
        # By the time memory is needed again, a real copy engine would have finished.
        self._finish()
        return True

    def buffer_users(self) -> int:
        return 0 if self.src is None else 1


class CudaStreams:
    """The streams torchTensorRef copies on, on one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side: Optional[torch.cuda.Stream] = None
        self._copy: Optional[torch.cuda.Stream] = None

    def _stream(self, which: str) -> torch.cuda.Stream:
        stream = getattr(self, which)
        if stream is None:
            stream = torch.cuda.Stream(self.device)
            setattr(self, which, stream)
        return stream

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, prefetch: bool) -> Pending:
        """Copy ``src`` into ``dst`` on a side stream (prefetches in, write-backs out).

        The side stream first waits for the compute stream, so the copy sees every write
        queued before it; the device buffer is recorded on the side stream, so the
        allocator does not reuse it before the copy ends.
        """
        stream = self._stream("_side" if prefetch else "_copy")
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)
        return CudaPending(event, self.device)

    def copy_ordered(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy on the compute stream: later ops on it see the bytes with no wait.

        Asynchronous for the host when the host side is pinned; from or to pageable
        memory CUDA makes the host wait.
        """
        dst.copy_(src, non_blocking=True)


class SimStreams:
    """The stand-in: side-stream copies are deferred until waited on (Note [Pending copies]).

    ``poison=False`` (the form of "sim" that times the manager, ``sim_strict = False``):
    destinations are left as they are until the copy runs. Filling them is a pass over the
    bytes that no GPU makes, a visible share of a paged step's time on a CPU.
    """

    def __init__(self, poison: bool = True, lag: int = 0):
        self.poison = poison
        #: the manager's ops a copy lasts unless waited on (Note [Copies that outlast their op]);
        #: 0: until the next room is made
        self.lag = lag
        #: the manager's op count (set with the device)
        self.clock: Optional[Callable[[], int]] = None

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, prefetch: bool) -> Pending:
        if self.poison:
            dst.fill_(POISON)
        clock = self.clock if self.lag else None
        return SimPending(dst, src, clock, clock() + self.lag if clock is not None else 0)

    def copy_ordered(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The compute stream runs in order: the next op comes after this copy.
        dst.copy_(src)


# -- the simulated device's streams, for PyTorch code ------------------------------------------
#
# Note [Streams of sim for PyTorch code]: code written for an accelerator (FSDP2 around each
# all-gather and reduce-scatter) orders its work with streams and events. Every op on
# "sim" runs on the host when it is called, in program order, and is complete when it
# returns, so each stream is already ordered after every other: waits and synchronizations
# have nothing to wait for. (The manager's own copies are deferred, and waited on, by
# ``SimPending``, which such code never sees.)


class SimStream:
    """A stream of ``sim:0`` (``torch.sim.Stream``): work on it is done when it is issued."""

    def __init__(self, device: object = None, priority: int = 0) -> None:
        self.priority = priority

    @property
    def device(self) -> torch.device:
        return torch.device("sim", 0)  # (the name exists once the device is registered)

    def wait_stream(self, stream: SimStream) -> None:
        pass

    def wait_event(self, event: SimEvent) -> None:
        pass

    def record_event(self, event: Optional[SimEvent] = None) -> SimEvent:
        event = SimEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimStream) and other is self

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<torch.sim.Stream device=sim:0 at {id(self):#x}>"


class SimEvent:
    """An event of ``sim:0`` (``torch.sim.Event``): complete as soon as it is recorded."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream: Optional[SimStream] = None) -> None:
        pass

    def wait(self, stream: Optional[SimStream] = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


DEFAULT_STREAM = SimStream()


class SimStreamContext:
    """``with torch.sim.stream(s):`` work issued inside runs on ``s``, that is, at once."""

    def __init__(self, stream: Optional[SimStream]) -> None:
        self.stream = stream

    def __enter__(self) -> Optional[SimStream]:
        return self.stream

    def __exit__(self, *exc: object) -> Literal[False]:
        return False
