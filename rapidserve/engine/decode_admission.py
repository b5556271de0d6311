"""The decode scheduler's admission: which waiting request gets blocks, and which prompts go to the prefill worker
(pure, no torch, no I/O).

`DecodeScheduler` (engine/decode_scheduler.py, whose docstring gives the request states and block ownership) inherits
these: `admit` (a split step's prompts to prefill), `hand_over` (prompts chunked here, handed to prefill by a split
step), `unadmit` (KVReadys prefill's inbox had no room for) and `_admit_head`, the admission both kinds share (a fused
step's local admission, `DecodeScheduler.plan`, goes through it too).

Policy:
- Admission (both kinds): while fewer than `max_seqs` requests are prefilling, chunking or running, the
  head of the queue gets blocks for all its tokens under the admission rule every scheduler shares
  (`BlockManager.can_admit`: keep the watermark free, unless nothing else holds blocks). The
  longest cached prefix of its full blocks is shared (`allocate_cached`): the KVReady tells
  prefill how many tokens are cached, and a chunked prompt starts after them (a request whose params say
  skip_reading_prefix_cache shares none: `DecodeRequest.reads_cache`; nor does it wait for a prefix in flight).
- Waiting for a prefix in flight: a waiting request whose next `share_min_tokens` or more tokens past
  its cached prefix are blocks a prefilling or chunking request is writing now (`BlockManager.pending_prefix`:
  a shared system prompt or conversation that the other request brought first) is passed over, keeping
  its place in the queue, until that write lands (PrefillDone, or the chunk recorded); then it shares those
  blocks and only the rest is computed. Prefill's queue is in arrival order (`prefill_worker.enqueue`), so
  it would have waited behind the other request anyway, and it keeps that place when admitted later;
  passing it over costs at most the hand-off, and saves computing the shared tokens twice (and their
  blocks). The requests behind it are admitted meanwhile.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet

from rapidserve.engine import messages as m
from rapidserve.engine.decode_request import DecodeRequest
from rapidserve.engine.decode_views import SchedulerViews


class SchedulerAdmission(SchedulerViews):
    """Admission, inherited by `DecodeScheduler`: it moves requests out of `waiting` and gives them blocks."""

    max_seqs: int

    def admit(self, now: float = 0.0) -> list[m.KVReady]:
        """A split step's prompts to prefill: first the prompts being chunked here (`hand_over`), then blocks for
        waiting requests, in order, while the seats and the pool allow; each KVReady carries the request (and,
        after a preemption, the outputs to recompute) to prefill, stamped `now` (the worker's clock: where the
        request's time to first token went, `PhaseTimes`)."""
        out = self.hand_over()
        passed: list[DecodeRequest] = []  # waiting for a prefix in flight: they keep their places
        busy = self.busy
        while (r := self._admit_head(frozenset(), passed, busy, now)) is not None:
            r.state, r.computed, busy = "prefilling", r.cached, busy + 1
            out.append(m.KVReady(r.request, self.blocks.table(r.req_id), list(r.outputs), r.attempt, r.cached, now))
        self.waiting.extendleft(reversed(passed))
        return out

    def hand_over(self) -> list[m.KVReady]:
        """The prompts being chunked here whose chunks have all landed, to prefill (a split step: only fused
        steps compute a chunk here, so a prompt left chunking through split steps would wait until decode has
        nothing to run, which on the H200 held 23K-token prompts for 20-110 s). Prefill computes from the
        last full block its chunks wrote (`KVReady.computed_tokens`; the tokens of a part-written block are
        computed again, into the same slots: that block is no one else's until it is full) and samples the first
        token; the KVReady keeps the request's admission time, when its first chunk started (the TTFT's split into
        queue and prefill: `PhaseTimes`) and its prefix-cache hits. Each is counted in `num_hand_overs` (Stats;
        /metrics' ``rapidserve:prompts_handed_over_total``)."""
        out: list[m.KVReady] = []
        bs = self.blocks.block_size
        for r in [r for r in self.chunking if r.chunks_inflight == 0]:
            self.chunking.remove(r)
            r.state, r.computed, r.handed = "prefilling", max(r.cached, r.computed // bs * bs), True
            out.append(m.KVReady(r.request, self.blocks.table(r.req_id), list(r.outputs), r.attempt, r.cached,
                                 r.admitted, r.computed, r.started))
        self.num_hand_overs += len(out)
        return out

    def _admit_head(self, hold: AbstractSet[str], passed: list[DecodeRequest], busy: int,
                    now: float) -> DecodeRequest | None:
        """The next waiting request, in order, given the blocks of all its tokens now (out of `waiting`,
        its state for the caller to set), or None: the seats or the pool are full. Requests in `hold` or
        waiting for a prefix in flight are moved to `passed` (the caller puts them back, in order)."""
        while self.waiting and busy < self.max_seqs:
            r = self.waiting[0]
            if r.req_id in hold or self._waits_for_prefix(r):
                passed.append(self.waiting.popleft())
                continue
            alone = busy == 0 and self.blocks.num_free == self.blocks.num_blocks  # nothing else holds blocks
            if not self.blocks.can_admit(r.num_tokens, alone, r.req_id, r.tokens if r.reads_cache else None):
                return None
            _, r.cached = self.blocks.allocate_cached(r.req_id, r.tokens, r.reads_cache)
            r.admitted = now
            self.waiting.popleft()
            return r
        return None

    def unadmit(self, handed: list[m.KVReady]) -> None:
        """These KVReadys were not sent (prefill's inbox was full): their requests wait again, in order (one
        `hand_over` handed goes on chunking here, keeping its blocks, and is no longer counted in `num_hand_overs`)."""
        for kv in reversed(handed):
            r = self.reqs[kv.request.req_id]
            if r.handed:
                r.state, r.handed = "chunking", False
                self.num_hand_overs -= 1
                _insert_before_later(self.chunking, r)
                continue
            self.blocks.free(r.req_id)
            self.blocks.unlookup(r.num_tokens, kv.cached_tokens, r.reads_cache)
            r.state = "waiting"
            _insert_before_later(self.waiting, r)


def _insert_before_later(queue: list[DecodeRequest] | deque[DecodeRequest], r: DecodeRequest) -> None:
    """`r` into `queue` before its first later arrival (by `order`): ahead of the later arrivals only, so a request
    passed over at the head keeps its place."""
    i = 0
    while i < len(queue) and queue[i].order < r.order:
        i += 1
    queue.insert(i, r)
