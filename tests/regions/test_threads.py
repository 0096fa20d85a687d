"""Regions and threads (Note [Regions and threads] in regions/threads.py): a region swaps its
module's tensors for plain views, so other threads' module calls wait for it, and a call is
a region only while no other thread is inside a module call. (Several threads training one
model through regions: tests/memory/test_manager.py, test_backward_on_several_threads_...)"""

from __future__ import annotations

import threading

import torch

import torchTensorRef
from torchTensorRef import TensorRef, regions, tensorsManager as tm
from paired import assert_identical, budget, plain_torch

TIMEOUT = 60


class Gate(torch.nn.Module):
    """A Linear whose call, as a region, stops at a gate until told to go on: before its
    product, or once it is allocated (``after_product``)."""

    def __init__(self, width: int = 8, after_product: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(width, width)
        self.after_product = after_product
        self.inside = threading.Event()
        self.go = threading.Event()
        self.hold = False

    def _stop(self):
        if self.hold and regions.in_region():
            self.inside.set()
            assert self.go.wait(TIMEOUT)

    def forward(self, x):
        if not self.after_product:
            self._stop()
        h = self.lin(x)
        if self.after_product:
            self._stop()
        return h.relu()


def test_a_module_call_waits_while_another_thread_s_region_has_its_tensors_swapped():
    with plain_torch():
        x = torch.randn(2, 8)
        plain_model = Gate().to(tm.torch_device)
        with torch.no_grad():
            plain = plain_model(x.to(tm.torch_device))
    model = regions.region(Gate())
    mx = torchTensorRef.manage(x.cpu())
    with torch.no_grad():
        model(mx)  # (measured: op by op)
    model.hold = True
    outs, errors, order = {}, [], []

    def call(name):
        try:
            with torch.no_grad():
                outs[name] = model(mx)
            order.append(name)
        except BaseException as e:  # reported below
            errors.append(e)

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert model.inside.wait(TIMEOUT)  # the first call is inside its region, tensors swapped
    second = threading.Thread(target=call, args=("second",))
    second.start()
    second.join(0.5)
    assert second.is_alive() and "second" not in outs  # it waits: the module's tensors are views now
    model.go.set()
    first.join(TIMEOUT)
    second.join(TIMEOUT)
    assert not first.is_alive() and not second.is_alive() and not errors, errors
    assert order == ["first", "second"]
    assert all(isinstance(p, TensorRef) for p in model.parameters())  # given back
    assert_identical(plain, outs["first"])
    assert_identical(plain, outs["second"])



def _rounded(*tensors) -> int:
    return sum((t.nbytes + 511) // 512 * 512 for t in tensors)  # (as the device's allocator counts them)


def test_another_thread_s_op_leaves_a_region_the_room_it_keeps_for_what_it_allocates(monkeypatch):
    # A region's kernels run outside the manager's lock, in the room the manager kept for
    # what they allocate; another thread's op took that room, and the device held more than
    # the budget (the fixture asks the device after every op)
    monkeypatch.setattr(tm, "check_device", True)
    tm.strategy = "flow"
    x = torch.randn(16, 64)
    with plain_torch():
        plain_model = Gate(64, after_product=True).to(tm.torch_device)
        with torch.no_grad():
            plain = plain_model(x.to(tm.torch_device))
    model = regions.region(Gate(64, after_product=True))
    spare, other = torch.randn(4096), torch.randn(1024)  # 16 KiB the other op may evict, its 4 KiB input
    with torch.no_grad():
        model(x)  # (measured: op by op)
        model(x)
    model.hold = True
    outs, errors = {}, []

    def call():
        try:
            with torch.no_grad():
                outs["region"] = model(x)
        except BaseException as e:  # reported below
            errors.append(e)

    # The region's working set and spare, and room for one of the two: what the region
    # allocates inside (its product and their relu) or the other op (``other`` and its double);
    # and the workspaces of the region's thread, new on CUDA
    tm.evict_all()
    spare.add_(0)
    tm.budget = budget(_rounded(x, model.lin.weight, model.lin.bias, spare) + 2 * _rounded(other), threads=1)
    first = threading.Thread(target=call)
    first.start()
    assert model.inside.wait(TIMEOUT)  # inside its region, its product allocated
    doubled = other * 2  # (it must evict spare)
    model.go.set()
    first.join(TIMEOUT)
    assert not first.is_alive() and not errors, errors
    assert_identical(plain, outs["region"])
    with plain_torch():
        assert_identical(other.target.clone().to(tm.torch_device) * 2, doubled)
