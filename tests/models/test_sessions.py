"""Property-based sessions of real models: what a user does over time, managed against plain torch.

Each example builds a small Hugging Face model from a config (random weights) twice from
one seed, plain torch on the device and managed under a strategy and a budget: a causal LM
(GPT-2, Llama with its embedding tied to its head or not, a Mixtral), an encoder-decoder
(T5, Whisper), an encoder (BERT's masked LM) or a vision model (ViT). It then draws a
session: training steps (AdamW or SGD, gradients accumulated over two batches or not,
clipped or not), ``generate()`` with prompts and new-token counts of varying lengths
(greedy or sampling; a forward for the models that do not generate), forwards without
gradients of varying lengths, the budget changed, every block evicted, a layer frozen (as an
adapter's user freezes the base), gradient checkpointing switched on or off, a state dict
loaded, and a host budget set (host copies beyond it go to the disk tier) or lifted. Some
sessions run with Python's garbage collector at every few allocations, so that TensorRefs in
reference cycles die at any point of an op, not only where a long run happens to collect;
some with a strategy that evicts the newest block it may (from the device and from host
memory), a choice every strategy is free to make.
After every step the logits, the losses, the tokens, the gradients, the optimizer's state
and every parameter and buffer must be plain torch's, bit for bit, and the manager's peak
within the budget.

A fixed set of sessions runs by default; ``TORCHTENSORREF_PROPERTY_EXAMPLES=N`` draws N at
random instead (a search; ``--hypothesis-seed`` replays one).
"""

from __future__ import annotations

import gc
import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchTensorRef import tensorsManager as tm
from paired import collecting, evict_newest, plain_torch

from . import harness
from .harness import Case, hf_forward

transformers = pytest.importorskip("transformers")

_SEARCH = int(os.environ.get("TORCHTENSORREF_PROPERTY_EXAMPLES", "0"))
SESSIONS = settings(
    max_examples=_SEARCH or 6,
    derandomize=not _SEARCH,
    print_blob=bool(_SEARCH),
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

VOCAB = 64
LAYERS = 2
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _config(name: str):
    if name == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=LAYERS, n_head=2,
                                       **SPECIAL)
    if name == "t5":
        return transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=LAYERS,
                                     num_decoder_layers=LAYERS, num_heads=4, relative_attention_num_buckets=8,
                                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=2)
    if name == "whisper":
        return transformers.WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=LAYERS, decoder_layers=LAYERS,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_source_positions=8, max_target_positions=32, decoder_start_token_id=1, suppress_tokens=None,
            begin_suppress_tokens=None, **SPECIAL)
    if name == "bert":
        return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=LAYERS, num_attention_heads=2, max_position_embeddings=64,
                                       pad_token_id=0)
    if name == "vit":
        # (twice the others' width: at 30% of thinner weights, the patch convolution's backward
        # alone is more than the budget where allocations are rounded as CUDA's are)
        return transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=2,
                                      num_labels=5)
    shapes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)
    if name == "mixtral":  # (experts stacked in one parameter, tokens routed by count)
        # (a third layer: a projection's stacked experts, in one op, fit 30% of the weights)
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                          **dict(shapes, num_hidden_layers=LAYERS + 1))
    return transformers.LlamaConfig(tie_word_embeddings=name == "llama_tied", **shapes)


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length))


def _text_inputs(batch: int, length: int, use: str) -> dict:
    """A causal LM's: the tokens, their own labels when training."""
    ids = _ids(batch, length)
    return dict(input_ids=ids, labels=ids) if use == "train" else dict(input_ids=ids)


def _t5_inputs(batch: int, length: int, use: str) -> dict:
    """An encoder-decoder's on tokens: the source, and the target (``labels``) or the decoder's
    tokens so far; ``generate()`` starts the decoder itself."""
    out = dict(input_ids=_ids(batch, length))
    if use != "generate":
        out["labels" if use == "train" else "decoder_input_ids"] = _ids(batch, max(length // 2, 1))
    return out


def _whisper_inputs(batch: int, length: int, use: str) -> dict:
    """An encoder-decoder's on audio features of the one length the config takes
    (``num_mel_bins`` by twice ``max_source_positions``)."""
    out = dict(input_features=torch.randn(batch, 8, 16))
    if use != "generate":
        out["labels" if use == "train" else "decoder_input_ids"] = _ids(batch, length)
    return out


def _bert_inputs(batch: int, length: int, use: str) -> dict:
    """A masked LM's: the loss on about half the tokens."""
    ids = _ids(batch, length)
    out = dict(input_ids=ids, token_type_ids=torch.zeros_like(ids))
    if use == "train":
        out["labels"] = ids.masked_fill(torch.rand(batch, length) < 0.5, -100)
    return out


def _vit_inputs(batch: int, _length: int, use: str) -> dict:
    """An image classifier's (images of the one size the config takes)."""
    out = dict(pixel_values=torch.randn(batch, 3, 16, 16))
    if use == "train":
        out["labels"] = torch.randint(0, 5, (batch,))
    return out


#: name -> (transformers' Auto class, its inputs ``(batch, length, use) -> kwargs`` drawn from
#: the RNG, whether it generates)
FAMILIES = {
    **{name: ("AutoModelForCausalLM", _text_inputs, True) for name in ("gpt2", "llama", "llama_tied", "mixtral")},
    "t5": ("AutoModelForSeq2SeqLM", _t5_inputs, True),
    "whisper": ("AutoModelForSpeechSeq2Seq", _whisper_inputs, True),
    "bert": ("AutoModelForMaskedLM", _bert_inputs, False),
    "vit": ("AutoModelForImageClassification", _vit_inputs, False),
}


def _layers(model) -> torch.nn.ModuleList:
    """The model's first stack of layers (the encoder's, where it has two)."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= LAYERS)


STEP = st.one_of(
    st.tuples(st.just("train"), st.sampled_from(["adamw", "sgd"]), st.booleans(), st.booleans()),
    st.tuples(st.just("generate"), st.integers(1, 2), st.integers(1, 10), st.integers(1, 8), st.booleans()),
    st.tuples(st.just("forward"), st.integers(1, 12)),
    st.tuples(st.just("budget"), st.sampled_from([None, 0.3, 0.5, 1.0, 2.0])),
    st.tuples(st.just("evict")),
    st.tuples(st.just("freeze"), st.integers(0, LAYERS - 1)),
    st.tuples(st.just("checkpointing"), st.booleans()),
    st.tuples(st.just("load")),
    st.tuples(st.just("disk"), st.sampled_from([None, 1.0, 2.0])),
)


def _checkpointing(model, on: bool) -> None:
    """Gradient checkpointing on (non-reentrant) or off, by transformers' current name."""
    name = "activation_checkpointing" if hasattr(model, "activation_checkpointing_enable") else (
        "gradient_checkpointing")
    if on:
        getattr(model, f"{name}_enable")(**{f"{name}_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_disable")()


class Session:
    """One model, managed and plain, and what the session has made of it so far."""

    def __init__(self, name: str, strategy: str, fraction, victims: str = "strategy"):
        tm.strategy = strategy
        if victims == "newest":
            evict_newest(tm.strategy)
        auto, self.inputs, self.generates = FAMILIES[name]
        case = Case(name, lambda: getattr(transformers, auto).from_config(_config(name)), dict, hf_forward)
        harness.BUDGET_FRACTION, previous = (fraction or 1.0), harness.BUDGET_FRACTION
        try:
            self.pair = harness.build_pair(case)
        finally:
            harness.BUDGET_FRACTION = previous
        if fraction is None:
            tm.budget = None
        self.weights = harness.param_bytes(self.pair.plain)
        self.optimizers = {}
        self.seed = 10
        self.folder = None  # (the disk tier's, once a host budget is set)

    def both(self, fn):
        """``fn(model)`` on the managed model, then on the plain one (same RNG state)."""
        self.seed += 1
        torch.manual_seed(self.seed)
        managed = fn(self.pair.managed, False)
        with plain_torch():
            torch.manual_seed(self.seed)
            plain = fn(self.pair.plain, True)
        return managed, plain

    def draw(self, batch: int, length: int, use: str):
        """The family's inputs for ``use`` ("train", "forward", "generate"), managed and plain."""
        return self.both(lambda _m, _p: self.inputs(batch, length, use))

    def step(self, kind, *p) -> None:
        pair = self.pair
        if kind == "train":
            self.train(*p)
        elif kind == "generate" and self.generates:
            batch, prompt, new, sample = p
            in_m, in_p = self.draw(batch, prompt, "generate")
            options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=sample, top_k=10)
            for m in (pair.managed, pair.plain):
                m.eval()
            tokens = self.both(lambda m, plain: m.generate(**(in_p if plain else in_m), **options))
            harness.compare(*tokens, "generated tokens")
        elif kind in ("forward", "generate"):  # (a model that does not generate runs a batch instead)
            batch, length = (1, p[0]) if kind == "forward" else p[:2]
            in_m, in_p = self.draw(batch, length, "forward")
            with torch.no_grad():
                logits = self.both(lambda m, plain: m(**(in_p if plain else in_m)).logits)
            harness.compare(*logits, "logits without gradients")
        elif kind == "budget":
            tm.budget = None if p[0] is None else tm.outside_bytes() + int(p[0] * self.weights)
            tm.reset_stats()
        elif kind == "evict":
            tm.evict_all()
        elif kind == "freeze":
            self.both(lambda m, _p: _layers(m)[p[0]].requires_grad_(False))
        elif kind == "checkpointing":
            self.both(lambda m, _p: _checkpointing(m, p[0]))
        elif kind == "load":
            self.both(lambda m, _p: m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()}))
        elif kind == "disk":
            self.host_budget(p[0])
        harness.compare_state(pair, f"after {kind}")
        if tm.budget is not None:
            pair.check_peak(kind)

    def host_budget(self, fraction) -> None:
        """Host copies beyond ``fraction`` of the weights (above what cannot leave host
        memory) go to the disk tier; ``None``: no host budget."""
        if fraction is None:
            tm.host_budget = None
            return
        if self.folder is None:
            self.folder = tempfile.TemporaryDirectory()
            tm.offload_dir = self.folder.name
        gc.collect()
        held = sum(b.nbytes for b in tm.host_tier.hosted.values() if b.host_shared or b.external)
        tm.host_budget = held + int(fraction * self.weights)

    def close(self) -> None:
        tm.budget = tm.host_budget = None
        if self.folder is not None:
            tm.offload_dir = None
            self.folder.cleanup()

    def train(self, optimizer: str, accumulate: bool, clip: bool) -> None:
        pair = self.pair
        if optimizer not in self.optimizers:
            make = (lambda ps: torch.optim.AdamW(ps, lr=1e-2)) if optimizer == "adamw" else (
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
            self.optimizers[optimizer] = self.both(lambda m, _p: make(m.parameters()))
        for m in (pair.managed, pair.plain):
            m.train()
        for _ in range(2 if accumulate else 1):
            in_m, in_p = self.draw(2, 6, "train")
            out = self.both(lambda m, plain: m(**(in_p if plain else in_m)))
            harness.compare(out[0].logits, out[1].logits, "training logits")
            harness.compare(out[0].loss, out[1].loss, "training loss")
            out[0].loss.backward()
            with plain_torch():
                out[1].loss.backward()
            out = None
        harness.compare_grads(pair)
        opt_m, opt_p = self.optimizers[optimizer]
        if clip:
            norms = self.both(lambda m, _p: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
            harness.compare(*norms, "gradient norm")
        opt_m.step()
        opt_m.zero_grad()
        with plain_torch():
            opt_p.step()
            opt_p.zero_grad()
        for state_m, state_p in zip(opt_m.state.values(), opt_p.state.values()):
            for key in state_p:
                if isinstance(state_p[key], torch.Tensor) and state_p[key].dim():
                    harness.compare(state_m[key], state_p[key], f"optimizer state {key}")


@SESSIONS
@given(name=st.sampled_from(list(FAMILIES)), strategy=st.sampled_from(["genoa", "flow"]),
       fraction=st.sampled_from([None, 0.3, 0.5, 1.0]), steps=st.lists(STEP, min_size=1, max_size=6),
       collect_often=st.booleans(), victims=st.sampled_from(["strategy", "newest"]))
def test_model_sessions_match_plain_torch(name, strategy, fraction, steps, collect_often, victims):
    with collecting(collect_often):
        session = Session(name, strategy, fraction, victims)
        try:
            for step in steps:
                session.step(*step)
        finally:
            session.close()
            session = None
            gc.collect()
