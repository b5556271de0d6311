"""The decode scheduler's seeded simulation (`test_decode_scheduler_sim.py`) with fused steps: at each step the
worker may run a fused step (`plan`: decodes, then prompt chunks computed here, of random budgets) or a split one
(decodes only, prompts handed to the fake prefill worker), so requests chunked here and requests handed to
prefill run side by side, share prefixes and are preempted, aborted and failed in every state, steps launched
one ahead. The same checks hold: block ownership (no block written while shared, cached or another's), cached
blocks hold what their hashes name, token order, outputs that depend only on the tokens (so a request chunked
here streams what one computed by prefill would), and everything freed at the end."""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest

from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, Row, StepBatch
from tests.decode_sched_fakes import BS, TOK
from tests.test_decode_scheduler_sim import GARBAGE, SEEDS, Outcome, Sim, Write, kv_of, next_token


class FusedSim(Sim):
    """The split simulation's worker, whose steps are fused half the time. A fused step in flight is `step` (the
    split one's stays `inflight`); a split step is planned once a fused one in flight has landed (the worker's
    switch of configuration synchronizes), a fused step may follow either."""

    def __init__(self, seed: int, cache: bool) -> None:
        super().__init__(seed, cache)
        self.shapes = random.Random(seed + 31)  # the fused steps' own draws
        self.step: tuple[StepBatch, list[Write]] | None = None

    def decode_step(self) -> None:
        if self.shapes.random() < 0.5:
            self.fused_step()
            return
        if self.step is not None:
            self.complete()
        super().decode_step()

    def fused_step(self) -> None:
        s, sh = self.s, self.shapes
        if not (s.running or s.chunking or s.waiting or self.inflight or self.step):
            return
        if sh.random() < 0.02:  # the step fails for no single row
            self.counts["fused fail_batch"] += 1
            self.fail_in_flight()
            return
        chunk, step_tokens = sh.choice([0, 1, 3, BS, 2 * BS, 16]), sh.choice([2, 6, 100])
        before = {r.req_id for r in s.chunking}
        batch = s.plan(chunk, step_tokens, quiet=self.inflight is None and self.step is None)
        if batch is None:  # preemption needs a quiet pool: the step in flight lands first
            self.counts["fused deferred"] += 1
            self.complete()
            batch = s.plan(chunk, step_tokens, quiet=True)
            assert batch is not None
        self.counts["preempted while chunking"] += sum(1 for r in s.waiting if r.req_id in before)
        for c in batch.chunks:
            assert c.start == c.req.computed and c.end <= c.req.num_tokens
            for pos in range(c.start, c.end):
                self.owned(s.blocks.table(c.req.req_id), pos)
        if not batch:
            self.complete()
            return
        if sh.random() < 0.03:  # the launch raised: the chunks' requests fail (what it wrote is garbage)
            self.counts["fused fail"] += 1
            for c in batch.chunks:
                for pos in range(c.start, c.end):
                    self.write(s.blocks.table(c.req.req_id), pos, GARBAGE, "d")
            s.fail([c.req for c in batch.chunks] or batch.decode, "step broke")
            self.complete()
            return
        writes = [(r, r.tokens_needed - 1) for r in batch.decode]
        for r, pos in writes:
            self.owned(s.blocks.table(r.req_id), pos)
        self.counts["fused chunks"] += len(batch.chunks)
        s.launched(batch)
        self.complete()
        self.step = (batch, writes)

    def admit(self) -> None:
        """A split step: the prompts chunked here whose chunks have landed go to prefill too (hand_over), from their
        last full block; prefill_step checks that what they wrote is what it reads."""
        s = self.s
        ready = {r.req_id for r in s.chunking if r.chunks_inflight == 0}
        n, back = len(self.prefill), self.counts["hand-over unadmitted"]
        unadmit = s.unadmit

        def counted(handed: list[m.KVReady]) -> None:  # prefill's inbox was full: back to chunking here
            self.counts["hand-over unadmitted"] += sum(1 for kv in handed if s.reqs[kv.req_id].handed)
            unadmit(handed)
            assert all(s.reqs[kv.req_id].state == "chunking" for kv in handed if kv.req_id in ready)

        s.unadmit = counted  # type: ignore[method-assign]
        try:
            super().admit()
        finally:
            del s.unadmit
        self.counts["chunked, handed over"] += len(ready & {kv.req_id for kv in self.prefill[n:]})
        assert s.num_hand_overs == self.counts["chunked, handed over"]  # those sent, never those un-admitted
        # a prompt ready to go stays here only when prefill's inbox was full for it
        assert len(ready & {r.req_id for r in s.chunking}) == self.counts["hand-over unadmitted"] - back

    def fail_in_flight(self) -> None:
        """Whatever step is in flight wrote garbage and fails with every running request."""
        s, reqs = self.s, []
        if self.inflight is not None:
            reqs += self.inflight[0]
            for r, pos in self.inflight[1]:
                self.write(s.blocks.table(r.req_id), pos, GARBAGE, "d")
        if self.step is not None:
            reqs += self.step[0].decode
            for r, pos in self.step[1]:
                self.write(s.blocks.table(r.req_id), pos, GARBAGE, "d")
            for c in self.step[0].chunks:
                reqs.append(c.req)
                for pos in range(c.start, c.end):
                    self.write(s.blocks.table(c.req.req_id), pos, GARBAGE, "d")
        self.inflight = self.step = None
        s.fail_batch(reqs, "step broke")

    def complete(self) -> None:
        """The step in flight lands. A fused one: its decode rows as in the split simulation, then each chunk
        reads the K/V before it and writes its tokens'; a chunk that ends its prompt samples from its last one."""
        if self.step is None:
            super().complete()
            return
        batch, writes = self.step
        self.step = None
        rows = [self.land_row(r, pos) for r, pos in writes]
        for c in batch.chunks:
            r, t = c.req, self.s.blocks.table(c.req.req_id)
            if r.state == "done":  # ended while the step ran: its input was dropped
                for pos in range(c.start, c.end):
                    self.write(t, pos, GARBAGE, "d")
                rows += [(TOK, -1.0, None, None)] if c.samples else []
                continue
            truth = self.learn(r)
            kv_prev = self.read(t, c.start - 1) if c.start else 0
            assert kv_prev == (truth[c.start - 1] if c.start else 0), f"{r.req_id} read other K/V at {c.start - 1}"
            assert kv_prev is not None
            for pos in range(c.start, c.end):
                kv_prev = kv_of(kv_prev, r.tokens[pos])
                self.write(t, pos, kv_prev, "d")
            if c.samples:
                rows.append((next_token(kv_prev), -1.0, None, None))
                self.counts["local recompute" if r.outputs else "local first token"] += 1
        for out in self.s.record(batch.sampled, rows):
            self.emit(out, "decode")
        self.s.chunks_landed(batch.chunks)
        for r in batch.sampled + [c.req for c in batch.chunks]:
            if self.s.reqs.get(r.req_id) is r:
                self.learn(r)  # its blocks may be registered now

    def land_row(self, r: DecodeRequest, pos: int) -> Row:
        """A decode row lands: it reads the K/V before its position, writes its input token's, samples."""
        t = self.s.blocks.table(r.req_id)
        if pos >= r.num_tokens:  # ended while the step ran: its input was dropped
            assert r.state != "running"
            self.write(t, pos, GARBAGE, "d")
            return (TOK, -1.0, None, None)
        truth = self.learn(r)
        kv_prev = self.read(t, pos - 1)
        assert kv_prev == truth[pos - 1], f"{r.req_id} read other K/V at {pos - 1}"
        kv = kv_of(kv_prev, r.tokens[pos])
        self.write(t, pos, kv, "d")
        return (next_token(kv), -1.0, None, None)

    def check(self) -> None:
        super().check()
        if self.step is not None:  # the fused step in flight writes these blocks: still theirs, and their own
            b = self.s.blocks
            for r, pos in self.step[1]:
                assert b.has(r.req_id)
                self.owned(b.table(r.req_id), pos)
            for c in self.step[0].chunks:
                assert b.has(c.req.req_id)
                for pos in range(c.start, c.end):
                    self.owned(b.table(c.req.req_id), pos)

    def idle(self) -> bool:
        return super().idle() and self.step is None


@functools.cache
def simulate(seed: int, cache: bool) -> Outcome:
    return FusedSim(seed, cache).run(200)


@pytest.mark.parametrize("cache", [False, True], ids=["cache off", "cache on"])
@pytest.mark.parametrize("seed", SEEDS)
def test_fused_simulation_keeps_every_invariant(seed: int, cache: bool) -> None:
    counts = simulate(seed, cache).counts
    assert counts["requests"] > 20
    assert cache or counts["hits"] == counts["queries"] == 0


@pytest.mark.parametrize("cache", [False, True], ids=["cache off", "cache on"])
def test_fused_simulation_reaches_every_path(cache: bool) -> None:
    total: Counter[str] = Counter()
    for seed in SEEDS:
        total += simulate(seed, cache).counts
    paths = ["fused chunks", "local first token", "local recompute", "fused deferred", "preempted while chunking",
             "fused fail", "fused fail_batch", "abort chunking", "abort chunking+", "abort prefilling",
             "abort running+", "preemptions", "ended by a token", "chunked, handed over", "hand-over unadmitted"]
    if cache:
        paths += ["hit, in use", "waited for a prefix in flight"]
    for what in paths:
        assert total[what] > 0, f"no {what!r} in {dict(total)}"
