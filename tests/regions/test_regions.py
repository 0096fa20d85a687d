"""Module regions (Note [Regions] in regions/mechanism.py, Note [Module regions] in
regions/__init__.py): a module call as one op, its forward on plain device tensors.

Every test compares with plain torch on the same device and checks that the calls did (or
did not) run as regions, by the manager's op count: a region is one op.
"""

from __future__ import annotations

import gc

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, regions, tensorsManager as tm
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.ops import split_handlers
from conftest import TEST_DEVICE
from paired import assert_identical, budget, device_type, plain_torch, to_plain

transformers = pytest.importorskip("transformers")

#: the package's default, read before any fixture sets it
DEFAULT_UNDER_BUDGET = regions.under_budget

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def regions_on():
    previous = regions.enabled, regions.min_ops, regions.under_budget
    regions.enabled, regions.under_budget = True, True
    yield
    regions.enabled, regions.min_ops, regions.under_budget = previous


@pytest.fixture
def small_regions():
    """Modules of a few ops are regions too (they are not, by default: ``regions.min_ops``)."""
    regions.min_ops = 0


def llama():
    """A tiny random Llama: plain under ``plain_torch()`` (then moved to the device), else managed."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def weight_bytes(model) -> int:
    """Device bytes of the model's tensors, each as the device's allocator gives it (CUDA's
    rounds every allocation up to 512 bytes), so that budgets in weights mean the same on a GPU."""
    return sum(tm.block_bytes(t.numel() * t.element_size()) for t in model.state_dict().values())


def decode(model, ids, cache="dynamic"):
    """Tokens of a greedy generate() and the logits of one forward, as plain CPU tensors."""
    with torch.no_grad():
        # (on CUDA a static cache compiles the forward: tests/integrations/test_compiler.py)
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                cache_implementation=cache, disable_compile=True)
        logits = model(ids).logits
    return tokens, logits


def page() -> None:
    """A device tensor larger than the budget's free room, dropped at once: room made by
    evicting, after which the size rule holds (Note [Regions until the budget pages])."""
    torch.zeros((tm.room() + 4096) // 4, device=tm.torch_device).add_(1.0)  # (made on the host: room when used)
    assert tm.paged


def ops_of(fn):
    """``fn()`` and the ops it ran, after a first call: a region's first call with given shapes
    under a limit (the device's capacity on "sim") runs op by op, measuring what it allocates."""
    fn()
    tm.reset_stats()
    out = fn()
    return out, tm.stats()["ops"]


@pytest.mark.parametrize("device,fraction", [("cpu", None), (TEST_DEVICE, None), (TEST_DEVICE, 0.5),
                                             (TEST_DEVICE, 0.25)],
                         ids=["cpu", "device-no-budget", "device-50%", "device-25%"])
def test_generate_matches_plain_torch_in_fewer_ops(device, fraction):
    tm.device = device
    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain = decode(llama().to(tm.torch_device), ids.to(tm.torch_device))
    tm.strategy = "flow"
    model = llama()
    limit = None if fraction is None else budget(int(fraction * weight_bytes(model)))
    tm.budget = limit
    managed, ops = ops_of(lambda: decode(model, torchTensorRef.manage(ids.cpu())))
    assert isinstance(managed[1], TensorRef) and managed[1].device.type == device_type()
    assert_identical(plain, managed)
    stats = tm.stats()
    if limit is not None:
        assert stats["evictions"] > 0 and stats["peak_device_bytes"] <= limit
    regions.enabled = False
    tm.reset_stats()
    again, per_op = ops_of(lambda: decode(model, torchTensorRef.manage(ids.cpu())))
    assert_identical(plain, again)
    # the module calls ran as regions, one op each (under a budget, the modules whose weights
    # fit half of it: at 25% only the norms and rotary embeddings of this tiny model)
    assert ops * {None: 3, 0.5: 1.5, 0.25: 1}[fraction] < per_op


@pytest.mark.parametrize("strategy", ["flow", "genoa"])
def test_generate_under_a_budget_that_fits_is_one_region_sized_by_its_settings(strategy):
    # Note [Regions until the budget pages]: the model is above half the budget, yet nothing
    # pages: a generate() call is one op, as with no budget, room kept for what its first
    # call with the same shapes and settings made; more new tokens, or hidden states
    # returned, make more: measured again, within the budget
    def run(model, ids, new=6, **settings):
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, **settings)
            return out.sequences, out.get("hidden_states") is not None and out.hidden_states[-1][-1]

    # (last: transformers keeps the hooks that capture hidden states, and a hooked model is
    # no region)
    # (a setting's first call runs as a loop whose model calls are regions, its second is
    # measured op by op: one op from the third)
    calls = ((6, {}), (6, {}), (6, {}), (12, {}), (12, {}), (6, {}), (12, dict(output_hidden_states=True)),
             (12, dict(output_hidden_states=True)))
    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain_model = llama().to(tm.torch_device)
        # (held on the host: on the device they would count in the budget, outside the manager)
        plain = [tuple(map(to_plain, run(plain_model, ids.to(tm.torch_device), new, **settings)))
                 for new, settings in calls]
        del plain_model
    tm.strategy = strategy
    model = llama()
    tm.budget = budget(weight_bytes(model) * 19 // 10)
    assert weight_bytes(model) > regions.fraction * (tm.budget - tm.outside_bytes())
    ids = torch.tensor([[1, 5, 9, 3, 7]], device=tm.torch_device)  # (the program's, on the device)
    tm.reset_stats()
    for i, ((new, settings), want) in enumerate(zip(calls, plain)):
        ops = tm.stats()["ops"]
        got = run(model, ids, new, **settings)
        if i in (2, 5):  # (the same shapes and settings as two calls before)
            assert tm.stats()["ops"] - ops == 1, i
        assert_identical(want, got)
        del got
    stats = tm.stats()
    assert stats["max_memory_allocated"] <= tm.budget and stats["worst_overshoot_bytes"] == 0, stats
    # (Genoa's meaning: the region's tensors out after its call; Flow keeps what fits)
    assert stats["evictions"] == 0 or strategy == "genoa"
    assert not tm.paged


def test_generate_as_one_region_is_measured_again_when_the_model_s_generation_config_grows():
    # a setting read from the model's generation config (not given to the call) changes what
    # the call makes: room kept for fewer tokens would let the device go past the budget
    def run(model, ids, new):
        model.generation_config.max_new_tokens = model.generation_config.min_new_tokens = new
        with torch.no_grad():
            return model.generate(ids, do_sample=False, pad_token_id=0)

    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain_model = llama().to(tm.torch_device)
        plain = [to_plain(run(plain_model, ids.to(tm.torch_device), new)) for new in (6, 24)]
        del plain_model
    tm.strategy = "flow"
    model = llama()
    tm.budget = budget(weight_bytes(model) * 3 // 2)
    ids = torch.tensor([[1, 5, 9, 3, 7]], device=tm.torch_device)
    for _ in range(3):  # (the third is one region)
        assert_identical(plain[0], run(model, ids, 6))
    # (the budget now what that call took: the larger call does not fit beside the weights)
    tm.budget = tm.outside_bytes() + tm.stats()["peak_device_bytes"]
    tm.reset_stats()
    for _ in range(2):  # (the second is measured: a region with the room kept for 6 would not be)
        assert_identical(plain[1], run(model, ids, 24))
    stats = tm.stats()
    assert stats["max_memory_allocated"] <= tm.budget and stats["worst_overshoot_bytes"] == 0, stats


@pytest.mark.parametrize("fraction", [None, 0.5], ids=["no-budget", "50%"])
def test_transformers_capture_hooks_left_by_a_call_for_hidden_states_keep_regions(fraction):
    # Note [Inert capture hooks]: the first call asking for hidden states installs hooks that
    # stay; counted as hooks, every later call ran op by op
    def run(model, ids):
        with torch.no_grad():
            first = model(ids, output_hidden_states=True).hidden_states
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            again = model(ids, output_hidden_states=True).hidden_states
        return first, tokens, again

    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain = to_plain(run(llama().to(tm.torch_device), ids.to(tm.torch_device)))
    tm.strategy = "flow"
    model = llama()
    tm.budget = None if fraction is None else budget(int(fraction * weight_bytes(model)))
    ids = torch.tensor([[1, 5, 9, 3, 7]], device=tm.torch_device)
    first, tokens, again = run(model, ids)
    assert_identical(plain, (first, tokens, again))
    assert all(isinstance(h, TensorRef) for h in first + again)
    assert any(m._forward_hooks for m in model.modules())  # (transformers' own, kept)
    with torch.no_grad():
        ops = tm.stats()["ops"]
        again = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        ops = tm.stats()["ops"] - ops
    assert_identical(plain[1], again)
    regions.enabled = False
    with torch.no_grad():
        per_op = tm.stats()["ops"]
        model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        per_op = tm.stats()["ops"] - per_op
    assert ops * 3 < per_op, (ops, per_op)


@pytest.mark.parametrize("strategy,fraction", [("flow", None), ("flow", 0.5), ("genoa", 0.5)])
def test_generate_under_inference_mode_matches_plain_torch(strategy, fraction):
    # the views given to a region of tensors made under inference_mode are inference tensors,
    # which have no version counter: reading one raised at the first call
    def run(model, ids):
        with torch.inference_mode():
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            return tokens, model(tokens).logits

    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain = run(llama().to(tm.torch_device), ids.to(tm.torch_device))
    tm.strategy = strategy
    model = llama()
    tm.budget = None if fraction is None else budget(int(fraction * weight_bytes(model)))
    managed, ops = ops_of(lambda: run(model, torchTensorRef.manage(ids.cpu())))
    assert_identical(plain, managed)
    regions.enabled = False
    _, per_op = ops_of(lambda: run(model, torchTensorRef.manage(ids.cpu())))
    assert ops < per_op  # (the module calls ran as regions)


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_region_s_write_to_an_inference_tensor_is_kept(strategy, small_regions):
    # an inference tensor has no version counter to show the write: it counts as written
    class AddInPlace(torch.nn.Module):
        def forward(self, x):
            return x.add_(1.0)

    tm.strategy = strategy
    tm.budget = budget(64 * 1024)
    module = AddInPlace()
    with torch.inference_mode():
        x = torch.zeros(4, 16) + 1.0  # an inference TensorRef
        for _ in range(4):  # (the first call measures op by op)
            ops_before = tm.stats()["ops"]
            module(x)
        assert tm.stats()["ops"] - ops_before == 1
        tm.evict_all()
    with plain_torch():
        expected = torch.full((4, 16), 5.0, device=tm.torch_device)
    assert_identical(expected, x)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_layer_s_working_set_holds_its_own_layer_s_cache_not_the_whole_cache(cache):
    # Each decoder layer is given the whole cache and reads its own layer's keys and values:
    # the working set of a layer's region must not grow with the number of layers.
    tm.strategy = "flow"
    working_sets = {}
    for layers in (2, 4):
        config = dict(CONFIG, num_hidden_layers=layers)
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        with plain_torch():
            torch.manual_seed(0)
            plain_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
            plain = decode(plain_model.to(tm.torch_device), ids.to(tm.torch_device), cache=cache)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
        layer_bytes = weight_bytes(model.model.layers[0])
        tm.budget = budget(2 * layer_bytes)  # a layer fits, the model does not
        seen = []
        handle = tm.add_callback(before=lambda op: seen.append(len(op.blocks))
                                 if op.name == "region LlamaDecoderLayer" else None)
        try:
            managed = decode(model, torchTensorRef.manage(ids.clone()), cache=cache)
        finally:
            handle.remove()
        assert_identical(plain, managed)
        working_sets[layers] = seen
        tm.budget = None
    # the decoding steps' layer calls ran as regions with both depths, each with as many
    # blocks (twice as many calls with twice the layers)
    steps = {layers: [n for n in seen if n == max(seen)] for layers, seen in working_sets.items()}
    assert max(working_sets[4]) == max(working_sets[2]), working_sets
    assert len(steps[4]) == 2 * len(steps[2]) > 0, working_sets


class _Holder:
    """A plain object holding tensors, as a cache does."""


class _Reader(torch.nn.Module):
    """Reads ``holder.a``, and ``holder.b`` too when ``holder.use_b``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, holder):
        out = self.lin(x) + holder.a
        return out * holder.b if holder.use_b else out


def test_a_held_tensor_the_measured_call_did_not_read_is_still_correct_when_read(small_regions):
    # The region keeps out of its working set what its measured call did not read; a later
    # call that reads it all the same gets the TensorRef, through the per-op path.
    def run(model, holder, x):
        outs = []
        with torch.no_grad():
            for use_b in (False, False, True, True):
                holder.use_b = use_b
                outs.append(model(x, holder))
        return outs

    def parts():
        torch.manual_seed(0)
        holder = _Holder()
        holder.a, holder.b = torch.randn(2, 4), torch.randn(2, 4)
        return torch.nn.Linear(4, 4), holder, torch.randn(2, 4)

    with plain_torch():
        lin, holder, x = parts()
        model = _Reader()
        model.lin = lin
        plain = run(model.to(tm.torch_device), holder, x)
    lin, holder, x = parts()
    model = regions.region(_Reader())
    model.lin = lin
    tm.strategy = "flow"
    tm.budget = budget(64 * 1024)
    tm.reset_stats()
    managed = run(model, holder, x)
    assert tm.stats()["ops"] < 4 * 3  # (the calls after the measured one are regions)
    for p, m in zip(plain, managed):
        assert_identical(p, m)


def test_a_static_cache_written_in_place_inside_regions_keeps_its_writes():
    # Genoa sends every block back after each op: the cache's in-place writes must reach the host
    ids = torch.tensor([[1, 5, 9, 3]])
    with plain_torch():
        plain = decode(llama().to(tm.torch_device), ids.to(tm.torch_device), cache="static")
    tm.strategy = "genoa"
    tm.budget = budget(24 * 1024)
    assert_identical(plain, decode(llama(), torchTensorRef.manage(ids.clone()), cache="static"))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()


def test_a_region_s_outputs_are_tensorrefs_and_it_is_one_op(small_regions):
    with plain_torch():
        plain_model = mlp().to(tm.torch_device)
        x = torch.randn(4, 16)
        with torch.no_grad():
            plain = plain_model(x)
    model = mlp()
    mx = torchTensorRef.manage(x.cpu())
    with torch.no_grad():
        out, ops = ops_of(lambda: model(mx))
    assert ops == 1
    assert isinstance(out, TensorRef) and out.device.type == device_type() and out.proxyInfo is not None
    assert all(isinstance(p, TensorRef) for p in model.parameters())  # given back after the call
    assert_identical(plain, out)
    assert_identical(plain, out.target)


class _Transposed(torch.nn.Module):
    """A projection of a transposed 3-d input (diffusers' attention blocks: ``(b, c, hw)`` to
    ``(b, hw, c)``), whose matmul folds into one product only where the weight needs gradients."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)  # (a width at which the CPU's two products differ)

    def forward(self, x):
        return self.proj(x.transpose(1, 2))


@pytest.mark.parametrize("fraction", [None, 2.0, 0.5])
def test_a_region_under_no_grad_runs_the_kernels_its_module_runs_in_plain_torch(small_regions, fraction):
    """A parameter needs gradients under ``no_grad`` too, and kernels choose by it: the views a
    region gives its call say so. (They did not: the calls run as a region, from the second,
    gave other last bits than plain torch and than the first call, run op by op.)"""
    torch.manual_seed(0)
    model = _Transposed()
    with plain_torch():
        plain_model = _Transposed().to(tm.torch_device)
        plain_model.load_state_dict({k: to_plain(v) for k, v in model.state_dict().items()})
        x = torch.randn(4, 4, 64)
        with torch.no_grad():
            plain = plain_model(x)
    mx = torchTensorRef.manage(x.cpu())
    if fraction is not None:
        tm.strategy = "flow"
        tm.budget = budget(int(fraction * weight_bytes(model)) + 8 * tm.block_bytes(4 * 64 * 4 * 4))
    with torch.no_grad():
        outs = [model(mx) for _ in range(3)]
        _out, ops = ops_of(lambda: model(mx))
    assert ops == 1  # (the calls after the first are the region's)
    assert all(p.requires_grad for p in model.parameters())
    for out in outs:
        assert_identical(plain, out)


def test_a_region_returning_a_view_of_its_input_shares_its_block(small_regions):
    class Half(torch.nn.Module):
        def forward(self, x):
            return x[:2], x * 2

    x = torchTensorRef.manage(torch.arange(8.0).reshape(4, 2))
    half = Half()
    with torch.no_grad():
        (view, doubled), ops = ops_of(lambda: half(x))
    assert ops == 1
    assert block_of(view) is block_of(x) and block_of(doubled) is not block_of(x)
    assert_identical(torch.arange(4.0).reshape(2, 2), view)


def test_a_working_set_larger_than_the_budget_runs_op_by_op():
    with plain_torch():
        x = torch.randn(4, 16)
        with torch.no_grad():
            plain = mlp().to(tm.torch_device)(x)
    model = regions.region(mlp())  # forced: still op by op where it cannot be one
    tm.strategy = "flow"
    tm.budget = budget(weight_bytes(model) * 19 // 20)
    with torch.no_grad():
        out, ops = ops_of(lambda: model(torchTensorRef.manage(x.cpu())))
    assert ops > 3  # op by op (the first Linear is above half the budget: not one either)
    assert_identical(plain, out)
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def test_the_size_rule_weighs_the_manager_s_share_not_what_the_device_holds_beside_it(small_regions):
    # The program's own device tensors, 8x the model, count in the budget (outside the
    # manager): they are no room for a region, so the model (above half of the manager's
    # share) must not become one, while with a share twice its bytes it does.
    with plain_torch():
        held = torch.zeros(8 * weight_bytes(mlp()) // 4)
        x = torch.randn(4, 16)
        with torch.no_grad():
            plain = mlp().to(tm.torch_device)(x)
    model = mlp()
    tm.strategy = "flow"
    for share, whole in ((weight_bytes(model) * 3 // 2, False), (weight_bytes(model) * 5 // 2, True)):
        tm.budget = budget(share)
        page()
        with torch.no_grad():
            out, ops = ops_of(lambda: model(torchTensorRef.manage(x.cpu())))
        assert (ops == 1) is whole, (share, ops)
        assert_identical(plain, out)
    del held


def test_until_the_budget_pages_a_module_above_the_size_rule_is_one_region(small_regions):
    # Note [Regions when all fits]: until room has had to be made by evicting, nothing pages:
    # the model is one op; once it has, the size rule holds (its Linears are the regions)
    # until the budget is set again
    with plain_torch():
        host_x = torch.randn(4, 16)
        with torch.no_grad():
            plain = mlp().to(tm.torch_device)(host_x.to(tm.torch_device))
    model = mlp()
    x = torch.tensor(host_x.tolist(), device=tm.torch_device)  # (the program's, on the device)
    tm.strategy = "flow"
    share = weight_bytes(model) * 3 // 2
    tm.budget = budget(share)
    assert weight_bytes(model) > regions.fraction * (tm.budget - tm.outside_bytes())
    with torch.no_grad():
        for pages, whole in ((False, True), (True, False), (False, True)):
            if pages:
                page()
            out, ops = ops_of(lambda: model(x))
            assert tm.paged is pages and (ops == 1) is whole, (pages, ops)
            assert_identical(plain, out)
            tm.budget = budget(share)  # (no pressure since)


def test_a_call_that_needs_gradients_is_one_op_and_trains(small_regions):
    # (training through regions: tests/regions/test_training.py)
    with plain_torch():
        plain_model = mlp().to(tm.torch_device)
        x = torch.randn(4, 16)
        plain_model(x).sum().backward()
        plain = [p.grad for p in plain_model.parameters()]
    model = mlp()
    out, ops = ops_of(lambda: model(torchTensorRef.manage(x.cpu())))
    assert ops == 1
    for p in model.parameters():
        p.grad = None  # (the measured first call's graph was dropped unused)
    out.sum().backward()
    assert_identical(plain, [p.grad for p in model.parameters()])


def test_no_region_runs_op_by_op_and_region_overrides_the_size_rule(small_regions):
    model = mlp()
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        regions.no_region(model)
        for layer in model:
            regions.no_region(layer)
        _, per_op = ops_of(lambda: model(x))
        assert per_op > 3
        for layer in model:
            regions.auto(layer)
        _, ops = ops_of(lambda: model(x))
        assert ops == 3  # the parent is not one: each layer is
        tm.strategy = "flow"
        gc.collect()  # (an earlier test's plain tensors, outside the manager, must not leave mid-test)
        # the whole model is above half the manager's share, each layer below it, by about
        # 1 KiB either way: what the device holds outside the manager may drift that little
        tm.budget = budget(int(weight_bytes(model) * 1.7))
        page()
        regions.auto(model)
        _, ops = ops_of(lambda: model(x))
        assert ops == 3
        regions.region(model)
        _, ops = ops_of(lambda: model(x))
        assert ops == 1
    with pytest.raises(TypeError, match="takes an nn.Module"):
        regions.region(lambda x: x)


def test_a_module_of_few_ops_is_not_a_region_unless_forced_or_under_a_budget():
    layer = torch.nn.Linear(16, 8)  # t and addmm: cheaper op by op than a region's boundary
    act = torch.nn.SiLU()  # one op and no tensors of its own: nothing for a region to page
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        _, ops = ops_of(lambda: layer(x))
        assert ops == 2
        # under a budget every op outside a region takes the generic path, dearer than a
        # region's boundary: a module with tensors of its own is a region whatever its ops
        tm.budget = budget(64 * 1024)
        expected, ops = ops_of(lambda: act(layer(x)))
        assert ops == 2  # the Linear as a region, the SiLU op by op
    # with gradients it is not: a region's backward has no op-by-op fallback
    _, ops = ops_of(lambda: layer(x))
    assert ops == 2
    with torch.no_grad():
        tm.budget = None
        regions.region(layer)
        _, ops = ops_of(lambda: layer(x))
        assert ops == 1
    with plain_torch():
        x, w, b = (to_plain(t).to(tm.torch_device) for t in (x, layer.weight, layer.bias))  # (on the device)
        plain = torch.nn.SiLU()(torch.nn.functional.linear(x, w, b))
    assert_identical(plain, expected)


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_batch_norm_in_training_mode_keeps_its_running_statistics_as_a_region(strategy):
    # batch norm's kernel updates the running statistics in place without moving their
    # version counters, by which a region finds what its call wrote: Genoa sent them back to
    # the host unwritten after every call, and only the last call's update was kept
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)).train()

    torch.manual_seed(1)
    x = torch.randn(8, 6)
    with plain_torch():
        plain = model().to(tm.torch_device)
        px = to_plain(x).to(tm.torch_device)
        with torch.no_grad():
            for _ in range(3):
                plain(px)
    tm.strategy = strategy
    managed = model()
    regions.region(managed)
    tm.budget = budget(64 * 1024)
    with torch.no_grad():
        for _ in range(4):  # (the first call measures op by op)
            ops_before = tm.stats()["ops"]
            managed(x)
    assert tm.stats()["ops"] - ops_before == 1
    with plain_torch():
        plain(px)
    for name, expected in plain.state_dict().items():
        assert_identical(expected, managed.state_dict()[name])


class _Counting(torch.nn.Module):
    """Adds its input to a buffer in a way that moves no version counter of the buffer's."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = torch.nn.Linear(32, 32)
        self.register_buffer("seen", torch.zeros(32))

    def forward(self, x):
        if self.how == "list op":
            torch._foreach_add_([self.seen], [x.sum(0)])
        else:
            self.seen.data.add_(x.sum(0))  # (the counter of the alias ``.data`` made moves)
        return self.lin(x)


@pytest.mark.parametrize("how", ["list op", "through .data"])
@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_buffer_written_with_no_counter_moving_keeps_its_writes_as_a_region(strategy, how):
    # (Note [Unversioned writes] in regions/mechanism.py, Note [Versions of list writes] in
    # core/op_specs.py: in eval mode, with nothing else marking its buffers written, the
    # region took the buffer as unchanged and eviction dropped the update)
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[_Counting(how) for _ in range(4)]).eval()

    x = torch.ones(2, 32)
    with plain_torch():
        plain = model().to(tm.torch_device)
        with torch.no_grad():
            for _ in range(5):
                plain(to_plain(x).to(tm.torch_device))
    tm.strategy = strategy
    managed = model()
    regions.no_region(managed)
    for layer in managed:
        regions.region(layer)
    tm.budget = budget(10 * 1024)  # (two of the four layers' 4.3 KiB: every pass evicts)
    with torch.no_grad():
        for _ in range(5):  # (the first call of each layer measures op by op)
            ops_before = tm.stats()["ops"]
            managed(x)
    assert tm.stats()["ops"] - ops_before == 4  # (one op per layer: the last calls were regions)
    assert tm.stats()["evictions"] > 0
    tm.evict_all()
    for name, expected in plain.state_dict().items():
        assert_identical(expected, managed.state_dict()[name])


def test_the_switch_turns_regions_off():
    model = mlp()
    x = torchTensorRef.manage(torch.randn(4, 16))
    regions.enabled = False
    with torch.no_grad():
        _, ops = ops_of(lambda: model(x))
    assert ops > 3


def test_a_module_with_hooks_runs_op_by_op_and_its_hooks_see_tensorrefs(small_regions):
    model = mlp()
    seen = []
    handle = model[2].register_forward_hook(lambda m, inp, out: seen.append(type(out)))
    x = torchTensorRef.manage(torch.randn(4, 16))
    try:
        with torch.no_grad():
            _, ops = ops_of(lambda: model(x))
    finally:
        handle.remove()
    assert seen == [TensorRef, TensorRef] and ops > 3


def test_a_module_that_ran_as_a_region_is_freed_when_dropped(small_regions):
    import gc
    import weakref

    model = mlp()
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        _, ops = ops_of(lambda m=model: m(x))
    assert ops == 1
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None  # (what regions keep of a module does not keep it alive)


def test_calls_run_op_by_op_while_the_manager_records(small_regions):
    model = mlp()
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        _, ops = ops_of(lambda: model(x))
        assert ops == 1
        with tm.recording():
            _, ops = ops_of(lambda: model(x))
    assert ops == 5  # t, addmm, gelu, t, addmm: the trace's consumers model aten ops


def test_a_recording_with_regions_keeps_them_one_op_and_the_offline_reference_makes_room_for_their_inside(
        small_regions):
    from torchTensorRef.analysis.offline import reference_moves

    model = regions.region(mlp())
    tm.strategy = "flow"
    share = weight_bytes(model) * 3
    tm.budget = budget(share)
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        model(x)  # (measured: op by op)
        with tm.recording(regions=True) as trace:
            out = model(x)
    assert [name for _i, name, *_ in trace.ops] == ["region Sequential"]
    (index,) = {a[0] for a in trace.accesses}
    weights = {block_of(p).id for p in model.parameters()}
    blocks = {a[1] for a in trace.accesses}
    assert weights | {block_of(x).id, block_of(out).id} <= blocks
    scratch = [a for a in trace.accesses if a[1] < 0]  # (the room kept for the inside, less the output)
    assert len(scratch) == 1 and scratch[0][2] > 0 and scratch[0][1] in trace.created
    ref = reference_moves(trace.accesses, share, trace.initial, trace.created, trace.block_bytes)
    # the reference must fit the working set, the output and the inside at once
    assert ref["peak_device_bytes"] >= sum(a[2] for a in trace.accesses)
    with pytest.raises(torchTensorRef.OutOfBudgetError):
        too_small = sum(a[2] for a in trace.accesses) - 1
        reference_moves(trace.accesses, too_small, trace.initial, trace.created, trace.block_bytes)


def test_under_a_budget_regions_are_on_by_default_and_under_budget_makes_them_opt_in(small_regions):
    model = mlp()
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        regions.under_budget = DEFAULT_UNDER_BUDGET
        tm.budget = budget(64 * 1024)
        _, budgeted = ops_of(lambda: model(x))
        regions.under_budget = False
        _, opted_out = ops_of(lambda: model(x))
        tm.budget = None
        _, free = ops_of(lambda: model(x))
        tm.budget = budget(64 * 1024)
        regions.region(model)
        _, forced = ops_of(lambda: model(x))
    assert (budgeted, free, forced) == (1, 1, 1) and opted_out > 3  # op by op only when opted out


def test_a_call_no_larger_than_a_measured_one_is_a_region_at_once_and_a_much_larger_one_is_measured(small_regions):
    with plain_torch():
        xs = [torch.randn(n, 16) for n in (8, 4, 16, 40, 36)]
        with torch.no_grad():
            plain_model = mlp().to(tm.torch_device)
            plain = [plain_model(x.to(tm.torch_device)) for x in xs]
    model = mlp()
    ops = []
    outs = []
    with torch.no_grad():
        for x in xs:
            tm.reset_stats()
            outs.append(model(torchTensorRef.manage(x.cpu())))
            ops.append(tm.stats()["ops"])
    # 8 rows: measured op by op; 4 rows: bounded by the 8 rows' measurement, one op; 16 rows:
    # within GROWTH of 8, one op measuring itself (Note [Calls larger than measured]); 40 rows:
    # beyond it, measured op by op; 36 rows: bounded by 40's
    assert ops[0] > 1 and ops[1] == 1 and ops[2] == 1 and ops[3] > 1 and ops[4] == 1, ops
    assert tm.stats()["worst_overshoot_bytes"] == 0
    assert_identical(plain, outs)


def test_inside_data_parallel_the_module_runs_op_by_op(small_regions):
    # (its forward waits on threads that call modules; DistributedDataParallel alike:
    # tests/integrations/test_distributed.py)
    model = mlp()
    wrapper = torch.nn.DataParallel(model)
    x = torchTensorRef.manage(torch.randn(4, 16))
    with torch.no_grad():
        model(x)
        _, alone = ops_of(lambda: model(x))
        _, wrapped = ops_of(lambda: wrapper(x))
    # t, addmm, gelu, t, addmm; on CUDA first its scatter's split of the input (one device)
    assert alone == 1 and wrapped == 5 + bool(wrapper.device_ids)


def test_decoding_under_a_budget_reads_the_embedding_rows_not_the_table():
    # Note [Rows of a table]: an embedding is not a region under a budget with gradients
    # off; its op reads the rows it needs from the table's host copy. The table (a vocabulary
    # of 32768: 4 MiB, as much as the output layer) is never brought in whole.
    config = dict(CONFIG, vocab_size=32768, tie_word_embeddings=False)
    torch.manual_seed(0)
    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain = decode(transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval().to(tm.torch_device),
                       ids.to(tm.torch_device))
    tm.strategy = "flow"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    table = model.model.embed_tokens.weight
    tm.budget = budget(weight_bytes(model) // 2)
    tm.reset_stats()
    assert_identical(plain, decode(model, torchTensorRef.manage(ids.cpu())))
    assert block_of(table).fetches == 0 and not block_of(table).resident
    assert tm.stats()["peak_device_bytes"] <= tm.budget


def test_decoding_a_mixture_of_experts_under_a_budget_reads_the_experts_it_routes_to():
    # Note [Regions that read rows]: a decoding token gathers its two experts' weights from a
    # parameter stacking sixteen (4 MiB, transformers' batched_mm). As regions (eight layers,
    # each an eighth of the weights, at half of them) the layers brought every expert in for
    # nearly every token, 4 to 7 times a stack a call; the layers whose measured call read rows
    # run op by op, and their gathers read the two experts alone. (The prompt's forward,
    # grouped_mm, reads each stack whole.)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    with plain_torch():
        ids = torch.tensor([[1, 5, 9, 3, 7]])
        plain = decode(transformers.MixtralForCausalLM(config).eval().to(tm.torch_device), ids.to(tm.torch_device))
    tm.strategy = "flow"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    stacks = [block_of(layer.mlp.experts.gate_up_proj) for layer in model.model.layers]
    assert all(b.nbytes >= split_handlers.ROWS_MIN_TABLE for b in stacks)
    tm.budget = budget(weight_bytes(model) // 2)
    for _ in range(2):  # (regions measure their calls, and learn which read rows)
        assert_identical(plain, decode(model, torchTensorRef.manage(ids.cpu())))
    before = [b.fetches for b in stacks]
    tm.reset_stats()
    assert_identical(plain, decode(model, torchTensorRef.manage(ids.cpu())))
    # each stack whole for the two prompt forwards (generate's and decode's logits), not for the 5 tokens
    whole = [b.fetches - n for b, n in zip(stacks, before)]
    assert all(n <= 2 for n in whole), whole
    assert tm.stats()["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_call_given_a_plain_cpu_batch_runs_op_by_op_and_brings_the_batch_in(strategy):
    # A DataLoader's worker gives plain CPU batches. A region gave its kernels the batch as it
    # was, beside its views of the weights on the device: CUDA's "Expected all tensors to be on
    # the same device" on an H200 (op by op, the manager brings such a batch to the device).
    def run(batch):
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 4)
        regions.region(layer)
        with torch.no_grad():
            return [layer(batch) for _ in range(3)]

    with torchTensorRef.disabled():
        batch = torch.randn(5, 3)
    with plain_torch():
        expected = run(batch.to(tm.torch_device))
    tm.strategy = strategy
    tm.budget = budget(64 * 1024)
    got = run(batch)
    assert_identical(expected, got)
    assert all(type(t) is TensorRef and t.device.type == device_type() for t in got)


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_a_call_given_a_nested_tensor_runs_op_by_op(strategy):
    # In eval with a padding mask, TransformerEncoder packs the batch into a nested tensor and
    # calls its layers with it; a layer as a region read the nested tensor's shape for its
    # key and raised "NestedTensorImpl doesn't support sizes" (seen on CUDA too).
    def encoder():
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        return torch.nn.TransformerEncoder(layer, num_layers=3).eval()

    def run(model, x, mask):
        with torch.no_grad():
            return [model(x, src_key_padding_mask=mask) for _ in range(3)]

    torch.manual_seed(1)
    x = torch.randn(4, 10, 32)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, 7:] = True
    mask[2, 5:] = True
    with plain_torch():
        expected = run(encoder().to(tm.torch_device), x.to(tm.torch_device), mask.to(tm.torch_device))
    tm.strategy = strategy
    model = encoder()
    tm.budget = budget(weight_bytes(model))  # (the layers are regions, the encoder is not)
    got = run(model, torchTensorRef.manage(x.clone()), torchTensorRef.manage(mask.clone()))
    assert_identical(expected, got)


def test_the_size_rule_reads_a_module_s_bytes_again_once_its_tensors_change():
    # (kept from call to call: the size rule asks at every call of every module; a tensor
    # given other bytes, ``p.data = t``, or resized in place must be seen)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(8, 32))
    module.register_buffer("b", torch.zeros(16))
    info = regions._module_info(module)
    assert regions._tensor_bytes(info) == tm.block_bytes(8 * 32 * 4) + tm.block_bytes(16 * 4)
    module.w.data = torch.randn(160, 32)
    assert regions._tensor_bytes(info) == tm.block_bytes(160 * 32 * 4) + tm.block_bytes(16 * 4)
    module.b.resize_(1024)
    assert regions._tensor_bytes(info) == tm.block_bytes(160 * 32 * 4) + tm.block_bytes(1024 * 4)
    module.register_buffer("c", torch.zeros(8))
    info = regions._module_info(module)
    assert regions._tensor_bytes(info) == tm.block_bytes(160 * 32 * 4) + tm.block_bytes(1024 * 4) + tm.block_bytes(32)


def test_the_search_of_an_object_finds_its_tensors_as_it_did_with_classes_seen_before(monkeypatch):
    # (what a value is to the search is kept for its class: a second search, and one after the
    # kept classes were dropped, find the same tensors, and pass over callables and modules)
    from torchTensorRef.regions import scan

    class Layer:
        def __init__(self, k):
            self.keys, self.values, self.ready, self.dtype = k, k + 1, True, torch.float32

    class Hook:
        def __init__(self):
            self.t = torch.ones(1)

        def __call__(self):
            return None

    with torchTensorRef.disabled():
        a, b = torch.zeros(2), torch.ones(3)
    cache = type("Cache", (), {})()
    cache.layers = [Layer(a), Layer(b)]
    cache.extra = {"mask": a, "hook": Hook(), "module": torch.nn.Linear(1, 1), "n": 3}

    def found():
        return [(k, v) for _c, k, v in scan.object_tensors(cache, set(), scan.OBJECT_DEPTH, [scan.OBJECT_VALUES])]

    first = found()
    assert [k for k, _v in first] == ["keys", "values", "keys", "values", "mask"]
    second = found()
    assert [(k, id(v)) for k, v in second] == [(k, id(v)) for k, v in first]
    monkeypatch.setattr(scan, "_MOST_KINDS", len(scan._kinds))  # (the next new class drops them)
    cache.extra["more"] = type("Other", (), {})()
    cache.extra["more"].t = b
    assert [k for k, _v in found()] == ["keys", "values", "keys", "values", "mask", "t"]


def test_the_search_of_an_object_stops_where_its_budget_of_values_ends():
    # (a structure larger than what is left of the budget is searched a value at a time: the
    # tensors among the values looked at are found, in order, and the search says it stopped)
    from torchTensorRef.regions import scan

    with torchTensorRef.disabled():
        tensors = [torch.full((1,), float(i)) for i in range(5)]
    holder = type("Holder", (), {})()
    holder.first, holder.rest = tensors[0], list(tensors[1:])
    for most, expected, complete in ((2, [0], False), (4, [0, 1, 2], False), (6, [0, 1, 2, 3, 4], True)):
        out: list = []
        assert scan._object_tensors(holder, set(), scan.OBJECT_DEPTH, [most], out) is complete
        assert [v.item() for _c, _k, v in out] == expected
        assert all(c[k] is v for c, k, v in out if isinstance(c, list))
