"""The decode worker's scheduler (`rapidserve/engine/decode_scheduler.py`) on CPU, against a small BlockManager,
with the prefix cache off.

Table tests, each checking the scheduler's invariants after every step (`check`), for: admission (seats, the
pool and its watermark with the "alone" exception, FCFS, KVReady contents, `unadmit`), block-table growth
(the in-flight token counted), preemption by recompute (deferred while a step is in flight, latest admitted
first, re-admission with outputs and a new attempt, stale prefill answers ignored), stops applied by
`record`, prefill answers, aborts in every state, `fail` / `fail_batch`, and duplicate request ids. The prefix
cache's cases are in `test_decode_scheduler_cache.py`, the randomized simulation in
`test_decode_scheduler_sim.py`, the shared helpers in `decode_sched_fakes.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rapidserve.block_manager import blocks_for
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, DecodeScheduler
from rapidserve.sampling_params import SamplingParams
from tests.decode_sched_fakes import (
    BS,
    EOS,
    STOP,
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
    start(s, new(0, 3, params(stop_token_ids=[STOP])))
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    assert land(s, b0, STOP)[0].finish_reason == "stop"  # ended by its token; b1 still writes its blocks
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
    start(s, new(0, 4, params(stop_token_ids=[STOP])), new(1, 4))
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    out0 = land(s, b0, [STOP, TOK])
    assert [(t.req_id, t.index, t.finish_reason) for t in out0] == [("r0", 1, "stop"), ("r1", 1, None)]
    assert s.reqs["r0"].state == "done" and s.blocks.has("r0") and ids(s.running) == ["r1"]
    out1 = land(s, b1)
    assert [(t.req_id, t.index) for t in out1] == [("r1", 2)] and "r0" not in s.reqs and not s.finished


@pytest.mark.parametrize("cap", [None, 6], ids=["max_tokens", "the context cap"])
def test_a_token_in_flight_that_must_end_its_request_gets_no_further_step(cap: int | None) -> None:
    """The length rule (stop_rules.reaches_length) holds whatever the token: the next batch leaves the request
    out (no row, no block grown for it), and its blocks go back as soon as that token is recorded."""
    s = make(num_blocks=8, cap=cap)
    start(s, new(0, 4, params(max_tokens=2 if cap is None else 100)), new(1, 2))
    b0 = launch(s)
    grown = table(s, "r0")
    b1 = launch(s, quiet=False)
    assert ids(b1) == ["r1"] and table(s, "r0") == grown
    out0 = land(s, b0)
    assert [(t.req_id, t.index, t.finish_reason) for t in out0] == [("r0", 1, "length"), ("r1", 1, None)]
    assert "r0" not in s.reqs and not s.blocks.has("r0") and not s.finished
    assert [(t.req_id, t.index) for t in land(s, b1)] == [("r1", 2)]


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
    start(s, new(9), new(0, p=params(stop_token_ids=[STOP])))
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    assert [t.finish_reason for t in land(s, b0, [TOK, STOP])] == [None, "stop"]
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
        s.add(new(i, 5, params(stop_token_ids=[STOP]) if i == 2 else None))
    kvs = admit(s)  # r0..r4; r5 waits for a seat
    assert ids(kvs) == ["r0", "r1", "r2", "r3", "r4"]
    for kv in kvs[:3]:
        answer(s, kv)
    b0 = launch(s)
    b1 = launch(s, quiet=False)
    assert [t.finish_reason for t in land(s, b0, [TOK, TOK, STOP])] == [None, None, "stop"]  # b1 writes r2's blocks
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
