"""TensorRef as its user sees it: the proxy API, printing, values out, explicit moves, copies."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest
import torch

import torchTensorRef
from torchTensorRef import OutOfBudgetError, TensorRef, tensorsManager
from torchTensorRef.strategies import NAMES
from torchTensorRef.core.tensor_ref import block_of

from paired import assert_identical, budget, device_type, paging, run_both  # noqa: F401  (paging is a fixture)


def _where(ref) -> str:
    """The device type ``ref``'s bytes are on now (``proxyInfo.device`` is ``"cuda:0"`` on a GPU)."""
    return ref.proxyInfo.device.split(":")[0]


# -- construction and the proxy API ----------------------------------------------------

def test_creation_functions_return_tensor_refs():
    for x in (torch.zeros(3), torch.rand(2, 2), torch.arange(4), torch.tensor([1, 2]), torch.full((2,), 7.0)):
        assert type(x) is TensorRef and isinstance(x, torch.Tensor)


def test_tensor_ref_of_a_plain_tensor_shares_its_bytes():
    with torchTensorRef.disabled():
        plain = torch.arange(4.0)
    ref = TensorRef(plain)
    assert type(ref) is TensorRef and torch.equal(ref.target, plain)
    plain[0] = 10  # the block's host copy is the plain tensor's storage
    assert ref.tolist() == [10.0, 1.0, 2.0, 3.0]
    assert TensorRef(ref) is ref


def test_tensor_ref_rejects_what_it_cannot_manage():
    with pytest.raises(TypeError, match="needs a torch.Tensor"):
        TensorRef([1, 2])
    with pytest.raises(ValueError, match="strided tensors with data"):
        TensorRef(torch.empty(2, device="meta"))


def test_target_is_plain_with_the_values():
    x = torch.arange(6.0).reshape(2, 3)
    t = x.t().target
    assert type(t) is torch.Tensor
    with torchTensorRef.disabled():
        assert torch.equal(t, torch.arange(6.0).reshape(2, 3).t())


def test_views_share_one_block_and_proxy_info_reports_it():
    x = torch.zeros(4, 4)
    v = x[1]
    w = x.t()
    assert x.proxyInfo.block_id == v.proxyInfo.block_id == w.proxyInfo.block_id
    assert v.proxyInfo.nbytes == x.proxyInfo.nbytes == 64
    assert x.proxyInfo.views == 3
    assert set(x.proxyInfo.as_dict()) >= {"device", "nbytes", "block_id", "on_device", "dirty", "pinned", "views"}
    assert "ProxyInfo(" in repr(x.proxyInfo)


@pytest.mark.parametrize("strategy", NAMES)
def test_to_gpu_and_to_cpu_move_the_bytes_and_proxy_info_follows(strategy):
    tm = tensorsManager
    tm.strategy = strategy
    x = torch.arange(8.0)
    v = x[2:]
    x.toCPU()
    assert x.proxyInfo.device == "cpu" and not x.proxyInfo.on_device
    assert x.toGPU() is x
    assert _where(x) == _where(v) == device_type()  # the whole block moved
    assert tm.stats()["device_bytes"] >= x.proxyInfo.nbytes
    assert v.toCPU() is v
    assert x.proxyInfo.device == "cpu" and v.proxyInfo.device == "cpu"
    assert x.tolist() == list(range(8))


@pytest.mark.parametrize("strategy", NAMES)
def test_a_write_on_the_accelerator_is_written_back_by_to_cpu(strategy):
    tensorsManager.strategy = strategy
    x = torch.zeros(4)
    x.toGPU()
    x.add_(1)
    if x.proxyInfo.on_device:  # the strategy kept it: the host copy is now stale
        assert x.proxyInfo.dirty
    x.toCPU()
    assert not x.proxyInfo.dirty and x.proxyInfo.device == "cpu"
    with torchTensorRef.disabled():
        assert torch.equal(x.target, torch.ones(4))


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_write_through_a_view_is_seen_by_the_base_and_every_view(where, paging):
    def run():
        base = torch.arange(24.0).reshape(4, 6)
        views = [base[1], base.t(), base[:, 2:4], base.view(-1)[5:], base.unsqueeze(0).narrow(2, 1, 3)]
        seen = []
        for k, v in enumerate(views):
            for t in views + [base]:
                if isinstance(t, TensorRef):
                    t.toGPU() if where == "device" else t.toCPU()
            with torch.no_grad():
                v.mul_(-1).add_(k)
            seen.append([u.clone() for u in [base] + views])
        return seen

    assert_identical(*run_both(run))


def test_to_gpu_over_the_budget_raises_and_moves_nothing():
    tm = tensorsManager
    tm.budget = budget(64)
    x = torch.zeros(32)  # 128 bytes
    with pytest.raises(OutOfBudgetError):
        x.toGPU()
    assert x.proxyInfo.device == "cpu" and tm.stats()["device_bytes"] == 0


def test_to_gpu_evicts_others_to_stay_within_the_budget():
    tm = tensorsManager
    tm.budget = budget(768)
    a, b = torch.zeros(128), torch.ones(128)  # 512 bytes each (as the device's allocator counts them too)
    a.toGPU()
    b.toGPU()
    assert _where(b) == device_type() and _where(a) == "cpu"
    assert tm.stats()["peak_device_bytes"] <= 768


# -- printing ---------------------------------------------------------------------------

REPR_CASES = {
    # a requires_grad suffix too long for the values' line goes to a line of its own
    "requires_grad": lambda: torch.randn(6, requires_grad=True),
    "grad_fn": lambda: torch.randn(6, requires_grad=True) * 2,
    "grad_fn_view": lambda: (torch.randn(2, 3, requires_grad=True) * 1)[1],
    "float64": lambda: torch.randn(3, 4, dtype=torch.float64),
    "float16_grad": lambda: torch.randn(2, 3, dtype=torch.float16, requires_grad=True),
    "int": lambda: torch.arange(5),
    "int32": lambda: torch.arange(5, dtype=torch.int32),
    "bool": lambda: torch.tensor([True, False]),
    "complex": lambda: torch.randn(3, dtype=torch.complex64),
    "conj": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.zeros(0, 3),
    "empty_int": lambda: torch.zeros(0, dtype=torch.int32),
    # (values from no generator: a random factory larger than the budget draws on the host,
    # from the CPU's generator, where CUDA's draws other numbers; creation.py)
    "large_summarised": lambda: torch.arange(1200, dtype=torch.float64).reshape(40, 30).sin() * 3,
    "parameter": lambda: torch.nn.Linear(3, 2).weight,
    "non_contiguous": lambda: torch.randn(4, 5).t()[1:],
}


@pytest.mark.parametrize("case", sorted(REPR_CASES))
def test_repr_and_str_are_those_of_plain_torch(case, paging):
    plain, managed = run_both(REPR_CASES[case])
    assert type(managed) is TensorRef and not isinstance(plain, TensorRef)
    assert repr(managed) == repr(plain)
    assert str(managed) == str(plain)


def test_print_writes_what_plain_torch_writes(capsys):
    plain, managed = run_both(lambda: torch.randn(3, 3, requires_grad=True) @ torch.randn(3, 3))
    print(plain)
    expected = capsys.readouterr().out
    print(managed)
    assert capsys.readouterr().out == expected


def test_repr_follows_print_options():
    plain, managed = run_both(lambda: torch.randn(4, 4) * 1000)
    with torch._tensor_str.printoptions(precision=2, sci_mode=True, linewidth=40):
        assert repr(managed) == repr(plain)


@pytest.mark.parametrize("spec", ["", ".3f", "+.1e", "10.4g"])
def test_f_string_of_a_0_dim_tensor_formats_its_value(spec, paging):
    def make():
        x = torch.randn(5, requires_grad=True)
        return (x * x).sum()  # requires grad: formatting still shows the value

    plain, managed = run_both(make)
    assert format(managed, spec) == format(plain, spec)


def test_f_string_of_tensors_and_parameters_is_plain_torchs():
    plain, managed = run_both(lambda: (torch.arange(3.0), torch.nn.Parameter(torch.tensor(1.5))))
    assert f"{managed[0]}" == f"{plain[0]}"
    for p, m in zip(plain, managed):
        # plain torch refuses a format spec for n-dim tensors and for Parameters
        with pytest.raises(TypeError):
            format(p, ".2f")
        with pytest.raises(TypeError):
            format(m, ".2f")


# -- values out: numpy, tolist, item ------------------------------------------------------

def test_numpy_tolist_item_give_the_values(paging):
    def make():
        x = torch.randn(3, 4)
        y = (x @ x.t()).t()[1:]
        return y, y[0, 1]

    (py, ps), (my, ms) = run_both(make)
    # (plain torch refuses numpy() on an accelerator tensor; a TensorRef gives its host copy)
    np.testing.assert_array_equal(my.numpy(), py.cpu().numpy())
    assert my.tolist() == py.tolist()
    assert ms.item() == ps.item()
    assert my.numpy().shape == py.cpu().numpy().shape and my.numpy().dtype == py.cpu().numpy().dtype


def test_numpy_refuses_tensors_that_require_grad_like_torch():
    x = torch.zeros(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="Can't call numpy\\(\\) on Tensor that requires grad"):
        x.numpy()
    assert x.numpy(force=True).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("strategy", NAMES)
def test_numpy_array_and_tensor_share_their_bytes_both_ways(strategy):
    # Under "flow" the block used to stay on the accelerator: the array's later writes were
    # overwritten by the write-back, and ops read a stale copy.
    tm = tensorsManager
    tm.strategy = strategy
    y = torch.zeros(4)
    array = y.numpy()
    y.add_(1)  # seen by the array
    assert array.tolist() == [1.0, 1.0, 1.0, 1.0]
    y.toGPU()  # an array holder may write at any time: the bytes stay on the host
    array[0] = 5  # seen by the tensor
    assert (y * 1).tolist() == [5.0, 1.0, 1.0, 1.0]
    assert y.tolist() == [5.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("strategy", NAMES)
def test_an_op_that_raises_leaves_a_shared_block_on_the_host(strategy):
    # An op that raised after its tensors were fetched left a block an array shares on the
    # accelerator: the array's next write was not seen (found by the property programs).
    tensorsManager.strategy = strategy

    def program():
        x = torch.tensor([[5.0, 2.0], [1.0, 3.0]])
        array = x.numpy()
        with pytest.raises(RuntimeError):
            torch.mm(x, torch.ones(3, 3))  # fetched, then the kernel refuses the shapes
        array[0, 0] = 7
        return x, [x.tolist(), (x * 1).tolist()]

    with torchTensorRef.disabled():
        _, expected = program()  # plain torch: the array and the tensor share their bytes
    x, got = program()
    assert isinstance(x, TensorRef) and not x.proxyInfo.on_device
    assert got == expected


@pytest.mark.parametrize("strategy", NAMES)
def test_from_numpy_buffer_rewritten_between_ops_is_read_afresh(strategy):
    # The pattern of a reused input buffer: under "flow" every op used to read the first batch.
    tensorsManager.strategy = strategy
    w = torch.ones(4)
    buffer = np.zeros(4, dtype=np.float32)
    x = torch.from_numpy(buffer)
    sums = []
    for i in range(4):
        buffer[:] = i
        sums.append((x * w).sum().item())
    assert sums == [0.0, 4.0, 8.0, 12.0]
    x.mul_(2)  # and a write by an op reaches the buffer
    assert buffer.tolist() == [6.0, 6.0, 6.0, 6.0]


def test_a_block_is_cached_again_once_its_arrays_are_gone():
    tm = tensorsManager
    tm.strategy = "flow"
    w = torch.ones(4)
    view = w.numpy()[1:]
    assert block_of(w).external
    del view
    gc.collect()
    assert not block_of(w).external
    w.toGPU()
    assert _where(w) == device_type()


def test_data_ptr_and_untyped_storage_follow_views():
    x = torch.arange(6.0)
    v = x[2:]
    assert v.data_ptr() - x.data_ptr() == 2 * x.element_size()
    assert v.untyped_storage().nbytes() == x.untyped_storage().nbytes() == 24


# -- pickle, deepcopy, .data --------------------------------------------------------------

def test_pickle_round_trip_keeps_values_kind_and_attributes(paging):
    x = torch.randn(3, requires_grad=True)
    p = torch.nn.Linear(2, 2).weight
    p.tag = "kept"
    y, q = pickle.loads(pickle.dumps((x, p)))
    assert type(y) is TensorRef and y.requires_grad and torch.equal(y, x)
    assert isinstance(q, torch.nn.Parameter) and type(q) is TensorRef and torch.equal(q, p)
    assert q.tag == "kept"


@pytest.mark.parametrize("strategy", NAMES)
def test_pickle_reads_the_latest_write(strategy):
    tensorsManager.strategy = strategy
    x = torch.zeros(3)
    x.toGPU()
    x.add_(2)
    assert pickle.loads(pickle.dumps(x)).tolist() == [2.0, 2.0, 2.0]


def test_deepcopy_is_independent_and_keeps_views_shared(paging):
    x = torch.arange(6.0)
    x.toGPU()
    pair = copy.deepcopy((x, x[2:]))
    a, b = pair
    assert type(a) is TensorRef and a.proxyInfo.block_id == b.proxyInfo.block_id != x.proxyInfo.block_id
    b[0] = 100
    assert a.tolist() == [0.0, 1.0, 100.0, 3.0, 4.0, 5.0]
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_deepcopy_of_a_non_leaf_is_refused_like_torch():
    y = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(y)


def test_deepcopy_of_a_module_keeps_tied_weights_tied():
    def make():
        m = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
        m[1].weight = m[0].weight
        return m

    plain, managed = run_both(make)
    twin = copy.deepcopy(managed)
    assert twin[0].weight is twin[1].weight and isinstance(twin[0].weight, torch.nn.Parameter)
    assert type(twin[0].weight) is TensorRef and twin[0].weight is not managed[0].weight
    assert torch.equal(twin[0].weight, managed[0].weight)
    assert_identical(plain[0].weight, twin[0].weight)


def test_data_setter_rebinds_the_parameter():
    p = torch.nn.Parameter(torch.zeros(3))
    p.data = torch.ones(2)
    assert isinstance(p, torch.nn.Parameter) and p.shape == (2,)
    assert p.tolist() == [1.0, 1.0]
    p.data.mul_(3)  # the new block is the parameter's
    assert p.tolist() == [3.0, 3.0]


def test_a_tensor_rebound_by_data_leaves_its_old_bytes_to_their_other_users(paging):
    # ``b.data = t`` left b's old liveness weakref in the old block's list of views: b's
    # death was counted against the old block too, which was released under ``other``
    # (reading it then raised "'NoneType' object has no attribute 'device'").
    def run():
        b = torch.arange(4.0)
        other = b.detach()  # the same bytes, not a view with b as its base
        b.data = torch.zeros(4)
        del b
        gc.collect()
        torch.ones(1).add_(1)  # (an op: deaths queued meanwhile are applied)
        return other.tolist(), other * 2

    plain, managed = run_both(run)
    assert managed[0] == plain[0]
    assert_identical(plain[1], managed[1])


def test_a_parameter_rebound_to_its_own_bytes_stays_readable(paging):
    # ``p.data = p.detach()`` counted p's later death twice against its own block, which
    # was then released under the tensors still viewing it.
    def run():
        p = torch.nn.Parameter(torch.arange(3.0))
        view = p.detach()
        p.data = p.detach()
        del p
        gc.collect()
        torch.ones(1).add_(1)
        return view.tolist(), view + 1

    plain, managed = run_both(run)
    assert managed[0] == plain[0]
    assert_identical(plain[1], managed[1])


def test_resize_of_a_tensor_numpy_shares_is_refused_like_torch():
    # resize_ ran on the accelerator copy, which is resizable: the resize succeeded where
    # plain torch refuses, and the array was left behind.
    x = torch.zeros(3)
    array = x.numpy()
    with pytest.raises(RuntimeError, match="not resizable"):
        x.resize_(10)
    assert array.__array_interface__["data"][0] == x.data_ptr()


def test_inference_mode_gives_what_plain_torch_gives(paging):
    # Fixed: a view made in inference mode of a tensor made before it raised "Cannot set
    # version_counter for inference tensor" (BertEmbeddings slices its position_ids buffer so).
    def run():
        buffer = torch.arange(10).expand((1, -1))
        x = torch.arange(10.0)
        with torch.inference_mode():
            made = torch.zeros(3)
            read = x[2:5].tolist()  # (reads x in inference mode)
            outs = [buffer[:, 2:5], x[2:5], x.view(2, 5), x.t(), x + 1, made]
            inference = [t.is_inference() for t in outs]
            values = [t.clone() for t in outs]
        refused = []
        for t in (outs[1], made):  # in place outside inference mode: refused for inference tensors only
            try:
                t.add_(1)
                refused.append(None)
            except RuntimeError as e:
                refused.append(str(e).split(".")[0])
        return values, outs, inference, refused, read

    plain, managed = run_both(run)
    assert_identical(plain[0], managed[0])
    assert_identical(plain[1], managed[1])  # (after the in-place add on the normal view)
    assert managed[2:] == plain[2:]
    assert managed[2] == [False, False, False, False, True, True]


def test_a_parameter_rebuilt_from_its_class_and_dict_is_a_parameter(paging):
    # accelerate's init_empty_weights and loaders rebuild parameters as
    # ``type(p)(data, requires_grad=..., **p.__dict__)``; it raised "TensorRef.__new__() got an
    # unexpected keyword argument '_is_param'".
    p = torch.nn.Linear(3, 2).weight
    on_meta = type(p)(p.to("meta"), requires_grad=p.requires_grad, **p.__dict__)
    assert isinstance(on_meta, torch.nn.Parameter) and on_meta.is_meta and on_meta.shape == p.shape
    p.tag = "kept"
    frozen = type(p)(p.detach(), requires_grad=False, **p.__dict__)
    assert type(frozen) is TensorRef and isinstance(frozen, torch.nn.Parameter) and frozen.tag == "kept"
    assert not frozen.requires_grad and frozen.proxyInfo.block_id == p.proxyInfo.block_id
    assert torch.equal(frozen, p)
    with pytest.raises(TypeError, match="needs a torch.Tensor"):
        type(p)([1.0, 2.0], **p.__dict__)


def test_reading_a_tensor_ref_under_a_dispatch_mode_shows_the_mode_no_op(paging):
    # Fixed: the manager's copies for tolist(), .target, untyped_storage() ... ran under the
    # caller's dispatch mode, which saw a dozen ops plain torch never runs (and torch.export's
    # fake-tensor mode took them over and failed).
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def run():
        x = torch.randn(64) * 2  # (a result: on the device under Flow, written)
        log = Log()
        with log:
            values = x.tolist()
            x.untyped_storage()
            x.data_ptr()
            pickle.dumps(x)
            on_host = x.cpu()  # (an op: both logs have it)
            array = on_host.numpy().copy()
        return values, array.tolist(), log.ops

    plain, managed = run_both(run)
    assert managed[:2] == plain[:2]
    assert managed[2] == ["aten._to_copy.default"]
    # Plain torch runs that op too, and no other but copies to the host and detaches: on a GPU
    # its tolist() and pickling copy to the host with _to_copy, and on "sim" a SimTensor
    # detaches where it pickles or leaves for numpy (its own wrapper's doing).
    assert "aten._to_copy.default" in plain[2]
    assert set(plain[2]) <= {"aten._to_copy.default", "aten.detach.default"}
