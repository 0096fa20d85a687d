"""What a call's ops allocate, followed to its peak (``regions/inside.py``)."""

from __future__ import annotations

import torch

from torchTensorRef import tensorsManager as tm
from torchTensorRef.regions.inside import Measure

from paired import plain_torch


def test_a_storage_s_bytes_are_counted_until_the_storage_dies_not_its_first_tensor():
    # A plain storage is known by its address: one that a tensor let go of with ``set_`` is
    # free for the next allocation while that tensor lives, and the allocator gives it to the
    # next storage of its size class. That storage's bytes are freed with it, not with the
    # tensor that held the address first (a scope's measured peak depended on where the
    # allocator put its storages).
    with plain_torch():
        device = tm.torch_device
        other = torch.ones(4, device=device)
        measure = Measure(set(), lambda n: n)
        with measure:
            held = torch.empty(0, device=device)
            held.set_(other.untyped_storage())  # (counted from here: the measure saw it returned)
            for _ in range(8):
                made = torch.empty(256, device=device)
                del made
        assert (measure.now, measure.peak) == (16, 16 + 1024)
        del held
        assert measure.now == 16  # (``other``'s storage lives on)
        del other
        assert measure.now == 0
