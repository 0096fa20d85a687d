"""Every aten op: PyTorch's OpInfo database, plain torch vs TensorRefs on "sim" under a tight budget.

For each ``op_db`` entry that supports float32 on the CPU and each strategy, the first
``SAMPLES_PER_OP`` sample inputs and a non-contiguous copy of the first run twice: once in
plain torch on the test device (``SimTensor``s on "sim", plain CUDA tensors on CUDA), once
with every tensor of the sample made a TensorRef, under a budget of twice the sample's bytes (so the op's
intermediate tensors and autograd's saved tensors are evicted and fetched back). The function and
in-place variants run forward and backward (the gradients of a fixed random weighting of the
outputs; in place on a clone of the input); ``out=`` (into empty tensors the op must resize) runs forward. Results, the
inputs afterwards (ops may write them) and gradients must match plain torch bit for bit;
where plain torch raises, the managed run must raise an exception of the very same type
(never one of the package's own errors, such as ``OutOfBudgetError``, a ``RuntimeError``).

An op whose own working set does not fit raises ``OutOfBudgetError``, which is correct
behaviour: the managed run is then repeated from fresh inputs with a larger budget.

Two more modes run the sweep where nothing has to move, so that ops take the fast path
(Note [Fast path] in ``ops/dispatch.py``): ``"resident"`` (Flow on "sim" with no budget,
every input brought in before the op) and ``"pass-through"`` (device "cpu").

Known failures are listed with their reason in ``opinfo_xfails.py``; they are strict, so a
fixed op fails the sweep until its entry is removed. ``python tests/ops/test_opinfo.py`` prints
the match rate.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

pytest.importorskip("expecttest")  # op_db needs it

import torchTensorRef  # noqa: E402
from torchTensorRef import TensorRef, OutOfBudgetError, tensorsManager
from torchTensorRef.core import errors, raw  # noqa: E402
from torchTensorRef.strategies import NAMES  # noqa: E402
from torchTensorRef.memory.sim.tensor import SimTensor  # noqa: E402
from torchTensorRef.core.tensor_ref import with_math_bits  # noqa: E402

from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from opinfo_xfails import ACCELERATOR_XFAILS, PASS_THROUGH_XFAILS, XFAILS  # noqa: E402
from paired import budget, plain_torch, values  # noqa: E402

#: sample inputs per op (op_db's first ones are the typical shapes; more only costs time)
SAMPLES_PER_OP = 2
#: required share of the swept ops that match plain torch
REQUIRED_MATCH_RATE = 0.98
#: ops whose outputs are uninitialized memory: only their metadata is compared
UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
                           "empty_permuted"})
#: ops whose ``out=`` result is sometimes uninitialized memory on an accelerator (seen on
#: "sim", for plain torch's SimTensors as for TensorRefs): an empty matrix's rank written into
#: an ``out`` resized from size 0; only its metadata is compared
UNINITIALIZED_OUT = frozenset({"linalg.matrix_rank"})
#: ops whose backward sums a gradient larger than the tight budget along dimensions (kron's:
#: its result's gradient, reshaped, summed over the other operand's): the sum runs in slices
#: (``ops/split_reductions.py``), within rounding of one call, since a kernel orders a sum's
#: additions by the shape it is given, as a product's tiles; under a budget it fits, bit for bit
SPLIT_SUMS = frozenset({"kron"})
#: ops whose backward multiplies matrices larger than the tight budget where CUDA's allocation
#: sizes are emulated (tensorinv's: the inverse's gradient, two products): the product runs in
#: tiles, which the CPU's BLAS may compute by another kernel than the whole product, within
#: rounding of one call (``docs/concepts.md``); under a budget it fits, bit for bit
SPLIT_PRODUCTS = frozenset({"linalg.tensorinv"})
#: ops whose CUDA kernels add into one element from many threads with atomics, in no fixed
#: order (forward, or the backward the sweep runs: scatter_add, index_add, atomicAdd), so
#: that plain CUDA torch's own sums differ in their last bits from run to run: on CUDA
#: they are compared within float rounding (bit for bit on the CPU and "sim")
ATOMIC_SUMS_ON_CUDA = frozenset({
    "cummax", "cummin", "nn.functional.upsample_bilinear", "nn.functional.interpolate", "bincount",
    "index_add", "scatter_add", "scatter_reduce", "index_put", "put", "take", "gather", "index_select",
    "repeat_interleave", "nn.functional.grid_sample", "nn.functional.embedding_bag", "histc",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.adaptive_avg_pool3d",
    "nn.functional.adaptive_max_pool2d", "nn.functional.adaptive_max_pool3d", "nn.functional.avg_pool3d",
    "nn.functional.ctc_loss",
})
#: times the budget may be raised after an OutOfBudgetError before the op is declared failing
BUDGET_RETRIES = 12

SWEPT = [op for op in op_db if torch.float32 in op.supported_dtypes("cpu")]

#: the suite's device (tests/conftest.py): "sim" unless TORCHTENSORREF_TEST_DEVICE says otherwise
TEST_DEVICE = os.environ.get("TORCHTENSORREF_TEST_DEVICE", "sim")
#: why the jiterator entries are not swept on CUDA
JITERATOR_ON_CUDA = (
    "jiterator_* launch a raw CUDA kernel (torch._C._cuda_jiterator_compile_and_launch_kernel) that no "
    "tensor subclass sees; on TensorRefs it read the wrappers' empty storage (an illegal memory access "
    "that kills the process's CUDA context): tested with its guard in tests/ops/test_jiterator.py"
)
#: the package's own errors: never "the same exception" as one plain torch raised
OWN_ERRORS = tuple(c for c in vars(errors).values()
                   if inspect.isclass(c) and issubclass(c, BaseException) and c.__module__ == errors.__name__)

#: each strategy under a tight budget, then the two modes in which nothing moves
MODES = NAMES + ("resident", "pass-through")
_mode = {"tight_budget": True, "bring_in": False, "reference_on_device": True}


def op_key(op):
    """The ``(name, variant)`` key of an OpInfo in the expected-failure table."""
    return (op.name, op.variant_test_name)


def op_id(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


#: expected failures on CUDA alone: an empty matrix's rank is made by the C++ composite's
#: factory calls, which on CUDA (as on the CPU, pass-through) reach no tensor subclass; on
#: "sim" they reach the device's factory kernels, which make TensorRefs
CUDA_XFAILS = {key: PASS_THROUGH_XFAILS[key] for key in (("linalg.matrix_rank", ""),
                                                         ("linalg.matrix_rank", "hermitian"))}

#: accelerator failures that match on CUDA: plain CUDA torch, the reference there, takes the
#: CSR input beside CUDA tensors as the managed run does (on "sim" the reference is plain CPU torch)
MATCH_ON_CUDA = frozenset({("sparse.sampled_addmm", "")})


def _params():
    params = []
    for op in SWEPT:
        for mode in MODES:
            by_mode = PASS_THROUGH_XFAILS if mode == "pass-through" else ACCELERATOR_XFAILS
            reason = XFAILS.get(op_key(op)) or by_mode.get(op_key(op))
            if TEST_DEVICE.startswith("cuda") and mode != "pass-through":
                if op_key(op) in MATCH_ON_CUDA:
                    reason = None
                reason = reason or CUDA_XFAILS.get(op_key(op))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            if op.name.startswith("jiterator_") and TEST_DEVICE.startswith("cuda"):
                marks = [pytest.mark.skip(reason=JITERATOR_ON_CUDA)]
            params.append(pytest.param(op, mode, id=f"{op_id(op)}-{mode}", marks=marks))
    return params


# -- running one sample ------------------------------------------------------------------------

def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


_sample_cache: dict = {}


def _samples(op):
    """The first ``SAMPLES_PER_OP`` samples, then the first again with non-contiguous tensors.

    The non-contiguous copy views every other element of a larger storage at an offset, so
    the managed tensors are strided views of their blocks. Cached for the other strategies
    (making samples costs as much as checking them; they are only ever copied).
    """
    if op_key(op) not in _sample_cache:
        _sample_cache.clear()  # an op's strategies are collected next to each other
        _sample_cache[op_key(op)] = _make_samples(op)
    return _sample_cache[op_key(op)]


def _make_samples(op):
    with torchTensorRef.disabled():
        samples = []
        for sample in op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd):
            samples.append(sample)
            if len(samples) == SAMPLES_PER_OP:
                break
        if samples and all(t.layout == torch.strided for t in tree_flatten(
                (samples[0].input, samples[0].args, samples[0].kwargs))[0] if _is_tensor(t)):
            samples.append(samples[0].noncontiguous())
        return samples


def _copy(tree, managed: bool, grad: bool = True, on_device: bool = False):
    """Independent copies of the tensors of ``tree``, with their strides and storage sharing.

    ``managed``: TensorRefs; ``on_device``: plain tensors of the test device (the reference);
    neither: plain CPU tensors.
    """
    memo, storages = {}, {}

    def one(t):
        if not _is_tensor(t):
            return t
        if id(t) not in memo:
            with torchTensorRef.disabled():
                if t.layout == torch.strided:
                    key = t.untyped_storage()._cdata
                    if key not in storages:
                        storages[key] = t.untyped_storage().clone()
                    c = with_math_bits(raw.typed_view(storages[key], t.dtype, t.size(), t.stride(),
                                                      t.storage_offset()), t)
                else:
                    c = t.detach().clone()
            if managed and c.layout == torch.strided:
                c = _on_the_device(TensorRef(c))
            elif (managed or on_device) and c.layout in (torch.strided, torch.sparse_coo):
                c = _on_test_device(c)  # a sparse input of a managed run is a plain device tensor
            memo[id(t)] = c.requires_grad_(grad and t.requires_grad)
        return memo[id(t)]

    return tree_map(one, tree)


def _test_device() -> torch.device:
    """The device managed tensors report: read from the public setting for CUDA, where the
    manager's own record is a placeholder (the CPU) until its first tensor resolves "cuda"."""
    name = tensorsManager.device
    return torch.device(name) if name.startswith("cuda") else tensorsManager.declared


def _on_the_device(ref):
    """A TensorRef the program put on the test device, as the reference's tensors are
    (``_on_test_device``): beside a CPU tensor its ops fail as on CUDA, where one made without
    a device would run on the host (Note [Default-device tensors] in ops/device_checks.py)."""
    return ref.to(_test_device())


def _on_test_device(t):
    """A plain CPU tensor as a plain tensor of the test device (its bytes, its strides)."""
    device = _test_device() if _mode["reference_on_device"] else torch.device("cpu")
    if device.type == "sim":
        return SimTensor(t)
    if device.type == "cuda":
        if t.layout != torch.strided:
            return t.to(device)
        # (keyword only: ``UntypedStorage.to(device)`` is a TypeError on every torch)
        storage = t.untyped_storage().to(device=device)
        return with_math_bits(raw.typed_view(storage, t.dtype, t.size(), t.stride(), t.storage_offset()), t)
    return t


def _weights(outputs):
    """Fixed random weights, one plain tensor per differentiable output."""
    weights = []
    with torchTensorRef.disabled():
        for i, o in enumerate(outputs):
            g = torch.Generator().manual_seed(1000 + i)
            shape = o.shape if not o.is_complex() else (2,) + tuple(o.shape)
            weights.append(torch.randn(shape, generator=g, dtype=o.real.dtype if o.is_complex() else o.dtype))
    return weights


def _loss(outputs, weights):
    total = None
    for o, w in zip(outputs, weights):
        term = (o.real * w[0]).sum() + (o.imag * w[1]).sum() if o.is_complex() else (o * w).sum()
        total = term if total is None else total + term
    return total


def _identity(result, written):
    """Which results are the very objects the op wrote (in-place and out= ops return them)."""
    results = result if isinstance(result, tuple) else (result,)
    written = written if isinstance(written, tuple) else (written,)
    return tuple(r is w for r, w in zip(results, written))


def _run(op, sample, tree, variant: str, managed: bool):
    """Run a variant of ``op`` on the copied sample ``tree``: (result, tree after, extras).

    ``tree`` is ``(input, args, kwargs)``, plus the ``out`` tensors for the ``"out"`` variant.
    ``extras`` holds the gradients and, for in-place and ``out=``, whether the op returned
    the very tensors it wrote.
    """
    inp, args, kwargs = tree[:3]
    torch.manual_seed(0)  # random ops draw the same numbers in both runs
    if variant == "out":
        out = op(inp, *args, out=tree[3], **kwargs)
        return out, tree, _identity(out, tree[3])
    if variant == "inplace":
        # Autograd through an in-place op needs a non-leaf to write: a clone of the input.
        target = inp.clone() if inp.requires_grad else inp
        out = op.inplace_variant(target, *args, **kwargs)
        return out, tree, (_identity(out, target), _grads(op, sample, tree, out, managed))
    out = op(inp, *args, **kwargs)
    return out, tree, _grads(op, sample, tree, out, managed)


def _grads(op, sample, tree, out, managed: bool):
    """Gradients of a fixed random weighting of ``out`` w.r.t. the sample's tensors, or None."""
    leaves = [t for t in tree_flatten(tree)[0] if _is_tensor(t) and t.requires_grad]
    if not (op.supports_autograd and leaves):
        return None
    diff = [o for o in tree_flatten(sample.output_process_fn_grad(out))[0]
            if _is_tensor(o) and o.requires_grad and (o.is_floating_point() or o.is_complex())]
    if not diff:
        return None
    weights = [_on_the_device(TensorRef(w)) if managed else _on_test_device(w) for w in _weights(diff)]
    torch.manual_seed(1)
    return torch.autograd.grad(_loss(diff, weights), leaves, allow_unused=True)


def _grad_enabled(op, variant: str) -> bool:
    """Whether the variant runs backward too (its sample keeps ``requires_grad``)."""
    if variant == "function":
        return True
    return variant == "inplace" and op.supports_inplace_autograd


def _plain(tree):
    """``tree`` with every tensor replaced by a plain CPU copy of its values (strides kept)."""
    def one(t):
        if not _is_tensor(t):
            return t
        v = values(t).detach()
        # (a plain CUDA tensor is copied with its strides too: .cpu() made a strided view
        # dense, and a metadata-only comparison failed on the strides)
        if v.layout != torch.strided or v._is_zerotensor() or (type(t) is torch.Tensor and t.device.type == "cpu"):
            return v.cpu()  # (a plain CPU tensor may have no storage: autograd's zero tensors)
        # copied with its storage, to keep strides (clone would make it dense)
        copy = raw.typed_view(v.untyped_storage().cpu().clone(), v.dtype, v.size(), v.stride(), v.storage_offset())
        return with_math_bits(copy, v)

    return tree_map(one, tree)


def _check_managed(tree, what: str, zeros_may_escape: bool = False):
    """Every strided tensor in ``tree`` is a TensorRef.

    With ``zeros_may_escape``, a plain all-zero tensor is accepted: autograd's engine fills
    an undefined gradient with ``aten.zeros``, which has no tensor argument to dispatch on.
    """
    for t in tree_flatten(tree)[0]:
        if _is_tensor(t) and t.layout == torch.strided and not isinstance(t, TensorRef):
            assert zeros_may_escape and not values(t).any(), f"{what}: a {type(t).__name__} escaped management"


def _compare(actual, expected, what: str, values: bool = True, exact: bool = True):
    a_flat, a_spec = tree_flatten(actual)
    e_flat, e_spec = tree_flatten(expected)
    assert a_spec == e_spec, f"{what}: structure {a_spec} != {e_spec}"
    for i, (a, e) in enumerate(zip(a_flat, e_flat)):
        label = f"{what} (leaf {i})"
        if _is_tensor(e):
            assert _is_tensor(a), f"{label}: got {type(a).__name__}, expected a tensor"
            if values and exact:
                torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{label}: {m}")
            elif values:
                torch.testing.assert_close(a, e, equal_nan=True, msg=lambda m: f"{label} (within rounding): {m}")
            else:
                assert (a.shape, a.dtype, a.stride()) == (e.shape, e.dtype, e.stride()), label
        else:
            assert a == e or (a != a and e != e), f"{label}: {a!r} != {e!r}"


def _sample_bytes(tree) -> int:
    return sum(t.untyped_storage().nbytes() for t in tree_flatten(tree)[0]
               if _is_tensor(t) and t.layout == torch.strided)


def _managed_run(op, sample, pristine, variant):
    """The managed run, under a budget raised (from fresh inputs) as long as it is too small."""
    if not _mode["tight_budget"]:
        tree = _copy(pristine, managed=True, grad=_grad_enabled(op, variant))
        if _mode["bring_in"]:
            for t in tree_flatten(tree)[0]:
                if isinstance(t, TensorRef):
                    t.toGPU()
        return _run(op, sample, tree, variant, managed=True)
    managed = max(2 * _sample_bytes(pristine), 64)  # (above what the device holds outside the manager)
    for _ in range(BUDGET_RETRIES):
        tree = _copy(pristine, managed=True, grad=_grad_enabled(op, variant))
        tensorsManager.budget = budget(managed)
        try:
            return _run(op, sample, tree, variant, managed=True)
        except OutOfBudgetError as e:
            del tree
            tensorsManager.budget = None
            managed = max(2 * managed, e.needed - e.outside)
    raise _StillOutOfBudget(f"still out of budget at {managed} bytes beside what is outside the manager")


class _StillOutOfBudget(AssertionError):
    """The managed run did not fit even the last budget tried (never plain torch's exception)."""


class _SubclassPath(TorchDispatchMode):
    """Plain torch as it runs for a tensor subclass.

    Some of torch's formulas branch on ``isTensorSubclassLike`` (``prod``'s backward avoids
    a data-dependent ``nonzero`` for subclasses), and the branches round differently. Under
    an active dispatch mode plain tensors take the subclass branch too.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _reference(op, sample, pristine, variant, subclass_path: bool = False):
    """Plain torch's result for the sample, or the exception it raised."""
    # A compressed sparse input stays a CPU tensor (only COO ones can be sim tensors), and
    # PyTorch refuses it beside sim tensors: such samples are compared with plain CPU torch on
    # "sim". On CUDA plain torch takes it beside CUDA tensors as the managed run has it, and
    # is the reference (it raises where CUDA has no kernel: sparse.mm's reduce, SparseCsrCUDA).
    compressed = any(_is_tensor(t) and t.layout not in (torch.strided, torch.sparse_coo)
                     for t in tree_flatten(pristine)[0])
    on_device = TEST_DEVICE.startswith("cuda") or not compressed
    _mode["reference_on_device"] = on_device
    with plain_torch() if on_device else torchTensorRef.disabled():
        tree = _copy(pristine, managed=False, grad=_grad_enabled(op, variant), on_device=on_device)
        try:
            if subclass_path:
                with _SubclassPath():
                    return _plain(_run(op, sample, tree, variant, managed=False))
            return _plain(_run(op, sample, tree, variant, managed=False))
        except Exception as e:
            return e
        finally:
            _mode["reference_on_device"] = True


def _compare_all(got, expected, values: bool, exact: bool = True):
    _compare(got[0], expected[0], "result", values, exact)
    _compare(got[1], expected[1], "inputs after the op", values, exact)  # out= of empty() stays uninitialized
    _compare(got[2], expected[2], "gradients or returned objects", values, exact)


def exact_on_test_device(op) -> bool:
    """Whether the managed run must equal plain torch bit for bit on the suite's device (not
    where plain CUDA torch adds with atomics: ``ATOMIC_SUMS_ON_CUDA``; nor where a sum the
    tight budget splits rounds apart: ``SPLIT_SUMS``, ``SPLIT_PRODUCTS``)."""
    if _mode["tight_budget"] and (op.name in SPLIT_SUMS or op.name in SPLIT_PRODUCTS):
        return False
    return not (_test_device().type == "cuda" and op.name in ATOMIC_SUMS_ON_CUDA)


def check_variant(op, sample, pristine, variant: str):
    """Assert the managed run of one variant on ``sample`` matches plain torch bit for bit.

    Returns plain torch's result (or the exception it raised).
    """
    expected = _reference(op, sample, pristine, variant)
    if isinstance(expected, Exception):  # plain torch rejects the sample: so must we
        try:
            _managed_run(op, sample, pristine, variant)
        except Exception as e:
            assert_same_exception(e, expected, variant)
        else:
            raise AssertionError(f"{variant}: plain torch raised {type(expected).__name__} ({expected}); "
                                 f"the managed run did not raise")
        return expected
    got = _managed_run(op, sample, pristine, variant)
    _check_managed(got[0], f"{variant}: result")
    _check_managed(got[2], f"{variant}: gradient or returned objects", zeros_may_escape=True)
    got = _plain(got)
    values = op.name not in UNINITIALIZED and not (variant == "out" and op.name in UNINITIALIZED_OUT
                                                     and _test_device().type != "cpu")
    exact = exact_on_test_device(op)
    try:
        _compare_all(got, expected, values, exact)
    except AssertionError:
        if not _reproducible(op, sample, pristine, variant, expected):
            # Plain torch gives other values each run (native_batch_norm's out= variant on a
            # non-contiguous input reads memory it did not write): only metadata can match.
            _compare_all(got, expected, values=False)
            return expected
        # Bit-identical to torch's subclass branch is a match too (see _SubclassPath).
        subclass_expected = _reference(op, sample, pristine, variant, subclass_path=True)
        try:
            assert not isinstance(subclass_expected, Exception)
            _compare_all(got, subclass_expected, values, exact)
        except AssertionError:
            _compare_all(got, expected, values, exact)  # report the difference from plain torch
    return expected


def assert_same_exception(got: BaseException, expected: BaseException, what: str) -> None:
    """``got`` has the very type of ``expected``, plain torch's exception (not a subclass: an
    ``OutOfBudgetError`` is a ``RuntimeError``), and is none of the package's own errors."""
    if type(got) is not type(expected) or isinstance(got, OWN_ERRORS):
        raise AssertionError(f"{what}: plain torch raised {type(expected).__name__} ({expected}); "
                             f"the managed run raised {type(got).__name__} ({got})") from got


def _reproducible(op, sample, pristine, variant, expected) -> bool:
    """Whether plain torch gives ``expected`` again, also once the memory its results are
    allocated from was last filled with something else (a result read from memory the op
    did not write repeats by chance when the allocator hands back the same bytes)."""
    for fill in (None, float("nan"), 7.0):
        if fill is not None:
            _refill_freed_memory(expected, fill)
        again = _reference(op, sample, pristine, variant)
        try:
            assert not isinstance(again, Exception)
            _compare_all(again, expected, values=True)
        except AssertionError:
            return False
    return True


def _refill_freed_memory(expected, fill):
    """Allocate tensors like the results in ``expected``, fill them and free them: the next
    allocations of these sizes get those bytes."""
    with torchTensorRef.disabled():
        leaves = [t for t in tree_flatten(expected)[0] if _is_tensor(t) and t.layout == torch.strided]
        junk = [torch.full(t.shape, fill if t.is_floating_point() or t.is_complex() else 7, dtype=t.dtype,
                           device=t.device) for t in leaves if t.numel()]
        del junk


def _out_templates(result):
    """Empty tensors to pass as ``out=`` (size 0, so the op must resize them), or ``None``."""
    with torchTensorRef.disabled():
        if _is_tensor(result) and result.layout == torch.strided:
            return torch.empty(0, dtype=result.dtype)
        if type(result) is tuple and result and all(_is_tensor(r) and r.layout == torch.strided for r in result):
            return tuple(torch.empty(0, dtype=r.dtype) for r in result)
    return None


def check_sample(op, sample):
    """Check the function variant (forward and backward), the in-place one and ``out=``."""
    with torchTensorRef.disabled():
        pristine = _copy((sample.input, sample.args, sample.kwargs), managed=False)
    expected = check_variant(op, sample, pristine, "function")
    if op.inplace_variant is not None and _is_tensor(sample.input):
        check_variant(op, sample, pristine, "inplace")
    if op.supports_out and not isinstance(expected, Exception):
        templates = _out_templates(expected[0])
        if templates is not None:
            check_variant(op, sample, pristine + (templates,), "out")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: ``pytest -n 2`` runs two workers on two cores, and the sweep's
    tensors are too small to gain from more (plain and managed runs use the same setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def mode(request, fresh_manager):
    """Set the manager up for one of ``MODES``."""
    name = request.param
    fresh_manager.strategy = "flow" if name in ("resident", "pass-through") else name
    if name == "pass-through":
        fresh_manager.device = "cpu"
    _mode.update(tight_budget=name in NAMES, bring_in=name == "resident")
    yield name
    _mode.update(tight_budget=True, bring_in=False)


@pytest.mark.parametrize("op, mode", _params(), indirect=["mode"])
def test_op_matches_plain_torch(op, mode):
    samples = _samples(op)
    assert samples, f"{op_id(op)} has no float32 sample inputs"
    for sample in samples:
        check_sample(op, sample)


# -- the sweep's own checks ----------------------------------------------------------------------

def test_a_package_error_is_not_the_exception_plain_torch_raised(fresh_manager):
    # Where plain torch raised a RuntimeError, any RuntimeError of the managed run passed as
    # "the same exception": OutOfBudgetError (from the budget setter, on CUDA) gave false passes.
    from torch.testing._internal.opinfo.core import SampleInput

    mm = next(op for op in SWEPT if op_key(op) == ("mm", ""))
    with torchTensorRef.disabled():
        sample = SampleInput(torch.randn(2, 3), args=(torch.randn(4, 5),))  # shapes mm refuses
        pristine = _copy((sample.input, sample.args, sample.kwargs), managed=False)
    check_variant(mm, sample, pristine, "function")  # the managed mm refuses them as plain torch does
    handle = fresh_manager.add_callback(before=lambda op: False)  # each managed op: OpVetoedError
    try:
        with pytest.raises(AssertionError, match="the managed run raised OpVetoedError"):
            check_variant(mm, sample, pristine, "function")
    finally:
        handle.remove()
    with pytest.raises(AssertionError, match="the managed run raised OutOfBudgetError"):
        assert_same_exception(OutOfBudgetError("aten.mm.default", 8, 4), RuntimeError("mm"), "function")
    with pytest.raises(AssertionError, match="the managed run raised _StillOutOfBudget"):
        assert_same_exception(_StillOutOfBudget("4 bytes"), AssertionError("op's own"), "function")
    assert_same_exception(RuntimeError("one message"), RuntimeError("another"), "function")  # same type


def test_a_cuda_reference_copies_storages_with_device_as_a_keyword(monkeypatch):
    # _on_test_device called untyped_storage().to(device): the argument is keyword-only on
    # every torch, so each reference on CUDA raised TypeError before plain torch ran.
    real_to = torch.UntypedStorage.to
    assert inspect.signature(real_to).parameters["device"].kind is inspect.Parameter.KEYWORD_ONLY
    asked = []

    def to(self, *, device, non_blocking=False):  # torch's signature; the bytes stay on the CPU here
        asked.append(torch.device(device))
        return real_to(self, device="cpu", non_blocking=non_blocking)

    monkeypatch.setattr(torch.UntypedStorage, "to", to)
    monkeypatch.setitem(globals(), "_test_device", lambda: torch.device("cuda", 0))
    with torchTensorRef.disabled():
        t = torch.arange(24.0).view(4, 6).t()[1:]  # strided, at an offset
        got = _on_test_device(t)
        assert asked == [torch.device("cuda", 0)]
        assert (got.shape, got.stride(), got.storage_offset()) == (t.shape, t.stride(), t.storage_offset())
        assert torch.equal(got, t)


def test_sums_made_with_atomics_on_cuda_compare_within_rounding_there_only(monkeypatch):
    # On an H200 the backward of cummax, cummin and upsample_bilinear differed from plain CUDA
    # torch's in the last bit: their kernels add with atomics, in no fixed order, so plain
    # torch's own runs differ too. There alone, and for such ops alone, rounding is allowed.
    [cummax] = [op for op in op_db if op.name == "cummax"]
    [add] = [op for op in op_db if op.name == "add"]
    expected = (torch.tensor([1.0, 2.0]), (), ())
    one_ulp = (torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()]), (), ())
    far = (torch.tensor([1.0, 2.001]), (), ())
    monkeypatch.setitem(globals(), "_test_device", lambda: torch.device("cuda", 0))
    assert not exact_on_test_device(cummax) and exact_on_test_device(add)
    _compare_all(one_ulp, expected, values=True, exact=False)
    with pytest.raises(AssertionError, match="within rounding"):
        _compare_all(far, expected, values=True, exact=False)
    with pytest.raises(AssertionError):
        _compare_all(one_ulp, expected, values=True, exact=True)
    monkeypatch.setitem(globals(), "_test_device", lambda: torch.device("cpu"))  # (as "sim": any but CUDA)
    assert exact_on_test_device(cummax)


# -- the rate and the table ---------------------------------------------------------------------

def match_rate():
    """(matched, swept): the swept ops minus the expected failures (on an accelerator), and the swept ops."""
    swept = {op_key(op) for op in SWEPT}
    return len(swept) - len(swept & (set(XFAILS) | set(ACCELERATOR_XFAILS))), len(swept)


def test_match_rate_is_at_least_required():
    matched, swept = match_rate()
    assert matched / swept >= REQUIRED_MATCH_RATE, f"{matched}/{swept} ops match plain torch"


def test_xfail_table_names_swept_ops_with_reasons():
    swept = {op_key(op) for op in SWEPT}
    tables = (XFAILS, PASS_THROUGH_XFAILS, ACCELERATOR_XFAILS)
    stale = sorted(set().union(*tables) - swept)
    assert not stale, f"expected failures for ops the sweep does not run: {stale}"
    assert all(isinstance(r, str) and r.strip() for table in tables for r in table.values())


if __name__ == "__main__":
    matched, swept = match_rate()
    print(f"{matched}/{swept} ops ({matched / swept:.1%}) match plain torch; {swept - matched} expected failures")
