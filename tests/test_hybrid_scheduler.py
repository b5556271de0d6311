"""Hybrid (chunked-prefill) scheduler decisions on CPU, against a small fake KV pool."""

from __future__ import annotations

import pytest

from rapidserve.block_manager import BlockManager, blocks_for
from rapidserve.hybrid_scheduler import HybridScheduler
from rapidserve.sampling_params import SamplingParams
from rapidserve.sequence import SeqStatus, Sequence
from rapidserve.step_plan import StepPlan

BS = 4


def seq(i: int, n: int, max_tokens: int = 3) -> Sequence:
    return Sequence(f"s{i}", list(range(1, n + 1)), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    arrival=i)


def describe(plan: StepPlan) -> str:
    parts = []
    if plan.decode:
        parts.append("D:" + ",".join(s.seq_id for s in plan.decode))
    if plan.prefill:
        parts.append("P:" + ",".join(f"{c.seq.seq_id}[{c.start}:{c.start + c.length}]" for c in plan.prefill))
    parts += [f"X:{s.seq_id}" for s in plan.preempted]
    return " ".join(parts)


def check_invariants(s: HybridScheduler, plan: StepPlan) -> None:
    assert plan.num_tokens <= s.budget
    assert len(s.running) <= s.max_running
    ids = [x.seq_id for x in s.running] + [x.seq_id for x in s.waiting]
    assert len(ids) == len(set(ids))
    for x in plan.decode:
        assert x.num_tokens - x.num_computed == 1
        assert len(s.blocks.table(x.seq_id)) * BS >= x.num_tokens
    for c in plan.prefill:
        assert c.start == c.seq.num_computed and c.length >= 1
        assert len(s.blocks.table(c.seq.seq_id)) * BS >= c.start + c.length
    for x in s.waiting:
        assert not s.blocks.has(x.seq_id) and x.num_computed == 0
    s.blocks.check()


def step(s: HybridScheduler, token: int = 7) -> str:
    """One step with a fake model that samples `token`; finishes sequences at max_tokens."""
    plan = s.schedule()
    check_invariants(s, plan)
    s.complete(plan)
    for x in plan.sampled:
        x.output_token_ids.append(token)
        if len(x.output_token_ids) >= x.params.max_tokens:  # type: ignore[operator]
            s.finish(x, "length")
    s.blocks.check()
    return describe(plan)


def run_to_end(s: HybridScheduler, max_steps: int = 10_000) -> list[str]:
    log = []
    for _ in range(max_steps):
        if not s.has_work:
            return log
        log.append(step(s))
    raise AssertionError("scheduler did not finish")


CASES = [
    # name, num_blocks, budget, max_seqs, prompts, max_tokens, expected first steps
    ("short prompts share a step, then decode", 64, 64, 8, [5, 5, 5], 2,
     ["P:s0[0:5],s1[0:5],s2[0:5]", "D:s0,s1,s2"]),
    ("decodes first, prompt chunks fill the rest", 64, 16, 8, [10, 20], 3,
     ["P:s0[0:10],s1[0:6]", "D:s0 P:s1[6:20]", "D:s0,s1", "D:s1"]),
    ("long prompt chunked beside decodes", 64, 16, 8, [4, 40], 4,
     ["P:s0[0:4],s1[0:12]", "D:s0 P:s1[12:27]", "D:s0 P:s1[27:40]", "D:s0,s1", "D:s1"]),
    ("a partial prompt goes on before new admissions", 64, 8, 8, [6, 6, 3], 1,
     ["P:s0[0:6],s1[0:2]", "P:s1[2:6],s2[0:3]"]),
    ("a prompt's last token is planned like a decode", 64, 4, 8, [5], 2, ["P:s0[0:4]", "D:s0", "D:s0"]),
    ("max_num_seqs caps admission", 64, 100, 1, [4, 4], 2, ["P:s0[0:4]", "D:s0", "P:s1[0:4]", "D:s1"]),
    ("the budget caps running sequences", 64, 2, 8, [1, 1, 1], 2, ["P:s0[0:1],s1[0:1]", "D:s0,s1", "P:s2[0:1]"]),
    ("pool caps admission", 4, 64, 8, [8, 8], 1, ["P:s0[0:8],s1[0:8]"]),
    ("pool too small for the second", 3, 64, 8, [8, 8], 1, ["P:s0[0:8]", "P:s1[0:8]"]),
]


@pytest.mark.parametrize("name,num_blocks,budget,max_seqs,prompts,max_tokens,expected", CASES,
                         ids=[c[0] for c in CASES])
def test_schedule_table(name: str, num_blocks: int, budget: int, max_seqs: int, prompts: list[int],
                        max_tokens: int, expected: list[str]) -> None:
    s = HybridScheduler(BlockManager(num_blocks, BS, watermark=0.0), max_seqs, budget)
    seqs = [seq(i, n, max_tokens) for i, n in enumerate(prompts)]
    for x in seqs:
        s.add(x)
    log = run_to_end(s)
    assert log[: len(expected)] == expected
    assert s.blocks.num_free == num_blocks
    assert all(len(x.output_token_ids) == max_tokens and x.status is SeqStatus.FINISHED for x in seqs)


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks() -> None:
    # 4 blocks of 4 tokens: two sequences of 7 tokens fit (2 blocks each) until both need a third.
    s = HybridScheduler(BlockManager(4, BS, watermark=0.0), 8, 64)
    a, b = seq(0, 7, max_tokens=6), seq(1, 7, max_tokens=6)
    s.add(a)
    s.add(b)
    log = run_to_end(s)
    assert log[:3] == ["P:s0[0:7],s1[0:7]", "D:s0,s1", "D:s0 X:s1"]  # the later admission is the victim
    assert b.num_preemptions >= 1 and a.num_preemptions == 0 and s.num_preemptions == b.num_preemptions
    # s1 comes back with prompt + its outputs recomputed (the last one as a decode), then decodes on
    assert any(x.startswith("P:s1[0:") and x != "P:s1[0:7]" for x in log)
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6
    assert s.blocks.num_free == 4


def test_victim_still_prefilling_loses_its_progress() -> None:
    # s0 decodes and needs a new block while s1 (admitted later) is mid-prompt and holds the rest.
    s = HybridScheduler(BlockManager(4, BS, watermark=0.0), 8, 5)
    a, b = seq(0, 4, max_tokens=3), seq(1, 12, max_tokens=1)
    s.add(a)
    s.add(b)
    assert step(s) == "P:s0[0:4],s1[0:1]"
    assert step(s) == "D:s0 X:s1"  # s0 needs a block for its 5th token; s1 holds all the others
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and not s.blocks.has("s1")
    run_to_end(s)
    assert b.output_token_ids == [7] and s.blocks.num_free == 4


def test_a_lone_sequence_preempting_itself_comes_back() -> None:
    s = HybridScheduler(BlockManager(3, BS, watermark=0.0), 8, 64)
    a = seq(0, 8, max_tokens=4)  # grows past 8 tokens: needs the third block, which is free
    s.add(a)
    assert run_to_end(s) == ["P:s0[0:8]", "D:s0", "D:s0", "D:s0"]
    assert s.blocks.num_free == 3


def test_watermark_never_starves_a_lone_sequence() -> None:
    s = HybridScheduler(BlockManager(4, BS, watermark=0.5), 8, 64)
    a = seq(0, 15, max_tokens=1)
    s.add(a)
    assert step(s) == "P:s0[0:15]"


def test_nothing_is_admitted_in_a_step_that_preempted() -> None:
    s = HybridScheduler(BlockManager(4, BS, watermark=0.0), 8, 64)
    a, b = seq(0, 8, max_tokens=3), seq(1, 4, max_tokens=3)
    s.add(a)
    s.add(b)
    assert step(s) == "P:s0[0:8],s1[0:4]"  # 3 blocks, 1 free
    c = seq(2, 1, max_tokens=1)
    s.add(c)
    assert step(s) == "D:s0 X:s1"  # s0 takes the last block for its 9th token; s1 preempts itself
    assert c.status is SeqStatus.WAITING and s.blocks.num_free == 1  # s1's block: c would fit, yet waits
    run_to_end(s)
    assert c.output_token_ids == [7] and s.blocks.num_free == 4


@pytest.mark.parametrize("when", [0, 1, 2, 5])
def test_abort_at_any_step_frees_every_block(when: int) -> None:
    s = HybridScheduler(BlockManager(16, BS, watermark=0.0), 8, 6)
    seqs = [seq(i, n, max_tokens=4) for i, n in enumerate([9, 3, 14])]
    for x in seqs:
        s.add(x)
    for _ in range(when):
        step(s)
    victim = seqs[2]
    if not victim.is_finished:
        s.finish(victim, "abort")
    assert not s.blocks.has("s2") and victim not in s.running and victim not in s.waiting
    run_to_end(s)
    assert s.blocks.num_free == 16 and len(seqs[0].output_token_ids) == 4


def test_abort_while_a_step_is_in_flight_leaves_the_sequence_alone() -> None:
    s = HybridScheduler(BlockManager(16, BS, watermark=0.0), 8, 64)
    a = seq(0, 5)
    s.add(a)
    plan = s.schedule()
    s.finish(a, "abort")  # the router's Abort arrives while the GPU runs the step
    s.complete(plan)
    assert a.num_computed == 0 and a.status is SeqStatus.FINISHED and s.blocks.num_free == 16
    assert not s.has_work


def test_many_sequences_small_pool_small_budget_all_finish() -> None:
    s = HybridScheduler(BlockManager(10, BS, watermark=0.0), 6, 8)
    seqs = [seq(i, 1 + (7 * i) % 17, max_tokens=4 + i % 9) for i in range(20)]
    for x in seqs:
        s.add(x)
    log = run_to_end(s)
    assert all(len(x.output_token_ids) == x.params.max_tokens for x in seqs)
    assert s.blocks.num_free == 10 and s.num_preemptions > 0
    assert any("D:" in x and "P:" in x for x in log)  # mixed steps happened


def test_counts_split_decoding_prefilling_waiting() -> None:
    s = HybridScheduler(BlockManager(64, BS, watermark=0.0), 2, 6)
    for i, n in enumerate([3, 10, 4]):
        s.add(seq(i, n))
    step(s)  # s0 whole, s1 first 3 tokens; s2 waits for the running cap
    assert s.counts() == (1, 1, 1)


@pytest.mark.parametrize("tokens,budget", [(40, 7), (5, 1), (33, 16)])
def test_chunks_cover_the_prompt_exactly_once(tokens: int, budget: int) -> None:
    s = HybridScheduler(BlockManager(blocks_for(tokens + 4, BS), BS, watermark=0.0), 4, budget)
    a = seq(0, tokens, max_tokens=2)
    s.add(a)
    covered = []
    while not a.output_token_ids:
        plan = s.schedule()
        covered += [p for c in plan.prefill for p in range(c.start, c.start + c.length)]
        covered += [x.num_tokens - 1 for x in plan.decode]
        step_done(s, plan)
    assert covered == list(range(tokens))


def step_done(s: HybridScheduler, plan: StepPlan) -> None:
    s.complete(plan)
    for x in plan.sampled:
        x.output_token_ids.append(7)
