"""``manage()``: modules, tensors and state dicts made by plain torch, brought under management."""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import torchTensorRef
from torchTensorRef.memory.adoption import PIN_AT_ADOPTION_BYTES
from torchTensorRef import TensorRef
from torchTensorRef import manage
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, budget, device_type, paging, plain_torch  # noqa: F401  (paging is a fixture)


def plain_model(tied=True):
    """A module built by plain torch (as if torchTensorRef were imported after it)."""
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(6, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 6),
                                torch.nn.BatchNorm1d(6))
        if tied:
            m[2].weight = m[0].weight
    return m


def run_training(m, steps=3):
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    tokens = torch.tensor([0, 2, 5, 1])
    for _ in range(steps):
        opt.zero_grad()
        m(tokens).pow(2).mean().backward()
        opt.step()
    return m.state_dict()


def test_manage_module_in_place_keeps_ties_and_matches_plain(paging):
    plain = plain_model()
    managed = manage(plain_model())
    assert isinstance(managed, torch.nn.Sequential)
    assert managed[0].weight is managed[2].weight  # tied parameters stay one object
    assert len(list(managed.parameters())) == len(list(plain.parameters()))
    for p in managed.parameters():
        assert isinstance(p, torch.nn.Parameter) and type(p) is TensorRef
    assert all(type(b) is TensorRef for b in managed.buffers())
    with plain_torch():  # on the managed tensors' device: its kernels and optimizer choices
        plain.to(device_type())
        assert plain[0].weight is plain[2].weight
        expected = run_training(plain)
    assert_identical(expected, run_training(managed))
    assert managed[0].weight is managed[2].weight


def test_manage_returns_the_same_module():
    m = plain_model()
    assert manage(m) is m


def test_manage_twice_changes_nothing():
    m = manage(plain_model())
    params = list(m.parameters())
    manage(m)
    assert all(a is b for a, b in zip(params, m.parameters()))


def test_parameters_sharing_bytes_share_a_block():
    with torchTensorRef.disabled():
        base = torch.zeros(4, 3)
        m = torch.nn.Module()
        m.a = torch.nn.Parameter(base[:2])
        m.b = torch.nn.Parameter(base[2:])
    manage(m)
    assert m.a is not m.b and m.a.proxyInfo.block_id == m.b.proxyInfo.block_id


def test_manage_keeps_requires_grad_grads_and_attributes():
    # Parameter attributes (transformers marks parameters) and grads used to be dropped.
    m = plain_model(tied=False)
    with torchTensorRef.disabled():
        m[0].weight.requires_grad_(False)
        m[2].weight.tag = "head"
        m(torch.tensor([1, 2])).sum().backward()
        expected = m[2].weight.grad.clone()
    manage(m)
    assert not m[0].weight.requires_grad and m[2].weight.requires_grad
    assert m[2].weight.tag == "head"
    assert type(m[2].weight.grad) is TensorRef
    assert_identical(expected, m[2].weight.grad)


def test_manage_failure_leaves_the_module_unchanged():
    # A module used to be left half converted when one of its tensors could not be managed.
    m = plain_model(tied=False)
    m[3].register_buffer("on_meta", torch.empty(3, device="meta"))  # converted last
    before = list(m.parameters())
    with pytest.raises(ValueError, match="strided tensors with data"):
        manage(m)
    assert all(a is b for a, b in zip(before, m.parameters()))
    assert all(type(p) is torch.nn.Parameter for p in m.parameters())


def test_manage_tensor_shares_bytes_and_keeps_parameters():
    with torchTensorRef.disabled():
        t = torch.arange(3.0)
        p = torch.nn.Parameter(torch.ones(2))
    ref = manage(t)
    assert type(ref) is TensorRef and ref.tolist() == [0.0, 1.0, 2.0]
    t[0] = 5
    assert ref.tolist()[0] == 5.0
    mp = manage(p)
    assert isinstance(mp, torch.nn.Parameter) and type(mp) is TensorRef and mp.requires_grad


def test_manage_state_dict_keeps_kind_metadata_and_ties():
    # A tensor appearing twice used to give two TensorRefs.
    m = plain_model()
    sd = m.state_dict(keep_vars=True)
    assert sd["0.weight"] is sd["2.weight"]
    msd = manage(sd)
    assert type(msd) is collections.OrderedDict and msd._metadata == sd._metadata
    assert msd["0.weight"] is msd["2.weight"]
    assert all(type(v) is TensorRef for v in msd.values())
    assert_identical(dict(sd), dict(msd))
    target = manage(plain_model())
    target.load_state_dict(msd)
    assert_identical(dict(sd), dict(target.state_dict(keep_vars=True)))


def test_manage_nested_containers():
    P = collections.namedtuple("P", "tensor number")
    with torchTensorRef.disabled():
        t = torch.ones(2)
        obj = {"list": [t, 3], "pair": P(t, 1.5), "deep": collections.defaultdict(list, x=t)}
    out = manage(obj)
    assert out["list"][0] is out["pair"].tensor is out["deep"]["x"]
    assert type(out["list"][0]) is TensorRef and out["list"][1] == 3
    assert type(out["pair"]) is P and out["pair"].number == 1.5
    assert out["deep"].default_factory is list
    assert type(obj["list"][0]) is torch.Tensor  # the input is left as it was


def test_manage_optimizer_state_dict():
    m = plain_model(tied=False)
    with torchTensorRef.disabled():
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        m(torch.tensor([1, 2])).sum().backward()
        opt.step()
        state = opt.state_dict()
    managed = manage(state)
    assert managed["param_groups"] == state["param_groups"]
    bufs = [v for s in managed["state"].values() for v in s.values()]
    assert bufs and all(type(v) is TensorRef for v in bufs)
    manage(m)
    opt2 = torch.optim.Adam(m.parameters(), lr=0.1)
    opt2.load_state_dict(managed)
    assert all(type(v) is TensorRef for s in opt2.state.values() for v in s.values())


def test_manage_rejects_other_objects():
    with pytest.raises(TypeError, match="accepts an nn.Module, a tensor, or a dict/list/tuple"):
        manage(3)


def test_a_managed_module_s_tensors_nobody_else_holds_become_the_managers_own(fresh_manager):
    tm = fresh_manager
    with torchTensorRef.disabled():
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
        other = torch.nn.Linear(64, 128)
        x = torch.randn(4, 64)
    with plain_torch(), torch.no_grad():  # (a graph would hold the weights: they would stay shared)
        device = tm.torch_device  # (plain torch on the device the managed model computes on)
        expected = copy.deepcopy(model).to(device)(x.to(device))
    held = other.weight  # the program still holds this one: its bytes must stay where they are
    torchTensorRef.manage(model)
    torchTensorRef.manage(other)
    if tm.device != "cpu":
        assert all(tm.backend.pinned.is_pinned(block_of(p).host) for p in model.parameters() if p.numel() >= 1024)
    assert not any(block_of(p).host_shared for p in model.parameters())
    assert block_of(other.weight).host_shared and not block_of(other.bias).host_shared
    tm.strategy = "flow"
    tm.budget = budget("40KiB")  # fetched and evicted around every op: asynchronous copies only
    xr = torch.empty(4, 64)
    xr.copy_(x)
    tm.reset_stats()
    out = model(xr)
    stats = tm.stats()
    assert_identical(expected, out)
    if tm.device != "cpu":
        # (from bytes still shared every fetch would copy synchronously; only host copies
        # too small to be worth pinning do)
        small = sum(1 for p in model.parameters() if p.nbytes < PIN_AT_ADOPTION_BYTES)
        assert stats["fetches"] > small and stats["host_syncs"] <= small
    with torch.no_grad():
        other.weight.add_(1)  # written through: the holder of the plain tensor sees it
    assert torch.equal(held, other.weight.cpu())


def test_manage_of_an_empty_module_is_a_no_op():
    m = torch.nn.ReLU()
    assert torchTensorRef.manage(m) is m


def test_moving_a_model_between_devices_keeps_its_tied_parameters_tied(paging):
    with plain_torch():
        plain = plain_model()
        plain.to(device_type())
        assert plain[0].weight is plain[2].weight  # (what plain torch does)
        expected = run_training(plain)
    managed = manage(plain_model())
    managed.cpu()  # a TensorRef to host memory: not converted in place by torch
    assert managed[0].weight is managed[2].weight and managed[0].weight.device.type == "cpu"
    managed.to(device_type())
    assert managed[0].weight is managed[2].weight
    moved = plain_model()
    moved.to(device_type())  # a plain model moved to the managed device outside disabled()
    assert moved[0].weight is moved[2].weight
    assert len(list(moved.parameters())) == len(list(plain.parameters()))
    assert_identical(run_training(managed), expected)
    assert_identical(run_training(moved), expected)
