"""A block's residence (Note [Residence] in core/blocks.py): one state, changed by named
transitions as the manager moves and writes it."""

from __future__ import annotations

import torch

from torchTensorRef import tensorsManager as tm
from torchTensorRef.core.blocks import Residence
from torchTensorRef.core.tensor_ref import block_of
from paired import plain_torch


def test_a_tensor_s_residence_follows_its_moves_and_writes():
    tm.strategy = "flow"  # (no budget: nothing leaves the device but what the test sends)
    x = torch.zeros(1024)
    x.toCPU()
    assert x.proxyInfo.residence == "on host"
    x.toGPU()
    assert x.proxyInfo.residence == "resident, clean"
    x.add_(1.0)  # (an op writes the device copy)
    assert x.proxyInfo.residence == "resident, dirty" and x.proxyInfo.dirty
    x.toCPU()  # (written back, then dropped)
    assert x.proxyInfo.residence == "on host" and x.proxyInfo.as_dict()["residence"] == "on host"
    assert torch.zeros(3, device="cpu").proxyInfo.residence == "host only"
    with plain_torch():
        expected = torch.ones(1024)
    assert torch.equal(x.cpu().target, expected.cpu())


def test_a_prefetched_block_is_arriving_until_an_op_reads_it():
    tm.strategy = "flow"
    x = torch.ones(64 * 1024)
    x.toCPU()
    x.toGPU()
    x.toCPU()  # (its host copy is pinned from its second move: prefetches copy from pinned memory)
    block = block_of(x)
    assert tm.prefetch(block)
    assert block.residence is Residence.ARRIVING and block.prefetched
    hits = tm.stats()["prefetch_hits"]
    y = x * 2  # (the op is ordered after the copy in: a prefetch hit)
    assert block.residence is Residence.CLEAN and not block.prefetched
    assert tm.stats()["prefetch_hits"] == hits + 1
    with plain_torch():
        expected = torch.ones(64 * 1024) * 2
    assert torch.equal(y.cpu().target, expected.cpu())
