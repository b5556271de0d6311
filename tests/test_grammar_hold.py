"""Requests whose grammar is still compiling sit out the steps that need their mask (CPU, no model):
table tests of the pure decisions that take the set of held ids (`GrammarBook.compiling()`): the decode
scheduler's batch, its local admission in fused steps (hybrid mode), and the prefill worker's batch."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from rapidserve.block_manager import blocks_for
from rapidserve.engine import messages as m
from rapidserve.engine.prefill_worker import Job, PrefillWorker
from rapidserve.sampling_params import SamplingParams
from tests.decode_sched_fakes import BS, check, ids, land, make, new, start


def held(text: str) -> frozenset[str]:
    return frozenset(x for x in text.split(",") if x)


# ---- the decode scheduler: held running requests sit out, keep their seat and blocks ------------------------------
DECODE = [
    # name, num_blocks, prompt lengths (each runs with its first token), hold, quiet, batch (None: wait), preempted
    ("nothing held: every running request", 16, [4, 4, 4], "", True, "r0,r1,r2", ""),
    ("a held request sits out, the rest step", 16, [4, 4, 4], "r1", True, "r0,r2", ""),
    ("all held: an empty batch", 16, [4, 4], "r0,r1", True, "", ""),
    ("ids not running change nothing", 16, [4, 4], "r7", True, "r0,r1", ""),
    ("unheld, the latest admitted preempts itself when the pool is short", 3, [4, 4], "", True, "r0", "r1"),
    ("held, it is not grown, so it preempts nobody", 3, [4, 4], "r1", True, "r0", ""),
    ("held, it is still the victim when another must grow", 2, [4, 4], "r1", True, "r0", "r1"),
    ("a step in flight: wait (None), held or not", 2, [4, 4], "r1", False, None, ""),
]


@pytest.mark.parametrize("name,num_blocks,prompts,hold,quiet,batch,preempted", DECODE, ids=[c[0] for c in DECODE])
def test_decode_batch_leaves_held_requests_out(name: str, num_blocks: int, prompts: list[int], hold: str,
                                               quiet: bool, batch: str | None, preempted: str) -> None:
    s = make(num_blocks=num_blocks)
    start(s, *[new(i, n) for i, n in enumerate(prompts)])
    before = {r.req_id: len(s.blocks.table(r.req_id)) for r in s.running}
    got = s.schedule(quiet, held(hold))
    check(s)
    assert (None if got is None else ",".join(ids(got))) == batch
    assert ",".join(ids(s.waiting)) == preempted
    for r in s.running:  # held ones keep their table as it was; the batch's cover their next token
        want = before[r.req_id] if r.req_id in held(hold) or got is None else blocks_for(r.tokens_needed, BS)
        assert len(s.blocks.table(r.req_id)) == want, r.req_id


def test_decode_a_held_request_joins_once_ready() -> None:
    s = make(num_blocks=16)
    start(s, new(0), new(1))
    b = s.schedule(True, held("r1"))
    assert b is not None and ids(b) == ["r0"]
    s.launched(b)
    land(s, b)
    b = s.schedule(True)  # r1's grammar is ready
    assert b is not None and ids(b) == ["r0", "r1"] and [len(r.outputs) for r in b] == [2, 1]
    check(s)


# ---- fused steps (hybrid mode): held waiting requests are passed over at local admission, keeping their place -----
FUSED = [
    # name, num_blocks, max seqs, budget, prompt lengths, hold, admitted (prompt chunks), still waiting (in order)
    ("nothing held: FCFS", 16, 8, 64, [4, 4, 4], "", "r0[0:4],r1[0:4],r2[0:4]", ""),
    ("a held head is passed over, keeping its place", 16, 8, 64, [4, 4, 4], "r0", "r1[0:4],r2[0:4]", "r0"),
    ("held in the middle", 16, 8, 64, [4, 4, 4], "r1", "r0[0:4],r2[0:4]", "r1"),
    ("all held: nothing to do", 16, 8, 64, [4, 4], "r0,r1", "", "r0,r1"),
    ("held ones take no seat", 16, 1, 64, [4, 4], "r0", "r1[0:4]", "r0"),
    ("held ones take no budget: the next gets the chunk", 16, 8, 6, [8, 8], "r0", "r1[0:6]", "r0"),
    ("among the ready, a head that does not fit still blocks the rest", 4, 8, 64, [4, 20, 4], "r0",
     "", "r0,r1,r2"),
    ("ids not waiting change nothing", 16, 8, 64, [4], "r9", "r0[0:4]", ""),
]


@pytest.mark.parametrize("name,num_blocks,max_seqs,budget,prompts,hold,admitted,waiting", FUSED,
                         ids=[c[0] for c in FUSED])
def test_fused_admission_passes_over_held_requests(name: str, num_blocks: int, max_seqs: int, budget: int,
                                                   prompts: list[int], hold: str, admitted: str,
                                                   waiting: str) -> None:
    s = make(num_blocks=num_blocks, max_seqs=min(max_seqs, budget), watermark=0.01)
    for i, n in enumerate(prompts):
        s.add(new(i, n))
    b = s.plan(budget, budget, quiet=True, hold=held(hold))
    assert b is not None
    check(s)
    assert ",".join(f"{c.req.req_id}[{c.start}:{c.end}]" for c in b.chunks) == admitted
    assert ",".join(ids(s.waiting)) == waiting
    assert not b.decode and s.num_preemptions == 0
    for r in s.waiting:
        assert not s.blocks.has(r.req_id)


def test_fused_a_held_request_is_admitted_once_ready() -> None:
    s = make(num_blocks=16)
    s.add(new(0, 4))
    s.add(new(1, 4))
    b = s.plan(64, 64, quiet=True, hold=held("r0"))
    assert b is not None and [c.req.req_id for c in b.chunks] == ["r1"]
    s.launched(b)
    s.record(b.sampled, [(7, None, None, None)])
    b = s.plan(64, 64, quiet=True)  # r0's grammar is ready
    assert b is not None and ids(b.decode) == ["r1"] and [c.req.req_id for c in b.chunks] == ["r0"]
    s.launched(b)
    assert ids(s.running) == ["r1", "r0"]


# ---- the prefill worker's batch: held jobs are passed over, keeping their place ------------------------------------
PREFILL = [
    # name, budget, jobs (id, tokens, done), hold, batch (id:tokens)
    ("nothing held: FCFS whole prompts up to the budget", 16, [("a", 6, 0), ("b", 6, 0), ("c", 6, 0)], "",
     "a:6,b:6"),
    ("a held head is passed over", 16, [("a", 6, 0), ("b", 6, 0), ("c", 6, 0)], "a", "b:6,c:6"),
    ("all held: nothing", 16, [("a", 6, 0), ("b", 6, 0)], "a,b", ""),
    ("behind a held head, an over-budget prompt goes in a chunk", 16, [("a", 6, 0), ("b", 40, 0)], "a", "b:16"),
    ("a held job takes no budget", 12, [("a", 6, 0), ("b", 6, 0), ("c", 6, 0)], "b", "a:6,c:6"),
    ("a cached prefix counts as done", 16, [("a", 20, 8), ("b", 6, 0)], "b", "a:12"),
    ("ids not waiting change nothing", 16, [("a", 6, 0)], "z", "a:6"),
]


@pytest.mark.parametrize("name,budget,jobs,hold,batch", PREFILL, ids=[c[0] for c in PREFILL])
def test_prefill_batch_passes_over_held_jobs(name: str, budget: int, jobs: list[tuple[str, int, int]], hold: str,
                                             batch: str) -> None:
    waiting = deque(Job(m.NewRequest(rid, list(range(n)), SamplingParams(), 0.0), list(range(n)), [], 0,
                        done_tokens=done) for rid, n, done in jobs)
    worker = SimpleNamespace(waiting_prefill=waiting, budget=budget, batch_target=budget)
    got = PrefillWorker.take_batch(worker, held(hold))  # type: ignore[arg-type]
    assert ",".join(f"{j.req.req_id}:{n}" for j, n in got) == batch
    assert [j.req.req_id for j in waiting] == [j[0] for j in jobs]  # taking a batch moves nothing
