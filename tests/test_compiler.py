"""torch.compile on code that touches TensorRefs (Note [torch.compile] in ``compiler.py``):
never an error inside the compiler, and the same results as plain eager torch."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager

from paired import assert_identical, plain_torch


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["accelerator", "pass-through"])
def device(request):
    if request.param == "pass-through":
        tensorsManager.device = "cpu"
    return tensorsManager._declared


def with_creations(x):
    # factories with and without a device, inside the compiled code
    return x * 2 + torch.arange(4, device=x.device) + torch.zeros(4) + torch.tensor([1.0, 2.0, 3.0, 4.0])


def test_creations_in_compiled_code_run_eagerly_with_plain_results(device):
    with plain_torch():
        plain = with_creations(torch.ones(4))
    x = torch.ones(4)
    managed = torch.compile(with_creations)(x)
    assert isinstance(managed, TensorRef) and managed.device == device
    assert_identical(plain, managed)


def test_creations_alone_give_managed_tensors(device):
    # no TensorRef goes in: the compiler would have made plain tensors of the device
    out = torch.compile(lambda n: torch.zeros(n) + torch.ones(n, device=device))(3)
    assert isinstance(out, TensorRef) and out.device == device
    assert out.tolist() == [1.0, 1.0, 1.0]


def make_layer():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)


def train_step(layer, compiled):
    x = torch.randn(2, 5, 16)
    out = (layer if compiled is None else compiled)(x)
    out.pow(2).mean().backward()
    return out, [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_compiled_module_trains_like_eager_torch(device, how):
    with plain_torch():
        plain = train_step(make_layer(), None)
    layer = make_layer()
    if how == "torch.compile":
        compiled = torch.compile(layer)
    else:
        layer.compile()
        compiled = layer
    tensorsManager.strategy = "flow"
    tensorsManager.budget = None if device.type == "cpu" else 16 * 1024  # smaller than the layer
    assert_identical(plain, train_step(layer, compiled))


def test_fullgraph_refuses_tensorrefs_naming_them():
    fn = torch.compile(lambda x: x.sin(), fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="TensorRef"):
        fn(torch.ones(3))


def test_code_without_tensorrefs_still_compiles():
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend=counter)
    with torchTensorRef.disabled():
        x = torch.randn(8)
        assert torch.equal(fn(x), (x.sin() * 2).sum())
    assert counter.frame_count == 1 and counter.op_count == 3


def test_patching_again_keeps_the_wrappers_out_of_graphs():
    torch.compile(lambda: None)()  # the compiler is loaded and told
    torchTensorRef.unpatch()
    torchTensorRef.patch()  # new wrappers
    out = torch.compile(lambda n: torch.zeros(n) + 1)(2)
    assert isinstance(out, TensorRef) and out.tolist() == [1.0, 1.0]


def test_static_cache_generate_with_a_compiled_forward_matches_plain_torch():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    def generate(compile_forward):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        if compile_forward:
            model.forward = torch.compile(model.forward)
        ids = torch.tensor([[1, 5, 9, 3]])
        return model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")

    with plain_torch():
        plain = generate(False)
    tensorsManager.strategy = "flow"
    tensorsManager.budget = 24 * 1024  # below the weights: they page while it decodes
    assert_identical(plain, generate(True))
