"""torch.distributed with TensorRefs: each rank a process with its own manager and budget.

The ranks run in spawned processes (``distributed_workers.py``) over ``gloo`` on the CPU,
with a deadline so that a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
from torchTensorRef.core.tensor_ref import block_of

import distributed_workers as workers
from paired import ROOT, TESTS

DEADLINE_S = 120

#: FSDP2 on "sim" needs the device registered before the ranks' process group is made
#: ("cpu:gloo,sim:gloo"), which the package does at import only where CUDA is not available
#: (Note [Registering "sim" early] in torchTensorRef/__init__.py): with CUDA the ranks failed
#: in init_process_group ("Expected one of cpu, cuda, ... device type at start of device string: sim")
fsdp2_on_sim = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason='FSDP2 on "sim" runs only where CUDA is not available: with CUDA, "sim" is not registered at '
           'import (Note [Registering "sim" early]), and FSDP2 on CUDA TensorRefs is refused '
           '(test_fsdp2_on_cuda_is_refused_before_it_shards)')


#: runs of the ranks, the first included, where each time a rank was killed by a signal
#: after it had returned (gloo's threads aborting the interpreter at exit, plain torch too:
#: seen once in a loaded suite run); an error, or a signal before that, fails at once, and
#: a run again must pass whole
RUNS = 3


def spawn(fn, *args, world: int = 2):
    """Run ``fn(rank, world, init_file, *args)`` in ``world`` processes; fail on error or hang."""
    import tempfile

    for run in range(RUNS):
        folder = tempfile.mkdtemp(prefix="ttr-dist-")
        init_file = os.path.join(folder, "init")
        context = mp.spawn(workers.returned, args=(fn, world, init_file, *args), nprocs=world, join=False)
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
                if time.monotonic() > deadline:
                    pytest.fail(f"the {world} ranks did not finish in {DEADLINE_S} s")
            return
        except mp.ProcessExitedException as e:
            # (the other ranks are terminated at once: only the signalled one's mark is known)
            returned = os.path.exists(workers.returned_marker(init_file, e.error_index))
            if not (returned and e.signal_name) or run == RUNS - 1:
                raise
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()


@pytest.fixture(autouse=True)
def _workers_import_this_tree(monkeypatch):
    # Spawned ranks import the package found first on their path: the one under test.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_collectives_on_tensor_refs_are_plain_collectives(device):
    spawn(workers.collectives_worker, device)


#: DDP's options, each run plain and managed in the same processes
DDP_OPTIONS = [
    {},
    {"gradient_as_bucket_view": True},
    {"no_sync": True},
    {"bucket_cap_mb": 4096 / 2**20, "gradient_as_bucket_view": True},
    {"broadcast_buffers": False},
]
#: small buckets, so that each bucket (one block) fits half the parameter bytes
SMALL_BUCKETS = {"bucket_cap_mb_list": [1024 / 2**20]}


def test_ddp_pass_through_is_plain_ddp():
    runs = [("flow", None, o) for o in DDP_OPTIONS + [{"find_unused_parameters": True}]]
    spawn(workers.ddp_worker, "cpu", runs)


def test_ddp_on_sim_is_plain_ddp():
    spawn(workers.ddp_worker, "sim", [("flow", None, o) for o in DDP_OPTIONS])


def test_ddp_find_unused_parameters_on_sim_is_refused_when_built():
    # DDP needs pinned memory of the device for it, which a Python-registered device cannot
    # allocate: refused before DDP asks for a process group or touches the module.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchTensorRef import tensorsManager

    if tensorsManager.device != "sim":
        pytest.skip("the refusal is for the simulated device")
    model = workers.Net(unused=True)
    params = dict(model.named_parameters())
    saved = {name: workers.values(p) for name, p in params.items()}
    state = {id(m): dict(vars(m)) for m in model.modules()}
    for call in (lambda: DDP(model, find_unused_parameters=True),
                 lambda: DDP(module=model, bucket_cap_mb=1, find_unused_parameters=True)):
        with pytest.raises(ValueError, match=r"find_unused_parameters=True\) cannot run on TensorRefs of \"sim\".*"
                                             r"Leave find_unused_parameters out"):
            call()
    assert dict(model.named_parameters()) == params
    for name, p in model.named_parameters():
        assert torch.equal(workers.values(p), saved[name]), name
    assert all(vars(m) == state[id(m)] for m in model.modules())


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_ddp_pages_each_rank_at_half_the_parameters(strategy):
    runs = [(strategy, 0.5, dict(SMALL_BUCKETS)), (strategy, 0.5, dict(SMALL_BUCKETS, gradient_as_bucket_view=True))]
    spawn(workers.ddp_worker, "sim", runs)


@pytest.mark.cuda
def test_ddp_on_gpus_with_nccl_is_plain_ddp():
    world = min(torch.cuda.device_count(), 2)
    runs = [("flow", None, o) for o in DDP_OPTIONS + [{"find_unused_parameters": True}]]
    spawn(workers.ddp_worker, "cuda", runs, "nccl", world=world)


#: what gloo prints when a rank's teardown destroys a thread still running
TEARDOWN_ABORT = "terminate called without an active exception"
#: runs of a script whose ranks wrote their outputs and aborted in Gloo's teardown (plain
#: torch's did twice in a row on a loaded 2-core machine)
TEARDOWN_TRIES = 3


def _torchrun(*args, out):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("TORCHTENSORREF_SIM_WORKSPACE", None)  # (the runner's run names "sim" and a 5 KiB budget)
    outputs = [os.path.join(out, f"rank{r}.txt") for r in (0, 1)]
    for attempt in range(TEARDOWN_TRIES):
        for path in outputs:
            if os.path.exists(path):
                os.remove(path)  # (what this attempt writes, not an earlier one)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(_free_port()), *args, out]
        done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S, env=env)
        # Gloo's teardown can abort a rank after the script's work is done and written
        # ("terminate called without an active exception", SIGABRT), in plain torch as under
        # the runner: such a run is run again; a failure before the outputs is not.
        written = all(os.path.exists(path) for path in outputs)
        if (done.returncode == 0 or attempt == TEARDOWN_TRIES - 1
                or not (written and TEARDOWN_ABORT in done.stderr)):
            break
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_runs_the_runner_on_every_rank(tmp_path):
    script = os.path.join(TESTS, "distributed_train.py")
    plain, managed = tmp_path / "plain", tmp_path / "managed"
    plain.mkdir()
    managed.mkdir()
    _torchrun(script, out=str(plain))
    done = _torchrun("-m", "torchTensorRef", "run", "--device", "sim", "--strategy", "flow", "--budget", "12KiB",
                     script, out=str(managed))
    for rank in (0, 1):  # each rank's own summary
        assert done.stderr.count(f"torchTensorRef (rank {rank}): device sim, strategy flow, budget 12.0 KiB") == 1
    for rank in (0, 1):
        expected = (plain / f"rank{rank}.txt").read_text().splitlines()
        got = (managed / f"rank{rank}.txt").read_text().splitlines()
        assert got[:-1] == expected[:-1], f"rank {rank}: losses differ"
        assert (expected[-1], got[-1]) == ("device cpu", "device sim:0")
    peaks = [line.split("peak ")[1].split(" resident")[0] for line in done.stderr.splitlines() if "resident of" in line]
    assert len(peaks) == 2 and all(p.endswith(" B") or (p.endswith(" KiB") and float(p.split()[0]) <= 12.0)
                                   for p in peaks), peaks


def test_data_parallel_over_several_gpus_is_refused(monkeypatch):
    import torchTensorRef

    model = torch.nn.Linear(4, 4)
    assert isinstance(model.weight, torchTensorRef.TensorRef)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"DataParallel over 2 GPUs .*Use DistributedDataParallel"):
        torch.nn.DataParallel(model)
    with pytest.raises(RuntimeError, match=r"DataParallel over 2 GPUs"):
        torch.nn.DataParallel(model, device_ids=[0, 1])


def test_data_parallel_without_gpus_runs_the_module():
    # Without CUDA, DataParallel calls the module itself: nothing to refuse.
    model = torch.nn.Linear(4, 4)
    x = torch.rand(3, 4)
    assert torch.equal(torch.nn.DataParallel(model)(x).cpu(), model(x).cpu())


#: FSDP2's options, each run plain and managed in the same processes
FSDP2_OPTIONS = [{}, {"reshard_after_forward": False}, {"mp_policy": (torch.bfloat16, torch.float32)},
                 {"no_sync": True}, {"prefetch": True}]


def test_fsdp2_pass_through_is_plain_fsdp2():
    spawn(workers.fsdp_worker, "cpu", [("flow", None, o) for o in FSDP2_OPTIONS])


@fsdp2_on_sim
def test_fsdp2_on_sim_is_plain_fsdp2():
    spawn(workers.fsdp_worker, "sim", [("flow", None, o) for o in FSDP2_OPTIONS])


@fsdp2_on_sim
@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_fsdp2_pages_each_rank_at_half_the_parameters(strategy):
    spawn(workers.fsdp_worker, "sim", [(strategy, 0.5, o) for o in FSDP2_OPTIONS])


@fsdp2_on_sim
@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_fsdp2_pages_each_rank_under_a_host_budget_too(strategy):
    # (the module is managed in place from plain tensors, whose host copies are shared and
    # stay: about the parameter bytes; the rest of the host budget is what pages)
    spawn(workers.fsdp_worker, "sim", [(strategy, 0.5, {"host_fraction": 2.0, "room_fraction": 1.0})])


def test_fsdp2_functions_are_wrapped_when_imported_and_restored_by_unpatch():
    import torch.distributed.fsdp as fsdp
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    import torchTensorRef
    from torchTensorRef.integrations.patching import _FunctionWrapper

    places = [(fsdp, "fully_shard"), (fsdp._fully_shard, "fully_shard"), (_fsdp_param, "alloc_storage"),
              (_fsdp_param, "free_storage"), (_fsdp_param_group, "alloc_storage")]
    assert all(isinstance(getattr(m, n), _FunctionWrapper) for m, n in places)
    torchTensorRef.unpatch()
    try:
        assert not any(isinstance(getattr(m, n), _FunctionWrapper) for m, n in places)
    finally:
        torchTensorRef.patch()
    assert all(isinstance(getattr(m, n), _FunctionWrapper) for m, n in places)
    assert hasattr(fsdp.fully_shard, "state")  # (FSDP2 reads its state through the name)


def test_fsdp2_on_cuda_is_refused_before_it_shards(monkeypatch):
    # Checked without a GPU: the refusal comes before FSDP2 looks at the device or the mesh.
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from torchTensorRef import TensorRef, tensorsManager as tm

    model = workers.Stack(depth=1)
    params = dict(model.named_parameters())
    state = {id(m): dict(vars(m)) for m in model.modules()}
    monkeypatch.setattr(type(tm.backend), "name", "cuda")
    monkeypatch.setattr(tm.backend, "resolved", False, raising=False)  # (read by tm.device)
    with pytest.raises(RuntimeError, match=r"FSDP2 \(fully_shard\) cannot run on TensorRefs on device .*CUDA "
                                           r"streams of its own.*Use DistributedDataParallel"):
        fully_shard(model.layers[0])
    monkeypatch.undo()
    assert dict(model.named_parameters()) == params
    assert all(isinstance(p, TensorRef) for p in params.values())
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    assert all(vars(m) == state[id(m)] for m in model.modules())


def test_discard_drops_the_device_copy_without_writing_it_back():
    # What FSDP2's free of a gathered parameter becomes (Note [FSDP2 on TensorRefs])
    from torchTensorRef import tensorsManager as tm

    if tm.device != "sim":
        pytest.skip("moves counted on the simulated device")
    tm.strategy = "flow"  # (keeps blocks resident between ops)
    t = torch.ones(256, device="sim")
    t.add_(1)
    tm.discard(t)  # no host copy yet: written back once to get one
    assert not block_of(t).resident and tm.stats()["writebacks"] == 1
    t.mul_(3)  # dirty again, with a host copy
    moved = tm.stats()["bytes_to_host"]
    tm.discard(t)
    assert not block_of(t).resident
    assert (tm.stats()["writebacks"], tm.stats()["bytes_to_host"]) == (1, moved)
    tm.pin(t)
    t.add_(1)
    tm.discard(t)  # a pinned block stays
    assert block_of(t).resident
    tm.unpin(t)


def test_ddp_s_broadcast_buckets_fit_the_managers_share_beside_the_workspaces():
    # DDP broadcasts a module's state at construction in buckets of ``buffer_size`` bytes,
    # flattened and copied back (about twice a bucket resident): a quarter of the manager's
    # share. Of the raw budget, which on a GPU also holds cuBLAS's workspaces, a bucket could
    # be larger than all the room the manager has.
    from torchTensorRef import tensorsManager as tm
    from torchTensorRef.integrations.distributed import broadcast_coalesced_wrapper

    if tm.device != "sim":
        pytest.skip("the workspaces emulated on the simulated device")
    previous = tm.sim_workspace
    tm.sim_workspace = "1MiB"
    try:
        tensors = [torch.ones(64)]
        tm.budget = tm.outside_bytes() + 64 * 1024
        asked = []
        broadcast_coalesced_wrapper(lambda *a, **k: asked.append(a[2]), None, (None, tensors, 2**30, 0), {})
        assert asked == [tm.accounting.share() // 4] and 64 * 1024 // 4 - 4096 < asked[0] <= 64 * 1024 // 4
    finally:
        tm.budget = None
        tm.sim_workspace = previous


@fsdp2_on_sim
def test_fsdp2_with_cpu_offload_is_refused_before_it_shards():
    spawn(workers.fsdp_refused_worker, "sim")


def test_fsdp1_on_one_process_is_plain_fsdp1():
    # FSDP1 swaps its flat parameter's views in with ``param.data = view`` during each call:
    # as a region, the call's plain views took them, and after one forward the module's
    # parameters were gone from named_parameters() and state_dict() (then a segfault)
    script = (
        "import sys, torch, torch.nn as nn, torch.distributed as dist\n"
        "if sys.argv[1] == 'managed':\n"
        "    import torchTensorRef\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "dist.init_process_group(backend='gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "torch.manual_seed(0)\n"
        "m = FSDP(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), use_orig_params=True, device_id='cpu')\n"
        "x = torch.arange(8.).view(2, 4)\n"
        "with torch.no_grad():\n"
        "    m(x)\n"
        "print([n for n, _ in m.named_parameters()], list(m.state_dict()))\n"
        "m(x).sum().backward()\n"
        "print([p.grad.tolist() for p in m.parameters()], m(x).tolist())\n"
        # (left to the interpreter's exit, gloo's threads aborted it now and then, under
        # load, with or without the package: "terminate called without an active exception")
        "dist.destroy_process_group()\n"
    )
    out = {}
    for mode in ("plain", "managed"):
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=DEADLINE_S)
        assert done.returncode == 0, done.stderr[-2000:]
        out[mode] = done.stdout
    assert out["managed"] == out["plain"]
