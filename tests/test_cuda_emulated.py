"""The manager on ``"cuda"``, on a machine without one: ``torch.cuda``'s functions emulated.

What the first GPU run found, each shown here without a GPU:
- ``device = "cuda"`` again (every test's setup) made a new, unresolved backend whose
  device was the CPU placeholder, and the budget then asked ``torch.cuda.memory_allocated``
  about the CPU (``ValueError: Expected a cuda device, but got: cpu``);
- the first tensor made after ``device = "cuda"`` was made on the CPU (its device read
  before ``"cuda"`` was resolved);
- the budget counted the cuBLAS workspaces (33 MiB on an H100) only once a device reading
  happened to see them, so a budget below them failed in the middle of a model;
- every release of a host copy asked the driver for the device's free memory;
- registering ``"sim"`` in a CUDA process broke CUDA's backward;
- each reading of the device asked ``torch.cuda.memory_allocated``, which flattens every
  statistic of the allocator into a new dict: under Flow at 50%, 38% of a decoding call.
"""

from __future__ import annotations

import pytest
import torch

from torchTensorRef import OutOfBudgetError, tensorsManager
from torchTensorRef.integrations import creation
from torchTensorRef.memory.sim import device as sim_device
from torchTensorRef.memory.devices import CudaBackend
from torchTensorRef.core.errors import BudgetBelowFloorError

# (on a GPU the real backend is already resolved and its memory real: the tests there are the
# suite itself on CUDA, and these CPU stand-ins would only measure their own mocks)
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="emulates torch.cuda where there is none")

MiB = 2**20
WORKSPACE = 32 * MiB + MiB  # cuBLAS's and cuBLASLt's on an H100, per handle


class FakeCuda:
    """What ``torch.cuda`` says about one device whose allocator holds ``allocated`` bytes."""

    def __init__(self):
        self.allocated = 0
        self.workspaces = set()
        self.capacity_reads = 0
        self.flattened_reads = 0  # torch.cuda.memory_allocated's, each flattening every statistic
        self.counter_reads = 0  # the nested statistics' (what torch.cuda.memory_stats flattens)

    def _check(self, device=None):
        device = torch.device("cuda", 0) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")  # as torch.cuda does

    def memory_allocated(self, device=None):
        self._check(device)
        self.flattened_reads += 1
        return self.allocated

    def max_memory_allocated(self, device=None):
        self._check(device)
        return self.allocated

    def nested_stats(self, index):
        assert isinstance(index, int), index  # (as torch._C's: a device index)
        self.counter_reads += 1
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.allocated}}}

    def mem_get_info(self, device=None):
        self._check(device)
        self.capacity_reads += 1
        return 80 * 2**30 - self.allocated, 80 * 2**30

    def memory_reserved(self, device=None):
        self._check(device)
        return self.allocated

    def warm_up(self, backend, backward=True):
        # As cuBLAS: a workspace per thread's handle, and one for autograd's device thread.
        import threading

        for key in [threading.get_ident()] + (["backward"] if backward else []):
            if key not in self.workspaces:
                self.workspaces.add(key)
                self.allocated += WORKSPACE


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", fake.memory_allocated)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", fake.nested_stats, raising=False)  # (CPU builds lack it)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", fake.memory_reserved)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", fake.memory_reserved)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake._check)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(CudaBackend, "warm_up", lambda self, backward=True: fake.warm_up(self, backward))
    yield fake
    tm = tensorsManager
    tm.budget = None
    tm.device = "cpu"  # (while torch.cuda is still emulated)


def test_cuda_assigned_again_keeps_its_backend_resolved_or_not(cuda):
    tm = tensorsManager
    tm.device = "cuda"
    unresolved = tm.backend
    tm.device = "cuda"
    assert tm.backend is unresolved and tm.device == "cuda"
    assert tm.torch_device == torch.device("cuda", 0)  # resolves
    tm.device = "cuda"
    tm.device = "cuda:0"
    assert tm.backend is unresolved and tm.device == "cuda:0"


def test_a_budget_on_unresolved_cuda_counts_the_workspaces_and_refuses_less(cuda):
    tm = tensorsManager
    tm.device = "cuda"
    with pytest.raises(BudgetBelowFloorError, match=r"66\.0 MiB .* on cuda:0 outside the manager") as info:
        tm.budget = "16MiB"
    assert isinstance(info.value, ValueError) and isinstance(info.value, OutOfBudgetError)
    assert tm.budget is None  # unchanged
    assert cuda.allocated == 2 * WORKSPACE  # this thread's and autograd's, made before the check
    tm.budget = "100MiB"
    assert tm.budget == 100 * MiB
    s = tm.stats()
    assert s["outside_bytes"] == 2 * WORKSPACE
    assert s["device"] == "cuda:0"
    assert tm.room() == 100 * MiB - 2 * WORKSPACE
    assert tm.fits(100 * MiB - 2 * WORKSPACE) and not tm.fits(100 * MiB - 2 * WORKSPACE + 1)


def test_the_first_tensor_after_cuda_is_made_on_the_resolved_device(cuda):
    tm = tensorsManager
    tm.device = "cuda"
    seen = []

    class Stop(Exception):
        pass

    def factory(*args, **kwargs):
        seen.append(kwargs["device"])
        raise Stop

    with pytest.raises(Stop):
        creation._on_device(tm, factory, (4,), {}, 16, "zeros")
    assert seen == [torch.device("cuda", 0)]


def test_an_op_that_does_not_fit_beside_the_workspaces_says_so(cuda):
    tm = tensorsManager
    tm.device = "cuda"
    tm.budget = 2 * WORKSPACE + MiB
    with pytest.raises(OutOfBudgetError, match="66.0 MiB is allocated outside the manager"):
        tm.make_room(2 * MiB, (), "aten.mm.default")


def test_a_new_threads_workspace_is_made_and_counted_before_its_kernels(cuda):
    import threading

    tm = tensorsManager
    tm.device = "cuda"
    tm.budget = "200MiB"
    assert tm.stats()["outside_bytes"] == 2 * WORKSPACE
    worker = threading.Thread(target=lambda: tm.make_room(MiB, (), "aten.mm.default"))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert tm.accounting.elsewhere_bytes == 3 * WORKSPACE  # read when it was made, not 64 checks later


def test_releasing_host_copies_does_not_ask_cuda_for_its_capacity(cuda):
    tm = tensorsManager
    tm.device = "cuda"
    tm.budget = "200MiB"
    reads = cuda.capacity_reads
    for _ in range(10):
        assert tm.residency.kept_limit() == 0  # (CUDA's allocators keep freed memory themselves)
    assert cuda.capacity_reads == reads


def test_the_budget_reads_the_allocator_s_counter_not_its_flattened_statistics(cuda):
    tm = tensorsManager
    tm.device = "cuda"
    tm.budget = "200MiB"
    cuda.flattened_reads = cuda.counter_reads = 0
    cuda.allocated += 3 * MiB  # (a plain tensor of the program's)
    for _ in range(5):
        tm.make_room(MiB, (), "aten.mm.default")
        assert tm.stats()["outside_bytes"] == 2 * WORKSPACE + 3 * MiB  # (a reading of the device)
    assert cuda.counter_reads >= 5 and cuda.flattened_reads == 0


def test_sim_is_not_registered_where_cuda_is_available(cuda):
    # From torch 2.8 on, a registered private-use device breaks every CUDA backward.
    reason = sim_device.unavailable_reason()
    assert reason is not None and "CUDA" in reason


def test_a_large_buffer_is_counted_at_what_the_allocator_s_counter_grew_by(cuda, monkeypatch):
    # (Note [Allocator slack]: a 2.5 MiB request served from a cached 3 MiB block is counted
    # at 3 MiB by memory_allocated; the small pool splits off every rest)
    from torchTensorRef.memory.devices import Backend, cuda_block_bytes

    backend = CudaBackend(0)
    grows = []

    def allocate(self, nbytes):
        cuda.allocated += grows.pop(0)
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(Backend, "allocate", allocate)
    grows.append(3 * MiB)
    large = backend.allocate(2 * MiB + MiB // 2)
    assert backend.dev_bytes(large.untyped_storage()) == 3 * MiB
    # asked again (no longer the last allocation): as planned, and a kernel's result too
    assert backend.dev_bytes(large.untyped_storage()) == cuda_block_bytes(2 * MiB + MiB // 2)
    reads = cuda.counter_reads
    grows.append(4096)
    small = backend.allocate(4000)
    assert backend.dev_bytes(small.untyped_storage()) == 4096
    assert cuda.counter_reads == reads  # (no reading for a small one)
    assert backend.slack() == MiB
