"""The decode worker's scheduler (`rapidserve/engine/decode_scheduler.py`) on CPU, against a small BlockManager.

Table tests, each checking the scheduler's invariants after every step (`check`), for: admission (seats, the
pool and its watermark with the "alone" exception, FCFS, KVReady contents, `unadmit`), block-table growth
(the in-flight token counted), preemption by recompute (deferred while a step is in flight, latest admitted
first, re-admission with outputs and a new attempt, stale prefill answers ignored), stops applied by
`record`, prefill answers, aborts in every state, `fail` / `fail_batch`, duplicate request ids, and the prefix
cache (hits on repeated and shared prefixes, registration only once prefill's or a step's writes landed, sharing
through preemption and aborts, eviction order, admission counting hits); then a seeded simulation, with the
cache off and on, that drives the scheduler as `decode_worker.py` does (with a fake prefill worker, router and
model over a fake KV pool) and checks block ownership, that no block is written while shared or cached, that a
cached block holds what its hash names, token order, that outputs do not depend on the cache, and that
everything is freed at the end.
"""

from __future__ import annotations

import functools
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from rapidserve.block_manager import BlockManager, block_hash, blocks_for
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, DecodeScheduler, Row
from rapidserve.sampling_params import SamplingParams
from rapidserve.sequence import check_stop

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
         caching: bool = False) -> DecodeScheduler:
    return DecodeScheduler(BlockManager(num_blocks, BS, watermark, enable_caching=caching, salt=SALT), max_seqs,
                           (EOS,), cap or num_blocks * BS)


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
    waiting, running = set(map(id, s.waiting)), set(map(id, s.running))
    assert all(r.state == "waiting" for r in s.waiting) and len(waiting) == len(s.waiting)
    assert all(r.state == "running" for r in s.running) and len(running) == len(s.running)
    assert len(s.running) + s.num_prefilling <= s.max_seqs
    known = {id(r) for r in s.reqs.values()}
    assert waiting <= known and running <= known
    for i, r in s.reqs.items():  # (`i in tables`: the request holds blocks)
        assert r.req_id == i and 0 <= r.inflight <= 1
        if r.state == "waiting":
            assert i not in tables and id(r) in waiting and r.inflight == 0 and not r.aborting
            continue
        if r.state == "prefilling":  # exactly the blocks of its KVReady, which prefill writes
            assert len(tables[i]) == blocks_for(r.num_tokens, BS) and r.inflight == 0
        elif r.state == "running":  # K/V of all but its newest token, and of the step in flight
            assert id(r) in running and not r.aborting
            assert blocks_for(r.tokens_needed - 1, BS) <= len(tables[i]) <= blocks_for(r.tokens_needed, BS)
        else:  # ended, but a step in flight still writes its blocks, or prefill owes the answer to a Drop
            assert r.state == "done"
            assert (r.inflight > 0 and i in tables) or (r.drop_pending and r.inflight == 0 and i not in tables)
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
        # the leading full blocks found in the cache (leaving a token to compute), then fresh ones for prefill
        c, b = kv.cached_tokens, s.blocks
        assert c % BS == 0 and 0 <= c < r.num_tokens and (c == 0 or b.enable_caching)
        assert all(blk in b._hash_of for blk in kv.block_ids[:c // BS])
        assert all(b._ref[blk] == 1 and blk not in b._hash_of for blk in kv.block_ids[c // BS:])
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
    out = s.record(batch, [(t, -0.5, [(t, -0.5)]) for t in toks])
    check(s)
    return out


def step(s: DecodeScheduler, token: int | list[int] = TOK) -> list[m.TokenOut]:
    return land(s, launch(s), token)


def table(s: DecodeScheduler, rid: str) -> list[int]:
    return list(s.blocks.table(rid))


def all_free(s: DecodeScheduler) -> bool:
    return not s.reqs and not s.waiting and not s.running and s.blocks.num_free == s.blocks.num_blocks


# ---- 1. admission --------------------------------------------------------------------------------
ADMIT_CASES = [
    # name, num_blocks, watermark, max_seqs, prompt lengths, admitted
    ("all fit", 16, 0.0, 8, [4, 5, 8], ["r0", "r1", "r2"]),
    ("the seats cap admission", 16, 0.0, 2, [4, 4, 4], ["r0", "r1"]),
    ("one seat", 16, 0.0, 1, [1, 1], ["r0"]),
    ("the pool caps admission", 4, 0.0, 8, [8, 8, 8], ["r0", "r1"]),
    ("FCFS: a head that does not fit blocks smaller ones behind it", 4, 0.0, 8, [8, 12, 4], ["r0"]),
    ("the watermark is kept free", 10, 0.2, 8, [16, 20], ["r0"]),  # 10 - 4 - 5 = 1 free < 2
    ("up to the watermark", 10, 0.2, 8, [16, 16], ["r0", "r1"]),  # 10 - 4 - 4 = 2 free
    ("alone: the watermark never starves the only request", 4, 0.5, 8, [16], ["r0"]),
    ("alone holds for the first only", 4, 0.5, 8, [12, 4], ["r0"]),
    ("alone, yet more than the pool: it waits", 2, 0.0, 8, [12, 4], []),
]


@pytest.mark.parametrize("name,num_blocks,watermark,max_seqs,prompts,admitted", ADMIT_CASES,
                         ids=[c[0] for c in ADMIT_CASES])
def test_admission(name: str, num_blocks: int, watermark: float, max_seqs: int, prompts: list[int],
                   admitted: list[str]) -> None:
    s = make(num_blocks, max_seqs, watermark)
    reqs = [new(i, n) for i, n in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    kvs = admit(s)
    assert ids(kvs) == admitted
    for kv, r in zip(kvs, reqs, strict=False):
        assert kv.request is r and kv.outputs == [] and kv.attempt == 0
        assert s.reqs[r.req_id].state == "prefilling"
    assert ids(s.waiting) == [r.req_id for r in reqs[len(kvs):]]
    assert s.blocks.num_free == num_blocks - sum(blocks_for(n, BS) for n in prompts[:len(kvs)])
    assert s.num_prefilling == len(kvs) and s.has_pending
    assert admit(s) == []  # nothing changed: nothing more


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 13])
def test_kvready_blocks_cover_the_prompt(n: int) -> None:
    s = make(num_blocks=16)
    s.add(new(0, n))
    s.add(new(1, n))
    a, b = admit(s)
    assert len(a.block_ids) * BS >= n > (len(a.block_ids) - 1) * BS
    assert not set(a.block_ids) & set(b.block_ids)


def test_seats_count_prefilling_and_running() -> None:
    s = make(max_seqs=2)
    start(s, new(0))
    s.add(new(1))
    s.add(new(2))
    assert ids(admit(s)) == ["r1"]  # r0 runs, r1 prefills: both seats taken
    assert admit(s) == []
    assert s.abort("r0") is False and fin(s) == ["r0:abort"]
    assert ids(admit(s)) == ["r2"]


Hold = Callable[[DecodeScheduler], Callable[[], object]]


def hold_prefilling(s: DecodeScheduler) -> Callable[[], object]:
    s.add(new(0, 3))
    [kv] = admit(s)
    return lambda: s.prefill_failed(m.PrefillFailed("r0", kv.attempt, "boom"))


def hold_aborting(s: DecodeScheduler) -> Callable[[], object]:
    s.add(new(0, 3))
    admit(s)
    assert s.abort("r0")
    return lambda: s.dropped("r0")


def hold_running(s: DecodeScheduler) -> Callable[[], object]:
    start(s, new(0, 3))
    return lambda: s.abort("r0")


def hold_aborted_in_flight(s: DecodeScheduler) -> Callable[[], object]:
    start(s, new(0, 3))
    batch = launch(s)
    s.abort("r0")
    return lambda: land(s, batch)


def hold_ended_in_flight(s: DecodeScheduler) -> Callable[[], object]:
    start(s, new(0, 3, params(max_tokens=2)))
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    assert land(s, b0)[0].finish_reason == "length"  # ended by its token; b1 still writes its blocks
    return lambda: land(s, b1)


def hold_nothing(s: DecodeScheduler) -> Callable[[], object]:
    return lambda: None


HOLDERS: list[tuple[str, Hold, bool]] = [
    # name, how r0 holds blocks (or not), whether r9 must wait for it
    ("prefilling", hold_prefilling, True),
    ("aborted while prefilling, not yet let go", hold_aborting, True),
    ("running", hold_running, True),
    ("aborted, its step in flight", hold_aborted_in_flight, True),
    ("ended by its token, the next step in flight", hold_ended_in_flight, True),
    ("nothing", hold_nothing, False),
]


@pytest.mark.parametrize("name,hold,blocked", HOLDERS, ids=[h[0] for h in HOLDERS])
def test_alone_means_nothing_else_holds_blocks(name: str, hold: Hold, blocked: bool) -> None:
    # 8 blocks, 4 kept back by the watermark: r9 (5 blocks) only gets in alone
    s = make(num_blocks=8, watermark=0.5)
    release = hold(s)
    s.add(new(9, 20))
    assert ids(admit(s)) == ([] if blocked else ["r9"])
    release()
    check(s)
    fin(s)
    assert set(s.reqs) == {"r9"} and s.blocks.num_free == (8 if blocked else 3)
    if blocked:
        [kv] = admit(s)
        assert kv.req_id == "r9" and len(kv.block_ids) == 5


def test_a_waiting_request_behind_does_not_spoil_alone() -> None:
    s = make(num_blocks=8, watermark=0.5)
    s.add(new(9, 20))
    s.add(new(5, 1))  # waiting requests hold no blocks
    assert ids(admit(s)) == ["r9"]


@pytest.mark.parametrize("cut", [0, 1, 2])
def test_unadmit_puts_requests_back_at_the_head_in_order(cut: int) -> None:
    s = make(num_blocks=16, max_seqs=3)
    reqs = [new(i, 5) for i in range(4)]  # 2 blocks each
    for r in reqs:
        s.add(r)
    handed = admit(s)
    assert ids(handed) == ["r0", "r1", "r2"]
    s.unadmit(handed[cut:])  # prefill's inbox was full from handed[cut] on
    check(s)
    assert ids(s.waiting) == [f"r{i}" for i in range(cut, 4)]
    assert s.blocks.num_free == 16 - 2 * cut and s.num_prefilling == cut
    assert all(s.reqs[kv.req_id].state == "waiting" and not s.blocks.has(kv.req_id) for kv in handed[cut:])
    again = admit(s)
    assert ids(again) == [f"r{i}" for i in range(cut, 3)]
    assert [kv.request for kv in again] == reqs[cut:3]
    assert all(kv.attempt == 0 and kv.outputs == [] for kv in again)


# ---- 2. growth -----------------------------------------------------------------------------------
GROWTH = [
    # prompt length, block-table length at each of 6 schedules (tokens: prompt + first token + steps)
    (3, [1, 2, 2, 2, 2, 3]),
    (4, [2, 2, 2, 2, 3, 3]),
    (7, [2, 3, 3, 3, 3, 4]),
    (8, [3, 3, 3, 3, 4, 4]),
]


@pytest.mark.parametrize("one_ahead", [False, True], ids=["one step at a time", "one step ahead"])
@pytest.mark.parametrize("n,lens", GROWTH, ids=[f"prompt {g[0]}" for g in GROWTH])
def test_tables_grow_a_block_at_a_boundary(n: int, lens: list[int], one_ahead: bool) -> None:
    """One step ahead, each schedule sees one token fewer recorded, and counts the one in flight: the
    tables are the same."""
    s = make(num_blocks=8)
    [kv] = start(s, new(0, n))
    r = s.reqs["r0"]
    prev: list[DecodeRequest] | None = None
    tables = [list(kv.block_ids)]
    for k, want in enumerate(lens):
        batch = s.schedule(quiet=prev is None)
        assert batch is not None and ids(batch) == ["r0"]
        check(s)
        assert r.tokens_needed == n + 1 + k and r.inflight == (1 if prev is not None else 0)
        t = table(s, "r0")
        assert len(t) == want and t[:len(tables[-1])] == tables[-1]  # grown at the end only
        tables.append(t)
        s.launched(batch)
        if one_ahead:
            if prev is not None:
                land(s, prev)
            prev = batch
        else:
            land(s, batch)
    assert len(r.outputs) == (len(lens) if one_ahead else len(lens) + 1)


def test_tokens_needed_counts_the_inflight_token() -> None:
    s = make(num_blocks=8)
    start(s, new(0, 3))
    r = s.reqs["r0"]
    assert (r.num_tokens, r.tokens_needed) == (4, 4)
    b0 = launch(s)
    assert len(table(s, "r0")) == 1
    assert (r.num_tokens, r.tokens_needed, r.inflight) == (4, 5, 1)
    b1 = launch(s, quiet=False)  # the 5th token is still on the device: its successor needs block 2
    assert len(table(s, "r0")) == 2 and r.num_tokens == 4
    land(s, b0)
    assert (r.num_tokens, r.tokens_needed) == (5, 6)
    land(s, b1)
    assert (r.num_tokens, r.tokens_needed, r.inflight) == (6, 6, 0)


# ---- 3. preemption -------------------------------------------------------------------------------
def test_a_short_pool_defers_while_a_step_is_in_flight_then_preempts_the_latest() -> None:
    s = make(num_blocks=4)
    start(s, new(0, 7), new(1, 7))  # 8 tokens each: 2 blocks each, none free
    a, b = s.reqs["r0"], s.reqs["r1"]
    b0 = launch(s)
    before = (table(s, "r0"), table(s, "r1"))
    assert s.schedule(quiet=False) is None  # both need a 3rd block; nothing may be freed now
    check(s)
    assert (table(s, "r0"), table(s, "r1")) == before and s.blocks.num_free == 0
    assert s.num_preemptions == 0 and ids(s.running) == ["r0", "r1"] and not s.waiting
    land(s, b0, [21, 22])
    batch = s.schedule(quiet=True)  # quiet now: r1, admitted last, makes room
    check(s)
    assert batch is not None and ids(batch) == ["r0"] and len(table(s, "r0")) == 3
    assert ids(s.waiting) == ["r1"] and b.state == "waiting" and not s.blocks.has("r1")
    assert b.outputs == [TOK, 22] and b.attempt == 1 and a.attempt == 0 and s.num_preemptions == 1
    s.launched(batch)
    land(s, batch)
    assert admit(s) == []  # r1 needs 3 blocks, 1 is free
    assert s.abort("r0") is False and fin(s) == ["r0:abort"]
    [kv] = admit(s)
    assert kv.request is b.request and kv.outputs == [TOK, 22] and kv.attempt == 1 and len(kv.block_ids) == 3
    s.unadmit([kv])  # prefill's inbox was full: the same KVReady next time
    [kv2] = admit(s)
    assert (kv2.outputs, kv2.attempt) == (kv.outputs, kv.attempt)
    stale = m.TokenOut("r1", 1, 99, None, None, None)
    assert s.prefill_done(m.PrefillDone("r1", 0, stale)) is None  # an answer to attempt 0
    s.prefill_failed(m.PrefillFailed("r1", 0, "old"))
    check(s)
    assert b.state == "prefilling" and b.outputs == [TOK, 22] and not s.finished
    first = answer(s, kv2, token=23)
    assert first is not None and (first.index, first.token_id) == (2, 23) and b.state == "running"
    [t] = step(s)
    assert (t.req_id, t.index) == ("r1", 3) and b.outputs == [TOK, 22, 23, TOK]


VICTIMS = [
    # name, num_blocks, order the prefills answer in, batch, waiting after (head first)
    ("the latest admitted goes", 9, [0, 1, 2, 3], ["r0", "r1", "r2"], ["r3"]),
    ("as many as needed; the one that needs a block may go itself", 8, [0, 1, 2, 3], ["r0", "r1"], ["r2", "r3"]),
    ("by admission order, not place in the batch", 9, [3, 2, 1, 0], ["r2", "r1", "r0"], ["r3"]),
    ("by admission order, twice", 8, [3, 2, 1, 0], ["r1", "r0"], ["r2", "r3"]),
    ("no one when all fit", 12, [0, 1, 2, 3], ["r0", "r1", "r2", "r3"], []),
]


@pytest.mark.parametrize("name,num_blocks,answer_order,batch_ids,waiting_ids", VICTIMS, ids=[v[0] for v in VICTIMS])
def test_preemption_takes_the_latest_admitted_until_the_rest_fit(name: str, num_blocks: int, answer_order: list[int],
                                                                 batch_ids: list[str], waiting_ids: list[str]) -> None:
    s = make(num_blocks=num_blocks)
    for i in range(4):
        s.add(new(i, 8))  # 2 blocks each; with the first token 9 tokens: a 3rd block each
    kvs = admit(s)
    for i in answer_order:
        answer(s, kvs[i])
    batch = s.schedule(quiet=True)
    check(s)
    assert batch is not None and ids(batch) == batch_ids and ids(s.waiting) == waiting_ids
    assert all(len(table(s, r.req_id)) == 3 for r in batch)
    assert s.num_preemptions == len(waiting_ids)
    for r in s.waiting:
        assert r.outputs == [TOK] and r.attempt == 1 and not s.blocks.has(r.req_id)
    for r in batch:  # the rest end; the preempted come back with their outputs, in order
        s.abort(r.req_id)
    again = admit(s)
    assert ids(again) == waiting_ids and all(kv.outputs == [TOK] and kv.attempt == 1 for kv in again)


def test_a_request_preempts_itself_when_prefilling_ones_hold_the_pool() -> None:
    s = make(num_blocks=4)
    s.add(new(0, 8))
    s.add(new(1, 8))
    ka, kb = admit(s)
    answer(s, ka)  # r0 runs and needs a 3rd block; r1, still prefilling, holds the other two
    assert s.schedule(quiet=True) == []
    check(s)
    a = s.reqs["r0"]
    assert a.state == "waiting" and a.attempt == 1 and a.outputs == [TOK] and s.num_preemptions == 1
    assert s.blocks.num_free == 2 and table(s, "r1") == kb.block_ids
    assert admit(s) == []  # r1 holds blocks: not alone, and 3 blocks do not fit
    answer(s, kb)
    assert s.abort("r1") is False
    [kv] = admit(s)
    assert kv.req_id == "r0" and kv.attempt == 1 and kv.outputs == [TOK]


@pytest.mark.parametrize("kind", ["PrefillDone", "PrefillFailed", "Dropped"])
def test_a_stale_or_unasked_answer_is_ignored(kind: str) -> None:
    s = make(num_blocks=4)
    start(s, new(0, 7), new(1, 7))
    land(s, launch(s))
    s.schedule(quiet=True)  # r1 preempted: attempt 1
    s.abort("r0")
    [kv] = admit(s)
    assert kv.attempt == 1
    if kind == "PrefillDone":
        assert s.prefill_done(m.PrefillDone("r1", 0, m.TokenOut("r1", 1, 99, None, None, "stop"))) is None
    elif kind == "PrefillFailed":
        s.prefill_failed(m.PrefillFailed("r1", 0, "old"))
    else:
        s.dropped("r1")  # r1 was not aborted: prefill did not drop it
    check(s)
    assert s.reqs["r1"].state == "prefilling" and table(s, "r1") == kv.block_ids and fin(s) == ["r0:abort"]


# ---- 4. stops ------------------------------------------------------------------------------------
STOPS = [
    # name, params, prompt length, context cap, decode tokens after the first (TOK), want (index, token, reason)
    ("max_tokens", params(max_tokens=3), 4, None, [TOK, TOK], [(1, TOK, None), (2, TOK, "length")]),
    ("eos", params(), 4, None, [TOK, EOS], [(1, TOK, None), (2, EOS, "stop")]),
    ("eos ignored with ignore_eos", params(max_tokens=3, ignore_eos=True), 4, None, [EOS, EOS],
     [(1, EOS, None), (2, EOS, "length")]),
    ("no eos stop before min_tokens", params(min_tokens=3), 4, None, [EOS, EOS], [(1, EOS, None), (2, EOS, "stop")]),
    ("stop_token_ids", params(stop_token_ids=(STOP,)), 4, None, [STOP], [(1, STOP, "stop")]),
    ("a stop id nobody asked for is a token", params(max_tokens=2), 4, None, [STOP], [(1, STOP, "length")]),
    ("no stop-id stop before min_tokens", params(min_tokens=3, stop_token_ids=(STOP,)), 4, None, [STOP, STOP],
     [(1, STOP, None), (2, STOP, "stop")]),
    ("eos at max_tokens is a stop", params(max_tokens=2), 4, None, [EOS], [(1, EOS, "stop")]),
    ("the context cap", params(), 6, 9, [TOK, TOK], [(1, TOK, None), (2, TOK, "length")]),
    ("no max_tokens: up to the context cap", params(max_tokens=None), 4, 8, [TOK, TOK, TOK],
     [(1, TOK, None), (2, TOK, None), (3, TOK, "length")]),
]


@pytest.mark.parametrize("name,p,n,cap,tokens,want", STOPS, ids=[c[0] for c in STOPS])
def test_record_applies_stops(name: str, p: SamplingParams, n: int, cap: int | None, tokens: list[int],
                              want: list[tuple[int, int, str | None]]) -> None:
    s = make(num_blocks=8, cap=cap)
    start(s, new(0, n, p))
    got: list[m.TokenOut] = []
    for t in tokens:
        got += step(s, t)
    assert [(t.index, t.token_id, t.finish_reason) for t in got] == want
    assert all(t.req_id == "r0" and t.logprob == -0.5 and t.top_logprobs == [(t.token_id, -0.5)] for t in got)
    assert not s.finished and all_free(s)  # ended by its token: no Finished; blocks back at once
    assert s.schedule(quiet=True) == []


def test_a_stop_with_the_next_step_in_flight_drops_that_steps_token() -> None:
    s = make(num_blocks=8)
    start(s, new(0, 4, params(max_tokens=2)), new(1, 4))
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    out0 = land(s, b0)
    assert [(t.req_id, t.index, t.finish_reason) for t in out0] == [("r0", 1, "length"), ("r1", 1, None)]
    assert s.reqs["r0"].state == "done" and s.blocks.has("r0") and ids(s.running) == ["r1"]
    out1 = land(s, b1)
    assert [(t.req_id, t.index) for t in out1] == [("r1", 2)] and "r0" not in s.reqs and not s.finished


# ---- 5. prefill answers --------------------------------------------------------------------------
ANSWERS = [
    # name, aborted first, prefill's answer, reason on the first token, Finished, runs after
    ("the first token streams and the request runs", False, "done", None, [], True),
    ("a first token that ends it: prefill told the router", False, "done", "length", [], False),
    ("a first eos that ends it", False, "done", "stop", [], False),
    ("prefill failed", False, "failed", None, ["r0:error:it broke"], False),
    ("aborted, then its first token", True, "done", None, ["r0:abort:"], False),
    ("aborted, then a first token that ends it", True, "done", "stop", ["r0:abort:"], False),
    ("aborted, then prefill failed", True, "failed", None, ["r0:abort:it broke"], False),
    ("aborted, then dropped", True, "dropped", None, ["r0:abort:"], False),
]


@pytest.mark.parametrize("name,aborted,kind,reason,finished,runs", ANSWERS, ids=[a[0] for a in ANSWERS])
def test_prefill_answers(name: str, aborted: bool, kind: str, reason: str | None, finished: list[str],
                         runs: bool) -> None:
    s = make(num_blocks=8)
    s.add(new(0, 5))
    [kv] = admit(s)
    if aborted:
        assert s.abort("r0") is True and not s.finished and table(s, "r0") == kv.block_ids
    first = m.TokenOut("r0", 0, TOK, -0.1, None, reason)
    if kind == "done":
        out = s.prefill_done(m.PrefillDone("r0", 0, first))
        assert out is (first if runs else None)
    elif kind == "failed":
        s.prefill_failed(m.PrefillFailed("r0", 0, "it broke"))
    else:
        s.dropped("r0")
    check(s)
    assert [f"{f.req_id}:{f.reason}:{f.message}" for f in s.finished] == finished
    if runs:
        r = s.reqs["r0"]
        assert r.state == "running" and r.outputs == [TOK] and ids(s.running) == ["r0"]
        assert table(s, "r0") == kv.block_ids
    else:
        if aborted and kind != "dropped":  # the id stays held until prefill answers the Drop
            assert s.reqs["r0"].drop_pending and s.blocks.num_free == s.blocks.num_blocks
            s.finished.clear()
            s.dropped("r0")
            check(s)
            assert not s.finished
        assert all_free(s)


def test_an_answer_for_an_unknown_request_is_ignored() -> None:
    s = make()
    start(s, new(0))
    assert s.prefill_done(m.PrefillDone("zz", 0, m.TokenOut("zz", 0, TOK))) is None
    s.prefill_failed(m.PrefillFailed("zz", 0, "x"))
    s.dropped("zz")
    s.dropped("r0")  # running: nothing to drop
    check(s)
    assert not s.finished and ids(s.running) == ["r0"]


# ---- scenes: r0 in a given state, r9 running beside it -------------------------------------------
@dataclass
class Scene:
    s: DecodeScheduler
    kv: m.KVReady | None = None  # r0's KVReady, while prefill holds it
    r0: DecodeRequest | None = None  # r0, once the scheduler has let go of it
    inflight: list[DecodeRequest] | None = None  # the step in flight


def scene_waiting() -> Scene:
    s = make(max_seqs=1)
    start(s, new(9))
    s.add(new(0))
    assert admit(s) == []
    return Scene(s)


def scene_preempted() -> Scene:
    s = make(num_blocks=4)
    start(s, new(9, 7), new(0, 7))
    step(s)
    assert ids(s.schedule(quiet=True) or []) == ["r9"]
    check(s)
    assert s.reqs["r0"].state == "waiting" and s.reqs["r0"].outputs == [TOK, TOK]
    return Scene(s)


def scene_prefilling() -> Scene:
    s = make()
    start(s, new(9))
    s.add(new(0))
    [kv] = admit(s)
    return Scene(s, kv=kv)


def scene_aborting() -> Scene:
    sc = scene_prefilling()
    assert sc.s.abort("r0") is True and not sc.s.finished
    return sc


def scene_running() -> Scene:
    s = make()
    start(s, new(9), new(0))
    return Scene(s)


def scene_in_flight() -> Scene:
    sc = scene_running()
    sc.inflight = launch(sc.s)
    return sc


def scene_ended_in_flight() -> Scene:
    s = make()
    start(s, new(9), new(0, p=params(max_tokens=2)))
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    assert [t.finish_reason for t in land(s, b0)] == [None, "length"]
    return Scene(s, inflight=b1)


def scene_gone() -> Scene:
    sc = scene_running()
    sc.r0 = sc.s.reqs["r0"]
    assert sc.s.abort("r0") is False and fin(sc.s) == ["r0:abort"]
    return sc


def scene_never() -> Scene:
    s = make()
    start(s, new(9))
    return Scene(s)


Release = Callable[[Scene], list[m.TokenOut]]


def rel_dropped(sc: Scene) -> list[m.TokenOut]:
    sc.s.dropped("r0")
    return []


def rel_done(sc: Scene) -> list[m.TokenOut]:
    assert sc.kv is not None
    t = answer(sc.s, sc.kv)
    return [] if t is None else [t]


def rel_done_final(sc: Scene) -> list[m.TokenOut]:
    assert sc.kv is not None
    t = answer(sc.s, sc.kv, EOS, "stop")
    return [] if t is None else [t]


def rel_failed(sc: Scene) -> list[m.TokenOut]:
    assert sc.kv is not None
    sc.s.prefill_failed(m.PrefillFailed("r0", sc.kv.attempt, "it broke"))
    return []


def rel_land(sc: Scene) -> list[m.TokenOut]:
    assert sc.inflight is not None
    out, sc.inflight = land(sc.s, sc.inflight), None
    return out


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


ABORTS: list[tuple[str, Callable[[], Scene], bool | None, list[str], bool, Release | None, list[str]]] = [
    # name, scene, abort's answer (True: send Drop; None: either), Finished at once, r0 keeps its blocks,
    # what lets go of them, Finished then
    ("waiting", scene_waiting, False, ["r0:abort"], False, None, []),
    ("preempted, waiting again", scene_preempted, False, ["r0:abort"], False, None, []),
    ("prefilling, then Dropped", scene_prefilling, True, [], True, rel_dropped, ["r0:abort"]),
    ("prefilling, then PrefillDone", scene_prefilling, True, [], True, rel_done, ["r0:abort"]),
    ("prefilling, then a PrefillDone that ends it", scene_prefilling, True, [], True, rel_done_final, ["r0:abort"]),
    ("prefilling, then PrefillFailed", scene_prefilling, True, [], True, rel_failed, ["r0:abort"]),
    ("aborted twice while prefilling", scene_aborting, None, [], True, rel_dropped, ["r0:abort"]),
    ("running, no step in flight", scene_running, False, ["r0:abort"], False, None, []),
    ("running, its step in flight", scene_in_flight, False, ["r0:abort"], True, rel_land, []),
    ("ended by its token, the next step in flight", scene_ended_in_flight, False, [], True, rel_land, []),
    ("done and gone", scene_gone, False, [], False, None, []),
    ("never known", scene_never, False, [], False, None, []),
]


@pytest.mark.parametrize("name,scene,drop,now,keeps,release,then", ABORTS, ids=[a[0] for a in ABORTS])
def test_abort_in_every_state(name: str, scene: Callable[[], Scene], drop: bool | None, now: list[str], keeps: bool,
                              release: Release | None, then: list[str]) -> None:
    sc = scene()
    s = sc.s
    fin(s)
    r9 = s.reqs["r9"]
    r9_table = table(s, "r9")
    assert s.abort("r0") is drop or drop is None
    check(s)
    assert fin(s) == now and s.blocks.has("r0") is keeps
    assert "r0" not in ids(s.running) and "r0" not in ids(s.waiting)
    if release is not None:
        out = release(sc)
        check(s)
        assert "r0" not in [t.req_id for t in out]  # no token after an abort or an end
        assert fin(s) == then
    if "r0" in s.reqs:  # prefill answered PrefillDone/PrefillFailed first: the id waits for its Dropped
        assert s.reqs["r0"].drop_pending and not s.blocks.has("r0")
        s.dropped("r0")
        check(s)
        assert fin(s) == []
    assert "r0" not in s.reqs and not s.blocks.has("r0")
    assert s.reqs["r9"] is r9 and r9.state == "running" and table(s, "r9")[:len(r9_table)] == r9_table
    assert s.abort("r0") is False and not s.finished  # once ended, an abort is a no-op
    finish_all(sc)


# ---- 7. fail and fail_batch ----------------------------------------------------------------------
FAILS = [
    # name, scene, Finished, r0 keeps its blocks until the step lands
    ("running, no step in flight", scene_running, ["r0:error"], False),
    ("running, a step in flight", scene_in_flight, ["r0:error"], True),
    ("ended by its token, a step in flight", scene_ended_in_flight, [], True),
    ("aborted, gone", scene_gone, [], False),
]


@pytest.mark.parametrize("name,scene,finished,keeps", FAILS, ids=[f[0] for f in FAILS])
def test_fail_ends_the_failed_rows(name: str, scene: Callable[[], Scene], finished: list[str], keeps: bool) -> None:
    sc = scene()
    s = sc.s
    fin(s)
    r0 = sc.r0 or s.reqs["r0"]
    s.fail([r0], "bad row")  # as the worker does: the failed rows of a batch
    check(s)
    assert all(f.message == "bad row" for f in s.finished)
    assert fin(s) == finished and s.blocks.has("r0") is keeps
    if sc.inflight is not None:
        assert "r0" not in [t.req_id for t in rel_land(sc)]
    assert "r0" not in s.reqs and not s.blocks.has("r0") and ids(s.running) == ["r9"]
    finish_all(sc)


def test_fail_batch_ends_every_running_request_and_frees_the_ended_ones() -> None:
    s = make(max_seqs=5)
    for i in range(6):
        s.add(new(i, 5, params(max_tokens=2) if i == 2 else None))
    kvs = admit(s)  # r0..r4; r5 waits for a seat
    assert ids(kvs) == ["r0", "r1", "r2", "r3", "r4"]
    for kv in kvs[:3]:
        answer(s, kv)
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    assert [t.finish_reason for t in land(s, b0)] == [None, None, "length"]  # r2 ended; b1 writes its blocks
    answer(s, kvs[3])  # r3 runs, not in the step in flight
    s.fail_batch(b1, "device fault")
    check(s)
    finished = s.finished[:]
    assert sorted(f.req_id for f in finished) == ["r0", "r1", "r3"]
    assert all(f.reason == "error" and f.message == "device fault" for f in finished)
    assert set(s.reqs) == {"r4", "r5"} and not s.running and ids(s.waiting) == ["r5"]
    assert s.blocks.num_free == s.blocks.num_blocks - len(kvs[4].block_ids)  # only r4's, which prefill writes
    assert all(r.inflight == 0 for r in b1)
    fin(s)
    answer(s, kvs[4])
    [kv5] = admit(s)
    answer(s, kv5)
    assert [t.req_id for t in step(s)] == ["r4", "r5"]
    finish_all(Scene(s))


def test_fail_batch_with_nothing_in_flight() -> None:
    sc = scene_running()
    sc.s.fail_batch([], "boom")
    assert sorted(fin(sc.s)) == ["r0:error", "r9:error"] and all_free(sc.s)


# ---- 8. duplicate request ids --------------------------------------------------------------------
DUPS = [
    ("waiting", scene_waiting),
    ("preempted", scene_preempted),
    ("prefilling", scene_prefilling),
    ("aborting while prefilling", scene_aborting),
    ("running", scene_running),
    ("running, its step in flight", scene_in_flight),
    ("ended by its token, the next step in flight", scene_ended_in_flight),
]


@pytest.mark.parametrize("name,scene", DUPS, ids=[d[0] for d in DUPS])
def test_a_duplicate_id_is_refused_and_the_earlier_request_is_unaffected(name: str, scene: Callable[[], Scene]) -> None:
    sc = scene()
    s = sc.s
    fin(s)
    r0 = s.reqs["r0"]
    before = (r0.state, r0.aborting, list(r0.outputs), r0.attempt, r0.inflight,
              table(s, "r0") if s.blocks.has("r0") else None, ids(s.waiting), ids(s.running), s.blocks.num_free)
    s.add(new(0, 9, params(max_tokens=1)))
    check(s)
    [f] = s.finished
    assert (f.req_id, f.reason) == ("r0", "error") and "'r0'" in f.message
    assert s.reqs["r0"] is r0
    assert before == (r0.state, r0.aborting, list(r0.outputs), r0.attempt, r0.inflight,
                      table(s, "r0") if s.blocks.has("r0") else None, ids(s.waiting), ids(s.running), s.blocks.num_free)
    fin(s)
    finish_all(sc)
    s.add(new(0))  # released: the id is free again
    assert ids(admit(s)) == ["r0"]


def test_an_id_stays_held_until_prefill_answers_its_drop() -> None:
    """Prefill answers every Drop, even after PrefillDone: until that Dropped comes the id is refused,
    so a late Dropped can never free a newer request's blocks while prefill computes into them."""
    s = make()
    free0 = s.blocks.num_free
    s.add(new(0))
    [kv_old] = admit(s)
    assert s.abort("r0") is True  # Drop #1; prefill had already finished r0, so it answers PrefillDone, Dropped
    assert s.abort("r0") is False  # a second abort sends no second Drop
    assert answer(s, kv_old) is None and fin(s) == ["r0:abort"]
    assert s.blocks.num_free == free0 and "r0" in s.reqs  # blocks back now; the id still held
    s.add(new(0))  # reused too early: refused, and the held request is untouched
    assert [(f.req_id, f.reason) for f in s.finished] == [("r0", "error")]
    assert "still in flight" in s.finished[0].message
    s.finished.clear()
    assert admit(s) == []
    s.dropped("r0")  # the answer to Drop #1
    assert "r0" not in s.reqs and not s.finished and s.blocks.num_free == free0
    s.add(new(0))
    [kv_new] = admit(s)
    assert table(s, "r0") == kv_new.block_ids


def test_stats_count_every_state() -> None:
    sc = scene_preempted()  # r9 runs (3 blocks of 4), r0 waits after a preemption
    s = sc.s
    s.add(new(1, 1))
    assert s.stats("p", 3) == m.Stats(1, 2, 0, 4, 1, 1, "p", 3)
    assert s.mean_context() == 9 and s.has_pending
    assert admit(s) == []  # r0 needs 3 blocks, 1 is free; r1 waits behind it
    s.abort("r9")
    assert ids(admit(s)) == ["r0", "r1"]
    assert s.stats("q", 0) == m.Stats(0, 0, 2, 4, 0, 1, "q", 0) and s.mean_context() == 0 and s.has_pending


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
    [kv1] = admit(s)
    s.unadmit([kv1])
    check(s)
    assert refs(s, kv0.block_ids) == [1, 1, 1] and cached(s) == set(kv0.block_ids[:2])
    [kv1] = admit(s)
    assert kv1.cached_tokens == 8 and kv1.block_ids[:2] == kv0.block_ids[:2]
    answer(s, kv1)
    finish_all(Scene(s))


# ---- 10. randomized simulation, driven as decode_worker.py drives it -------------------------------
M61 = (1 << 61) - 1
GARBAGE = -1  # what a dropped, failed or broken computation leaves in a slot


def kv_of(prev: int, token: int) -> int:
    """The fake model's K/V at a position: a function of the K/V before it (as read from the pool) and the
    token there, so of every token up to it."""
    return (prev * 1_000_003 + token + 1) % M61


def kvs_of(tokens: list[int]) -> list[int]:
    out: list[int] = []
    for t in tokens:
        out.append(kv_of(out[-1] if out else 0, t))
    return out


def next_token(kv: int) -> int:
    """The fake model's sampled token after a position whose K/V is `kv`: it depends only on the tokens so far."""
    x = (kv * 0x9E3779B97F4A7C15 >> 17) % 1000
    return EOS if x < 80 else STOP if x < 140 else PROMPT0 + 20 + x % 70


def ideal(prompt: list[int], p: SamplingParams, cap: int) -> list[int]:
    """A request's outputs with nothing in the way (no abort, failure or preemption)."""
    outs: list[int] = []
    kv = kvs_of(prompt)[-1]
    while True:
        outs.append(next_token(kv))
        if check_stop(p, outs, len(prompt) + len(outs), (EOS,), cap) is not None:
            return outs
        kv = kv_of(kv, outs[-1])


@dataclass
class Seen:
    """What the router got for one request."""

    tokens: list[m.TokenOut] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)  # "prefill:<reason>", "decode:<reason>", "finished:<reason>"
    aborted: bool = False  # the router sent Abort (possibly racing with the end)


@dataclass
class Outcome:
    counts: Counter[str]
    streams: dict[str, tuple[list[int], bool]]  # per request: the tokens the router got, whether a token ended it


Write = tuple[DecodeRequest, int]  # a decode step's row: the request and the position its input token is written to


class Sim:
    """The decode worker's loop around the scheduler, with a fake prefill worker (FIFO, answers every Drop
    with Dropped, as prefill_worker.py does), a fake router checking what it receives, and a fake model over a
    fake KV pool: prefill and decode steps read K/V from the blocks of their table and write theirs there, and
    a sampled token depends on what they read. So a cache hit on a block with other content, or a block written
    while another request reads it, changes the outputs; the Sim also asserts each directly: every write goes to
    a block that only its writer holds and that is not registered, and every registered block holds the K/V of
    the tokens its hash names."""

    def __init__(self, seed: int, cache: bool) -> None:
        self.rng = rng = random.Random(seed)
        num_blocks = rng.randint(5, 12)
        self.cap = num_blocks * BS - rng.choice([0, 0, 3])
        self.cache = cache
        self.s = DecodeScheduler(BlockManager(num_blocks, BS, rng.choice([0.0, 0.1, 0.25]), enable_caching=cache,
                                              salt=SALT), rng.randint(1, 5), (EOS,), self.cap)
        self.prefill: list[m.KVReady] = []  # prefill's queue: it writes these blocks
        self.p2d: deque[m.PrefillDone | m.PrefillFailed | m.Dropped] = deque()
        self.inflight: tuple[list[DecodeRequest], list[Write]] | None = None
        self.seen: dict[str, Seen] = {}
        self.objs: dict[str, DecodeRequest] = {}
        self.counts: Counter[str] = Counter()
        # the workload: its own generator, so a seed gives the same requests with the cache on and off
        self.wl = random.Random(seed + 1_000_003)
        # prompts are made of a few block-sized chunks, so one block's tokens come after different prefixes
        self.chunks = [[self.wl.randint(PROMPT0, PROMPT0 + 29) for _ in range(BS)] for _ in range(3)]
        self.systems = [self.chunked(2) + self.tail(0, 2) for _ in range(3)]
        self.prompts: list[list[int]] = []
        self.ideals: dict[str, list[int]] = {}
        # the fake pool: per block and slot, the K/V written there and by whom ("p"refill, "d"ecode)
        self.pool: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.by: list[list[str]] = [[""] * BS for _ in range(num_blocks)]
        self.expect: dict[bytes, list[int]] = {}  # a block hash -> the K/V its block must hold
        self.known: dict[str, tuple[list[bytes], list[int]]] = {}  # per request: its block hashes and K/V so far

    def chunked(self, most: int) -> list[int]:
        return [t for _ in range(self.wl.randint(1, most)) for t in self.wl.choice(self.chunks)]

    def tail(self, least: int, most: int) -> list[int]:
        return [self.wl.randint(PROMPT0, PROMPT0 + 29) for _ in range(self.wl.randint(least, most))]

    # -- the fake model ---------------------------------------------------------------------------
    def learn(self, r: DecodeRequest) -> list[int]:
        """The true K/V of `r`'s tokens so far, and the block hashes they give (the cache's truth)."""
        hs, kvs = self.known.setdefault(r.req_id, ([], []))
        toks = r.tokens
        while len(kvs) < len(toks):
            kvs.append(kv_of(kvs[-1] if kvs else 0, toks[len(kvs)]))
        while self.cache and (len(hs) + 1) * BS <= len(toks):
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else SALT, toks[i * BS:(i + 1) * BS]))
            want = kvs[i * BS:(i + 1) * BS]
            assert self.expect.setdefault(hs[-1], want) == want, "two prefixes with one hash"
        return kvs

    def read(self, table: list[int], pos: int) -> int | None:
        return self.pool[table[pos // BS]][pos % BS]

    def write(self, table: list[int], pos: int, kv: int, by: str) -> None:
        blk = table[pos // BS]
        b = self.s.blocks
        assert b._ref[blk] == 1, f"a write into block {blk}, which {b._ref[blk]} tables hold"
        assert blk not in b._hash_of, f"a write into block {blk}, which is in the prefix cache"
        self.pool[blk][pos % BS] = kv
        self.by[blk][pos % BS] = by

    def owned(self, table: list[int], pos: int) -> None:
        """The block of `pos` may be written now: only its request holds it and it is not registered."""
        blk = table[pos // BS]
        assert self.s.blocks._ref[blk] == 1 and blk not in self.s.blocks._hash_of, f"block {blk} is shared"

    # -- the router ------------------------------------------------------------------------------
    def emit(self, t: m.TokenOut, by: str) -> None:
        v = self.seen[t.req_id]
        assert not v.ends and not v.aborted, f"token {t} after the end ({v.ends}, aborted={v.aborted})"
        assert t.index == len(v.tokens), f"token {t} after {len(v.tokens)} tokens"
        v.tokens.append(t)
        if t.finish_reason is not None:
            v.ends.append(f"{by}:{t.finish_reason}")

    def publish(self) -> None:
        for f in self.s.finished:
            v = self.seen[f.req_id]
            if f.reason == "abort":
                assert v.aborted
            if v.ends:  # only: aborted while prefill held it, and prefill's first token had ended it
                assert f.reason == "abort" and len(v.ends) == 1 and v.ends[0].startswith("prefill:"), (f, v.ends)
            v.ends.append(f"finished:{f.reason}")
        self.s.finished.clear()

    # -- events ----------------------------------------------------------------------------------
    def arrive(self) -> None:
        """The next request of the workload: a system prompt and a tail, a few chunks and a tail, an earlier
        prompt again, or an earlier prompt continued by that request's outputs."""
        wl = self.wl
        rid = f"q{len(self.seen)}"
        mt = None if wl.random() < 0.15 else wl.randint(1, 12)
        p = params(max_tokens=mt, min_tokens=wl.randint(0, min(3, mt or 3)), ignore_eos=wl.random() < 0.2,
                   stop_token_ids=wl.choice([(), (STOP,)]))
        x = wl.random()
        if self.prompts and x < 0.2:
            prompt = list(wl.choice(self.prompts))
        elif self.prompts and x < 0.35:
            j = wl.randrange(len(self.prompts))
            prompt = self.prompts[j] + self.ideals[f"q{j}"][:wl.randint(1, 8)]
        elif x < 0.7:
            prompt = wl.choice(self.systems) + self.tail(0, 6)
        elif x < 0.9:
            prompt = self.chunked(3) + self.tail(0, 4)
        else:
            prompt = self.tail(1, 12)
        prompt = prompt[:min(18, self.cap - 1)]
        self.prompts.append(prompt)
        self.ideals[rid] = ideal(prompt, p, self.cap)
        self.seen[rid] = Seen()
        self.s.add(m.NewRequest(rid, prompt, p, 0.0))
        self.objs[rid] = self.s.reqs[rid]

    def abort(self) -> None:
        live = list(self.s.reqs)
        rid = self.rng.choice(live if live and self.rng.random() < 0.7 else list(self.seen))
        r = self.s.reqs.get(rid)
        self.counts["abort " + ("gone" if r is None else f"{r.state}{'+' if r.inflight or r.aborting else ''}")] += 1
        self.seen[rid].aborted = True
        for kv in [kv for kv in self.prefill if kv.req_id == rid]:  # prefill may have written part of it
            for pos in range(kv.cached_tokens, self.rng.randint(kv.cached_tokens, self.s.reqs[rid].num_tokens)):
                self.write(kv.block_ids, pos, GARBAGE, "p")
        if self.s.abort(rid):  # Drop: prefill forgets the job if it still has it, and answers Dropped
            self.prefill = [kv for kv in self.prefill if kv.req_id != rid]
            self.p2d.append(m.Dropped(rid))

    def admit(self) -> None:
        b = self.s.blocks
        in_use, registered = list(b._ref), set(b._hash_of)
        handed = admit(self.s)
        for kv in handed:
            k = kv.cached_tokens // BS
            for blk in kv.block_ids[:k]:
                self.counts["hit, in use" if in_use[blk] else "hit, revived"] += 1
                if "d" in self.by[blk]:
                    self.counts["hit on decode's K/V"] += 1
            self.counts["evicted"] += sum(1 for blk in kv.block_ids[k:] if blk in registered)
        if handed and self.rng.random() < 0.2:  # prefill's inbox is full from handed[i] on
            i = self.rng.randrange(len(handed))
            self.s.unadmit(handed[i:])
            handed = handed[:i]
            self.counts["unadmit"] += 1
        self.prefill += handed

    def prefill_step(self) -> None:
        if not self.prefill:
            return
        kv = self.prefill.pop(0)
        toks = kv.request.prompt_token_ids + kv.outputs
        c, t = kv.cached_tokens, kv.block_ids
        truth = kvs_of(toks)
        assert [self.read(t, pos) for pos in range(c)] == truth[:c], "a cache hit holds other K/V"
        if self.rng.random() < 0.05:  # it broke, part way
            for pos in range(c, self.rng.randint(c, len(toks))):
                self.write(t, pos, GARBAGE, "p")
            self.p2d.append(m.PrefillFailed(kv.req_id, kv.attempt, "prefill broke"))
            return
        kv_prev = self.read(t, c - 1) if c else 0
        for pos in range(c, len(toks)):
            assert kv_prev is not None
            kv_prev = kv_of(kv_prev, toks[pos])
            self.write(t, pos, kv_prev, "p")
        assert kv_prev is not None
        tok = next_token(kv_prev)
        outs = [*kv.outputs, tok]
        reason = check_stop(kv.request.params, outs, len(kv.request.prompt_token_ids) + len(outs), (EOS,), self.cap)
        first = m.TokenOut(kv.req_id, len(kv.outputs), tok, None, None, reason)
        if reason is not None:  # prefill sends a first token that ends the request to the router itself
            self.emit(first, "prefill")
        self.p2d.append(m.PrefillDone(kv.req_id, kv.attempt, first))

    def deliver(self) -> None:
        for _ in range(self.rng.randint(1, 3)):
            if not self.p2d:
                return
            msg = self.p2d.popleft()
            if isinstance(msg, m.PrefillDone):
                first = self.s.prefill_done(msg)
                self.learn(self.objs[msg.req_id])  # its prompt's blocks may be registered now
                if first is not None:
                    assert first is msg.token and first.finish_reason is None
                    self.emit(first, "decode")
            elif isinstance(msg, m.PrefillFailed):
                self.counts["prefill failed"] += 1
                self.s.prefill_failed(msg)
            else:
                self.s.dropped(msg.req_id)

    def complete(self) -> None:
        """The step in flight lands: each row reads the K/V before its position, writes its input token's and
        samples from it. A row whose request was aborted meanwhile had an input that was dropped: garbage."""
        if self.inflight is None:
            return
        batch, writes = self.inflight
        self.inflight = None
        rows: list[Row] = []
        for r, pos in writes:
            t = self.s.blocks.table(r.req_id)
            if pos < r.num_tokens:
                truth = self.learn(r)
                kv_prev = self.read(t, pos - 1)
                assert kv_prev == truth[pos - 1], f"{r.req_id} read other K/V at {pos - 1}"
                kv = kv_of(kv_prev, r.tokens[pos])
                self.write(t, pos, kv, "d")
                rows.append((next_token(kv), -1.0, None))
            else:
                assert r.state != "running"
                self.write(t, pos, GARBAGE, "d")
                rows.append((TOK, -1.0, None))
        for out in self.s.record(batch, rows):
            self.emit(out, "decode")
        for r in batch:
            self.learn(r)  # its decode blocks may be registered now

    def decode_step(self) -> None:
        s, rng = self.s, self.rng
        if not s.running and self.inflight is None:
            return
        if rng.random() < 0.02:  # the step fails for no single row
            self.counts["fail_batch"] += 1
            f, self.inflight = self.inflight, None
            if f is not None:
                for r, pos in f[1]:  # it wrote what it wrote
                    self.write(s.blocks.table(r.req_id), pos, GARBAGE, "d")
            s.fail_batch(f[0] if f is not None else [], "decode step broke")
            return
        batch = s.schedule(quiet=self.inflight is None)
        if batch is None:  # preemption needs a quiet pool: the step in flight lands first
            self.counts["deferred"] += 1
            self.complete()
            batch = s.schedule(quiet=True)
            assert batch is not None
        for r in batch:
            assert r.state == "running" and len(s.blocks.table(r.req_id)) * BS >= r.tokens_needed
        if not batch:
            self.complete()
            return
        if rng.random() < 0.03:  # sampling raised for some rows (RequestsFailed): they fail, the rest go on
            self.counts["fail"] += 1
            s.fail(rng.sample(batch, rng.randint(1, len(batch))), "sampling broke")
            self.complete()
            return
        writes = [(r, r.tokens_needed - 1) for r in batch]
        for r, pos in writes:
            self.owned(s.blocks.table(r.req_id), pos)
        s.launched(batch)
        self.complete()
        self.inflight = (batch, writes)

    # -- checks ----------------------------------------------------------------------------------
    def check(self) -> None:
        s = self.s
        b = s.blocks
        check(s)
        for kv in self.prefill:  # prefill may write these blocks: still that request's, and its own
            r = s.reqs[kv.req_id]
            assert r.state == "prefilling" and r.attempt == kv.attempt and b.table(kv.req_id) == kv.block_ids
            assert all(blk in b._hash_of for blk in kv.block_ids[:kv.cached_tokens // BS])  # what it reads
            for pos in range(kv.cached_tokens, r.num_tokens, BS):
                self.owned(kv.block_ids, pos)
        if self.inflight is not None:  # the step in flight writes these blocks: still theirs, and their own
            for r, pos in self.inflight[1]:
                assert b.has(r.req_id)
                self.owned(b.table(r.req_id), pos)
        for blk, h in b._hash_of.items():  # a registered block holds what its hash names
            assert h in self.expect and self.pool[blk] == self.expect[h], f"block {blk} holds other K/V"
        assert s.num_preemptions == sum(r.attempt for r in self.objs.values())
        assert not {kv.req_id for kv in self.prefill} & set(ids(s.waiting))

    def tick(self, arrivals: bool) -> None:
        actions: list[tuple[Callable[[], None], float]] = [
            (self.abort, 0.4 if arrivals else 0.2), (self.admit, 1.0), (self.prefill_step, 1.0),
            (self.deliver, 1.0), (self.decode_step, 2.0)]
        if arrivals:
            actions.append((self.arrive, 1.2))
        fn = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
        if fn != self.abort or self.seen:
            fn()
        self.publish()
        self.check()

    def idle(self) -> bool:
        return not self.s.reqs and self.inflight is None and not self.p2d and not self.prefill

    def run(self, steps: int) -> Outcome:
        for _ in range(steps):
            self.tick(arrivals=True)
        for _ in range(20_000):  # no arrivals: everything must end, every answer be delivered
            if self.idle():
                break
            self.tick(arrivals=False)
        s, b = self.s, self.s.blocks
        assert self.idle() and all_free(s), "the simulation did not drain"
        b.check()
        assert b._ref == [0] * b.num_blocks and not b._tables
        assert not b._chains and not b._committed, "the block manager still keeps state of ended requests"
        streams: dict[str, tuple[list[int], bool]] = {}
        for rid, v in self.seen.items():
            assert [t.index for t in v.tokens] == list(range(len(v.tokens)))
            # every token streamed is an output, but for a first token prefill streamed itself while an abort
            # was on its way: decode drops it (and sends Finished(abort))
            sent = v.tokens[:-1] if v.ends[1:] == ["finished:abort"] else v.tokens
            assert [t.token_id for t in sent] == self.objs[rid].outputs
            assert v.ends, f"{rid} never ended"
            if not v.ends[0].startswith("finished"):
                assert v.tokens[-1].finish_reason is not None
            # the model's tokens depend only on the tokens so far: whatever happened (preemptions, cache hits),
            # a request streams a prefix of its ideal outputs, all of them when a token ended it
            got = [t.token_id for t in v.tokens]
            ended = bool(v.tokens) and v.tokens[-1].finish_reason is not None
            assert got == (self.ideals[rid] if ended else self.ideals[rid][:len(got)]), rid
            streams[rid] = (got, ended)
        self.counts["preemptions"] += s.num_preemptions
        self.counts["requests"] += len(self.seen)
        self.counts["hits"] += b.hits
        self.counts["queries"] += b.queries
        self.counts["ended by a token"] += sum(1 for _, e in streams.values() if e)
        return Outcome(self.counts, streams)


SEEDS = list(range(30))


@functools.cache
def simulate(seed: int, cache: bool) -> Outcome:
    return Sim(seed, cache).run(200)


@pytest.mark.parametrize("cache", [False, True], ids=["cache off", "cache on"])
@pytest.mark.parametrize("seed", SEEDS)
def test_simulation_keeps_every_invariant(seed: int, cache: bool) -> None:
    counts = simulate(seed, cache).counts
    assert counts["requests"] > 20
    assert cache or counts["hits"] == counts["queries"] == 0


def test_simulation_outputs_do_not_depend_on_the_cache() -> None:
    """The same workload with the cache off and on: each request streams the same tokens, up to where an abort
    or a failure (which fall differently in the two runs) cut one of them short."""
    compared = 0
    for seed in SEEDS:
        off, on = simulate(seed, False).streams, simulate(seed, True).streams
        both = set(off) & set(on)
        assert len(both) > 20
        for rid in both:
            (a, a_ended), (b, b_ended) = off[rid], on[rid]
            n = min(len(a), len(b))
            assert a[:n] == b[:n], (seed, rid)
            if a_ended and b_ended:
                assert a == b, (seed, rid)
                compared += 1
    assert compared > 100


@pytest.mark.parametrize("cache", [False, True], ids=["cache off", "cache on"])
def test_simulation_reaches_every_path(cache: bool) -> None:
    total: Counter[str] = Counter()
    seeds_with_hits = 0
    for seed in SEEDS:
        counts = simulate(seed, cache).counts
        total += counts
        seeds_with_hits += counts["hits"] > 0
    paths = ["preemptions", "deferred", "unadmit", "fail", "fail_batch", "prefill failed", "abort waiting",
             "abort prefilling", "abort prefilling+", "abort running", "abort running+", "abort done+",
             "abort gone", "ended by a token"]
    if cache:
        paths += ["hit, in use", "hit, revived", "hit on decode's K/V", "evicted"]
        assert seeds_with_hits >= len(SEEDS) * 3 // 4, f"{seeds_with_hits} seeds with hits"
        assert total["hits"] * 5 > total["queries"], dict(total)  # prefixes do repeat
    for what in paths:
        assert total[what] > 0, f"no {what!r} in {dict(total)}"
