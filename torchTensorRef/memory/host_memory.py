"""Watching host memory, so running out of RAM is an error message and not a killed process.

Host copies of evicted blocks (and, on ``"sim"``, the accelerator copies too) are new host
allocations. Before making one, the manager asks this watch whether it fits. Asking the
system costs tens of microseconds, so it is asked again only after a step of allocations
or a short time.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Optional

import psutil

from ..core.sizes import format_size


class HostMemoryError(MemoryError):
    """Host memory is too low for a copy the manager must make."""

    def __init__(self, needed: int, available: int, reserve: int):
        self.needed, self.available, self.reserve = needed, available, reserve
        super().__init__(
            f"host memory is low: a copy of {format_size(needed)} would leave less than the "
            f"reserve of {format_size(reserve)} ({format_size(available)} available); free host "
            f"memory, give the accelerator a larger budget so fewer blocks live on the host, or "
            f"lower tensorsManager.host_reserve"
        )


class HostMemoryWatch:
    """Decides whether ``nbytes`` more host memory may be allocated.

    Args:
        reserve: bytes that must stay available; ``None``: 5% of total RAM, at least 256 MiB.
        check_every_bytes / check_every_seconds: how often the system is asked (it costs
            a read of ``/proc/meminfo``, hundreds of microseconds: training that pages
            activations allocates a GiB a step), besides whenever what is left nears the
            reserve. Between asks our own allocations are counted, our frees are not (the
            estimate errs on the safe side).
    """

    def __init__(self, reserve: Optional[int] = None, check_every_bytes: int = 2**30,
                 check_every_seconds: float = 0.5):
        total = psutil.virtual_memory().total
        self.reserve = max(total // 20, 256 * 2**20) if reserve is None else reserve
        self.check_every_bytes = check_every_bytes
        self.check_every_seconds = check_every_seconds
        self._available = 0
        self._since = 0
        self._at = 0.0
        self._warned = False
        #: called before refusing: frees host memory kept for reuse (set by the manager)
        self.release: Optional[Callable[[], None]] = None
        self._refresh()

    def _refresh(self) -> None:
        self._available = psutil.virtual_memory().available
        self._since = 0
        self._at = time.monotonic()

    def reserve_bytes(self, nbytes: int) -> None:
        """Account ``nbytes`` about to be allocated; raise ``HostMemoryError`` if they do not fit."""
        stale = (self._since + nbytes > self.check_every_bytes
                 or time.monotonic() - self._at > self.check_every_seconds)
        if stale or self._available - self._since - nbytes < self.reserve:
            self._refresh()
        left = self._available - self._since - nbytes
        if left < self.reserve and self.release is not None:
            self.release()  # memory kept for reuse goes back first (the simulated device's cache)
            self._refresh()
            left = self._available - nbytes
        if left < self.reserve:
            raise HostMemoryError(nbytes, self._available - self._since, self.reserve)
        if left < 2 * self.reserve and not self._warned:
            self._warned = True
            warnings.warn(
                f"host memory is getting low: {format_size(left)} available after this copy "
                f"(reserve {format_size(self.reserve)}); torchTensorRef will raise HostMemoryError "
                f"rather than let the process be killed", ResourceWarning, stacklevel=3)
        self._since += nbytes
