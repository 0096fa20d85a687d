"""The budget covers what the device holds outside the manager (Note [Budget on CUDA]).

On a GPU, cuBLAS and cuBLASLt keep a workspace per thread's handle for the life of the
process (33 MiB on an H100), and the budget counted them only once a device reading
happened to see them: the demo failed with "aten.view needs 33.0 MiB". ``"sim"`` emulates
those workspaces (``tensorsManager.sim_workspace``) so that CI shows what a GPU would.
"""

from __future__ import annotations

import gc

import threading

import pytest
import torch

import torchTensorRef
from torchTensorRef import OutOfBudgetError, tensorsManager
from torchTensorRef.core.errors import BudgetBelowFloorError

from paired import assert_identical, plain_torch

MiB = 2**20
WORKSPACE = MiB

pytestmark = pytest.mark.skipif(
    __import__("conftest").TEST_DEVICE != "sim", reason='emulated workspaces are a setting of "sim"')


@pytest.fixture
def workspaces():
    """The test device with an emulated 1 MiB workspace per thread; the previous setting afterwards."""
    tm = tensorsManager
    gc.collect()  # (an earlier test's plain device tensors in reference cycles would read as outside)
    previous = tm.sim_workspace  # (TORCHTENSORREF_SIM_WORKSPACE runs the whole suite with workspaces)
    tm.sim_workspace = WORKSPACE  # (no thread has made its workspace yet)
    yield tm
    tm.budget = None
    tm.sim_workspace = previous


def test_workspaces_are_made_for_this_thread_and_the_backward_and_counted(workspaces):
    tm = workspaces
    assert tm.stats()["outside_bytes"] == 0  # nothing has run yet
    assert tm.outside_bytes() == 2 * WORKSPACE  # this thread's and autograd's, made first
    assert tm.stats()["outside_bytes"] == 2 * WORKSPACE


def test_a_budget_at_or_below_the_workspaces_is_refused_and_changes_nothing(workspaces):
    tm = workspaces
    tm.budget = "8MiB"
    with pytest.raises(BudgetBelowFloorError, match=r"more than the 2\.0 MiB .* outside the manager") as info:
        tm.budget = 2 * WORKSPACE
    assert isinstance(info.value, ValueError) and isinstance(info.value, OutOfBudgetError)
    assert tm.budget == 8 * MiB


def test_room_leaves_out_what_is_allocated_outside_the_manager(workspaces):
    tm = workspaces
    tm.budget = 3 * MiB
    x = torch.ones(1024)
    x.toGPU()
    assert tm.stats()["device_bytes"] == 4096
    assert tm.room() == 3 * MiB - 2 * WORKSPACE - 4096


def test_an_op_that_fits_the_budget_but_not_beside_the_workspaces_names_them(workspaces):
    tm = workspaces
    tm.budget = 2 * WORKSPACE + 64 * 1024
    x = torch.ones(32 * 1024)  # 128 KiB: alone under the budget, not beside 2 MiB of workspaces
    with pytest.raises(OutOfBudgetError, match="outside the manager"):
        x.cumsum(0)  # (a scan: it cannot run in chunks)


def test_a_new_thread_adds_its_workspace_and_the_budget_still_holds(workspaces):
    tm = workspaces
    tm.strategy = "flow"
    tm.budget = 3 * WORKSPACE + 96 * 1024
    torch.manual_seed(0)
    ws = [torch.randn(64, 64) for _ in range(8)]  # 128 KiB: must be paged beside 3 workspaces
    tm.reset_stats()
    out = []
    worker = threading.Thread(target=lambda: out.append(sum((w * 2).sum() for w in ws)))
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    s = tm.stats()
    assert s["outside_bytes"] == 3 * WORKSPACE  # this thread, the backward, the worker
    assert s["device_bytes"] + s["outside_bytes"] <= tm.budget
    assert s["worst_overshoot_bytes"] == 0  # (it counts the workspaces too)
    with plain_torch():
        torch.manual_seed(0)
        plain_ws = [torch.randn(64, 64) for _ in range(8)]
        want = sum((w * 2).sum() for w in plain_ws)
    assert_identical(want, out[0])


def test_training_within_a_budget_over_the_workspaces_matches_plain_torch(workspaces):
    tm = workspaces
    tm.strategy = "flow"

    def train():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            loss = model(torch.randn(4, 64)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    with plain_torch():
        want = train()
    weights = 6 * (64 * 64 + 64) * 4
    tm.budget = tm.outside_bytes() + weights // 2  # half the weights beside the workspaces
    tm.reset_stats()
    got = train()
    assert_identical(want, got)
    s = tm.stats()
    assert s["evictions"] > 0
    assert s["peak_device_bytes"] + s["outside_bytes"] <= tm.budget
    assert s["worst_overshoot_bytes"] == 0


def test_foreach_slices_leave_out_the_workspaces(workspaces):
    # The slices of a multi-tensor op were sized from the whole budget: on the GPU,
    # _foreach_mul_ "needed" the budget plus 64 MiB of workspaces.
    tm = workspaces
    torch.manual_seed(0)
    xs = [torch.randn(128, 128) for _ in range(6)]  # 384 KiB
    with plain_torch():
        torch.manual_seed(0)
        plain_xs = [torch.randn(128, 128) for _ in range(6)]
        torch._foreach_mul_(plain_xs, 3.0)
    tm.budget = tm.outside_bytes() + 200 * 1024  # the list fits the budget, not beside the workspaces
    tm.reset_stats()
    torch._foreach_mul_(xs, 3.0)
    assert_identical(plain_xs, xs)
    s = tm.stats()
    assert s["worst_overshoot_bytes"] == 0
    assert s["peak_device_bytes"] + s["outside_bytes"] <= tm.budget


def test_the_environment_sets_the_emulated_workspace():
    tm = tensorsManager
    try:
        torchTensorRef.configure_from_environment({"TORCHTENSORREF_SIM_WORKSPACE": "1MiB"})
        assert tm.sim_workspace == MiB
        assert tm.outside_bytes() == 2 * MiB
    finally:
        tm.sim_workspace = 0
    with pytest.raises(ValueError, match="TORCHTENSORREF_SIM_WORKSPACE"):
        torchTensorRef.configure_from_environment({"TORCHTENSORREF_SIM_WORKSPACE": "lots"})


def test_to_gpu_of_a_block_that_fits_the_budget_but_not_beside_the_workspaces_says_so(workspaces):
    # It was checked against the whole budget, and refused later by the room-making.
    tm = workspaces
    tm.budget = 2 * WORKSPACE + 64 * 1024
    x = torch.ones(32 * 1024)  # 128 KiB
    with pytest.raises(OutOfBudgetError, match="outside the manager") as info:
        x.toGPU()
    assert info.value.outside == 2 * WORKSPACE
    assert not x.proxyInfo.on_device
