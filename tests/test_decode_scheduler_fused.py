"""The decode scheduler's fused steps (`DecodeScheduler.plan`: decodes, then prompt chunks computed in the decode
worker) on CPU, against a small BlockManager, checking the scheduler's invariants after every call (`check`).

Tables of step shapes (budgets, order, seats, pool), then: grammar holds at local admission, no admission in a
step that preempted, preemption of a chunking request, scheduling ahead (a chunk planned while the one before is
in flight), the first token's cached prefix and PhaseTimes, aborts of a chunking request in each state, a failed
batch, the prefix cache (a prompt waits for a prefix being chunked, then shares it), a prompt handed to the
prefill worker beside one chunked here, the hand-overs counted (`num_hand_overs`), and what the policies are told
(`pending_prefill`, `shape_state`)."""

from __future__ import annotations

import pytest

from rapidserve.engine import messages as m
from rapidserve.partition.policy import WaitingPrefill
from rapidserve.partition.shape import Fused
from tests.decode_sched_fakes import (
    BS,
    TOK,
    admit,
    all_free,
    answer,
    check,
    fin,
    fuse,
    ids,
    land,
    land_fused,
    launch,
    make,
    new,
    params,
    shape,
    start,
    table,
)

Chunks = list[tuple[str, int, int, bool]]

# name, running (prompt lengths, via prefill), waiting prompt lengths, max_seqs, num_blocks, chunk_tokens,
# step_tokens, the steps' shapes (each lands before the next is planned)
STEPS: list[tuple[str, list[int], list[int], int, int, int, int, list[tuple[list[str], Chunks]]]] = [
    ("a long prompt is chunked over steps, its last chunk samples", [], [10], 8, 32, 4, 100, [
        ([], [("r0", 0, 4, False)]), ([], [("r0", 4, 4, False)]), ([], [("r0", 8, 2, True)]), (["r0"], [])]),
    ("short prompts share a step, in arrival order", [], [3, 3, 3], 8, 32, 8, 100, [
        ([], [("r0", 0, 3, True), ("r1", 0, 3, True), ("r2", 0, 2, False)]),
        (["r0", "r1"], [("r2", 2, 1, True)]), (["r0", "r1", "r2"], [])]),
    ("decode rows count against the step's tokens", [3], [6], 8, 32, 8, 5, [
        (["r9"], [("r0", 0, 4, False)]), (["r9"], [("r0", 4, 2, True)]), (["r9", "r0"], [])]),
    ("the prompt in progress goes first", [], [6, 2], 8, 32, 4, 100, [
        ([], [("r0", 0, 4, False)]), ([], [("r0", 4, 2, True), ("r1", 0, 2, True)])]),
    ("the seats cap local admission", [], [2, 2, 2], 2, 32, 8, 100, [
        ([], [("r0", 0, 2, True), ("r1", 0, 2, True)]), (["r0", "r1"], [])]),
    ("a running request holds its seat", [3], [2, 2], 2, 32, 8, 100, [
        (["r9"], [("r0", 0, 2, True)]), (["r9", "r0"], [])]),
    ("chunk_tokens 0: decodes only, nothing admitted", [3], [2], 8, 32, 0, 100, [(["r9"], []), (["r9"], [])]),
    ("FCFS: a head that does not fit blocks smaller ones behind it", [], [12, 8, 2], 8, 4, 16, 100, [
        ([], [("r0", 0, 12, True)]), (["r0"], [])]),
]


@pytest.mark.parametrize("name,running,waiting,max_seqs,num_blocks,chunk,step_tokens,want", STEPS,
                         ids=[c[0] for c in STEPS])
def test_fused_step_shapes(name: str, running: list[int], waiting: list[int], max_seqs: int, num_blocks: int,
                           chunk: int, step_tokens: int, want: list[tuple[list[str], Chunks]]) -> None:
    s = make(num_blocks=num_blocks, max_seqs=max_seqs)
    if running:
        start(s, *(new(9 - i, n) for i, n in enumerate(running)))
    for i, n in enumerate(waiting):
        s.add(new(i, n))
    for k, w in enumerate(want):
        batch = fuse(s, chunk, step_tokens, now=float(k))
        assert shape(batch) == w, k
        land_fused(s, batch)
    s2 = s.reqs.get("r0")
    assert s2 is None or s2.state in ("running", "chunking", "waiting")


def test_held_requests_are_passed_over_keeping_their_place_then_admitted_once_ready() -> None:
    s = make()
    for i in range(3):
        s.add(new(i, 2))
    b = fuse(s, 8, hold=frozenset({"r0"}))
    assert shape(b)[1] == [("r1", 0, 2, True), ("r2", 0, 2, True)] and ids(s.waiting) == ["r0"]
    land_fused(s, b)
    assert shape(fuse(s, 8))[1] == [("r0", 0, 2, True)]


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    # 4 blocks: r0 (8 tokens with its first output) runs in 2; r1 (8 tokens) is chunked in the other 2
    s = make(num_blocks=4)
    start(s, new(0, 7))
    s.add(new(1, 8))
    b = fuse(s, 4)
    assert shape(b) == (["r0"], [("r1", 0, 4, False)])
    land_fused(s, b)
    s.add(new(2, 1))
    b = fuse(s, 8)  # r0 needs a third block: r1, the latest admitted, is preempted; r2 is not admitted this step
    assert shape(b) == (["r0"], []) and s.num_preemptions == 1
    assert ids(s.waiting) == ["r1", "r2"] and s.reqs["r1"].attempt == 1 and s.reqs["r1"].computed == 0
    land_fused(s, b)


def test_preemption_waits_for_the_step_in_flight_then_takes_the_latest_admitted() -> None:
    s = make(num_blocks=4)
    start(s, new(0, 7))
    s.add(new(1, 8))
    b1 = fuse(s, 4)
    assert s.plan(4, 100, quiet=False) is None  # r0 must grow, the pool is short, a step is in flight
    land_fused(s, b1)
    b2 = fuse(s, 4)
    assert shape(b2) == (["r0"], []) and s.reqs["r1"].state == "waiting" and not s.blocks.has("r1")


def test_scheduling_ahead_a_chunk_and_a_first_token_in_flight() -> None:
    """The next step is planned while the last is in flight: its chunk starts where the one in flight ends, and
    a request whose last chunk is in flight decodes with its first token still on the device."""
    s = make()
    s.add(new(0, 6))
    b1 = fuse(s, 4)
    b2 = fuse(s, 4, quiet=False)
    assert shape(b2) == ([], [("r0", 4, 2, True)]) and s.reqs["r0"].state == "running"
    assert s.reqs["r0"].chunks_inflight == 1 and s.reqs["r0"].inflight == 1
    land_fused(s, b1)
    b3 = fuse(s, 4, quiet=False)
    assert shape(b3) == (["r0"], []) and s.reqs["r0"].tokens_needed == 8
    assert [(t.index, t.token_id) for t in land_fused(s, b2, 31)] == [(0, 31)]
    assert [(t.index, t.token_id) for t in land_fused(s, b3, 32)] == [(1, 32)]
    assert s.reqs["r0"].outputs == [31, 32]


def test_the_first_token_carries_its_cached_prefix_and_where_its_time_went() -> None:
    s = make(caching=True)
    s.add(new(0, 9))
    land_fused(s, fuse(s, 16, now=1.0), landed=1.5)  # r0's 2 full blocks are cached once the step has landed
    s.add(new(1, 10))
    b = fuse(s, 1, now=2.0)
    assert shape(b)[1] == [("r1", 8, 1, False)]  # r1 shares r0's 8 cached tokens
    land_fused(s, b, landed=2.5)
    b = fuse(s, 8, now=3.0)
    got = [t for t in land_fused(s, b, landed=3.5) if t.req_id == "r1"]
    assert [(t.index, t.cached_tokens, t.times) for t in got] == [(0, 8, m.PhaseTimes(2.0, 2.0, 3.5))]
    later = [t for t in land_fused(s, fuse(s, 8)) if t.req_id == "r1"]
    assert later[0].cached_tokens is None and later[0].times is None


@pytest.mark.parametrize("when", ["no chunk in flight", "a chunk in flight", "its last chunk in flight"])
def test_abort_while_chunking(when: str) -> None:
    s = make()
    start(s, new(9, 3))
    s.add(new(0, 8))
    b = fuse(s, 4)
    if when == "no chunk in flight":
        land_fused(s, b)
        b = None
    elif when == "its last chunk in flight":
        land_fused(s, b)
        b = fuse(s, 4)
        assert s.reqs["r0"].state == "running"
    assert s.abort("r0") is False and fin(s) == ["r0:abort"]
    check(s)
    assert s.blocks.has("r0") == (b is not None)  # a step in flight still writes its blocks
    if b is not None:
        assert [t.req_id for t in land_fused(s, b)] == ["r9"]  # no token after the abort
    assert "r0" not in s.reqs and not s.blocks.has("r0")
    s.abort("r9")
    assert all_free(s)


def test_a_failed_batch_ends_the_chunking_request_of_its_step() -> None:
    s = make()
    start(s, new(9, 3))
    s.add(new(0, 8))
    s.add(new(1, 8))
    b = fuse(s, 4)  # r9 decodes, r0 chunks; r1 waits for the budget
    s.fail_batch(b.decode + [c.req for c in b.chunks], "device fault")
    check(s)
    assert sorted(fin(s)) == ["r0:error", "r9:error"] and set(s.reqs) == {"r1"} and not s.chunking
    land_fused(s, fuse(s, 8))
    assert s.reqs["r1"].state == "running"


def test_a_prompt_waits_for_a_prefix_being_chunked_then_shares_it() -> None:
    s = make(caching=True, share_min=BS)
    s.add(new(0, 13))
    b = fuse(s, 4)
    s.add(new(1, 13))  # the same prompt: r0 is writing its blocks
    land_fused(s, b)
    b = fuse(s, 4)
    assert shape(b)[1] == [("r0", 4, 4, False)] and ids(s.waiting) == ["r1"]  # r1 waits for the prefix
    land_fused(s, b)
    b = fuse(s, 8)
    land_fused(s, b)
    b = fuse(s, 8)  # r0 wrote its 3 full blocks: r1 shares them and computes its last token only
    assert shape(b) == (["r0"], [("r1", 12, 1, True)])
    land_fused(s, b)


def test_a_prompt_handed_to_prefill_beside_one_chunked_here() -> None:
    s = make(max_seqs=2)
    s.add(new(0, 5))
    [kv] = admit(s)  # a split step: r0 goes to the prefill worker
    s.add(new(1, 5))
    s.add(new(2, 5))
    b = fuse(s, 4)  # a fused step: r1 is chunked here; r2 waits for a seat (r0 prefilling, r1 chunking)
    assert shape(b) == ([], [("r1", 0, 4, False)]) and s.busy == 2
    assert s.abort("r0") is True  # the prefill worker holds it: Drop, blocks kept until it answers
    land_fused(s, b)
    assert answer(s, kv) is None and fin(s) == ["r0:abort"]
    s.dropped("r0")
    b = fuse(s, 8)
    assert shape(b) == ([], [("r1", 4, 1, True), ("r2", 0, 5, True)])
    land_fused(s, b)
    for rid in ("r1", "r2"):
        s.abort(rid)
    assert all_free(s)


def test_hand_overs_are_counted_and_one_unadmitted_is_taken_back() -> None:
    """`num_hand_overs` (Stats; /metrics' rapidserve:prompts_handed_over_total) counts the prompts chunked here that a
    split step handed to the prefill worker (`hand_over`): not one whose chunk is still in flight, not a waiting
    prompt admitted to prefill, and one un-admitted (prefill's inbox full: it goes on chunking here) is taken back
    until it really goes."""
    s = make(max_seqs=4)
    start(s, new(9, 3))  # r9 decodes
    s.add(new(0, 10))
    b = fuse(s, 4)
    assert shape(b) == (["r9"], [("r0", 0, 4, False)])
    assert admit(s) == [] and s.num_hand_overs == 0  # a split while r0's chunk is in flight: it stays
    land_fused(s, b)
    s.add(new(1, 5))
    kvs = admit(s)  # r0 goes on at prefill from its 4 tokens; r1 goes there as any waiting prompt
    assert ids(kvs) == ["r0", "r1"] and [kv.computed_tokens for kv in kvs] == [4, 0] and s.num_hand_overs == 1
    s.unadmit(kvs)  # prefill's inbox was full: r0 goes on chunking here, r1 waits again
    assert (s.reqs["r0"].state, s.reqs["r1"].state, s.num_hand_overs) == ("chunking", "waiting", 0)
    b = fuse(s, 4)
    assert shape(b) == (["r9"], [("r0", 4, 4, False)])
    land_fused(s, b)
    kvs = admit(s)
    assert ids(kvs) == ["r0", "r1"] and kvs[0].computed_tokens == 8 and s.num_hand_overs == 1
    assert s.stats("split", 0).num_hand_overs == 1
    for kv in kvs:
        assert answer(s, kv) is not None
    land(s, launch(s))
    assert s.num_hand_overs == 1  # cumulative
    for rid in ("r9", "r0", "r1"):
        s.abort(rid)
    assert all_free(s)


def test_the_policies_are_told_every_prompt_not_yet_computed() -> None:
    s = make(max_seqs=8)
    start(s, new(9, 3))
    s.add(new(0, 6))
    [kv] = admit(s)
    s.add(new(1, 10))
    s.add(new(2, 3, params(max_tokens=2)))
    land_fused(s, fuse(s, 4))  # r1 chunks 4 of 10; r2 waits for the budget
    assert s.pending_prefill() == (WaitingPrefill("r0", 0.0, 6, 0), WaitingPrefill("r1", 0.0, 6, 4),
                                   WaitingPrefill("r2", 0.0, 3, 0))
    st = s.shape_state(Fused(4), 50.0, 64)
    assert st.decode_contexts == (s.reqs["r9"].tokens_needed,) and st.prefill_worker_tokens == 6
    assert st.waiting == s.pending_prefill() and st.current == Fused(4) and st.max_chunk_tokens == 64
    assert s.stats("overallocated", 0).num_prefilling == 2 and s.has_pending
    answer(s, kv, TOK)
    assert s.prefill_worker_tokens() == 0
    assert table(s, "r1") == s.blocks.table("r1")
