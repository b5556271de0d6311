"""KV block manager: which physical blocks of the pool belong to which sequence.

Pure Python, no torch: the scheduler's decisions are tested on CPU against it.

Ownership: a block is either on the free list or in exactly one sequence's block table. Only the
process that owns this object (the decode worker in the two-process engine, the engine core in a
single process) changes block tables. `free` returns every block of a sequence at once; the caller
must only free once nothing can still write into those blocks (docs/architecture.md: prefill done or dropped).

The watermark keeps a few blocks back when admitting new sequences, so running sequences can still
grow by a block without immediately preempting someone.
"""

from __future__ import annotations

from collections import deque


class BlockManagerError(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark={watermark} must be in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def can_allocate(self, num_tokens: int) -> bool:
        """Room for a new sequence of `num_tokens` while keeping the watermark free."""
        return len(self._free) - blocks_for(num_tokens, self.block_size) >= self.watermark_blocks

    def can_admit(self, num_tokens: int, alone: bool) -> bool:
        """The admission rule of every scheduler: room for a new sequence's `num_tokens` while keeping
        the watermark free, or, when nothing else holds blocks (`alone`), room at all: the watermark
        never starves the only sequence."""
        return self.can_allocate(num_tokens) or (alone and len(self._free) * self.block_size >= num_tokens)

    def blocks_needed_to_grow(self, seq_id: str, new_len: int) -> int:
        return max(0, blocks_for(new_len, self.block_size) - len(self._tables[seq_id]))

    def can_grow(self, seq_id: str, new_len: int) -> bool:
        return self.blocks_needed_to_grow(seq_id, new_len) <= len(self._free)

    # ---- changes ---------------------------------------------------------------------------
    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        if seq_id in self._tables:
            raise BlockManagerError(f"sequence {seq_id!r} already holds blocks")
        n = blocks_for(num_tokens, self.block_size)
        if n > len(self._free):
            raise BlockManagerError(f"need {n} blocks for {seq_id!r}, {len(self._free)} free")
        table = [self._free.popleft() for _ in range(n)]
        self._tables[seq_id] = table
        return table

    def grow(self, seq_id: str, new_len: int) -> list[int]:
        """Make the table cover `new_len` tokens; returns the blocks added (usually none or one)."""
        table = self._tables[seq_id]
        n = self.blocks_needed_to_grow(seq_id, new_len)
        if n > len(self._free):
            raise BlockManagerError(f"need {n} more blocks for {seq_id!r}, {len(self._free)} free")
        added = [self._free.popleft() for _ in range(n)]
        table.extend(added)
        return added

    def free(self, seq_id: str) -> int:
        """Return all of a sequence's blocks to the free list; returns how many."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._free.extend(table)
        return len(table)

    def check(self) -> None:
        """Invariant: every block is free or owned by exactly one sequence."""
        owned = [b for t in self._tables.values() for b in t]
        all_blocks = owned + list(self._free)
        if sorted(all_blocks) != list(range(self.num_blocks)):
            raise BlockManagerError("block accounting broken: a block is lost or owned twice")
