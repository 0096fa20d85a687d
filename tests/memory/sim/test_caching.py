"""The emulation of PyTorch's CUDA caching allocator (``memory/sim/caching.py``): what it
counts for each allocation follows the allocator's rules for pools, splits and merges."""

from __future__ import annotations

from torchTensorRef.memory.sim.caching import (LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE,
                                               CachingAllocator, round_size, segment_size)

MIB = 2**20


def test_requests_are_rounded_and_make_the_allocator_s_segments():
    assert [round_size(n) for n in (1, 512, 513, 3000)] == [512, 512, 1024, 3072]
    assert segment_size(round_size(1)) == SMALL_BUFFER
    assert segment_size(SMALL_SIZE) == SMALL_BUFFER
    assert segment_size(SMALL_SIZE + MIN_BLOCK) == LARGE_BUFFER
    assert segment_size(11 * MIB + 1024) == 12 * MIB


def test_a_small_request_is_split_off_exactly_and_a_large_one_keeps_a_rest_of_at_most_1_mib():
    a = CachingAllocator()
    small = a.malloc(1000)
    assert small.size == 1024 and a.reserved == SMALL_BUFFER
    big = a.malloc(11 * MIB + 512)  # a 12 MiB segment; the rest (1 MiB - 512) stays with it
    assert big.size == 12 * MIB
    other = a.malloc(10 * MIB + 512)  # a 12 MiB segment; the rest (2 MiB - 512) is split off
    assert other.size == 10 * MIB + 512
    assert a.allocated == 1024 + 12 * MIB + 10 * MIB + 512


def test_a_large_request_served_from_a_cached_block_is_counted_at_the_whole_block():
    a = CachingAllocator()
    first, second = a.malloc(3 * MIB), a.malloc(17 * MIB)  # one 20 MiB segment, wholly used
    a.free(first)
    assert a.allocated == 17 * MIB
    reused = a.malloc(2 * MIB + 512 * 1024)  # the free 3 MiB block fits; its rest is 0.5 MiB
    assert reused.ptr == first.ptr and reused.size == 3 * MIB
    assert a.allocated == 20 * MIB and a.reserved == LARGE_BUFFER
    a.free(reused)
    smaller = a.malloc(MIB + 512)  # a rest of more than 1 MiB is split off
    assert smaller.size == MIB + 512
    assert second.allocated


def test_freed_neighbours_merge_and_the_best_fitting_block_is_taken():
    a = CachingAllocator()
    x, gap, z, kept = a.malloc(4 * MIB), a.malloc(2 * MIB), a.malloc(6 * MIB), a.malloc(8 * MIB)
    a.free(x)
    a.free(z)
    got = a.malloc(4 * MIB)
    assert got.ptr == x.ptr and got.size == 4 * MIB  # (the 4 MiB block fits best, not the 6 MiB one)
    a.free(got)
    a.free(gap)  # merges with both free neighbours: one free 12 MiB block
    merged = a.malloc(11 * MIB + 512 * 1024)
    assert merged.ptr == x.ptr and merged.size == 12 * MIB
    assert a.allocated == 12 * MIB + 8 * MIB and kept.allocated


def test_each_stream_has_its_own_pools_and_wholly_free_segments_are_released():
    a = CachingAllocator()
    block = a.malloc(2 * MIB, stream="copy")
    a.free(block)
    again = a.malloc(2 * MIB)  # the default stream does not reuse the copy stream's segment
    assert again.ptr != block.ptr and a.reserved == 2 * LARGE_BUFFER
    a.free(again)
    a.empty_cache()
    assert a.reserved == 0 and a.allocated == 0
