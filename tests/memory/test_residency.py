"""The copy protocol under failure and in steady state: out-of-memory errors in fetches,
prefetches, kernels and creations, prefetch accounting, results sharing a storage, the
simulated device's capacity, and no host waits once a loop is paged."""

from __future__ import annotations

import os

import pytest
import torch

from paired import (assert_identical, budget, capacity, needs_fast_path, paging,  # noqa: F401 (a fixture)
                    plain_torch, room_report, run_both, small_sim_capacity)
import torchTensorRef
from torchTensorRef import DeviceOutOfMemoryError, HostMemoryError, OutOfBudgetError, tensorsManager as tm
from torchTensorRef.memory.room import is_out_of_memory
from torchTensorRef.strategies import Flow, Strategy
from torchTensorRef.core.tensor_ref import block_of

KIB = 1024

sim_only = pytest.mark.skipif(os.environ.get("TORCHTENSORREF_TEST_DEVICE", "sim") != "sim",
                              reason='the capacity of the simulated device ("sim")')

# Errors the device's libraries raise when their own allocations fail.
OOM_ERRORS = {
    "OutOfMemoryError": lambda: torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 1 KiB"),
    "cuBLAS": lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    "cuDNN": lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    "RuntimeError": lambda: RuntimeError("CUDA error: out of memory"),
}


class Fail:
    """A fault injector: raise a fresh ``make()`` at the first ``times`` faults of ``kind``."""

    def __init__(self, kind, make, times=1):
        self.kind, self.make, self.left = kind, make, times
        self.seen = 0

    def __call__(self, fault):
        if fault.kind == self.kind and self.left > 0:
            self.left -= 1
            self.seen += 1
            raise self.make()  # (a new error each time: a reused one keeps every traceback alive)


@pytest.fixture
def injector():
    """Install a fault injector for the test: ``injector(kind, make, times)``."""

    def install(kind, make=OOM_ERRORS["OutOfMemoryError"], times=1):
        tm.fault_injector = fail = Fail(kind, make, times)
        return fail

    yield install
    tm.fault_injector = None


@pytest.fixture
def restored_capacity():
    """Restore ``sim_capacity`` after the test."""
    before = tm.sim_capacity
    yield
    tm.budget = None
    tm.sim_capacity = before


def _resident_bytes_consistent() -> bool:
    return tm.device_bytes == sum(tm.block_bytes(b.nbytes) for b in tm.resident_blocks())


def _on_device_during_ops():
    """Record, for every op, whether all its blocks had device copies while it ran."""
    seen = []
    handle = tm.add_callback(after=lambda op: seen.append(all(b.dev is not None for b in op.blocks)))
    return seen, handle


# -- classifying errors ------------------------------------------------------------------------


@pytest.mark.parametrize("make", OOM_ERRORS.values(), ids=OOM_ERRORS.keys())
def test_allocation_failures_of_the_devices_libraries_are_out_of_memory(make):
    assert is_out_of_memory(make())


@pytest.mark.parametrize("error", [RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
                                   ValueError("out of memory"), MemoryError("host"),
                                   HostMemoryError(10, 5, 1)],
                         ids=["shape-mismatch", "ValueError", "MemoryError", "HostMemoryError"])
def test_other_errors_are_not_out_of_memory(error):
    assert not is_out_of_memory(error)


# -- out of memory in a demand fetch --------------------------------------------------------------


@pytest.mark.parametrize("error", OOM_ERRORS.keys())
def test_an_out_of_memory_in_a_fetch_keeps_the_ops_other_inputs(injector, error):
    # Fixed: a failed demand fetch evicted the op's other inputs (the op then ran on host
    # copies), and allocation failures raised as RuntimeErrors were not recovered at all.
    tm.strategy = "flow"  # (no budget: it keeps what is resident, so the test can see it)

    def compute(fail):
        torch.manual_seed(0)
        a, b = torch.randn(256), torch.randn(256)
        kept = a * 3  # computed by the user: only on the device (dirty) under Flow
        seen = handle = None
        if fail:
            a.toGPU()
            b.toCPU()
            assert kept.proxyInfo.dirty
            injector("fetch", OOM_ERRORS[error])
            seen, handle = _on_device_during_ops()
        out = a * b  # fetching b fails once: room is made from `kept`, never from `a`
        if handle is not None:
            handle.remove()
        return (a, out, kept), seen

    with plain_torch():
        expected, _ = compute(False)
    (a, out, kept), seen = compute(True)
    assert tm.fault_injector.seen == 1
    assert seen == [True]  # the op ran on device copies
    assert a.proxyInfo.on_device and not kept.proxyInfo.on_device
    assert_identical(expected, (a, out, kept))  # the evicted result was written back intact
    assert _resident_bytes_consistent()


def test_an_out_of_memory_in_a_fetch_under_genoa_runs_the_op_on_device_copies(injector):
    tm.strategy = "genoa"
    a, b = torch.full((256,), 2.0), torch.full((256,), 3.0)
    a.toGPU()
    injector("fetch")
    seen, handle = _on_device_during_ops()
    out = a * b
    handle.remove()
    assert seen == [True]
    assert out.tolist() == [6.0] * 256


def _one_input_away():
    """Under Flow: ``a`` on the device, ``b`` to fetch, and ``kept``, a result on the device."""
    tm.strategy = "flow"
    a, b = torch.full((256,), 2.0), torch.full((256,), 3.0)
    kept = a + 1
    a.toGPU()
    b.toCPU()
    return a, b, kept


def test_a_fetch_that_fails_twice_raises_and_leaves_the_op_uncounted(injector):
    # Fixed: the op stayed counted though it never ran.
    a, b, kept = _one_input_away()
    before, ops = tm.op_index, tm.stats()["ops"]
    injector("fetch", times=2)
    with pytest.raises(DeviceOutOfMemoryError, match="op aten.mul.Tensor ran out") as info:
        a * b
    assert info.value.needed == b.proxyInfo.nbytes and info.value.op == "aten.mul.Tensor"
    del info
    tm.fault_injector = None
    assert tm.op_index == before and tm.stats()["ops"] == ops
    assert a.proxyInfo.on_device and not b.proxyInfo.on_device
    assert _resident_bytes_consistent()
    assert (a * b).tolist() == [6.0] * 256  # and the next op runs
    assert kept.tolist() == [3.0] * 256  # nothing computed was lost
    assert tm.op_index == before + 1


def test_a_fetch_that_fails_twice_inside_a_paged_loop_leaves_it_able_to_go_on(injector):
    tm.strategy = "flow"
    torch.manual_seed(0)
    weights = [torch.randn(256) for _ in range(4)]
    tm.budget = budget(3 * KIB)

    def step(acc):
        for w in weights:
            acc = acc * 0.5 + w
        return acc

    with plain_torch():
        torch.manual_seed(0)
        plain_weights = [torch.randn(256) for _ in range(4)]
        expected = torch.zeros(256)
        for _ in range(8):
            for w in plain_weights:
                expected = expected * 0.5 + w
    acc = torch.zeros(256)
    for _ in range(4):
        acc = step(acc)
    injector("fetch", times=2)
    with pytest.raises(DeviceOutOfMemoryError):
        step(acc)
    tm.fault_injector = None
    for _ in range(4):
        acc = step(acc)
    assert_identical(expected, acc)
    assert _resident_bytes_consistent()


def test_an_error_that_is_not_out_of_memory_in_a_fetch_is_raised_unchanged(injector):
    a, b, kept = _one_input_away()
    before = tm.op_index
    fail = injector("fetch", lambda: ValueError("injected: not a memory error"))
    with pytest.raises(ValueError, match="not a memory error"):
        a * b
    assert fail.seen == 1  # no retry
    assert kept.proxyInfo.on_device  # no recovery either
    assert tm.op_index == before
    assert (a * b).tolist() == [6.0] * 256


# -- out of memory in a kernel and in a creation ----------------------------------------------------


@pytest.mark.parametrize("error", OOM_ERRORS.keys())
def test_an_out_of_memory_in_a_kernel_is_recovered_keeping_the_ops_inputs(injector, error):
    # cuBLAS and cuDNN report failed workspace allocations as RuntimeErrors from the kernel.
    tm.strategy = "flow"
    a, b = torch.full((16, 16), 2.0), torch.full((16, 16), 3.0)
    others = [torch.ones(256) + i for i in range(3)]
    a.toGPU()
    b.toGPU()
    fail = injector("op", OOM_ERRORS[error])
    seen, handle = _on_device_during_ops()
    out = a @ b
    handle.remove()
    assert fail.seen == 1 and seen == [True]
    assert a.proxyInfo.on_device and b.proxyInfo.on_device
    assert not any(o.proxyInfo.on_device for o in others)  # room was made from the others
    assert out.tolist() == [[96.0] * 16] * 16
    assert [o[0].item() for o in others] == [1.0, 2.0, 3.0]


def test_an_out_of_memory_in_a_kernel_that_persists_raises_naming_the_op(injector):
    tm.strategy = "flow"
    a = torch.full((16, 16), 2.0)
    injector("op", OOM_ERRORS["cuBLAS"], times=2)
    with pytest.raises(DeviceOutOfMemoryError, match="aten.mm"):
        a @ a
    tm.fault_injector = None
    assert (a @ a).tolist() == [[64.0] * 16] * 16


@pytest.mark.parametrize("error", ["OutOfMemoryError", "cuBLAS"])
def test_an_out_of_memory_making_a_random_tensor_is_recovered(injector, error):
    tm.strategy = "flow"
    kept = torch.full((256,), 2.0) * 2  # dirty, on the device
    fail = injector("create", OOM_ERRORS[error])
    plain, managed = run_both(lambda: torch.randn(64, 16))
    assert fail.seen == 1
    assert_identical(plain, managed)
    assert not kept.proxyInfo.on_device and kept.tolist() == [4.0] * 256


# -- out of memory in a prefetch --------------------------------------------------------------------


def _read_cycle(rounds, tensors):
    """Read each tensor in turn (clean blocks: Flow may evict them for a prefetch)."""
    sums = None
    for _ in range(rounds):
        sums = [t.sum() for t in tensors]
    return sums


@pytest.mark.parametrize("error", ["OutOfMemoryError", "cuBLAS"])
def test_an_out_of_memory_in_a_prefetch_drops_it_and_keeps_the_ops_inputs(injector, error):
    # Fixed: a failed prefetch recovered memory as a demand fetch does, evicting the inputs
    # of the op it runs beside.
    tm.strategy = Flow(lookahead=2, prefetch_evicts=True)
    tensors = [torch.full((256,), float(i)) for i in range(4)]  # 1 KiB each
    tm.budget = budget(3 * KIB)
    _read_cycle(12, tensors)
    assert tm.stats()["prefetches"] > 0, room_report()  # the loop prefetches when nothing fails
    tm.reset_stats()
    fail = injector("prefetch", OOM_ERRORS[error], times=10**6)
    seen, handle = _on_device_during_ops()
    sums = _read_cycle(2, tensors)
    handle.remove()
    tm.fault_injector = None
    stats = tm.stats()
    assert fail.seen > 0 and stats["prefetches_dropped"] == fail.seen and stats["prefetches"] == 0
    assert seen and all(seen)  # every op ran on its device copies
    assert [s.item() for s in sums] == [256.0 * i for i in range(4)]
    assert _resident_bytes_consistent()


# -- prefetch accounting ------------------------------------------------------------------------------


def _prefetched_ones():
    """A tensor of ones prefetched under Flow, from zeroed stats."""
    tm.strategy = Flow(lookahead=0)
    a = torch.ones(256)
    a.toCPU()
    tm.reset_stats()
    assert tm.prefetch(block_of(a))
    return a


def test_a_prefetch_evicted_unused_counts_as_one_miss_not_also_a_hit():
    # Fixed: the demand fetch that followed counted as both a hit and a miss.
    a = _prefetched_ones()
    tm.evict(block_of(a))  # never used
    a.add_(1)
    stats = tm.stats()
    assert (stats["prefetches"], stats["prefetches_unused"]) == (1, 1)
    assert (stats["prefetch_hits"], stats["prefetch_misses"]) == (0, 1)
    assert a.tolist() == [2.0] * 256


def test_a_prefetch_used_counts_as_one_hit_and_no_miss():
    a = _prefetched_ones()
    a.add_(1)
    a.add_(1)  # (a second use is no second hit)
    stats = tm.stats()
    assert (stats["prefetch_hits"], stats["prefetch_misses"], stats["prefetches_unused"]) == (1, 0, 0)
    assert a.tolist() == [3.0] * 256


def test_bytes_are_counted_by_how_they_came_in():
    # A prefetch issued before the op that reads it counts as ahead; a demand fetch does not.
    a = _prefetched_ones()
    b = torch.ones(256)
    b.toCPU()
    a.add_(b)
    stats = tm.stats()
    nbytes = 256 * 4
    assert (stats["bytes_prefetched"], stats["bytes_prefetched_ahead"], stats["bytes_on_demand"]) == (
        nbytes, nbytes, nbytes)
    assert stats["bytes_to_device"] == stats["bytes_prefetched"] + stats["bytes_on_demand"]
    assert a.tolist() == [2.0] * 256


class _PrefetchOwnInputs(Strategy):
    """Prefetches an op's own blocks as the op begins: too late to overlap anything."""

    def before_op(self, op):
        for block in op.blocks:
            self.manager.prefetch(block)


def test_a_prefetch_issued_by_the_op_that_reads_it_is_not_ahead():
    tm.strategy = _PrefetchOwnInputs()
    a = torch.ones(256)
    a.toCPU()
    tm.reset_stats()
    a.add_(1)
    stats = tm.stats()
    assert (stats["prefetches"], stats["prefetch_hits"], stats["bytes_prefetched"]) == (1, 1, 256 * 4)
    assert (stats["bytes_prefetched_ahead"], stats["bytes_on_demand"]) == (0, 0)
    assert a.tolist() == [2.0] * 256


# -- device copies the program still views ------------------------------------------------------------


@pytest.mark.parametrize("how", ["released", "evicted"])
def test_a_device_copy_the_program_still_views_counts_until_the_view_goes(how, monkeypatch):
    # Note [Buffers still viewed]: the device keeps a buffer allocated while a plain view of
    # it lives, whatever the manager did with its block. The fixture fails the test where the
    # device held more than the budget at an op's end.
    monkeypatch.setattr(tm, "check_device", True)
    tm.strategy = "flow"
    size = tm.block_bytes(256 * 4)
    tm.budget = budget(4 * size)
    floor = tm.in_use()
    a = torch.full((256,), 2.0)
    kept = a.target  # (a plain view of its device copy)
    if how == "released":
        del a
    else:
        a.toCPU()
    assert tm.in_use() == floor + size  # the device still holds it
    others = [torch.full((256,), float(i)) for i in range(4)]  # room for three beside it
    assert tm.stats()["evictions"] > 0
    with torchTensorRef.disabled():
        assert kept.cpu().tolist() == [2.0] * 256  # (nothing reused its bytes)
    del kept
    others[0].add_(1)  # (the next op sees the view gone)
    assert tm.in_use() == floor + tm.device_bytes
    assert [t.tolist() for t in others] == [[float(i + (i == 0))] * 256 for i in range(4)]


def test_an_op_that_needs_the_bytes_the_program_still_views_is_refused_until_it_lets_go():
    # (nothing can wait for a program to drop a view: the op is refused, not waited for)
    tm.strategy = "flow"
    tm.budget = budget(2 * tm.block_bytes(256 * 4))
    a = torch.full((256,), 2.0)
    kept = a.target
    del a
    b = torch.ones(256)
    with pytest.raises(OutOfBudgetError, match="cumsum.*outside the manager"):
        b.cumsum(0)  # (b and its sums, one op: two blocks, beside the one still viewed)
    del kept
    assert b.cumsum(0).tolist() == [float(i + 1) for i in range(256)]


# -- results sharing one new storage ------------------------------------------------------------------


def _qkv():
    # Its three results are views of one storage the op allocates (CPU and CUDA kernels alike).
    qkv, bias = torch.randn(2, 2, 24), torch.randn(24)
    return torch.ops.aten._transform_bias_rescale_qkv(qkv, bias, 2)


def test_results_sharing_one_new_storage_get_one_block_counted_once_on_the_device():
    # Fixed: each result viewing the fresh storage got a block of all of it.
    tm.strategy = "flow"  # (keeps results on the device: their bytes are counted there)
    torch.manual_seed(0)
    qkv, bias = torch.randn(2, 3, 24), torch.randn(24)
    before, blocks = tm.device_bytes, tm.stats()["blocks"]
    q, k, v = torch.ops.aten._transform_bias_rescale_qkv(qkv, bias, 2)
    assert len({t.proxyInfo.block_id for t in (q, k, v)}) == 1
    assert q.proxyInfo.nbytes == 3 * q.numel() * q.element_size() and q.proxyInfo.views == 3
    assert tm.device_bytes - before == tm.block_bytes(q.proxyInfo.nbytes)  # (as the device's allocator counts it)
    assert tm.stats()["blocks"] == blocks + 1


def test_results_sharing_one_new_storage_are_written_back_once():
    tm.strategy = "genoa"
    torch.manual_seed(0)
    qkv, bias = torch.randn(2, 3, 24), torch.randn(24)
    tm.reset_stats()
    host_bytes = tm.stats()["host_bytes"]
    q, k, v = torch.ops.aten._transform_bias_rescale_qkv(qkv, bias, 2)
    stats = tm.stats()
    assert (stats["writebacks"], stats["bytes_to_host"]) == (1, q.proxyInfo.nbytes)
    assert stats["host_bytes"] - host_bytes == q.proxyInfo.nbytes


def test_results_sharing_one_new_storage_have_the_values_of_plain_torch(paging):
    plain, managed = run_both(_qkv)
    assert_identical(plain, managed)
    managed[0].mul_(0)  # a write through one result leaves the others as they were
    assert_identical(plain[1:], managed[1:])


# -- budget None: the simulated device's capacity ----------------------------------------------------


@sim_only
@small_sim_capacity
@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_no_budget_on_sim_pages_within_the_devices_capacity(restored_capacity, strategy):
    # Fixed: with no budget nothing was evicted, and the device ran out of memory.
    tm.strategy = strategy
    tm.sim_capacity = room = capacity(4 * KIB)
    assert tm.budget is None and tm.limit == room and tm.stats()["budget"] == room
    tm.reset_stats()

    def work():
        xs = [torch.randn(256) for _ in range(8)]  # 8 KiB in all, drawn on the device
        ys = [x * 2 + 1 for x in xs]
        return xs, ys, sum(y.sum() for y in ys)

    plain, managed = run_both(work)
    assert_identical(plain, managed)
    stats = tm.stats()
    assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= 4 * KIB


@sim_only
@small_sim_capacity
def test_changing_sim_capacity_moves_the_limit_when_there_is_no_budget(restored_capacity):
    tm.sim_capacity = large = capacity("64KiB")
    assert tm.sim_capacity == large and tm.limit == large
    tm.budget = "8KiB"
    tm.sim_capacity = small = capacity("32KiB")
    assert tm.limit == 8 * KIB  # a budget, once set, is the limit
    tm.budget = None
    assert tm.limit == small


@sim_only
@small_sim_capacity
@pytest.mark.parametrize("value", [None, -1, "lots", 1.5, True])
def test_bad_sim_capacity_raises_naming_what_is_accepted_and_changes_nothing(restored_capacity, value):
    tm.sim_capacity = room = capacity("1MiB")
    with pytest.raises(ValueError, match=r"sim_capacity must be .*size") as info:
        tm.sim_capacity = value
    assert "int" in str(info.value)
    assert tm.sim_capacity == room and tm.limit == room


@sim_only
@small_sim_capacity
def test_sim_capacity_below_the_bytes_on_the_device_raises_and_changes_nothing(restored_capacity):
    tm.strategy = "flow"
    tm.sim_capacity = room = capacity("1MiB")
    x = torch.ones(1024)
    x.toGPU()
    with pytest.raises(ValueError, match="sim_capacity"):
        tm.sim_capacity = 1024
    assert tm.sim_capacity == room and tm.limit == room
    assert x.proxyInfo.on_device and x.sum().item() == 1024.0


@sim_only
@small_sim_capacity
def test_sim_capacity_below_the_plain_tensors_on_the_device_raises_and_changes_nothing(restored_capacity):
    # The device holds plain tensors beside the manager's blocks: a capacity below them
    # would make every later allocation fail. Only the manager's bytes were checked.
    tm.sim_capacity = room = capacity("1MiB")
    with torchTensorRef.disabled(device="sim"):
        plain = torch.ones(64 * 1024, device="sim")  # 256 KiB outside the manager
    with pytest.raises(ValueError, match="sim_capacity .* below the .* bytes in use on the device"):
        tm.sim_capacity = room - 1024 * KIB + 128 * KIB  # (below them by 128 KiB)
    assert tm.sim_capacity == room and tm.limit == room
    assert plain.sum().item() == 64 * 1024


@sim_only
@small_sim_capacity
def test_an_out_of_memory_from_the_sim_capacity_is_recovered_by_evicting(restored_capacity):
    # A budget above what the device has: the allocations, not the budget, fail.
    tm.strategy = "genoa"  # (every op takes the path that allocates through the device)
    tm.sim_capacity = capacity(4 * KIB)
    tm.budget = "1MiB"
    keep = [torch.full((256,), float(i)) for i in range(2)]
    x, y = torch.full((256,), 2.0), torch.full((256,), 3.0)
    tm.pin(keep[0])
    try:
        tm.pin(keep[1])
        try:  # the pinned blocks fill half the device: x, y and the result do not fit beside
            with pytest.raises(DeviceOutOfMemoryError, match="aten.mul"):
                x * y
        finally:
            tm.unpin(keep[1])
        tm.reset_stats()
        assert (x * y).tolist() == [6.0] * 256  # room made by evicting the unpinned block
        assert not keep[1].proxyInfo.on_device and keep[1].tolist() == [1.0] * 256
        assert tm.stats()["peak_device_bytes"] <= 4 * KIB
    finally:
        tm.unpin(keep[0])


# -- host waits in steady state ----------------------------------------------------------------------


def _mlp():
    # many small layers: a quarter of the weights still holds any single op (Adam's included)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(16)])


class _TinyLM(torch.nn.Module):
    """A two-layer transformer language model."""

    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _weights(model) -> int:
    """Device bytes of the model's parameters, as the budget counts them (each rounded up by the device's allocator)."""
    return sum(tm.block_bytes(p.numel() * p.element_size()) for p in model.parameters())


def _workload(name):
    """(model, step): one training step, or one token of greedy decoding."""
    torch.manual_seed(0)
    if name.startswith("mlp"):
        model = _mlp()
        opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if name == "mlp-adam"
               else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        x = torch.randn(4, 32)

        def step():
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        return model, step
    model = _TinyLM()
    if name == "lm-adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 50, (2, 8))

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()

        return model, step
    state = {"tokens": torch.randint(0, 50, (2, 1))}

    @torch.no_grad()
    def step():  # the next token from the last position, fed back without .item()
        tokens = state["tokens"]
        state["tokens"] = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], 1)

    return model, step


# (a two-layer transformer has matrices too large for a quarter of its weights to hold the
# ops that train them; its decoding runs there)
STEADY = [(w, f) for w in ("mlp-sgd", "mlp-adam", "lm-greedy") for f in (0.25, 0.5, 1.0)]
STEADY += [("lm-adam", 0.5), ("lm-adam", 1.0)]


@pytest.mark.parametrize("work, fraction", STEADY, ids=[f"{w}-{int(f * 100)}%" for w, f in STEADY])
def test_flow_makes_no_host_waits_in_steady_state(work, fraction):
    # Fixed: demand fetches and write-backs made the host wait. From pinned memory both are
    # asynchronous: once the loop is paged, a step waits for the device nowhere.
    tm.strategy = "flow"
    model, step = _workload(work)
    managed = int(fraction * _weights(model))
    tm.budget = budget(managed)
    for _ in range(2):
        step()
    tm.reset_stats()
    for _ in range(3):
        step()
    stats = tm.stats()
    assert stats["evictions"] > 0  # the loop is paged
    assert stats["host_syncs"] == 0, stats
    assert stats["peak_device_bytes"] <= managed


@pytest.mark.parametrize("work", ["mlp-adam", "lm-greedy"])
def test_genoa_waits_at_most_once_per_op(work):
    tm.strategy = "genoa"
    model, step = _workload(work)
    tm.budget = budget(_weights(model) // 2)
    for _ in range(2):
        step()
    tm.reset_stats()
    before = tm.op_index
    for _ in range(3):
        step()
    assert 0 < tm.stats()["fetches"]
    assert tm.stats()["host_syncs"] <= tm.op_index - before


# -- the fast path recovers as the generic path does ---------------------------------------------

_fast_lib = torch.library.Library("ttr_fast_oom", "DEF")  # noqa: TOR901 (a test op)
_fast_lib.define("double(Tensor x) -> Tensor")
_fast_failures: list = []


def _double(x):
    if _fast_failures:
        raise _fast_failures.pop()
    return x * 2


_fast_lib.impl("double", _double, "CompositeExplicitAutograd")  # (every device: CUDA's too)
_fast_lib.impl("double", torch.empty_like, "Meta")


@needs_fast_path
def test_the_fast_path_recovers_a_cublas_out_of_memory():
    # Defect: the fast path caught only torch.OutOfMemoryError.
    tm.strategy = "flow"  # no budget: the fast path
    x = torch.ones(4)
    x.toGPU()
    assert tm.fast
    _fast_failures.append(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert torch.ops.ttr_fast_oom.double(x).tolist() == [2.0] * 4
    assert not _fast_failures


@needs_fast_path
def test_the_fast_path_never_passes_the_simulated_capacity():
    # Defect: only the budget was checked there, so "sim" ran past its capacity unnoticed.
    if tm.backend.name != "sim":
        pytest.skip("the simulated device's capacity")
    before = tm.sim_capacity
    try:
        tm.strategy = "flow"
        tm.sim_capacity = capacity(4096)
        tm.budget = "1MiB"  # above the capacity: the budget never binds
        x = torch.ones(256)
        ys = [x + i for i in range(8)]
        assert tm.device_bytes <= 4096
        assert [y[0].item() for y in ys] == [1.0 + i for i in range(8)]
        del ys
    finally:
        tm.budget = None
        tm.sim_capacity = before


def test_a_paged_host_copy_only_the_manager_holds_moves_into_pinned_memory():
    # Fixed: a tensor made from data (torch.tensor) lives in pageable memory, and each of its
    # fetches made the host wait (on CUDA a copy from pageable memory waits for the stream):
    # small optimizer state made from Python numbers (torch 2.11's Adam step counts) waited
    # in every step. Once it is paged (fetched a second time), its host copy moves into
    # pinned memory, and its moves stop making the host wait. (A tensor fetched once keeps
    # its pageable copy: pinned memory is not spent on what is used once.)
    x = torch.tensor([1.0, 2.0, 3.0])  # (made in host memory, from data)
    block, pinned = block_of(x), tm.backend.pinned
    x.toGPU()
    x.toCPU()
    after_one = pinned.is_pinned(block.host)  # (not in an assert: pytest would keep the storage named)
    syncs = tm.stats()["host_syncs"]
    x.toGPU()  # paged
    assert tm.stats()["host_syncs"] == syncs  # copied from pinned memory: no wait
    assert not after_one and pinned.is_pinned(block.host)
    x.add_(1)
    x.toCPU()  # written back into the pinned copy
    assert pinned.is_pinned(block.host)
    assert x.tolist() == [2.0, 3.0, 4.0]


def test_a_host_copy_a_tensor_still_views_stays_where_it_is():
    x = torch.tensor([1.0, 2.0, 3.0])
    held = x.target  # a plain tensor over the host copy's bytes
    x.toGPU()
    x.add_(1)
    x.toCPU()  # written back into the bytes it holds, not into new pinned ones
    assert x.target.data_ptr() == held.data_ptr()
    assert held.tolist() == [2.0, 3.0, 4.0]
