"""torch.save / torch.load and state dicts: files any PyTorch reads, round trips that keep sharing."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.strategies import NAMES
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, paging, run_both  # noqa: F401  (paging is a fixture)

#: a fresh interpreter that never imports torchTensorRef: for each line ``path<TAB>weights_only``
#: it reads, it ``torch.load``s the file and prints what it found as one line of JSON
_READER = textwrap.dedent('''
    import hashlib, json, sys
    import torch

    def describe(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous().reshape(-1)  # (plain torch on a GPU saves GPU tensors)
            return {"type": type(v).__name__, "dtype": str(t.dtype), "shape": list(v.shape),
                    "requires_grad": v.requires_grad, "attrs": sorted(v.__dict__),
                    "sha": hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest(),
                    "storage": v.untyped_storage().data_ptr()}
        if isinstance(v, dict):
            return {"type": type(v).__name__, "items": {str(k): describe(x) for k, x in v.items()}}
        if isinstance(v, (list, tuple)):
            return {"type": type(v).__name__, "items": [describe(x) for x in v]}
        if isinstance(v, torch.nn.Module):
            return {"type": type(v).__name__, "state": describe(v.state_dict(keep_vars=True))}
        return {"type": type(v).__name__, "repr": repr(v)}

    if __name__ == "__main__":
        for line in sys.stdin:
            path, weights_only = line.rstrip("\\n").split("\\t")
            try:
                out = {"loaded": describe(torch.load(path, weights_only=weights_only == "1"))}
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            out["imported"] = "torchTensorRef" in sys.modules
            print(json.dumps(out), flush=True)
''')


@pytest.fixture(scope="module")
def reader():
    """One interpreter without torchTensorRef for the whole module (torch imports slowly)."""
    process = subprocess.Popen([sys.executable, "-c", _READER], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    yield process
    process.stdin.close()
    process.wait(timeout=60)


@pytest.fixture
def read_elsewhere(reader):
    """``read_elsewhere(path, weights_only=True, storages=False)``: what ``torch.load`` finds
    in an interpreter without torchTensorRef, as JSON (storage addresses only with ``storages``)."""

    def read(path, weights_only=True, storages=False) -> dict:
        reader.stdin.write(f"{path}\t{'1' if weights_only else '0'}\n")
        reader.stdin.flush()
        out = json.loads(reader.stdout.readline())
        assert out["imported"] is False
        assert "error" not in out, out["error"]
        return out["loaded"] if storages else _strip_storage(out["loaded"])

    return read


def describe_here(obj) -> dict:
    """What the reader prints for the plain ``obj``."""
    ns = {}
    exec(_READER, ns)
    return _strip_storage(ns["describe"](obj))


def _strip_storage(d):
    if isinstance(d, dict):
        return {k: _strip_storage(v) for k, v in d.items() if k != "storage"}
    if isinstance(d, list):
        return [_strip_storage(v) for v in d]
    return d


def model():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    m(torch.randn(3, 4)).sum().backward()  # running stats move, grads exist
    return m


# -- files readable without torchTensorRef --------------------------------------------------

def test_saved_state_dict_loads_without_torch_tensor_ref(tmp_path, paging, read_elsewhere):
    plain, managed = run_both(lambda: model().state_dict())
    assert all(type(v) is TensorRef for v in managed.values())
    torch.save(managed, tmp_path / "m.pt")
    with torchTensorRef.disabled():
        torch.save(plain, tmp_path / "p.pt")
    loaded = read_elsewhere(tmp_path / "m.pt")
    assert loaded == read_elsewhere(tmp_path / "p.pt")
    assert {v["type"] for v in loaded["items"].values()} == {"Tensor"}


def test_saved_parameter_loads_as_a_parameter_with_its_attributes(tmp_path, read_elsewhere):
    # torch.save of a Parameter used to write a plain Tensor, and dropped its attributes.
    def make():
        p = torch.nn.Linear(3, 2).weight
        p.note = "kept"
        return p

    plain, managed = run_both(make)
    torch.save(managed, tmp_path / "m.pt")
    with torchTensorRef.disabled():
        torch.save(plain, tmp_path / "p.pt")
    theirs = read_elsewhere(tmp_path / "m.pt")
    assert theirs["type"] == "Parameter" and theirs["attrs"] == ["note"]
    assert theirs == read_elsewhere(tmp_path / "p.pt")
    here = torch.load(tmp_path / "m.pt")
    assert isinstance(here, torch.nn.Parameter) and type(here) is TensorRef and here.note == "kept"


def test_saved_non_leaf_keeps_requires_grad_like_torch(tmp_path, read_elsewhere):
    # torch.save writes requires_grad=True for a non-leaf; it used to be dropped.
    plain, managed = run_both(lambda: torch.randn(3, requires_grad=True) * 2)
    torch.save(managed, tmp_path / "m.pt")
    with torchTensorRef.disabled():
        torch.save(plain, tmp_path / "p.pt")
    assert read_elsewhere(tmp_path / "m.pt") == read_elsewhere(tmp_path / "p.pt")


def test_torch_save_bound_before_patching_still_writes_plain_tensors(tmp_path, read_elsewhere):
    # Libraries keep ``torch.save`` (or call torch.serialization.save) from before the patch:
    # the file used to reference torchTensorRef and fail to load elsewhere.
    original_save = torch.serialization.save
    x = torch.arange(5.0)
    original_save({"x": x}, tmp_path / "m.pt")
    loaded = read_elsewhere(tmp_path / "m.pt")
    assert loaded == describe_here({"x": x.target})
    assert loaded["items"]["x"]["type"] == "Tensor"


def test_saved_views_share_one_storage_when_loaded_elsewhere(tmp_path, read_elsewhere):
    x = torch.arange(6.0)
    torch.save({"base": x, "tail": x[2:], "other": torch.ones(2)}, tmp_path / "m.pt")
    items = read_elsewhere(tmp_path / "m.pt", storages=True)["items"]
    assert items["base"]["storage"] == items["tail"]["storage"] != items["other"]["storage"]


def test_saved_module_loads_elsewhere_with_parameters(tmp_path, paging, read_elsewhere):
    plain, managed = run_both(model)
    torch.save(managed, tmp_path / "m.pt")
    with torchTensorRef.disabled():
        torch.save(plain, tmp_path / "p.pt")
    theirs = read_elsewhere(tmp_path / "m.pt", weights_only=False)
    assert theirs == read_elsewhere(tmp_path / "p.pt", weights_only=False)
    assert theirs["state"]["items"]["0.weight"]["type"] == "Parameter"


@pytest.mark.parametrize("strategy", NAMES)
def test_save_writes_the_latest_write_on_the_accelerator(tmp_path, strategy, read_elsewhere):
    tensorsManager.strategy = strategy
    x = torch.zeros(4)
    x.toGPU()
    x.add_(3)
    torch.save(x, tmp_path / "m.pt")
    with torchTensorRef.disabled():
        expected = describe_here(torch.full((4,), 3.0))
    assert read_elsewhere(tmp_path / "m.pt") == expected


def test_dtypes_round_trip(tmp_path, read_elsewhere):
    dtypes = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    plain, managed = run_both(lambda: {str(d): (torch.randn(3) * 5).to(d) for d in dtypes})
    torch.save(managed, tmp_path / "m.pt")
    with torchTensorRef.disabled():
        torch.save(plain, tmp_path / "p.pt")
    assert read_elsewhere(tmp_path / "m.pt") == read_elsewhere(tmp_path / "p.pt")


# -- loading here ------------------------------------------------------------------------------

def test_load_gives_tensor_refs_and_keeps_sharing():
    x = torch.arange(3.0)
    buffer = io.BytesIO()
    torch.save({"a": x, "b": x, "tail": x[1:]}, buffer)
    buffer.seek(0)
    d = torch.load(buffer, weights_only=True)
    assert all(type(v) is TensorRef for v in d.values())
    # one tensor saved twice loads as one object, as plain torch does (it used to give two)
    assert d["a"] is d["b"]
    assert d["a"].proxyInfo.block_id == d["tail"].proxyInfo.block_id
    d["tail"][0] = 7
    assert d["a"].tolist() == [0.0, 7.0, 2.0]


def test_rng_states_restored_from_a_checkpoint_replay_the_same_numbers():
    # a training script's resume: save the generators' states, load them, restore, draw again
    # (on the host: get_rng_state() is the CPU generator's, and a GPU draws from its own)
    g = torch.Generator().manual_seed(5)
    torch.manual_seed(3)
    buffer = io.BytesIO()
    torch.save({"global": torch.get_rng_state(), "g": g.get_state()}, buffer)
    want = [torch.rand(4, device="cpu").tolist(), torch.rand(4, generator=g).tolist()]
    buffer.seek(0)
    states = torch.load(buffer, weights_only=True)
    assert all(type(v) is TensorRef for v in states.values())
    torch.set_rng_state(states["global"])  # patched: takes the TensorRef
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):
        g.set_state(states["g"])  # a C type: cannot be patched (docs/compatibility.md)
    g.set_state(states["g"].cpu().target)  # the documented way
    assert [torch.rand(4, device="cpu").tolist(), torch.rand(4, generator=g).tolist()] == want


def test_load_with_mmap(tmp_path):
    plain, managed = run_both(lambda: model().state_dict())
    torch.save(managed, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", mmap=True, weights_only=True)
    assert all(type(v) is TensorRef for v in loaded.values())
    assert_identical(plain, loaded)


class _ReaderOfTorch211:
    """``torch._C.PyTorchFileReader`` as torch 2.11 has it: no ``get_record_size``."""

    def __init__(self, name):
        self._reader = _REAL_READER(name)

    def __getattr__(self, name):
        if name == "get_record_size":
            raise AttributeError(f"'torch._C.PyTorchFileReader' object has no attribute '{name}'")
        return getattr(self._reader, name)


_REAL_READER = torch._C.PyTorchFileReader


def test_load_with_mmap_ties_the_file_without_get_record_size(tmp_path, monkeypatch):
    # torch 2.11's reader has no get_record_size: torch.load(mmap=True) raised AttributeError
    plain, managed = run_both(lambda: model().state_dict())
    torch.save(managed, tmp_path / "m.pt")
    monkeypatch.setattr(torch._C, "PyTorchFileReader", _ReaderOfTorch211)
    before = tensorsManager.stats()["bytes_from_disk"]
    loaded = torch.load(tmp_path / "m.pt", mmap=True, weights_only=True)
    assert all(type(v) is TensorRef and block_of(v).disk is not None and block_of(v).host is None
               for v in loaded.values())  # tied to the file's ranges, nothing read
    assert tensorsManager.stats()["bytes_from_disk"] == before
    assert_identical(plain, loaded)


# -- state dicts --------------------------------------------------------------------------------

def test_state_dict_load_state_dict_round_trip(paging, tmp_path):
    def run():
        source = model()
        torch.save(source.state_dict(), tmp_path / "sd.pt")
        target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
        weight = target[0].weight
        target.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
        assert target[0].weight is weight  # copied into, not replaced
        target.eval()
        return target.state_dict(), target(torch.randn(2, 4))

    plain, managed = run_both(run)
    assert_identical(plain, managed)
    assert all(type(v) is TensorRef for v in managed[0].values())


def test_load_state_dict_with_assign_keeps_parameters_managed():
    source = model().state_dict()
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    target.load_state_dict(source, assign=True)
    for p in target.parameters():
        assert isinstance(p, torch.nn.Parameter) and type(p) is TensorRef
    assert all(type(b) is TensorRef for b in target.buffers())


def test_load_state_dict_from_plain_tensors():
    with torchTensorRef.disabled():
        source = model().state_dict()
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    target.load_state_dict(source)
    assert all(type(v) is TensorRef for v in target.state_dict().values())
    assert_identical(source, target.state_dict())
