"""Hugging Face ``transformers`` models, unmodified, under every strategy and a tight budget.

Each model is built from a small config with random weights (no download). Configs have
several thin layers so that the budget (30% of the parameter bytes) forces weights out
while every single op, optimizer updates included, still fits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from . import harness  # noqa: E402
from paired import device_type  # noqa: E402,I100
from .harness import Case, hf_forward  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 128
BATCH, SEQ = 2, 8
#: special tokens inside the small vocabulary (the defaults of some configs are not)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _causal_inputs():
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    return dict(input_ids=ids, attention_mask=torch.ones(BATCH, SEQ, dtype=torch.long), labels=ids)


def _generate(model, inputs):
    kwargs = {k: v for k, v in inputs.items() if k != "labels"}
    return model.generate(**kwargs, max_new_tokens=6, do_sample=False)


def gpt2_config():
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=2, **SPECIAL)


def llama_config(layers=4):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)


def mistral_config():
    # A sliding window shorter than prompt + generated tokens, so the window is exercised.
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=6,
        **SPECIAL)


def mixtral_config():
    # A mixture of experts: its experts' weights stacked in one parameter per projection,
    # tokens routed by a count of integers (``histc``) and ``grouped_mm`` in training,
    # ``batched_mm`` (each token's experts gathered) in decoding, as on CUDA.
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8,
        num_experts_per_tok=2, **SPECIAL)


def qwen3_moe_config():
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=8,
        num_experts_per_tok=2, **SPECIAL)


def bert_config():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
        num_attention_heads=2, max_position_embeddings=32, pad_token_id=0)


def t5_config():
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=1)


def vit_config():
    return transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_labels=5)


def whisper_config():
    return transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=3, decoder_layers=3,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=8, max_target_positions=32, decoder_start_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None, **SPECIAL)


def _bert_inputs():
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    labels = ids.masked_fill(torch.rand(BATCH, SEQ) < 0.5, -100)  # loss on about half the tokens
    return dict(input_ids=ids, token_type_ids=torch.zeros_like(ids), labels=labels)


def _t5_inputs():
    return dict(input_ids=torch.randint(3, VOCAB, (BATCH, SEQ)), labels=torch.randint(3, VOCAB, (BATCH, 6)))


def _vit_inputs():
    return dict(pixel_values=torch.randn(BATCH, 3, 16, 16), labels=torch.randint(0, 5, (BATCH,)))


def _whisper_inputs():
    # input_features: (batch, num_mel_bins, 2 * max_source_positions)
    return dict(input_features=torch.randn(BATCH, 8, 16), labels=torch.randint(3, VOCAB, (BATCH, 6)))


def _auto(auto_class, config_fn):
    return lambda: getattr(transformers, auto_class).from_config(config_fn())


CASES = {
    "gpt2": Case("gpt2", _auto("AutoModelForCausalLM", gpt2_config), _causal_inputs, hf_forward, _generate),
    "llama": Case("llama", _auto("AutoModelForCausalLM", llama_config), _causal_inputs, hf_forward, _generate),
    "mistral": Case("mistral", _auto("AutoModelForCausalLM", mistral_config), _causal_inputs, hf_forward, _generate),
    "mixtral": Case("mixtral", _auto("AutoModelForCausalLM", mixtral_config), _causal_inputs, hf_forward, _generate),
    "qwen3_moe": Case("qwen3_moe", _auto("AutoModelForCausalLM", qwen3_moe_config), _causal_inputs, hf_forward,
                      _generate),
    "bert": Case("bert", _auto("AutoModelForMaskedLM", bert_config), _bert_inputs, hf_forward),
    "t5": Case("t5", _auto("AutoModelForSeq2SeqLM", t5_config), _t5_inputs, hf_forward, _generate),
    "vit": Case("vit", _auto("AutoModelForImageClassification", vit_config), _vit_inputs, hf_forward),
    "whisper": Case("whisper", _auto("AutoModelForSpeechSeq2Seq", whisper_config), _whisper_inputs, hf_forward,
                    _generate),
}
GENERATIVE = [name for name, case in CASES.items() if case.generate is not None]


@pytest.mark.parametrize("name", list(CASES))
def test_training_step(name, strategy):
    harness.check_training(harness.build_pair(CASES[name]))


@pytest.mark.parametrize("name", GENERATIVE)
def test_generate_greedy(name, strategy):
    harness.check_generate(harness.build_pair(CASES[name]))


GENERATION_MODES = {
    "static_cache": dict(do_sample=False, cache_implementation="static"),
    "beam_search": dict(do_sample=False, num_beams=3),
    "sampling": dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8),
}


@pytest.mark.parametrize("mode", list(GENERATION_MODES))
def test_generate_modes(mode, strategy):
    # A static cache is preallocated and written in place; beam search reorders the cache;
    # sampling draws from the RNG.
    def generate(model, inputs):
        kwargs = {k: v for k, v in inputs.items() if k != "labels"}
        return model.generate(**kwargs, max_new_tokens=6, **GENERATION_MODES[mode])

    harness.check_generate(harness.build_pair(CASES["llama"]), generate)


@pytest.mark.parametrize("name", list(CASES))
def test_save_and_from_pretrained(name, strategy, tmp_path):
    harness.check_save_pretrained(harness.build_pair(CASES[name]), tmp_path)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_autocast_bfloat16(name, strategy):
    pair = harness.build_pair(CASES[name])
    harness.check_training(pair, autocast=lambda: torch.autocast(device_type(), dtype=torch.bfloat16))


def test_bfloat16_weights_by_to(strategy):
    # GPT-2 ties lm_head to wte: Module.to visits the tied parameter twice.
    pair = harness.build_pair(CASES["gpt2"], convert=lambda m: m.to(torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in pair.managed.parameters())
    harness.check_training(pair)


def test_bfloat16_weights_from_config(strategy):
    case = dataclasses.replace(
        CASES["llama"],
        build=lambda: transformers.AutoModelForCausalLM.from_config(llama_config(), dtype=torch.bfloat16))
    pair = harness.build_pair(case)
    assert all(p.dtype == torch.bfloat16 for p in pair.managed.parameters())
    harness.check_training(pair)
    harness.check_generate(pair)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("name, reentrant, method", [
    ("gpt2", True, "gradient_checkpointing_enable"),  # the long-standing name (deprecated in v5)
    ("llama", False, "activation_checkpointing_enable"),
])
def test_gradient_checkpointing(name, reentrant, method, strategy):
    if not hasattr(transformers.PreTrainedModel, method):
        method = "gradient_checkpointing_enable"  # transformers before v5
    options = method.split("_enable")[0] + "_kwargs"

    def enable(model):
        getattr(model, method)(**{options: {"use_reentrant": reentrant}})
        return model

    pair = harness.build_pair(CASES[name], convert=enable)
    assert any(getattr(m, "gradient_checkpointing", False) for m in pair.managed.modules())
    harness.check_training(pair)


@pytest.mark.parametrize("options", [dict(foreach=True), dict(fused=True)], ids=["foreach", "fused"])
def test_list_optimizers_and_clipping(options, strategy):
    # foreach and fused optimizers, and foreach gradient clipping, update every parameter in
    # one op whose lists are larger than the budget. A fused AdamW position holds a weight,
    # its gradient and two states: six layers, so that the embedding's four fit the budget.
    case = dataclasses.replace(
        CASES["llama"], build=lambda: transformers.AutoModelForCausalLM.from_config(llama_config(layers=6)))
    pair = harness.build_pair(case)
    harness.check_training(
        pair, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, **options), clip_foreach=True)
