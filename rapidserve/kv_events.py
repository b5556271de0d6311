"""vLLM-compatible KV cache events: the wire structs, vLLM's block hash, and the log a BlockManager fills.

A KV-aware router (llm-d's KV cache manager, Dynamo's, NVIDIA's or SGLang's routers...) subscribes to each
replica's events and keeps an index of which replica holds which prefix blocks; it hashes an incoming prompt
the way vLLM does and sends the request where most of its leading blocks are cached. So the events carry
vLLM's hashes, not the BlockManager's own (BLAKE2b, salted with the model: block_manager.py).

The hash (vLLM v1's `hash_block_tokens` with its default `--prefix-caching-hash-algo sha256`): block i of a
prompt hashes to ``sha256(pickle.dumps((parent, tuple(tokens of block i), None), protocol=5))``, where
`parent` is block i-1's hash, and for the first block the seed NONE_HASH: sha256 of the pickled string
$PYTHONHASHSEED, or 32 random bytes when it is unset (then no router can reproduce the hashes, as with vLLM:
set PYTHONHASHSEED on every replica and router). rapidserve imports no pickle module (tests/test_supervision.py):
`pickle5` writes CPython's exact protocol-5 bytes for the few types a block hash pickles, and tests compare it
with `pickle.dumps` byte for byte. An event names a block by the low 64 bits of its hash as an unsigned integer
(vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).

The wire (vllm/distributed/kv_events.py): each ZMQ message is three frames [topic, sequence number (8 bytes,
big-endian), payload], the payload a msgpack `KVEventBatch` [ts, [event, ...], data_parallel_rank], each event an
array whose first item is its tag: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]. This is the array
layout vLLM's routers decode (msgspec `array_like` structs); the trailing `lora_name` is the newest field of that
layout (decoders of the older six-field layout ignore it). vLLM's newest sources declare the events as tagged
maps instead (structs without `array_like`); this module sends the array layout.

When (the BlockManager's hooks, `KVEventLog`): a full block registered in the prefix cache (its K/V written) is
stored, a contiguous run of them in one BlockStored whose `parent_block_hash` is the block before the run (None
for a prompt's first block); a registered block evicted (its content about to be overwritten) or forgotten is
removed; a content registered twice (two requests computed the same prefix at once) is announced once.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence

import msgspec

MEDIUM_GPU = "GPU"  # where the blocks are (vLLM's medium): the KV pool, on the GPU or, here, on the CPU alike
_U64 = (1 << 64) - 1


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (vLLM's tagged, array-like structs)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: wall-clock `ts` (time.time()), the events in order, the engine's rank."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# ---- vLLM's block hash ------------------------------------------------------------------------------------
def pickle5(obj: object) -> bytes:
    """CPython's ``pickle.dumps(obj, protocol=5)``, byte for byte, for None, int, bytes, str and tuples of those
    (each object pickled once: no shared references). TypeError for anything else."""
    body = bytearray()
    _pickle_into(body, obj)
    body += b"."  # STOP
    if len(body) >= 64 * 1024:  # CPython would split the frame here; a block hash never gets near
        raise ValueError(f"pickle5: {len(body)} bytes is more than one frame")
    frame = b"\x95" + struct.pack("<Q", len(body)) if len(body) >= 4 else b""
    return b"\x80\x05" + frame + bytes(body)


def _pickle_into(out: bytearray, obj: object) -> None:
    if obj is None:
        out += b"N"
    elif type(obj) is int:
        if 0 <= obj <= 0xFF:
            out += b"K" + bytes((obj,))
        elif 0 <= obj <= 0xFFFF:
            out += b"M" + struct.pack("<H", obj)
        elif -(1 << 31) <= obj < (1 << 31):
            out += b"J" + struct.pack("<i", obj)
        else:  # LONG1: little-endian two's complement, as pickle.encode_long
            n = (obj.bit_length() >> 3) + 1
            raw = obj.to_bytes(n, "little", signed=True)
            if obj < 0 and n > 1 and raw[-1] == 0xFF and raw[-2] & 0x80:
                raw = raw[:-1]
            out += b"\x8a" + bytes((len(raw),)) + raw
    elif type(obj) is bytes:
        out += (b"C" + bytes((len(obj),)) if len(obj) < 256 else b"B" + struct.pack("<I", len(obj))) + obj
        out += b"\x94"  # MEMOIZE
    elif type(obj) is str:
        raw = obj.encode("utf-8", "surrogatepass")
        out += (b"\x8c" + bytes((len(raw),)) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))) + raw
        out += b"\x94"
    elif type(obj) is tuple:
        if not obj:
            out += b")"  # EMPTY_TUPLE (not memoized)
            return
        if len(obj) > 3:
            out += b"("  # MARK
        for item in obj:
            _pickle_into(out, item)
        out += b"t" if len(obj) > 3 else (b"\x85", b"\x86", b"\x87")[len(obj) - 1]
        out += b"\x94"
    else:
        raise TypeError(f"pickle5: {type(obj).__name__} is not one of the types a block hash pickles")


def sha256_pickle(obj: object) -> bytes:
    """vLLM's `sha256` hash function (vllm/utils/hashing.py): sha256 of the object pickled with protocol 5."""
    return hashlib.sha256(pickle5(obj)).digest()


def make_none_hash(seed: str | None) -> bytes:
    """vLLM's NONE_HASH, the seed of a prompt's first block: sha256 of `seed` ($PYTHONHASHSEED), or 32 random
    bytes when there is none."""
    return sha256_pickle(seed) if seed is not None else os.urandom(32)


def vllm_block_hash(parent: bytes | None, tokens: Sequence[int], none_hash: bytes) -> bytes:
    """vLLM's `hash_block_tokens` (no extra keys: no LoRA, no multimodal input, no cache salt)."""
    return sha256_pickle((parent or none_hash, tuple(int(t) for t in tokens), None))


def external(block_hash: bytes) -> int:
    """How an event names a block: the low 64 bits of its hash, unsigned (vLLM's maybe_convert_block_hash)."""
    return int.from_bytes(block_hash, "big") & _U64


# ---- the log a BlockManager fills ---------------------------------------------------------------------------
class KVEventLog:
    """The events of one BlockManager since the last `drain`, and vLLM's hash of each registered block.

    The BlockManager calls `stored` when it registers full blocks, `removed` when it forgets one; the worker that
    owns it drains the log once per loop turn and sends the events to the router (engine/messages.py KVEvents).
    Keyed by the BlockManager's own hash of a registered block (which, like vLLM's, covers the whole prefix), the
    log keeps vLLM's hash of that block, so a block whose parent is registered hashes in one step; a parent no
    longer registered is recomputed from the nearest registered block before it."""

    def __init__(self, block_size: int, none_hash: bytes) -> None:
        if len(none_hash) == 0:
            raise ValueError("none_hash must be set (make_none_hash)")
        self.block_size = block_size
        self.none_hash = none_hash
        self.events: list[KVEvent] = []
        self._vllm: dict[bytes, bytes] = {}  # registered block's BlockManager hash -> vLLM's hash of it

    def __len__(self) -> int:
        return len(self.events)

    def stored(self, chain: Sequence[bytes], token_ids: Sequence[int], new: Sequence[int]) -> None:
        """The sequence's full blocks `new` (ascending indices; `chain`: the BlockManager's hashes of its full
        blocks, `token_ids`: its tokens) were registered: one BlockStored per contiguous run."""
        start = 0
        for k in range(1, len(new) + 1):
            if k == len(new) or new[k] != new[k - 1] + 1:
                self._store_run(chain, token_ids, new[start], new[k - 1])
                start = k

    def _store_run(self, chain: Sequence[bytes], token_ids: Sequence[int], first: int, last: int) -> None:
        bs = self.block_size
        parent = self._hash_at(chain, token_ids, first - 1)
        h, hashes = parent, []
        for i in range(first, last + 1):
            h = vllm_block_hash(h, token_ids[i * bs:(i + 1) * bs], self.none_hash)
            self._vllm[chain[i]] = h
            hashes.append(external(h))
        self.events.append(BlockStored(hashes, None if parent is None else external(parent),
                                       [int(t) for t in token_ids[first * bs:(last + 1) * bs]], bs, None,
                                       MEDIUM_GPU, None))

    def _hash_at(self, chain: Sequence[bytes], token_ids: Sequence[int], i: int) -> bytes | None:
        """vLLM's hash of full block `i` (None for i = -1: before the first block)."""
        j = i
        while j >= 0 and chain[j] not in self._vllm:
            j -= 1
        h = self._vllm[chain[j]] if j >= 0 else None
        bs = self.block_size
        for k in range(j + 1, i + 1):
            h = vllm_block_hash(h, token_ids[k * bs:(k + 1) * bs], self.none_hash)
        return h

    def removed(self, block_hash: bytes) -> None:
        """The registered block of this BlockManager hash was evicted or forgotten (runs of them share one event)."""
        h = self._vllm.pop(block_hash, None)
        if h is None:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(external(h))
        else:
            self.events.append(BlockRemoved([external(h)], MEDIUM_GPU))

    def cleared(self) -> None:
        """Every registered block is gone."""
        self._vllm.clear()
        self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out


def split_events(events: Sequence[KVEvent], max_items: int) -> list[list[KVEvent]]:
    """`events` in order, in groups of at most `max_items` token ids and hashes each (one ring message each; a
    single block may exceed it); a BlockStored larger than that is cut at block boundaries into several, each
    naming the last block of the one before as its parent, as separate registrations would; a BlockRemoved is
    cut likewise."""
    groups: list[list[KVEvent]] = [[]]
    size = 0
    for e in events:
        for piece in _pieces(e, max_items):
            cost = _cost(piece)
            if size and size + cost > max_items:
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += cost
    return [g for g in groups if g]


def _cost(e: KVEvent) -> int:
    if isinstance(e, BlockStored):
        return 1 + len(e.token_ids) + len(e.block_hashes)
    return 1 + len(e.block_hashes) if isinstance(e, BlockRemoved) else 1


def _pieces(e: KVEvent, max_items: int) -> list[KVEvent]:
    if _cost(e) <= max_items:
        return [e]
    if isinstance(e, BlockRemoved):
        per = max(1, max_items - 1)
        return [BlockRemoved(e.block_hashes[i:i + per], e.medium) for i in range(0, len(e.block_hashes), per)]
    assert isinstance(e, BlockStored)
    bs = e.block_size
    per = max(1, (max_items - 1) // (bs + 1))  # blocks per piece
    out: list[KVEvent] = []
    parent = e.parent_block_hash
    for i in range(0, len(e.block_hashes), per):
        hashes = e.block_hashes[i:i + per]
        out.append(BlockStored(hashes, parent, e.token_ids[i * bs:(i + len(hashes)) * bs], bs, e.lora_id, e.medium,
                               e.lora_name))
        parent = hashes[-1]
    return out
