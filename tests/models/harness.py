"""Run a model managed and plain from the same seed, and compare everything its user sees.

A :class:`Case` says how to build a model and its inputs from the current RNG state and
how to run it. :func:`build_pair` builds the plain reference inside
``plain_torch()`` (plain torch on the same device) and the managed model from the same seed,
under a budget of
``BUDGET_FRACTION`` of the model's parameter bytes. The ``check_*`` functions then do what
the model's user would do to both (train a step, generate, save and reload) and compare
every result; each asserts that the manager's peak stayed within the budget.

Comparisons are bit-exact by default: the plain model runs on the same device (``"sim"``:
plain SimTensors; CUDA: plain CUDA tensors), so PyTorch picks the same kernels for both, and
the managed model runs them on the same values, with the same strides and in the same
order, so any difference is a bug. A case that cannot be bit-exact says why in its
``tolerance``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch

from paired import device_type, plain_torch, values
from torchTensorRef import TensorRef, tensorsManager

#: the budget is this fraction of the model's parameter bytes: weights must be paged
BUDGET_FRACTION = 0.3
#: seeds of the model's weights, of its inputs, and of the RNG its forward uses (dropout)
MODEL_SEED, INPUT_SEED, FORWARD_SEED = 0, 1, 2

Inputs = Dict[str, torch.Tensor]


@dataclass
class Case:
    """One model as its user writes it.

    Attributes:
        name: test id.
        build: builds the model from the current RNG state (no download).
        inputs: the forward's keyword arguments, drawn from the current RNG state.
        forward: ``(model, inputs) -> (logits, loss)``.
        generate: ``(model, inputs) -> tokens`` for generative models.
        tolerance: ``None`` for bit-exact comparisons, else ``assert_close`` keyword
            arguments (and a comment saying why exactness is out of reach).
    """

    name: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], Inputs]
    forward: Callable[[torch.nn.Module, Inputs], Tuple[torch.Tensor, torch.Tensor]]
    generate: Optional[Callable[[torch.nn.Module, Inputs], torch.Tensor]] = None
    tolerance: Optional[dict] = field(default=None)

    def __repr__(self) -> str:
        return self.name


def hf_forward(model, inputs: Inputs):
    """A Hugging Face model called with labels: its logits and loss."""
    out = model(**inputs)
    return out.logits, out.loss


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct parameters (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class Pair:
    """A managed model and its plain twin, built from the same seed."""

    case: Case
    managed: torch.nn.Module
    plain: torch.nn.Module
    budget: int

    def check_peak(self, when: str, outside: Optional[int] = None) -> None:
        """The manager's peak fits in what the budget leaves it beside what is allocated
        outside the manager (workspaces, and the plain reference, which plain_torch() adds to
        the budget as it allocates it): now, or ``outside`` where given. (The device's own
        bytes at every op's end are the ``budget`` fixture's to check.)"""
        s = tensorsManager.stats()
        budget = tensorsManager.budget
        outside = s["outside_bytes"] if outside is None else outside
        peak = s["peak_device_bytes"] + outside
        assert peak <= budget, (f"{when}: peak device bytes {peak} exceed the budget {budget} "
                                f"({outside} of them outside the manager)")

    def compare(self, managed, plain, what: str) -> None:
        compare(managed, plain, what, self.case.tolerance)


def compare(managed, plain, what: str, tolerance: Optional[dict] = None) -> None:
    """Assert that managed tensor ``managed`` holds plain tensor ``plain``'s values."""
    assert isinstance(managed, TensorRef), f"{what}: managed result is a {type(managed).__name__}, not a TensorRef"
    assert not isinstance(plain, TensorRef), f"{what}: the plain reference is managed"
    assert managed.device == plain.device, f"{what}: device {managed.device} != {plain.device}"
    # (compared on the CPU: Genoa leaves results on the host; both were computed on one device)
    actual, plain = managed.target.cpu(), values(plain).cpu()
    assert actual.dtype == plain.dtype, f"{what}: dtype {actual.dtype} != {plain.dtype}"
    assert actual.shape == plain.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(plain.shape)}"
    if tolerance is None:
        if not torch.equal(actual, plain):
            diff = (actual.double() - plain.double()).abs().max().item() if actual.is_floating_point() else "n/a"
            raise AssertionError(f"{what}: not bit-identical to plain torch (max abs diff {diff})")
    else:
        torch.testing.assert_close(actual, plain, msg=lambda m: f"{what}: {m}", **tolerance)


def compare_state(pair: Pair, what: str) -> None:
    """Every parameter and buffer (BatchNorm running statistics included)."""
    managed = pair.managed.state_dict(keep_vars=True)
    with plain_torch():
        plain = pair.plain.state_dict(keep_vars=True)
    assert list(managed) == list(plain)
    for name, value in managed.items():
        pair.compare(value, plain[name], f"{what}: {name}")


def compare_grads(pair: Pair) -> None:
    """Every parameter's gradient, including which ones have none."""
    plain = dict(pair.plain.named_parameters())
    for name, p in pair.managed.named_parameters():
        q = plain[name]
        assert (p.grad is None) == (q.grad is None), f"grad of {name}: managed {p.grad is None}, plain {q.grad is None}"
        if p.grad is not None:
            pair.compare(p.grad, q.grad, f"grad of {name}")


def inputs_pair(case: Case, seed: int = INPUT_SEED) -> Tuple[Inputs, Inputs]:
    """The case's inputs made by patched torch (TensorRefs) and by plain torch, same seed."""
    torch.manual_seed(seed)
    managed = case.inputs()
    with plain_torch():
        torch.manual_seed(seed)
        plain = case.inputs()
    for name, value in managed.items():
        compare(value, plain[name], f"input {name}")
    return managed, plain


def build_pair(case: Case, convert: Callable[[torch.nn.Module], torch.nn.Module] = lambda m: m) -> Pair:
    """Build the plain model, set the budget from its size, then build the managed one.

    ``convert`` is applied to both right after building (``.to(bfloat16)``, enabling
    gradient checkpointing, ...), as the user would.
    """
    with plain_torch():
        torch.manual_seed(MODEL_SEED)
        plain = convert(case.build())
    budget = tensorsManager.outside_bytes() + int(BUDGET_FRACTION * param_bytes(plain))
    tensorsManager.budget = budget
    tensorsManager.reset_stats()
    torch.manual_seed(MODEL_SEED)
    managed = convert(case.build())
    pair = Pair(case, managed, plain, budget)
    compare_state(pair, "after construction")
    pair.check_peak("construction")
    return pair


def _run(pair: Pair, managed_inputs, plain_inputs, autocast, when: str):
    """Both models' forward, compared; the manager's peak checked (``when``) against what was
    outside it before: the plain reference's activations, which its loss keeps for the
    backward, and the managed model's own kept plain (a region's saved tensors while nothing
    pages: Note [Saved while nothing pages]) were counted in the room kept at its peak."""
    ctx = autocast or contextlib.nullcontext
    before = tensorsManager.stats()["outside_bytes"]
    torch.manual_seed(FORWARD_SEED)
    with ctx():
        logits_m, loss_m = pair.case.forward(pair.managed, managed_inputs)
    pair.check_peak(when, before)
    with plain_torch():
        torch.manual_seed(FORWARD_SEED)
        with ctx():
            logits_p, loss_p = pair.case.forward(pair.plain, plain_inputs)
    pair.compare(logits_m, logits_p, "logits")
    pair.compare(loss_m, loss_p, "loss")
    return loss_m, loss_p


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def check_training(
    pair: Pair,
    autocast: Optional[Callable] = None,
    optimizer: Callable = adamw,
    clip_foreach: Optional[bool] = None,
    scaler: bool = False,
    steps: int = 2,
) -> None:
    """``steps`` training steps, each a forward (logits, loss), backward (every gradient) and
    an optimizer step (every parameter and buffer), then a forward with the updated weights.
    (Two by default: a module region's first call with gradients runs op by op, measured,
    and its later ones as one op with a backward of its own.)

    Args:
        autocast: factory of the context the forwards run in (mixed precision).
        optimizer: ``params -> torch.optim.Optimizer`` (AdamW by default).
        clip_foreach: if not ``None``, ``clip_grad_norm_(..., foreach=clip_foreach)``
            before the step (its total norm is compared too).
        scaler: step through a ``torch.amp.GradScaler`` of the device (scaled backward, unscale,
            inf check, scale update).
    """
    managed_inputs, plain_inputs = inputs_pair(pair.case)
    pair.managed.train()
    pair.plain.train()
    loss_m, loss_p = _run(pair, managed_inputs, plain_inputs, autocast, "forward")

    opt_m = optimizer(pair.managed.parameters())
    scaler_m = torch.amp.GradScaler(device_type(), init_scale=2.0**8) if scaler else None
    with plain_torch():
        opt_p = optimizer(pair.plain.parameters())
        scaler_p = torch.amp.GradScaler(device_type(), init_scale=2.0**8) if scaler else None
    for step in range(1, steps + 1):
        _train_step(pair, loss_m, loss_p, opt_m, opt_p, scaler_m, scaler_p, clip_foreach, f"step {step}")
        # The step's in-place writes must be what the next forward reads.
        loss_m, loss_p = _run(pair, managed_inputs, plain_inputs, autocast, f"forward after step {step}")


def _train_step(pair: Pair, loss_m, loss_p, opt_m, opt_p, scaler_m, scaler_p, clip_foreach, what: str) -> None:
    """One backward and optimizer step of both models, compared (``check_training``)."""
    (scaler_m.scale(loss_m) if scaler_m else loss_m).backward()
    with plain_torch():
        (scaler_p.scale(loss_p) if scaler_p else loss_p).backward()
    compare_grads(pair)
    pair.check_peak(f"backward, {what}")

    if scaler_m:
        scaler_m.unscale_(opt_m)
        with plain_torch():
            scaler_p.unscale_(opt_p)
        compare_grads(pair)
    if clip_foreach is not None:
        norm_m = torch.nn.utils.clip_grad_norm_(pair.managed.parameters(), 0.5, foreach=clip_foreach)
        with plain_torch():
            norm_p = torch.nn.utils.clip_grad_norm_(pair.plain.parameters(), 0.5, foreach=clip_foreach)
        pair.compare(norm_m, norm_p, "total gradient norm")
        compare_grads(pair)
    if scaler_m:
        scaler_m.step(opt_m)
        scaler_m.update()
        with plain_torch():
            scaler_p.step(opt_p)
            scaler_p.update()
        assert scaler_m.get_scale() == scaler_p.get_scale()
    else:
        opt_m.step()
        with plain_torch():
            opt_p.step()
    opt_m.zero_grad()
    with plain_torch():
        opt_p.zero_grad()
    compare_state(pair, f"after a {type(opt_m).__name__} step ({what})")
    pair.check_peak(f"optimizer {what}")


def check_generate(pair: Pair, generate: Optional[Callable] = None, calls: int = 3) -> None:
    """``generate()`` (the case's greedy one by default) gives the same tokens, at each of
    ``calls`` calls. (Three by default: under a budget that has not paged, a call with new
    settings runs as a loop of its own, the next is measured op by op, and the third is one
    region: Note [Regions until the budget pages].)

    The RNG is seeded alike before both calls, so sampling draws the same numbers.
    """
    generate = generate or pair.case.generate
    assert generate is not None
    managed_inputs, plain_inputs = inputs_pair(pair.case)
    pair.managed.eval()
    with plain_torch():
        pair.plain.eval()
    for call in range(1, calls + 1):
        torch.manual_seed(FORWARD_SEED)
        tokens_m = generate(pair.managed, managed_inputs)
        with plain_torch():
            torch.manual_seed(FORWARD_SEED)
            tokens_p = generate(pair.plain, plain_inputs)
        compare(tokens_m, tokens_p, f"generated tokens, call {call}")
        pair.check_peak(f"generate, call {call}")


def eval_logits(case: Case, model, inputs: Inputs):
    model.eval()
    with torch.no_grad():
        return case.forward(model, inputs)[0]


def check_save_pretrained(pair: Pair, folder) -> None:
    """``save_pretrained`` writes the same files as plain torch; ``from_pretrained`` gives a
    managed model with the same logits."""
    managed_dir, plain_dir = folder / "managed", folder / "plain"
    pair.managed.save_pretrained(managed_dir)
    with plain_torch():
        pair.plain.save_pretrained(plain_dir)
    weights = sorted(p.name for p in plain_dir.glob("*.safetensors"))
    assert weights and weights == sorted(p.name for p in managed_dir.glob("*.safetensors"))
    for name in weights:
        assert (managed_dir / name).read_bytes() == (plain_dir / name).read_bytes(), f"{name} differs"
    pair.check_peak("save_pretrained")

    reloaded = type(pair.managed).from_pretrained(managed_dir)
    for name, value in reloaded.state_dict().items():
        assert isinstance(value, TensorRef), f"reloaded {name} is a {type(value).__name__}, not a TensorRef"
    pair.check_peak("from_pretrained")
    compare_eval_logits(pair, reloaded, "logits of the reloaded model")
    pair.check_peak("reloaded forward")


def compare_eval_logits(pair: Pair, model, what: str) -> None:
    """``model``'s eval logits on the case's inputs equal the plain model's."""
    managed_inputs, plain_inputs = inputs_pair(pair.case)
    logits = eval_logits(pair.case, model, managed_inputs)
    with plain_torch():
        expected = eval_logits(pair.case, pair.plain, plain_inputs)
    pair.compare(logits, expected, what)


def check_state_dict_roundtrip(pair: Pair, folder) -> None:
    """``torch.save(model.state_dict())`` then ``load_state_dict(torch.load(...))`` into a
    fresh model: same state, same outputs; the file holds plain tensors."""
    path = folder / "model.pt"
    torch.save(pair.managed.state_dict(), path)
    with plain_torch():
        saved = torch.load(path, weights_only=True)
        expected = pair.plain.state_dict()
        assert list(saved) == list(expected)
        for name, value in saved.items():
            assert type(value) is torch.Tensor, f"saved {name} is a {type(value).__name__}"
            assert torch.equal(value, values(expected[name]).cpu()), f"saved {name} differs"

    torch.manual_seed(MODEL_SEED + 1)  # other weights, so that loading has to overwrite them
    fresh = pair.case.build()
    fresh.load_state_dict(torch.load(path, weights_only=True))
    reloaded = Pair(pair.case, fresh, pair.plain, pair.budget)
    compare_state(reloaded, "after load_state_dict")
    compare_eval_logits(pair, fresh, "outputs of the reloaded model")
    pair.check_peak("state dict round trip")



def check_pickled_module_roundtrip(pair: Pair, folder) -> None:
    """``torch.save(model)`` then ``torch.load(..., weights_only=False)``: a managed model
    (tied parameters still shared) with the same state and outputs."""
    path = folder / "model.pkl"
    torch.save(pair.managed, path)
    loaded = torch.load(path, weights_only=False)
    for name, value in loaded.state_dict(keep_vars=True).items():
        assert isinstance(value, TensorRef), f"loaded {name} is a {type(value).__name__}, not a TensorRef"
    assert len(list(loaded.parameters())) == len(list(pair.managed.parameters())), "tied parameters came apart"
    reloaded = Pair(pair.case, loaded, pair.plain, pair.budget)
    compare_state(reloaded, "after torch.load")
    compare_eval_logits(pair, loaded, "outputs of the loaded model")
    pair.check_peak("pickled module round trip")
