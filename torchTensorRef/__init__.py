"""torchTensorRef: run PyTorch models larger than accelerator memory, unmodified.

``import torchTensorRef`` patches torch's tensor-creating functions to return
:class:`TensorRef` proxies; the global :data:`tensorsManager` moves their bytes between
host and accelerator memory around every op, following a pluggable strategy.
"""

from __future__ import annotations

import os
import sys

import torch

from .core import raw  # noqa: F401  (first: keeps the unpatched constructors)
from .integrations.checkpoint import load_checkpoint
from .memory.disk import CheckpointChangedError, DiskError
from .core.errors import BudgetBelowFloorError, DeviceOutOfMemoryError, OpVetoedError, OutOfBudgetError
from .memory.host_memory import HostMemoryError
from .memory.host_tier import HostBudgetError
from .integrations.manage import manage
from .memory.manager import TensorsManager, tensorsManager
from .integrations.patching import is_patched, patch, unpatch
from .integrations.plain import disabled
from .core.proxy_info import ProxyInfo
from .core.tensor_ref import TensorRef
from .integrations.compiled_region import compile_region
from .regions import no_region, region  # (wraps nn.Module.__call__: Note [Module regions])
from . import regions, strategies
from .analysis import gpus, timeline, trace
from .core import sizes
from .integrations import compiler, patching

# Note [Public module paths]: the documentation names these modules at the top level
# (``torchTensorRef.timeline.predict``, ``from torchTensorRef.sizes import parse_size``,
# ``torchTensorRef.compiler.FullGraphError`` ...); their code lives in the layers
# (docs/architecture.md). Registered under their public names too, so that both ``import``
# forms keep working.
PUBLIC_MODULES = {"gpus": gpus, "timeline": timeline, "trace": trace, "sizes": sizes,
                  "compiler": compiler, "patching": patching}
for _name, _module in PUBLIC_MODULES.items():
    sys.modules[f"{__name__}.{_name}"] = _module

__version__ = "0.1.0"

__all__ = [
    "TensorRef", "ProxyInfo", "TensorsManager", "tensorsManager", "manage",
    "patch", "unpatch", "is_patched", "disabled", "strategies", "compile_region", "region", "no_region",
    "OutOfBudgetError", "BudgetBelowFloorError", "DeviceOutOfMemoryError", "OpVetoedError", "HostMemoryError",
    "HostBudgetError", "DiskError", "CheckpointChangedError", "load_checkpoint",
    "configure_from_environment",
]

ENVIRONMENT = {
    "TORCHTENSORREF_SIM_STRICT": "sim_strict",  # (before the device: "sim" is built in that form)
    "TORCHTENSORREF_DEVICE": "device",
    "TORCHTENSORREF_SIM_WORKSPACE": "sim_workspace",  # (before the budget, which covers it)
    "TORCHTENSORREF_SIM_ROUNDING": "sim_rounding",  # (before the budget too)
    "TORCHTENSORREF_SIM_COPY_OPS": "sim_copy_ops",
    "TORCHTENSORREF_STRATEGY": "strategy",
    "TORCHTENSORREF_BUDGET": "budget",
    "TORCHTENSORREF_HOST_BUDGET": "host_budget",
    "TORCHTENSORREF_OFFLOAD_DIR": "offload_dir",
    "TORCHTENSORREF_CHECK_DEVICE": "check_device",
}


def configure_from_environment(environ=None) -> None:
    """Apply ``TORCHTENSORREF_DEVICE``, ``_STRATEGY``, ``_BUDGET``, ``_HOST_BUDGET``,
    ``_OFFLOAD_DIR``, ``_SIM_WORKSPACE``, ``_SIM_ROUNDING``, ``_SIM_COPY_OPS``, ``_SIM_STRICT`` and
    ``_CHECK_DEVICE`` to the manager.

    Raises:
        ValueError: naming the variable and what it accepts.
    """
    environ = os.environ if environ is None else environ
    applied = []  # (setting, its value before): given back if a later variable is refused
    try:
        for var, attr in ENVIRONMENT.items():
            value = environ.get(var)
            if value is None or value == "":
                continue
            previous = getattr(tensorsManager, attr)
            try:
                setattr(tensorsManager, attr, value)
            except ValueError as e:
                raise ValueError(f"environment variable {var}: {e}") from e
            applied.append((attr, previous))
    except BaseException:
        for attr, previous in reversed(applied):
            setattr(tensorsManager, attr, previous)
        raise


# Note [Registering "sim" early]: autograd sizes its per-device worker queues once, at the
# first backward of the process, from the devices that exist then. On a machine with no
# accelerator, a "sim" device registered after a first backward on the CPU would have no
# queue, and every later backward on it would fail inside the engine. So it is registered
# here, before user code can run a backward; with CUDA present the queues exist anyway.
if not torch.cuda.is_available():
    from .memory.sim import device as sim_device

    sim_device.register()

# Note [A failed import]: an import that raises (a bad TORCHTENSORREF_ variable) leaves torch
# as it found it: its functions unwrapped and nn.Module.__call__ its own. A later import runs
# this again with the submodules already loaded, so the module regions are installed here
# too, not only by importing ``regions``. The simulated device stays registered: PyTorch
# cannot take a device's registration back, and it changes nothing for plain tensors.
try:
    patch()
    regions.install()
    configure_from_environment()
except BaseException:
    unpatch()
    regions.uninstall()
    raise
