"""The queue's head as the duet policy is told it (partition/shape.py `queue_head`, `ShapeState`'s docstring;
engine/decode_views.py `pending_prefill(head)`), on CPU, pure.

A policy that reads the queue only up to a step's token budget (`reads_queue_head`: `DuetPolicy`) is told only the
head of it, so a long queue costs the decode worker no prefix lookup per queued prompt each step. What is kept:
the rule (`queue_head`), that only the listed entries are looked up, and that `decide_adaptive` decides exactly as
on the whole queue, over a sweep of states on a measured-style profile and on the Qwen3-8B roofline."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from rapidserve.engine import messages as m
from rapidserve.partition.policies import AdaptiveParams, DuetPolicy, decide_adaptive
from rapidserve.partition.policy import WaitingPrefill
from rapidserve.partition.shape import DecodeAlone, Fused, ShapeState, Split, StepShape, queue_head
from rapidserve.partition.step_costs import StepCosts
from tests.decode_sched_fakes import BS, admit, fuse, make, params
from tests.test_adaptive_policy import COSTS, ROOF

W = [WaitingPrefill(f"w{i}", 0.0, n) for i, n in enumerate((5, 3, 8, 1, 4))]  # sums: 5 8 16 17 21


@pytest.mark.parametrize(("tokens", "listed"), [
    (0, 1),  # the first entry alone passes 0
    (4, 1), (5, 2),  # 5 is not past 5: the next one is listed too
    (7, 2), (8, 3), (15, 3), (16, 4), (17, 5), (20, 5),
    (21, 5), (1000, 5),  # the whole queue is within: all of it
])
def test_the_head_ends_with_the_entry_that_passes_the_tokens(tokens: int, listed: int) -> None:
    head = queue_head(W, tokens)
    assert head == tuple(W[:listed])
    whole = sum(w.tokens for w in W)
    total = sum(w.tokens for w in head)
    assert total == whole if whole <= tokens else total > tokens  # what a policy may rely on
    assert queue_head((), tokens) == ()


def test_the_head_reads_a_lazy_queue_no_further() -> None:
    made: list[int] = []

    def lazy() -> Iterator[WaitingPrefill]:
        for i, w in enumerate(W):
            made.append(i)
            yield w

    assert queue_head(lazy(), 6) == tuple(W[:2]) and made == [0, 1]


def test_pending_prefill_looks_up_only_the_head() -> None:
    """Each waiting request's cached prefix is looked up only while it is in the head; a prefilling and a chunking
    request come first in arrival order as before; the head is the whole list's head."""
    s = make(num_blocks=256, max_seqs=3, caching=True)
    s.add(m.NewRequest("r0", list(range(10, 10 + 3 * BS)), params(), 0.0))
    admit(s)  # r0 prefilling
    s.add(m.NewRequest("r1", list(range(110, 110 + 2 * BS + 1)), params(), 0.0))
    fuse(s, BS)  # r1 chunking, one block of it computed
    assert [s.reqs["r0"].state, s.reqs["r1"].state] == ["prefilling", "chunking"]
    for i in range(2, 12):
        s.add(m.NewRequest(f"r{i}", list(range(100 * i + 10, 100 * i + 10 + 2 * BS)), params(), float(i)))
    whole = s.pending_prefill()
    assert [w.req_id for w in whole] == [f"r{i}" for i in range(12)]
    looked: list[str] = []
    lookahead = s.blocks.lookahead

    def counted(seq_id: str, token_ids: list[int]) -> tuple[int, int]:
        looked.append(seq_id)
        return lookahead(seq_id, token_ids)

    s.blocks.lookahead = counted  # type: ignore[method-assign]
    for head in (0, 3 * BS, 4 * BS, 5 * BS + 1, 9 * BS, 1000):
        looked.clear()
        got = s.pending_prefill(head)
        assert got == queue_head(whole, head)
        assert looked == [w.req_id for w in got if w.req_id not in ("r0", "r1")]  # the waiting ones listed, only
    st = s.shape_state(Fused(4), 50.0, 5 * BS, head=True)
    assert st.waiting == queue_head(whole, 5 * BS) and len(st.waiting) == 3  # 12 + 5 + 8 > 20
    assert s.shape_state(Fused(4), 50.0, 5 * BS).waiting == whole  # a policy that reads it all is told it all


def _states(rng: random.Random) -> Iterator[ShapeState]:
    """Queues around the budget (exactly on it, one token past, far past, a single long prompt) beside decode batches,
    a busy or idle prefill worker, SLOs from none to tight, and the shapes before."""
    currents: list[StepShape] = [DecodeAlone(), Fused(512), Split("split32", 4096), DecodeAlone("split64")]
    for budget, batch, busy, slo in itertools.product((256, 2048, 8192), (0, 1, 64, 256), (0, 3000),
                                                      (None, 15.0, 50.0, 200.0)):
        queues = [(), (budget,), (budget + 1,), (budget - 1, 1), (budget - 1, 2), (4 * budget,)]
        queues += [tuple(rng.randint(1, budget) for _ in range(rng.randint(1, 40))) for _ in range(3)]
        for sizes in queues:
            waiting = tuple(WaitingPrefill(f"q{i}", 0.0, n, rng.choice((0, 0, 64))) for i, n in enumerate(sizes))
            contexts = tuple(rng.randint(200, 8192) for _ in range(batch))
            yield ShapeState(contexts, waiting, busy, rng.choice(currents), slo, budget)


@pytest.mark.parametrize("costs", [COSTS, ROOF], ids=["profile", "roofline"])
def test_duet_decides_on_the_head_as_on_the_whole_queue(costs: StepCosts) -> None:
    assert DuetPolicy.reads_queue_head
    params = AdaptiveParams(graph_buckets=(256, 512, 1024, 2048, 4096, 8192))
    rng = random.Random(3)
    n = 0
    for st in _states(rng):
        head = ShapeState(st.decode_contexts, queue_head(st.waiting, st.max_chunk_tokens), st.prefill_worker_tokens,
                          st.current, st.slo_itl_ms, st.max_chunk_tokens)
        n += len(head.waiting) < len(st.waiting)
        for held in (None, decide_adaptive(st, costs, params=params)[1]):
            assert decide_adaptive(head, costs, held=held, params=params) == \
                decide_adaptive(st, costs, held=held, params=params), st
    assert n > 100  # the head was shorter than the queue in many of them
