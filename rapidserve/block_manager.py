"""KV block manager: which physical blocks of the pool belong to which sequence, and the prefix cache.

Pure Python, no torch: every scheduler's decisions are tested on CPU against it.

Ownership: a block is either on the free list (reference count 0) or in the block tables of the
sequences that use it (its reference count says how many). Only the process that owns this object
(the decode or hybrid worker, or the engine core in a single process) changes block tables. `free`
drops a sequence's references at once; the caller must only free once nothing can still write into
its blocks (docs/architecture.md: prefill done or dropped).

Prefix caching (`enable_caching`; the engines set it from `CacheConfig.enable_prefix_caching`, on by
default): a full block whose K/V are written is registered (`commit`) under a hash of its token ids
chained with the hash of the block before it (the chain starts from `salt`, e.g. the model's id, so
whatever changes the K/V changes the hash). A sequence admitted with `allocate_cached` shares the
blocks of the longest registered prefix of its full blocks (each such block's count goes up) and
gets fresh blocks for the rest; at least one token is always left to compute, so the step that
computes it yields the next token's logits. A shared block is never written: hits are full blocks,
writes go to positions past them. A block is registered only once its writes have landed (`commit`
with the count of computed tokens), so a block is never shared while it is being written. Blocks
whose count drops to 0 stay registered on the free list, in least-recently-freed order behind the
unregistered ones, and are evicted (their hash forgotten) only when an allocation takes them. Hashes
are BLAKE2b digests (not Python's hash), so prompts cannot be crafted to collide with another
tenant's blocks.

Pending blocks: `allocate_cached` also notes the hashes of the full prompt blocks a sequence is about to
write that no registered or pending block holds (`_pending`, hash -> the writer), until `commit` registers
them or `free` drops them. `pending_prefix` tells a scheduler how many tokens past a new sequence's cached
prefix are being written by a sequence in flight right now, so it can admit the new one after that write
lands and share the blocks instead of computing them twice. This index is advisory: nothing is shared
before `commit`.

The watermark keeps a few blocks back when admitting new sequences, so running sequences can still
grow by a block without immediately preempting someone.

KV events (`events`, a `kv_events.KVEventLog`, given when --kv-events-config asks for them): every block `commit`
registers is logged as stored, every registered block `_take` evicts or `reset_cache` forgets as removed. The log
hashes blocks as vLLM does; the owner of this object drains it (docs/architecture.md: KV events).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from rapidserve.kv_events import KVEventLog


class BlockManagerError(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of a full block: its token ids chained with the hash of the block before it."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, enable_caching: bool = False,
                 salt: bytes = b"", events: KVEventLog | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark={watermark} must be in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.enable_caching = enable_caching
        self.salt = salt
        self.events = events  # KV events of the prefix cache (None: none are collected)
        # Free blocks in the order allocations take them: unregistered first, then registered ones
        # from the least recently freed (evicting their hash).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._hash_of: dict[int, bytes] = {}  # registered block -> its hash
        self._block_of: dict[bytes, int] = {}  # hash -> registered block
        self._chains: dict[str, list[bytes]] = {}  # per sequence: hashes of its full blocks so far
        self._committed: dict[str, int] = {}  # per sequence: full blocks registered (or found registered)
        self._pending: dict[bytes, str] = {}  # hash of a full block being written -> the sequence writing it
        self._pending_of: dict[str, dict[bytes, None]] = {}  # per sequence: the hashes it holds in `_pending`
        self.pending_version = 0  # bumped whenever `_pending` loses entries: a waiter's answer may change
        self.queries = 0  # prompt tokens looked up in the cache (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def has(self, seq_id: str) -> bool:
        return seq_id in self._tables

    def can_allocate(self, num_tokens: int) -> bool:
        """Room for a new sequence of `num_tokens` while keeping the watermark free."""
        return len(self._free) - blocks_for(num_tokens, self.block_size) >= self.watermark_blocks

    def can_admit(self, num_tokens: int, alone: bool, seq_id: str | None = None,
                  token_ids: Sequence[int] | None = None) -> bool:
        """The admission rule of every scheduler: room for a new sequence's `num_tokens` while keeping
        the watermark free, or, when nothing else holds blocks (`alone`), room at all: the watermark
        never starves the only sequence. With its `token_ids`, cached prefix blocks in use by others
        cost nothing and free ones only leave the free list."""
        need = blocks_for(num_tokens, self.block_size)
        if token_ids is not None and seq_id is not None:
            hits = self._match(seq_id, token_ids)
            need -= sum(1 for b in hits if self._ref[b] > 0)
        free = len(self._free)
        return free - need >= self.watermark_blocks or (alone and free >= need)

    def blocks_needed_to_grow(self, seq_id: str, new_len: int) -> int:
        return max(0, blocks_for(new_len, self.block_size) - len(self._tables[seq_id]))

    def can_grow(self, seq_id: str, new_len: int) -> bool:
        return self.blocks_needed_to_grow(seq_id, new_len) <= len(self._free)

    def cached_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` an admission now would find cached (counts nothing, holds nothing)."""
        return len(self._match(seq_id, token_ids)) * self.block_size

    def pending_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Tokens right after the cached prefix of `token_ids` whose blocks another sequence is writing
        now (its prompt's blocks, allocated and not yet committed): an admission after that sequence's
        `commit` would find them cached. Counts only blocks a hit could take (one token left to compute)."""
        return self.lookahead(seq_id, token_ids)[1]

    def lookahead(self, seq_id: str, token_ids: Sequence[int]) -> tuple[int, int]:
        """`cached_prefix` and `pending_prefix` with one lookup (counts nothing, holds nothing)."""
        hits = len(self._match(seq_id, token_ids))
        if not self._pending:
            return hits * self.block_size, 0
        run = 0
        for h in self._chains[seq_id][hits:(len(token_ids) - 1) // self.block_size]:
            owner = self._pending.get(h)
            if owner is None or owner == seq_id:
                break
            run += 1
        return hits * self.block_size, run * self.block_size

    # ---- changes ---------------------------------------------------------------------------
    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Fresh blocks for `num_tokens` (no cache lookup)."""
        if seq_id in self._tables:
            raise BlockManagerError(f"sequence {seq_id!r} already holds blocks")
        n = blocks_for(num_tokens, self.block_size)
        if n > len(self._free):
            raise BlockManagerError(f"need {n} blocks for {seq_id!r}, {len(self._free)} free")
        table = [self._take() for _ in range(n)]
        self._tables[seq_id] = table
        return table

    def allocate_cached(self, seq_id: str, token_ids: Sequence[int], read: bool = True) -> tuple[list[int], int]:
        """Blocks for all of `token_ids`, sharing the longest cached prefix; returns the table and
        how many leading tokens are cached already (a multiple of the block size, < len(token_ids)).
        `read` False (vLLM's skip_reading_prefix_cache): nothing is looked up, every block is fresh (none is
        cached: 0), and the lookup counts nothing; its blocks are still registered as they are written."""
        if seq_id in self._tables:
            raise BlockManagerError(f"sequence {seq_id!r} already holds blocks")
        hits = self._match(seq_id, token_ids) if read else []
        n = blocks_for(len(token_ids), self.block_size)
        fresh = n - len(hits)
        if fresh + sum(1 for b in hits if self._ref[b] == 0) > len(self._free):
            raise BlockManagerError(f"need {fresh} fresh blocks for {seq_id!r}, {len(self._free)} free")
        for b in hits:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        table = hits + [self._take() for _ in range(fresh)]
        self._tables[seq_id] = table
        self._committed[seq_id] = len(hits)
        cached = len(hits) * self.block_size
        if self.enable_caching:
            if read:
                self.queries += len(token_ids)
                self.hits += cached
            chain = self._chain(seq_id, token_ids, len(token_ids) // self.block_size)
            mine = dict.fromkeys(h for h in chain[len(hits):] if h not in self._block_of and h not in self._pending)
            for h in mine:
                self._pending[h] = seq_id
            self._pending_of[seq_id] = mine
        return table, cached

    def unlookup(self, num_tokens: int, cached: int, read: bool = True) -> None:
        """Take back the counts of an `allocate_cached` whose admission was undone (the request waits
        again and will be looked up anew), so `queries`/`hits` count each admission once (`read`: as given
        to `allocate_cached`; False counted nothing)."""
        if self.enable_caching and read:
            self.queries -= num_tokens
            self.hits -= cached

    def grow(self, seq_id: str, new_len: int) -> list[int]:
        """Make the table cover `new_len` tokens; returns the blocks added (usually none or one)."""
        table = self._tables[seq_id]
        n = self.blocks_needed_to_grow(seq_id, new_len)
        if n > len(self._free):
            raise BlockManagerError(f"need {n} more blocks for {seq_id!r}, {len(self._free)} free")
        added = [self._take() for _ in range(n)]
        table.extend(added)
        return added

    def try_grow(self, seq_id: str, new_len: int) -> bool:
        """`grow` when the free blocks allow it (True, the table covers `new_len` tokens), else nothing (False): a
        scheduler's `can_grow` then `grow` in one look at the table (once per running sequence per step)."""
        n = self.blocks_needed_to_grow(seq_id, new_len)
        if n > len(self._free):
            return False
        if n:
            self._tables[seq_id].extend(self._take() for _ in range(n))
        return True

    def needs_commit(self, seq_id: str, num_computed: int) -> bool:
        """Whether `commit` with this count would register a block: a cheap test for the per-step
        callers, which then build the token list only when a block has filled up."""
        return (self.enable_caching and seq_id in self._tables
                and min(num_computed // self.block_size, len(self._tables[seq_id])) > self._committed.get(seq_id, 0))

    def commit(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """The K/V of the first `num_computed` of `token_ids` are written (the writes have landed, or are
        ordered before any read that a later admission could queue): register its full blocks."""
        if not self.enable_caching or seq_id not in self._tables:
            return
        table = self._tables[seq_id]
        n = min(num_computed // self.block_size, len(table))  # the chain may run further: only written blocks
        chain = self._chain(seq_id, token_ids, n)
        done = self._committed.get(seq_id, 0)
        new: list[int] = []
        for i in range(done, n):
            b, h = table[i], chain[i]
            if h not in self._block_of and b not in self._hash_of:  # else another block holds this content
                self._block_of[h] = b
                self._hash_of[b] = h
                new.append(i)
        if new and self.events is not None:
            self.events.stored(chain, token_ids, new)
        self._committed[seq_id] = max(done, n)
        if self._pending:  # these are written now (whoever was to write them: the content is registered)
            for h in chain[done:n]:
                owner = self._pending.pop(h, None)
                if owner is not None:
                    del self._pending_of[owner][h]
                    self.pending_version += 1

    def unpend(self, seq_id: str) -> None:
        """The sequence will not finish writing its prompt (aborted while prefilling): no one waits for it."""
        mine = self._pending_of.pop(seq_id, None)
        if mine:
            for h in mine:
                del self._pending[h]
            self.pending_version += 1

    def free(self, seq_id: str) -> int:
        """Drop all of a sequence's references; returns how many blocks it held. Blocks no one uses
        go back to the free list (registered ones keep their content until evicted)."""
        self._chains.pop(seq_id, None)
        self._committed.pop(seq_id, None)
        self.unpend(seq_id)
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        for b in reversed(table):  # the tail of a prefix is evicted before its head
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if b not in self._hash_of:
                    self._free.move_to_end(b, last=False)
        return len(table)

    def reset_cache(self) -> None:
        """Forget every registered block that no sequence uses (e.g. after the weights change)."""
        for b in [b for b in self._hash_of if self._ref[b] == 0]:
            h = self._hash_of.pop(b)
            del self._block_of[h]
            if self.events is not None:
                self.events.removed(h)

    def check(self) -> None:
        """Invariants: every block is free (count 0) or used by exactly as many tables as its count;
        the hash maps agree with each other."""
        uses = [0] * self.num_blocks
        for t in self._tables.values():
            for b in t:
                uses[b] += 1
        if uses != self._ref:
            raise BlockManagerError("block accounting broken: a reference count does not match the tables")
        if sorted(b for b in range(self.num_blocks) if self._ref[b] == 0) != sorted(self._free):
            raise BlockManagerError("block accounting broken: the free list does not hold exactly the unused blocks")
        if any(self._block_of.get(h) != b for b, h in self._hash_of.items()) or len(self._block_of) != len(
                self._hash_of):
            raise BlockManagerError("prefix cache broken: the hash maps disagree")
        pending = {(h, s) for s, hs in self._pending_of.items() for h in hs}
        if pending != set(self._pending.items()) or len(pending) != len(self._pending) or any(
                s not in self._tables or h in self._block_of for h, s in pending):
            raise BlockManagerError("prefix cache broken: a pending block is not one a live sequence writes")

    # ---- internals ---------------------------------------------------------------------------
    def _take(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self._hash_of.pop(b, None)
        if h is not None:  # evicted: its content is about to be overwritten
            del self._block_of[h]
            if self.events is not None:
                self.events.removed(h)
        self._ref[b] = 1
        return b

    def _chain(self, seq_id: str, token_ids: Sequence[int], n_blocks: int) -> list[bytes]:
        """Hashes of the first `n_blocks` full blocks of `token_ids`, kept per sequence (its tokens only
        grow at the end, so earlier hashes stay valid)."""
        chain = self._chains.setdefault(seq_id, [])
        bs = self.block_size
        while len(chain) < n_blocks:
            i = len(chain)
            chain.append(block_hash(chain[-1] if chain else self.salt, token_ids[i * bs:(i + 1) * bs]))
        return chain

    def _match(self, seq_id: str, token_ids: Sequence[int]) -> list[int]:
        """Blocks of the longest registered prefix of full blocks, leaving at least one token to compute."""
        if not self.enable_caching:
            return []
        hits: list[int] = []
        for h in self._chain(seq_id, token_ids, (len(token_ids) - 1) // self.block_size):
            b = self._block_of.get(h)
            if b is None:
                break
            hits.append(b)
        return hits
