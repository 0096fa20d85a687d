"""Room for every result before it exists: results whose size depends on the data get room
for an upper bound (Note [Data-dependent sizes]), and the budget holds for them too."""

from __future__ import annotations

import functools

import pytest
import torch

import torchTensorRef
from torchTensorRef import tensorsManager
from torchTensorRef.ops import output_size
from torchTensorRef.ops.output_size import _sizes_without_meta, estimate_output_bytes
from torchTensorRef.core.op_specs import spec_of
from torchTensorRef.strategies import NAMES

from conftest import TEST_DEVICE
from paired import assert_identical, budget, device_type, plain_torch, run_both

aten = torch.ops.aten

#: (op, arguments from a 1-d float tensor ``a`` and a boolean mask ``m`` of its shape)
DATA_DEPENDENT = [
    (aten.index.Tensor, lambda a, m: (a, [m])),
    (aten.masked_select.default, lambda a, m: (a, m)),
    (aten.nonzero.default, lambda a, m: (m,)),
    (aten.argwhere.default, lambda a, m: (m.view(2, -1),)),
    (aten._unique2.default, lambda a, m: (a, True, True, True)),
    (aten.unique_consecutive.default, lambda a, m: (a, True, True)),
    (aten.unique_dim.default, lambda a, m: (a.view(4, -1), 0, True, True, True)),
]


def _new_bytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.untyped_storage().nbytes()
    return sum(_new_bytes(o) for o in out)


@pytest.mark.parametrize("op, make", DATA_DEPENDENT, ids=[str(op) for op, _ in DATA_DEPENDENT])
@pytest.mark.parametrize("fill", ["random", "all true"])
def test_bound_holds_the_real_result(op, make, fill):
    with torchTensorRef.disabled():
        a = torch.randn(64)
        m = a > 0 if fill == "random" else torch.ones(64, dtype=torch.bool)
        args = make(a, m)
        real = _new_bytes(op(*args))
    bound = estimate_output_bytes(spec_of(op), args, {})
    assert real <= bound, f"{op}: {real} bytes > bound {bound}"
    assert bound <= 4 * max(real, 64 * 8) + 64 * 24  # a bound, not a refusal of every budget


@pytest.mark.parametrize("strategy", NAMES)
@pytest.mark.parametrize("select", [lambda a, m: a[m], lambda a, m: torch.masked_select(a, m),
                                    lambda a, m: torch.nonzero(m), lambda a, m: torch.unique(a)],
                         ids=["bool index", "masked_select", "nonzero", "unique"])
def test_data_dependent_results_stay_within_the_budget(strategy, select):
    # Two 32 KiB tensors and a mask used in a loop fill Flow's budget; the selection
    # used to be made room for only after it ran, 20% over the budget.
    tm = tensorsManager
    tm.strategy = strategy
    tm.budget = budget(80 * 1024)
    a, b = torch.randn(8192), torch.randn(8192)
    mask = a > 0
    for _ in range(10):
        (a * mask).sum()
        (b * mask).sum()
    tm.reset_stats()
    got = select(a, mask)
    stats = tm.stats()
    assert stats["peak_device_bytes"] <= tm.budget
    assert stats["worst_overshoot_bytes"] == 0
    with torchTensorRef.disabled():
        want = select(a.target.cpu(), mask.target.cpu())
        assert torch.equal(got.target.cpu(), want)


@pytest.mark.parametrize("strategy", NAMES)
@pytest.mark.parametrize("select", [lambda a, i: torch.bincount(i * 40), lambda a, i: torch.bincount(i * 40, a[:64]),
                                    lambda a, i: torch.repeat_interleave(i),
                                    lambda a, i: torch.repeat_interleave(a[:64].clone(), i)],
                         ids=["bincount", "bincount weights", "repeat_interleave", "repeat_interleave self"])
def test_results_sized_by_their_values_get_room_before_they_run(strategy, select):
    # bincount's length is the largest value plus one, repeat_interleave's the repeats' sum:
    # the bound reads them (as the kernels do) instead of making room after the op.
    tm = tensorsManager
    tm.strategy = strategy
    tm.budget = budget(96 * 1024)
    a, b = torch.randn(8192), torch.randn(8192)  # 32 KiB each
    counts = torch.randint(100, 120, (64,), generator=torch.Generator().manual_seed(0))
    for _ in range(10):
        (a * b).sum()
    a.toGPU(), b.toGPU(), counts.toGPU()  # 64.5 KiB resident: less than the result's room is left
    tm.reset_stats()
    got = select(a, counts)  # over 6,400 int64 (50 KiB) or 4,000 of them (31 KiB)
    stats = tm.stats()
    assert stats["peak_device_bytes"] <= tm.budget and stats["worst_overshoot_bytes"] == 0
    with torchTensorRef.disabled():
        want = select(a.target.cpu(), counts.target.cpu())
        if want.is_floating_point() and device_type() == "cuda":
            # (CUDA's bincount adds a bin's weights with atomics, in no fixed order: plain
            # CUDA torch's sums differ from the CPU's, and from run to run, in the last bits)
            torch.testing.assert_close(got.target.cpu(), want)
        else:
            assert torch.equal(got.target.cpu(), want)


def test_a_result_sized_by_its_values_past_the_budget_is_refused_before_it_runs():
    tm = tensorsManager
    tm.strategy = "flow"
    tm.budget = budget(4096)
    x = torch.tensor([2000])
    tm.reset_stats()
    with pytest.raises(torchTensorRef.OutOfBudgetError, match="aten.bincount"):
        torch.bincount(x)  # 2001 int64: 16008 bytes
    assert tm.stats()["worst_overshoot_bytes"] == 0 and tm.stats()["ops"] == 0
    tm.budget = None
    counts = torch.bincount(x)
    assert counts.shape == (2001,) and counts[2000].item() == 1 and counts.sum().item() == 1


def test_a_result_larger_than_its_meta_kernel_said_is_recorded_as_an_overshoot():
    # The safety net: a custom op whose meta kernel understates its result. The manager
    # makes room after it ran, and stats() says by how much the budget was passed.
    lib = torch.library.Library("torchTensorRef_test_sizes", "DEF")
    lib.define("grow(Tensor x, int n) -> Tensor")
    lib.impl("grow", lambda x, n: x.new_zeros(n), "CompositeExplicitAutograd")  # (every device)
    lib.impl("grow", lambda x, n: x.new_empty(1), "Meta")
    tm = tensorsManager
    tm.strategy = "genoa"
    tm.budget = budget(4096)
    x = torch.zeros(4)
    tm.reset_stats()
    grown = torch.ops.torchTensorRef_test_sizes.grow(x, 2000)  # 8000 bytes
    stats = tm.stats()
    assert stats["worst_overshoot_bytes"] > 0
    assert stats["worst_overshoot_bytes"] == stats["peak_device_bytes"] - 4096
    tm.reset_stats()
    assert tm.stats()["worst_overshoot_bytes"] == 0
    # Its next call with the same shapes is sized by that run (Note [Sizes known after the
    # op]): refused before it runs, as it cannot fit, and with room, within the budget.
    with pytest.raises(torchTensorRef.OutOfBudgetError, match="grow"):
        torch.ops.torchTensorRef_test_sizes.grow(x, 2000)
    assert tm.stats()["worst_overshoot_bytes"] == 0
    tm.budget = budget(12 * 1024)
    again = torch.ops.torchTensorRef_test_sizes.grow(x, 2000)
    assert tm.stats()["worst_overshoot_bytes"] == 0
    tm.budget = None
    assert grown.shape == again.shape == (2000,) and grown.sum().item() == again.sum().item() == 0


_RESERVE = 24 * 1024


@functools.lru_cache(maxsize=None)  # (defined once a process: the manager knows ops by identity)
def _library_op(name: str, zeros_ok: bool = True, meta: bool = True):
    """A custom op ``(x * 2, a uint8 reserve of n bytes)`` as cuDNN's RNN returns one: its
    meta kernel (if any) gives the reserve no bytes; without ``zeros_ok`` its kernel refuses
    all-zero inputs (so that running it on host zeros cannot size it)."""
    lib = torch.library.Library(name, "DEF")
    lib.define("reserve(Tensor x, int n) -> (Tensor, Tensor)")

    def kernel(x, n):
        if not zeros_ok and not bool((x != 0).any()):
            raise RuntimeError("not on zeros")
        return x * 2, x.new_zeros(n, dtype=torch.uint8)

    lib.impl("reserve", kernel, "CompositeExplicitAutograd")  # (every device)
    if meta:
        lib.impl("reserve", lambda x, n: (torch.empty_like(x), x.new_empty(0, dtype=torch.uint8)), "Meta")
    return lib, getattr(torch.ops, name).reserve.default


def _plain_results(op) -> list:
    """The op's results from plain torch on the test device (moved to the host)."""
    with plain_torch():
        return [r.cpu() for r in op(torch.arange(1, 1025, dtype=torch.float32), _RESERVE)]


def _held_resident(tm, strategy: str):
    """Four 16 KiB tensors used once, and an input of 4 KiB, under an 80 KiB budget."""
    tm.strategy = strategy
    tm.budget = budget(80 * 1024)
    held = [torch.full((4096,), float(i + 1)) for i in range(4)]
    x = torch.arange(1, 1025, dtype=torch.float32)
    for t in held:
        t.add_(0)
    return held, x


def _call_in_budget(tm, op, held, x, expected):
    """The op after the held tensors were used again, its results plain torch's
    (``expected``); its evictions, with no overshoot."""
    for t in held:
        t.add_(0)
    before = tm.stats()["evictions"]
    results = op(x, _RESERVE)
    assert tm.stats()["worst_overshoot_bytes"] == 0
    assert_identical(expected, [r.cpu() for r in results])
    return tm.stats()["evictions"] - before


@pytest.mark.parametrize("strategy", NAMES)
def test_results_only_the_kernel_can_size_get_all_the_room_then_what_they_took(strategy):
    # As cuDNN's RNN, whose reserve for its backward its meta kernel sizes at 0 bytes: the
    # op's first call with given shapes keeps all the room the budget leaves beside its own
    # blocks, the later ones what that call's results took (Note [Sizes known after the op]).
    tm = tensorsManager
    _lib, op = _library_op(f"torchTensorRef_test_reserve_{strategy}")  # (each its own: sizes are kept)
    output_size.sized_after_the_op(op)
    expected = _plain_results(op)
    held, x = _held_resident(tm, strategy)
    first = _call_in_budget(tm, op, held, x, expected)
    second = _call_in_budget(tm, op, held, x, expected)
    if strategy == "flow":  # (Genoa keeps nothing resident between ops)
        assert first == len(held)  # all the room: every other block went
        assert second < first  # the reserve's 24 KiB and the result's 4 KiB only


def test_an_op_no_kernel_can_size_ahead_is_sized_by_its_runs():
    # No meta kernel, and a kernel that refuses the host zeros sizing would run it on (as a
    # CUDA-only op has no host kernel): its estimate was 0 and its results passed the budget.
    tm = tensorsManager
    _lib, op = _library_op("torchTensorRef_test_no_kernel", zeros_ok=False, meta=False)
    expected = _plain_results(op)
    held, x = _held_resident(tm, "flow")
    first = _call_in_budget(tm, op, held, x, expected)
    second = _call_in_budget(tm, op, held, x, expected)
    assert first == len(held) and second < first


@pytest.mark.skipif(TEST_DEVICE != "sim", reason="the simulated device's CPU kernel: CUDA builds have none")
def test_an_op_with_no_meta_kernel_is_sized_on_host_zeros():
    # The simulated device's fused GRU cell has a CPU kernel and no meta kernel: its results
    # (hy and a workspace five times its size) are sized by running it once on zeros.
    op = aten._thnn_fused_gru_cell.default
    with torchTensorRef.disabled():
        gates, hx = torch.randn(3, 15), torch.randn(3, 5)
        with pytest.raises(Exception):
            op(*(t.to("meta") for t in (gates, gates, hx)))
        real = _new_bytes(op(gates, gates, hx))
    assert real == 6 * 3 * 5 * 4
    # (each result as the device's allocator gives it: with CUDA's rounding, 512 bytes each)
    sizes = tensorsManager.block_bytes(3 * 5 * 4) + tensorsManager.block_bytes(5 * 3 * 5 * 4)
    assert estimate_output_bytes(spec_of(op), (gates, gates, hx), {}) == sizes


def test_a_random_op_is_never_run_to_size_it():
    # Running it would advance the generator: plain torch's next random numbers would differ.
    op = aten.normal.Tensor_Tensor
    assert torch.Tag.nondeterministic_seeded in op.tags
    with torchTensorRef.disabled():
        mean, std = torch.zeros(4), torch.ones(4)
        torch.manual_seed(0)
        assert _sizes_without_meta(spec_of(op), (mean, std), {}) == 0
        after_estimate = torch.rand(1)
        torch.manual_seed(0)
        assert torch.equal(torch.rand(1), after_estimate)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_an_out_variant_s_growth_follows_its_written_tensor_on_every_call():
    # The size after the op is cached by shapes; the growth depends on the written tensor's
    # storage now, so the same call with a smaller, then a large enough `out` estimates apart.
    spec = spec_of(aten.add.out)
    a, b = torch.randn(1024), torch.randn(1024)
    small, large = torch.empty(0), torch.empty(2048)
    assert estimate_output_bytes(spec, (a, b), {"out": small}) == 4096
    assert estimate_output_bytes(spec, (a, b), {"out": small}) == 4096  # (cached)
    assert estimate_output_bytes(spec, (a, b), {"out": torch.empty(512)}) == 2048  # (it grows by half)
    assert estimate_output_bytes(spec, (a, b), {"out": large}) == 0


def test_creation_sizes_are_cached_by_their_arguments_and_stay_right(fresh_manager):
    tm = fresh_manager
    tm.strategy = "flow"
    tm.budget = budget("1MiB")
    for n in (24, 24, 25, 1000, 24):
        x = torch.arange(0, n)
        assert (x.proxyInfo.device.split(":")[0] == device_type() and x.numel() == n
                and x.untyped_storage().nbytes() == 8 * n)
        assert torch.equal(x.cpu(), torch.arange(0, n, device="cpu"))
    big = torch.arange(0, 2**20)  # 8 MiB: past the budget, so made in host memory
    assert big.proxyInfo.device == "cpu" and tm.stats()["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("loss", ["mse_loss", "smooth_l1_loss", "soft_margin_loss", "binary_cross_entropy"])
@pytest.mark.parametrize("pager", ["flow", "genoa"])
def test_a_small_result_viewing_a_large_buffer_keeps_only_its_bytes(loss, pager):
    # Fixed: these losses' CPU kernels return the mean as a 0-dim view of the unreduced loss;
    # the block kept all 4000 bytes where 4 had been made room for: 3000 bytes past the budget.
    fn = getattr(torch.nn.functional, loss)

    def run():
        a, b = torch.rand(1000), torch.rand(1000)
        tensorsManager.budget = budget(9000)  # a, b and a scalar
        tensorsManager.reset_stats()
        out = fn(a, b)
        return out, out.untyped_storage().nbytes(), tensorsManager.stats()["peak_device_bytes"]

    tensorsManager.strategy = pager
    plain, managed = run_both(run)
    tensorsManager.budget = None
    assert_identical(plain[0], managed[0])
    assert managed[1] == 4 and managed[2] <= 9000


def test_batch_norm_out_is_sized_by_its_results():
    # (its meta kernel leaves the out tensors as given, the kernel gives them new storage: the
    # budget held both for a moment, 520 bytes above it in the OpInfo sweep's tight budget)
    op = torch.ops.aten._native_batch_norm_legit.out
    with torchTensorRef.disabled():
        x, stats = torch.randn(5, 5, 5), [torch.ones(5) for _ in range(4)]
        outs = {"out": torch.empty(5, 5, 5), "save_mean": torch.empty(5), "save_invstd": torch.empty(5)}
    assert estimate_output_bytes(spec_of(op), (x, *stats, True, 0.1, 1e-5), outs) >= 500 + 2 * 20


def test_a_result_sharing_its_input_s_storage_allocates_nothing(fresh_manager):
    # ``_unsafe_view`` returns a view although its schema does not say so: the logits of a
    # large vocabulary larger than half the room were refused, counted twice.
    from torchTensorRef.core.op_specs import spec_of
    from torchTensorRef.ops.output_size import estimate_output_bytes

    aten = torch.ops.aten
    x = torch.randn(32, 1000)
    assert estimate_output_bytes(spec_of(aten._unsafe_view.default), (x, [2, 16, 1000]), {}) == 0
    assert estimate_output_bytes(spec_of(aten.clone.default), (x,), {}) == fresh_manager.block_bytes(32 * 1000 * 4)


def test_a_result_laid_out_like_an_input_with_gaps_is_sized_by_its_strides():
    # select_scatter's result keeps its input's strides, gaps included. Sizes were cached by
    # shape and dtype alone: after a contiguous call, a call on a strided view reused its
    # 500 bytes for a result of 996 (the OpInfo sweep on CUDA overshot the budget).
    op = torch.ops.aten.select_scatter.default
    with torchTensorRef.disabled():
        dense = torch.zeros(5, 5, 5)
        gaps = torch.zeros(250).as_strided((5, 5, 5), (50, 10, 2), 1)
        src = torch.zeros(5, 5)
        real = op(gaps, src, 1, 2).untyped_storage().nbytes()
    size = tensorsManager.block_bytes  # (as the device's allocator gives it)
    assert estimate_output_bytes(spec_of(op), (dense, src, 1, 2), {}) == size(500)
    assert size(real) >= estimate_output_bytes(spec_of(op), (gaps, src, 1, 2), {}) >= size(996)


def test_an_op_that_aliases_or_copies_is_sized_by_what_it_does():
    # ``to``, ``reshape`` and ``contiguous`` say their result aliases the argument; they copy
    # where they must. On inference tensors they reach the manager undecomposed: ``to`` of
    # another dtype was sized as nothing, and generate() under inference_mode passed the budget.
    size = tensorsManager.block_bytes
    with torchTensorRef.disabled():
        ids = torch.zeros(1, 5, dtype=torch.bool)
        gaps = torch.zeros(4, 6)[:, :3]
    assert estimate_output_bytes(spec_of(aten.to.dtype), (ids, torch.int64), {}) == size(40)
    assert estimate_output_bytes(spec_of(aten.to.dtype), (ids, torch.bool), {}) == 0  # (itself)
    assert estimate_output_bytes(spec_of(aten.reshape.default), (gaps, [12]), {}) == size(48)
    assert estimate_output_bytes(spec_of(aten.reshape.default), (gaps, [4, 3]), {}) == 0  # (a view)
    assert estimate_output_bytes(spec_of(aten.contiguous.default), (gaps,), {}) == size(48)


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["sum", "mean", "max"])
def test_embedding_bag_is_sized_to_hold_its_four_results(mode):
    # Its meta kernel laid out the bookkeeping results as the CPU's kernel does not (no
    # max_indices in sum mode, one offset2bag element fewer): the OpInfo sweep passed the
    # budget by a block with the allocator's rounding.
    op = aten._embedding_bag.default
    with torchTensorRef.disabled():
        weight, indices, offsets = torch.randn(10, 5), torch.tensor([0, 2, 4, 5, 4]), torch.tensor([0, 3])
        args = (weight, indices, offsets, False, mode, False, None)
        real = sum(tensorsManager.block_bytes(o.untyped_storage().nbytes()) for o in op(*args))
    assert estimate_output_bytes(spec_of(op), args, {}) >= real
