"""Shared helpers for the decode scheduler's tests (`test_decode_scheduler*.py`), on CPU against a small BlockManager.

Constants (block size, EOS, a stop token, an ordinary token, the prompts' first token, the cache's salt); `make`
(a scheduler), `new` / `params` (requests); `check`, the scheduler's invariants between the worker's calls; and
steps that check them after each call: `admit` (also checking each KVReady), `answer` (prefill's PrefillDone),
`start` (add, admit and answer), `launch` / `land` / `step` (a decode step); `Scene` (a scheduler with r0 in
some state and r9 running beside it) and `finish_all` (end everything, then nothing may hold a block).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rapidserve.block_manager import BlockManager, blocks_for
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, DecodeScheduler, StepBatch
from rapidserve.sampling_params import SamplingParams

BS = 4  # tokens per block
EOS = 2
STOP = 7  # a stop token id, for requests that ask for it
TOK = 20  # an ordinary token
PROMPT0 = 10  # prompts are 10, 11, ...: never EOS or STOP
SALT = b"test-model"  # the prefix cache's salt


# ---- helpers -------------------------------------------------------------------------------------
def params(max_tokens: int | None = 100, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def new(i: int, n: int = 4, p: SamplingParams | None = None) -> m.NewRequest:
    return m.NewRequest(f"r{i}", list(range(PROMPT0, PROMPT0 + n)), p or params(), 0.0)


def make(num_blocks: int = 32, max_seqs: int = 8, watermark: float = 0.0, cap: int | None = None,
         caching: bool = False, share_min: int | None = None) -> DecodeScheduler:
    """A scheduler; `share_min`: its share_min_tokens (default: the engine's, far above these tests' prompts)."""
    extra = {} if share_min is None else {"share_min_tokens": share_min}
    return DecodeScheduler(BlockManager(num_blocks, BS, watermark, enable_caching=caching, salt=SALT), max_seqs,
                           (EOS,), cap or num_blocks * BS, **extra)


def ids(reqs: Iterable[DecodeRequest] | Iterable[m.KVReady] | Iterable[m.NewRequest]) -> list[str]:
    return [r.req_id for r in reqs]


def fin(s: DecodeScheduler) -> list[str]:
    """The Finished messages since the last call, as "id:reason" (the worker publishes and clears them)."""
    out = [f"{f.req_id}:{f.reason}" for f in s.finished]
    s.finished.clear()
    return out


def check(s: DecodeScheduler) -> None:
    """Invariants that hold between the worker's calls (inflight <= 1: no launch awaiting its predecessor)."""
    b = s.blocks
    b.check()
    tables = b._tables
    assert tables.keys() <= s.reqs.keys(), "a block is owned by a request the scheduler no longer knows"
    held = {blk for t in tables.values() for blk in t}
    assert len(held) + b.num_free == b.num_blocks
    # the prefix cache: only registered blocks are shared (hits are; registration is undone only when a free
    # block is taken), and without the cache nothing is registered or shared
    assert all(b._ref[blk] == 1 or blk in b._hash_of for blk in held), "a block is shared but not in the cache"
    assert b.enable_caching or (not b._hash_of and max(b._ref) <= 1)
    waiting, running, chunking = set(map(id, s.waiting)), set(map(id, s.running)), set(map(id, s.chunking))
    assert all(r.state == "waiting" for r in s.waiting) and len(waiting) == len(s.waiting)
    assert all(r.state == "running" for r in s.running) and len(running) == len(s.running)
    assert all(r.state == "chunking" for r in s.chunking) and len(chunking) == len(s.chunking)
    assert [r.order for r in s.chunking] == sorted(r.order for r in s.chunking), "chunking: admission order"
    assert len(s.running) + s.num_prefilling + len(s.chunking) <= s.max_seqs
    known = {id(r) for r in s.reqs.values()}
    assert waiting <= known and running <= known and chunking <= known
    for i, r in s.reqs.items():  # (`i in tables`: the request holds blocks)
        assert r.req_id == i and 0 <= r.inflight <= 1 and 0 <= r.chunks_inflight <= 1
        if r.state == "waiting":
            assert i not in tables and id(r) in waiting and not r.writing and not r.aborting
            continue
        if r.state == "prefilling":  # exactly the blocks of its KVReady, which prefill writes
            assert len(tables[i]) == blocks_for(r.num_tokens, BS) and not r.writing
        elif r.state == "chunking":  # the blocks of all its tokens, computed here a chunk at a time
            assert id(r) in chunking and not r.aborting and r.inflight == 0
            assert len(tables[i]) == blocks_for(r.num_tokens, BS) and r.cached <= r.computed < r.num_tokens
            for blk in tables[i][r.computed // BS:]:  # written next
                assert b._ref[blk] == 1 and blk not in b._hash_of, f"{i}: block {blk} is written next, yet shared"
        elif r.state == "running":  # K/V of all but its newest token, and of the step in flight
            assert id(r) in running and not r.aborting
            assert blocks_for(r.tokens_needed - 1, BS) <= len(tables[i]) <= blocks_for(r.tokens_needed, BS)
        else:  # ended, but a step in flight still writes its blocks, or prefill owes the answer to a Drop
            assert r.state == "done"
            assert (r.writing and i in tables) or (r.drop_pending and not r.writing and i not in tables)
        if i in tables:  # from its newest token on, blocks are written next (by prefill or a step): its own, uncached
            for blk in tables[i][(r.num_tokens - 1) // BS:]:
                assert b._ref[blk] == 1 and blk not in b._hash_of, f"{i}: block {blk} is written next, yet shared"


def answer(s: DecodeScheduler, kv: m.KVReady, token: int = TOK, reason: str | None = None) -> m.TokenOut | None:
    """Prefill's PrefillDone for this KVReady: the first token (index = outputs so far)."""
    out = s.prefill_done(m.PrefillDone(kv.req_id, kv.attempt, m.TokenOut(kv.req_id, len(kv.outputs), token, None,
                                                                         None, reason)))
    check(s)
    return out


def admit(s: DecodeScheduler) -> list[m.KVReady]:
    kvs = s.admit()
    check(s)
    for kv in kvs:  # the blocks handed over are the request's table, covering all its tokens
        r = s.reqs[kv.req_id]
        assert kv.request is r.request and kv.block_ids == s.blocks.table(kv.req_id)
        assert len(kv.block_ids) == blocks_for(r.num_tokens, BS) and kv.outputs == r.outputs
        assert kv.outputs is not r.outputs and kv.attempt == r.attempt
        # the leading full blocks found in the cache (leaving a token to compute), then those a prompt chunked here
        # wrote before a split handed it over (hand_over: up to its last full block), then fresh ones for prefill
        c, st, b = kv.cached_tokens, kv.start_tokens, s.blocks
        assert c % BS == 0 and 0 <= c < r.num_tokens and (c == 0 or b.enable_caching)
        assert st % BS == 0 and c <= st < r.num_tokens and (st == c or r.handed) and r.computed == st
        assert all(blk in b._hash_of for blk in kv.block_ids[:c // BS])
        assert all(b._ref[blk] == 1 and blk not in b._hash_of for blk in kv.block_ids[st // BS:])
    return kvs


def start(s: DecodeScheduler, *reqs: m.NewRequest) -> list[m.KVReady]:
    """Add, admit and answer: the requests run, each with its first token."""
    for r in reqs:
        s.add(r)
    kvs = admit(s)
    assert ids(kvs) == ids(reqs)
    for kv in kvs:
        assert answer(s, kv) is not None
    return kvs


def launch(s: DecodeScheduler, quiet: bool = True) -> list[DecodeRequest]:
    batch = s.schedule(quiet)
    assert batch is not None
    check(s)
    for r in batch:
        assert len(s.blocks.table(r.req_id)) == blocks_for(r.tokens_needed, BS)
    s.launched(batch)
    return batch


def land(s: DecodeScheduler, batch: list[DecodeRequest], token: int | list[int] = TOK) -> list[m.TokenOut]:
    toks = token if isinstance(token, list) else [token] * len(batch)
    out = s.record(batch, [(t, -0.5, [(t, -0.5)], 1) for t in toks])
    check(s)
    return out


def step(s: DecodeScheduler, token: int | list[int] = TOK) -> list[m.TokenOut]:
    return land(s, launch(s), token)


def table(s: DecodeScheduler, rid: str) -> list[int]:
    return list(s.blocks.table(rid))


def all_free(s: DecodeScheduler) -> bool:
    return not s.reqs and not s.waiting and not s.running and not s.chunking and \
        s.blocks.num_free == s.blocks.num_blocks


# ---- scenes: r0 in a given state, r9 running beside it (`scene_*` in test_decode_scheduler.py) ---
@dataclass
class Scene:
    s: DecodeScheduler
    kv: m.KVReady | None = None  # r0's KVReady, while prefill holds it
    r0: DecodeRequest | None = None  # r0, once the scheduler has let go of it
    inflight: list[DecodeRequest] | None = None  # the step in flight


def finish_all(sc: Scene) -> None:
    """Land what is in flight, end everything: nothing may be left holding blocks."""
    s = sc.s
    if sc.inflight is not None:
        land(s, sc.inflight)
    for rid in list(s.reqs):
        s.abort(rid)
        if rid in s.reqs and s.reqs[rid].drop_pending:
            s.dropped(rid)  # prefill answers every Drop
    check(s)
    assert all_free(s)


# ---- fused steps (DecodeScheduler.plan): decodes, then prompt chunks computed in the decode worker ---------
def fuse(s: DecodeScheduler, chunk_tokens: int, step_tokens: int = 1 << 20, quiet: bool = True,
         hold: frozenset[str] = frozenset(), now: float = 0.0) -> StepBatch:
    """Plan and launch a fused step, checking its shape: decode rows grown, chunks in order within both budgets,
    each chunk starting where its request's computed tokens end."""
    batch = s.plan(chunk_tokens, step_tokens, quiet, hold, now)
    assert batch is not None
    check(s)
    for r in batch.decode:
        assert r.state == "running" and len(s.blocks.table(r.req_id)) == blocks_for(r.tokens_needed, BS)
    assert batch.chunk_tokens <= chunk_tokens and len(batch.decode) + batch.chunk_tokens <= step_tokens
    for c in batch.chunks:
        assert c.req.state == "chunking" and c.start == c.req.computed and c.length > 0
        assert len(s.blocks.table(c.req.req_id)) * BS >= c.end and c.samples == (c.end == c.req.num_tokens)
    s.launched(batch, now)
    return batch


def land_fused(s: DecodeScheduler, batch: StepBatch, token: int | list[int] = TOK,
               landed: float = 0.0) -> list[m.TokenOut]:
    """A fused step lands: its sampled rows' tokens (decodes, then the chunks ending a prompt), then its chunks."""
    sampled = batch.sampled
    toks = token if isinstance(token, list) else [token] * len(sampled)
    out = s.record(sampled, [(t, -0.5, [(t, -0.5)], 1) for t in toks], landed)
    s.chunks_landed(batch.chunks)
    check(s)
    return out


def shape(batch: StepBatch) -> tuple[list[str], list[tuple[str, int, int, bool]]]:
    """A fused step as (decode ids, [(id, start, length, samples)])."""
    return ids(batch.decode), [(c.req.req_id, c.start, c.length, c.samples) for c in batch.chunks]
