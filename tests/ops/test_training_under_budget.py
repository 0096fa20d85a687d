"""Ops larger than the budget run in pieces (``ops/split.py``), and a training step whose
optimizer state does not fit gives plain torch's parameters on the same device.

Each test makes its tensors and runs the plain reference (plain torch on the managed
tensors' device) before it sets the budget: the budget covers the plain tensors the
device holds, and a random tensor larger than the budget cannot be made under it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math

import pytest
import torch

import torchTensorRef
from torchTensorRef import HostBudgetError, OutOfBudgetError, TensorRef, strategies
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.ops import split_handlers
from paired import budget, device_type, plain_torch

aten = torch.ops.aten
ROWS, DIM = 512, 64  # a 128 KiB table
ROOM = 48 * 1024  # less than the table: every test below needs pieces


def _plain(t):
    if isinstance(t, TensorRef):
        t = t.target
    with torchTensorRef.disabled():
        return t.detach().cpu().clone()


def _assert_product_pieces_equal(got, expected, inner: int):
    """The pieces of a matrix product against one call, within what two orders of summing
    ``inner`` products may part by: ``inner`` roundings of the largest result. The BLAS picks
    its kernel (and how it blocks the inner dimension) by the shape it is given, on the CPU
    as on CUDA (docs/concepts.md): tiles of an fp32 product differ from one call in their
    last bits for some shapes, and a wrong tile would be off by far more."""
    atol = inner * torch.finfo(expected.dtype).eps * float(expected.abs().max())
    torch.testing.assert_close(_plain(got), expected, rtol=0, atol=atol)


def _pair(*shape, seed=0):
    """A managed tensor and the plain one of the same values on its device."""
    torch.manual_seed(seed)
    managed = torch.randn(*shape)
    with plain_torch():
        torch.manual_seed(seed)
        plain = torch.randn(*shape)
    return managed, plain


def _tighten(tm, room=ROOM):
    """Set the budget ``room`` above what the device holds now (the plain reference's tensors)."""
    tm.budget = budget(room)
    tm.reset_stats()


@pytest.fixture(params=strategies.NAMES)
def tight(request, fresh_manager):
    """The manager under each strategy; the test sets the budget with ``_tighten``."""
    fresh_manager.strategy = request.param
    yield fresh_manager
    assert fresh_manager.budget is not None, "the test did not set the budget"
    assert fresh_manager.stats()["peak_device_bytes"] <= fresh_manager.budget


def test_embedding_reads_only_its_rows_and_its_backward_fits(tight):
    w, pw = _pair(ROWS, DIM)
    w.requires_grad_(True)
    pw = pw.detach().requires_grad_(True)
    with plain_torch():
        pids = torch.tensor([[3, 7, 3, 500], [0, 7, 9, 11]])
        pout = torch.nn.functional.embedding(pids, pw, padding_idx=7)
        (pout * 2).sum().backward()
        expected, expected_grad = pout.detach().cpu(), pw.grad.cpu()
    ids = torch.tensor([[3, 7, 3, 500], [0, 7, 9, 11]])
    _tighten(tight)
    out = torch.nn.functional.embedding(ids, w, padding_idx=7)
    (out * 2).sum().backward()
    assert torch.equal(_plain(out), expected)
    assert torch.equal(_plain(w.grad), expected_grad)
    # the forward read 6 rows, not the table
    assert tight.stats()["bytes_to_device"] < 3 * ROWS * DIM * 4


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_an_embedding_that_fits_reads_its_rows_alone_with_no_gradient_to_record(tight, grad):
    # Note [Rows of a table]: the table fits the budget, but a few rows of it are all the op
    # needs; with a gradient to record the table is read whole, as a training step does.
    rows = split_handlers.ROWS_MIN_TABLE // (DIM * 4)  # (the smallest table read by rows)
    w, pw = _pair(rows, DIM)
    w.requires_grad_(grad)
    with plain_torch():
        pids = torch.tensor([[3, 7, 3, rows - 1], [0, 7, 9, 11]])
        expected = torch.nn.functional.embedding(pids, pw).cpu()
    ids = torch.tensor([[3, 7, 3, rows - 1], [0, 7, 9, 11]])
    table = rows * DIM * 4
    _tighten(tight, 2 * table)
    tight.move_to_host(w)  # (as a table evicted to make room for others)
    with torch.no_grad() if not grad else contextlib.nullcontext():
        out = torch.nn.functional.embedding(ids, w)
        again = torch.nn.functional.embedding(ids, w)  # (the table's device copy, if made, is used)
    assert torch.equal(_plain(out), expected) and torch.equal(_plain(again), expected)
    moved = tight.stats()["bytes_to_device"]
    assert moved < table / 4 if not grad else moved >= table


def test_rows_of_a_stacked_weight_larger_than_the_budget_are_read_alone(tight):
    # A mixture-of-experts layer decoding by ``batched_mm`` gathers the experts it routes
    # tokens to from a parameter stacking every expert's weight (``w[expert_ids]``): under a
    # budget below the stack, the experts named come to the device alone. (Its backward, a
    # gradient as large as the stack, is not split: docs/compatibility.md.)
    experts, rows, cols = 16, 64, 32  # (a 128 KiB stack, above the 64 KiB of room)
    w, pw = _pair(experts, rows, cols)
    with plain_torch():
        expected = pw[torch.tensor([5, 1, 5, 7], dtype=torch.int32)].cpu()
    ids = torch.tensor([5, 1, 5, 7], dtype=torch.int32)
    _tighten(tight, 64 * 1024)
    out = w[ids]
    assert torch.equal(_plain(out), expected)
    assert tight.stats()["bytes_to_device"] < 4 * rows * cols * 4  # (three experts, not sixteen)


def test_rows_of_a_stacked_weight_whose_result_does_not_fit_are_gathered_on_the_host(tight):
    # A batch of tokens each gathering its experts: the rows named and the result (a copy of
    # an expert per token) are more than the room, which the stack itself exceeds. The
    # gather runs on the host into a result held there; the product that reads it next runs
    # in batch groups.
    experts, rows, cols = 16, 64, 32  # (a 128 KiB stack; 8 KiB an expert)
    w, pw = _pair(experts, rows, cols)
    x, px = _pair(8, 1, rows, seed=1)
    ids = [5, 1, 5, 7, 2, 3, 9, 11]  # (seven experts, 56 KiB, and a 64 KiB result)
    with plain_torch():
        gathered = pw[torch.tensor(ids)]
        expected, expected_product = gathered.cpu(), torch.bmm(px, gathered).cpu()
    _tighten(tight, 64 * 1024)
    out = w[torch.tensor(ids)]
    assert torch.equal(_plain(out), expected)
    assert torch.equal(_plain(torch.bmm(x, out)), expected_product)


@pytest.mark.parametrize("room", [32, 64], ids=["short", "enough"])  # (KiB beside the stack)
def test_a_gather_on_the_host_keeps_its_result_under_a_host_budget(tight, monkeypatch, tmp_path, room):
    # The gather's result, made before its stack was read back from disk, was the host
    # tier's victim when that read made room (a strategy may pick any host copy no op
    # holds): its host copy went, and the gather wrote into nothing ("has no host copy").
    # Held while written, it stays: the stack and the result fit the host budget together,
    # or the op is refused saying so.
    experts, rows, cols = 16, 64, 32  # (a 128 KiB stack; a 64 KiB result)
    w, pw = _pair(experts, rows, cols)
    ids = torch.tensor([5, 1, 5, 7, 2, 3, 9, 11])
    with plain_torch():
        expected = pw[ids.to(pw.device)].cpu()
    _tighten(tight, 64 * 1024)
    monkeypatch.setattr(tight.strategy, "choose_host_victim",
                        lambda candidates, _index: max(candidates, key=lambda b: b.id, default=None))
    tight.offload_dir = tmp_path
    tight.evict_all()
    gc.collect()
    held = sum(b.nbytes for b in tight.host_tier.hosted.values() if b.host_shared or b.external)
    tight.host_budget = held
    tight.synchronize()  # (the stack is on disk only)
    tight.host_budget = held + (128 + room) * 1024 + 1024  # (and the indices)
    try:
        out = w[ids]
    except HostBudgetError:
        assert room < 64, "the stack and the result fit the host budget together"
    else:
        assert torch.equal(_plain(out), expected)
    finally:
        tight.host_budget = None


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_rows_of_a_stacked_weight_that_fits_are_read_alone_with_no_gradient_to_record(tight, grad):
    # Note [Rows of a table], for ``index``: a stack of ``ROWS_MIN_TABLE`` bytes fits the
    # budget, but the two experts a token is routed to are all the op needs.
    experts, cols = 16, 64
    rows = split_handlers.ROWS_MIN_TABLE // (experts * cols * 4)
    w, pw = _pair(experts, rows, cols)
    w.requires_grad_(grad)
    with plain_torch():
        expected = pw[torch.tensor([9, 2])].detach().cpu()
    stack = experts * rows * cols * 4
    _tighten(tight, 2 * stack)
    tight.move_to_host(w)  # (as a stack evicted to make room for other layers)
    with torch.no_grad() if not grad else contextlib.nullcontext():
        out = w[torch.tensor([9, 2])]
    assert torch.equal(_plain(out), expected)
    moved = tight.stats()["bytes_to_device"]
    assert (moved < stack / 4 if not grad else moved >= stack), moved


@pytest.mark.parametrize("ids", [[-1, 2], [3, 8]], ids=["from the end", "out of bounds"])
def test_rows_of_a_stacked_weight_named_from_the_end_or_out_of_bounds_are_as_plain_torch(tight, ids):
    w, pw = _pair(8, 64, 32)
    with plain_torch():
        try:
            expected = pw[torch.tensor(ids)].cpu()
        except IndexError as e:
            expected = e
    _tighten(tight, 4 * 64 * 1024)  # (the stack fits: it comes in whole, as plain torch reads it)
    if isinstance(expected, IndexError):
        with pytest.raises(IndexError):
            w[torch.tensor(ids)]
    else:
        assert torch.equal(_plain(w[torch.tensor(ids)]), expected)


@pytest.mark.parametrize("which", ["weight_t", "rows"])
def test_mm_in_tiles_equals_one_call(tight, which):
    w, pw = _pair(ROWS, DIM)
    x, px = _pair(8, DIM, seed=1)
    if which == "weight_t":  # logits = x @ W.T: tiles of W's rows
        with plain_torch():
            expected = (px @ pw.t()).cpu()
        _tighten(tight)
        out = x @ w.t()
    else:  # W @ v: tiles of W's rows as the output's rows
        with plain_torch():
            expected = (pw @ px.t()).cpu()
        _tighten(tight)
        out = w @ x.t()
    assert torch.equal(_plain(out), expected)


@pytest.mark.parametrize("which", ["columns", "rows"])
def test_addmm_in_tiles_equals_one_call(tight, which):
    # A Linear with a bias on a 2-D input is an addmm: refused as unsplittable where its
    # weight and activations did not fit together, while the same product without bias ran
    # in tiles.
    w, pw = _pair(ROWS, DIM)
    bias, pbias = _pair(ROWS if which == "columns" else DIM, seed=2)
    x, px = _pair(8 if which == "columns" else ROWS, DIM, seed=1)
    if which == "columns":  # x @ W.T + b: tiles of W's rows, each with its part of the bias
        with plain_torch():
            expected = torch.nn.functional.linear(px, pw, pbias).cpu()
        _tighten(tight)
        out = torch.nn.functional.linear(x, w, bias)
    else:  # W @ v + b over a tall W: tiles of W's rows as the output's rows, the bias whole
        small, psmall = _pair(DIM, DIM, seed=3)
        with plain_torch():
            expected = torch.addmm(pbias, pw, psmall).cpu()
        _tighten(tight)
        out = torch.addmm(bias, w, small)
    _assert_product_pieces_equal(out, expected, inner=DIM)


def test_elementwise_in_chunks_equals_one_call(tight):
    a, pa = _pair(ROWS, DIM)
    b, pb = _pair(ROWS, DIM, seed=1)
    with plain_torch():
        pa.add_(pb, alpha=0.5)
        pa.mul_(1.25)
        expected = pa.cpu()
    _tighten(tight)
    a.add_(b, alpha=0.5)
    a.mul_(1.25)
    assert torch.equal(_plain(a), expected)


def test_division_and_subtraction_in_chunks_equal_one_call(tight):
    # peft's RandLoRA normalizes its random bases by their std (``a / a.std()``, a 0-d
    # divisor): the division was refused two bytes over a budget its tensors met alone.
    a, pa = _pair(ROWS, DIM)
    b, pb = _pair(ROWS, DIM, seed=1)
    std = a.std()  # (a reduction, not split: taken before the budget)
    with plain_torch():
        expected = [(pa / pa.std()).cpu(), (pa - pb).cpu()]
        pa.sub_(pb)
        expected.append(pa.cpu())
    _tighten(tight)
    got = [a / std, a - b]
    a.sub_(b)
    got.append(a)
    for g, e in zip(got, expected):
        assert torch.equal(_plain(g), e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["mul", "div", "add", "sub", "rsub", "mul_", "div_", "add_", "sub_"])
def test_arithmetic_with_a_number_in_chunks_equals_one_call(tight, op, dtype):
    # GPT-2's activation backward multiplies a gradient larger than a small budget by a
    # number (``mul.Scalar``, as autograd's formulas call it): refused where ``mul.Tensor``,
    # what Python's ``t * 0.5`` calls, ran in chunks.
    overload = getattr(torch.ops.aten, op).Scalar
    a, pa = _pair(ROWS, DIM)
    a = a.to(dtype)
    with plain_torch():
        pa = pa.to(dtype)
        expected = overload(pa, 0.7).cpu()
    _tighten(tight)
    assert torch.equal(_plain(overload(a, 0.7)), expected)


@pytest.mark.parametrize("case", ["outer", "rows", "columns", "in place", "leading one", "two dims",
                                  "two dims in place"])
def test_broadcasting_elementwise_ops_in_rows_equal_one_call(tight, case):
    # diffusers' SD3 makes its 2-d sin-cos position embedding with ``torch.outer`` (a ``mul``
    # of (M, 1) by (D,)): a result larger than the budget was refused as unsplittable.
    col, pcol = _pair(ROWS, 1)
    row, prow = _pair(DIM, seed=1)
    big, pbig = _pair(ROWS, DIM, seed=2)
    ops = {"outer": lambda c, r, b: torch.outer(c.view(-1), r),
           "rows": lambda c, r, b: b - r,
           "columns": lambda c, r, b: torch.div(c, b),
           "in place": lambda c, r, b: b.add_(r.view(1, -1), alpha=0.5).mul_(c),
           "leading one": lambda c, r, b: b.view(1, ROWS, DIM) * r.view(1, 1, DIM),
           # (positions over two dims, cut as one; a whole tensor of the result's rank)
           "two dims": lambda c, r, b: b.view(2, ROWS // 2, DIM) + c.view(2, ROWS // 2, 1),
           "two dims in place": lambda c, r, b: b.view(2, ROWS // 2, DIM).mul_(r.view(1, 1, DIM))}
    with plain_torch():
        expected = ops[case](pcol, prow, pbig)
        layout = (expected.shape, expected.stride())
        expected = expected.cpu()
    _tighten(tight)
    got = ops[case](col, row, big)
    assert isinstance(got, TensorRef) and (got.shape, got.stride()) == layout
    assert torch.equal(_plain(got), expected)


def test_a_broadcast_over_a_transposed_tensor_equals_one_call(tight):
    # (the transposed rows are not ranges of its bytes: refused, until the op was cut in
    # the order of its result's dimensions, laid out as the transposed tensor)
    big, pbig = _pair(DIM, ROWS)
    row, prow = _pair(DIM, seed=1)
    with plain_torch():
        expected = pbig.t() * prow
        layout = (expected.shape, expected.stride())
    _tighten(tight)
    got = big.t() * row
    assert (got.shape, got.stride()) == layout
    assert torch.equal(_plain(got), expected.cpu())


@pytest.mark.parametrize("case", ["masked_fill", "masked_fill_", "where", "relu", "clamp", "maximum", "compare",
                                  "neg", "relu backward"])
def test_exact_elementwise_ops_larger_than_the_budget_in_pieces_equal_one_call(tight, case):
    # (eager attention masks its scores: at a small budget the scores did not fit; OPT's
    # ReLU backward, ``threshold_backward``, met a gradient larger than the budget)
    scores, pscores = _pair(2, 4, ROWS // 8, DIM)
    bound, pbound = _pair(DIM, seed=1)
    with plain_torch():
        pmask = torch.ones(ROWS // 8, DIM, dtype=torch.bool).tril().view(1, 1, ROWS // 8, DIM)
    mask = torchTensorRef.manage(pmask.cpu())
    ops = {"masked_fill": lambda s, m, b: s.masked_fill(m, float("-inf")),
           "masked_fill_": lambda s, m, b: s.masked_fill_(~m, -1e4),
           "where": lambda s, m, b: torch.where(m, s, b),
           "relu": lambda s, m, b: torch.relu(s),
           "clamp": lambda s, m, b: s.clamp(-0.5, 0.5),
           "maximum": lambda s, m, b: torch.maximum(s, b),
           "compare": lambda s, m, b: s > b,
           "neg": lambda s, m, b: -s,
           "relu backward": lambda s, m, b: torch.ops.aten.threshold_backward(s, s * 2, 0.0)}
    with plain_torch():
        expected = ops[case](pscores, pmask, pbound)
        layout = (expected.shape, expected.stride(), expected.dtype)
        expected = expected.cpu()
    _tighten(tight)
    got = ops[case](scores, mask, bound)
    assert isinstance(got, TensorRef) and (got.shape, got.stride(), got.dtype) == layout
    assert torch.equal(_plain(got), expected)


@pytest.mark.parametrize("case", ["masked_fill", "masked_fill_", "where", "add", "transposed"])
def test_a_mask_given_whole_beside_scores_larger_than_the_budget_per_head_equals_one_call(tight, case):
    # (a hybrid model's chunked scan masks scores of shape (1, heads, 1, L, L) with an (L, L)
    # mask: one head's scores, the mask and one head's result did not fit, and the mask
    # varies along the rows where the cut by heads stops: refused)
    scores, pscores = _pair(1, 2, 1, ROWS // 4, ROWS // 4)
    bias, pbias = _pair(ROWS // 4, ROWS // 4, seed=1)
    with plain_torch():
        pmask = torch.ones(ROWS // 4, ROWS // 4, dtype=torch.bool).tril()
    mask = torchTensorRef.manage(pmask.cpu())
    ops = {"masked_fill": lambda s, m, b: s.masked_fill(m, float("-inf")),
           "masked_fill_": lambda s, m, b: s.masked_fill_(~m, -1e4),
           "where": lambda s, m, b: torch.where(m, s, b),
           "add": lambda s, m, b: s + b,
           # (a scan's product of a transposed view and a contiguous tensor: its result is
           # laid out as the view, each row of positions a window of the other's bytes)
           "transposed": lambda s, m, b: s.transpose(1, 3) * s.transpose(1, 3).contiguous()}
    with plain_torch():
        expected = ops[case](pscores, pmask, pbias)
        layout = (expected.shape, expected.stride(), expected.dtype)
        expected = expected.cpu()
    _tighten(tight)
    got = ops[case](scores, mask, bias)
    assert isinstance(got, TensorRef) and (got.shape, got.stride(), got.dtype) == layout
    assert torch.equal(_plain(got), expected)
    if case == "masked_fill_":
        assert got is scores


@pytest.mark.parametrize("dim", [1, -1])
def test_a_cat_along_an_inner_dimension_in_rows_equals_one_call(tight, dim):
    # (SD3's sin-cos embedding joins two halves side by side: refused at a budget below it)
    left, pleft = _pair(2, ROWS, DIM // 2)
    right, pright = _pair(2, ROWS, DIM // 4, seed=1)
    empty, pempty = _pair(0)  # (a 1-d empty tensor, which cat passes by)
    with plain_torch():
        expected = torch.cat([pleft, pempty, pright], dim=dim + (dim > 0)).cpu()
    _tighten(tight)
    got = torch.cat([left, empty, right], dim=dim + (dim > 0))
    assert isinstance(got, TensorRef) and got.shape == expected.shape and got.is_contiguous()
    assert torch.equal(_plain(got), expected)


@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_a_stack_larger_than_the_budget_equals_one_call(tight, dim):
    # (a Cohere's rotary embedding stacks its halves on a last dimension: refused at a tenth
    # of its weights)
    first, pfirst = _pair(ROWS, DIM // 2)
    second, psecond = _pair(ROWS, DIM // 2, seed=1)
    with plain_torch():
        expected = torch.stack([pfirst, psecond], dim=dim).cpu()
    _tighten(tight)
    got = torch.stack([first, second], dim=dim)
    assert isinstance(got, TensorRef) and (got.shape, got.stride()) == (expected.shape, expected.stride())
    assert torch.equal(_plain(got), expected)


@pytest.mark.parametrize("case", ["rows", "batch-of-one", "mixed-dtypes", "channels-last"])
def test_a_cat_along_its_outer_dimension_larger_than_the_budget_equals_one_call(tight, case):
    # outputs gathered batch by batch (``torch.cat(outputs)``) larger than the budget were refused
    shape = {"batch-of-one": (1, 1, ROWS, DIM // 2), "channels-last": (2, 16, 16, 16)}.get(case, (ROWS // 2, DIM))
    dim = 2 if case == "batch-of-one" else 0  # (along a dimension that only ones precede)
    top, ptop = _pair(*shape)
    bottom, pbottom = _pair(*shape, seed=1)
    empty, pempty = _pair(0)  # (a 1-d empty tensor, which cat passes by)
    if case == "mixed-dtypes":  # (promoted as one call promotes)
        bottom, pbottom = bottom.half(), pbottom.half()
    if case == "channels-last":  # (the result laid out as one call lays it out)
        top, ptop, bottom, pbottom = (t.to(memory_format=torch.channels_last) for t in (top, ptop, bottom, pbottom))
    with plain_torch():
        expected = torch.cat([ptop, pempty, pbottom, ptop], dim=dim)
    _tighten(tight)
    got = torch.cat([top, empty, bottom, top], dim=dim)
    assert isinstance(got, TensorRef)
    assert (got.shape, got.stride(), got.dtype) == (expected.shape, expected.stride(), expected.dtype)
    assert torch.equal(_plain(got), expected.cpu())
    assert torch.equal(_plain(got * 2), expected.cpu() * 2)  # (a host result, brought in by the next op)


@pytest.mark.parametrize("case", ["a sequence to a multiple", "every side with a value", "cropped"])
def test_a_pad_larger_than_the_budget_equals_one_call(tight, case):
    # (a Falcon-H1's scan pads its sequence to a multiple of its chunk: the pad was refused
    # where the tensor and its result did not fit together)
    x, px = _pair(1, ROWS // 4, 2, DIM)
    pads, value = {"a sequence to a multiple": ((0, 0, 0, 0, 0, 100), 0.0),
                   "every side with a value": ((1, 2, 0, 1, 3, 4), -2.5),
                   "cropped": ((-3, 2, 1, -1, 0, 9), 1.0)}[case]
    with plain_torch():
        expected = torch.nn.functional.pad(px, pads, value=value)
        layout = (expected.shape, expected.stride())
    _tighten(tight)
    got = torch.nn.functional.pad(x, pads, value=value)
    assert isinstance(got, TensorRef) and (got.shape, got.stride()) == layout and got.numel() * 4 > ROOM
    assert torch.equal(_plain(got), expected.cpu())
    assert torch.equal(_plain(got * 2), expected.cpu() * 2)  # (a host result, brought in by the next op)
    assert torch.equal(_plain(x), px.cpu())


@pytest.mark.parametrize("case", ["slices", "a select", "a slice to the end"])
def test_the_backward_of_a_part_larger_than_the_budget_equals_plain_torch(tight, case):
    # (the gradient of projections split from one product, a Mamba's ``in_proj``: zeros of
    # the whole with the part's gradient in its place, refused where it did not fit)
    x, px = _pair(ROWS, DIM)
    parts = {"slices": lambda t: (t[100:400:3] * 2).sum() + (t[:, 5:9] * 3).sum(),  # (two, summed)
             "a select": lambda t: t[7] * 3,
             "a slice to the end": lambda t: t[:, 60:].exp()}[case]
    with plain_torch():
        px.requires_grad_(True)
        parts(px).sum().backward()
        expected = px.grad.cpu()
    _tighten(tight)
    x.requires_grad_(True)
    parts(x).sum().backward()
    assert (x.grad.shape, x.grad.stride()) == (expected.shape, expected.stride())
    assert torch.equal(_plain(x.grad), expected)


def test_transposed_tensors_in_chunks_equal_one_call(tight):
    # A weight used several times gets its gradients summed, each a transpose (a Linear's);
    # the sum was refused as unsplittable: pieces were cut for contiguous tensors only.
    a, pa = _pair(ROWS, DIM)
    b, pb = _pair(ROWS, DIM, seed=1)
    with plain_torch():
        expected = pa.t() + pb.t()
        expected_stride = expected.stride()
        expected = expected.cpu()
        mixed = pa.t().contiguous()
    _tighten(tight)
    got = a.t() + b.t()
    assert got.stride() == expected_stride  # (laid out as plain torch lays it out)
    assert torch.equal(_plain(got), expected)
    a.t().mul_(2)  # (in place, through the transposed view)
    with plain_torch():
        pa.t().mul_(2)
        expected_a = pa.cpu()
    assert torch.equal(_plain(a), expected_a)
    with plain_torch():  # (laid out differently: its pieces gathered, the result laid out as the first)
        expected = pa.t() + mixed
        expected_layout = (expected.shape, expected.stride())
    got = a.t() + torchTensorRef.manage(mixed.cpu())
    assert (got.shape, got.stride()) == expected_layout
    assert torch.equal(_plain(got), expected.cpu())


def test_a_small_transposed_tensor_repeated_larger_than_the_budget_equals_one_call(tight):
    # A Falcon-H1's scan repeats a transposed projection for each head
    # (``repeat_interleave``: a clone of a broadcast view whose positions interleave in its
    # bytes); the clone was refused as unsplittable, though its input is small.
    small, psmall = _pair(1, DIM, 16)  # (4 KiB: its positions, along 16, interleave)
    ops = (lambda t: t.transpose(1, 2).unsqueeze(2).repeat_interleave(DIM, dim=2, output_size=DIM),
           lambda t: t.transpose(1, 2).expand(DIM, -1, -1).contiguous())  # (its positions all one)
    with plain_torch():
        expected = [op(psmall) for op in ops]
        layouts = [(e.shape, e.stride()) for e in expected]
        expected = [e.cpu() for e in expected]
    _tighten(tight)
    for op, want, layout in zip(ops, expected, layouts):
        got = op(small)
        assert (got.shape, got.stride()) == layout and got.numel() * 4 > ROOM
        assert torch.equal(_plain(got), want)
    assert torch.equal(_plain(small), psmall.cpu())


@pytest.mark.parametrize("case", ["times a contiguous tensor", "plus a bias", "with a scalar tensor"])
def test_an_elementwise_result_laid_out_as_a_permuted_operand_equals_one_call(tight, case):
    # (plain torch lays the result out as its first operand, here with its two outer
    # dimensions swapped: a Falcon-H1's scan; the op was refused, its result not contiguous)
    base, pbase = _pair(ROWS // 8, 8, DIM)
    other, pother = _pair(8, ROWS // 8, DIM, seed=1)
    bias, pbias = _pair(DIM, seed=2)
    scalar, pscalar = _pair((), seed=3)
    ops = {"times a contiguous tensor": lambda x, o, b, s: x * o,
           "plus a bias": lambda x, o, b, s: torch.add(x, b, alpha=0.5),
           "with a scalar tensor": lambda x, o, b, s: torch.maximum(x, s)}
    with plain_torch():
        expected = ops[case](pbase.transpose(0, 1), pother, pbias, pscalar)
        layout = (expected.shape, expected.stride())
    assert not expected.is_contiguous()
    _tighten(tight)
    got = ops[case](base.transpose(0, 1), other, bias, scalar)
    assert (got.shape, got.stride()) == layout
    assert torch.equal(_plain(got), expected.cpu())
    assert torch.equal(_plain(base), pbase.cpu())


def test_a_corner_of_each_matrix_of_a_large_tensor_in_pieces_equals_one_call(tight):
    # (MiniMax's linear attention multiplies a corner of each head's decay matrix: a piece
    # was sized at the step between its positions, a whole matrix, not at the bytes it
    # spans, and the op was refused)
    big, pbig = _pair(2, ROWS // 2, DIM)  # (each matrix 64 KiB, more than the room)
    small, psmall = _pair(2, 6, 6, seed=1)
    with plain_torch():
        expected = (psmall * pbig[:, :6, :6]).cpu()
    _tighten(tight)
    got = small * big[:, :6, :6]
    assert torch.equal(_plain(got), expected)
    assert torch.equal(_plain(big), pbig.cpu())


def test_foreach_position_larger_than_budget_in_chunks(tight):
    (a, b), (pa, pb) = zip(_pair(ROWS, DIM), _pair(ROWS, DIM, seed=1))
    small, psmall = _pair(16)
    with plain_torch():
        aten._foreach_lerp_.Scalar([psmall, pa], [psmall, pb], 0.25)
        proots = aten._foreach_mul.Scalar([pa], 3.0)
        pmaxima = aten._foreach_max.default([psmall, pa])
    _tighten(tight)
    aten._foreach_lerp_.Scalar([small, a], [small, b], 0.25)
    roots = aten._foreach_mul.Scalar([a], 3.0)
    maxima = aten._foreach_max.default([small, a])
    assert torch.equal(_plain(a), pa.cpu())
    assert torch.equal(_plain(roots[0]), proots[0].cpu())
    assert [float(_plain(m)) for m in maxima] == [float(m.cpu()) for m in pmaxima]


def test_norm_of_a_tensor_larger_than_budget(tight):
    a, pa = _pair(ROWS, DIM)
    with plain_torch():
        expected = torch.linalg.vector_norm(pa).cpu()
    _tighten(tight)
    norms = aten._foreach_norm.Scalar([a], 2)
    whole = torch.linalg.vector_norm(a)
    # chunks' norms combined: the same value up to rounding (one kernel sums in another order)
    torch.testing.assert_close(_plain(norms[0]), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(_plain(whole), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("make", ["zeros_like", "empty_like", "ones_like", "full_like", "new_zeros", "new_full"])
def test_a_fill_larger_than_the_budget_is_made_on_the_host(tight, make):
    # (AdamW's moments of a table larger than the budget: zeros_like was refused outright)
    w, pw = _pair(ROWS, DIM)
    calls = {"zeros_like": lambda t: torch.zeros_like(t), "empty_like": lambda t: torch.empty_like(t).fill_(3),
             "ones_like": lambda t: torch.ones_like(t), "full_like": lambda t: torch.full_like(t, 2.5),
             "new_zeros": lambda t: t.new_zeros(t.shape), "new_full": lambda t: t.new_full(t.shape, -1.0)}
    with plain_torch():
        expected = calls[make](pw).add_(pw).cpu()
    _tighten(tight)
    made = calls[make](w)
    assert isinstance(made, TensorRef) and made.device == w.device
    assert made.shape == w.shape and made.stride() == w.stride() and made.dtype == w.dtype
    made.add_(w)  # used as a moment is: in chunks that fit
    assert torch.equal(_plain(made), expected)


def test_a_random_fill_larger_than_the_budget_is_still_refused(tight):
    # (its bits come from the device's generator, which a host copy would not reproduce)
    w, _ = _pair(ROWS, DIM)
    _tighten(tight)
    with pytest.raises(OutOfBudgetError, match="rand_like"):
        torch.rand_like(w)


def test_what_cannot_be_split_names_the_op_and_a_budget(fresh_manager):
    a, _ = _pair(ROWS, DIM)
    b, _ = _pair(DIM, ROWS, seed=1)
    fresh_manager.budget = budget(ROOM)
    with pytest.raises(OutOfBudgetError, match=r"aten\.mm\.default.*a budget of \d+ bytes runs it"):
        a @ b  # both operands larger than the room: only a split of the sum would do


def _llama(vocab=512):
    from transformers import LlamaConfig, LlamaForCausalLM
    import transformers

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=vocab,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=1, eos_token_id=None, pad_token_id=0)
    with torchTensorRef.disabled():
        torch.manual_seed(0)
        return LlamaForCausalLM(config)


def _reference_then_managed(plain, train):
    """The parameters plain torch gives after ``train`` on a copy of ``plain`` on the test
    device, and a managed copy of ``plain`` to train the same way."""
    with plain_torch():
        ref = copy.deepcopy(plain).to(device_type())
        train(ref)
        expected = [p.detach().cpu() for p in ref.parameters()]
    del ref
    with torchTensorRef.disabled():
        model = copy.deepcopy(plain)
    return expected, torchTensorRef.manage(model)


def _train(model, ids, steps=2, accumulate=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            model(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # (a chunked norm is not bit-exact)
        opt.step()
        sched.step()


@pytest.mark.parametrize("accumulate", [1, 2], ids=["one", "accumulated"])
@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_llama_adamw_steps_equal_plain_torch(fresh_manager, monkeypatch, fraction, accumulate):
    regions = getattr(torchTensorRef, "regions", None)
    if regions is not None:
        monkeypatch.setattr(regions, "enabled", False)  # the per-op path is what is tested here
    plain = _llama()
    with torchTensorRef.disabled():
        ids = torch.randint(2, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    expected, model = _reference_then_managed(
        plain, lambda ref: _train(ref, ids.to(device_type()), accumulate=accumulate))
    wbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    # at 100% one position of AdamW (the 128 KiB embedding, its gradient and two moments) does not fit
    fresh_manager.budget = budget(int(fraction * wbytes))
    fresh_manager.reset_stats()
    _train(model, torchTensorRef.manage(ids.clone()), accumulate=accumulate)
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(_plain(p), e)
    assert fresh_manager.stats()["peak_device_bytes"] <= fresh_manager.budget


def test_conversions_and_copies_in_chunks_equal_one_call(tight):
    # (.float() of a table larger than the budget, and a bf16 copy of an fp32 master, were refused)
    w, pw = _pair(ROWS, DIM)
    with plain_torch():
        phalf = pw.to(torch.bfloat16)
        pagain = phalf.float().clone()
        phalf.copy_(pw * 0.5)
    _tighten(tight)
    half = w.to(torch.bfloat16)
    again = half.float().clone()
    with torch.no_grad():
        half.copy_(w * 0.5)
    assert torch.equal(_plain(again), pagain.cpu())
    assert torch.equal(_plain(half), phalf.cpu())


def test_a_conversion_of_an_inference_tensor_in_chunks_equals_one_call(tight):
    # Under inference_mode ``to`` reaches the manager undecomposed (``to.dtype``,
    # ``to.dtype_layout``): a table's conversion larger than the room was refused.
    torch.manual_seed(0)
    with torch.inference_mode():
        w = torch.randn(ROWS, DIM)
    with plain_torch(), torch.inference_mode():
        torch.manual_seed(0)
        pw = torch.randn(ROWS, DIM)
        expected = [pw.to(torch.bfloat16).cpu(), pw.to(dtype=torch.float64).cpu()]
    _tighten(tight)
    with torch.inference_mode():
        got = [w.to(torch.bfloat16), aten.to.dtype_layout(w, dtype=torch.float64, device=w.device)]
    for g, e in zip(got, expected):
        assert g.device == w.device and torch.equal(_plain(g), e)
    # a ``to`` that converts nothing returns its argument, as plain torch's: never a copy
    with torch.inference_mode(), pytest.raises(OutOfBudgetError, match="aten.to.dtype"):
        w.to(torch.float32)  # (the table alone is larger than the room)
    _tighten(tight, room=1 << 20)
    with torch.inference_mode():  # (its block: the same bytes)
        assert block_of(w.to(torch.float32)) is block_of(w)
        assert block_of(w.to(torch.float32, copy=True)) is not block_of(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_softmax_and_its_backward_in_rows_equal_one_call(tight, dtype):
    # (the logits of a large vocabulary: each row is computed alone, so chunks of rows give one call's bits)
    x, px = _pair(64, ROWS)
    x, px = x.to(dtype).requires_grad_(True), px.to(dtype).requires_grad_(True)
    g, pg = _pair(64, ROWS, seed=2)
    with plain_torch():
        py = torch.log_softmax(px.float(), -1)
        py.backward(pg)
    _tighten(tight)
    y = torch.log_softmax(x.float(), -1)
    y.backward(g)
    assert torch.equal(_plain(y), py.detach().cpu())
    assert torch.equal(_plain(x.grad), px.grad.cpu())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_over_a_vocabulary_larger_than_the_budget_equals_one_call(tight, reduction):
    # nll_loss_forward and nll_loss_backward were refused: the logits of a large vocabulary
    # (a 2-layer Llama's at 50% of its weights) did not fit, and nothing split them
    x, px = _pair(64, ROWS)
    x.requires_grad_(True)
    px.requires_grad_(True)
    target = torch.randint(0, ROWS, (64,), generator=torch.Generator().manual_seed(3))
    target[::7] = -100  # (ignored rows, as a causal language model's padding)
    with plain_torch():
        ploss = torch.nn.functional.cross_entropy(px, target.to(px.device), reduction=reduction)
        ploss.sum().backward()
    _tighten(tight)
    loss = torch.nn.functional.cross_entropy(x, torchTensorRef.manage(target), reduction=reduction)
    loss.sum().backward()
    assert torch.equal(_plain(loss), ploss.detach().cpu())
    assert torch.equal(_plain(x.grad), px.grad.cpu())


def test_a_class_weighted_nll_loss_larger_than_the_budget_is_refused_saying_why(tight):
    x, px = _pair(64, ROWS)
    weight = torch.rand(ROWS)
    target = torchTensorRef.manage(torch.randint(0, ROWS, (64,)))
    _tighten(tight)
    with pytest.raises(OutOfBudgetError, match="cannot be split"):
        torch.nn.functional.nll_loss(x, target, weight=weight)
    tight.reset_stats()


def test_safe_softmax_in_rows_equals_one_call(tight):
    # scaled_dot_product_attention's math path on masked rows: refused as larger than the budget
    x, px = _pair(64, ROWS)
    with plain_torch():
        py = aten._safe_softmax.default(px, -1)
    _tighten(tight)
    y = aten._safe_softmax.default(x, -1)
    assert torch.equal(_plain(y), py.cpu())


@pytest.mark.parametrize("op", ["bmm", "baddbmm", "baddbmm-broadcast"])
def test_batched_products_larger_than_the_budget_in_batch_groups_equal_one_call(tight, op):
    # attention's scores (bmm, baddbmm) larger than the budget were refused
    a, pa = _pair(16, 32, 48)
    b, pb = _pair(16, 48, 40, seed=1)
    bias, pbias = _pair(1 if op.endswith("broadcast") else 16, 32, 40, seed=2)
    run = ((lambda a, b, bias: torch.bmm(a, b)) if op == "bmm"
           else (lambda a, b, bias: torch.baddbmm(bias, a, b, beta=0.5, alpha=2.0)))
    with plain_torch():
        expected = run(pa, pb, pbias)
    _tighten(tight, room=64 * 1024)
    got = run(a, b, bias)
    assert tight.stats()["peak_device_bytes"] < 2 * 16 * 32 * 40 * 4
    _assert_product_pieces_equal(got, expected.cpu(), inner=48)


@pytest.mark.parametrize("case", ["scores", "scores-bias-rows", "use", "wide-b", "broadcast-bias-columns",
                                  "use-of-sliced-values"])
def test_a_batch_element_larger_than_the_budget_runs_in_tiles_equal_to_one_call(tight, case):
    # one attention element larger than the budget (a 5.4 MiB score matrix at 4 MiB) was
    # refused: batched products were cut only between batch elements
    heads, n, d = 2, 192, 16
    q, pq = _pair(heads, n, d)
    k, pk = _pair(heads, n, d, seed=1)
    if case == "scores":  # q @ k^T: k transposed, tiles of the scores' rows
        run = lambda q, k: torch.bmm(q, k.transpose(1, 2))  # noqa: E731
    elif case == "scores-bias-rows":  # a mask added per row and column, scaled
        mask, pmask = _pair(heads, n, n, seed=2)
        run = lambda q, k: torch.baddbmm(  # noqa: E731
            mask if isinstance(q, TensorRef) else pmask, q, k.transpose(1, 2), beta=0.5, alpha=0.25)
    elif case == "use":  # softmax(scores) @ v: tiles of the scores' rows, v whole
        p, pp = _pair(heads, n, n, seed=3)
        run = lambda q, k: torch.bmm(p if isinstance(q, TensorRef) else pp, k)  # noqa: E731
    elif case == "use-of-sliced-values":  # diffusers' attention slicing: one head's values, a
        # view of all heads' (a block larger than the room), were brought in whole
        p, pp = _pair(1, n, n, seed=3)
        v, pv = _pair(16, n, d, seed=4)
        run = lambda q, k: torch.bmm(*((p, v[1:2]) if isinstance(q, TensorRef) else (pp, pv[1:2])))  # noqa: E731
    elif case == "wide-b":  # q^T-like: the second operand the larger, tiles of its columns
        w, pw = _pair(heads, d, 2 * n, seed=4)
        run = lambda q, k: torch.bmm(k, w if isinstance(q, TensorRef) else pw)  # noqa: E731
    else:  # a bias of one row broadcast over rows and batch, cut by columns
        w, pw = _pair(heads, d, 2 * n, seed=4)
        bias, pbias = _pair(1, 1, 2 * n, seed=5)
        run = lambda q, k: torch.baddbmm(  # noqa: E731
            bias if isinstance(q, TensorRef) else pbias, k, w if isinstance(q, TensorRef) else pw)
    with plain_torch():
        expected = run(pq, pk).cpu()
    _tighten(tight, room=n * n * 4 // 2)  # (half of one element's output)
    got = run(q, k)
    assert tight.stats()["peak_device_bytes"] < n * n * 4
    _assert_product_pieces_equal(got, expected, inner=n if case.startswith("use") else d)


#: activations and transcendental functions (Note [Cuts of host kernels]): a shape larger than
#: the room, and than threads x 32,768 elements (at most four threads: ``few_threads``), of an
#: odd size: a whole call's ranges on several threads are then not multiples of its vectors
ROUNDED_SHAPE = (641, 509)


@pytest.fixture
def few_threads():
    """At most four of the host's threads (a host kernel's whole call on more threads is cut
    into ranges whose ends this shape's size no longer fixes: the op is refused there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, 4))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("op", ["gelu", "gelu-tanh", "silu", "sigmoid", "sin", "exp", "pow", "silu_"])
def test_activations_larger_than_the_budget_in_chunks_equal_one_call(tight, few_threads, op):
    # a UNet's GEGLU at 256 KiB (gelu), SD3's sin-cos position embedding (sin) were refused
    run = {"gelu": torch.nn.functional.gelu, "gelu-tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
           "silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid, "sin": torch.sin, "exp": torch.exp,
           "pow": lambda x: x.abs() ** 1.7, "silu_": lambda x: torch.nn.functional.silu(x, inplace=True)}[op]
    x, px = _pair(*ROUNDED_SHAPE)
    with plain_torch():
        expected = run(px).cpu()
    _tighten(tight, room=256 * 1024)
    got = run(x)
    assert torch.equal(_plain(got), expected)
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_an_activations_backward_larger_than_the_budget_equals_one_call(tight, few_threads, approximate):
    # a UNet trained at a quarter of its weights stopped at gelu_backward
    x, px = _pair(*ROUNDED_SHAPE)
    g, pg = _pair(*ROUNDED_SHAPE, seed=1)
    x.requires_grad_(True)
    px.requires_grad_(True)
    with plain_torch():
        torch.nn.functional.gelu(px, approximate=approximate).backward(pg)
    _tighten(tight, room=512 * 1024)
    torch.nn.functional.gelu(x, approximate=approximate).backward(g)
    assert torch.equal(_plain(x.grad), px.grad.cpu())


def test_an_activations_backward_in_chunks_of_a_few_vectors_equals_one_call(tight):
    # torch.func's per-sample gradients of a small MLP at half its weights: gelu_backward of
    # 256 float32 elements with room for 64 of each tensor was refused (its chunks had to be
    # multiples of 128 elements, the step of the narrowest type, not of float32's 32)
    x, px = _pair(8, 32)
    g, pg = _pair(8, 32, seed=1)
    with plain_torch():
        expected = aten.gelu_backward(pg, px).cpu()
    _tighten(tight, room=3 * tight.block_bytes(64 * 4) + 64)
    got = aten.gelu_backward(g, x)
    assert torch.equal(_plain(got), expected)


def test_a_gated_activation_of_half_a_projection_larger_than_the_budget_equals_one_call(tight, few_threads):
    # diffusers' GEGLU: gelu of one half of a projection (a view laid out otherwise than its
    # gradient) times the other; cut in rows, whose count (a multiple of 12) puts the whole
    # call's thread ranges between rows on up to four threads
    rows, width = 1200, 100
    x, px = _pair(rows, 2 * width)
    g, pg = _pair(rows, width, seed=1)
    x.requires_grad_(True)
    px.requires_grad_(True)

    def geglu(x):
        hidden, gate = x.chunk(2, dim=-1)
        return hidden * torch.nn.functional.gelu(gate, approximate="tanh")

    with plain_torch():
        py = geglu(px)
        py.backward(pg)
    _tighten(tight, room=512 * 1024)
    y = geglu(x)
    y.backward(g)
    assert torch.equal(_plain(y), py.detach().cpu())
    assert torch.equal(_plain(x.grad), px.grad.cpu())


@pytest.mark.parametrize("case", ["conv2d", "bias-stride-padding", "channels-last", "conv1d", "grouped",
                                  "depthwise", "depthwise-channels-last"])
def test_a_convolution_larger_than_the_budget_in_groups_of_channels_equals_one_call(tight, case):
    # a UNet's convolutions at 256 KiB (diffusers' own tests) were refused; grouped ones
    # (a ConvNeXt's depthwise, peft's tests of a grouped Conv2d) too
    conv = torch.nn.functional.conv1d if case == "conv1d" else torch.nn.functional.conv2d
    groups = {"grouped": 4, "depthwise": 32, "depthwise-channels-last": 32}.get(case, 1)
    shape, filters = ((2, 32, 128), (96, 32, 3)) if case == "conv1d" else ((2, 32, 16, 16), (96, 32 // groups, 3, 3))
    x, px = _pair(*shape)
    w, pw = _pair(*filters, seed=1)
    b, pb = _pair(96, seed=2)
    if case.endswith("channels-last"):
        x, px, w, pw = (t.to(memory_format=torch.channels_last) for t in (x, px, w, pw))
    kwargs = {"stride": 2, "padding": 1} if case == "bias-stride-padding" else {"padding": 1}
    kwargs["groups"] = groups
    bias = case != "conv2d"
    with plain_torch():
        expected = conv(px, pw, pb if bias else None, **kwargs)
    _tighten(tight, room=96 * 1024)
    got = conv(x, w, b if bias else None, **kwargs)
    assert got.stride() == expected.stride()  # (channels last stays channels last)
    _assert_product_pieces_equal(got, expected.cpu(), inner=w.shape[1] * math.prod(w.shape[2:]))
    assert tight.stats()["peak_device_bytes"] < sum(t.numel() * 4 for t in (x, w, got))


@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
def test_a_group_norm_larger_than_the_budget_in_groups_of_samples_equals_one_call(tight, layout):
    # a UNet's GroupNorm at 256 KiB (diffusers' own tests) was refused
    x, px = _pair(6, 32, 16, 16)
    w, pw = _pair(32, seed=1)
    b, pb = _pair(32, seed=2)
    if layout == "channels-last":
        x, px = x.to(memory_format=torch.channels_last), px.to(memory_format=torch.channels_last)
    # (torch.group_norm gives the op its input contiguous: in the input's own layout on the
    # CPU, in the standard one on CUDA, whose kernel refuses any other, plain torch's too)
    nx, npx = (x.contiguous(), px.contiguous()) if device_type() == "cuda" else (x, px)
    with plain_torch():
        expected = [t.cpu() for t in aten.native_group_norm(npx, pw, pb, 6, 32, 256, 8, 1e-5)]
        expected_strides = aten.native_group_norm(npx, pw, pb, 6, 32, 256, 8, 1e-5)[0].stride()
    _tighten(tight, room=96 * 1024)
    got = aten.native_group_norm(nx, w, b, 6, 32, 256, 8, 1e-5)
    assert got[0].stride() == expected_strides
    assert all(torch.equal(_plain(g), e) for g, e in zip(got, expected))
    with torch.no_grad():  # (as a module computes it)
        assert torch.equal(_plain(torch.nn.functional.group_norm(x, 8, w, b)), expected[0])
    assert tight.stats()["peak_device_bytes"] < 2 * x.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_layer_norm_larger_than_the_budget_in_groups_of_batch_elements_equals_one_call(tight, dtype):
    # OPT's, BERT's and StarCoder2's LayerNorm on 4 x 30 positions at 15% of their weights was refused
    x, px = _pair(6, 30, 64)
    w, pw = _pair(64, seed=1)
    b, pb = _pair(64, seed=2)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    with plain_torch():
        px, pw, pb = px.to(dtype), pw.to(dtype), pb.to(dtype)
        expected = [t.cpu() for t in aten.native_layer_norm(px, [64], pw, pb, 1e-5)]
    _tighten(tight, room=12 * 1024 * x.element_size())  # (its input and output do not fit together)
    got = aten.native_layer_norm(x, [64], w, b, 1e-5)
    assert [(g.shape, g.dtype) for g in got] == [(e.shape, e.dtype) for e in expected]
    assert all(torch.equal(_plain(g), e) for g, e in zip(got, expected))
    with torch.no_grad():  # (as a module computes it)
        assert torch.equal(_plain(torch.nn.functional.layer_norm(x, [64], w, b)), expected[0])


@pytest.mark.parametrize("case", ["conv2d", "no-bias", "channels-last", "conv1d", "weights-only", "input-only",
                                  "grouped", "depthwise", "causal-depthwise-conv1d"])
def test_a_convolution_backward_larger_than_the_budget_in_groups_of_channels_equals_one_call(tight, case):
    # a gated linear attention's short depthwise conv1d (lara_mini) at 25% of its weights was
    # refused in its backward; one group: its weight's gradient by output channels, its
    # input's by input channels
    conv = torch.nn.functional.conv1d if "conv1d" in case else torch.nn.functional.conv2d
    groups = {"grouped": 4, "depthwise": 32, "causal-depthwise-conv1d": 32}.get(case, 1)
    shape, filters = ((2, 32, 16, 16), (96 // (1 if groups == 1 else 3), 32 // groups, 3, 3))
    if "conv1d" in case:
        shape, filters = (2, 32, 256), (filters[0], filters[1], 4 if groups > 1 else 3)
    x, px = _pair(*shape)
    w, pw = _pair(*filters, seed=1)
    b, pb = _pair(filters[0], seed=2)
    if case == "channels-last":
        x, px, w, pw = (t.to(memory_format=torch.channels_last) for t in (x, px, w, pw))
    kwargs = {"stride": 2 if groups == 1 else 1, "padding": 3 if case.startswith("causal") else 1, "groups": groups}
    grads = {"weights-only": (False, True, True), "input-only": (True, False, False)}.get(case, (True, True, True))
    bias = case != "no-bias"
    leaves = [(t, p) for t, p, g in zip((x, w, b), (px, pw, pb), grads) if g and (t is not b or bias)]
    for t, p in leaves:
        t.requires_grad_(True)
        p.requires_grad_(True)
    with plain_torch():
        py = conv(px, pw, pb if bias else None, **kwargs)
        pg = torch.randn(py.shape, generator=torch.Generator().manual_seed(3)).to(py.device)
        py.backward(pg)
    y = conv(x, w, b if bias else None, **kwargs)
    g = torch.randn(py.shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_plain(y), py.detach().cpu())  # (the forward fits: the backward alone is cut)
    # (one group: room for the input or the output's gradient whole, and a few channels)
    room = max(x.numel(), y.numel()) * 4 + 16 * 1024 if groups == 1 else (x.numel() + y.numel()) * 2
    _tighten(tight, room=room)
    y.backward(g)
    batch_positions = y.numel() // y.shape[1]
    for t, p in leaves:
        inner = batch_positions if t is not x else w.shape[0] // groups * math.prod(w.shape[2:])
        assert t.grad.stride() == p.grad.stride()  # (channels last stays channels last)
        _assert_product_pieces_equal(t.grad, p.grad.cpu(), inner=inner)

@pytest.mark.parametrize("dims,keepdim,case", [
    ((-1,), False, "contiguous"), ((3,), True, "contiguous"), ((0, 2), False, "transposed"),
    ((-1, 1), False, "float64"), ((1,), False, "transposed")])
def test_a_sum_along_dimensions_larger_than_the_budget_in_slices_of_a_dimension_it_keeps(tight, dims, keepdim, case):
    # a Mamba-2 scan's ``(C * B).sum(-1)`` larger than a small budget (Falcon-H1) was refused;
    # the outermost dimension it keeps (past the batch of one) is cut
    x, px = _pair(1, 6, 8, 16, 32)
    if case == "transposed":
        x, px = x.transpose(2, 3), px.transpose(2, 3)
    kwargs = {"dtype": torch.float64} if case == "float64" else {}
    with plain_torch():
        expected = px.sum(dims, keepdim=keepdim, **kwargs)
    _tighten(tight)
    got = x.sum(dims, keepdim=keepdim, **kwargs)
    assert (got.shape, got.dtype, got.stride()) == (expected.shape, expected.dtype, expected.stride())
    # (each value sums the same elements as one call; the kernel may order the additions by
    # the shape it is given, as with a product's tiles)
    _assert_product_pieces_equal(got, expected.cpu(), inner=x.numel() // expected.numel())
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


@pytest.mark.parametrize("dim,case", [(-2, "contiguous"), (-1, "transposed"), (1, "contiguous"), (0, "float64")])
def test_a_cumsum_larger_than_the_budget_in_slices_of_another_dimension(tight, dim, case):
    # a Mamba-2 scan's segment sums at its default chunk (a cumsum over an L x L mask per
    # head and chunk) was refused under a small budget (Falcon-H1, Nemotron-H)
    x, px = _pair(1, 6, 8, 16, 32)
    if case == "transposed":
        x, px = x.transpose(2, 3), px.transpose(2, 3)
    kwargs = {"dtype": torch.float64} if case == "float64" else {}
    with plain_torch():
        expected = px.cumsum(dim, **kwargs)
    _tighten(tight)
    got = x.cumsum(dim, **kwargs)
    assert (got.shape, got.dtype, got.stride()) == (expected.shape, expected.dtype, expected.stride())
    _assert_product_pieces_equal(got, expected.cpu(), inner=x.shape[dim])
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


@pytest.mark.parametrize("dims,case", [((-1,), "contiguous"), ((1, 3), "transposed"), ((0, 1), "contiguous")])
def test_a_flip_larger_than_the_budget_in_slices_of_a_dimension_it_keeps(tight, dims, case):
    # a scan run backwards over a sequence larger than a small budget (Nemotron-H) was refused
    x, px = _pair(1, 6, 8, 16, 32)
    if case == "transposed":
        x, px = x.transpose(2, 3), px.transpose(2, 3)
    with plain_torch():
        expected = px.flip(dims)
    _tighten(tight)
    got = x.flip(dims)
    assert (got.shape, got.stride()) == (expected.shape, expected.stride())
    assert torch.equal(_plain(got), expected.cpu())  # (copies)
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


@pytest.mark.parametrize("op", ["cumsum", "sum", "flip"])
def test_a_sum_whose_slices_of_the_outer_kept_dimension_do_not_fit_is_cut_along_the_next(tight, op):
    # (a Falcon-H1's segment sums, (1, heads, 1, L, L) along -2 at a quarter of its weights:
    # one head's L x L and its result did not fit, and the cumsum was refused)
    x, px = _pair(1, 2, 1, ROWS // 8, DIM * 2)
    ops = {"cumsum": lambda t: t.cumsum(-2), "sum": lambda t: t.sum(-2), "flip": lambda t: t.flip(-2)}
    with plain_torch():
        expected = ops[op](px)
    _tighten(tight)
    got = ops[op](x)
    assert (got.shape, got.dtype, got.stride()) == (expected.shape, expected.dtype, expected.stride())
    if op == "flip":
        assert torch.equal(_plain(got), expected.cpu())
    else:
        _assert_product_pieces_equal(got, expected.cpu(), inner=ROWS // 8)
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


@pytest.mark.parametrize("case", ["lower-unit", "upper-right", "shared-matrix"])
def test_a_batched_triangular_solve_larger_than_the_budget_in_groups_of_its_matrices(tight, case):
    # (a gated delta rule solves each head's chunk, (1, heads, 1, C, C) against (1, heads, 1,
    # C, 2C): 1.3 MiB at a budget of 632 KiB was refused)
    heads, c = 8, 32
    a, pa = _pair(1, heads if case != "shared-matrix" else 1, 1, c, c)
    b, pb = _pair(1, heads, 1, c, 2 * c, seed=1)
    a = a + torch.eye(c) * c  # (well conditioned: the solve's values stay of the inputs' size)
    with plain_torch():
        pa = pa + torch.eye(c) * c
    kwargs = {"lower-unit": dict(upper=False, unitriangular=True), "upper-right": dict(upper=True, left=False),
              "shared-matrix": dict(upper=False)}[case]
    if case == "upper-right":
        b, pb = b.transpose(-1, -2), pb.transpose(-1, -2)
    with plain_torch():
        expected = torch.linalg.solve_triangular(pa, pb, **kwargs)
        layout = (expected.shape, expected.stride())
    _tighten(tight, room=40 * 1024)
    got = torch.linalg.solve_triangular(a, b, **kwargs)
    assert isinstance(got, TensorRef) and (got.shape, got.stride()) == layout
    # (each matrix solved alone, as in one call; a batched kernel may block one otherwise)
    _assert_product_pieces_equal(got, expected.cpu(), inner=c)
    assert tight.stats()["peak_device_bytes"] < (a.numel() + b.numel()) * 4


@pytest.mark.parametrize("op", ["tril", "triu", "tril-1", "triu+1"])
@pytest.mark.parametrize("heads", [8, 2, 1])
def test_the_triangle_of_each_matrix_of_a_batch_larger_than_the_budget_in_slices(tight, op, heads):
    # (a gated delta rule masks each head's chunk, (1, heads, 1, C, C): refused at a budget
    # below the batch; and below one head's matrix, in groups of its rows)
    x, px = _pair(1, heads, 1, 64 if heads == 8 else 256, 64)
    name, diagonal = op[:4], int(op[4:] or 0)
    with plain_torch():
        expected = getattr(torch, name)(px, diagonal)
    _tighten(tight)
    got = getattr(torch, name)(x, diagonal)
    assert (got.shape, got.stride()) == (expected.shape, expected.stride())
    assert torch.equal(_plain(got), expected.cpu())  # (copies and zeros)
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


@pytest.mark.parametrize("case", ["index", "expanded-index"])
def test_a_scatter_add_into_a_tensor_larger_than_the_budget_in_slices_of_another_dimension(tight, case):
    # (a sparse attention's backward scatters each head's chosen keys' gradients into
    # scores (1, heads, queries, keys) larger than a quarter of its weights: refused)
    x, px = _pair(1, 8, 6, 512)
    src, psrc = _pair(1, 8, 6, 6, seed=1)
    torch.manual_seed(2)
    chosen = torch.randint(0, 512, (1, 8 if case == "index" else 1, 6, 6))
    with plain_torch():
        torch.manual_seed(2)
        pchosen = torch.randint(0, 512, (1, 8 if case == "index" else 1, 6, 6))
        expected = px.scatter_add(-1, pchosen.expand(1, 8, 6, 6), psrc).cpu()
    _tighten(tight)
    got = x.scatter_add(-1, chosen.expand(1, 8, 6, 6), src)
    assert isinstance(got, TensorRef) and (got.shape, got.stride()) == (expected.shape, expected.stride())
    assert torch.equal(_plain(got), expected)
    assert tight.stats()["peak_device_bytes"] < x.numel() * 4


def test_a_sum_of_a_whole_tensor_larger_than_the_budget_is_refused_with_what_it_needs(tight):
    x, _px = _pair(1, 6, 8, 16, 32)
    _tighten(tight)
    with pytest.raises(OutOfBudgetError, match=r"aten\.sum\.dim_IntList needs"):
        x.sum((0, 1, 2, 3, 4))
    assert tight.stats()["peak_device_bytes"] <= tight.budget


def _train_mixed(model, ids, mode, device, steps=2):
    """One of three mixed-precision loops a user writes."""
    if mode == "master":  # bf16 weights, fp32 master copies and optimizer state
        params = list(model.parameters())
        master = [p.detach().float().clone().requires_grad_(True) for p in params]
        opt = torch.optim.AdamW(master, lr=1e-2)
        for _ in range(steps):
            for p in params:
                p.grad = None
            model(ids, labels=ids).loss.backward()
            for m, p in zip(master, params):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, params):
                    p.copy_(m)
        return
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0) if mode == "scaler" else None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16 if scaler else torch.bfloat16):
            loss = model(ids, labels=ids).loss
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()


@pytest.mark.parametrize("strategy", strategies.NAMES)
@pytest.mark.parametrize("mode", ["autocast", "scaler", "master"])
def test_mixed_precision_training_equals_plain_torch(fresh_manager, monkeypatch, mode, strategy):
    # master under Flow at 25%: a tile's result was copied into a host copy the manager had
    # meanwhile moved into pinned memory for a prefetch, and the second step's gradients were NaN
    regions = getattr(torchTensorRef, "regions", None)
    if regions is not None:
        monkeypatch.setattr(regions, "enabled", False)  # the per-op path is what is tested here
    fresh_manager.strategy = strategy
    plain = _llama()
    if mode == "master":
        with torchTensorRef.disabled():
            plain = plain.to(torch.bfloat16)
    with torchTensorRef.disabled():
        ids = torch.randint(2, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    expected, model = _reference_then_managed(
        plain, lambda ref: _train_mixed(ref, ids.to(device_type()), mode, device_type()))
    wbytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    fresh_manager.budget = budget(wbytes // 4)
    fresh_manager.reset_stats()
    _train_mixed(model, torchTensorRef.manage(ids.clone()), mode, device_type())
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(_plain(p), e)
    assert fresh_manager.stats()["peak_device_bytes"] <= fresh_manager.budget


def test_a_conjugated_view_larger_than_the_budget_is_refused_not_split(tight):
    # (pieces alias byte ranges; a lazily conjugated view has none: from_dlpack raised BufferError)
    torch.manual_seed(0)
    z = torch.randn(ROWS, DIM // 2, dtype=torch.complex64)
    _tighten(tight)
    with pytest.raises(OutOfBudgetError, match="clone"):
        z.conj().clone()


def test_a_copy_to_the_host_takes_the_usual_path(tight):
    # (.cpu() of a tensor that fits the budget alone was refused: its result counted as device bytes)
    w, pw = _pair(ROWS // 4, DIM)
    with plain_torch():
        expected = pw.cpu()
    _tighten(tight, ROWS // 4 * DIM * 4 + 4096)
    assert torch.equal(w.cpu(), expected)


@pytest.mark.parametrize("case", ["product", "gelu's input", "contiguous", "copy", "two halves"])
def test_halves_of_a_chunked_tensor_in_rows_equal_one_call(tight, case):
    # diffusers' GEGLU multiplies one half of a projection (``chunk(2, dim=-1)``: not one
    # range of its bytes) by an activation of the other: at a quarter of a UNet's weights
    # the product was refused as unsplittable.
    proj, pproj = _pair(2, ROWS // 4, 2 * DIM)
    dst, pdst = _pair(2, ROWS // 4, DIM, seed=1)
    ops = {"product": lambda p, d: p.chunk(2, -1)[0] * torch.relu(p.chunk(2, -1)[1]),
           "gelu's input": lambda p, d: torch.maximum(p.chunk(2, -1)[1], d),
           "contiguous": lambda p, d: p.chunk(2, -1)[1].contiguous(),
           "copy": lambda p, d: d.copy_(p.chunk(2, -1)[0]),
           "two halves": lambda p, d: p.chunk(2, -1)[0] - p.chunk(2, -1)[1]}
    with plain_torch():
        expected = ops[case](pproj, pdst)
        layout = (expected.shape, expected.stride())
        expected = expected.cpu()
    _tighten(tight)
    with torch.no_grad():
        got = ops[case](proj, dst)
    assert isinstance(got, TensorRef) and (got.shape, got.stride()) == layout
    assert torch.equal(_plain(got), expected)
    assert torch.equal(_plain(proj), pproj.cpu())  # (only read)


@pytest.mark.parametrize("op", ["copy_", "mul_"])
def test_transposed_heads_written_in_place_larger_than_the_budget_equal_one_call(tight, op):
    # (a linear attention writes its state's heads through a transposed view, each head a
    # dense range of the buffer's bytes: refused, as a window written back might have
    # overwritten another piece's bytes)
    buf, pbuf = _pair(1, 8, 64, 64)
    src, psrc = _pair(1, 8, 64, 64, seed=1)
    run = {"copy_": lambda b, s: b.transpose(-1, -2).copy_(s),
           "mul_": lambda b, s: b.transpose(-1, -2).mul_(s)}[op]
    with plain_torch():
        run(pbuf, psrc)
        expected = pbuf.cpu()
    _tighten(tight)
    run(buf, src)
    assert torch.equal(_plain(buf), expected)


def test_a_half_of_a_chunked_tensor_written_in_place_runs_row_by_row(tight):
    # (a window of a half brings the other half's bytes too; written back, they would
    # overwrite what another piece of the tensor wrote: it was refused; each row of a half
    # is a range of its bytes, which the op runs on index by index, the other half intact)
    proj, pproj = _pair(2, ROWS // 4, 2 * DIM)
    other, pother = _pair(2, ROWS // 4, DIM, seed=1)
    with plain_torch():
        pfirst, _ = pproj.chunk(2, -1)
        pfirst.mul_(pother)
        expected = pproj.cpu()
    _tighten(tight)
    first, second = proj.chunk(2, -1)
    assert first.mul_(other) is first
    assert torch.equal(_plain(proj), expected)
    with pytest.raises(OutOfBudgetError, match="add"):  # (an ``out=`` op is not split)
        torch.add(first, other, out=second)


def test_contiguous_of_a_transposed_tensor_larger_than_the_budget_is_laid_out_as_plain_torch(tight):
    a, pa = _pair(ROWS, DIM)
    with plain_torch():
        expected = pa.t().contiguous()
        layout = (expected.shape, expected.stride())
    _tighten(tight)
    got = a.t().contiguous()  # (its positions interleave in its bytes: its pieces gathered)
    assert (got.shape, got.stride()) == layout
    assert torch.equal(_plain(got), expected.cpu())


@pytest.mark.parametrize("case", ["select", "unbind", "narrow", "every other row", "split", "squeeze", "item",
                                  "bool", "a row in place"])
def test_parts_of_a_tensor_larger_than_the_budget_equal_plain_torch(tight, case):
    # (taking a part of a tensor that did not fit was refused, and so was item() of one element)
    big, pbig = _pair(ROWS, DIM)
    ops = {"select": lambda b: b[3] * 2,
           "unbind": lambda b: b.unbind(0)[2] + 1,
           "narrow": lambda b: b.narrow(0, 100, 300) * 2,
           "every other row": lambda b: b[::2].clone(),
           "split": lambda b: b.split(8)[1] - 1,
           "squeeze": lambda b: b.view(1, ROWS, DIM).squeeze(0)[4:6] * 3,
           "item": lambda b: torch.tensor(b[5, 7].item()),
           "bool": lambda b: torch.tensor(bool(b[5, 7] > 0)),
           "a row in place": lambda b: b[7].add_(1.0)}
    with plain_torch():
        expected = ops[case](pbig)
        layout = (expected.shape, expected.stride(), expected.dtype)
        expected, expected_big = expected.cpu(), pbig.cpu()
    _tighten(tight)
    got = ops[case](big)
    assert (got.shape, got.stride(), got.dtype) == layout
    assert torch.equal(_plain(got), expected)
    assert torch.equal(_plain(big), expected_big)


@pytest.mark.parametrize("case", ["experts", "an-expert-larger-than-the-room", "few-rows-wide-experts"])
def test_a_grouped_product_larger_than_the_budget_in_groups_of_experts_equals_one_call(tight, case):
    # transformers' experts run all in one `_grouped_mm` (a Mixtral's at 30% of its weights
    # was refused, 1-4 KiB short): now in groups of experts, its backward's too (an Aria's
    # weight gradient, few rows per expert and wide ones, was sized by its rows squared
    # for its gradient's piece, rows by width: a group too large, refused)
    experts, inner, width = (8, 128, 32) if case == "few-rows-wide-experts" else (6, 64, 48)
    ends = {"experts": [5, 5, 17, 30, 30, 36], "an-expert-larger-than-the-room": [2, 2, 100, 101, 101, 110],
            "few-rows-wide-experts": [1, 1, 5, 6, 8, 9, 9, 12]}[case]
    rows = ends[-1] + 4  # (rows after the last expert's: the kernel computes none)
    a, pa = _pair(rows, inner)
    b, pb = _pair(experts, width, inner, seed=1)  # (each expert's weight (out, in): used transposed)
    g, pg = _pair(rows, width, seed=2)
    offs = torch.tensor(ends, dtype=torch.int32)
    for t in (a, b, pa, pb):
        t.requires_grad_(True)
    run = lambda a, b, offs: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)  # noqa: E731
    with plain_torch():
        pout = run(pa, pb, torch.tensor(ends, dtype=torch.int32))
        pout.backward(pg)
    computed = slice(0, ends[-1])
    expected = [pout.detach()[computed].cpu(), pa.grad[computed].cpu(), pb.grad.cpu()]
    weights = experts * width * inner * 4
    # (half of the experts' weights; or room for all of them and their gradient's piece of
    # every row, not for the pieces of the rows too)
    _tighten(tight, room=weights // 2 if case != "few-rows-wide-experts" else weights + 6 * 1024)
    out = run(a, b, offs)
    out.backward(g)
    assert tight.stats()["peak_device_bytes"] < weights + (8 * 1024 if case == "few-rows-wide-experts" else 0)
    for got, want in zip([out.detach()[computed], a.grad[computed], b.grad], expected):
        _assert_product_pieces_equal(got, want, inner=max(inner, width, rows))
    assert torch.equal(_plain(out)[ends[-1]:], torch.zeros(rows - ends[-1], width))
