"""The decode scheduler's prefix cache (`rapidserve/engine/decode_scheduler.py` over a caching BlockManager), on CPU.

Hits on repeated and shared prefixes (always leaving a token to compute), registration only once prefill's or a
step's writes landed, sharing through preemption and aborts, eviction order (unregistered blocks first, then the
least recently freed), and admission counting hits on blocks in use as free; each step checked against the
scheduler's invariants (`check`, in `decode_sched_fakes.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from rapidserve.block_manager import blocks_for
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, DecodeScheduler
from rapidserve.sampling_params import SamplingParams
from tests.decode_sched_fakes import (
    BS,
    PROMPT0,
    TOK,
    Scene,
    admit,
    all_free,
    answer,
    check,
    fin,
    finish_all,
    ids,
    land,
    launch,
    make,
    new,
    params,
    start,
    step,
    table,
)


# ---- 9. prefix caching --------------------------------------------------------------------------
def seq(n: int, base: int = PROMPT0) -> list[int]:
    return list(range(base, base + n))


def newp(i: int, prompt: list[int], p: SamplingParams | None = None) -> m.NewRequest:
    return m.NewRequest(f"r{i}", list(prompt), p or params(), 0.0)


def cached(s: DecodeScheduler) -> set[int]:
    """The registered blocks (in use or free)."""
    return set(s.blocks._hash_of)


def refs(s: DecodeScheduler, blocks: Iterable[int]) -> list[int]:
    return [s.blocks._ref[b] for b in blocks]


@pytest.mark.parametrize("first_running", [False, True], ids=["the first ended", "the first still running"])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 13])
def test_cache_a_repeated_prompt_hits_its_full_blocks_but_leaves_a_token(n: int, first_running: bool) -> None:
    s = make(num_blocks=16, caching=True)
    [kv0] = start(s, new(0, n))
    if not first_running:
        assert s.abort("r0") is False and fin(s) == ["r0:abort"]
    k = (n - 1) // BS  # full blocks before the last token
    assert cached(s) == set(kv0.block_ids[:n // BS])  # the prompt's full blocks, once prefill's writes landed
    free, reg = s.blocks.num_free, cached(s)
    s.add(new(1, n))
    [kv1] = admit(s)
    assert kv1.cached_tokens == k * BS and kv1.block_ids[:k] == kv0.block_ids[:k]
    assert not set(kv1.block_ids[k:]) & reg  # the rest are fresh: nothing cached was evicted for them
    if first_running:  # shared: only the fresh blocks leave the free list
        assert refs(s, kv0.block_ids[:k]) == [2] * k and not set(kv1.block_ids[k:]) & set(kv0.block_ids)
        assert free - s.blocks.num_free == blocks_for(n, BS) - k
    else:  # revived from the free list
        assert refs(s, kv0.block_ids[:k]) == [1] * k and free - s.blocks.num_free == blocks_for(n, BS)
    assert (s.blocks.queries, s.blocks.hits) == (2 * n, k * BS)
    st = s.stats("p", 0)
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (2 * n, k * BS)
    answer(s, kv1)
    step(s)
    finish_all(Scene(s))


PREFIXES = [
    # name, the second prompt (the first is seq(13), cached: its 3 full blocks), cached tokens
    ("identical", seq(13), 12),
    ("differs in the last token", seq(12) + [99], 12),
    ("differs in block 2", seq(9) + [99] + seq(3, PROMPT0 + 10), 8),
    ("differs at the end of block 1", seq(7) + [99] + seq(5, PROMPT0 + 8), 4),
    ("differs at the start of block 1", seq(4) + [99] + seq(8, PROMPT0 + 5), 4),
    ("differs at the end of block 0", seq(3) + [99] + seq(9, PROMPT0 + 4), 0),
    ("differs in the first token", [99] + seq(12, PROMPT0 + 1), 0),
    ("a shorter prefix, mid-block", seq(10), 8),
    ("a shorter prefix of whole blocks: its last token is computed", seq(8), 4),
    ("longer: only what is cached hits", seq(13) + [50, 51, 52], 12),
    ("much longer", seq(13) + seq(10, 50), 12),
    ("shorter than a block", seq(3), 0),
    ("exactly one block", seq(4), 0),
    ("the same tokens, shifted", seq(13, PROMPT0 + 1), 0),
]


@pytest.mark.parametrize("name,prompt,hit", PREFIXES, ids=[c[0] for c in PREFIXES])
def test_cache_a_shared_prefix_hits_its_full_blocks(name: str, prompt: list[int], hit: int) -> None:
    s = make(num_blocks=16, caching=True)
    [kv0] = start(s, new(0, 13))
    s.add(newp(1, prompt))
    [kv1] = admit(s)
    k = hit // BS
    assert kv1.cached_tokens == hit and kv1.block_ids[:k] == kv0.block_ids[:k]
    assert not set(kv1.block_ids[k:]) & set(kv0.block_ids)
    assert refs(s, kv0.block_ids) == [2] * k + [1] * (4 - k)
    answer(s, kv1)
    step(s)
    finish_all(Scene(s))


def test_cache_a_block_hits_only_after_the_same_prefix() -> None:
    """A block's hash covers every token before it: the same tokens after another prefix are no hit."""
    s = make(num_blocks=16, caching=True)
    x, y, z = seq(4, 30), seq(4, 40), seq(4, 50)
    [kv0] = start(s, newp(0, x + y + [99]))  # caches x, and y after x
    [kv1] = start(s, newp(1, z + x + [99]))  # caches z, and x after z
    assert len(cached(s)) == 4
    for i, prompt, hit in [(2, z + y + [99], kv1.block_ids[:1]), (3, x + x + [99], kv0.block_ids[:1]),
                           (4, y + [99], []), (5, z + x + y + [99], kv1.block_ids[:2])]:
        s.add(newp(i, prompt))
        [kv] = admit(s)
        assert kv.cached_tokens == len(hit) * BS and kv.block_ids[:len(hit)] == hit, prompt
        answer(s, kv)
    finish_all(Scene(s))


def test_cache_a_prompt_is_hit_only_once_its_prefill_is_done() -> None:
    """Blocks are registered when PrefillDone says prefill's writes landed: a request admitted while the first
    still prefills computes the prompt again, into its own blocks."""
    s = make(num_blocks=16, caching=True)
    p = seq(9)
    s.add(newp(0, p))
    s.add(newp(1, p))
    kv0, kv1 = admit(s)
    s.add(newp(2, p))
    [kv2] = admit(s)
    assert [kv.cached_tokens for kv in (kv0, kv1, kv2)] == [0, 0, 0] and not cached(s)
    assert len(set(kv0.block_ids) | set(kv1.block_ids) | set(kv2.block_ids)) == 9
    answer(s, kv0)
    assert cached(s) == set(kv0.block_ids[:2])
    s.add(newp(3, p))
    [kv3] = admit(s)
    assert kv3.cached_tokens == 8 and kv3.block_ids[:2] == kv0.block_ids[:2]
    answer(s, kv1)  # the same content is cached already, in r0's blocks: r1's are not registered
    answer(s, kv2)
    answer(s, kv3)
    assert cached(s) == set(kv0.block_ids[:2])
    s.add(newp(4, p))
    [kv4] = admit(s)
    assert kv4.block_ids[:2] == kv0.block_ids[:2] and refs(s, kv0.block_ids[:2]) == [3, 3]
    finish_all(Scene(s))


@pytest.mark.parametrize("one_ahead", [False, True], ids=["one step at a time", "one step ahead"])
def test_cache_decode_blocks_are_registered_as_their_steps_land(one_ahead: bool) -> None:
    s = make(num_blocks=16, caching=True)
    [kv0] = start(s, new(0, 5))
    r = s.reqs["r0"]
    assert cached(s) == {kv0.block_ids[0]}  # the second block holds 1 prompt token and the first output
    prev: list[DecodeRequest] | None = None
    for _ in range(10):
        batch = launch(s, quiet=prev is None)  # check(): the block a step writes is never registered
        if one_ahead:
            if prev is not None:
                land(s, prev, 30 + len(r.outputs))
            prev = batch
        else:
            land(s, batch, 30 + len(r.outputs))
        assert cached(s) == set(table(s, "r0")[:(r.num_tokens - 1) // BS])  # all K/V written but the newest's
    if prev is not None:
        land(s, prev, 30 + len(r.outputs))
    assert r.num_tokens == 16 and len(cached(s)) == 3
    # a prompt that is r0's prompt and outputs hits the blocks decode wrote
    s.add(newp(1, r.tokens[:14]))
    [kv1] = admit(s)
    assert kv1.cached_tokens == 12 and kv1.block_ids[:3] == table(s, "r0")[:3]
    answer(s, kv1)
    finish_all(Scene(s))


def test_cache_preempting_a_sharer_drops_only_its_references() -> None:
    """r0 and r1 share r0's prompt blocks; r1, admitted last, is preempted: r0 keeps the shared blocks; r1's own
    blocks stay cached until evicted, and its re-admission hits the ones left."""
    s = make(num_blocks=6, caching=True)
    p = seq(9)
    [kv0] = start(s, newp(0, p))
    [kv1] = start(s, newp(1, p))
    a, b = kv0.block_ids[:2]
    assert kv1.block_ids[:2] == [a, b] and kv1.cached_tokens == 8 and s.blocks.num_free == 2
    for k in range(7):  # 10 -> 17 tokens each, different outputs: 4 blocks each, the first 4 registered
        step(s, [40 + k, 60 + k])
    r1 = s.reqs["r1"]
    t0, t1 = table(s, "r0"), table(s, "r1")
    assert r1.num_tokens == 17 and s.blocks.num_free == 0 and cached(s) == set(t0) | set(t1)
    batch = s.schedule(quiet=True)  # both need a 5th block: r1 goes
    check(s)
    assert batch is not None and ids(batch) == ["r0"] and r1.state == "waiting" and s.num_preemptions == 1
    assert table(s, "r0")[:4] == t0 and refs(s, t0[:2]) == [1, 1] and {a, b} <= cached(s)  # r0 keeps them
    evicted = table(s, "r0")[4]
    assert evicted == t1[3]  # r0's new block: the least recently freed of r1's (freed tail first)
    assert t1[2] in cached(s) and s.blocks._ref[t1[2]] == 0 and evicted not in cached(s)
    s.launched(batch)
    land(s, batch)
    assert s.abort("r0") is False and fin(s) == ["r0:abort"]
    [kv] = admit(s)  # r1 again, with its outputs: its prompt blocks (r0's), its own block 2; block 3 was evicted
    assert kv.req_id == "r1" and kv.attempt == 1 and kv.cached_tokens == 12 and kv.block_ids[:3] == [a, b, t1[2]]
    answer(s, kv)
    assert r1.outputs[:8] == [TOK] + [60 + k for k in range(7)]
    finish_all(Scene(s))


@pytest.mark.parametrize("how", ["Dropped", "PrefillDone, Dropped", "PrefillFailed, Dropped"])
def test_cache_an_abort_while_prefilling_leaves_shared_blocks_to_their_other_user(how: str) -> None:
    s = make(num_blocks=8, caching=True)
    p = seq(13)
    [kv0] = start(s, newp(0, p))
    s.add(newp(1, p))
    [kv1] = admit(s)
    shared = kv0.block_ids[:3]
    assert kv1.block_ids[:3] == shared and refs(s, shared) == [2, 2, 2]
    assert s.abort("r1") is True
    if how.startswith("PrefillDone"):
        assert answer(s, kv1) is None
    elif how.startswith("PrefillFailed"):
        s.prefill_failed(m.PrefillFailed("r1", 0, "it broke"))
    s.dropped("r1")
    check(s)
    assert fin(s) == ["r1:abort"] and "r1" not in s.reqs
    assert table(s, "r0") == kv0.block_ids and refs(s, shared) == [1, 1, 1] and cached(s) == set(shared)
    assert kv1.block_ids[3] not in cached(s)  # what prefill wrote for an aborted request is not registered
    s.add(newp(2, p))
    [kv2] = admit(s)
    assert kv2.block_ids[:3] == shared and kv2.cached_tokens == 12
    answer(s, kv2)
    step(s)
    finish_all(Scene(s))


def singles(s: DecodeScheduler, first: int, n: int) -> list[int]:
    """Admit and run `n` one-token requests with prompts of their own: the blocks the free list gave them."""
    got = []
    for i in range(first, first + n):
        [kv] = start(s, newp(i, [200 + i]))
        assert kv.cached_tokens == 0
        got += kv.block_ids
    return got


def test_cache_eviction_takes_unregistered_blocks_first_then_the_least_recently_freed() -> None:
    s = make(num_blocks=10, max_seqs=16, caching=True)
    pa, pb = seq(9), seq(9, 50)
    s.add(newp(0, pa, params(max_tokens=1)))
    s.add(newp(1, pb, params(max_tokens=1)))
    ka, kb = admit(s)
    assert answer(s, ka, reason="length") is None  # ends with its first token: its 2 full blocks stay cached, free
    assert answer(s, kb, reason="length") is None  # ends later
    a0, a1, a2 = ka.block_ids
    b0, b1, b2 = kb.block_ids
    assert all_free(s) and cached(s) == {a0, a1, b0, b1}
    got = singles(s, 10, 6)  # the unregistered blocks go first: 4 never used, each prompt's partial one
    assert set(got) == set(range(10)) - {a0, a1, b0, b1} and cached(s) == {a0, a1, b0, b1}
    assert singles(s, 20, 1) == [a1]  # then the least recently freed: r0's, its tail first
    assert cached(s) == {a0, b0, b1}
    s.add(newp(2, pa))
    [kv] = admit(s)  # r0's head still hits; its 2 fresh blocks evict r1's, tail first
    assert kv.cached_tokens == 4 and kv.block_ids == [a0, b1, b0] and cached(s) == {a0}
    finish_all(Scene(s))


def test_cache_a_revived_block_is_freed_again_as_the_most_recent() -> None:
    s = make(num_blocks=10, max_seqs=16, caching=True)
    heads = []
    for i, pr in enumerate([seq(9), seq(9, 50), seq(9)]):  # r2 hits r0's blocks, uses them and frees them again
        s.add(newp(i, pr, params(max_tokens=1)))
        [kv] = admit(s)
        assert answer(s, kv, reason="length") is None
        heads.append(kv.block_ids[:2])
    ha, hb, ha2 = heads
    assert ha2 == ha and cached(s) == set(ha + hb)
    singles(s, 10, 6)  # the unregistered blocks
    assert singles(s, 20, 2) == [hb[1], hb[0]]  # r1's are now the least recently freed
    assert cached(s) == set(ha)
    finish_all(Scene(s))


CAN_ADMIT = [
    # name, num_blocks, watermark, r0 (prompt seq(13): 3 full blocks) still running, caching, r1 (the same) admitted
    # r9 runs beside, in 1 block: no one is alone
    ("hits on blocks in use cost nothing", 6, 0.0, True, True, True),  # 1 free; r1 needs 1 fresh block
    ("without the cache the same request waits", 6, 0.0, True, False, False),  # needs 4
    ("the fresh blocks keep the watermark", 7, 0.15, True, True, True),  # 2 free - 1 >= 1
    ("the fresh blocks break the watermark", 6, 0.2, True, True, False),  # 1 free - 1 < 1
    ("hits on free cached blocks cost a block each", 5, 0.0, False, True, True),  # 4 free - 4 >= 0
    ("hits on free cached blocks count against the watermark", 5, 0.2, False, True, False),  # 4 free - 4 < 1
    ("free blocks without the cache", 5, 0.0, False, False, True),
]


@pytest.mark.parametrize("name,num_blocks,watermark,running,caching,admitted", CAN_ADMIT,
                         ids=[c[0] for c in CAN_ADMIT])
def test_cache_admission_counts_hits_on_blocks_in_use_as_free(name: str, num_blocks: int, watermark: float,
                                                              running: bool, caching: bool, admitted: bool) -> None:
    s = make(num_blocks=num_blocks, watermark=watermark, caching=caching)
    if running:
        start(s, newp(9, [90]))
        [kv0] = start(s, newp(0, seq(13)))
    else:  # r0 ran alone (4 of 5 blocks) and ended; r9 takes its unregistered block
        [kv0] = start(s, newp(0, seq(13)))
        s.abort("r0")
        fin(s)
        start(s, newp(9, [90]))
    free = s.blocks.num_free
    s.add(newp(1, seq(13)))
    kvs = admit(s)
    assert ids(kvs) == (["r1"] if admitted else [])
    if admitted:
        hit = 12 if caching else 0
        assert kvs[0].cached_tokens == hit and kvs[0].block_ids[:hit // BS] == kv0.block_ids[:hit // BS]
        assert free - s.blocks.num_free == 4 - (hit // BS if running else 0)
    finish_all(Scene(s))


def test_cache_unadmit_gives_the_hits_back() -> None:
    s = make(num_blocks=8, caching=True)
    [kv0] = start(s, new(0, 9))
    s.add(new(1, 9))
    counts = (s.blocks.queries, s.blocks.hits)
    [kv1] = admit(s)
    s.unadmit([kv1])
    check(s)
    assert (s.blocks.queries, s.blocks.hits) == counts  # an undone admission is not counted
    assert refs(s, kv0.block_ids) == [1, 1, 1] and cached(s) == set(kv0.block_ids[:2])
    [kv1] = admit(s)
    assert kv1.cached_tokens == 8 and kv1.block_ids[:2] == kv0.block_ids[:2]
    assert (s.blocks.queries, s.blocks.hits) == (counts[0] + 9, counts[1] + 8)  # counted once
    answer(s, kv1)
    finish_all(Scene(s))


def test_pending_prefill_for_the_policy() -> None:
    """What the scheduling policy is told: each request's tokens beyond its cached prefix, in arrival order
    (a waiting one's prefix is what admission would find now, counting nothing); running ones as contexts."""
    s = make(num_blocks=64, max_seqs=2, caching=True)
    start(s, new(0, n=3 * BS + 2))  # admitted and answered: the prompt is registered and r0 runs
    assert s.pending_prefill() == ()
    assert s.decode_contexts() == (3 * BS + 2 + 1,)  # prompt + first token, the next step's context
    s.add(new(1, n=3 * BS + 2))  # same prompt: 3 full blocks cached
    s.add(m.NewRequest("r2", list(range(500, 500 + BS)), params(), 0.0))  # nothing cached
    q0 = s.blocks.queries
    got = s.pending_prefill()
    assert [(w.req_id, w.tokens, w.prefix) for w in got] == [("r1", 2, 3 * BS), ("r2", BS, 0)]
    assert s.blocks.queries == q0  # looking did not count as a query
    kv = admit(s)  # one seat left: r1 is prefilling (its cache match is known), r2 waits
    assert ids(kv) == ["r1"] and kv[0].cached_tokens == 3 * BS
    got = s.pending_prefill()
    assert [(w.req_id, w.tokens, w.prefix) for w in got] == [("r1", 2, 3 * BS), ("r2", BS, 0)]
    s.abort("r2")
    assert [w.req_id for w in s.pending_prefill()] == ["r1"]
    assert s.abort("r1")  # prefilling: prefill must drop it; it is no longer pending work
    assert s.pending_prefill() == ()


def test_pending_work_counts_up_to_the_cap() -> None:
    """The rapid policy's count of prompt tokens prefill has yet to compute: the same figures as
    `pending_prefill` (cached prefixes excluded), summed, and no further than just past the cap."""
    s = make(num_blocks=64, max_seqs=2, caching=True)
    assert s.pending_work(1000).tokens == 0
    start(s, new(0, n=3 * BS + 2))
    assert s.pending_work(1000).tokens == 0  # r0 runs: nothing left for prefill
    assert s.pending_work(1000).longest == 0
    s.add(new(1, n=3 * BS + 2))  # 3 full blocks cached: 2 tokens to compute
    s.add(m.NewRequest("r2", list(range(500, 500 + BS)), params(), 0.0))  # nothing cached
    want = sum(w.tokens for w in s.pending_prefill())
    assert want == 2 + BS and s.pending_work(1000).tokens == want
    assert s.pending_work(1).tokens == 2  # r1 alone passes the cap: r2 is not looked at
    assert s.pending_work(2).tokens == 2 + BS
    kv = admit(s)  # r1 prefilling, r2 waits: the same count
    assert ids(kv) == ["r1"] and s.pending_work(1000).tokens == want
    s.add(m.NewRequest("r3", list(range(700, 700 + 4 * BS)), params(), 0.0))
    q0 = s.blocks.queries
    assert s.pending_work(BS).tokens == 2 + BS  # stops at r2, before looking r3's prefix up
    assert s.pending_work(10_000).tokens == 2 + BS + 4 * BS
    assert s.blocks.queries == q0  # looking did not count as a query
    assert s.pending_work(1).longest == 4 * BS  # the longest pending prompt, however far counted
    assert s.abort("r1")  # prefilling and aborted: no longer pending work
    assert s.pending_work(10_000).tokens == BS + 4 * BS


# ---- waiting for a prefix in flight (`share_min_tokens`) ------------------------------------------------------
@pytest.mark.parametrize("share_min,waits", [(BS, True), (2 * BS, True), (3 * BS, False), (None, False)],
                         ids=["one block", "two blocks", "more than is in flight", "the engine's default"])
def test_cache_a_request_waits_for_a_prefix_in_flight_and_then_shares_it(share_min: int | None, waits: bool) -> None:
    """r1 repeats r0's first two blocks while r0 is prefilling: with share_min_tokens at most what is in flight it
    is passed over (keeping its place; r2 behind it is admitted) until r0's PrefillDone, then hits those blocks."""
    s = make(num_blocks=32, caching=True, share_min=share_min)
    p = seq(2 * BS + 1)
    s.add(newp(0, p))
    [kv0] = admit(s)
    s.add(newp(1, p[:2 * BS] + [99, 98, 97]))
    s.add(m.NewRequest("r2", list(range(500, 500 + BS + 1)), params(), 0.0))
    kvs = admit(s)
    if not waits:  # admitted at once: computes the shared blocks again, into its own
        assert ids(kvs) == ["r1", "r2"] and kvs[0].cached_tokens == 0
        finish_all(Scene(s))
        return
    assert ids(kvs) == ["r2"] and ids(s.waiting) == ["r1"]
    assert [(w.req_id, w.prefix) for w in s.pending_prefill()] == [("r0", 0), ("r1", 2 * BS), ("r2", 0)]
    assert s.pending_work(1000).tokens == (2 * BS + 1) + 3 + (BS + 1)  # r1: only its 3 own tokens
    assert admit(s) == []  # still in flight
    answer(s, kv0)
    [kv1] = admit(s)
    assert kv1.req_id == "r1" and kv1.cached_tokens == 2 * BS and kv1.block_ids[:2] == kv0.block_ids[:2]
    finish_all(Scene(s))


@pytest.mark.parametrize("how", ["abort", "PrefillFailed", "unadmit"])
def test_cache_a_request_stops_waiting_when_the_prefix_in_flight_is_given_up(how: str) -> None:
    """If the writer never lands (aborted, failed, or its KVReady was never sent), the waiting request is
    admitted with nothing cached: it never waits for blocks no one writes."""
    s = make(num_blocks=32, caching=True, share_min=BS)
    p = seq(2 * BS + 1)
    s.add(newp(0, p))
    kv0s = admit(s)
    s.add(newp(1, p))
    assert admit(s) == []
    if how == "abort":
        assert s.abort("r0") is True
        s.dropped("r0")
    elif how == "PrefillFailed":
        s.prefill_failed(m.PrefillFailed("r0", 0, "it broke"))
        s.dropped("r0")
    else:
        s.unadmit(kv0s)  # r0 waits again, at the head: it is admitted first, and r1 waits for it once more
        assert ids(admit(s)) == ["r0"] and ids(s.waiting) == ["r1"]
        s.abort("r0")
        s.dropped("r0")
    check(s)
    [kv1] = admit(s)
    assert kv1.req_id == "r1" and kv1.cached_tokens == 0
    finish_all(Scene(s))


def test_cache_waiting_for_a_prefix_keeps_the_seats_and_order() -> None:
    """Passed-over requests hold no seat and keep their order; the first one that does not fit the pool
    still stops admission for everyone behind it (first come, first served)."""
    s = make(num_blocks=6, max_seqs=3, caching=True, share_min=BS)
    p = seq(2 * BS + 1)  # 3 blocks
    s.add(newp(0, p))
    [kv0] = admit(s)
    s.add(newp(1, p))
    s.add(newp(2, p[:2 * BS] + [77]))
    s.add(m.NewRequest("r3", list(range(500, 500 + 3 * BS)), params(), 0.0))  # 3 blocks: 3 free, fits
    s.add(m.NewRequest("r4", list(range(600, 600 + BS)), params(), 0.0))  # no room left
    assert ids(admit(s)) == ["r3"] and ids(s.waiting) == ["r1", "r2", "r4"]
    answer(s, kv0)
    assert ids(admit(s)) == []  # r1 and r2 would share 2 blocks, but only 0 are free and each needs 1 fresh block
    finish_all(Scene(s))


def test_cache_unadmit_keeps_a_passed_over_request_ahead_of_later_arrivals() -> None:
    """r1 waits for r0's prefix; r2 (later) is admitted, then unadmitted (prefill's inbox was full): r2 goes back
    behind r1, so once r0 lands r1 is first (review finding: unadmit put r2 at the head)."""
    s = make(num_blocks=32, caching=True, share_min=BS)
    p = seq(2 * BS + 1)
    s.add(newp(0, p))
    [kv0] = admit(s)
    s.add(newp(1, p))
    s.add(m.NewRequest("r2", list(range(500, 500 + BS)), params(), 0.0))
    kvs = admit(s)
    assert ids(kvs) == ["r2"]
    s.unadmit(kvs)
    assert ids(s.waiting) == ["r1", "r2"]
    answer(s, kv0)
    assert ids(admit(s)) == ["r1", "r2"]
    finish_all(Scene(s))


def test_cache_an_aborted_writer_is_not_waited_for_and_what_it_finished_is_shared() -> None:
    """Aborting the writer ends the wait at once (before prefill's Dropped); a PrefillDone that still comes
    registers the prompt it wrote, which later requests share."""
    s = make(num_blocks=32, caching=True, share_min=BS)
    p = seq(2 * BS + 1)
    s.add(newp(0, p))
    [kv0] = admit(s)
    s.add(newp(1, p))
    assert admit(s) == []
    assert s.abort("r0") is True
    [kv1] = admit(s)  # no longer waits: r0 may never finish its prompt
    assert kv1.req_id == "r1" and kv1.cached_tokens == 0
    assert answer(s, kv0) is None  # prefill had finished r0 before the Drop: its blocks are registered
    s.dropped("r0")
    assert fin(s) == ["r0:abort"]
    s.add(newp(2, p))
    [kv2] = admit(s)
    assert kv2.cached_tokens == 2 * BS and kv2.block_ids[:2] == kv0.block_ids[:2]
    finish_all(Scene(s))


def test_cache_a_passed_over_request_is_not_looked_up_again_until_a_pending_block_changes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """admit runs every loop: a request that waits is looked up again only after the pending index lost an
    entry (`BlockManager.pending_version`), so a long queue of waiters costs nothing per step."""
    s = make(num_blocks=64, caching=True, share_min=BS)
    p = seq(2 * BS + 1)
    s.add(newp(0, p))
    [kv0] = admit(s)
    for i in range(1, 6):
        s.add(newp(i, p + [90 + i]))
    calls: list[str] = []
    real = s.blocks.pending_prefix
    monkeypatch.setattr(s.blocks, "pending_prefix", lambda sid, toks: calls.append(sid) or real(sid, toks))
    assert admit(s) == [] and len(calls) == 5
    assert admit(s) == [] and admit(s) == [] and len(calls) == 5  # nothing changed: no lookup
    answer(s, kv0)  # r0's blocks are written: the waiters are looked up again and admitted
    assert ids(admit(s)) == ["r1", "r2", "r3", "r4", "r5"] and len(calls) == 10
    assert not s._passed
    finish_all(Scene(s))
