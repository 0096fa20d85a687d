"""Tests of patching: which functions return TensorRefs, when, and undoing it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef
from torchTensorRef.integrations import creation, patching
from torchTensorRef.memory.devices import default_device
from torchTensorRef.memory.manager import tensorsManager
from torchTensorRef.memory.sim.tensor import SimTensor
from torchTensorRef.strategies import NAMES

from conftest import TEST_DEVICE
from paired import assert_identical, budget, plain_torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.range is deprecated")

def _saved_file(tmp_path):
    path = tmp_path / "t.pt"
    with torchTensorRef.disabled():
        torch.save(torch.arange(6.0), path)
    return path


def _raw_file(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(4, dtype=np.float32).tofile(path)
    return path


#: one call per name in ``patching.CREATION_FUNCTIONS``; takes pytest's ``tmp_path``
CALLS = {
    "rand": lambda p: torch.rand(2, 3),
    "randn": lambda p: torch.randn(2, 3),
    "randint": lambda p: torch.randint(0, 10, (4,)),
    "randperm": lambda p: torch.randperm(5),
    "normal": lambda p: torch.normal(0.0, 1.0, (3,)),
    "poisson": lambda p: torch.poisson(torch.ones(3)),
    "zeros": lambda p: torch.zeros(2, 2),
    "ones": lambda p: torch.ones(2, 2),
    "empty": lambda p: torch.empty(2, 2),
    "empty_strided": lambda p: torch.empty_strided((2, 2), (1, 2)),
    "empty_permuted": lambda p: torch.empty_permuted((2, 3), (1, 0)),
    "full": lambda p: torch.full((2,), 7.0),
    "arange": lambda p: torch.arange(5),
    "range": lambda p: torch.range(0, 4),
    "linspace": lambda p: torch.linspace(0, 1, 5),
    "logspace": lambda p: torch.logspace(0, 1, 5),
    "eye": lambda p: torch.eye(3),
    "tensor": lambda p: torch.tensor([1.0, 2.0]),
    "as_tensor": lambda p: torch.as_tensor([1, 2, 3]),
    "asarray": lambda p: torch.asarray([1, 2, 3]),
    "from_numpy": lambda p: torch.from_numpy(np.arange(3.0)),
    "frombuffer": lambda p: torch.frombuffer(bytearray(b"\x01\x02\x03\x04"), dtype=torch.uint8),
    "from_file": lambda p: torch.from_file(str(_raw_file(p)), size=4, dtype=torch.float32),
    "from_dlpack": lambda p: torch.from_dlpack(np.arange(3.0)),
    "scalar_tensor": lambda p: torch.scalar_tensor(3.0),
    "tril_indices": lambda p: torch.tril_indices(3, 3),
    "triu_indices": lambda p: torch.triu_indices(3, 3),
    "bartlett_window": lambda p: torch.bartlett_window(5),
    "blackman_window": lambda p: torch.blackman_window(5),
    "hamming_window": lambda p: torch.hamming_window(5),
    "hann_window": lambda p: torch.hann_window(5),
    "kaiser_window": lambda p: torch.kaiser_window(5),
    "load": lambda p: torch.load(_saved_file(p), weights_only=True),
}

PRESENT = [name for name in patching.CREATION_FUNCTIONS if hasattr(torch, name)]


def test_every_creation_function_has_a_call_here():
    assert set(patching.CREATION_FUNCTIONS) <= set(CALLS)


def _call(name, tmp_path):
    torch.manual_seed(0)
    return CALLS[name](tmp_path)


@pytest.mark.parametrize("name", PRESENT)
def test_creation_function_returns_tensor_ref_when_patched(name, tmp_path):
    managed = _call(name, tmp_path)
    assert type(managed) is TensorRef
    with plain_torch():  # (on the managed tensors' device: random ones draw from its generator)
        plain = _call(name, tmp_path)
    assert type(plain) in (torch.Tensor, SimTensor)  # a plain tensor (of the "sim" device, or not)
    assert managed.dtype == plain.dtype
    if name not in ("empty", "empty_strided", "empty_permuted"):
        assert_identical(plain, managed)


@pytest.mark.parametrize("strategy", NAMES)
def test_factories_whose_numbers_hang_on_the_device_are_made_where_torch_makes_them(strategy, monkeypatch):
    # Random factories and windows are made on the device, whatever the strategy does with new
    # tensors, as under set_default_device: their numbers are its generator's and its
    # arithmetic's (CUDA's window cosines differ from the CPU's in their last bits). No default
    # device reaches torch.normal: it draws on the host, from the CPU's generator.
    tensorsManager.strategy = strategy
    made_on_device = []
    on_device = creation._on_device
    monkeypatch.setattr(creation, "_on_device", lambda *a: made_on_device.append(a[-1]) or on_device(*a))
    for name in sorted(creation.ON_DEVICE):
        _call(name, None)
    assert made_on_device == [f"torch.{name}" for name in sorted(creation.ON_DEVICE)]
    managed = _call("normal", None)
    with torch.device(tensorsManager.torch_device):  # (which torch.normal ignores)
        in_context = _call("normal", None)
    assert len(made_on_device) == len(creation.ON_DEVICE) and type(managed) is TensorRef
    with torchTensorRef.disabled():
        expected = _call("normal", None)
    assert_identical(expected, managed)
    assert_identical(expected, in_context)


def test_a_generator_draws_on_its_own_device_inside_disabled_with_a_device():
    # disabled(device=...) gives its device to creation functions as a device context would,
    # but not against a generator of another device: the numbers are that generator's, as a
    # managed factory given it draws them (on the host), not CUDA's error
    with plain_torch():
        plain = torch.randint(0, 9, (5,), generator=torch.Generator().manual_seed(4))
    assert plain.device.type == "cpu"
    managed = torch.randint(0, 9, (5,), generator=torch.Generator().manual_seed(4))
    assert_identical(plain, managed)


#: data holding tensors: torch reads each one's value (``item()``), its dtype counting in the result's
DATA_WITH_TENSORS = {
    "tensor of 0-d tensors": lambda t: torch.tensor([t(1.5), t(-2.25)]),
    "nested, a number beside": lambda t: torch.tensor([[1, t(2)], (t(3), 4)]),
    "integers, dtype given": lambda t: torch.tensor((t(7), t(9)), dtype=torch.float64),
    "one-element tensors": lambda t: torch.tensor([t([0.5]), t([[2.0]])]),
    "data= keyword": lambda t: torch.tensor(data=[t(True), t(False)]),
    "as_tensor": lambda t: torch.as_tensor([t(1.5), t(2.5)]),
    "asarray": lambda t: torch.asarray([t(3), t(4)]),
    "a tensor's new_tensor": lambda t: t([0.5]).new_tensor([[t(1.5)], [t(2.0)]]),
}


@pytest.mark.parametrize("case", list(DATA_WITH_TENSORS))
def test_tensor_from_a_list_of_tensor_refs_has_their_values(case):
    """``torch.tensor([a, b])`` with TensorRefs in the list: torch read their bytes, which a
    TensorRef does not hold, and raised; plain torch gives their values."""
    with plain_torch() if TEST_DEVICE == "cuda" else torchTensorRef.disabled():
        # (plain "sim" tensors have no ``item()`` kernel in C++: their values are the CPU's)
        plain = DATA_WITH_TENSORS[case](torch.tensor)
    managed = DATA_WITH_TENSORS[case](torch.tensor)
    assert type(managed) is TensorRef
    assert managed.dtype == plain.dtype and managed.shape == plain.shape
    assert managed.tolist() == plain.tolist()


def test_the_legacy_constructor_takes_a_list_of_tensor_refs():
    """``torch.Tensor([a, b])`` (diffusers' Euler scheduler builds its continuous timesteps so)
    gives the plain CPU tensor plain torch gives; ``unpatch()`` takes the constructor back."""
    with plain_torch() if TEST_DEVICE == "cuda" else torchTensorRef.disabled():
        plain = torch.Tensor([torch.tensor(0.25), torch.tensor([3.5])])
    managed = torch.Tensor([torch.tensor(0.25), torch.tensor([3.5])])
    assert type(managed) is type(plain) is torch.Tensor and managed.device == plain.device
    assert torch.equal(managed, plain)
    assert torch.Tensor(2, 3).shape == (2, 3)
    torchTensorRef.unpatch()
    try:
        assert "__new__" not in vars(torch.Tensor)
        assert torch.Tensor([1.0, 2.0]).tolist() == [1.0, 2.0]
    finally:
        torchTensorRef.patch()
    assert "__new__" in vars(torch.Tensor)


def test_a_list_of_tensors_of_several_elements_raises_as_in_plain_torch():
    with pytest.raises(ValueError, match="only one element tensors"):
        torch.tensor([torch.ones(2), torch.zeros(2)])


@pytest.mark.parametrize("name", PRESENT)
def test_creation_function_returns_plain_tensor_after_unpatch(name, tmp_path):
    torchTensorRef.unpatch()
    assert not torchTensorRef.is_patched()
    assert type(_call(name, tmp_path)) is torch.Tensor


def test_unpatch_restores_the_originals():
    torchTensorRef.unpatch()
    originals = {name: getattr(torch, name) for name in PRESENT}
    torchTensorRef.patch()
    assert torch.zeros is not originals["zeros"]
    torchTensorRef.unpatch()
    for name in PRESENT:
        assert getattr(torch, name) is originals[name], name
    assert torch.save is torch.serialization.save


def test_patch_twice_wraps_once():
    torchTensorRef.patch()
    wrapper = torch.zeros
    torchTensorRef.patch()
    assert torch.zeros is wrapper
    assert torchTensorRef.is_patched()
    torchTensorRef.unpatch()
    assert type(torch.zeros(2)) is torch.Tensor
    assert not hasattr(torch.zeros, "__wrapped__")


def test_unpatch_twice_is_harmless():
    torchTensorRef.unpatch()
    original = torch.zeros
    torchTensorRef.unpatch()
    assert torch.zeros is original
    assert not torchTensorRef.is_patched()
    assert type(torch.ones(2)) is torch.Tensor


def test_patch_unpatch_patch():
    torchTensorRef.unpatch()
    torchTensorRef.patch()
    assert torchTensorRef.is_patched()
    assert type(torch.zeros(2)) is TensorRef
    torchTensorRef.unpatch()
    assert type(torch.zeros(2)) is torch.Tensor
    torchTensorRef.patch()
    assert type(torch.zeros(2)) is TensorRef


def test_unpatch_leaves_alone_a_function_someone_else_replaced():
    def theirs(*args, **kwargs):
        return "theirs"

    torchTensorRef.unpatch()
    original = torch.zeros
    torchTensorRef.patch()
    torch.zeros = theirs
    try:
        torchTensorRef.unpatch()
        assert torch.zeros is theirs
    finally:
        torch.zeros = original


def test_disabled_gives_plain_tensors_and_nests():
    with torchTensorRef.disabled():
        with torchTensorRef.disabled():
            assert type(torch.zeros(2)) is torch.Tensor
        assert type(torch.zeros(2)) is torch.Tensor
    assert type(torch.zeros(2)) is TensorRef


def test_disabled_still_manages_ops_on_existing_refs():
    x = torch.ones(3)
    with torchTensorRef.disabled():
        y = x + 1
        expected = torch.full((3,), 2.0)
    assert type(y) is TensorRef
    torch.testing.assert_close(y.target, expected)


def test_disabled_is_per_thread():
    inside = threading.Event()
    checked = threading.Event()
    seen = {}

    def other_thread():
        inside.wait()
        seen["other"] = type(torch.zeros(2))
        checked.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with torchTensorRef.disabled():
        inside.set()
        assert checked.wait(30)
        seen["this"] = type(torch.zeros(2))
    thread.join()
    assert seen == {"this": torch.Tensor, "other": TensorRef}


class _DoubleMadeInBackward(torch.autograd.Function):
    """Doubles; its backward makes its result with a creation function (as some of torch's
    Python ops do), on the thread autograd runs it on."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        made = torch.empty(grad.shape, device=grad.device)
        ctx.made_type = type(made)
        return made.copy_(grad * 2)


@pytest.mark.skipif(TEST_DEVICE != "sim", reason="disabled() carries its state to autograd's "
                    "threads on the simulated device only (a dispatch mode); on CUDA that would "
                    "slow every plain op")
def test_disabled_reaches_the_backward_of_plain_tensors_on_autograd_threads():
    # A tight budget: a creation that became managed in backward would not fit.
    torchTensorRef.tensorsManager.budget = budget(8)  # (8 bytes above what the device holds now)
    with plain_torch():
        x = torch.randn(4, requires_grad=True)
        y = _DoubleMadeInBackward.apply(x)
        y.sum().backward()
        expected = torch.full((4,), 2.0)
    assert not isinstance(x.grad, TensorRef)
    assert y.grad_fn.made_type is not TensorRef
    assert_identical(x.grad, expected)


def test_a_device_context_inside_disabled_gives_its_own_device():
    # disabled(device=...) made a model built under ``with torch.device("meta")`` on the device
    # instead: transformers' from_pretrained then initialised its buffers early, and replaced
    # them with empty ones afterwards (a Llama's rotary frequencies were uninitialised memory)
    device = torchTensorRef.tensorsManager.torch_device
    with torchTensorRef.disabled(device=device):
        with torch.device("meta"):
            layer = torch.nn.Linear(4, 4)
            made = torch.zeros(3)
        outside = torch.zeros(3)
    assert layer.weight.is_meta and made.is_meta
    assert outside.device.type == device.type and type(outside) is not TensorRef


def test_meta_tensors_stay_plain():
    x = torch.empty(3, device="meta")
    assert type(x) is torch.Tensor and x.is_meta
    y = torch.zeros(2, 2, device=torch.device("meta"))
    assert type(y) is torch.Tensor and y.is_meta


def test_meta_device_context_stays_plain():
    with torch.device("meta"):
        x = torch.zeros(3)
        layer = torch.nn.Linear(4, 4)
    assert type(x) is torch.Tensor and x.is_meta
    assert type(layer.weight) is torch.nn.Parameter and layer.weight.is_meta
    assert type(torch.zeros(3)) is TensorRef


def test_sparse_tensors_stay_plain():
    x = torch.zeros(2, 2, layout=torch.sparse_coo)
    assert type(x) is torch.Tensor and x.layout == torch.sparse_coo


def test_load_returns_tensor_refs_inside_containers(tmp_path):
    path = tmp_path / "sd.pt"
    with torchTensorRef.disabled():
        plain = {"w": torch.arange(4.0), "b": [torch.ones(2), torch.zeros(1)]}
        torch.save(plain, path)
    loaded = torch.load(path, weights_only=True)
    assert type(loaded["w"]) is TensorRef
    assert all(type(t) is TensorRef for t in loaded["b"])
    assert torch.equal(loaded["w"].target, plain["w"])


class _CreatingDataset(torch.utils.data.Dataset):
    """Creates tensors in ``__getitem__`` and reports what type they got."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        t = torch.full((3,), float(i))
        return t, type(t).__name__


def test_dataloader_workers_get_plain_tensors():
    loader = torch.utils.data.DataLoader(_CreatingDataset(), batch_size=2, num_workers=2)
    values, kinds = [], []
    for batch, names in loader:
        values.append(batch)
        kinds.extend(names)
    assert kinds == ["Tensor"] * 4
    assert type(torch.zeros(1)) is TensorRef  # the main process still gets TensorRefs
    with torchTensorRef.disabled():
        expected = torch.arange(4.0).repeat_interleave(3).reshape(4, 3)
    assert torch.equal(torch.cat([torch.as_tensor(v) for v in values]).target, expected)


def test_dataloader_in_the_main_process_gets_tensor_refs():
    loader = torch.utils.data.DataLoader(_CreatingDataset(), batch_size=2, num_workers=0)
    kinds = [name for _batch, names in loader for name in names]
    assert kinds == ["TensorRef"] * 4


IMPORT_ORDERS = {
    "torchTensorRef first": "import torchTensorRef\nimport torch\n",
    "torch first": "import torch\nimport torchTensorRef\n",
}


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_import_order(order):
    code = IMPORT_ORDERS[order] + (
        "x = torch.rand(3, 3)\n"
        "assert type(x) is torchTensorRef.TensorRef, type(x)\n"
        "assert torchTensorRef.is_patched()\n"
        "torchTensorRef.tensorsManager.device = 'sim'\n"
        "y = (x @ x).sum()\n"
        "with torchTensorRef.disabled():\n"
        "    ref = (x.target.clone() @ x.target.clone()).sum()\n"
        "assert torch.equal(y.target, ref)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# A failed import, then the same import with the variable fixed; each prints what torch is.
_FAILED_IMPORT = """
import os, sys
import torch
originals = (torch.zeros, torch.load, torch.nn.Module.__call__, torch.nn.Module.__setattr__)
os.environ.update(TORCHTENSORREF_DEVICE="gpu", TORCHTENSORREF_BUDGET="1MiB")
try:
    import torchTensorRef
except ValueError as e:
    print("ValueError", "TORCHTENSORREF_DEVICE" in str(e))
now = (torch.zeros, torch.load, torch.nn.Module.__call__, torch.nn.Module.__setattr__)
print("unpatched", [a is b for a, b in zip(now, originals)], type(torch.zeros(2)).__name__,
      torch.equal(torch.zeros(2), torch.tensor([0.0, 0.0])))
print("manager", sys.modules["torchTensorRef.memory.manager"].tensorsManager.device)
os.environ["TORCHTENSORREF_DEVICE"] = "sim"
import torchTensorRef
print("patched", torchTensorRef.is_patched(), type(torch.zeros(2)).__name__,
      torch.nn.Module.__call__ is not originals[2], torchTensorRef.tensorsManager.device,
      torchTensorRef.tensorsManager.budget)
"""


def test_a_failed_import_leaves_torch_unpatched():
    # With TORCHTENSORREF_DEVICE=gpu the import raised ValueError but left torch patched:
    # torch.zeros made TensorRefs, torch.load and nn.Module.__call__ stayed wrapped.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHTENSORREF_")}
    done = subprocess.run([sys.executable, "-c", _FAILED_IMPORT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "ValueError True",
        "unpatched [True, True, True, True] Tensor True",
        f"manager {default_device()}",  # (the manager as it was made, before the failed import)
        f"patched True TensorRef True sim {2**20}",
    ]
