"""Shared fixtures: every test starts from a known manager and patch state."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import tensorsManager


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
    """Patched torch, ``"sim"`` device, Genoa, no budget, zeroed stats; restored afterwards."""
    torchTensorRef.patch()
    tm = tensorsManager
    tm.budget = None
    tm.device = "sim"
    tm.strategy = "genoa"
    tm.fault_injector = None
    tm.evict_all()  # blocks an earlier test left resident must not change this one's figures
    tm.reset_stats()
    yield tm
    tm.fault_injector = None
    tm.budget = None
    tm.strategy = "genoa"
    tm.device = "sim"
    torchTensorRef.patch()


@pytest.fixture
def plain():
    """Context manager for computing the plain-torch reference inside a test."""
    return torchTensorRef.disabled
