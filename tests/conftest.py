"""Shared fixtures: every test starts from a known manager and patch state."""

from __future__ import annotations

import os

import pytest
import torch

import torchTensorRef
from torchTensorRef import tensorsManager


# transformers 5.25 and later kernelize every model from_pretrained loads (hub kernels, the
# ``kernels`` package), and that library refuses devices it does not know, "sim" among them,
# as it refuses plain tensors there: the suite loads models without it, on every device.
os.environ.setdefault("USE_HUB_KERNELS", "NO")

# The device every test starts on. CI has no GPU and uses "sim"; on a GPU machine
# TORCHTENSORREF_TEST_DEVICE=cuda runs the same suite against the real accelerator.
TEST_DEVICE = os.environ.get("TORCHTENSORREF_TEST_DEVICE", "sim")
# TORCHTENSORREF_SIM_ROUNDING=1 (or 0): "sim" counts allocations at the sizes CUDA's allocator
# gives them (tensorsManager.sim_rounding), as the budget does on a GPU; the package applies
# it when imported (configure_from_environment).


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not keywords: a param id "cuda" is one
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_manager():
    """Patched torch, the test device (``"sim"`` unless set), Genoa, no budget, zeroed stats; restored afterwards."""
    torchTensorRef.patch()
    tm = tensorsManager
    tm.budget = None
    tm.host_budget = None
    tm.sim_strict = True
    tm.device = TEST_DEVICE
    tm.backend.nested_results = False  # (a nested tensor an earlier test made: Note [Plain CPU tensors])
    tm.strategy = "genoa"
    tm.fault_injector = None
    tm.evict_all()  # blocks an earlier test left resident must not change this one's figures
    tm.synchronize()  # (and their write-backs still in flight)
    tm.reset_stats()
    yield tm
    # The budget is a promise: no test may have gone above it (a test that shows an
    # overshoot on purpose resets the stats).
    stats = tm.stats()
    overshoot = stats["worst_overshoot_bytes"]
    device_overshoot = stats["device_overshoot_bytes"]  # (read where check_device is on)
    leaked = list(tm.callbacks.handles)
    for handle in leaked:
        handle.remove()  # (a callback left behind would turn the fast path off for later tests)
    tm.fault_injector = None
    tm.budget = None
    tm.host_budget = None
    tm.strategy = "genoa"
    tm.sim_strict = True
    tm.device = TEST_DEVICE
    tm.synchronize()  # (spills still being written)
    tm.offload_dir = None
    torchTensorRef.patch()
    assert overshoot == 0, f"{overshoot} bytes in use above the budget"
    assert device_overshoot == 0, f"the device held {device_overshoot} bytes above the budget at an op's end"
    assert not leaked, f"the test left {len(leaked)} callback(s) added: remove them with handle.remove()"


@pytest.fixture
def regions_on():
    """Module regions on, under a budget too (whatever the defaults), restored afterwards."""
    from torchTensorRef import regions

    previous = regions.enabled, regions.under_budget
    regions.enabled, regions.under_budget = True, True
    yield
    regions.enabled, regions.under_budget = previous


@pytest.fixture
def plain():
    """Context manager for computing the plain-torch reference inside a test (on the test device)."""
    from paired import plain_torch

    return plain_torch
