"""Pinned host memory: within ``pinned_limit``, counted as PyTorch's pinned allocator rounds,
given back when blocks let go of it, and never at the cost of memory a user shares with a
TensorRef."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, tensorsManager as tm
from torchTensorRef.memory import pinned as pinned_module
from torchTensorRef.memory.pinned import PinnedMemory, rounded
from torchTensorRef.strategies import Flow
from torchTensorRef.core.tensor_ref import block_of
from paired import budget, room_report

KIB = 1024


@pytest.fixture
def limit():
    """Restore ``pinned_limit`` after the test."""
    before = tm.pinned_limit
    yield
    tm.pinned_limit = before


def _pinned() -> int:
    return tm.stats()["pinned_bytes"]


def _is_pinned(ref) -> bool:
    return tm.backend.pinned.is_pinned(block_of(ref).host)


def _written_back(n, nbytes=1000):
    """``n`` results whose host copies were made by a write-back (Genoa), waited for."""
    results = [torch.full((nbytes // 4,), float(i)) + 1 for i in range(n)]
    tm.synchronize()
    return results


# -- the setting -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("1MiB", 2**20), ("64 KiB", 64 * KIB), ("2GB", 2 * 10**9),
                                             (4096, 4096), (0, 0)])
def test_pinned_limit_accepts_sizes_and_ints(limit, value, expected):
    tm.pinned_limit = value
    assert tm.pinned_limit == expected


@pytest.mark.parametrize("value", [None, -1, "lots", "12 parsecs", 1.5, True])
def test_bad_pinned_limit_raises_naming_what_is_accepted_and_changes_nothing(limit, value):
    tm.pinned_limit = "1MiB"
    with pytest.raises(ValueError, match=r"pinned_limit must be .*size") as info:
        tm.pinned_limit = value
    assert "int" in str(info.value)
    assert tm.pinned_limit == 2**20


def test_pinned_limit_set_on_another_device_applies_when_sim_is_chosen(limit):
    tm.device = "cpu"
    tm.pinned_limit = "3MiB"
    tm.device = "sim"
    assert tm.pinned_limit == 3 * 2**20 and tm.backend.pinned.limit == 3 * 2**20


# -- accounting ------------------------------------------------------------------------------------------


def test_pinned_bytes_are_counted_at_the_allocators_rounded_sizes_and_given_back(limit):
    tm.pinned_limit = "1MiB"
    start = _pinned()
    results = _written_back(4)
    assert all(_is_pinned(r) for r in results)
    assert _pinned() - start == 4 * rounded(1000) == 4 * KIB
    del results[0]  # a block that dies gives its pinned memory back at once
    assert _pinned() - start == 3 * KIB
    del results
    assert _pinned() == start


def test_pinned_bytes_never_exceed_the_limit_and_past_it_copies_are_pageable(limit):
    start = _pinned()
    tm.pinned_limit = start + 2 * KIB  # room for two of the four host copies
    peaks = []
    handle = tm.add_callback(after=lambda op: peaks.append(_pinned()))
    results = _written_back(4)
    handle.remove()
    assert max(peaks + [_pinned()]) <= tm.pinned_limit
    assert [_is_pinned(r) for r in results] == [True, True, False, False]
    syncs = tm.stats()["host_syncs"]
    for r in results:
        r.mul_(2)  # fetched, written, written back: from pageable memory the host waits
    assert [r.tolist() for r in results] == [[2.0 * (i + 1)] * 250 for i in range(4)]
    assert tm.stats()["host_syncs"] > syncs
    assert _pinned() <= tm.pinned_limit
    del results
    assert _pinned() == start


def test_the_limit_applies_to_prefetches_too(limit):
    # Flow pins a host copy before prefetching from it; past the limit it does not prefetch.
    tm.strategy = Flow(lookahead=2, prefetch_evicts=True)
    start = _pinned()
    tm.pinned_limit = start
    tensors = [torch.full((256,), float(i)) for i in range(4)]
    tm.budget = budget(3 * KIB)

    def cycle():
        for _ in range(12):
            sums = [t.sum() for t in tensors]
        return [s.item() for s in sums]

    assert cycle() == [256.0 * i for i in range(4)]
    assert _pinned() == start and tm.stats()["prefetches"] == 0
    tm.pinned_limit = start + 4 * KIB  # room: the same loop prefetches
    assert cycle() == [256.0 * i for i in range(4)]
    assert tm.stats()["prefetches"] > 0 and start < _pinned() <= tm.pinned_limit


def test_pinned_memory_refuses_past_its_limit_and_counts_what_it_gives_back():
    pinned = PinnedMemory(emulated=True, limit=3 * KIB)
    a = pinned.allocate(1000)
    b = pinned.allocate(1025)  # rounded to 2 KiB: 3 KiB in all
    assert a.numel() == 1000 and b.numel() == 1025 and pinned.used == 3 * KIB
    assert pinned.allocate(1) is None and pinned.used == 3 * KIB
    assert pinned.is_pinned(a.untyped_storage())
    pinned.freed(a.untyped_storage())
    pinned.freed(a.untyped_storage())  # (twice: counted once)
    assert pinned.used == 2 * KIB and not pinned.is_pinned(a.untyped_storage())
    assert pinned.allocate(KIB) is not None and pinned.used == 3 * KIB


def test_emulated_pinned_memory_knows_a_storage_that_aliases_its_buffer_as_cuda_does():
    # (a piece of a big host tensor, made with dlpack, has a storage of its own; CUDA finds
    # its bytes page-locked by their address, and so must the emulation)
    pinned = PinnedMemory(emulated=True, limit=64 * KIB)
    buffer = pinned.allocate(4 * KIB)
    with torchTensorRef.disabled():
        piece = torch.from_dlpack(buffer[KIB:2 * KIB])
        elsewhere = torch.empty(KIB, dtype=torch.uint8)
    assert piece.untyped_storage()._cdata != buffer.untyped_storage()._cdata
    assert pinned.is_pinned(piece.untyped_storage()) and not pinned.is_pinned(elsewhere.untyped_storage())
    pinned.freed(buffer.untyped_storage())
    assert not pinned.is_pinned(piece.untyped_storage())


def test_a_resize_that_drops_the_host_copy_gives_its_pinned_memory_back(limit):
    # Fixed: the dropped host copy stayed counted as pinned.
    tm.pinned_limit = "1MiB"
    start = _pinned()
    x = torch.zeros(2048)  # 8 KiB: its host copy is pinned when it is made
    assert _is_pinned(x) and _pinned() - start == 8 * KIB
    x.resize_(3000)  # grown on the device: the 8 KiB host copy is out of date
    tm.synchronize()
    assert _pinned() - start == rounded(12000) == 16 * KIB  # the new host copy only
    assert x.shape == (3000,) and x[:2048].tolist() == [0.0] * 2048
    del x
    assert _pinned() == start


def test_a_resize_of_a_tensor_only_on_the_device_pins_its_host_copy_once(limit):
    tm.strategy = "flow"
    tm.pinned_limit = "1MiB"
    start = _pinned()
    x = torch.zeros(2048) + 1  # only on the device: no host copy yet
    x.resize_(4096)
    x.toCPU()
    assert _pinned() - start == 16 * KIB
    del x
    assert _pinned() == start


# -- memory shared with the user -------------------------------------------------------------------------


def _user_tensor(n=2048):
    # 8 KiB: a host copy this large is pinned when torchTensorRef makes the tensor itself
    with torchTensorRef.disabled():
        return torch.zeros(n)


@pytest.mark.parametrize("how", ["TensorRef", "manage", "manage_tensor"])
def test_a_tensorref_over_a_users_tensor_shares_its_memory_both_ways(limit, how):
    # Fixed: re-homing host copies into pinned memory broke the sharing TensorRef(t) promises.
    tm.pinned_limit = "1MiB"
    plain = _user_tensor()
    start = _pinned()
    ref = {"TensorRef": TensorRef, "manage": torchTensorRef.manage, "manage_tensor": tm.manage_tensor}[how](plain)
    ref.add_(1)  # Genoa: brought in, written, written back (at once: the user may read it)
    assert _pinned() == start  # the user's memory stayed where it is
    assert block_of(ref).host.data_ptr() == plain.untyped_storage().data_ptr()
    assert plain.tolist() == [1.0] * 2048  # the user's tensor sees the write
    plain.fill_(5.0)
    assert ref.tolist() == [5.0] * 2048  # and the TensorRef sees the user's
    assert (ref * 2).tolist() == [10.0] * 2048


def test_a_users_tensor_keeps_its_memory_while_flow_pins_and_prefetches_others(limit):
    tm.pinned_limit = "1MiB"
    tm.strategy = Flow(lookahead=2, prefetch_evicts=True)
    plains = [_user_tensor() for _ in range(3)]
    refs = [TensorRef(p) for p in plains]
    others = [torch.full((2048,), float(i)) for i in range(3)]
    tm.budget = budget(3 * 8 * KIB)
    for _ in range(8):
        for t in refs + others:
            t.sum()
    assert tm.stats()["prefetches"] > 0 and all(_is_pinned(o) for o in others), room_report()  # the others were
    for r in refs:
        r.add_(1)
    tm.evict_all()
    tm.synchronize()
    for r, p in zip(refs, plains):
        assert block_of(r).host.data_ptr() == p.untyped_storage().data_ptr() and not _is_pinned(r)
        assert p.tolist() == [1.0] * 2048
    plains[0].fill_(7.0)
    assert refs[0].sum().item() == 7.0 * 2048


def test_a_fetch_of_a_users_small_tensor_is_staged_through_pinned_memory(limit, monkeypatch):
    # Fixed: every fetch from pageable memory made the host wait (on CUDA, for the whole
    # stream): a model's plain buffer shared with an attribute (a rotary embedding's
    # frequencies) did so twice per decoded token. A small one is copied into a transient
    # pinned buffer first; the user's memory stays where it is and counts nothing pinned.
    tm.pinned_limit = "1MiB"
    plain = _user_tensor()  # 8 KiB
    ref = TensorRef(plain)
    start, waits = _pinned(), 0
    for i in range(3):
        syncs = tm.stats()["host_syncs"]
        ref.toGPU()
        waits += tm.stats()["host_syncs"] - syncs
        assert _pinned() == start
        assert (ref * 2).tolist() == [2.0 * i] * 2048
        ref.toCPU()
        plain.add_(1)  # (the user's writes reach the next fetch)
    assert waits == 0
    assert block_of(ref).host.data_ptr() == plain.untyped_storage().data_ptr()
    monkeypatch.setattr(pinned_module, "STAGE_MAX", 4 * KIB)  # larger than that: copied from pageable memory
    syncs = tm.stats()["host_syncs"]
    ref.toGPU()
    assert tm.stats()["host_syncs"] == syncs + 1
    assert ref.tolist() == [3.0] * 2048


def test_pinned_blocks_alive_at_exit_leave_without_errors():
    # TensorRefs dying as the interpreter shut down released their pinned host copies
    # through modules already torn down: "Exception ignored ... 'NoneType' object is not
    # callable", once per block, after a normal exit
    script = (
        "import torch, torchTensorRef\n"
        "tm = torchTensorRef.tensorsManager\n"
        "tm.device = 'sim'; tm.strategy = 'flow'; tm.budget = tm.outside_bytes() + 3 * 2**20\n"
        "a = [torch.ones(256 * 1024) for _ in range(4)]\n"
        "for _ in range(4):\n"
        "    for t in a: t.add_(1)\n"
        "assert tm.stats()['pinned_bytes'] > 0\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


def test_a_pin_the_system_refuses_is_counted_and_the_copy_stays_pageable(monkeypatch):
    # (a pin refused, by locked-memory limits or a device with no pinned allocator, was
    # swallowed: the host copy stayed pageable and was never prefetched, and nothing said so)
    empty = torchTensorRef.core.raw.empty

    def refusing(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("cudaHostAlloc failed: out of memory")  # (what a locked-memory limit gives)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torchTensorRef.core.raw, "empty", refusing)
    memory = PinnedMemory(emulated=False, limit=64 * KIB)
    with torchTensorRef.disabled():
        src = torch.arange(100, dtype=torch.uint8)
    assert memory.allocate(1000) is None and memory.staged(src) is None
    assert memory.failed == 2 and memory.used == 0
    # the manager's own pins: none refused in this process (emulated on "sim"; real on CUDA,
    # where a refusal would leave its blocks unprefetched)
    assert tm.stats()["pin_failures"] == tm.backend.pinned.failed == 0
