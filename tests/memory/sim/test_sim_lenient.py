"""The lenient form of "sim" (``tensorsManager.sim_strict = False``): TensorRefs report
``cpu`` and the device copies are plain CPU tensors, while copies, budget and paging are
those of the strict form. It is what times the manager's own cost against plain CPU torch
(``benchmarks/small_ops.py``), so its results must be plain CPU torch's, bit for bit."""

from __future__ import annotations

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, regions, tensorsManager as tm
from torchTensorRef.memory.sim.tensor import SimTensor
from torchTensorRef.core.tensor_ref import block_of
from conftest import TEST_DEVICE
from paired import assert_identical

transformers = pytest.importorskip("transformers")

strict_sim_here = pytest.mark.skipif(TEST_DEVICE != "sim", reason="the strict form of \"sim\" cannot be "
                                     "registered in a CUDA process (it would break CUDA's backward)")


@pytest.fixture
def lenient():
    tm.sim_strict = False
    tm.device = "sim"
    yield
    tm.sim_strict = True


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def decode(model, ids):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("use_regions", [False, True], ids=["per-op", "regions"])
def test_generate_under_flow_pages_and_matches_plain_cpu_torch(lenient, use_regions):
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torchTensorRef.disabled():
        plain = decode(llama(), ids)
    previous = regions.enabled, regions.under_budget
    regions.enabled, regions.under_budget = use_regions, True
    try:
        tm.strategy = "flow"
        model = llama()
        tm.budget = tm.outside_bytes() + weight_bytes(model) // 2
        out = decode(model, torchTensorRef.manage(ids.clone()))
        tm.reset_stats()
        again = decode(model, torchTensorRef.manage(ids.clone()))
    finally:
        regions.enabled, regions.under_budget = previous
    assert isinstance(out, TensorRef) and out.device.type == "cpu"
    assert_identical(plain, out)
    assert_identical(plain, again)
    stats = tm.stats()
    assert stats["bytes_to_device"] > 0 and stats["evictions"] > 0
    assert stats["peak_device_bytes"] <= tm.budget - tm.outside_bytes()


def test_a_creation_asking_for_cpu_is_a_device_tensor_in_the_lenient_form(lenient):
    # "cpu" is the device its TensorRefs report: model code passing ``device=x.device`` must
    # not get host-only tensors (they would keep its module calls from being regions)
    x = torch.zeros(3)
    for made in (torch.arange(4, device="cpu"), torch.ones(2, device=x.device), x.new_zeros(3)):
        assert isinstance(made, TensorRef) and not block_of(made).host_only


@strict_sim_here
def test_a_creation_asking_for_cpu_stays_on_the_host_in_the_strict_form():
    x = torch.zeros(3)
    for made in (torch.arange(4, device="cpu"), x.new_zeros(3, device="cpu")):
        assert made.device.type == "cpu" and block_of(made).host_only


@strict_sim_here
def test_switching_forms_keeps_every_value_and_says_so():
    x = torch.arange(6.0) * 2  # made on the device
    with torchTensorRef.disabled():
        expected = torch.arange(6.0) * 2
    with pytest.warns(UserWarning, match="keep reporting device sim:0"):
        tm.sim_strict = False
    assert tm.device == "sim" and torch.zeros(1).device.type == "cpu"
    assert block_of(x).dev is None  # brought to the host before the device changed form
    assert_identical(expected, x)
    with pytest.warns(UserWarning, match="keep reporting device cpu"):
        tm.sim_strict = True
    assert torch.zeros(1).device.type == "sim"
    assert_identical(expected, x)


class Probe(torch.nn.Module):
    """Records the type of tensor its forward is given."""

    def forward(self, x):
        self.seen = type(x)
        return x * 2


@pytest.mark.parametrize("strict", [pytest.param(True, marks=strict_sim_here), False], ids=["strict", "lenient"])
def test_a_region_computes_on_plain_cpu_tensors_only_in_the_lenient_form(strict):
    tm.sim_strict = strict
    tm.device = "sim"
    probe = regions.region(Probe())
    previous = regions.min_ops
    regions.min_ops = 0
    try:
        with torch.no_grad():
            probe(torch.ones(3))  # (a region's first call runs op by op, measuring what it allocates)
            out = probe(torch.ones(3))
    finally:
        regions.min_ops = previous
        tm.sim_strict = True
    assert probe.seen is (SimTensor if strict else torch.Tensor)
    with torchTensorRef.disabled():
        assert_identical(torch.full((3,), 2.0), out)


@pytest.mark.parametrize("value", ["maybe", 2, None])
def test_a_bad_value_is_refused_and_changes_nothing(value):
    device = torch.zeros(1).device  # (first: a first tensor resolves "cuda" to "cuda:N")
    before = tm.device, tm.sim_strict, device
    with pytest.raises(ValueError, match="sim_strict must be True or False"):
        tm.sim_strict = value
    assert (tm.device, tm.sim_strict, torch.zeros(1).device) == before


def test_the_environment_sets_it_before_the_device():
    torchTensorRef.configure_from_environment({"TORCHTENSORREF_SIM_STRICT": "0", "TORCHTENSORREF_DEVICE": "sim"})
    try:
        assert tm.sim_strict is False and tm.device == "sim" and torch.zeros(1).device.type == "cpu"
    finally:
        tm.sim_strict = True


def test_its_deferred_copies_leave_destinations_as_they_are(lenient):
    # The strict form poisons a pending copy's destination (tests/memory/test_streams.py); the
    # timing form does not make that pass over the bytes, and the copy still runs when waited on.
    streams = tm.backend.streams
    with torchTensorRef.disabled():
        src, dst = torch.arange(12, dtype=torch.uint8), torch.zeros(12, dtype=torch.uint8)
        pending = streams.copy_async(dst, src, prefetch=True)
        assert dst.tolist() == [0] * 12
        pending.wait_host()
        assert dst.tolist() == list(range(12))
