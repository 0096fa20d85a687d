"""Run the same code on plain torch and on TensorRefs, and compare what it returns.

Shared by the semantic test modules (tensor_ref, autograd, serialization, manage). The
``paging`` fixture puts the manager under every strategy of
``torchTensorRef.strategies.NAMES``, with no budget and with a budget so small that blocks
are evicted between ops.
"""

from __future__ import annotations

import contextlib  # noqa: F401
import gc
import itertools
import os

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.memory.sim.tensor import SimTensor
from torchTensorRef.core.sizes import parse_size
from torchTensorRef.strategies import NAMES

#: the tests' folder (their shared modules and scripts) and the repository's root
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


#: a test of the simulated device itself: it runs where the suite runs on "sim" (in a CUDA
#: process "sim" is not registered, and plain torch there is the GPU's)
ON_SIM = os.environ.get("TORCHTENSORREF_TEST_DEVICE", "sim") == "sim"
SIM_ONLY_REASON = 'checks the simulated device itself (the suite runs on "sim")'
sim_only = pytest.mark.skipif(not ON_SIM, reason=SIM_ONLY_REASON)


def outside_floor() -> int:
    """Device bytes the test device holds outside the manager once libraries made their
    workspaces (Note [Budget on CUDA]): 0 on plain "sim", tens of MiB on a GPU. A budget
    covers them, so the tests' budgets are set above them."""
    from conftest import TEST_DEVICE

    tm = tensorsManager
    previous = tm.device
    tm.device = TEST_DEVICE
    try:
        return tm.outside_bytes()
    finally:
        tm.device = previous


#: what the test device holds outside the manager at the start (0 on plain "sim")
OUTSIDE = outside_floor()
#: one thread's workspaces: a thread that runs its first op adds them (the floor is two
#: such sets, this thread's and autograd's device thread's)
THREAD_WORKSPACE = OUTSIDE // 2
#: whether "sim" emulates workspaces (TORCHTENSORREF_SIM_WORKSPACE): every op then takes
#: the generic path, as on CUDA
EMULATED_WORKSPACES = tensorsManager.sim_workspace > 0
#: bytes the ``paging`` fixture's small budget gives the manager: any of the tests' models pages its weights
TINY = 2048
#: that budget, as the suite's process starts
TINY_BUDGET = OUTSIDE + TINY


def outside() -> int:
    """What the manager's device holds outside it now. It only grows: each thread that ran
    an op keeps its workspaces (on CUDA, cuBLAS keeps one per handle the process made), so
    a budget is counted from a reading taken when it is set, not from ``OUTSIDE``."""
    return tensorsManager.outside_bytes()


def capacity(nbytes) -> int:
    """A ``sim_capacity`` leaving ``nbytes`` (an int or ``"4KiB"``) beside what the device
    holds outside the manager now: a test of the capacity must not count on an empty device
    (plain device tensors outlive the tests that made them: a library's tables made at its
    import under a device's default, a cycle through autograd's nodes)."""
    return outside() + parse_size(nbytes, none=False)


def budget(nbytes, threads: int = 0) -> int:
    """A budget giving the manager ``nbytes`` (an int or ``"96KiB"``) above what the device
    holds outside it now, with room for the workspaces of ``threads`` threads yet to run ops."""
    return outside() + threads * THREAD_WORKSPACE + parse_size(nbytes, none=False)


def room_report() -> str:
    """What decides whether Flow has room to prefetch, for an assertion's message: the
    manager's count, the buffers copies still use, the limit, the outside reading, pins."""
    tm = tensorsManager
    s = tm.stats()
    return (f"in_use={tm.in_use()} pending={tm.accounting.pending_bytes} limit={tm.limit} "
            f"outside={tm.read_outside()} pinned_bytes={s['pinned_bytes']} pin_failures={s['pin_failures']} "
            f"prefetches_dropped={s['prefetches_dropped']} evictions={s['evictions']}")


def without_emulated_workspaces(reason: str):
    """Skip a test about "sim" itself where it emulates workspaces (``reason`` says why)."""
    return pytest.mark.skipif(EMULATED_WORKSPACES, reason=f"emulated workspaces: {reason}")


#: for tests that assert the fast path is taken
needs_fast_path = without_emulated_workspaces("every op takes the generic path (no fast path)")
#: for tests that give "sim" a capacity of a few KiB
small_sim_capacity = without_emulated_workspaces("a sim_capacity of a few KiB is below the workspaces themselves")
SETTINGS = list(itertools.product(NAMES, (None, TINY)))


@pytest.fixture(params=SETTINGS, ids=[f"{s}-{b or 'unlimited'}" for s, b in SETTINGS])
def paging(request):
    """The manager under one strategy and budget (``"sim"``, from the autouse fixture)."""
    strategy, managed = request.param
    tensorsManager.strategy = strategy
    if managed is not None:
        managed = tiny_room(managed)
    limit = None if managed is None else budget(managed)
    tensorsManager.budget = limit
    tensorsManager.reset_stats()
    yield tensorsManager
    if managed is not None:
        assert tensorsManager.stats()["peak_device_bytes"] <= managed


def tiny_room(nbytes: int = TINY) -> int:
    """The small budget's room: ``nbytes``, and at least twelve of the device's smallest
    allocations where its allocator rounds every size up (CUDA's, and "sim" with
    ``sim_rounding``: 512 bytes each), so that an op with ten tensors (a batch norm's
    backward: seven inputs, three results) still runs whole."""
    return max(nbytes, 12 * tensorsManager.block_bytes(1))


def device_type() -> str:
    """The device type managed tensors report: ``"sim"``, ``"cuda"``, or ``"cpu"`` (pass-through)."""
    return tensorsManager.torch_device.type


@contextlib.contextmanager
def timing_form_of_sim():
    """``"sim"`` in its timing form (``sim_strict = False``: its device tensors are plain CPU
    tensors) for the block; strict ``"sim"`` again after it, no budget."""
    previous = tensorsManager.sim_strict
    tensorsManager.sim_strict = False
    tensorsManager.device = "sim"
    try:
        yield
    finally:
        tensorsManager.budget = None
        tensorsManager.sim_strict = previous
        tensorsManager.device = "sim"


@contextlib.contextmanager
def plain_torch():
    """Plain torch on the managed tensors' device: what a test compares them with.

    On ``"sim"`` that is ``SimTensor``s (plain tensors of the simulated device), on CUDA plain
    CUDA tensors: PyTorch picks the same kernels for both runs, so results are bit-identical.

    The device counts the plain tensors made here outside the manager, against its budget
    (Note [Budget on CUDA]): what they add is given to the budget (or, on "sim" without
    one, to its capacity), so that the manager keeps the room the test gave it.
    """
    device = tensorsManager.torch_device
    before = outside() if device.type != "cpu" else None
    try:
        with torchTensorRef.disabled(device=device if device.type != "cpu" else None):
            yield
    finally:
        if before is not None:
            give_room(outside() - before)


#: the garbage collector's thresholds where a random search draws collecting often: TensorRefs
#: in reference cycles then die at any point of an op, not only where a long run collects
COLLECT_OFTEN = (5, 2, 2)


@contextlib.contextmanager
def collecting(often: bool):
    """Python's garbage collector at every few allocations (``often``), else as it was."""
    before = gc.get_threshold()
    if often:
        gc.set_threshold(*COLLECT_OFTEN)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def evict_newest(strategy) -> None:
    """``strategy`` evicts the newest block it may, from the device and from host memory: a
    choice a strategy is free to make, and the one least like the usual least recently used
    (what an op, or a handler, made last and still writes is the first candidate)."""
    def device(protect):
        blocks = [b for b in tensorsManager.resident_blocks() if not b.pins and b.id not in protect]
        return max(blocks, key=lambda b: b.id, default=None)

    strategy.choose_victim = device
    strategy.choose_host_victim = lambda candidates, _index: max(candidates, key=lambda b: b.id, default=None)


def give_room(nbytes: int) -> None:
    """Raise the budget by ``nbytes`` the test's own device tensors took outside the manager
    (on "sim" without a budget: its capacity, the limit then)."""
    tm = tensorsManager
    if nbytes <= 0:
        return
    if tm.budget is not None:
        tm.budget = tm.budget + nbytes
    elif tm.device == "sim":
        tm.sim_capacity = tm.sim_capacity + nbytes


def run_both(fn, seed: int = 0):
    """``(plain, managed)``: ``fn()`` run on plain torch, then managed, from the same seed."""
    with plain_torch():
        torch.manual_seed(seed)
        plain = fn()
    torch.manual_seed(seed)
    managed = fn()
    return plain, managed


def values(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s values where its ops compute (a TensorRef's target,
    a SimTensor's CPU bytes, a plain tensor itself)."""
    if isinstance(t, TensorRef):
        return t.target
    if isinstance(t, SimTensor):
        return t.data_
    return t


def to_plain(obj):
    """``obj`` with every tensor replaced by a plain, detached copy of its values."""
    if isinstance(obj, torch.Tensor):
        with torchTensorRef.disabled():
            # (on the CPU: a result may be on the device or back on the host, as Genoa leaves it)
            return values(obj).detach().cpu().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def assert_identical(plain, managed, where: str = "result") -> None:
    """Same structure, and bit-identical tensors (plain torch on CPU is deterministic)."""
    if isinstance(plain, torch.Tensor):
        assert isinstance(managed, torch.Tensor), f"{where}: {type(managed).__name__}"
        a, b = to_plain(plain), to_plain(managed)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: {b} != {a}"
    elif isinstance(plain, (list, tuple)):
        assert type(managed) is type(plain) and len(managed) == len(plain), where
        for i, (p, m) in enumerate(zip(plain, managed)):
            assert_identical(p, m, f"{where}[{i}]")
    elif isinstance(plain, dict):
        assert managed.keys() == plain.keys(), where
        for k in plain:
            assert_identical(plain[k], managed[k], f"{where}[{k!r}]")
    else:
        assert managed == plain, f"{where}: {managed!r} != {plain!r}"
