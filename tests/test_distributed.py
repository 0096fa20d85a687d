"""torch.distributed with TensorRefs: each rank a process with its own manager and budget.

The ranks run in spawned processes (``distributed_workers.py``) over ``gloo`` on the CPU,
with a deadline so that a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

import distributed_workers as workers

DEADLINE_S = 120


def spawn(fn, *args, world: int = 2):
    """Run ``fn(rank, world, init_file, *args)`` in ``world`` processes; fail on error or hang."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="ttr-dist-")
    init_file = os.path.join(folder, "init")
    context = mp.spawn(fn, args=(world, init_file, *args), nprocs=world, join=False)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish in {DEADLINE_S} s")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()


@pytest.fixture(autouse=True)
def _workers_import_this_tree(monkeypatch):
    # Spawned ranks import the package found first on their path: the one under test.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")]))


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
    # (find_unused_parameters needs pinned memory of the device, which a Python-registered
    # device cannot provide: docs/distributed.md)
    spawn(workers.ddp_worker, "sim", [("flow", None, o) for o in DDP_OPTIONS])


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_ddp_pages_each_rank_at_half_the_parameters(strategy):
    runs = [(strategy, 0.5, dict(SMALL_BUCKETS)), (strategy, 0.5, dict(SMALL_BUCKETS, gradient_as_bucket_view=True))]
    spawn(workers.ddp_worker, "sim", runs)
