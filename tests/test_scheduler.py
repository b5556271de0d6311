"""Block manager basics, the stop check, and the steps `LLM`'s in-process engine takes (rapidserve/core.py: the
`DecodeScheduler` under `AlwaysFused` shapes; ported from the tests of the prefill-first `Scheduler` it replaced:
chunking, the step's token budget, the seats, preemption by recompute, the watermark, an abort), on CPU against a
small BlockManager, checking the scheduler's invariants after every call (tests/decode_sched_fakes.py)."""

from __future__ import annotations

import pytest

from rapidserve.block_manager import BlockManager, BlockManagerError, blocks_for
from rapidserve.engine.decode_scheduler import DecodeScheduler
from rapidserve.partition.shape import Fused
from rapidserve.partition.step_policies import AlwaysFused
from rapidserve.sampling_params import SamplingParams
from rapidserve.stop_rules import check_stop
from tests.decode_sched_fakes import TOK, all_free, fin, fuse, land_fused, make, new, params
from tests.decode_sched_fakes import shape as shape_of


@pytest.mark.parametrize("tokens,bs,want", [(1, 16, 1), (16, 16, 1), (17, 16, 2), (0, 16, 0), (33, 8, 5)])
def test_blocks_for(tokens: int, bs: int, want: int) -> None:
    assert blocks_for(tokens, bs) == want


def test_block_manager_allocate_grow_free() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, watermark=0.0)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.grow("a", 8) == []
    assert bm.grow("a", 9) == [2]
    bm.allocate("b", 4)
    assert bm.num_free == 4
    with pytest.raises(BlockManagerError):
        bm.allocate("a", 1)  # already holds blocks
    with pytest.raises(BlockManagerError):
        bm.allocate("c", 100)
    assert bm.free("a") == 3 and bm.free("a") == 0
    bm.check()
    assert bm.num_free == 7


@pytest.mark.parametrize(
    "num_blocks,watermark,free_after,tokens,ok",
    [(100, 0.0, 100, 1600, True), (100, 0.0, 100, 1601, False), (100, 0.05, 100, 1520, True),
     (100, 0.05, 100, 1521, False)],
)
def test_watermark(num_blocks: int, watermark: float, free_after: int, tokens: int, ok: bool) -> None:
    bm = BlockManager(num_blocks, 16, watermark)
    assert bm.can_allocate(tokens) is ok


def run_to_end(s: DecodeScheduler, budget: int, max_steps: int = 1000) -> list[str]:
    """Drive the scheduler as `LLM`'s engine does (rapidserve/core.py: `AlwaysFused` shapes, each step landed
    before the next is planned) with a fake model that emits an ordinary token forever; returns a step log: the
    step's decodes ("D:") and prompt chunks ("P:"), then "X:" for each request it preempted."""
    policy, shape, log = AlwaysFused(), Fused(0), []
    for _ in range(max_steps):
        if not s.reqs:
            return log
        shape = policy.decide(s.shape_state(shape, None, budget, queue=False))
        assert isinstance(shape, Fused)
        attempts = {rid: r.attempt for rid, r in s.reqs.items()}
        batch = fuse(s, shape.chunk_tokens, budget)
        decode, chunks = shape_of(batch)
        step = [f"D:{','.join(decode)}"] if decode else []
        step += [f"P:{','.join(f'{rid}[{a}:{a + n}]' for rid, a, n, _ in chunks)}"] if chunks else []
        log.append(" ".join(step))
        log += [f"X:{rid}" for rid, r in s.reqs.items() if r.attempt > attempts.get(rid, 0)]
        land_fused(s, batch)
        assert not [f for f in fin(s) if not f.endswith(":length")]  # only ends by max_tokens
    raise AssertionError("scheduler did not finish")


CASES = [
    # name, num_blocks, budget, max_seqs, prompts, max_tokens, expected first steps
    ("one prefill batch then decode", 64, 64, 8, [10, 20], 3,
     ["P:r0[0:10],r1[0:20]", "D:r0,r1", "D:r0,r1"]),
    ("budget splits admission; decodes share the step", 64, 25, 8, [10, 20], 2,
     ["P:r0[0:10],r1[0:15]", "D:r0 P:r1[15:20]", "D:r1"]),
    ("long prompt chunked", 64, 16, 8, [40], 2, ["P:r0[0:16]", "P:r0[16:32]", "P:r0[32:40]", "D:r0"]),
    ("max_num_seqs caps admission", 64, 100, 1, [4, 4], 2, ["P:r0[0:4]", "D:r0", "P:r1[0:4]", "D:r1"]),
]


@pytest.mark.parametrize("name,num_blocks,budget,max_seqs,prompts,max_tokens,expected", CASES,
                         ids=[c[0] for c in CASES])
def test_schedule_table(name: str, num_blocks: int, budget: int, max_seqs: int, prompts: list[int],
                        max_tokens: int, expected: list[str]) -> None:
    s = make(num_blocks=num_blocks, max_seqs=max_seqs)
    for i, n in enumerate(prompts):
        s.add(new(i, n, params(max_tokens)))
    log = run_to_end(s, budget)
    assert log[: len(expected)] == expected
    assert all_free(s)


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks() -> None:
    # 4 blocks of 4 tokens: two requests of 7 tokens fit (2 blocks each) until both need a third.
    s = make(num_blocks=4, cap=64)
    s.add(new(0, 7, params(6)))
    s.add(new(1, 7, params(6)))
    a, b = s.reqs["r0"], s.reqs["r1"]
    log = run_to_end(s, 64)
    assert "X:r1" in log and "X:r0" not in log  # the later arrival is the victim
    assert b.attempt >= 1 and a.attempt == 0
    assert len(a.outputs) == 6 and len(b.outputs) == 6
    # after preemption r1 recomputes its prompt and the outputs it had, from position 0, in one chunk
    recompute = [x for x in log[log.index("X:r1"):] if x.startswith("P:r1[0:")]
    assert recompute and recompute[0] != "P:r1[0:7]"
    assert all_free(s)


def test_a_request_alone_ends_at_the_pool_capacity_without_preempting_itself() -> None:
    # 3 blocks of 4: the context cap is the pool's 12 tokens, so an 11-token prompt ends at its first token
    s = make(num_blocks=3)
    s.add(new(0, 11, params(5)))
    r = s.reqs["r0"]
    assert run_to_end(s, 64) == ["P:r0[0:11]"]
    assert r.outputs == [TOK] and s.num_preemptions == 0 and all_free(s)


def test_watermark_never_starves_a_lone_request() -> None:
    s = make(num_blocks=4, watermark=0.5)
    s.add(new(0, 15, params(1)))
    assert shape_of(fuse(s, 64, 64)) == ([], [("r0", 0, 15, True)])


def test_abort_frees_a_chunked_prompts_blocks_once_its_step_has_landed() -> None:
    s = make(num_blocks=8)
    s.add(new(0, 10))
    b = fuse(s, 4, 4)  # the first chunk; blocks for the whole prompt
    assert s.blocks.num_free == 5
    s.abort("r0")
    assert s.blocks.num_free == 5 and fin(s) == ["r0:abort"]  # the step in flight still writes them
    land_fused(s, b)
    assert all_free(s)


@pytest.mark.parametrize(
    "params,outputs,eos,max_len,want",
    [
        (SamplingParams(max_tokens=5), [3], (2,), 100, None),
        (SamplingParams(max_tokens=5), [2], (2,), 100, "stop"),
        (SamplingParams(max_tokens=5, ignore_eos=True), [2], (2,), 100, None),
        (SamplingParams(max_tokens=5, stop_token_ids=(9,)), [9], (2,), 100, "stop"),
        (SamplingParams(max_tokens=2), [3, 4], (2,), 100, "length"),
        (SamplingParams(max_tokens=50), [3, 4], (2,), 6, "length"),
        (SamplingParams(max_tokens=5, min_tokens=2), [2], (2,), 100, None),
    ],
)
def test_check_stop(params: SamplingParams, outputs: list[int], eos: tuple[int, ...], max_len: int,
                    want: str | None) -> None:
    assert check_stop(params, list(outputs), 4 + len(outputs), eos, max_len) == want
