"""What a region's forward stores on modules, and other semantics regions keep (Note [Stores
on modules] in regions/stores.py): every test runs the same module program on plain torch
on the same device and managed, with the module a region, and compares."""

from __future__ import annotations

import pickle
import weakref

import pytest
import torch

import torchTensorRef
from torchTensorRef import regions, tensorsManager as tm
from torchTensorRef.regions import stores
from paired import budget, plain_torch

#: (strategy, budget of the test's module in bytes or None)
SETTINGS = [("genoa", None), ("flow", None), ("flow", 24 * 1024), ("genoa", 24 * 1024)]
IDS = ["genoa-no-budget", "flow-no-budget", "flow-budget", "genoa-budget"]


@pytest.fixture(autouse=True)
def forced_regions():
    previous = regions.enabled, regions.min_ops, regions.under_budget
    regions.enabled, regions.min_ops, regions.under_budget = True, 0, True
    yield
    regions.enabled, regions.min_ops, regions.under_budget = previous


class Stack(torch.nn.Module):
    """Layers of a few Linears whose forward calls ``store(self, x)`` before its last one
    (a tensor it returns replaces ``x``)."""

    def __init__(self, store=None, width=8):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(3))
        self.store = store

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if self.store is not None:
            y = self.store(self, x)
            x = x if y is None else y
        return self.lin(x)


def both(store, program, setting, calls=3, grad=False, stays_region=True):
    """``program(module, x)`` after ``calls`` calls of a new ``Stack(store)``: once on plain
    torch, once managed with the module a region under ``setting`` (its blocks evicted
    before ``program``); returns both results. ``stays_region=False``: the forward changes
    its module's own state, after which its calls run op by op."""
    results = []
    for managed in (False, True):
        torch.manual_seed(0)
        if managed:
            strategy, nbytes = setting
            tm.strategy = strategy
            module, x = Stack(store), torch.randn(4, 8)
            regions.region(module)
            tm.budget = None if nbytes is None else budget(nbytes)
            ops = run_calls(module, x, calls, grad)
            if stays_region:
                assert grad or ops == 1, "the module's last call did not run as a region"
            else:
                assert regions._info[module].region.mutates and ops > 1, "the module's calls stayed a region"
            tm.evict_all()
            results.append(program(module, x))
        else:
            with plain_torch():
                module, x = Stack(store).to(tm.torch_device), torch.randn(4, 8).to(tm.torch_device)
                run_calls(module, x, calls, grad)
                results.append(program(module, x))
    return results


def run_calls(module, x, calls, grad):
    """The module called ``calls`` times; the ops its last call took."""
    ops = 0
    for _ in range(calls):
        before = tm.stats()["ops"]
        with torch.set_grad_enabled(grad):
            out = module(x)
        ops = tm.stats()["ops"] - before
        if grad:
            out.sum().backward()
    return ops


def values(t):
    return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_detached_alias_stored_in_forward_follows_the_weight(setting):
    # a view the forward stored on its module was the region's plain view of the weight's
    # device copy: after an eviction it no longer followed the weight (equal: False)
    def store(self, x):
        self.w_alias = self.lin.weight.detach()

    def program(module, x):
        with torch.no_grad():
            module.lin.weight.add_(1.0)
        return torch.equal(module.w_alias, module.lin.weight), values(module.w_alias)

    plain, managed = both(store, program, setting)
    assert plain[0] is True and managed[0] is True
    torch.testing.assert_close(managed[1], plain[1], rtol=0, atol=0)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_parameter_assigned_in_forward_is_registered_as_in_plain_torch(setting, grad):
    # the forward's ``self.w_alias = self.lin.weight`` got the region's plain view: from the
    # second call nn.Module refused it ("cannot assign 'torch.sim.FloatTensor' as parameter")
    def store(self, x):
        self.w_alias = self.lin.weight

    def program(module, x):
        names = [n for n, _ in module.named_parameters()]
        return names, module.w_alias is module.lin.weight, values(module(x)), values(module.lin.weight.grad)

    plain, managed = both(store, program, setting, grad=grad)
    assert managed[0] == plain[0] and managed[1] is plain[1] is True
    torch.testing.assert_close(managed[2], plain[2], rtol=0, atol=0)
    torch.testing.assert_close(managed[3], plain[3], rtol=0, atol=0)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_tensors_stored_in_forward_become_tensorrefs_with_plain_values(setting):
    # a new tensor, a tuple and a list of them, a replaced buffer: left as the region's plain
    # tensors, they held device memory outside the manager and were not TensorRefs
    def store(self, x):
        self.last = x * 2
        self.pair = (x + 1, self.lin.bias.detach())
        self.history = [x.sum()]
        self.register_buffer("seen", x.mean(0), persistent=False)
        self.seen = x.amax(0)

    def program(module, x):
        stored = [module.last, *module.pair, *module.history, module.seen]
        return [type(t).__name__ for t in stored], [values(t) for t in stored], isinstance(module.pair, tuple)

    plain, managed = both(store, program, setting, stays_region=False)  # (it changes its own buffer)
    assert set(managed[0]) == {"TensorRef"} and managed[2] is plain[2] is True
    for p, m in zip(plain[1], managed[1]):
        torch.testing.assert_close(m, p, rtol=0, atol=0)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_submodule_made_in_forward_is_managed(setting):
    # the Linear was made with the region's plain creation: its weights stayed plain tensors
    def store(self, x):
        if not hasattr(self, "extra"):
            self.extra = torch.nn.Linear(8, 8)
        return self.extra(x)

    def program(module, x):
        return (type(module.extra.weight).__name__, isinstance(module.extra.weight, torch.nn.Parameter),
                values(module(x)))

    plain, managed = both(store, program, setting, stays_region=False)  # (it gains a submodule)
    assert managed[0] == "TensorRef" and managed[1] is plain[1] is True
    torch.testing.assert_close(managed[2], plain[2], rtol=0, atol=0)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_an_in_place_write_before_an_error_inside_a_region_is_kept(setting):
    # an exception inside the call skipped the bookkeeping that marks what it wrote: the
    # device copy held the write, the host copy did not, and an eviction dropped the write
    fail = [False]

    def store(self, x):
        if fail[0]:
            with torch.no_grad():
                self.lin.weight.mul_(2.0)
            raise ValueError("midway")

    def program(module, x):
        fail[0] = True
        with pytest.raises(ValueError, match="midway"):
            with torch.no_grad():
                module(x)
        fail[0] = False
        tm.evict_all()
        return values(module.lin.weight)

    plain, managed = both(store, program, setting)
    torch.testing.assert_close(managed, plain, rtol=0, atol=0)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_submodule_replaced_between_calls_is_in_the_working_set_and_the_old_one_is_freed(setting):
    # the region's record of its module's tensors was read again only when their counts
    # changed: a layer replaced by one of the same shape kept the old layer's weights alive
    # and in the working set, and the new layer's ops ran op by op inside the region
    freed = []

    def program(module, x):
        torch.manual_seed(1)
        old = module.layers[1].weight
        weakref.finalize(old, freed.append, True)
        module.layers[1] = torch.nn.Linear(8, 8)
        del old
        with torch.no_grad():
            module(x)
            before = tm.stats()["ops"]
            out = module(x)
            ops = tm.stats()["ops"] - before
        return values(out), ops, bool(freed)

    plain, managed = both(None, program, setting)
    torch.testing.assert_close(managed[0], plain[0], rtol=0, atol=0)
    assert managed[1] == 1 and managed[2] is plain[2] is True


class Adapters(torch.nn.Module):
    """A layer and adapters in a ModuleDict, as a library injects them; its forward slices its
    layers into a new ModuleList, as Llama's does."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.adapters = torch.nn.ModuleDict()

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        for adapter in self.adapters.values():
            x = x + adapter(x)
        return x


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_an_adapter_added_to_a_module_dict_after_calls_is_in_the_working_set(setting):
    # only changes to modules a region has read make the regions read their modules again:
    # an adapter added to the ModuleDict of a module that ran as a region must be one of them
    def program(module):
        x = torch.ones(2, 8).to(module.layers[0].weight.device)
        outs = []
        with torch.no_grad():
            outs.append(values(module(x)))
            torch.manual_seed(1)
            module.adapters["a"] = torch.nn.Linear(8, 8)
            outs += [values(module(x)), values(module(x))]
            before = tm.stats()["ops"]
            module(x)
            ops = tm.stats()["ops"] - before
        return outs, ops

    plain, managed = compare(Adapters, program, setting)
    assert_same(plain[0], managed[0])
    assert managed[1] == 1  # (still one region: the new adapter's weights are in its working set)


def test_a_forward_that_slices_its_layers_does_not_make_regions_read_their_modules_again():
    # Llama's forward slices ``self.layers[:n]`` into a new ModuleList at every call: its
    # add_module calls made every region read all its modules again at its next call
    module = Adapters()
    regions.region(module)
    x = torch.ones(2, 8)
    with torch.no_grad():
        module(x)
        before = stores.structure[0]
        module(x)
        module(x)
    assert stores.structure[0] == before


def test_a_compiled_region_given_a_nested_tensor_says_why_it_cannot_run():
    # a strict region raised the internal NotARegion for a nested tensor argument
    region = torchTensorRef.compile_region(lambda t: t, backend="eager")
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(RuntimeError, match="nested tensor") as info:
        region(nested)
    assert type(info.value) is RuntimeError


# -- forwards that change their module's own state (peft's merges, samplers, parametrizations)

def compare(make, program, setting=("flow", None)):
    """``program(module)`` for a module ``make()`` builds: on plain torch on the device, and
    managed with the module a region under ``setting``; both results, as plain CPU values."""
    results = []
    for managed in (False, True):
        torch.manual_seed(0)
        if managed:
            tm.strategy, nbytes = setting
            module = regions.region(make())
            tm.budget = None if nbytes is None else budget(nbytes)
            results.append(program(module))
        else:
            with plain_torch():
                results.append(program(make().to(tm.torch_device)))
    return results


class Rebinds(torch.nn.Module):
    """Rebinds its weight's ``.data`` inside its forward, by a tensor it keeps in a dict."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.kept = {}

    def forward(self, x):
        if "scale" in self.kept:
            w = self.lin.weight
            w.data = w.data * self.kept.pop("scale")
        for _ in range(8):
            x = x + 0.0
        return self.lin(x)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
@pytest.mark.parametrize("scale", ["tensor", "number"])
def test_a_forward_that_rebinds_its_weight_s_data_matches_plain_torch(setting, scale):
    # peft's merges and unmerges do ``weight.data = ...`` inside forward: the region's view
    # took the new bytes while the TensorRef kept the old ones (the weight's pickled copy was
    # half the plain value, silently), and with a tensor the module held in a dict (outside
    # the working set) the view was given a TensorRef's empty storage ("data is not allocated")
    def program(module):
        x = torch.ones(2, 4).to(module.lin.weight.device)
        outs = []
        with torch.no_grad():
            outs += [values(module(x)), values(module(x))]
            module.kept["scale"] = torch.full((4, 1), 2.0).to(x.device) if scale == "tensor" else 2.0
            outs += [values(module(x)), values(module(x))]
        tm.evict_all()
        return outs, values(module.lin.weight), values(pickle.loads(pickle.dumps(module.lin.weight)))

    plain, managed = compare(Rebinds, program, setting)
    assert_same(plain, managed)


class KeepsAGraph(torch.nn.Module):
    """Assigns, in its forward, a result that needs gradients to one of its buffers, then uses it."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.arange(4.0))
        self.register_buffer("b", torch.ones(4))

    def forward(self, x):
        self.b = torch.exp(self.p * 0.1)
        for _ in range(8):
            x = x + 0.0
        return x * self.b


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_buffer_assigned_a_graph_in_forward_trains_as_in_plain_torch(setting):
    # (a sampler keeps its draw so): from the second step the region gave the old graph's
    # buffer to the call's graph as an input, and backward raised "Trying to backward through
    # the graph a second time"; a sampler's parameters got no gradients at all
    def program(module):
        x = torch.ones(2, 4).to(module.p.device)
        grads = []
        for _ in range(3):
            module.p.grad = None
            module(x).sum().backward()
            grads.append(values(module.p.grad))
        return grads

    plain, managed = compare(KeepsAGraph, program, setting)
    assert_same(plain, managed)


class Parametrized(torch.nn.Module):
    """Registers a parametrization on its layer's weight for the length of its forward."""

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(3, 4, bias=False)

    def forward(self, x):
        torch.nn.utils.parametrize.register_parametrization(self.base, "weight", self.Double())
        try:
            for _ in range(8):
                x = x + 0.0
            return self.base(x)
        finally:
            torch.nn.utils.parametrize.remove_parametrizations(self.base, "weight", leave_parametrized=False)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_parametrization_registered_in_forward_trains_as_in_plain_torch(setting):
    # the region gave the call a plain view the parametrization took as its original:
    # backward raised "element 0 of tensors does not require grad"
    def program(module):
        x = torch.ones(2, 3).to(module.base.weight.device)
        grads = []
        for _ in range(3):
            module.zero_grad()
            module(x).square().sum().backward()
            grads.append(values(module.base.weight.grad))
        return [n for n, _ in module.named_parameters()], grads

    plain, managed = compare(Parametrized, program, setting)
    assert_same(plain, managed)


class SeesItsParameters(torch.nn.Module):
    """Notes, in its forward, whether its weights are ``nn.Parameter``s (a frozen one and a
    trainable one), as libraries ask before moving them by their kind."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.trained = torch.nn.Linear(3, 3)
        self.seen = []

    def forward(self, x):
        self.seen.append([isinstance(p, torch.nn.Parameter) for p in (self.frozen.weight, self.trained.weight)])
        for _ in range(8):
            x = x + 0.0
        return self.trained(self.frozen(x))


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_region_s_call_sees_its_parameters_as_parameters(setting):
    # the call was given plain views: peft's ``target_parameters`` registers a
    # parametrization in forward and its removal put the frozen weight's view back as a
    # buffer (``isinstance(view, nn.Parameter)`` was False): the weight left
    # named_parameters(), silently
    def program(module):
        x = torch.ones(2, 3).to(module.frozen.weight.device)
        with torch.no_grad():
            module(x)
            before = tm.stats()["ops"]
            module(x)
            ops = tm.stats()["ops"] - before
        module(x).sum().backward()
        return module.seen, ops

    plain, managed = compare(SeesItsParameters, program, setting)
    assert managed[0] == plain[0] == [[True, True]] * 3
    assert managed[1] == 1  # (the calls ran as a region)


class ReadsItsWeightsAttributes(torch.nn.Module):
    """Scales by an attribute its weight carries, and counts its calls on the weight."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        w = self.lin.weight
        w.calls = w.calls + 1
        for _ in range(8):
            x = x + 0.0
        return self.lin(x) * getattr(w, "scale", 1.0)


@pytest.mark.parametrize("setting", SETTINGS, ids=IDS)
def test_a_region_s_call_reads_and_sets_its_tensors_attributes_as_plain_torch(setting):
    # the call's views carried none of the attributes set on the parameters: a forward
    # reading one with a default computed with the default, silently
    def program(module):
        # (set once the module is on its device: plain torch's ``.to("sim")`` swaps each
        # parameter with a new one, as it swaps a tensor subclass's, and their attributes)
        module.lin.weight.scale, module.lin.weight.calls = 3.0, 0
        x = torch.ones(2, 3).to(module.lin.weight.device)
        with torch.no_grad():
            outs = [values(module(x)) for _ in range(3)]
            before = tm.stats()["ops"]
            module(x)
            ops = tm.stats()["ops"] - before
        return outs, module.lin.weight.calls, module.lin.weight.scale, ops

    plain, managed = compare(ReadsItsWeightsAttributes, program, setting)
    assert_same(plain[:3], managed[:3])
    assert managed[1] == 4 and managed[3] == 1


def assert_same(plain, managed) -> None:
    if isinstance(plain, torch.Tensor):
        torch.testing.assert_close(managed, plain, rtol=0, atol=0)
    elif isinstance(plain, (list, tuple)):
        assert len(plain) == len(managed)
        for p, m in zip(plain, managed):
            assert_same(p, m)
    else:
        assert managed == plain
