"""Storage blocks: the unit torchTensorRef moves, and the coherence of their two copies.

Note [Blocks and coherence]: every TensorRef views one *block*, the bytes of one torch
storage. Views share their base's block, so moving a block moves every view at once and a
write through any view is seen by all of them. A block has up to two copies: ``host``
(in host memory) and ``dev`` (in accelerator memory). The rules:

- at least one copy is valid at any time;
- ``dev is not None`` means the accelerator copy is valid (an invalid one is dropped);
- ``host_valid`` says whether the host copy holds the current bytes. An op writes only the
  accelerator copy, so a write clears ``host_valid``: the block is *dirty*;
- evicting a clean block just drops ``dev``; a dirty one is written back first;
- below the host copy there may be a disk copy (``disk``, Note [Three levels] in
  ``disk.py``): a block whose host copy was dropped has ``host`` ``None`` and ``disk`` set,
  and a clean one is one whose host or disk copy holds the current bytes;
- a copy still in flight (Note [Pending copies] in ``streams.py``) is waited on before its
  destination is read: ``dev_pending`` by the op that reads ``dev`` (on the GPU),
  ``host_pending`` by whoever reads ``host`` (in Python, or a re-fetch on the GPU).

A *host-only* block (``host_only``) is a CPU tensor in the manager's books: made with
``device="cpu"``, by ``.cpu()``, or a CPU result of an accelerator op. It reports ``cpu``,
is never moved to the accelerator and takes no accelerator memory. An *explicit* block
(``explicit``) is one the program put on the accelerator itself: made with the device named,
moved there with ``.to(...)``, or computed from such a block; the others the manager holds
for the accelerator are the program's *default-device* tensors, made without a device (Note
[Default-device tensors] in ``ops/device_checks.py``).

Note [External bytes]: a block is *external* when its host copy is memory that code outside
torchTensorRef reads and writes directly: a numpy array from ``x.numpy()`` (while the array
lives) or given to ``torch.from_numpy`` (for good), or an op's pieces while it runs in them
(Note [Pieces] in ``ops/pieces.py``). Such writes are invisible to the manager, so an
external block is never kept on the accelerator between ops, whatever pins, prefetches or
``toGPU()`` ask (it is written back and dropped after each op, and fetched afresh by the
next one), and its host copy is never re-homed, dropped or spilled to disk; a disk copy it
had is stale from then on, unless its holders only read (an op's pieces of a tensor it does
not write). A block made by ``TensorRef(t)`` from a plain tensor shares ``t``'s bytes
(``host_shared``): its host copy is never re-homed either, and it is written back
synchronously, since ``t``'s holder may read it at any time.

Note [Residence]: a block's state is one value, ``Block.residence`` (a ``Residence``),
read off its copies; the manager changes it only through the block's transitions, each
named for what happened:

- ``HOST_ONLY``: a CPU tensor of the program; no transition leaves it;
- ``ON_HOST`` (or ``ON_DISK`` where only a disk copy holds the bytes): no device copy.
  ``set_dev`` (a fetch) makes it ``CLEAN``; ``arriving`` (a prefetch) makes it ``ARRIVING``;
- ``ARRIVING``: a device copy is being copied in; ``arrived`` (the op that reads it is
  ordered after the copy) makes it ``CLEAN``;
- ``CLEAN``: a device copy and a copy below with the same bytes; ``written_on_device`` (an
  op wrote the device copy) makes it ``DIRTY``;
- ``DIRTY``: the device copy holds writes no copy below has; ``written_back`` makes it
  ``CLEAN``;
- any resident state: ``left_device`` (an eviction, the copy dropped) gives ``ON_HOST``;
  ``rewritten_on_host`` (an op on the host wrote the host copy) drops the device copy.

Orthogonal to the residence, and never changed by it: pins (``pins``: kept resident),
holders outside torch (``external``), a shared host copy (``host_shared``), an address
handed out (``exposed``).

Strategies never touch these fields: they ask the manager to ``fetch`` or ``evict``.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Callable, Optional

import torch

_ids = itertools.count(1)


def id_mark() -> int:
    """An id below the ids of every block made from now on (blocks are numbered as made)."""
    return next(_ids)


class Residence(enum.Enum):
    """Where a block's current bytes are (Note [Residence])."""

    HOST_ONLY = "host only"
    ON_HOST = "on host"
    ON_DISK = "on disk"
    ARRIVING = "arriving"
    CLEAN = "resident, clean"
    DIRTY = "resident, dirty"


class Block:
    """The bytes behind one torch storage, with a host and an accelerator copy."""

    __slots__ = (
        "id", "nbytes", "host", "host_valid", "dev", "gen", "dev_key",
        "refs", "pins", "alive", "last_use", "on_ref_dead", "from_op", "prefetched", "prefetch_op",
        "dev_pending", "host_pending", "external", "host_only", "host_shared", "exposed",
        "disk", "spilling", "views", "fetches", "explicit", "dev_bytes", "host_parent", "group", "__weakref__",
    )

    def __init__(self, nbytes: int, on_ref_dead: Optional[Callable[..., None]] = None) -> None:
        self.id: int = next(_ids)
        self.nbytes: int = nbytes
        self.host: Optional[torch.UntypedStorage] = None
        self.host_valid: bool = False
        self.dev: Optional[torch.UntypedStorage] = None
        #: the device bytes ``dev`` is counted at against the budget: what the device's
        #: allocator counts for it (Note [Allocator slack] in ``memory/sim/caching.py``)
        self.dev_bytes: int = 0
        #: bumped whenever ``dev`` or ``host`` changes, so TensorRefs know a cached view is stale
        self.gen: int = 0
        #: identity of the storage ops run on, to recognise op outputs that alias it
        self.dev_key: int = 0
        #: live TensorRefs viewing this block
        self.refs: int = 0
        #: explicit pins (``tensorsManager.pin``): a pinned block is never evicted
        self.pins: int = 0
        self.alive: bool = True
        #: index of the last op that touched the block (recency, for strategies)
        self.last_use: int = -1
        #: weakref callback of the TensorRefs viewing the block (the manager's bookkeeping)
        self.on_ref_dead = on_ref_dead
        #: created as an op's result (an activation, a gradient), not by a creation function
        self.from_op: bool = False
        #: brought in by a prefetch and not used since (for the hit/miss statistics)
        self.prefetched: bool = False
        #: the first op index whose use of it counts as brought in ahead (the op after the one
        #: during which its last prefetch was issued)
        self.prefetch_op: int = -1
        # (``dev_pending``, ``host_pending``, ``disk`` and ``spilling`` are typed ``Any``: their
        # types are memory/'s, above the core: ``Pending`` of ``streams.py``, ``FileRange`` of
        # ``disk.py``, the spill of ``host_tier.py``)
        #: copy into ``dev`` still running (a prefetch); ops wait on it
        self.dev_pending: Any = None
        #: copy into ``host`` still running (a write-back); readers of ``host`` wait on it
        self.host_pending: Any = None
        #: holders of its host bytes outside the manager (Note [External bytes])
        self.external: int = 0
        #: a CPU tensor: never moved to the accelerator, reports ``cpu``
        self.host_only: bool = False
        #: the host copy is a plain tensor's storage that its holder still uses
        self.host_shared: bool = False
        #: the block whose host copy this one's host copy is a range of (a piece of a tensor
        #: split for an op: Note [Pieces] in ``ops/pieces.py``): its write-backs may run
        #: asynchronously, the host copy they land in waiting for them (``host_pending``)
        self.host_parent: Optional[Block] = None
        #: its device address was handed out (``data_ptr``): kept resident until room is needed
        self.exposed: bool = False
        #: a file range holding the current bytes (Note [Three levels] in ``disk.py``), or None
        self.disk: Any = None
        #: the write of its host copy to the spill file, while it runs
        self.spilling: Any = None
        #: weakrefs of the TensorRefs viewing it, whose cached views are dropped with a copy
        self.views: list = []
        #: times brought to the device on demand: from the second, it is paged, and its host
        #: copy is worth pinning
        self.fetches: int = 0
        #: the program put it on the accelerator (a device named), or it was computed from such
        #: a block: mixed with CPU tensors, its ops fail as on CUDA
        self.explicit: bool = False
        #: the group whose buffers hold its copies, with those of the other tensors its region
        #: owns (Note [Region groups] in ``memory/groups.py``; typed ``Any``: memory/'s type)
        self.group: Any = None

    @property
    def residence(self) -> Residence:
        """Where its current bytes are (Note [Residence])."""
        if self.host_only:
            return Residence.HOST_ONLY
        if self.dev is None:
            return Residence.ON_DISK if not self.host_valid and self.disk is not None else Residence.ON_HOST
        if self.dev_pending is not None:
            return Residence.ARRIVING
        return Residence.DIRTY if self.dirty else Residence.CLEAN

    # -- transitions (Note [Residence]) ------------------------------------------------------

    def arriving(self, storage: torch.UntypedStorage, pending: Any) -> None:
        """A prefetch is copying the bytes into ``storage`` (``pending``: the copy)."""
        self.set_dev(storage)
        self.dev_pending = pending
        self.prefetched = True

    def arrived(self) -> bool:
        """An op is about to read it: ordered after its copy in; whether it was brought in by
        a prefetch and not used since."""
        hit = self.prefetched
        self.prefetched = False
        self.wait_arrival()
        return hit

    def wait_arrival(self) -> None:
        """Whatever reads the device copy next is ordered after its copy in (the compute
        stream waits for it, the host does not)."""
        if self.dev_pending is not None:
            self.dev_pending.wait_compute()
            self.dev_pending = None

    def written_on_device(self) -> None:
        """An op wrote the device copy: the copies below are stale."""
        self.host_valid = False

    def written_back(self) -> None:
        """The host copy holds the device copy's bytes (or will once its copy ends)."""
        self.host_valid = True

    def left_device(self) -> None:
        """The device copy goes (the caller drops it): a prefetch not waited on is forgotten."""
        self.dev_pending = None
        self.exposed = False
        self.prefetched = False

    def rewritten_on_host(self) -> None:
        """An op on the host wrote the host copy: it holds the bytes, a device copy is stale."""
        self.host_valid = True
        self.dev_pending = None

    @property
    def resident(self) -> bool:
        """Whether the accelerator copy is valid."""
        return self.dev is not None

    @property
    def clean(self) -> bool:
        """Whether a copy below the accelerator (host or disk) holds the current bytes."""
        return self.host_valid or self.disk is not None

    @property
    def dirty(self) -> bool:
        """Whether the accelerator copy holds writes no copy below it has."""
        return self.dev is not None and not self.host_valid and self.disk is None

    def set_dev(self, storage: Optional[torch.UntypedStorage]) -> None:
        if self.dev is not None:
            self.drop_views()
        self.dev = storage
        self.gen += 1
        self.dev_key = storage._cdata if storage is not None else 0

    def set_host(self, storage: Optional[torch.UntypedStorage], valid: bool) -> None:
        if self.host is not None and storage is not self.host:
            self.drop_views()
        self.host = storage
        self.host_valid = valid
        self.gen += 1

    def host_storage(self) -> torch.UntypedStorage:
        """``host``, where the caller knows there is a host copy (its bytes are not on disk
        only, Note [Three levels] in ``disk.py``)."""
        host = self.host
        assert host is not None, f"{self!r} has no host copy"
        return host

    #: ``forget_views(views)``: the TensorRefs behind ``views`` (weakrefs) forget the views
    #: they cached; returns the weakrefs still alive (installed by ``core.tensor_ref``, which
    #: owns those caches)
    forget_views = staticmethod(lambda views: views)

    def drop_views(self) -> None:
        """A copy goes: the views TensorRefs cached of it go too, or they would keep its
        memory allocated (device memory past the budget, host memory past the host budget)."""
        self.views = Block.forget_views(self.views)

    def __repr__(self) -> str:
        where = "host only" if self.host_only else ("device" if self.dev is not None else "host")
        state = " dirty" if self.dirty else ""
        return f"Block(id={self.id}, nbytes={self.nbytes}, on {where}{state}, refs={self.refs})"
