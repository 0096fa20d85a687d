"""The strict "sim" accelerator behaves as plain torch does on a CUDA-like device.

Each test compares TensorRefs on ``"sim"`` with plain torch: plain ``SimTensor``s of the
same device (``paired.run_both``), or plain CPU tensors where the CPU is the reference (the
simulated device computes with the CPU's kernels).
"""

from __future__ import annotations

import copy
import ctypes
import io
import pickle
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager
from torchTensorRef.memory.sim import device as sim_device
from torchTensorRef.memory.sim.tensor import SimTensor
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, device_type, paging, plain_torch, run_both, sim_only  # noqa: F401  (paging is a fixture)

pytestmark = sim_only

# (None where "sim" is not registered, as in a CUDA process: a device name torch does not
# know fails at collection, and every test here skips there)
SIM = sim_device.registered()
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def strict_sim():
    if sim_device.registered() is None:
        pytest.skip(f"no strict sim device: {sim_device.unavailable_reason()}")


def _host_only(t) -> bool:
    return isinstance(t, TensorRef) and block_of(t).host_only and not t.proxyInfo.on_device


# -- CPU tensors stay CPU tensors ---------------------------------------------------------------
# Defect: under "sim", .cpu(), .to("cpu") and device="cpu" gave tensors that reported (and
# were paged to) the accelerator.


def test_sim_tensors_report_sim_and_cpu_ones_report_cpu():
    def devices():
        x = torch.rand(3, 4)
        made = (x.cpu(), x.to("cpu"), torch.ones(3, 4, device="cpu"), torch.zeros_like(x, device="cpu"))
        return [x, *made], [x.device, x.is_cpu] + [(t.device, t.is_cpu) for t in made]

    (plain, plain_where), (managed, managed_where) = run_both(devices)
    assert managed_where == plain_where
    assert managed_where[0] == SIM and managed_where[1] is False
    assert all(where == (CPU, True) for where in managed_where[2:])
    assert_identical(plain, managed)
    assert all(_host_only(t) for t in managed[1:])
    assert all(t.proxyInfo.device == "cpu" for t in managed[1:])


def test_cpu_tensors_never_move_to_the_device_even_after_ops():
    x = torch.rand(4, 4)
    c = x.cpu()
    d = torch.arange(16.0, device="cpu").reshape(4, 4)
    tensorsManager.reset_stats()
    results = [c @ d, (c * 2 + d).sum(0), torch.cat([c, d]), c.relu_(), d.t().contiguous()]
    c.toGPU()  # a CPU tensor's bytes never move
    stats = tensorsManager.stats()
    assert stats["ops"] >= len(results)
    assert stats["bytes_to_device"] == 0 and stats["device_bytes"] == 0
    assert all(t.device == CPU and _host_only(t) for t in [c, d, *results])
    with torchTensorRef.disabled():  # the values: plain CPU torch on the same inputs
        pc, pd = x.target.clone(), torch.arange(16.0).reshape(4, 4)
        expected = [pc @ pd, (pc * 2 + pd).sum(0), torch.cat([pc, pd]), pc.relu_(), pd.t().contiguous()]
    for got, want in zip(results, expected):
        assert torch.equal(got.target, want)


@pytest.mark.parametrize("op", [
    lambda x, c: x + c,
    lambda x, c: c * x,
    lambda x, c: x @ c,
    lambda x, c: torch.cat([x, c]),
    lambda x, c: x.add_(c),
    lambda x, c: c.add_(x),
    lambda x, c: torch.where(x > 0.5, x, c),
], ids=["add", "mul", "matmul", "cat", "add_ sim", "add_ cpu", "where"])
def test_mixing_a_cpu_tensor_with_a_sim_tensor_is_refused_as_on_cuda(op):
    # (a tensor put on "sim" by the program; one made without a device meets CPU tensors on the
    # host, as in plain torch: Note [Default-device tensors], tests/ops/test_device_checks.py)
    x = torch.rand(3, 3, device="sim")
    c = torch.rand(3, 3, device="cpu")
    before = c.target.clone()
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        op(x, c)
    assert torch.equal(c.target, before) and _host_only(c)


@pytest.mark.parametrize("op", [
    lambda x, c: x + c,
    lambda x, c: x @ c,
    lambda x, c: torch.cat([x, c]),
    lambda x, c: c.add_(x),
    lambda x, c: torch.nn.functional.linear(c, x),
], ids=["add", "matmul", "cat", "add_ cpu", "linear"])
def test_the_device_s_own_kernels_refuse_a_plain_cpu_tensor_as_cuda_s_do(op):
    # Plain tensors of "sim" (a region's views of its blocks are such) took a plain CPU tensor
    # beside them and computed on the CPU, where CUDA raises: a region given a plain CPU batch
    # failed on a GPU only
    with torchTensorRef.disabled():
        x = torch.rand(3, 3, device=SIM)
        c = torch.rand(3, 3)
        before = c.clone()
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            op(x, c)
        assert torch.equal(c, before)
        # a 0-dim CPU tensor is a scalar; copies and indexing take host tensors, as on CUDA
        assert torch.equal((x * torch.tensor(2.0)).cpu(), x.cpu() * 2)
        assert torch.equal(x[torch.tensor([0, 2])].cpu(), x.cpu()[[0, 2]])
        x.copy_(c)
        assert torch.equal(x.cpu(), c)


def test_factories_with_per_backend_kernels_only_are_made_on_sim(paging):
    # Fixed: no kernel of the device ran them ("Could not run 'aten::tril_indices' with
    # arguments from the 'sim' backend"; kaiser_window failed an internal assert).
    def make():
        out = [torch.tril_indices(4, 4), torch.triu_indices(3, 5, 1), torch.kaiser_window(8),
               torch.kaiser_window(7, periodic=False), torch.kaiser_window(6, True, 5.0, dtype=torch.float64)]
        return out, [t.device for t in out]

    plain, managed = run_both(make)
    assert_identical(plain, managed)
    assert managed[1] == [SIM] * 5
    with torchTensorRef.disabled():  # the values: the CPU's kernels
        assert torch.equal(managed[0][0].cpu().target, torch.tril_indices(4, 4))
        assert torch.equal(managed[0][2].cpu().target, torch.kaiser_window(8))


def test_a_0dim_cpu_tensor_is_a_scalar_beside_sim_tensors():
    def with_scalar():
        x = torch.rand(3, 3)
        s = torch.tensor(2.5, device="cpu")
        out = [x * s, s + x, torch.where(x > 0.5, x, s), x.clone().sub_(s), torch.maximum(x, s)]
        return out, [t.device for t in out]

    plain, managed = run_both(with_scalar)
    assert_identical(plain, managed)
    assert managed[1] == [SIM] * 5


def test_copies_and_indexing_take_cpu_tensors_as_on_cuda():
    def mixed():
        x = torch.rand(4, 3)
        c = torch.rand(4, 3, device="cpu")
        rows = x[torch.tensor([0, 2], device="cpu")]
        x.copy_(c)
        c.copy_(x * 2)
        return [rows, x, c], [rows.device, x.device, c.device]

    plain, managed = run_both(mixed)
    assert_identical(plain, managed)
    assert managed[1] == [SIM, SIM, CPU] and _host_only(managed[0][2])


# -- DataLoader --------------------------------------------------------------------------------
# Defect: the sampler's permutation and the loader's base seed, drawn from a CPU generator,
# were made as accelerator tensors (CUDA refuses a CPU generator for those; on "sim" they
# show as device memory that plain torch never uses).


@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global rng"])
def test_dataloader_shuffles_as_plain_torch_over_epochs(seeded):
    def batches():
        data = TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))
        generator = torch.Generator().manual_seed(7) if seeded else None
        loader = DataLoader(data, batch_size=3, shuffle=True, generator=generator)
        return [[batch for batch in loader] for _epoch in range(3)]

    plain, managed = run_both(batches)
    assert_identical(plain, managed)
    orders = [torch.cat([labels.target for _, labels in epoch]).tolist() for epoch in managed]
    assert orders[0] != list(range(10)) and orders[0] != orders[1]  # it did shuffle, per epoch


def test_dataloader_over_cpu_data_touches_no_device_memory():
    def batches():
        data = TensorDataset(torch.arange(20.0, device="cpu").reshape(10, 2), torch.arange(10, device="cpu"))
        loader = DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(7))
        tensorsManager.reset_stats()
        out = [[batch for batch in loader] for _epoch in range(2)]
        stats = tensorsManager.stats()
        return out, [b[0].device for epoch in out for b in epoch], stats["peak_device_bytes"], stats["bytes_to_device"]

    plain, managed = run_both(batches)
    assert_identical(plain, managed)  # CPU batches, and no device memory (as plain torch: none)
    assert set(managed[1]) == {CPU}


def _pinned_batches():
    data = TensorDataset(torch.arange(12.0, device="cpu").reshape(6, 2), torch.arange(6, device="cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = [(x, y, x.is_pinned(), x.device, (x.to("sim") * 2).device)
               for x, y in DataLoader(data, batch_size=4, pin_memory=True)]
    return out, sorted({str(w.message) for w in caught})


def test_dataloader_pin_memory_behaves_as_on_a_cpu_only_machine():
    # Defect: pin_memory=True asked the sim backend to pin batches, unlike a machine with no GPU.
    plain, managed = run_both(_pinned_batches)
    assert_identical(plain, managed)
    with torchTensorRef.disabled():  # plain torch with no accelerator at all
        cpu_only = _pinned_batches()
    assert [b[2:4] for b in managed[0]] == [b[2:4] for b in cpu_only[0]]
    if not torch.cuda.is_available():
        assert [b[2:4] for b in managed[0]] == [(False, CPU)] * 2  # nothing pinned, as without a GPU
    assert managed[1] == cpu_only[1]  # the same warnings as plain torch without a GPU
    assert all(b[4] == SIM for b in managed[0])


# -- RNG state from a checkpoint ---------------------------------------------------------------
# Defect: torch.load gives TensorRefs, which the generator refused as RNG state.


@pytest.mark.parametrize("restore", [lambda s: torch.set_rng_state(s), lambda s: torch.random.set_rng_state(s)],
                         ids=["torch.set_rng_state", "torch.random.set_rng_state"])
def test_rng_state_restored_from_a_checkpoint_draws_the_same_numbers(restore):
    def draws():
        torch.rand(3)
        buffer = io.BytesIO()
        torch.save({"cpu": torch.get_rng_state()}, buffer)
        first = torch.rand(5)
        torch.randn(7)  # move on
        buffer.seek(0)
        loaded = torch.load(buffer)
        restore(loaded["cpu"])
        return first, torch.rand(5), type(loaded["cpu"]).__name__

    plain, managed = run_both(draws)
    assert managed[2] == "TensorRef"  # (so the restore had a TensorRef to take)
    assert_identical(plain[:2], managed[:2])
    assert torch.equal(managed[0].target, managed[1].target)


# -- optimizers --------------------------------------------------------------------------------
# Defect: Adam's step counters were made as sim tensors where plain torch keeps them on the
# CPU (capturable=False), and the optimizer chose another implementation than for plain tensors.


def _fit(model, optimizer, x, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("foreach", [None, False], ids=["default", "for-loop"])
def test_adam_steps_are_where_plain_torch_puts_them_and_parameters_match(paging, foreach):
    # The step counters are CPU tensors, as plain torch on a GPU keeps them: torch 2.13's Adam
    # names the CPU for them, torch 2.11's names no device (torch.tensor(0.0)), which the
    # manager and disabled(device="sim") took for the accelerator on 2.11.
    def train():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, foreach=foreach)
        _fit(model, optimizer, torch.randn(5, 4), 3)
        states = list(optimizer.state.values())
        return ([p.detach() for p in model.parameters()], [s["exp_avg_sq"] for s in states],
                [(s["step"].device.type, s["step"].item()) for s in states],
                [p.device.type for p in model.parameters()])

    plain, managed = run_both(train)
    assert plain[3] == managed[3] == [device_type()] * 4  # (the plain run is on the managed device)
    assert plain[2] == [("cpu", 3.0)] * 4
    assert_identical(plain, managed)  # the step counters' device types included


def _nadam(foreach):
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.NAdam(model.parameters(), lr=0.01, foreach=foreach)
    _fit(model, optimizer, torch.randn(5, 8), 5)
    return [p.detach() for p in model.parameters()]


def test_optimizer_default_is_the_list_implementation_as_for_accelerator_tensors():
    # NAdam's list and for-loop implementations differ in the last bits: by default plain
    # torch picks the list one for (exact) tensors on an accelerator, so TensorRefs and
    # plain tensors of "sim" must too.
    with plain_torch():
        torch.manual_seed(0)
        plain = _nadam(foreach=None)
        torch.manual_seed(0)
        assert_identical(plain, _nadam(foreach=True))
    torch.manual_seed(0)
    assert_identical(plain, _nadam(foreach=None))


# -- bytes reached without an op -------------------------------------------------------------
# Defect: data_ptr() of a sim TensorRef gave the address of its host copy, not of the device
# copy that ops read and write.


def test_data_ptr_of_a_sim_tensor_is_its_device_copy():
    x = torch.arange(16.0).reshape(4, 4)
    x.toCPU()  # data_ptr() must bring it in
    address = x[1].data_ptr()
    block = block_of(x)
    assert block.dev is not None and x.proxyInfo.on_device
    assert address == block.dev.data_ptr() + 4 * x.element_size()
    assert block.host is None or not block.host.data_ptr() <= address < block.host.data_ptr() + block.nbytes


def test_writes_through_data_ptr_are_seen_as_in_plain_torch():
    def written():
        x = torch.arange(16.0).reshape(4, 4)
        ctypes.c_float.from_address(x[1].data_ptr()).value = 42.0  # as a kernel given the address
        tensorsManager.evict_all()  # the write is written back, not dropped with the device copy
        return x.clone(), x.tolist()

    plain, managed = run_both(written)
    assert_identical(plain, managed)
    assert managed[1][1][0] == 42.0


def test_data_ptr_of_a_cpu_tensor_is_its_host_memory():
    c = torch.arange(4.0, device="cpu")
    assert c.data_ptr() == block_of(c).host.data_ptr()
    ctypes.c_float.from_address(c.data_ptr() + c.element_size()).value = -1.0
    assert c.tolist() == [0.0, -1.0, 2.0, 3.0] and _host_only(c)


def test_numpy_of_a_plain_sim_tensor_is_refused_as_for_cuda():
    with plain_torch():
        torch.manual_seed(0)
        a = torch.rand(3)
        assert type(a) is SimTensor
        with pytest.raises(TypeError, match=r"can't convert sim:0 device type tensor to numpy.*Tensor\.cpu\(\)"):
            a.numpy()
        expected = a.cpu().numpy()
    # a TensorRef gives its values (documented: code written for CPU tensors calls numpy())
    torch.manual_seed(0)
    assert (torch.rand(3).numpy() == expected).all()


# -- nn.Module.to("sim") -----------------------------------------------------------------------
# Defect: module.to("sim") replaced each module's parameter with a new Parameter, so tied
# weights came apart (CUDA assigns .data in place and keeps them tied).


def _tied_model():
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    return torch.nn.Sequential(embedding, head)


def _logits_and_grad(model, tokens):
    logits = model(tokens)
    logits.pow(2).sum().backward()
    return logits.detach(), model[0].weight.grad


def test_plain_module_to_sim_keeps_parameters_and_ties():
    with torchTensorRef.disabled():
        model = _tied_model()
        reference = copy.deepcopy(model)
        weight = model[0].weight
        assert model.to("sim") is model
        assert model[0].weight is weight and model[1].weight is weight  # the same Parameter, tied
        assert weight.device == SIM and type(weight) is SimTensor and isinstance(weight, torch.nn.Parameter)
        assert len(list(model.parameters())) == 1
        logits, grad = _logits_and_grad(model, torch.tensor([1, 2, 3]).to("sim"))
        want_logits, want_grad = _logits_and_grad(reference, torch.tensor([1, 2, 3]))
        assert logits.device == SIM and grad.device == SIM
        # the tied weight's gradient sums both uses, as on the CPU (same kernels: bit-identical)
        assert torch.equal(logits.data_, want_logits) and torch.equal(grad.data_, want_grad)


@pytest.mark.parametrize("moved", ["from the cpu", "on sim already"])
def test_plain_module_to_sim_keeps_its_parameters_gradient_hooks(moved):
    # Defect: module.to("sim") swaps each parameter with its SimTensor (swap_tensors), which
    # left the hooks autograd runs with the tensor swapped out: a hook registered before it
    # (or before a .to of a module already on sim) never ran again, where CUDA's .data = keeps
    # them (peft's OSF projects its gradients by hooks: plain torch on sim trained otherwise)
    def run(device):
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4)
        if moved == "on sim already":
            linear.to(device)
        seen = []
        linear.weight.register_hook(lambda g: g * 0 + 1)
        linear.bias.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
        linear.to(device)
        linear(torch.randn(2, 4).to(device)).sum().backward()
        return linear.weight.grad, seen

    with torchTensorRef.disabled():
        grad, seen = run("sim")
        want_grad, want_seen = run("cpu")
        assert torch.equal(grad.data_, torch.ones(4, 4)) and torch.equal(want_grad, torch.ones(4, 4))
        assert len(seen) == len(want_seen) == 1 and torch.equal(seen[0].data_, want_seen[0])


# -- autocast ----------------------------------------------------------------------------------
# Defect: sim tensors reported the CPU to autocast: autocast("sim") did nothing for them and
# autocast("cpu") cast them.


def test_autocast_sim_casts_sim_tensors_as_cuda_autocast_does():
    def forward():
        linear = torch.nn.Linear(8, 4)
        x = torch.randn(3, 8)
        target = torch.rand(3, 4)
        with torch.autocast("sim", dtype=torch.bfloat16):
            y = linear(x)
            loss = torch.nn.functional.binary_cross_entropy(y.sigmoid(), target.bfloat16())  # a float32 op
        with torch.autocast("cpu", dtype=torch.bfloat16):
            untouched = linear(x)  # not a CPU tensor: as CUDA tensors under autocast("cpu")
        return y, loss, untouched, [y.dtype, loss.dtype, untouched.dtype]

    plain, managed = run_both(forward)
    assert_identical(plain, managed)
    assert managed[3] == [torch.bfloat16, torch.float32, torch.float32]
    with torchTensorRef.disabled():  # the CPU's own autocast casts the same way
        torch.manual_seed(0)
        linear, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = linear(x)
    assert torch.equal(managed[0].target, expected)


# -- recurrent layers --------------------------------------------------------------------------
# Defect: LSTM and GRU on a non-CPU device run fused cell ops only CUDA implements; the sim
# device lacked them (and their backward).


def _rnn_run(model, x, state, outputs_only):
    out, final = model(x, state)
    finals = final if isinstance(final, tuple) else (final,)
    loss = out.pow(2).sum()
    if not outputs_only:  # (else the final states get no gradient: the cells' None-gradient paths)
        loss = loss + sum(f.sum() * (i + 1) for i, f in enumerate(finals))
    loss.backward()
    inputs = [x, *(state if isinstance(state, tuple) else (state,))]
    return [out, *finals] + [p.grad for p in model.parameters()] + [t.grad for t in inputs]


@pytest.mark.parametrize("kind", [torch.nn.LSTM, torch.nn.GRU], ids=["LSTM", "GRU"])
@pytest.mark.parametrize("bias, layers, bidirectional, outputs_only",
                         [(True, 1, False, False), (False, 2, True, False), (True, 2, False, True)],
                         ids=["bias", "no bias, 2 layers, bidirectional", "outputs only"])
def test_sim_rnn_matches_the_cpu_forward_and_backward(kind, bias, layers, bidirectional, outputs_only):
    directions = 2 if bidirectional else 1
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        cpu_model = kind(5, 6, num_layers=layers, bias=bias, batch_first=True, bidirectional=bidirectional)
        x = torch.randn(3, 4, 5)
        h0 = torch.randn(layers * directions, 3, 6)
        c0 = torch.randn(layers * directions, 3, 6)
        managed_model = copy.deepcopy(cpu_model)

        def state(make):
            h = make(h0).requires_grad_()
            return (h, make(c0).requires_grad_()) if kind is torch.nn.LSTM else h

        expected = _rnn_run(cpu_model, x.clone().requires_grad_(), state(torch.Tensor.clone), outputs_only)

    managed_model = torchTensorRef.manage(managed_model)
    names = []
    handle = tensorsManager.add_callback(before=lambda op: names.append(op.name))
    try:
        got = _rnn_run(managed_model, TensorRef(x.clone()).requires_grad_(), state(lambda t: TensorRef(t.clone())),
                       outputs_only)
    finally:
        handle.remove()
    fused = "aten._thnn_fused_lstm_cell" if kind is torch.nn.LSTM else "aten._thnn_fused_gru_cell"
    assert any(n.startswith(fused) for n in names) and any("backward" in n and "_thnn_fused" in n for n in names)
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.device == SIM, i
        assert torch.allclose(g.target, e, rtol=1e-5, atol=1e-6), f"{i}: {(g.target - e).abs().max()}"


# -- ops CUDA's kernels take for more dtypes than the CPU's --------------------------------------
# Defect: transformers' mixture-of-experts layers count the tokens routed to each expert with
# ``torch.histc`` of an integer tensor on any device but the CPU; the CPU's kernel takes
# floating point only, so every such model failed on "sim", plain torch included, where it
# runs on CUDA (Note [Kernels CUDA has for more dtypes]).


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("bins, low, high, expected", [
    (4, 0, 3, [2, 1, 1, 3]),  # (an expert's id per bin: 5 and -1 are outside and not counted)
    (3, 0, 0, [3, 2, 4]),  # (the limits from the values: -1 and 5, a bin of two ids each)
    (2, 1, 2, [1, 1]),
], ids=["experts", "extremes", "one range"])
def test_a_histogram_of_integers_counts_as_cuda_s_kernel_does(paging, dtype, bins, low, high, expected):
    values = [0, 0, 1, 3, 3, 3, 2, 5, -1]
    if dtype is torch.uint8:
        values, low, high, expected = [v + 1 for v in values], low + 1, high + 1, expected
    plain, managed = run_both(lambda: torch.histc(torch.tensor(values, dtype=dtype), bins=bins, min=low, max=high))
    assert plain.device == managed.device == SIM and plain.dtype == managed.dtype == dtype
    assert plain.cpu().tolist() == managed.cpu().tolist() == expected


def test_a_histogram_of_integers_on_the_cpu_is_still_refused_as_plain_cpu_torch_refuses_it():
    with pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        torch.histc(torch.tensor([1, 2], device="cpu"), bins=3)  # (a TensorRef of the host)
    with torchTensorRef.disabled(), pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        torch.histc(torch.tensor([1, 2]), bins=3)


# -- the backend module ------------------------------------------------------------------------
# Defect: torch.sim.is_available() said True, so code looking for the machine's accelerator
# (torch.accelerator, DataLoader's pin_memory) saw a GPU where there is none.


def test_sim_backend_is_not_the_machines_accelerator():
    assert torch.sim.is_available() is False
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    assert accelerator is None or accelerator.type != "sim"
    assert torch.accelerator.is_available() is torch.cuda.is_available()
    # ... and sim tensors work all the same
    y = torch.ones(2, device="sim") + torch.ones(2)
    assert y.device == SIM and y.tolist() == [2.0, 2.0]


# -- generators --------------------------------------------------------------------------------
# Defect: torch.Generator(device="sim") raised NotImplementedError ("You should register
# `PrivateUse1HooksInterface` ... getNewGenerator"): a private-use device's generators are made
# in C++ only, and tests written for any accelerator make one as torch.Generator(device=device).


def _draws(generator, device):
    generator.manual_seed(3)
    return [torch.randn(5, generator=generator, device=device), torch.rand(2, 3, generator=generator, device=device),
            torch.randint(0, 9, (6,), generator=generator, device=device),
            torch.randperm(7, generator=generator, device=device),
            torch.empty(4, device=device).normal_(generator=generator)]


def test_a_generator_of_the_device_draws_what_a_cpu_generator_seeded_alike_draws(paging):
    g = torch.Generator(device="sim")
    assert g.device == SIM and isinstance(g, torch.Generator)
    assert torch.Generator(device=SIM).device == SIM
    with plain_torch():
        plain = _draws(g, "sim")
    managed = _draws(g, "sim")
    assert all(type(t) is SimTensor for t in plain) and all(type(t) is TensorRef for t in managed)
    assert all(t.device == SIM for t in plain + managed)
    assert_identical(plain, managed)
    with torchTensorRef.disabled():  # sim's random numbers are the CPU's
        assert_identical(_draws(torch.Generator(), "cpu"), managed)


def test_a_generator_of_the_device_keeps_its_device_through_copies_and_states():
    g = torch.Generator(device="sim").manual_seed(11)
    copies = [copy.deepcopy(g), pickle.loads(pickle.dumps(g)), g.clone_state()]
    restored = torch.Generator(device="sim")
    restored.set_state(g.get_state())
    expected = torch.rand(4, generator=g, device="sim")
    for other in copies + [restored]:
        assert other.device == SIM and isinstance(other, torch.Generator) and other.initial_seed() == 11
        assert_identical(expected, torch.rand(4, generator=other, device="sim"))


def test_other_generators_are_torchs_own():
    made = [torch.Generator(), torch.Generator(device="cpu"), torch.Generator(CPU)]
    assert all(type(g) is torch._C.Generator and g.device == CPU for g in made)
    assert isinstance(torch.default_generator, torch.Generator)
    assert issubclass(torch._C.Generator, torch.Generator)
    with pytest.raises(RuntimeError, match="sim:0"):
        torch.Generator(device="sim:1")


def test_fork_rng_of_the_device_leaves_its_numbers_as_plain_torch_s():
    # (peft's PSOFT initializes under torch.random.fork_rng(device_type=x.device.type): it
    # asked torch.sim for its generator's state, which the device module did not give)
    def fn():
        inside = []
        with torch.random.fork_rng(devices=[0], device_type="sim"):
            inside.append(torch.randn(4, device="sim"))
        inside.append(torch.randn(4, device="sim"))  # (the numbers before the fork come again)
        return inside

    plain, managed = run_both(fn, seed=5)
    assert_identical(plain, managed)
    assert_identical(managed[0], managed[1])
