"""torch.compile on code that touches TensorRefs (Note [torch.compile] in ``compiler.py``):
never an error inside the compiler, and the same results as plain eager torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import torchTensorRef
from torchTensorRef import OutOfBudgetError, TensorRef, compile_region, tensorsManager
from torchTensorRef.integrations.compiler import FullGraphError
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, budget, plain_torch


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["accelerator", "pass-through"])
def device(request):
    if request.param == "pass-through":
        tensorsManager.device = "cpu"
    return tensorsManager.torch_device  # (resolved: "cuda" is cuda:0)


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
    tensorsManager.budget = None if device.type == "cpu" else budget(16 * 1024)  # smaller than the layer
    assert_identical(plain, train_step(layer, compiled))


@pytest.mark.parametrize("what", ["function", "module"])
def test_fullgraph_refuses_tensorrefs_saying_why(what):
    fn = torch.compile(torch.nn.Linear(3, 3) if what == "module" else (lambda x: x.sin()), fullgraph=True)
    with pytest.raises(FullGraphError, match="compile_region") as raised:
        fn(torch.ones(3))
    assert isinstance(raised.value.__cause__, torch._dynamo.exc.Unsupported)


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


def _refusing_disallow_in_graph(monkeypatch):
    """Make ``torch._dynamo.disallow_in_graph`` refuse every function as torch 2.11 refuses one
    it would not put in a graph anyway: with ``torch._dynamo.exc.IncorrectUsage``, an
    ``Exception`` but no ``RuntimeError`` (torch 2.13 has no such class: one is put there)."""
    incorrect_usage = getattr(torch._dynamo.exc, "IncorrectUsage", None)
    if incorrect_usage is None:
        incorrect_usage = type("IncorrectUsage", (Exception,), {})
        monkeypatch.setattr(torch._dynamo.exc, "IncorrectUsage", incorrect_usage, raising=False)
    assert not issubclass(incorrect_usage, RuntimeError)
    refused = []

    def disallow_in_graph(fn):
        refused.append(fn)
        raise incorrect_usage("disallow_in_graph is expected to be used on an already allowed callable")

    monkeypatch.setattr(torch._dynamo, "disallow_in_graph", disallow_in_graph)
    return refused


def test_patch_with_the_compiler_loaded_survives_incorrect_usage_from_disallow_in_graph(monkeypatch):
    # torch 2.11 raised IncorrectUsage, not RuntimeError, here: patch() (and so importing the
    # package after torch._dynamo) failed
    try:
        with monkeypatch.context() as m:
            refused = _refusing_disallow_in_graph(m)
            torchTensorRef.unpatch()
            torchTensorRef.patch()  # new wrappers, told to the loaded compiler
            assert refused, "patch() did not ask the compiler to keep its wrappers out of graphs"
    finally:
        torchTensorRef.unpatch()
        torchTensorRef.patch()  # wrappers the real disallow_in_graph has seen, for later tests
    out = torch.compile(lambda n: torch.zeros(n) + 1)(2)
    assert isinstance(out, TensorRef) and out.tolist() == [1.0, 1.0]


def test_first_compile_survives_incorrect_usage_from_disallow_in_graph(monkeypatch):
    # torch 2.11 raised IncorrectUsage, not RuntimeError, here: the first torch.compile failed
    with plain_torch():
        plain = with_creations(torch.ones(4))
    with monkeypatch.context() as m:
        m.setattr(torchTensorRef.integrations.compiler, "_breaks", {})  # as if no wrapper had been told yet
        refused = _refusing_disallow_in_graph(m)
        compiled = torch.compile(with_creations)
        assert refused, "torch.compile did not ask the compiler to keep the wrappers out of graphs"
    managed = compiled(torch.ones(4))
    assert isinstance(managed, TensorRef)
    assert_identical(plain, managed)


def test_importing_the_package_after_the_compiler_works():
    # torch 2.11: `import torch._dynamo; import torchTensorRef` raised IncorrectUsage at import
    code = ("import torch, torch._dynamo, torchTensorRef\n"
            "x = torch.compile(lambda n: torch.zeros(n) + 1)(2)\n"
            "assert isinstance(x, torchTensorRef.TensorRef) and x.tolist() == [1.0, 1.0], x\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


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
    tensorsManager.budget = budget(24 * 1024)  # below the weights: they page while it decodes
    assert_identical(plain, generate(True))


# -- compiled regions (Note [Compiled regions] in compiled_region.py) ------------------------
# The plain reference is compiled for plain CPU tensors: where "sim" computes, and the
# region's compiled code then runs the same kernels, so the values are bit-identical.


def mlp(seed=0, n=4, width=64, managed=True):
    # drawn by the CPU's generator (a managed model draws from the device's) and then managed
    with torchTensorRef.disabled():
        torch.manual_seed(seed)
        layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width))
                  for _ in range(n)]
        model = torch.nn.Sequential(*layers).eval()
    return torchTensorRef.manage(model) if managed else model


def weight_bytes(model):
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_a_compiled_region_function_matches_plain_compiled_torch(device):
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1), x.t()

    # Plain compiled torch for the kernels the region runs: the device's on a GPU, the CPU's
    # on "sim" (its kernels are the CPU's, and its plain tensors, a Python subclass, are not
    # compiled: inductor falls back to eager for them).
    where = torch.device("cpu") if device.type in ("cpu", "sim") else device
    with torchTensorRef.disabled(device=where):
        torch.manual_seed(0)
        x, w = torch.randn(8, 16), torch.randn(16, 16)
        plain = torch.compile(f)(x, w)
    torch._dynamo.reset()  # (the region compiles f afresh)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    region = compile_region(f, backend=counter, fullgraph=True)
    torch.manual_seed(0)
    mx, mw = torch.randn(8, 16), torch.randn(16, 16)
    with torch.no_grad():
        managed = region(mx, mw)
    assert all(isinstance(t, TensorRef) and t.device == device for t in managed)
    assert_identical(plain, managed)
    assert counter.frame_count == 1 and counter.op_count >= 3  # one graph: it ran compiled
    assert block_of(managed[1]) is block_of(mx)  # a view of an input shares its block


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_compiled_region_layers_keep_the_budget_and_match_plain_compiled_torch(strategy):
    with torchTensorRef.disabled():
        x = torch.randn(2, 64)
        plain_model = torch.nn.Sequential(*[torch.compile(layer) for layer in mlp(managed=False)])
        with torch.no_grad():
            plain = [plain_model(x) for _ in range(3)]
    model = mlp()
    for layer in model:
        assert compile_region(layer, fullgraph=True) is layer  # a region is one graph
    tensorsManager.strategy = strategy
    tensorsManager.budget = budget(weight_bytes(model) // 2)  # the layers page, one region at a time
    tensorsManager.reset_stats()
    with torch.no_grad():
        managed = [model(TensorRef(x.clone())) for _ in range(3)]
    assert_identical(plain, managed)
    stats = tensorsManager.stats()
    assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= tensorsManager.budget
    assert stats["ops"] == 3 * 4  # one op per region call


def test_a_region_writing_its_inputs_and_buffers_in_place_keeps_the_writes():
    def bump(x):
        x.add_(1)
        return x * 2

    with torchTensorRef.disabled():
        torch.manual_seed(0)
        norm_plain = torch.nn.BatchNorm1d(8).train()
        x = torch.randn(4, 8)
        with torch.no_grad():
            plain = (torch.compile(norm_plain)(x), norm_plain.running_mean.clone())
    torch.manual_seed(0)
    norm = compile_region(torch.nn.BatchNorm1d(8).train())
    mx = TensorRef(torch.randn(4, 8))
    with torch.no_grad():
        out = norm(mx)
        doubled = compile_region(bump)(mx)
    tensorsManager.evict_all()  # the writes must have reached the host copies
    assert_identical(plain, (out, norm.running_mean))
    assert_identical(x + 1, mx)
    assert_identical((x + 1) * 2, doubled)


def test_a_region_larger_than_the_budget_is_refused_naming_it():
    model = mlp(n=1)
    compile_region(model)
    tensorsManager.budget = budget(weight_bytes(model) // 2)
    with torch.no_grad(), pytest.raises(OutOfBudgetError, match="compiled region Sequential"):
        model(torch.randn(2, 64))


def test_a_region_refuses_to_run_where_gradients_are_needed():
    model = compile_region(mlp(n=1))
    with pytest.raises(RuntimeError, match="inference only"):
        model(torch.randn(2, 64))
    with torch.no_grad():
        assert isinstance(model(torch.randn(2, 64)), TensorRef)


def test_a_gpt2_with_compiled_decoder_layers_matches_plain_compiled_torch():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)

    def forward(region, managed):
        with torchTensorRef.disabled():
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(config).eval()
        if managed:
            model = torchTensorRef.manage(model)
        for i, block in enumerate(model.transformer.h):
            model.transformer.h[i] = region(block)
        with torch.no_grad():
            return model(torch.tensor([[1, 5, 9, 3, 7]]), use_cache=False).logits

    with torchTensorRef.disabled():
        plain = forward(torch.compile, False)
    tensorsManager.strategy = "flow"
    tensorsManager.budget = budget(240 * 1024)  # below the weights (about 330 KiB; a block about 100 KiB)
    tensorsManager.reset_stats()
    managed = forward(compile_region, True)
    assert_identical(plain, managed)
    assert tensorsManager.stats()["peak_device_bytes"] <= tensorsManager.budget


@pytest.mark.parametrize("resident", [True, False], ids=["weights on the device", "weights in host memory"])
def test_torch_export_of_a_managed_model_runs_like_eager(resident):
    # Fixed: with the weights resident, export's fake tensors took the copy to host memory
    # that reading a TensorRef's storage makes ("Attempted to set the storage of a tensor on
    # device meta to a storage on different device cpu").
    tensorsManager.strategy = "flow"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()
    x = torch.randn(3, 32)
    if resident:
        model(x)  # (the weights are fetched and stay)
        assert model[0].weight.proxyInfo.on_device
    else:
        tensorsManager.evict_all()
    eager = model(x)
    exported = torch.export.export(model, (x,))
    assert_identical(eager, exported.module()(x))
