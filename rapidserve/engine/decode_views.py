"""What the decode scheduler tells the policies and the router: read-only views of its queues (pure, no torch).

`DecodeScheduler` (engine/decode_scheduler.py) inherits these; nothing here changes a request or a block.
- the step policy (partition/shape.py): `shape_state`, one `ShapeState` per step boundary;
- the partition policies carried out as split shapes (partition/runtime.py): `decode_contexts`,
  `pending_prefill` (duet, drift), `mean_context`, `has_pending`, `pending_work` (rapid);
- the router: `stats`.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from rapidserve.block_manager import BlockManager
from rapidserve.engine import messages as m
from rapidserve.engine.decode_request import DecodeRequest
from rapidserve.partition.policy import PendingWork, WaitingPrefill
from rapidserve.partition.shape import ShapeState, StepShape, queue_head

_PENDING = frozenset(("waiting", "prefilling", "chunking"))  # the states whose prompt is not yet computed
_ORDER = attrgetter("order")


class SchedulerViews:
    blocks: BlockManager
    share_min_tokens: int
    reqs: dict[str, DecodeRequest]
    waiting: deque[DecodeRequest]
    running: list[DecodeRequest]
    chunking: list[DecodeRequest]
    _passed: dict[str, int]
    num_preemptions: int
    num_hand_overs: int

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_prefilling(self) -> int:
        """Requests whose prompt the prefill worker holds."""
        return sum(1 for r in self.reqs.values() if r.state == "prefilling")

    @property
    def busy(self) -> int:
        """Requests holding a seat: running, prefilling or chunking."""
        return len(self.running) + self.num_prefilling + len(self.chunking)

    @property
    def has_pending(self) -> bool:
        """Prompts waiting for blocks or being computed (the partition manager's `pending`)."""
        return bool(self.waiting) or bool(self.chunking) or self.num_prefilling > 0

    # ---- the policies' inputs -----------------------------------------------------------------
    def pending_prefill(self, head: int | None = None) -> tuple[WaitingPrefill, ...]:
        """Prompt work not yet done, in arrival order, for the scheduling policy: each request's tokens
        beyond what is in the cache (a prefilling one's cached prefix, or the chunks computed here before a split
        handed it over: prefill's progress not being known here; a chunking one's tokens computed so far; a
        waiting one's prefix is what its admission would
        find cached now). `head` (tokens): only `queue_head(that list, head)` (partition/shape.py), the entries
        behind it not looked up (a prefix lookup each, every step: milliseconds a step with a thousand queued)."""
        reqs = sorted((r for r in self.reqs.values() if r.state in _PENDING and not r.aborting), key=_ORDER)
        entries = map(self._pending_entry, reqs)  # lazy: `queue_head` makes only the entries it lists
        return tuple(entries) if head is None else queue_head(entries, head)

    def _pending_entry(self, r: DecodeRequest) -> WaitingPrefill:
        prefix = r.computed if r.state in ("prefilling", "chunking") else self._expected_prefix(r)
        return WaitingPrefill(r.req_id, r.request.arrival, max(1, r.num_tokens - prefix), prefix)

    def prefill_worker_tokens(self) -> int:
        """Prompt tokens handed to the prefill worker and not answered yet (what the blocks held then left out)."""
        return sum(max(1, r.num_tokens - r.computed) for r in self.reqs.values()
                   if r.state == "prefilling" and not r.aborting)

    def shape_state(self, current: StepShape, slo_itl_ms: float | None, max_chunk_tokens: int,
                    queue: bool = True, head: bool = False) -> ShapeState:
        """What a step policy is told at this step boundary (partition/shape.py). `waiting` lists every
        prompt not yet computed, those the prefill worker holds included (also in `prefill_worker_tokens`);
        `queue=False` (a policy that reads no queue: `reads_waiting`) leaves it empty, saving a prefix lookup
        per queued prompt each step; `head=True` (a policy that reads only the queue's first `max_chunk_tokens`
        tokens: `reads_queue_head`) lists only that head (`pending_prefill(max_chunk_tokens)`; what it keeps:
        `ShapeState`'s docstring)."""
        waiting = self.pending_prefill(max_chunk_tokens if head else None) if queue else ()
        return ShapeState(self.decode_contexts(), waiting, self.prefill_worker_tokens(), current, slo_itl_ms,
                          max_chunk_tokens)

    def pending_work(self, cap: int) -> PendingWork:
        """Prompt tokens still to compute (a prefilling request's beyond its cached prefix, prefill's progress
        not being known here; a chunking one's beyond its computed tokens; a waiting one's beyond what its
        admission would find cached now), counted only until they pass `cap`: the rapid policy asks only
        whether the pending work is short, and a long queue's prefixes are not all looked up each step. With
        them, the longest pending prompt, prefix included, of every prefilling, chunking and waiting request
        (no lookup needed)."""
        total, longest, counting = 0, 0, True
        for r in self.reqs.values():
            if r.state in ("prefilling", "chunking") and not r.aborting:
                longest = max(longest, r.num_tokens)
                if counting:
                    total += max(1, r.num_tokens - r.computed)
                    counting = total <= cap
        for r in self.waiting:
            longest = max(longest, r.num_tokens)
            if counting:
                total += max(1, r.num_tokens - self._expected_prefix(r))
                counting = total <= cap
        return PendingWork(total, longest)

    def _expected_prefix(self, r: DecodeRequest) -> int:
        """Tokens of a waiting request that its prefill will not compute: what its admission would find
        cached now, and the prefix in flight it waits for (`_waits_for_prefix`)."""
        if not r.reads_cache:
            return 0
        cached, in_flight = self.blocks.lookahead(r.req_id, r.tokens)
        return cached + (in_flight if in_flight >= self.share_min_tokens else 0)

    def _waits_for_prefix(self, r: DecodeRequest) -> bool:
        """Its next `share_min_tokens` or more are being written by a prefilling or chunking request
        (decode_admission.py's docstring). Never one that reads nothing from the cache (`reads_cache`)."""
        if not r.reads_cache:
            return False
        version = self.blocks.pending_version
        if self._passed.get(r.req_id) == version:
            return True
        waits = self.blocks.pending_prefix(r.req_id, r.tokens) >= self.share_min_tokens
        if waits:
            self._passed[r.req_id] = version
        else:
            self._passed.pop(r.req_id, None)
        return waits

    def decode_contexts(self) -> tuple[int, ...]:
        """Each running request's context (tokens in the cache after its next step), for the policy."""
        return tuple(r.tokens_needed for r in self.running)

    def mean_context(self) -> int:
        return sum(r.num_tokens for r in self.running) // len(self.running) if self.running else 0

    def stats(self, partition: str, switches: int, steps: dict[str, int] | None = None,
              token_slots: int = 0, step_kinds: dict[str, m.StepKindStats] | None = None,
              step_correction: dict[str, float] | None = None) -> m.Stats:
        """For the router; `num_prefilling` counts the prompts being computed, by either worker. `step_kinds` and
        `step_correction`: the worker's step counts and its policy's correction (engine/step_tally.py)."""
        b = self.blocks
        return m.Stats(len(self.running), len(self.waiting), self.num_prefilling + len(self.chunking), b.num_blocks,
                       b.num_free, self.num_preemptions, partition, switches, b.queries, b.hits, dict(steps or {}),
                       token_slots, dict(step_kinds or {}), dict(step_correction or {}), self.num_hand_overs)
