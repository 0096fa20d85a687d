"""Running low on host memory is a clear error, raised before anything changes."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from paired import values
from torchTensorRef import HostMemoryError, tensorsManager as tm
from torchTensorRef.memory.host_memory import HostMemoryWatch


def test_watch_raises_when_a_copy_would_eat_into_the_reserve():
    watch = HostMemoryWatch(reserve=0)
    watch.reserve_bytes(1024)  # fits
    watch.reserve = 1 << 62
    with pytest.raises(HostMemoryError, match="host memory is low"):
        watch.reserve_bytes(1024)


def test_eviction_without_host_room_fails_and_keeps_the_data(fresh_manager):
    tm.strategy = "flow"  # keeps results on the device
    x = torch.ones(256)
    y = x * 2  # a new block, only on the (simulated) device, no host copy yet
    assert y.proxyInfo.on_device and y.proxyInfo.dirty
    before = tm.host_reserve
    tm.host_reserve = 1 << 62
    try:
        with pytest.raises(HostMemoryError):
            y.toCPU()
        assert y.proxyInfo.on_device and y.proxyInfo.dirty  # nothing was lost or moved
    finally:
        tm.host_reserve = before
    with torchTensorRef.disabled():
        expected = torch.full((256,), 2.0)  # (was a TensorRef: compared with y's plain CPU bytes)
    assert torch.equal(values(y.toCPU()).cpu(), expected)


def test_host_reserve_rejects_bad_values(fresh_manager):
    before = tm.host_reserve
    for bad in (None, -1, "lots"):
        with pytest.raises(ValueError, match="host_reserve"):
            tm.host_reserve = bad
        assert tm.host_reserve == before
