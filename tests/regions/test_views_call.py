"""A call given plain tensors for TensorRefs, as one op of the manager (regions/views_call.py):
what it writes is kept, versions move as plain torch's would, and nothing stays pinned."""

from __future__ import annotations

import pytest
import torch

from torchTensorRef import TensorRef, tensorsManager as tm
from torchTensorRef.core.tensor_ref import block_of
from torchTensorRef.regions.op import RegionSpec
from torchTensorRef.regions.views_call import run_on_views
from paired import assert_identical, plain_torch

SPEC = RegionSpec("a views call")


def pinned() -> int:
    return sum(b.pins for b in tm.books.blocks.values())


@pytest.mark.parametrize("strategy", ["genoa", "flow"])
def test_what_the_call_writes_is_kept_and_versions_move_as_the_views_moved(fresh_manager, strategy):
    tm.strategy = strategy
    a, b = torch.arange(8.0), torch.ones(8)
    with plain_torch():
        plain_a, plain_b = torch.arange(8.0, device=tm.torch_device), torch.ones(8, device=tm.torch_device)
        plain_a.mul_(2.0)
        plain_a.add_(plain_b)
    tm.evict_all()  # (clean blocks: their host copies current, as after a first eviction)
    versions = a._version, b._version
    before = tm.stats()["ops"]

    def call(views, adopt):
        x, y = views
        x.mul_(2.0)
        x.add_(y)
        return adopt(x)

    out = run_on_views(SPEC, [a, b], call)
    assert tm.stats()["ops"] - before == 1
    assert out is a  # (a view given back is its TensorRef)
    assert (a._version - versions[0], b._version - versions[1]) == (2, 0)
    assert pinned() == 0
    tm.evict_all()  # (Genoa evicted after the op already: the host copies hold the writes)
    assert_identical(plain_a, a)
    assert_identical(plain_b, b)


def test_a_tensor_the_call_makes_becomes_a_new_block(fresh_manager):
    a = torch.ones(4)
    out = run_on_views(SPEC, [a], lambda views, adopt: adopt(views[0] * 3))
    assert type(out) is TensorRef and block_of(out) is not block_of(a)
    with plain_torch():
        assert_identical(torch.full((4,), 3.0, device=tm.torch_device), out)


def test_an_error_in_the_call_keeps_what_it_wrote_and_unpins(fresh_manager):
    a = torch.zeros(4)
    tm.evict_all()  # (a clean block: its host copy current)

    def call(views, adopt):
        views[0].add_(1.0)
        raise ValueError("midway")

    with pytest.raises(ValueError, match="midway"):
        run_on_views(SPEC, [a], call)
    assert pinned() == 0 and a._version == 1
    tm.evict_all()
    with plain_torch():
        assert_identical(torch.ones(4, device=tm.torch_device), a)
