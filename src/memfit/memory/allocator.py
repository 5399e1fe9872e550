"""A model of PyTorch's CUDA caching allocator, to predict ``memory_reserved`` from a trace.

``torch.cuda.memory_allocated`` counts the bytes of live blocks; ``memory_reserved`` counts the segments the
allocator obtained from ``cudaMalloc`` and keeps cached. The difference is fragmentation: a freed block can
only serve a request that fits into it. :class:`CachingAllocatorModel` replays the trace's allocations and
frees through the same rules as the default allocator (c10's ``CUDACachingAllocator``, no
``PYTORCH_CUDA_ALLOC_CONF`` settings, one stream):

- sizes are rounded up to 512 bytes;
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger requests from the large
  pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB otherwise;
- a request takes the best-fitting free block of its pool (smallest size, then lowest address) and splits
  it when the remainder is at least 512 bytes (small pool) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of its segment; segments are never returned (no
  ``empty_cache``), so the reserved peak is the reserved total at the end.

Trade-off: this is a replay of the policy, not of the real allocator. Not modelled: several streams, the
retry that frees cached segments when ``cudaMalloc`` fails (near the device limit, reserved can be lower
than predicted), ``expandable_segments`` and the allocator's settings. ``benchmarks/validate_estimator.py``
measures the remaining error on a real card.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_REQUEST = 1024**2
SMALL_SEGMENT = 2 * 1024**2
LARGE_SEGMENT = 20 * 1024**2
MIN_LARGE_ALLOC = 10 * 1024**2
ROUND_LARGE = 2 * 1024**2


@dataclass(eq=False, slots=True)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = field(default=None, repr=False)
    next: _Block | None = field(default=None, repr=False)


class CachingAllocatorModel:
    def __init__(self) -> None:
        self.reserved_bytes = 0
        self.allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_allocated_bytes = 0
        self._pools: dict[bool, list[tuple[int, int, int, _Block]]] = {True: [], False: []}
        """Free blocks per pool (``True``: small), sorted by (size, segment, offset)."""
        self._live: dict[Hashable, tuple[_Block, bool]] = {}
        self._segments = 0

    @staticmethod
    def round_size(nbytes: int) -> int:
        return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)

    def allocate(self, key: Hashable, nbytes: int) -> int:
        """Serve storage ``key`` of ``nbytes``; returns the block's size, which ``memory_allocated`` counts.

        That is the 512-rounded request, or more when a cached block is reused without splitting it.
        """
        size = self.round_size(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._pools[small]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index < len(pool):
            block = pool.pop(index)[3]
        else:
            block = self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_REQUEST:
            rest = _Block(block.segment, block.offset + size, remaining, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest, small)
        block.free = False
        self._live[key] = (block, small)
        self.allocated_bytes += block.size
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return block.size

    def free(self, key: Hashable) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        block, small = entry
        self.allocated_bytes -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour, small)
                block = self._merge(block, neighbour)
        self._insert(block, small)

    def _new_segment(self, size: int, small: bool) -> _Block:
        if small:
            segment_bytes = SMALL_SEGMENT
        elif size < MIN_LARGE_ALLOC:
            segment_bytes = LARGE_SEGMENT
        else:
            segment_bytes = -(-size // ROUND_LARGE) * ROUND_LARGE
        self._segments += 1
        self.reserved_bytes += segment_bytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return _Block(self._segments, 0, segment_bytes)

    def _insert(self, block: _Block, small: bool) -> None:
        bisect.insort(self._pools[small], (block.size, block.segment, block.offset, block))

    def _remove(self, block: _Block, small: bool) -> None:
        pool = self._pools[small]
        index = bisect.bisect_left(pool, (block.size, block.segment, block.offset))
        assert pool[index][3] is block
        pool.pop(index)

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour.next is block else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first
