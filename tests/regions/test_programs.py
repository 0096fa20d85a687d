"""Property-based module programs under regions, managed against plain torch on the device.

Each example draws a module whose forward is a random list of steps (Linears, a norm, batch
norm, dropout, attention over the batch, an embedding, a weight used outside its module,
activations written in place, a checkpointed block, a parameter made in the call, a branch
on a value, reshapes, a detach, a Linear under ``no_grad``, tensors stored on ``self``,
parameters aliased and re-assigned, buffers written in place or replaced, parameters written
in place, an error midway) and a list of calls (with or without gradients, failing or not,
called twice in one graph or its backward run twice; with a submodule replaced, weights
tied, a hook or a pre-hook registered, an optimizer step, a layer frozen, the mode switched,
a state dict loaded, gradients accumulated or every block evicted between them), under
either strategy at a random budget or none, with the module a region (or, one time in four,
regions off: the per-op path alone), some with the strategy evicting the newest block it may,
the garbage collector at every few allocations (``paired.evict_newest``,
``paired.collecting``) or a host budget of a few KiB (host copies beyond it on disk). After
every call and after ``evict_all()``, the outputs, the gradients, the optimizer's state and
every tensor the modules hold (their values, whether each is a TensorRef, and which
parameter each attribute is) must be plain torch's, and an error must be the same error:
where a region cannot keep plain torch's semantics the call runs op by op, nothing is
silently different (Note [Stores on modules] in regions/stores.py).

``TORCHTENSORREF_PROGRAM_EXAMPLES`` sets how many programs (a fixed set: the same on every run);
``TORCHTENSORREF_PROPERTY_EXAMPLES=N`` draws N at random instead, as for ``tests/test_properties.py``
(a search; ``--hypothesis-seed`` replays one).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchTensorRef import TensorRef, regions, tensorsManager as tm
from paired import budget, collecting, evict_newest, plain_torch

WIDTH = 16
LAYERS = 3
_SEARCH = int(os.environ.get("TORCHTENSORREF_PROPERTY_EXAMPLES", "0"))
PROGRAMS = settings(
    max_examples=_SEARCH or int(os.environ.get("TORCHTENSORREF_PROGRAM_EXAMPLES", "30")),
    derandomize=not _SEARCH,
    print_blob=bool(_SEARCH),
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)



@pytest.fixture(scope="module", autouse=True)
def cheap_collections():
    """Each program collects reference cycles first: the objects alive before this module
    are set apart, so that each collection looks at this module's objects alone."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


layer = st.integers(0, LAYERS - 1)
STEP = st.one_of(
    st.tuples(st.just("linear"), layer),
    st.tuples(st.just("relu"), st.just(0)),
    st.tuples(st.just("store_new"), st.integers(0, 1)),
    st.tuples(st.just("store_detached_weight"), layer),
    st.tuples(st.just("store_tuple"), layer),
    st.tuples(st.just("store_list"), st.just(0)),
    st.tuples(st.just("alias_param"), layer),
    st.tuples(st.just("buffer_in_place"), st.just(0)),
    st.tuples(st.just("replace_buffer"), st.just(0)),
    st.tuples(st.just("param_in_place"), layer),
    st.tuples(st.just("raise"), st.just(0)),
    st.tuples(st.just("norm"), st.just(0)),
    st.tuples(st.just("batch_norm"), st.just(0)),
    st.tuples(st.just("dropout"), st.just(0)),
    st.tuples(st.just("attention"), st.just(0)),
    st.tuples(st.just("embedding"), st.just(0)),
    st.tuples(st.just("transposed"), layer),
    st.tuples(st.just("relu_in_place"), st.just(0)),
    st.tuples(st.just("checkpoint"), layer),
    st.tuples(st.just("new_parameter"), st.just(0)),
    st.tuples(st.just("branch_on_value"), st.just(0)),
    st.tuples(st.just("reshape"), st.just(0)),
    st.tuples(st.just("detach"), st.just(0)),
    st.tuples(st.just("linear_no_grad"), layer),
)
BETWEEN = [None, None, None, "replace", "hook", "evict", "tie", "step", "freeze", "mode", "load", "accumulate",
           "twice", "retain", "pre_hook"]
CALL = st.tuples(st.booleans(), st.booleans(), st.sampled_from(BETWEEN), layer)


class Program(torch.nn.Module):
    """A module whose forward runs ``steps`` (and raises at a ``raise`` step when ``fail``)."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.bn = torch.nn.BatchNorm1d(WIDTH)
        self.emb = torch.nn.Embedding(WIDTH, WIDTH)
        self.register_buffer("count", torch.zeros(WIDTH))
        self.fail = False

    def forward(self, x):
        for kind, i in self.steps:
            if kind == "linear":
                x = self.layers[i](x)
            elif kind == "relu":
                x = torch.relu(x)
            elif kind == "store_new":
                setattr(self, f"kept{i}", x * 2)
            elif kind == "store_detached_weight":
                self.weight_seen = self.layers[i].weight.detach()
            elif kind == "store_tuple":
                self.pair = (x + 1, self.layers[i].bias.detach())
            elif kind == "store_list":
                self.history = [x.sum(), x.mean()]
            elif kind == "alias_param":
                self.alias = self.layers[i].weight
            elif kind == "buffer_in_place":
                with torch.no_grad():
                    self.count.add_(x.detach().mean(0))
            elif kind == "replace_buffer":
                self.count = self.count * 0.5 + 1
            elif kind == "param_in_place":
                with torch.no_grad():
                    self.layers[i].weight.mul_(0.5)
            elif kind == "raise" and self.fail:
                raise ValueError("midway")
            elif kind == "norm":
                x = self.norm(x)
            elif kind == "batch_norm":
                x = self.bn(x)
            elif kind == "dropout":
                x = torch.nn.functional.dropout(x, 0.5, self.training)
            elif kind == "attention":
                x = (x @ x.transpose(0, 1)).softmax(-1) @ x
            elif kind == "embedding":
                x = x + self.emb(x.argmax(-1))
            elif kind == "transposed":
                x = x @ self.layers[i].weight.t()
            elif kind == "relu_in_place":
                x = torch.relu_(x * 1)
            elif kind == "checkpoint":
                x = torch.utils.checkpoint.checkpoint(self.block, x, i, use_reentrant=False)
            elif kind == "new_parameter":
                self.extra = torch.nn.Parameter(x.detach().mean(0))
                x = x + self.extra
            elif kind == "branch_on_value":
                x = x * 2 if x.sum().item() > 0 else x - 1
            elif kind == "reshape":
                x = x.reshape(2, -1).flip(0).reshape(-1, WIDTH)
            elif kind == "detach":
                x = x.detach()
            elif kind == "linear_no_grad":
                with torch.no_grad():
                    x = self.layers[i](x)
        return x

    def block(self, x, i):
        """What a ``checkpoint`` step recomputes in the backward: random bits included."""
        return torch.nn.functional.dropout(torch.relu(self.layers[i](x)), 0.5, self.training)


def snapshot(module) -> dict:
    """Every tensor the modules hold, by path: its values, whether it is a TensorRef, and the
    parameter it is (by identity), if any."""
    params = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    out = {}
    for prefix, m in module.named_modules():
        for name, value in sorted(vars(m).items()):
            if name in ("_parameters", "_buffers"):
                entries = sorted(value.items())
            else:
                entries = [(name, value)]
            for key, v in entries:
                container = type(v).__name__ if isinstance(v, (list, tuple)) else None
                for i, t in enumerate(v if container else [v]):
                    if isinstance(t, torch.Tensor):
                        out[f"{prefix}.{key}[{i}]"] = (t.detach().cpu().clone(), isinstance(t, TensorRef),
                                                       params.get(id(t)), container)
    return out


def run(steps, calls, managed: bool, setting) -> list:
    """What the program shows after each call: its output or error, gradients, snapshot."""
    torch.manual_seed(0)
    seen = []
    if managed:
        module, x = Program(steps), torch.randn(4, WIDTH)
        regions.region(module)
        strategy, nbytes, *more = setting
        victims, host = (more + [None, None])[:2]
        tm.strategy = strategy
        if victims == "newest":
            evict_newest(tm.strategy)
        if host is not None:  # (host copies beyond it go to disk)
            tm.offload_dir = tempfile.mkdtemp(prefix="programs-")
            tm.host_budget = sum(b.nbytes for b in tm.host_tier.hosted.values() if b.host_shared or b.external) + host
        # (where the device rounds every allocation up, CUDA's way, room for the sixteen of a
        # batch norm's backward at least)
        tm.budget = None if nbytes is None else budget(max(nbytes, 16 * tm.block_bytes(1)))
        return _calls(module, x, calls, seen, managed)
    with plain_torch():
        module, x = Program(steps).to(tm.torch_device), torch.randn(4, WIDTH).to(tm.torch_device)
        return _calls(module, x, calls, seen, managed)


def _calls(module, x, calls, seen, managed):
    hooked = []
    handles = []
    optimizer = None
    try:
        for n, (grad, fail, between, which) in enumerate(calls):
            refused = None  # (what a change between calls raised: plain torch's error, the same)
            try:
                if between == "replace":
                    torch.manual_seed(100 + n)
                    module.layers[which] = torch.nn.Linear(WIDTH, WIDTH).to(x.device)
                elif between == "hook":
                    handles.append(module.layers[which].register_forward_hook(
                        lambda _m, _i, out: hooked.append(out.detach().cpu().clone())))
                elif between == "evict" and managed:
                    tm.evict_all()
                elif between == "tie":
                    module.layers[which].weight = module.layers[(which + 1) % LAYERS].weight
                elif between == "step":
                    optimizer = optimizer or torch.optim.AdamW(module.parameters(), lr=0.1)
                    optimizer.step()
                elif between == "freeze":
                    module.layers[which].requires_grad_(False)
                elif between == "mode":
                    module.train(not module.training)
                elif between == "pre_hook":
                    handles.append(module.layers[which].register_forward_pre_hook(lambda _m, args: (args[0] * 2,)))
                elif between == "load":
                    module.load_state_dict({k: v + 1 for k, v in module.state_dict().items()})
            except (ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
                refused = type(e).__name__
            module.fail = fail
            if between != "accumulate":
                module.zero_grad(set_to_none=True)
            backward = False
            try:
                with torch.set_grad_enabled(grad):
                    out = module(x)
                    if between == "twice":  # (two calls in one graph)
                        out = out + module(x)
                    if grad and out.requires_grad:
                        backward = True
                        loss = out.square().mean()
                        loss.backward(retain_graph=between == "retain")
                        if between == "retain":  # (the same graph's backward again)
                            loss.backward()
                result = out.detach().cpu().clone()
            except (ValueError, RuntimeError, TypeError) as e:
                result = type(e).__name__
                if backward:
                    # Which gradients a backward that raised leaves is the order autograd ran
                    # its nodes in, and a region is one node (docs/compatibility.md): none
                    # are compared, nor carried into the next call.
                    module.zero_grad(set_to_none=True)
            grads = [(name, p.grad.cpu().clone()) for name, p in module.named_parameters() if p.grad is not None]
            if between == "twice":
                # A parameter read several times in each of two calls of a region in one graph:
                # its gradient is each call's sum, added in another order than plain torch's
                # (Note [Gradients summed inside a region]): equal but for rounding, and not
                # carried into the next call.
                grads = [(name, Rounded(g)) for name, g in grads]
                module.zero_grad(set_to_none=True)
            state = [t.cpu().clone() for group in (optimizer.state.values() if optimizer else ())
                     for t in group.values()]
            seen.append((result, grads, snapshot(module), list(hooked), state, refused))
            if managed:
                tm.evict_all()
            seen.append(snapshot(module))
    finally:
        for h in handles:
            h.remove()
    return seen


class Rounded:
    """A tensor compared up to rounding."""

    def __init__(self, t):
        self.t = t


def assert_same(plain, managed, where="") -> None:
    if isinstance(plain, Rounded):  # (each term rounded: relative to the largest)
        torch.testing.assert_close(managed.t, plain.t, rtol=1e-5, atol=1e-5 * float(plain.t.abs().max()), msg=where)
    elif isinstance(plain, torch.Tensor):
        assert isinstance(managed, torch.Tensor), where
        torch.testing.assert_close(managed, plain, rtol=0, atol=0, msg=where)
    elif isinstance(plain, dict):
        assert sorted(managed) == sorted(plain), where
        for k in plain:
            assert_same(plain[k], managed[k], f"{where}/{k}")
    elif isinstance(plain, (list, tuple)):
        assert len(managed) == len(plain), where
        for i, (p, m) in enumerate(zip(plain, managed)):
            assert_same(p, m, f"{where}[{i}]")
    else:
        assert managed == plain, f"{where}: {managed!r} != {plain!r}"


@PROGRAMS
@given(steps=st.lists(STEP, min_size=1, max_size=8), calls=st.lists(CALL, min_size=1, max_size=6),
       setting=st.tuples(st.sampled_from(["genoa", "flow"]), st.sampled_from([None, 3 * 1024, 8 * 1024, 64 * 1024]),
                         st.sampled_from(["strategy", "newest"]), st.sampled_from([None, None, 8 * 1024, 16 * 1024])),
       by_op=st.sampled_from([False, False, False, True]), collect_often=st.booleans())
def test_module_programs_under_regions_match_plain_torch(steps, calls, setting, by_op, collect_often):
    with collecting(collect_often):
        check(steps, calls, setting, by_op)


@pytest.mark.parametrize("setting", [("flow", None), ("genoa", None), ("flow", 8 * 1024)])
def test_a_weight_written_between_the_call_that_saved_it_and_backward_is_refused(setting):
    # Found by drawing programs at random: the Linear, a region of its own (its parent stores
    # a tensor on itself: op by op), is called twice, and its weight written under no_grad
    # before backward. Plain torch refuses the backward; with no budget the region's saved
    # leaf did not see the write, and the gradients came from the written weight (Note [Saved
    # leaves are watched] in regions/saved.py).
    steps = [("linear", 0), ("linear", 0), ("store_new", 0), ("param_in_place", 0)]
    calls = [(True, False, None, 0), (True, False, None, 0), (True, False, None, 0)]
    check(steps, calls, setting)


@pytest.mark.parametrize("setting", [("genoa", None), ("flow", None), ("flow", 8 * 1024)])
def test_a_weight_written_later_in_the_call_that_saved_it_is_refused(setting):
    # Found the same way: the program is the region and writes the weight at the end of its
    # forward. Under Genoa what a call saves is a view of a block, whose TensorRef's version
    # the write inside the call did not move: the backward ran on the written weight.
    steps = [("linear", 0), ("linear", 0), ("param_in_place", 0)]
    calls = [(True, False, None, 0), (True, False, None, 0), (True, False, None, 0)]
    check(steps, calls, setting)


@pytest.mark.parametrize("setting", [("genoa", None), ("flow", None)])
def test_a_parameter_stored_after_its_slot_was_tied_is_the_tied_parameter(setting):
    # Found the same way: ``self.alias = self.layers[0].weight`` registers a parameter, then
    # ``layers[0].weight`` is tied to ``layers[1].weight``. The alias slot held the old weight,
    # so the view the call stored was not given for it: it became a new Parameter on the tied
    # weight's bytes, which an optimizer would have updated twice.
    steps = [("alias_param", 0)]
    calls = [(False, False, None, 0), (False, False, None, 0), (False, False, "tie", 0)]
    check(steps, calls, setting)


@pytest.mark.parametrize("setting", [("genoa", None), ("flow", None), ("flow", 8 * 1024)])
def test_a_value_stored_on_the_module_gives_no_gradient_the_loss_does_not_need(setting):
    # Found the same way: the call stores ``[x.sum(), x.mean()]`` of a Linear's output, then
    # detaches it. The loss does not read the stored values, but autograd gave the region's
    # node zero gradients for them, and the Linear's parameters got zero gradients where
    # plain torch gives none (an AdamW step would have decayed them).
    steps = [("linear", 0), ("store_list", 0), ("detach", 0), ("norm", 0)]
    calls = [(False, False, None, 0), (True, False, None, 0), (True, False, None, 0)]
    check(steps, calls, setting)


@pytest.mark.parametrize("setting", [("genoa", None), ("flow", None)])
def test_a_weight_a_call_writes_is_refused_in_the_backward_of_an_earlier_call(setting):
    # Found the same way: two calls in one graph, each reading the weight, writing it under
    # no_grad, reading it again. Plain torch refuses the backward (the first call saved the
    # weight, written since); the region's write moved its view's version and not its
    # TensorRef's, and the first call's saved weight, the TensorRef, passed the check.
    steps = [("linear", 0), ("param_in_place", 0), ("linear", 0)]
    check(steps, [(True, False, "twice", 0)], setting)


@pytest.mark.parametrize("setting", [("genoa", None), ("flow", None), ("flow", 8 * 1024)])
def test_a_weight_a_call_writes_before_reading_it_passes_its_backward(setting):
    # Found the same way: a call writes the weight under no_grad, then reads it; plain torch
    # saves the written weight and its backward runs. The region's saved view of the weight
    # watched its TensorRef's version from before the call, which the call's write moved as
    # the call returned: the backward of the second call (the first one a region) was refused.
    steps = [("param_in_place", 0), ("norm", 0), ("linear", 0)]
    check(steps, [(True, False, None, 0), (True, False, None, 0), (True, False, None, 0)], setting)


def test_a_backward_retained_past_a_write_to_a_weight_it_does_not_need_runs_again():
    # Found the same way: the Linear, a region of its own, is called, its weight written
    # under no_grad, and the loss's backward run twice (retain_graph=True the first time).
    # Plain torch runs both (the weight's gradient does not read the weight). The region's
    # node had saved the weight to learn whether autograd freed its graph; the write failed
    # that check, which read as freed, and the second backward was refused.
    steps = [("linear", 0), ("param_in_place", 0), ("new_parameter", 0)]
    check(steps, [(False, False, None, 0), (True, False, None, 0), (True, False, "retain", 0)], ("genoa", None))


def check(steps, calls, setting, by_op=False):
    """The program run on plain torch and managed, the same after every call (``by_op``:
    with regions off, the per-op path alone)."""
    gc.collect()  # (the plain device tensors of earlier programs, held by cycles, go first)
    previous = regions.enabled, regions.min_ops, regions.under_budget
    regions.enabled, regions.min_ops, regions.under_budget = not by_op, 0, True
    try:
        plain = run(steps, calls, False, setting)
        managed = run(steps, calls, True, setting)
    finally:
        regions.enabled, regions.min_ops, regions.under_budget = previous
        folder = tm.offload_dir if tm.host_budget is not None else None
        tm.budget = tm.host_budget = None
        if folder is not None:
            tm.offload_dir = None
            shutil.rmtree(folder, ignore_errors=True)
    # plain torch's tensors on the device are not TensorRefs; every managed one must be
    for entry in plain:
        for state in ([entry] if isinstance(entry, dict) else [entry[2]]):
            for key, value in state.items():
                state[key] = (value[0], True) + value[2:]
    assert_same(plain, managed)
