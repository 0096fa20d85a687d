"""The manager's settings: device, strategy, budget and the limits of each tier.

A mixin of ``TensorsManager`` (``manager.py``): each setter validates its value, raising a
``ValueError`` that names what is accepted, and changes nothing when it refuses.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..core.errors import BudgetBelowFloorError, OutOfBudgetError
from ..core.sizes import parse_size
from ..strategies import Strategy, by_name
from .devices import make_backend
from .disk import check_offload_dir
from .host_tier import return_freed_host_memory

#: device memory left free when ``budget=None`` on CUDA (allocator slack, kernels' workspaces)
CUDA_RESERVE_BYTES = 512 * 2**20
#: the words a flag may be given as (environment variables)
_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
          "off": False, "": False}


def _flag(value, name: str) -> bool:
    """``value`` as a bool: ``True``/``False``, or a word of an environment variable
    (``"1"``, ``"off"`` ...: ``TORCHTENSORREF_SIM_ROUNDING``); ``ValueError`` naming ``name``."""
    if isinstance(value, str) and value.strip().lower() in _FLAGS:
        value = _FLAGS[value.strip().lower()]
    if not isinstance(value, bool):
        raise ValueError(f'{name} must be True or False, or one of "1", "0", "true", '
                         f'"false", "yes", "no", "on", "off" (got: {value!r})')
    return value


class Settings:
    """``device``, ``strategy``, ``budget``, ``sim_workspace``, ``sim_rounding``,
    ``sim_strict``, ``pinned_limit``, ``sim_capacity``, ``host_reserve``, ``host_budget``
    and ``offload_dir``."""


    @property
    def device(self) -> str:
        """``"cpu"`` (pass-through), ``"sim"``, ``"cuda"`` (until its first tensor) or ``"cuda:N"``."""
        b = self._backend
        if b.name == "cuda":
            return str(b.compute) if b.resolved else "cuda"
        return b.name

    @device.setter
    def device(self, value) -> None:
        self._set_device(value, again=False)

    def _set_device(self, value, again: bool) -> None:
        """Make ``value`` the device; ``again``: build its backend anew even if it is the
        current one (a setting of the backend changed)."""
        with self._lock:
            current = self._backend
            if not again and isinstance(value, str) and value.strip().lower() == self.device and current.name != "cuda":
                return  # (no new backend: "sim" would register nothing new, but keep its state)
            backend = make_backend(value, self._sim_capacity, self._pinned_limit, self._sim_workspace,
                                   self._sim_rounding, self._sim_strict)  # ValueError: nothing changed
            self._drain()
            if current.name == backend.name and (
                    (current.compute, current.declared) == (backend.compute, backend.declared)
                    if backend.name != "cuda"  # (sim: its strict and lenient forms differ in declared)
                    else current.target_index() == backend.target_index()):
                return  # the same device ("cuda" again, resolved or not): keep every block where it is
            self._retire_inflight(wait=True)
            for block in list(self._resident.values()):
                self._evict(block)
            self._retire_inflight(wait=True)
            old_declared = self._declared
            self._backend = backend
            # (CUDA's and sim's allocators hold plain tensors beside ours: Note [Allocated bytes on sim])
            self._elsewhere = not backend.passthrough
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
                self._warmed = set()
                self._read_outside()
                self._refresh_fast()

    @property
    def sim_rounding(self) -> bool:
        """Whether the simulated device (``"sim"``) counts each allocation at the size CUDA's
        caching allocator gives it (rounded up to 512 bytes: ``devices.cuda_block_bytes``),
        as the budget does on CUDA; default ``False``. Blocks count so against the budget and
        in ``peak_device_bytes``, so that a CPU machine shows what a GPU would."""
        return self._sim_rounding

    @sim_rounding.setter
    def sim_rounding(self, value) -> None:
        value = _flag(value, "sim_rounding")
        with self._lock:
            if value == self._sim_rounding:
                return
            backend = self._backend
            if backend.simulated:
                # The blocks on the device were counted by the old sizes: they leave first.
                self._drain()
                self._retire_inflight(wait=True)
                for block in list(self._resident.values()):
                    if block.pins:
                        raise ValueError("sim_rounding cannot change while blocks are pinned on the device")
                for block in list(self._resident.values()):
                    self._evict(block)
                self._retire_inflight(wait=True)
                backend.set_rounding(value)
                self._read_outside()
            self._sim_rounding = value

    @property
    def sim_strict(self) -> bool:
        """Whether ``"sim"`` runs in its strict form (default ``True``): TensorRefs report a
        device of their own, ``sim:0``, and every op on it pays its emulation (Note [Strict
        sim]). ``False`` gives its lenient form: TensorRefs report ``cpu`` and the device
        copies are plain CPU tensors, so ops cost what plain CPU torch's do, while copies,
        capacity, budget and paging are unchanged. That form times the manager's own cost
        against plain CPU torch running the same kernels; the strict one checks correctness.
        Changing it while ``device`` is ``"sim"`` brings every block back to the host first."""
        return self._sim_strict

    @sim_strict.setter
    def sim_strict(self, value) -> None:
        value = _flag(value, "sim_strict")
        with self._lock:
            if value == self._sim_strict:
                return
            previous, self._sim_strict = self._sim_strict, value
            if self._backend.simulated:
                try:
                    self._set_device("sim", again=True)
                except Exception:
                    self._sim_strict = previous
                    raise

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

    # -- the host tier's settings -----------------------------------------------------------

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
        tensors spilled there are read back, written or freed. Spill files are removed at a
        normal exit too, in any folder; a folder given here and its other files are left as
        they are (Note [Spill files at exit] in ``disk.py``)."""
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
