"""The manager's settings: device, strategy, budget and the limits of each tier.

A part of ``TensorsManager`` (``manager.py``), whose public properties are these settings
(``Setting``): each setter validates its value, raising a ``ValueError`` that names what is
accepted, and changes nothing when it refuses.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Union

import torch

from ..core.errors import BudgetBelowFloorError, OutOfBudgetError
from ..core.sizes import Size, parse_size
from ..strategies import DEFAULT, Strategy, by_name
from .devices import SIM_CAPACITY_BYTES, CudaBackend, make_backend
from .disk import check_offload_dir
from .host_tier import return_freed_host_memory
from .pinned import default_limit
from .streams import SimStreams

#: device memory left free when ``budget=None`` on CUDA (allocator slack, kernels' workspaces)
CUDA_RESERVE_BYTES = 512 * 2**20
#: the words a flag may be given as (environment variables)
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
          "off": False, "": False}


def _flag(value: object, name: str) -> bool:
    """``value`` as a bool: ``True``/``False``, or a word of an environment variable
    (``"1"``, ``"off"`` ...: ``TORCHTENSORREF_SIM_ROUNDING``); ``ValueError`` naming ``name``."""
    if isinstance(value, str) and value.strip().lower() in _FLAGS:
        value = _FLAGS[value.strip().lower()]
    if not isinstance(value, bool):
        raise ValueError(f'{name} must be True or False, or one of "1", "0", "true", '
                         f'"false", "yes", "no", "on", "off" (got: {value!r})')
    return value


class Setting:
    """A setting of the manager, read and written through its ``Settings`` part: a property
    of ``Settings`` of the same name, whose docstring documents it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = getattr(Settings, name).__doc__

    def __get__(self, manager, owner: Optional[type] = None):
        if manager is None:
            return self
        return getattr(manager.settings, self.name)

    def __set__(self, manager, value: object) -> None:
        setattr(manager.settings, self.name, value)


class Settings:
    """``device``, ``strategy``, ``budget``, ``sim_workspace``, ``sim_rounding``,
    ``sim_strict``, ``pinned_limit``, ``sim_capacity``, ``host_reserve``, ``host_budget``,
    ``offload_dir`` and ``check_device``: each setter validates its value and changes nothing when it refuses.

    Attributes:
        budget: the budget as set (``None``: the device's capacity; ``Accounting.limit`` is
            the one in force).
    """


    def __init__(self, manager) -> None:
        self.m = manager
        self.budget_value: Optional[int] = None
        self.strategy_value: Strategy = by_name(DEFAULT)
        self.sim_capacity_value: int = SIM_CAPACITY_BYTES
        self.sim_workspace_value: int = 0
        self.sim_rounding_value: bool = False
        self.sim_copy_ops_value: int = 0
        self.sim_strict_value: bool = True
        self.check_device_value: bool = False
        self.pinned_limit_value: int = default_limit()

    @property
    def device(self) -> str:
        """``"cpu"`` (pass-through), ``"sim"``, ``"cuda"`` (until its first tensor) or ``"cuda:N"``."""
        b = self.m.backend
        if b.name == "cuda":
            return str(b.compute) if b.resolved else "cuda"
        return b.name

    @device.setter
    def device(self, value: Union[str, torch.device]) -> None:
        self.set_device(value, again=False)

    def set_device(self, value: Union[str, torch.device], again: bool) -> None:
        """Make ``value`` the device; ``again``: build its backend anew even if it is the
        current one (a setting of the backend changed)."""
        m = self.m
        with m.lock:
            current = m.backend
            if not again and isinstance(value, str) and value.strip().lower() == self.device and current.name != "cuda":
                return  # (no new backend: "sim" would register nothing new, but keep its state)
            backend = make_backend(value, self.sim_capacity_value, self.pinned_limit_value, self.sim_workspace_value,
                                   self.sim_rounding_value, self.sim_strict_value)  # ValueError: nothing changed
            m.drain()
            if current.name == backend.name and (
                    current.target_index() == backend.target_index()
                    if isinstance(current, CudaBackend) and isinstance(backend, CudaBackend)
                    # (sim: its strict and lenient forms differ in declared)
                    else (current.compute, current.declared) == (backend.compute, backend.declared)):
                return  # the same device ("cuda" again, resolved or not): keep every block where it is
            self._evict_everything()
            old_declared = m.declared
            m.use_backend(backend)
            if isinstance(backend.streams, SimStreams):
                backend.streams.clock = lambda: m.op_count
                backend.streams.lag = self.sim_copy_ops_value
            self._warn_if_alive(value, old_declared)
            for block in m.books.blocks.values():
                shares_host = (backend.passthrough or block.host_only) and block.host is not None
                block.dev_key = block.host._cdata if shares_host else 0
            m.accounting.limit = self.limit_for(self.budget_value)
            m.host_tier.count_host_copies()
            self.strategy_value.device_changed()
            m.refresh_fast()

    def _evict_everything(self) -> None:
        """Every block leaves the device, every copy in flight ended."""
        m = self.m
        m.device_room.retire(wait=True)
        for block in list(m.books.resident.values()):
            m.residency.evict(block)
        m.device_room.retire(wait=True)

    def _warn_if_alive(self, value: Union[str, torch.device], old_declared: torch.device) -> None:
        m = self.m
        live = [b for b in m.books.blocks.values() if not b.host_only]
        if live and old_declared != m.declared and not m.unresolved:
            warnings.warn(
                f"tensorsManager.device changed to {value!r} while {len(live)} managed storages "
                f"are alive: existing TensorRefs keep reporting device {old_declared}; set the "
                f"device before creating tensors", stacklevel=5)

    @property
    def torch_device(self) -> torch.device:
        """The ``torch.device`` managed tensors report and their ops run for: ``cuda:N``
        (``"cuda"`` is resolved here if it was not yet), ``sim:0``, or ``cpu``."""
        m = self.m
        if m.unresolved:
            m.resolve_device()
        return m.declared

    @property
    def strategy(self) -> Strategy:
        """The paging policy: ``"genoa"``, ``"flow"`` or a :class:`~torchTensorRef.strategies.Strategy`."""
        return self.strategy_value

    @strategy.setter
    def strategy(self, value: Union[str, Strategy]) -> None:
        if isinstance(value, Strategy):
            new = value
        elif isinstance(value, str):
            new = by_name(value)
        elif isinstance(value, type) and issubclass(value, Strategy):
            raise ValueError(f"strategy must be an instance, not the class {value.__name__}: use {value.__name__}()")
        else:
            new = by_name(value)  # raises the ValueError naming what is accepted
        with self.m.lock:
            self.strategy_value.detach()
            self.strategy_value = new
            new.attach(self.m)
            self.m.refresh_fast()

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
        return self.budget_value

    @budget.setter
    def budget(self, value: Size) -> None:
        nbytes = parse_size(value, "budget")
        m = self.m
        with m.lock:
            backend = m.backend
            if nbytes is not None and not backend.passthrough:
                if m.unresolved:
                    m.resolve_device()
                outside = m.device_room.warm_up()  # (what libraries keep allocated, known before it is checked)
                if outside and outside >= nbytes and m.device_room.collect_garbage(always=True):
                    outside = m.device_room.read_outside()  # (a program's dropped model in a cycle)
                if outside and outside >= nbytes:
                    raise BudgetBelowFloorError(nbytes, outside, str(backend.declared))
            old = (self.budget_value, m.accounting.limit, m.paged)
            self.budget_value = nbytes
            m.accounting.limit = self.limit_for(nbytes)
            m.pressured = m.paged = False  # (room made below sets both: the budget does not fit what is resident)
            m.device_room.collect_again()
            try:
                m.device_room.make(0, (), "tensorsManager.budget")
            except OutOfBudgetError:
                self.budget_value, m.accounting.limit, m.paged = old
                raise
            finally:
                m.pressured = False
                m.refresh_fast()

    @property
    def sim_workspace(self) -> int:
        """Bytes the simulated device (``"sim"``) keeps allocated for each thread that ran a
        kernel on it (and once for autograd's backward), as cuBLAS's workspaces do on CUDA;
        default 0, or ``TORCHTENSORREF_SIM_WORKSPACE``. They count against the budget as
        CUDA's do (Note [Budget on CUDA]), so that a CPU machine shows what a GPU would."""
        return self.sim_workspace_value

    @sim_workspace.setter
    def sim_workspace(self, value: Size) -> None:
        nbytes = parse_size(value, "sim_workspace", none=False)
        m = self.m
        with m.lock:
            self.sim_workspace_value = nbytes
            if m.backend.simulated:
                m.backend.set_workspace(nbytes)
                m.accounting.warmed = set()
                m.device_room.read_outside()
                m.refresh_fast()

    @property
    def sim_rounding(self) -> bool:
        """Whether the simulated device (``"sim"``) counts each allocation at the size CUDA's
        caching allocator gives it (rounded up to 512 bytes: ``devices.cuda_block_bytes``,
        and placed in its blocks as it places them: Note [Allocator slack]), as the budget
        does on CUDA; default ``False``. Blocks count so against the budget and
        in ``peak_device_bytes``, so that a CPU machine shows what a GPU would."""
        return self.sim_rounding_value

    @sim_rounding.setter
    def sim_rounding(self, value: Union[bool, str]) -> None:
        value = _flag(value, "sim_rounding")
        m = self.m
        with m.lock:
            if value == self.sim_rounding_value:
                return
            backend = m.backend
            if backend.simulated:
                # The blocks on the device were counted by the old sizes: they leave first.
                m.drain()
                m.device_room.retire(wait=True)
                if any(block.pins for block in m.books.resident.values()):
                    raise ValueError("sim_rounding cannot change while blocks are pinned on the device")
                self._evict_everything()
                backend.set_rounding(value)
                m.accounting.slack = backend.slack()
                m.device_room.read_outside()
            self.sim_rounding_value = value

    @property
    def sim_copy_ops(self) -> int:
        """How many of the manager's ops a copy on a side stream of ``"sim"`` (a prefetch, a
        write-back) lasts unless waited on; default 0, or ``TORCHTENSORREF_SIM_COPY_OPS``.
        With 0 a copy ends when room is next made, so none is ever in flight when the manager
        plans; above 0, as on a GPU, copies outlast the ops that issued them (Note [Copies that
        outlast their op] in ``streams.py``)."""
        return self.sim_copy_ops_value

    @sim_copy_ops.setter
    def sim_copy_ops(self, value: Union[int, str]) -> None:
        try:
            ops = int(value.strip()) if isinstance(value, str) else value
        except ValueError:
            ops = None
        if not isinstance(ops, int) or isinstance(ops, bool) or ops < 0:
            raise ValueError(f"sim_copy_ops must be a count of ops, 0 or more (got: {value!r})")
        m = self.m
        with m.lock:
            self.sim_copy_ops_value = ops
            if isinstance(m.backend.streams, SimStreams):
                m.backend.streams.lag = ops  # (copies in flight keep the end they were given)

    @property
    def sim_strict(self) -> bool:
        """Whether ``"sim"`` runs in its strict form (default ``True``): TensorRefs report a
        device of their own, ``sim:0``, and every op on it pays its emulation (Note [Strict
        sim]). ``False`` gives its lenient form: TensorRefs report ``cpu`` and the device
        copies are plain CPU tensors, so ops cost what plain CPU torch's do, while copies,
        capacity, budget and paging are unchanged. That form times the manager's own cost
        against plain CPU torch running the same kernels; the strict one checks correctness.
        Changing it while ``device`` is ``"sim"`` brings every block back to the host first."""
        return self.sim_strict_value

    @sim_strict.setter
    def sim_strict(self, value: Union[bool, str]) -> None:
        value = _flag(value, "sim_strict")
        with self.m.lock:
            if value == self.sim_strict_value:
                return
            previous, self.sim_strict_value = self.sim_strict_value, value
            if self.m.backend.simulated:
                try:
                    self.set_device("sim", again=True)
                except Exception:
                    self.sim_strict_value = previous
                    raise

    @property
    def check_device(self) -> bool:
        """Whether the device is asked, after every op, how much it has allocated (default
        ``False``: a reading costs more than an op): the most it held above the budget at an
        op's end is ``stats()["device_overshoot_bytes"]``. A check of the budget's promise in
        the device's own figures (``torch.cuda.memory_allocated`` on CUDA), for tests and
        debugging (``TORCHTENSORREF_CHECK_DEVICE``)."""
        return self.check_device_value

    @check_device.setter
    def check_device(self, value: Union[bool, str]) -> None:
        value = _flag(value, "check_device")
        with self.m.lock:
            self.check_device_value = value

    def limit_for(self, budget: Optional[int]) -> Optional[int]:
        """The limit in force for ``budget`` on the current device."""
        m = self.m
        backend = m.backend
        if backend.passthrough or budget is not None:
            return budget
        if m.unresolved:
            return None  # known once the device is (at the first tensor)
        capacity = backend.capacity()
        if capacity is None or backend.simulated:
            return capacity
        return max(capacity - CUDA_RESERVE_BYTES, 0)

    @property
    def pinned_limit(self) -> int:
        """Most host bytes kept in pinned memory for asynchronous copies (default: a quarter of RAM)."""
        pinned = self.m.backend.pinned
        return pinned.limit if pinned is not None else self.pinned_limit_value

    @pinned_limit.setter
    def pinned_limit(self, value: Size) -> None:
        nbytes = parse_size(value, "pinned_limit", none=False)
        with self.m.lock:
            self.pinned_limit_value = nbytes
            if self.m.backend.pinned is not None:
                self.m.backend.pinned.limit = nbytes

    @property
    def sim_capacity(self) -> int:
        """Memory of the simulated device (``"sim"``), default 16 GiB: past it, allocations fail."""
        return self.sim_capacity_value

    @sim_capacity.setter
    def sim_capacity(self, value: Size) -> None:
        nbytes = parse_size(value, "sim_capacity", none=False)
        m = self.m
        with m.lock:
            if m.backend.simulated:
                # (what the device holds: the manager's blocks and what lies outside it, plain
                # device tensors and workspaces, as an allocation past the capacity would fail)
                in_use = m.accounting.resident + m.backend.in_use_elsewhere(m.accounting.resident)
                if nbytes < in_use:
                    raise ValueError(f"sim_capacity {nbytes} is below the {in_use} bytes in use on the device")
            self.sim_capacity_value = nbytes
            if m.backend.simulated:
                m.backend.set_capacity(nbytes)
                m.accounting.limit = self.limit_for(self.budget_value)
                m.refresh_fast()

    # -- the host tier's settings -----------------------------------------------------------

    @property
    def host_reserve(self) -> int:
        """Host bytes that must stay available; a copy that would eat into them raises
        ``HostMemoryError`` (default: 5% of RAM, at least 256 MiB)."""
        return self.m.host_tier.watch.reserve

    @host_reserve.setter
    def host_reserve(self, value: Size) -> None:
        nbytes = parse_size(value, "host_reserve", none=False)
        self.m.host_tier.watch.reserve = nbytes

    @property
    def host_budget(self) -> Optional[int]:
        """Host bytes the manager's host copies may take: int, ``"24GiB"``, or ``None``.

        Past it, host copies go down to disk (Note [Three levels] in ``disk.py``): a clean
        one (its bytes are in a checkpoint file or a spill slot) is dropped, any other is
        written to the spill file in ``offload_dir`` first. ``None`` (the default) means no
        limit of the manager's own: host memory is then limited by what the system has
        (``host_reserve``). CPU tensors of the program (``device="cpu"``) are not counted.
        """
        return self.m.host_tier.budget

    @host_budget.setter
    def host_budget(self, value: Size) -> None:
        nbytes = parse_size(value, "host_budget")
        if nbytes is not None:
            return_freed_host_memory()
        m = self.m
        tier = m.host_tier
        with m.lock:
            old = (tier.budget, tier.limit)
            tier.budget = tier.limit = nbytes
            try:
                tier.make_room(0, (), "tensorsManager.host_budget")
            except MemoryError:
                tier.budget, tier.limit = old
                raise
            if nbytes is not None:
                m.backend.release_cached()  # (buffers kept for reuse leave the process)

    @property
    def offload_dir(self) -> Optional[str]:
        """Folder of the spill file for host copies past ``host_budget`` (``None``: a temporary
        folder removed at exit). Checkpoint files are read where they are, never written.
        After a change, new spills go to the new folder; the old file is removed once the
        tensors spilled there are read back, written or freed. Spill files are removed at a
        normal exit too, in any folder; a folder given here and its other files are left as
        they are (Note [Spill files at exit] in ``disk.py``)."""
        return self.m.host_tier.offload_dir

    @offload_dir.setter
    def offload_dir(self, value: Union[str, os.PathLike, None]) -> None:
        path = None if value is None else check_offload_dir(value)  # ValueError: nothing changed
        with self.m.lock:
            self.m.host_tier.set_offload_dir(path)
