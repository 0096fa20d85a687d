"""The copy protocol under failure and in steady state: out-of-memory in fetches and
prefetches, prefetch accounting, and no host waits once a loop is paged."""

from __future__ import annotations

import pytest
import torch

from torchTensorRef import DeviceOutOfMemoryError, tensorsManager as tm
from torchTensorRef.strategies import Flow

KIB = 1024


class FailFirst:
    """A fault injector: raise ``error`` at the first ``times`` allocations of ``kind``."""

    def __init__(self, kind, error, times=1):
        self.kind, self.error, self.left = kind, error, times

    def __call__(self, fault):
        if fault.kind == self.kind and self.left > 0:
            self.left -= 1
            raise self.error


def _oom():
    return torch.OutOfMemoryError("injected: out of memory")


@pytest.mark.parametrize("error", [_oom(), RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
                                   RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")],
                         ids=["OutOfMemoryError", "cuBLAS", "cuDNN"])
def test_an_out_of_memory_in_a_fetch_keeps_the_ops_other_inputs(error):
    # Defects: a failed demand fetch evicted the op's other inputs, and the op then ran on
    # host views; allocation failures that are RuntimeErrors were not recovered at all.
    tm.strategy = "flow"  # (with no budget it keeps what it fetched: the test can see it)
    a, b, other = torch.full((256,), 2.0), torch.full((256,), 3.0), torch.ones(256)
    a.toGPU()
    other.toGPU()
    b.toCPU()
    tm.fault_injector = FailFirst("fetch", error)
    out = a * b  # fetching b fails once: memory is recovered from `other`, never from `a`
    tm.fault_injector = None
    assert a.proxyInfo.on_device and b.proxyInfo.on_device and not other.proxyInfo.on_device
    assert out.device == tm._declared and out.tolist() == [6.0] * 256


def test_a_fetch_that_fails_twice_raises_and_leaves_the_op_uncounted():
    a, b = torch.full((256,), 2.0), torch.full((256,), 3.0)
    b.toCPU()
    before = tm.op_index
    tm.fault_injector = FailFirst("fetch", _oom(), times=2)
    with pytest.raises(DeviceOutOfMemoryError, match="fetch"):
        a * b
    tm.fault_injector = None
    assert tm.op_index == before
    assert (a * b).tolist() == [6.0] * 256  # nothing lost, and the next op runs


def _read_cycle(rounds, tensors):
    """Read each tensor in turn (clean blocks: Flow may evict them for a prefetch)."""
    return [[t.sum() for t in tensors] for _ in range(rounds)][-1]


def test_an_out_of_memory_in_a_prefetch_drops_the_prefetch():
    # Defect: a failed prefetch recovered memory like a fetch, evicting the running op's inputs.
    tm.strategy = Flow(lookahead=2, prefetch_evicts=True)
    tensors = [torch.full((256,), float(i)) for i in range(4)]  # 1 KiB each
    tm.budget = 3 * KIB
    _read_cycle(12, tensors)
    assert tm.stats()["prefetches"] > 0
    tm.fault_injector = FailFirst("prefetch", _oom(), times=1000)
    tm.reset_stats()
    inputs_away = []
    watch = tm.add_callback(after=lambda op: inputs_away.extend(b for b in op.blocks if b.dev is None))
    sums = _read_cycle(2, tensors)
    watch.remove()
    tm.fault_injector = None
    stats = tm.stats()
    assert stats["prefetches_dropped"] > 0 and stats["prefetches"] == 0
    assert not inputs_away  # every op ran on its device copies
    assert [s.item() for s in sums] == [256.0 * i for i in range(4)]


def test_a_prefetch_evicted_unused_counts_as_one_miss_not_also_a_hit():
    # Defect: it counted as both a hit and a miss.
    tm.strategy = Flow(lookahead=0)
    a, b = torch.ones(256), torch.ones(256)
    tm.budget = 2 * KIB
    a.toCPU()
    assert tm.prefetch(a._tr_block)
    tm.evict(a._tr_block)  # never used
    tm.reset_stats()
    a.add_(1)
    stats = tm.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (0, 1)
    assert a.tolist() == [2.0] * 256 and b.tolist() == [1.0] * 256


def test_results_sharing_one_new_storage_get_one_block():
    # Defect: each of several results viewing one fresh storage got a block of all of it.
    tm.strategy = "flow"  # (keeps results on the device: their bytes are counted there)
    x = torch.arange(12.0)
    before = tm.device_bytes
    parts = torch.ops.aten.split.Tensor(x * 2, 4)  # three views of one new 48-byte storage
    assert len({p._tr_block.id for p in parts}) == 1
    assert tm.device_bytes - before == 48
    assert [p.tolist() for p in parts] == [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0], [16.0, 18.0, 20.0, 22.0]]


def _model():
    torch.manual_seed(0)
    # many small layers: a quarter of the weights still holds any single op
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(8)])


def _weights(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _train_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _decode_step(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("work", ["train", "decode"])
def test_flow_makes_no_host_waits_in_steady_state(work, fraction):
    # Demand fetches from pinned memory and write-backs are asynchronous: once the loop is
    # paged, a step makes the host wait for the device nowhere (no .item() in the loop).
    tm.strategy = "flow"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(4, 32)
    step = (lambda: _train_step(model, opt, x)) if work == "train" else (lambda: _decode_step(model, x))
    tm.budget = int(fraction * _weights(model))
    for _ in range(3):
        step()
    tm.reset_stats()
    for _ in range(3):
        step()
    stats = tm.stats()
    assert stats["host_syncs"] == 0, stats
    assert stats["peak_device_bytes"] <= tm.budget


def test_genoa_waits_at_most_once_per_op():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 32)
    tm.budget = 16 * KIB
    _train_step(model, opt, x)
    tm.reset_stats()
    before = tm.op_index
    _train_step(model, opt, x)
    assert tm.stats()["host_syncs"] <= tm.op_index - before


def test_synchronize_leaves_every_host_copy_valid():
    x = torch.full((256,), 1.0)
    for _ in range(3):
        x.add_(1)  # Genoa writes the result back after each op, asynchronously
    tm.synchronize()
    block = x._tr_block
    assert block.host_pending is None and block.host_valid
    assert x.tolist() == [4.0] * 256
