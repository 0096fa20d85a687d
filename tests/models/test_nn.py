"""Plain ``torch.nn`` models, unmodified, under every strategy and a tight budget.

Each is a stack of thin layers, so that the budget (30% of the parameter bytes) forces
weights out while every single op, optimizer updates included, still fits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchTensorRef
from paired import give_room, outside, plain_torch

from . import harness
from .harness import Case

BATCH, SEQ = 2, 8

# TransformerEncoder's eval fast path warns that nested tensors are a prototype API.
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")


class AttentionStack(nn.Module):
    """Residual ``nn.MultiheadAttention`` layers, optionally checkpointed."""

    def __init__(self, dim=16, heads=4, layers=8, classes=10, checkpointed=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(dim, classes)
        self.checkpointed = checkpointed

    def _layer(self, layer, x):
        return x + layer(x, x, x, need_weights=False)[0]

    def forward(self, x):
        for layer in self.layers:
            if self.checkpointed:
                x = checkpoint(self._layer, layer, x, use_reentrant=False)
            else:
                x = self._layer(layer, x)
        return self.head(x).mean(1)


class Recurrent(nn.Module):
    """A multi-layer ``nn.LSTM`` (one fused kernel per layer) and a classifier.

    On CPU each layer is one oneDNN kernel whose workspace (kept for backward) is about
    as large as the layer's weights: many layers, so that one layer's op fits the budget.
    """

    def __init__(self, features=64, hidden=64, layers=12, classes=10):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + ReLU blocks: running statistics are buffers written in place."""

    def __init__(self, channels=8, blocks=12, classes=10):
        super().__init__()
        layers = []
        for i in range(blocks):
            layers += [nn.Conv2d(3 if i == 0 else channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                       nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection's (tied weights)."""

    def __init__(self, vocab=32, dim=32, layers=12):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(dim, dim), nn.Tanh())])
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embedding.weight

    def forward(self, ids):
        return self.out(self.body(self.embedding(ids)))


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` with a key padding mask (eval runs PyTorch's fast path)."""

    def __init__(self, dim=16, heads=2, layers=6, classes=10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, classes)

    def forward(self, x, padding):
        return self.head(self.encoder(x, src_key_padding_mask=padding)[:, 0])


def _padded_sequences():
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[1, SEQ // 2:] = True  # the second sequence is half padding
    return dict(x=torch.randn(BATCH, SEQ, 16), padding=padding, labels=torch.randint(0, 10, (BATCH,)))


def _encoder(model, inputs):
    out = model(inputs["x"], inputs["padding"])
    return out, F.cross_entropy(out, inputs["labels"])


def _regression(model, inputs):
    out = model(inputs["x"])
    return out, F.mse_loss(out, inputs["target"])


def _classification(model, inputs):
    out = model(inputs["x"])
    return out, F.cross_entropy(out, inputs["labels"])


def _language_model(model, inputs):
    logits = model(inputs["ids"])
    return logits, F.cross_entropy(logits.flatten(0, 1), inputs["ids"].flatten())


CASES = {
    "multihead_attention": Case(
        "multihead_attention", AttentionStack,
        lambda: dict(x=torch.randn(BATCH, SEQ, 16), target=torch.randn(BATCH, 10)), _regression),
    "lstm": Case(
        "lstm", Recurrent,
        lambda: dict(x=torch.randn(BATCH, SEQ, 64), labels=torch.randint(0, 10, (BATCH,))), _classification),
    "conv_batchnorm": Case(
        "conv_batchnorm", ConvNet,
        lambda: dict(x=torch.randn(BATCH, 3, 4, 4), labels=torch.randint(0, 10, (BATCH,))), _classification),
    "transformer_encoder": Case("transformer_encoder", Encoder, _padded_sequences, _encoder),
    "tied_embedding": Case("tied_embedding", TiedLM, lambda: dict(ids=torch.randint(0, 32, (BATCH, SEQ))),
                           _language_model),
}


def _kernels_that_fit(name: str):
    """The LSTM's layers as ops of their own: on CUDA cuDNN runs all twelve as one op, larger
    than the budget (refused, as docs/compatibility.md says, with this way round it)."""
    return torch.backends.cudnn.flags(enabled=name != "lstm")


@pytest.mark.parametrize("name", list(CASES))
def test_training_step(name, strategy):
    # check_training compares the whole state dict after the step: BatchNorm's running
    # mean, variance and num_batches_tracked included.
    with _kernels_that_fit(name):
        harness.check_training(harness.build_pair(CASES[name]))


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip(name, strategy, tmp_path):
    with _kernels_that_fit(name):
        harness.check_state_dict_roundtrip(harness.build_pair(CASES[name]), tmp_path)


def test_pickled_module_round_trip(strategy, tmp_path):
    # torch.load of a whole pickled module used to return it with plain, unmanaged
    # parameters (only tensors, dicts, lists and tuples were adopted).
    pair = harness.build_pair(CASES["tied_embedding"])
    harness.check_pickled_module_roundtrip(pair, tmp_path)


def test_tied_weights_stay_tied(strategy):
    pair = harness.build_pair(CASES["tied_embedding"])
    harness.check_training(pair)
    model = pair.managed
    assert model.out.weight is model.embedding.weight
    assert model.out.weight.untyped_storage().data_ptr() == model.embedding.weight.untyped_storage().data_ptr()


def test_tied_weights_to_bfloat16(strategy):
    # Module.to visits a tied parameter twice; the second time ``p.to(dtype)`` returns p
    # itself and ``p.data = p`` used to release p's own block (its bytes were lost).
    pair = harness.build_pair(CASES["tied_embedding"], convert=lambda m: m.to(torch.bfloat16))
    assert pair.managed.out.weight.dtype == torch.bfloat16
    harness.check_training(pair)


def test_lstm_workspace_of_the_cpu_kernel_is_estimated():
    # The oneDNN LSTM kernel (plain CPU; on the strict sim an LSTM runs the fused cell
    # instead) returns a workspace its meta kernel reports as empty: the op used to be
    # admitted on a 1.2 KiB estimate and then overshoot the budget by 28 KiB.
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchTensorRef.ops.output_size import estimate_output_bytes
    from torchTensorRef.core.op_specs import spec_of

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                calls.append((args, kwargs or {}, out))
            return out

    calls = []
    with torchTensorRef.disabled(), Record():
        nn.LSTM(16, 16, batch_first=True)(torch.randn(2, 8, 16))
    if not calls:
        pytest.skip("this CPU build runs LSTMs without oneDNN")
    args, kwargs, out = calls[0]
    produced = sum(t.untyped_storage().nbytes() for t in out)
    assert produced > 8 * 1024  # the workspace
    # (the estimate is in device bytes: each result as the device's allocator gives it)
    on_device = sum(torchTensorRef.tensorsManager.block_bytes(t.untyped_storage().nbytes()) for t in out)
    assert estimate_output_bytes(spec_of(torch.ops.aten.mkldnn_rnn_layer.default), args, kwargs) == on_device


def test_activation_checkpointing(strategy):
    case = Case("checkpointed_attention", lambda: AttentionStack(checkpointed=True),
                CASES["multihead_attention"].inputs, _regression)
    harness.check_training(harness.build_pair(case))


def test_batchnorm_eval_uses_running_statistics(strategy):
    pair = harness.build_pair(CASES["conv_batchnorm"])
    harness.check_training(pair)
    managed_inputs, plain_inputs = harness.inputs_pair(pair.case, seed=7)
    logits = harness.eval_logits(pair.case, pair.managed, managed_inputs)
    with torchTensorRef.disabled():
        expected = harness.eval_logits(pair.case, pair.plain, plain_inputs)
    pair.compare(logits, expected, "eval-mode outputs")
    pair.check_peak("eval")


@pytest.mark.parametrize("name", ["tied_embedding", "conv_batchnorm"])
def test_grad_scaler_and_sgd(name, strategy):
    # GradScaler unscales all gradients in one list op and checks them for infs; SGD with
    # momentum and foreach keeps a momentum buffer per parameter.
    harness.check_training(
        harness.build_pair(CASES[name]), scaler=True,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True))


def _encoder_eval_pair():
    pair = harness.build_pair(CASES["transformer_encoder"])
    managed_inputs, plain_inputs = harness.inputs_pair(pair.case)
    out = harness.eval_logits(pair.case, pair.managed, managed_inputs)
    with plain_torch():  # (its outputs on the device are given to the budget, as the harness's are)
        expected = harness.eval_logits(pair.case, pair.plain, plain_inputs)
    pair.check_peak("eval")
    return out, expected


def test_transformer_encoder_fast_path_values(strategy):
    # In eval with a padding mask, TransformerEncoder packs its activations into a nested
    # tensor (strided layout, but no single storage): wrapping it used to raise
    # "NestedTensorImpl doesn't support sizes".
    out, expected = _encoder_eval_pair()
    with torchTensorRef.disabled():
        assert torch.equal(out.target if isinstance(out, torchTensorRef.TensorRef) else out, expected)


@pytest.mark.xfail(strict=True, reason="nested-tensor activations are not managed: docs/compatibility.md")
def test_transformer_encoder_fast_path_is_managed(strategy):
    pair = harness.build_pair(CASES["transformer_encoder"])
    managed_inputs, plain_inputs = harness.inputs_pair(pair.case)
    pair.managed.eval()
    with torch.no_grad():
        out = pair.managed.encoder(managed_inputs["x"], src_key_padding_mask=managed_inputs["padding"])
    with torchTensorRef.disabled():
        pair.plain.eval()
        with torch.no_grad():
            expected = pair.plain.encoder(plain_inputs["x"], src_key_padding_mask=plain_inputs["padding"])
    harness.compare(out, expected, "encoder outputs")  # a plain tensor: the fast path left us


class SparseBag(nn.Module):
    """An embedding with sparse gradients (trained with SGD) under dense layers."""

    def __init__(self, vocab=64, dim=16, layers=30, classes=10):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=True)
        self.body = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.body(self.embedding(ids).mean(1)))  # ids: (batch, bag)


def test_sparse_embedding_sgd_values(strategy):
    case = Case("sparse_embedding", SparseBag,
                lambda: dict(x=torch.randint(0, 64, (BATCH, SEQ)), labels=torch.randint(0, 10, (BATCH,))),
                _classification)
    pair = harness.build_pair(case)
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    # The sparse gradient itself is a plain tensor (see the xfail below): compare it densely.
    grad_m, grad_p = [], []
    pair.managed.embedding.weight.register_post_accumulate_grad_hook(lambda p: grad_m.append(p.grad.to_dense()))
    with torchTensorRef.disabled():
        pair.plain.embedding.weight.register_post_accumulate_grad_hook(lambda p: grad_p.append(p.grad.to_dense()))
    managed_inputs, plain_inputs = harness.inputs_pair(case)
    before = outside()
    _out, loss = case.forward(pair.managed, managed_inputs)
    loss.backward()
    sgd(pair.managed.parameters()).step()
    give_room(outside() - before)  # (the sparse gradient: a plain device tensor beside the manager's)
    with plain_torch():
        _out, loss = case.forward(pair.plain, plain_inputs)
        loss.backward()
        sgd(pair.plain.parameters()).step()
        assert torch.equal(grad_m[0], grad_p[0])
    harness.compare_state(pair, "after an SGD step")
    pair.check_peak("sparse training step")


@pytest.mark.xfail(strict=True, reason="sparse gradients are not managed: docs/compatibility.md")
def test_sparse_embedding_gradient_is_managed(strategy):
    embedding = nn.Embedding(64, 16, sparse=True)
    embedding(torch.randint(0, 64, (BATCH, SEQ))).sum().backward()
    managed = isinstance(embedding.weight.grad, torchTensorRef.TensorRef)
    del embedding  # (the failure's traceback would keep its plain device gradient past the test)
    assert managed
