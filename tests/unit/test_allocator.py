"""The caching-allocator model: pools, segment sizes, splitting, best fit, merging."""

from __future__ import annotations

from memfit.memory.allocator import CachingAllocatorModel

KiB, MiB = 1024, 1024**2


def test_small_requests_share_a_two_mib_segment() -> None:
    model = CachingAllocatorModel()
    sizes = [model.allocate(key, nbytes) for key, nbytes in enumerate([1, 4, 513, 100 * KiB])]
    assert sizes == [512, 512, 1024, 100 * KiB]
    assert model.reserved_bytes == 2 * MiB and model.allocated_bytes == sum(sizes)


def test_large_requests_use_twenty_mib_segments_below_ten_mib() -> None:
    model = CachingAllocatorModel()
    model.allocate(0, 3 * MiB)
    model.allocate(1, 3 * MiB)
    assert model.reserved_bytes == 20 * MiB  # both from one 20 MiB segment
    model.allocate(2, 11 * MiB + 1)  # fits the 14 MiB left in that segment
    assert model.reserved_bytes == 20 * MiB
    model.allocate(3, 15 * MiB + 1)
    assert model.reserved_bytes == 20 * MiB + 16 * MiB  # rounded up to 2 MiB, a segment of its own
    model.allocate(4, 1 * MiB)  # exactly 1 MiB is still a small request
    assert model.reserved_bytes == 38 * MiB


def test_freed_blocks_fragment_until_their_neighbours_are_free() -> None:
    model = CachingAllocatorModel()
    for key in range(4):
        model.allocate(key, 5 * MiB)  # fills one 20 MiB segment
    model.free(0)
    model.free(2)  # 10 MiB free, in two separate 5 MiB holes
    model.allocate(4, 8 * MiB)
    assert model.reserved_bytes == 40 * MiB  # fragmentation: a new segment
    model.free(1)  # 0, 1, 2 merge into one 15 MiB block
    model.allocate(5, 14 * MiB)
    assert model.reserved_bytes == 40 * MiB
    assert model.peak_reserved_bytes == 40 * MiB


def test_best_fit_and_the_unsplit_remainder_counts_as_allocated() -> None:
    model = CachingAllocatorModel()
    model.allocate(0, 3 * MiB)
    model.allocate(1, 17 * MiB)  # the exact rest of the segment
    model.allocate(2, 4 * MiB)  # a second segment; 16 MiB free there
    model.free(0)  # a 3 MiB hole in the first segment
    size = model.allocate(3, 2 * MiB + 512 * KiB)  # best fit is the hole; 0.5 MiB left: too little to split
    assert size == 3 * MiB
    assert model.reserved_bytes == 40 * MiB
    assert model.allocated_bytes == 17 * MiB + 4 * MiB + 3 * MiB
    model.free(3)
    model.free(2)
    assert model.allocated_bytes == 17 * MiB and model.peak_allocated_bytes == 24 * MiB
