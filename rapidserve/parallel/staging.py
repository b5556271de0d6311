"""The prefill instance's own block allocator over its staging KV pool (disagg mode).

In disagg mode (engine/disagg.py) the prefill worker computes each prompt into a pool on its own GPU,
the staging pool, and copies the blocks it wrote into the decode pool's blocks named by KVReady. Only
the decode worker's BlockManager decides the decode pool's tables; the staging pool's blocks are
handed out here, one set per prefill job, held from the batch that first computes the job until the
job ends (done, failed or dropped) and then returned, after every copy out of them has landed.

Pure bookkeeping, no torch: an allocation takes all of its blocks or none (a job that does not fit
waits, and the pool is left as it was), the lowest free blocks first (so a job's blocks tend to be one
run), and freeing an owner twice or one that holds nothing returns nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable


class StagingAllocator:
    """Blocks 0 .. num_blocks - 1 of a staging pool, held per owner (a prefill job's key)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a staging pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: the lowest free block first
        self._held: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_blocks - len(self._free)

    def owners(self) -> list[Hashable]:
        return list(self._held)

    def held(self, owner: Hashable) -> list[int] | None:
        """The blocks `owner` holds, in the order they were given (None: it holds none)."""
        blocks = self._held.get(owner)
        return None if blocks is None else list(blocks)

    def fits(self, n: int) -> bool:
        """Whether `n` blocks could ever be allocated here (with every block free)."""
        return 0 <= n <= self.num_blocks

    def allocate(self, owner: Hashable, n: int) -> list[int] | None:
        """`n` blocks for `owner`, or None when fewer are free (then nothing is taken). An owner holds
        one allocation at a time: a second one before `free(owner)` is a bug (ValueError)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if owner in self._held:
            raise ValueError(f"{owner!r} already holds staging blocks {self._held[owner]}")
        if n > len(self._free):
            return None
        blocks = [heapq.heappop(self._free) for _ in range(n)]
        self._held[owner] = blocks
        return list(blocks)

    def free(self, owner: Hashable) -> int:
        """Return `owner`'s blocks to the pool; how many (0 when it held none, e.g. freed already)."""
        blocks = self._held.pop(owner, None)
        if blocks is None:
            return 0
        for b in blocks:
            heapq.heappush(self._free, b)
        return len(blocks)
