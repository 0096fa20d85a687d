"""peft's LoRA, unmodified, under each strategy at a budget below the base model's weights:
losses, adapter weights, saved and reloaded adapters, merged models and generated tokens equal
plain torch's on the device.

A small Llama with random weights (nothing is downloaded) wrapped by ``get_peft_model`` with
a LoRA adapter on its attention and MLP projections.
"""

from __future__ import annotations

import gc

import pytest
import torch

from torchTensorRef import TensorRef, strategies, tensorsManager as tm
from paired import budget, plain_torch, to_plain

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: the fraction of the base model's weight bytes the budget gives the manager
FRACTION = 0.5


def base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


def lora_config():
    # (init_lora_weights=False: B is random too, so that the adapter changes the outputs from the start)
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False,
                           task_type="CAUSAL_LM")


def lora_model():
    model = base()
    torch.manual_seed(1)
    return peft.get_peft_model(model, lora_config())


def weights(model) -> int:
    return sum(tm.block_bytes(p.numel() * p.element_size()) for p in model.parameters())


def under(strategy, model):
    tm.strategy = strategy
    tm.budget = budget(int(FRACTION * weights(model)))
    tm.reset_stats()


def check_paged():
    s = tm.stats()
    assert s["evictions"] > 0 and s["peak_device_bytes"] <= tm.budget


def batches(device=None, steps=3):
    g = torch.Generator().manual_seed(2)
    out = [torch.randint(1, 64, (2, 12), generator=g) for _ in range(steps)]
    return [b.to(device) for b in out] if device is not None else out


def lora_weights(model):
    """The adapter's parameters by name, as plain CPU tensors."""
    return {n: to_plain(p) for n, p in model.named_parameters() if "lora_" in n}


def train(model, device=None, steps=3):
    """AdamW steps of the adapter on the causal-LM loss; (losses, the adapter's weights)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in batches(device, steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(to_plain(loss))
    return losses, lora_weights(model)


def logits(model, device=None):
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    if device is not None:
        ids = ids.to(device)
    model.eval()
    with torch.no_grad():
        return to_plain(model(input_ids=ids).logits)


def generate(model, device=None):
    """Greedy calls with prompts of two lengths, each three times (a call with new settings
    runs as a loop of its own, the next is measured, the third may be one region: Note
    [Regions until the budget pages]); their token ids."""
    ids = torch.randint(1, 64, (1, 10), generator=torch.Generator().manual_seed(4))
    if device is not None:
        ids = ids.to(device)
    model.eval()
    out = []
    for prompt, tokens in ((4, 5), (9, 3)) * 3:
        p = ids[:, :prompt]
        out.append(to_plain(model.generate(input_ids=p, attention_mask=torch.ones_like(p), max_new_tokens=tokens,
                                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)))
    return out


def assert_equal_dicts(got, expected):
    """Same names, and bit-identical tensors of the same dtype and shape."""
    assert list(got) == list(expected) and got
    for name, value in expected.items():
        assert (got[name].dtype, got[name].shape) == (value.dtype, value.shape), name
        assert torch.equal(got[name], value), f"{name} differs from plain torch's"


def assert_managed(model):
    assert all(isinstance(p, TensorRef) for p in model.parameters())


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_lora_training_steps_under_a_budget_below_the_base_weights_equal_plain_torch(strategy):
    with plain_torch():
        plain = lora_model().to(tm.torch_device)
        initial = lora_weights(plain)
        expected = train(plain, tm.torch_device)
        del plain
    # (the steps move every adapter weight: equal weights below mean the managed steps did too)
    assert not any(torch.equal(initial[n], w) for n, w in expected[1].items())
    gc.collect()
    model = lora_model()
    assert_managed(model)
    under(strategy, model)
    losses, adapter = train(model)
    assert len(losses) == len(expected[0])
    assert all(torch.equal(a, b) for a, b in zip(losses, expected[0]))
    assert_equal_dicts(adapter, expected[1])
    # (the base model's weights are frozen: only the adapter trained)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    check_paged()


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_a_saved_adapter_reloads_on_a_fresh_base_with_the_same_weights_and_outputs(strategy, tmp_path):
    def save_and_reload(folder, device=None):
        model = lora_model() if device is None else lora_model().to(device)
        if device is None:
            under(strategy, model)
        train(model, device, steps=1)
        model.save_pretrained(folder)
        trained = lora_weights(model)
        del model
        gc.collect()
        fresh = base() if device is None else base().to(device)
        reloaded = peft.PeftModel.from_pretrained(fresh, folder)
        return trained, reloaded

    with plain_torch():
        trained, plain = save_and_reload(tmp_path / "plain", tm.torch_device)
        expected_weights, expected_logits = lora_weights(plain), logits(plain, tm.torch_device)
        del plain
    assert_equal_dicts(expected_weights, trained)
    gc.collect()
    _, reloaded = save_and_reload(tmp_path / "managed")
    check_paged()
    # the adapter's files are plain torch's, byte for byte
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert "adapter_model.safetensors" in names and names == sorted(p.name for p in (tmp_path / "managed").iterdir())
    for name in names:
        assert (tmp_path / "managed" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert_managed(reloaded)
    assert_equal_dicts(lora_weights(reloaded), expected_weights)
    assert torch.equal(logits(reloaded), expected_logits)
    check_paged()


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_merge_and_unload_gives_plain_torch_s_merged_model(strategy):
    with plain_torch():
        plain = lora_model().to(tm.torch_device)
        train(plain, tm.torch_device, steps=1)
        merged = plain.merge_and_unload()
        expected_state = {n: to_plain(v) for n, v in merged.state_dict().items()}
        expected_logits = logits(merged, tm.torch_device)
        del plain, merged
    gc.collect()
    model = lora_model()
    under(strategy, model)
    train(model, steps=1)
    merged = model.merge_and_unload()
    assert isinstance(merged, transformers.LlamaForCausalLM)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert_managed(merged)
    assert_equal_dicts({n: to_plain(v) for n, v in merged.state_dict().items()}, expected_state)
    assert torch.equal(logits(merged), expected_logits)
    check_paged()


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_generate_with_the_adapter_gives_plain_torch_s_tokens(strategy):
    with plain_torch():
        plain = lora_model().to(tm.torch_device)
        expected = generate(plain, tm.torch_device)
        with plain.disable_adapter():
            without = generate(plain, tm.torch_device)
        del plain
    # (the adapter changes the tokens: equal tokens below mean the managed calls applied it)
    assert not any(torch.equal(a, b) for a, b in zip(expected, without))
    gc.collect()
    model = lora_model()
    under(strategy, model)
    got = generate(model)
    assert [t.shape for t in got] == [(1, 4 + 5), (1, 9 + 3)] * 3
    for a, b in zip(got, expected):
        assert torch.equal(a, b), f"{a} != {b}"
    check_paged()


class LinearOfAParameter(torch.nn.Module):
    """A layer computing on its weight Parameter directly (no nn.Linear): peft adapts it with
    ``target_parameters``, a parametrization registered and removed in every forward."""

    def __init__(self, inputs, outputs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(inputs, outputs))
        self.bias = torch.nn.Parameter(torch.ones(outputs))

    def forward(self, x):
        return x @ self.weight + self.bias


class MlpOfParameters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = LinearOfAParameter(10, 20)
        self.lin1 = LinearOfAParameter(20, 2)

    def forward(self, x):
        return torch.log_softmax(self.lin1(torch.relu(self.lin0(x.float()))), dim=-1)


def target_parameters_run(device=None, strategy=None):
    """An eval call, then SGD steps of a LoRA on ``lin0.weight`` by ``target_parameters``;
    (outputs, losses, the base layer's parameter names, the base weight, the adapter)."""
    torch.manual_seed(0)
    model = MlpOfParameters()
    if device is not None:
        model = model.to(device)
    x = torch.arange(90).view(9, 10)
    x = x.to(device) if device is not None else x
    model.eval()
    outs = [to_plain(model(x))]
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(target_parameters=["lin0.weight"], init_lora_weights=False))
    if strategy is not None:
        # (a budget a few times the model's bytes: a region's first backward keeps all the
        # room it leaves, and evicts the rest of the model for it)
        tm.strategy, tm.budget = strategy, budget(64 * 1024)
        tm.reset_stats()
    model.eval()
    outs.append(to_plain(model(x)))
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x)
        loss = torch.nn.functional.nll_loss(out, torch.arange(len(out)).to(out.device) % 2)
        loss.backward()
        optimizer.step()
        losses.append(to_plain(loss))
    base_layer = model.base_model.model.lin0.base_layer
    names = sorted(n for n, _ in base_layer.named_parameters())
    return outs, losses, names, to_plain(base_layer.weight), lora_weights(model)


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_target_parameters_keeps_the_base_weight_a_parameter_and_trains_as_plain_torch(strategy):
    # the region gave its call a plain view of the frozen weight; the parametrization's
    # removal registered that view back as a buffer: the weight left named_parameters(),
    # silently, and its device copy stayed allocated outside the manager
    with plain_torch():
        expected = target_parameters_run(tm.torch_device)
    got = target_parameters_run(strategy=strategy)
    assert tm.stats()["peak_device_bytes"] <= tm.budget
    assert got[2] == expected[2] == ["bias", "weight"]
    for a, b in zip(got[0] + got[1] + [got[3]], expected[0] + expected[1] + [expected[3]]):
        assert torch.equal(a, b)
    assert_equal_dicts(got[4], expected[4])
