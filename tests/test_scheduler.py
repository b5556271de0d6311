"""Block manager and single-process scheduler decisions, on CPU, against a small fake KV pool."""

from __future__ import annotations

import pytest

from rapidserve.block_manager import BlockManager, BlockManagerError, blocks_for
from rapidserve.sampling_params import SamplingParams
from rapidserve.scheduler import Scheduler
from rapidserve.sequence import SeqStatus, Sequence, check_stop

P = SamplingParams(temperature=0.0, max_tokens=100)


def seq(i: int, n: int, params: SamplingParams = P) -> Sequence:
    return Sequence(f"s{i}", list(range(1, n + 1)), params, arrival=i)


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


def run_to_end(s: Scheduler, max_steps: int = 10_000) -> list[str]:
    """Drive the scheduler with a fake model that emits token 7 forever; returns a step log."""
    log = []
    for _ in range(max_steps):
        if not s.has_work:
            return log
        out = s.schedule()
        if out.prefill:
            log.append("P:" + ",".join(f"{c.seq.seq_id}[{c.start}:{c.start + c.length}]" for c in out.prefill))
            for c in out.prefill:
                s.on_prefill_done(c)
                if c.samples:
                    c.seq.output_token_ids.append(7)
        else:
            log.append("D:" + ",".join(x.seq_id for x in out.decode))
            for x in out.decode:
                s.on_decode_done(x)
                x.output_token_ids.append(7)
        for x in out.preempted:
            log.append(f"X:{x.seq_id}")
        for x in list(s.running):
            if len(x.output_token_ids) >= x.params.max_tokens:  # type: ignore[operator]
                s.finish(x, "length")
        s.blocks.check()
    raise AssertionError("scheduler did not finish")


CASES = [
    # name, num_blocks, budget, max_seqs, prompts, max_tokens, expected first steps
    ("one prefill batch then decode", 64, 64, 8, [10, 20], 3,
     ["P:s0[0:10],s1[0:20]", "D:s0,s1", "D:s0,s1"]),
    ("budget splits admission", 64, 25, 8, [10, 20], 2, ["P:s0[0:10],s1[0:15]", "P:s1[15:20]", "D:s0,s1"]),
    ("long prompt chunked", 64, 16, 8, [40], 2, ["P:s0[0:16]", "P:s0[16:32]", "P:s0[32:40]", "D:s0"]),
    ("max_num_seqs caps admission", 64, 100, 1, [4, 4], 2, ["P:s0[0:4]", "D:s0", "P:s1[0:4]", "D:s1"]),
]


@pytest.mark.parametrize("name,num_blocks,budget,max_seqs,prompts,max_tokens,expected", CASES,
                         ids=[c[0] for c in CASES])
def test_schedule_table(name: str, num_blocks: int, budget: int, max_seqs: int, prompts: list[int],
                        max_tokens: int, expected: list[str]) -> None:
    s = Scheduler(BlockManager(num_blocks, 4, watermark=0.0), max_seqs, budget)
    for i, n in enumerate(prompts):
        s.add(seq(i, n, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    log = run_to_end(s)
    assert log[: len(expected)] == expected
    assert s.blocks.num_free == num_blocks


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks() -> None:
    # 4 blocks of 4 tokens: two sequences of 7 tokens fit (2 blocks each) until both need a third.
    s = Scheduler(BlockManager(4, 4, watermark=0.0), 8, 64)
    a, b = seq(0, 7, SamplingParams(max_tokens=6)), seq(1, 7, SamplingParams(max_tokens=6))
    s.add(a)
    s.add(b)
    log = run_to_end(s)
    assert "X:s1" in log  # the later arrival is the victim
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6
    # after preemption s1 recomputes prompt + the outputs it had, in one prefill
    recompute = [x for x in log if x.startswith("P:s1[0:") and x != "P:s1[0:7]"]
    assert recompute and recompute[0].startswith("P:s1[0:")
    assert s.blocks.num_free == 4


def test_preempting_itself_when_alone_does_not_loop() -> None:
    s = Scheduler(BlockManager(3, 4, watermark=0.0), 8, 64)
    a = seq(0, 11, SamplingParams(max_tokens=1))
    s.add(a)
    run_to_end(s)
    assert a.output_token_ids == [7] and s.blocks.num_free == 3


def test_watermark_never_starves_a_lone_sequence() -> None:
    s = Scheduler(BlockManager(4, 4, watermark=0.5), 8, 64)
    a = seq(0, 15, SamplingParams(max_tokens=1))
    s.add(a)
    out = s.schedule()
    assert [c.seq for c in out.prefill] == [a]


def test_finish_frees_blocks_from_waiting_and_running() -> None:
    s = Scheduler(BlockManager(8, 4, watermark=0.0), 8, 4)
    a = seq(0, 10)
    s.add(a)
    s.schedule()  # first chunk allocated the whole prompt's blocks
    assert s.blocks.num_free == 5
    s.finish(a, "abort")
    assert s.blocks.num_free == 8 and not s.has_work and a.status is SeqStatus.FINISHED


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
