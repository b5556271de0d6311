"""Hybrid mode's steps (chunked prefill: every step fused) as the decode scheduler plans them: `plan` with the
budget `AlwaysFused` gives (`--max-num-batched-tokens` for the whole step: decodes first, prompt chunks in the
rest) and the seats the decode worker gives (at most the budget), on CPU against a small BlockManager.

These are the cases of the hybrid scheduler's tests (rapidserve/hybrid_scheduler.py, now gone: its planning is
`DecodeScheduler.plan`'s), with their assertions. One notation changed: a prompt's last token is computed as the
last chunk of the prompt (`P:s0[4:5]`), where the hybrid scheduler planned it as a decode row (`D:s0`); the step
and its tokens are the same."""

from __future__ import annotations

import pytest

from rapidserve.block_manager import blocks_for
from rapidserve.engine.decode_scheduler import DecodeScheduler, StepBatch
from tests.decode_sched_fakes import BS, check, make, new, params

TOK = 20


def hybrid(num_blocks: int, budget: int, max_seqs: int, watermark: float = 0.0) -> DecodeScheduler:
    """The scheduler of hybrid mode's decode worker: at most `budget` seats (one token each in a step)."""
    return make(num_blocks=num_blocks, max_seqs=min(max_seqs, budget), watermark=watermark)


def add(s: DecodeScheduler, i: int, n: int, max_tokens: int = 3) -> None:
    s.add(new(i, n, params(max_tokens=max_tokens)))


def plan(s: DecodeScheduler, budget: int) -> tuple[StepBatch, list[str]]:
    """AlwaysFused's step: chunks of at most the budget, the whole step within it; the requests it preempted."""
    attempts = {k: r.attempt for k, r in s.reqs.items()}
    b = s.plan(budget, budget, quiet=True)
    assert b is not None
    check(s)
    assert len(b.decode) + b.chunk_tokens <= budget
    return b, [k for k, r in s.reqs.items() if k in attempts and r.attempt > attempts[k]]


def step(s: DecodeScheduler, budget: int) -> str:
    """One step with a fake model that samples TOK (the requests end at their max_tokens)."""
    b, preempted = plan(s, budget)
    s.launched(b)
    s.record(b.sampled, [(TOK, None, None, None)] * len(b.sampled))
    s.chunks_landed(b.chunks)
    check(s)
    return describe(b, preempted)


def describe(b: StepBatch, preempted: list[str]) -> str:
    parts = []
    if b.decode:
        parts.append("D:" + ",".join(r.req_id for r in b.decode))
    if b.chunks:
        parts.append("P:" + ",".join(f"{c.req.req_id}[{c.start}:{c.end}]" for c in b.chunks))
    return " ".join(parts + [f"X:{x}" for x in preempted])


def run_to_end(s: DecodeScheduler, budget: int, max_steps: int = 10_000) -> list[str]:
    log = []
    for _ in range(max_steps):
        if not s.reqs:
            return log
        log.append(step(s, budget))
    raise AssertionError("scheduler did not finish")


CASES = [
    # name, num_blocks, budget, max_seqs, prompts, max_tokens, expected first steps
    ("short prompts share a step, then decode", 64, 64, 8, [5, 5, 5], 2,
     ["P:r0[0:5],r1[0:5],r2[0:5]", "D:r0,r1,r2"]),
    ("decodes first, prompt chunks fill the rest", 64, 16, 8, [10, 20], 3,
     ["P:r0[0:10],r1[0:6]", "D:r0 P:r1[6:20]", "D:r0,r1", "D:r1"]),
    ("long prompt chunked beside decodes", 64, 16, 8, [4, 40], 4,
     ["P:r0[0:4],r1[0:12]", "D:r0 P:r1[12:27]", "D:r0 P:r1[27:40]", "D:r0,r1", "D:r1"]),
    ("a partial prompt goes on before new admissions", 64, 8, 8, [6, 6, 3], 1,
     ["P:r0[0:6],r1[0:2]", "P:r1[2:6],r2[0:3]"]),
    ("a prompt's last token is its last chunk", 64, 4, 8, [5], 2, ["P:r0[0:4]", "P:r0[4:5]", "D:r0"]),
    ("max_num_seqs caps admission", 64, 100, 1, [4, 4], 2, ["P:r0[0:4]", "D:r0", "P:r1[0:4]", "D:r1"]),
    ("the budget caps running sequences", 64, 2, 8, [1, 1, 1], 2, ["P:r0[0:1],r1[0:1]", "D:r0,r1", "P:r2[0:1]"]),
    ("pool caps admission", 4, 64, 8, [8, 8], 1, ["P:r0[0:8],r1[0:8]"]),
    ("pool too small for the second", 3, 64, 8, [8, 8], 1, ["P:r0[0:8]", "P:r1[0:8]"]),
]


@pytest.mark.parametrize("name,num_blocks,budget,max_seqs,prompts,max_tokens,expected", CASES,
                         ids=[c[0] for c in CASES])
def test_schedule_table(name: str, num_blocks: int, budget: int, max_seqs: int, prompts: list[int],
                        max_tokens: int, expected: list[str]) -> None:
    s = hybrid(num_blocks, budget, max_seqs)
    reqs = []
    for i, n in enumerate(prompts):
        add(s, i, n, max_tokens)
        reqs.append(s.reqs[f"r{i}"])
    log = run_to_end(s, budget)
    assert log[: len(expected)] == expected
    assert s.blocks.num_free == num_blocks
    assert all(len(r.outputs) == max_tokens and r.state == "done" for r in reqs)


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks() -> None:
    # 4 blocks of 4 tokens: two requests of 7 tokens fit (2 blocks each) until both need a third.
    s = hybrid(4, 64, 8)
    add(s, 0, 7, max_tokens=6)
    add(s, 1, 7, max_tokens=6)
    a, b = s.reqs["r0"], s.reqs["r1"]
    log = run_to_end(s, 64)
    assert log[:3] == ["P:r0[0:7],r1[0:7]", "D:r0,r1", "D:r0 X:r1"]  # the later admission is the victim
    assert b.attempt >= 1 and a.attempt == 0 and s.num_preemptions == b.attempt
    # r1 comes back with prompt + its outputs recomputed, then decodes on
    assert any(x.startswith("P:r1[0:") and x != "P:r1[0:7]" for x in log)
    assert len(a.outputs) == 6 and len(b.outputs) == 6
    assert s.blocks.num_free == 4


def test_victim_still_prefilling_loses_its_progress() -> None:
    # r0 decodes and needs a new block while r1 (admitted later) is mid-prompt and holds the rest.
    s = hybrid(4, 5, 8)
    add(s, 0, 4, max_tokens=3)
    add(s, 1, 12, max_tokens=1)
    b = s.reqs["r1"]
    assert step(s, 5) == "P:r0[0:4],r1[0:1]"
    assert step(s, 5) == "D:r0 X:r1"  # r0 needs a block for its 5th token; r1 holds all the others
    assert b.state == "waiting" and b.computed == 0 and not s.blocks.has("r1")
    run_to_end(s, 5)
    assert b.outputs == [TOK] and s.blocks.num_free == 4


def test_a_lone_request_needing_a_block_comes_back() -> None:
    s = hybrid(3, 64, 8)
    add(s, 0, 8, max_tokens=4)  # grows past 8 tokens: needs the third block, which is free
    assert run_to_end(s, 64) == ["P:r0[0:8]", "D:r0", "D:r0", "D:r0"]
    assert s.blocks.num_free == 3


def test_watermark_never_starves_a_lone_request() -> None:
    s = hybrid(4, 64, 8, watermark=0.5)
    add(s, 0, 15, max_tokens=1)
    assert step(s, 64) == "P:r0[0:15]"


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    s = hybrid(4, 64, 8)
    add(s, 0, 8, max_tokens=3)
    add(s, 1, 4, max_tokens=3)
    assert step(s, 64) == "P:r0[0:8],r1[0:4]"  # 3 blocks, 1 free
    add(s, 2, 1, max_tokens=1)
    c = s.reqs["r2"]
    assert step(s, 64) == "D:r0 X:r1"  # r0 takes the last block for its 9th token; r1 preempts itself
    assert c.state == "waiting" and s.blocks.num_free == 1  # r1's block: r2 would fit, yet waits
    run_to_end(s, 64)
    assert c.outputs == [TOK] and s.blocks.num_free == 4


@pytest.mark.parametrize("when", [0, 1, 2, 5])
def test_abort_at_any_step_frees_every_block(when: int) -> None:
    s = hybrid(16, 6, 8)
    for i, n in enumerate([9, 3, 14]):
        add(s, i, n, max_tokens=4)
    first = s.reqs["r0"]
    for _ in range(when):
        step(s, 6)
    s.abort("r2")
    assert not s.blocks.has("r2") and "r2" not in s.reqs
    run_to_end(s, 6)
    assert s.blocks.num_free == 16 and len(first.outputs) == 4


def test_abort_while_a_step_is_in_flight_frees_once_it_lands() -> None:
    s = hybrid(16, 64, 8)
    add(s, 0, 5)
    b, _ = plan(s, 64)
    s.launched(b)
    s.abort("r0")  # the router's Abort arrives while the device runs the step
    assert s.blocks.has("r0")  # the step writes its blocks
    s.record(b.sampled, [(TOK, None, None, None)] * len(b.sampled))
    s.chunks_landed(b.chunks)
    assert not s.reqs and s.blocks.num_free == 16 and [f.reason for f in s.finished] == ["abort"]


def test_many_requests_small_pool_small_budget_all_finish() -> None:
    s = hybrid(10, 8, 6)
    reqs = []
    for i in range(20):
        add(s, i, 1 + (7 * i) % 17, max_tokens=4 + i % 9)
        reqs.append(s.reqs[f"r{i}"])
    log = run_to_end(s, 8)
    assert all(len(r.outputs) == r.params.max_tokens for r in reqs)
    assert s.blocks.num_free == 10 and s.num_preemptions > 0
    assert any("D:" in x and "P:" in x for x in log)  # mixed steps happened


def test_counts_split_decoding_prefilling_waiting() -> None:
    s = hybrid(64, 6, 2)
    for i, n in enumerate([3, 10, 4]):
        add(s, i, n)
    step(s, 6)  # r0 whole, r1 first 3 tokens; r2 waits for the running cap
    st = s.stats("overallocated", 0)
    assert (st.num_running, st.num_prefilling, st.num_waiting) == (1, 1, 1)


@pytest.mark.parametrize("tokens,budget", [(40, 7), (5, 1), (33, 16)])
def test_chunks_cover_the_prompt_exactly_once(tokens: int, budget: int) -> None:
    s = hybrid(blocks_for(tokens + 4, BS), budget, 4)
    add(s, 0, tokens, max_tokens=2)
    a = s.reqs["r0"]
    covered: list[int] = []
    while not a.outputs:
        b, _ = plan(s, budget)
        covered += [p for c in b.chunks for p in range(c.start, c.end)]
        covered += [r.tokens_needed - 1 for r in b.decode]
        s.launched(b)
        s.record(b.sampled, [(TOK, None, None, None)] * len(b.sampled))
        s.chunks_landed(b.chunks)
    assert covered == list(range(tokens))
