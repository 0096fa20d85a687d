"""Upper bounds of results whose size depends on the data (Note [Data-dependent sizes]),
from the arguments' shapes, or from their values where no shape bounds them; and of the
results some meta kernels size too small. ``output_size.py`` gives an op room for its bound."""

from __future__ import annotations

from typing import Callable, Dict

import torch

from ..core import raw
from ..core.tensor_ref import TensorRef
from ..memory.sim.tensor import SimTensor

META = torch.device("meta")


def to_meta(value):
    """``value`` with its tensors (in lists and tuples) as meta tensors of the same geometry."""
    if isinstance(value, torch.Tensor):
        return raw.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=META)
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    return value


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a ``SimTensor``'s bytes; any other tensor as it is."""
    return t.data_ if t.__class__ is SimTensor else t


# Note [Data-dependent sizes]: the bound of each op whose result size depends on its data,
# from the arguments' shapes alone where one exists (reading the data would make the host
# wait for the device). Two ops have no such bound: ``bincount`` (the largest value plus
# one) and ``repeat_interleave`` with tensor repeats (their sum). Their kernels read those
# values themselves before allocating (CUDA's too, unless ``output_size`` is given), so the
# bound reads them first: the same wait, one op earlier. Those bounds depend on values, so
# they are never cached. An op that still outgrows its estimate (a custom op whose meta
# kernel is wrong) makes the manager make room after it ran, and the peak may pass the
# budget by the difference (``stats()["worst_overshoot_bytes"]`` records it): once, as its
# later calls are sized by its runs (Note [Sizes known after the op]).

def _itemsize(t: torch.Tensor) -> int:
    return t.element_size()


def _bound_index(args, kwargs) -> int:
    # A k-dim boolean mask selects at most all of its elements: as k long indices of that
    # length, which the meta kernel sizes.
    self, indices = args[0], args[1]
    long_indices = []
    for index in indices:
        if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
            long_indices += [raw.empty_strided((index.numel(),), (1,), dtype=torch.long, device=META)] * index.dim()
        else:
            long_indices.append(to_meta(index))
    out = torch.ops.aten.index.Tensor(to_meta(self), long_indices)
    return out.numel() * _itemsize(self)


def _bound_masked_select(args, kwargs) -> int:
    self, mask = args[0], args[1]
    return torch.broadcast_shapes(self.shape, mask.shape).numel() * _itemsize(self)


def _bound_nonzero(args, kwargs) -> int:
    return args[0].numel() * max(args[0].dim(), 1) * 8


def _bound_ctc_loss(args, kwargs) -> tuple:
    # The loss per sequence, and log_alpha of (batch, time, 2 * longest target + 1): the
    # longest target is at most the targets' width, or all of them when concatenated.
    log_probs, targets = args[0], args[1]
    batch = log_probs.size(1) if log_probs.dim() == 3 else 1
    longest = targets.size(-1) if targets.dim() == 2 else targets.numel()
    itemsize = _itemsize(log_probs)
    return (batch * itemsize, batch * log_probs.size(0) * (2 * longest + 1) * itemsize)


def _values(t: torch.Tensor) -> torch.Tensor:
    """The current values of ``t`` as a plain tensor (waiting for copies in flight)."""
    if isinstance(t, TensorRef):
        return t.target
    return plain(t)


def _bound_repeat_interleave(args, kwargs) -> int:
    # repeat_interleave(repeats, *, output_size=None): sum(repeats) int64 indices.
    size = kwargs.get("output_size")
    if size is None:
        size = int(_values(args[0]).sum()) if args[0].numel() else 0
    return size * 8


def _bound_bincount(args, kwargs) -> int:
    # bincount(self, weights=None, minlength=0): max(self) + 1 counts, int64 or the weights'
    # floating type (at most 8 bytes each).
    self = args[0]
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    length = int(_values(self).max()) + 1 if self.numel() else 0
    return max(length, minlength) * 8


def _unique_bound(flags_at: tuple):
    """The bound of a ``unique`` variant: every element distinct; the inverse indices and
    the counts (int64) only when asked (``flags_at``: their argument positions)."""

    def bound(args, kwargs) -> tuple:
        self = args[0]
        asked = [8 * self.numel() for i in flags_at if (args[i] if i < len(args) else False)]
        return (self.numel() * _itemsize(self), *asked)

    return bound


BOUNDS: Dict[object, Callable] = {}
#: ids of the ops whose bound reads values (Note [Data-dependent sizes]): never cached by
#: shapes (ids: ``OpOverload.__hash__`` is Python code, and this is asked for every op)
READS_VALUES = set()
#: ops whose meta kernel sizes what they write too small (``_native_batch_norm_legit``'s out=
#: variants: the meta kernel leaves the out tensors as given, the host kernel gives them new
#: storage, which the budget then held twice for a moment): sized by their bounds instead
#: ``_embedding_bag``'s kernels lay out its bookkeeping results as they need (the CPU's
#: gives ``max_indices`` a result in every mode and ``offset2bag`` one more element), and its
#: meta kernel as the CPU's does not: sized by a bound of all four
META_TOO_SMALL = frozenset(op for op in (
    torch.ops.aten._ctc_loss.Tensor,
    getattr(torch.ops.aten._native_batch_norm_legit, "out", None),
    getattr(torch.ops.aten._native_batch_norm_legit, "no_stats_out", None),
    torch.ops.aten._embedding_bag.default,
) if op is not None)


def _bound_batch_norm_out(args, kwargs) -> tuple:
    """Its three results whole: the output (as the input) and the saved mean and inverse
    deviation (one per channel, in at least float32)."""
    x = args[0]
    channels = x.shape[1] if x.dim() > 1 else 1
    stat = channels * max(x.element_size(), 4)
    return (x.numel() * x.element_size(), stat, stat)


def _bound_embedding_bag(args, kwargs) -> tuple:
    """Its four results whole: the bags' sums (bags x embedding size), ``offset2bag`` (one
    per index, and one more), ``bag_size`` (one per bag) and ``max_indices`` (one per bag
    and embedding column, as in max mode)."""
    weight, indices, offsets = args[0], args[1], args[2]
    include_last = args[5] if len(args) > 5 else kwargs.get("include_last_offset", False)
    bags = indices.shape[0] if indices.dim() == 2 else offsets.shape[0] - bool(include_last)
    dim = weight.shape[1]
    index = indices.element_size()
    return (bags * dim * weight.element_size(), (indices.numel() + 1) * index, bags * index, bags * dim * index)


def _bound_pack_padded_sequence(args, kwargs) -> tuple:
    """``_pack_padded_sequence(input, lengths, batch_first)``: at most every step of every
    sequence (its lengths are values, on the host), and one batch size (int64) per step."""
    x = args[0]
    batch_first = args[2] if len(args) > 2 else kwargs.get("batch_first", False)
    steps = x.shape[1] if batch_first and x.dim() > 1 else x.shape[0]
    return (x.numel() * _itemsize(x), steps * 8)


def _register_bounds() -> None:
    aten = torch.ops.aten
    pairs = [
        # (an out= variant's bound is its result's: more than the out tensor grows by)
        ("index", ("Tensor", "Tensor_out"), _bound_index),
        ("masked_select", ("default", "out"), _bound_masked_select),
        ("nonzero", ("default", "out"), _bound_nonzero),
        ("argwhere", ("default",), _bound_nonzero),
        # (self, sorted, return_inverse[, return_counts]), (self, return_inverse, return_counts, dim) ...
        ("_unique", ("default",), _unique_bound((2,))),
        ("_unique2", ("default",), _unique_bound((2, 3))),
        ("unique_dim", ("default",), _unique_bound((3, 4))),
        ("unique_consecutive", ("default",), _unique_bound((1, 2))),
        ("unique_dim_consecutive", ("default",), _unique_bound((2, 3))),
        ("_ctc_loss", ("Tensor",), _bound_ctc_loss),
        ("_native_batch_norm_legit", ("out", "no_stats_out"), _bound_batch_norm_out),
        ("_embedding_bag", ("default",), _bound_embedding_bag),
        ("repeat_interleave", ("Tensor",), _bound_repeat_interleave),
        ("bincount", ("default",), _bound_bincount),
        ("_pack_padded_sequence", ("default",), _bound_pack_padded_sequence),
    ]
    for name, overloads, bound in pairs:
        packet = getattr(aten, name, None)
        for overload in overloads:
            op = getattr(packet, overload, None) if packet is not None else None
            if op is not None:
                BOUNDS[op] = bound
                if bound in (_bound_repeat_interleave, _bound_bincount):
                    READS_VALUES.add(id(op))


_register_bounds()
