"""The decode worker's decisions: pure Python, no torch, no I/O; tested on CPU against a BlockManager.

The decode worker (`engine/decode_worker.py`) owns the block tables and asks this scheduler what to
do; it only moves messages and runs the device. Messages in (`add`, `abort`, `prefill_done`,
`prefill_failed`, `dropped`) change request states; `admit` hands waiting requests to prefill;
`schedule` gives the next decode batch; `record` takes a landed step's tokens. What the router must
hear (`Finished`) collects in `finished`, which the worker publishes.

Request states: waiting (holds no blocks: new, or preempted) -> prefilling (blocks allocated and
handed to prefill in a KVReady, which carries the request; prefill writes them) -> running (in the
decode batch) -> done. Requests are admitted in arrival order; a preempted one goes back to the
head of the queue.

Policy:
- Admission: while fewer than `max_seqs` requests are prefilling or running, the head of the queue
  gets blocks for all its tokens under the admission rule every scheduler shares
  (`BlockManager.can_admit`: keep the watermark free, unless nothing else holds blocks). The
  longest cached prefix of its full blocks is shared (`allocate_cached`) and the KVReady tells
  prefill how many tokens are cached, so prefill computes only the rest. A request's full blocks
  are registered in the cache once their K/V are written: the prompt's when PrefillDone comes
  (prefill's writes landed before it answered), decode's as its steps land.
- Waiting for a prefix in flight: a waiting request whose next `share_min_tokens` or more tokens past
  its cached prefix are blocks a prefilling request is writing now (`BlockManager.pending_prefix`: a
  shared system prompt or conversation that the other request brought first) is passed over, keeping
  its place in the queue, until that prefill answers; then it shares those blocks and prefill computes
  only the rest. Prefill's queue is in arrival order (`prefill_worker.enqueue`), so it would have
  waited behind the other request anyway, and it keeps that place when admitted later; passing it over
  costs at most the hand-off, and saves computing the shared tokens twice (and their blocks). The
  requests behind it are admitted meanwhile.
- Growth: before each step every running request's table grows to cover its tokens, counting the
  token of the step still in flight. When the pool is short, the most recently admitted running
  request is preempted by recompute (its blocks are freed; it goes back to waiting with its outputs,
  which prefill recomputes with the prompt, so no token is lost or repeated). Preemption frees
  blocks, so it needs a quiet pool: with a step in flight `schedule` returns None and the worker
  lets that step land first.
- Stops: after each token, `check_stop` (the one stop check) against the context cap, which is the
  model's window or the pool's capacity where that is smaller, so a request alone always fits.

Block ownership (docs/architecture.md): a request's blocks are freed only when nothing can still write into them:
- while prefilling, prefill writes them: an abort asks prefill to drop the request (`abort` returns
  True: the worker sends Drop) and frees on Dropped, PrefillDone or PrefillFailed, whichever comes;
  the request's id stays held until the Dropped comes (prefill answers every Drop), so a request
  that reuses the id is refused meanwhile and a late Dropped never frees a newer request's blocks;
- while a decode step that includes the request is in flight (`inflight` > 0), that step writes its
  newest K/V: a request finished or aborted meanwhile is freed when that step is recorded, and the
  step's token for it is dropped, so no token is emitted after the end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from rapidserve.block_manager import BlockManager
from rapidserve.engine import messages as m
from rapidserve.partition.policy import PendingWork, WaitingPrefill
from rapidserve.sampling_params import SamplingParams
from rapidserve.sequence import check_stop

State = Literal["waiting", "prefilling", "running", "done"]
Row = tuple[int, float | None, list[tuple[int, float]] | None]  # a sampled token, its logprob, top logprobs


@dataclass(eq=False)
class DecodeRequest:
    request: m.NewRequest
    order: int  # arrival order: preemption takes the latest admitted first
    outputs: list[int] = field(default_factory=list)
    state: State = "waiting"
    attempt: int = 0  # preemptions so far: a PrefillDone of an earlier attempt is stale
    inflight: int = 0  # launched decode steps whose token is not recorded yet (0 or 1)
    aborting: bool = False  # aborted while prefilling: waits for prefill to let go
    drop_pending: bool = False  # a Drop was sent and its Dropped has not come back: the id stays held
    cached: int = 0  # tokens found in the prefix cache at the last admission

    @property
    def req_id(self) -> str:
        return self.request.req_id

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.outputs)

    @property
    def tokens(self) -> list[int]:
        """Prompt and outputs: what prefill computes after a preemption, and what the cache hashes."""
        return self.request.prompt_token_ids + self.outputs

    @property
    def tokens_needed(self) -> int:
        """Tokens the block table must cover for the next step (the in-flight step's token included)."""
        return self.num_tokens + self.inflight


SHARE_MIN_TOKENS = 512  # a prefix in flight this long is worth waiting for (Mooncake's hash blocks are 512 tokens)


class DecodeScheduler:
    def __init__(self, blocks: BlockManager, max_seqs: int, eos: tuple[int, ...], context_cap: int,
                 share_min_tokens: int = SHARE_MIN_TOKENS) -> None:
        if max_seqs <= 0:
            raise ValueError(f"max_seqs={max_seqs} must be positive")
        if share_min_tokens <= 0:
            raise ValueError(f"share_min_tokens={share_min_tokens} must be positive")
        self.blocks, self.max_seqs, self.eos, self.context_cap = blocks, max_seqs, eos, context_cap
        self.share_min_tokens = share_min_tokens
        # waiting requests found waiting for a prefix in flight, with the BlockManager.pending_version then:
        # until that changes (a pending block written or given up) they still wait, so admit skips the lookup
        self._passed: dict[str, int] = {}
        self.reqs: dict[str, DecodeRequest] = {}  # every request that holds or may hold blocks
        self.waiting: deque[DecodeRequest] = deque()
        self.running: list[DecodeRequest] = []
        self.finished: list[m.Finished] = []  # for the router; the worker publishes and clears it
        self.num_preemptions = 0
        self._arrivals = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_prefilling(self) -> int:
        return sum(1 for r in self.reqs.values() if r.state == "prefilling")

    @property
    def has_pending(self) -> bool:
        """Prompts waiting for blocks or in prefill (the partition manager's `pending`)."""
        return bool(self.waiting) or self.num_prefilling > 0

    def pending_prefill(self) -> tuple[WaitingPrefill, ...]:
        """Prefill work not yet done, in arrival order, for the scheduling policy: each request's tokens
        beyond its cached prefix (prefill's progress on a prefilling one is not known here, so all of
        them; a waiting one's prefix is what its admission would find cached now)."""
        reqs = sorted((r for r in self.reqs.values() if r.state in ("waiting", "prefilling") and not r.aborting),
                      key=lambda r: r.order)
        out = []
        for r in reqs:
            prefix = r.cached if r.state == "prefilling" else self._expected_prefix(r)
            out.append(WaitingPrefill(r.req_id, r.request.arrival, max(1, len(r.tokens) - prefix), prefix))
        return tuple(out)

    def pending_work(self, cap: int) -> PendingWork:
        """Prompt tokens prefill still has to compute (a prefilling request's beyond its cached prefix,
        prefill's progress not being known here; a waiting one's beyond what its admission would find
        cached now), counted only until they pass `cap`: the rapid policy asks only whether the pending
        work is short, and a long queue's prefixes are not all looked up each step. With them, the longest
        pending prompt, prefix included, of every prefilling and waiting request (no lookup needed)."""
        total, longest, counting = 0, 0, True
        for r in self.reqs.values():
            if r.state == "prefilling" and not r.aborting:
                longest = max(longest, r.num_tokens)
                if counting:
                    total += max(1, r.num_tokens - r.cached)
                    counting = total <= cap
        for r in self.waiting:
            longest = max(longest, r.num_tokens)
            if counting:
                total += max(1, r.num_tokens - self._expected_prefix(r))
                counting = total <= cap
        return PendingWork(total, longest)

    def _expected_prefix(self, r: DecodeRequest) -> int:
        """Tokens of a waiting request that prefill will not compute: what its admission would find
        cached now, and the prefix in flight it waits for (`_waits_for_prefix`)."""
        cached, in_flight = self.blocks.lookahead(r.req_id, r.tokens)
        return cached + (in_flight if in_flight >= self.share_min_tokens else 0)

    def _waits_for_prefix(self, r: DecodeRequest) -> bool:
        """Its next `share_min_tokens` or more are being written by a prefilling request (module doc)."""
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
              token_slots: int = 0) -> m.Stats:
        b = self.blocks
        return m.Stats(len(self.running), len(self.waiting), self.num_prefilling, b.num_blocks, b.num_free,
                       self.num_preemptions, partition, switches, b.queries, b.hits, dict(steps or {}), token_slots)

    # ---- messages in --------------------------------------------------------------------------
    def add(self, req: m.NewRequest) -> bool:
        """A new request joins the queue (False: refused, its id still in use). The router checked the
        prompt (`rapidserve/prompt.py`)."""
        if req.req_id in self.reqs:  # an earlier request of this id is still finishing
            self.finished.append(m.Finished(req.req_id, "error", f"request id {req.req_id!r} is still in "
                                            "flight (an earlier request of that id is finishing): use unique ids"))
            return False
        self._arrivals += 1
        r = DecodeRequest(req, self._arrivals)
        self.reqs[r.req_id] = r
        self.waiting.append(r)
        return True

    def abort(self, req_id: str) -> bool:
        """End the request; True when prefill holds it and must be told to drop it (send Drop)."""
        r = self.reqs.get(req_id)
        if r is None or r.state == "done":
            return False
        if r.state == "prefilling":
            if r.aborting:
                return False  # prefill was told already
            r.aborting = r.drop_pending = True  # freed when prefill answers Dropped, PrefillDone or PrefillFailed
            self.blocks.unpend(r.req_id)  # requests waiting for its prefix stop waiting
            return True
        if r.state == "waiting":
            self.waiting.remove(r)
        self._finish(r, "abort")
        return False

    def prefill_done(self, msg: m.PrefillDone) -> m.TokenOut | None:
        """The prompt is in the cache: the request runs, and its first token is returned to stream
        (None when it ended: aborted meanwhile, or the token ends it and prefill told the router)."""
        r = self._prefilling(msg.req_id, msg.attempt)
        if r is None:
            return None
        self.blocks.commit(r.req_id, r.tokens, r.num_tokens)  # prefill's writes landed before it answered
        if r.aborting:  # aborted meanwhile: what it wrote stays cached for others
            self._finish(r, "abort")
            return None
        r.outputs.append(msg.token.token_id)
        if msg.token.finish_reason is not None:
            self._finish(r, msg.token.finish_reason, notify=False)
            return None
        r.state = "running"
        self.running.append(r)
        return msg.token

    def prefill_failed(self, msg: m.PrefillFailed) -> None:
        r = self._prefilling(msg.req_id, msg.attempt)
        if r is not None:
            self._finish(r, "abort" if r.aborting else "error", message=msg.message, fault=msg.fault)

    def dropped(self, req_id: str) -> None:
        """Prefill let go of the request (it answers every Drop, even after PrefillDone/PrefillFailed):
        only now may its id be used again, so a late Dropped never touches a newer request's blocks."""
        r = self.reqs.get(req_id)
        if r is None or not r.drop_pending:
            return
        r.drop_pending = False
        if r.state == "prefilling":
            self._finish(r, "abort")
        else:
            self._release(r)

    def _prefilling(self, req_id: str, attempt: int) -> DecodeRequest | None:
        r = self.reqs.get(req_id)
        return r if r is not None and r.state == "prefilling" and r.attempt == attempt else None

    # ---- admission ----------------------------------------------------------------------------
    def admit(self, now: float = 0.0) -> list[m.KVReady]:
        """Blocks for waiting requests, in order, while the seats and the pool allow; each KVReady
        carries the request (and, after a preemption, the outputs to recompute) to prefill, stamped
        `now` (the worker's clock: where the request's time to first token went, `PhaseTimes`)."""
        out: list[m.KVReady] = []
        passed: list[DecodeRequest] = []  # waiting for a prefix in flight: they keep their places
        busy = len(self.running) + self.num_prefilling
        while self.waiting and busy < self.max_seqs:
            r = self.waiting[0]
            if self._waits_for_prefix(r):
                passed.append(self.waiting.popleft())
                continue
            alone = busy == 0 and self.blocks.num_free == self.blocks.num_blocks  # nothing else holds blocks
            tokens = r.tokens
            if not self.blocks.can_admit(r.num_tokens, alone, r.req_id, tokens):
                break
            table, cached = self.blocks.allocate_cached(r.req_id, tokens)
            self.waiting.popleft()
            r.state, r.cached, busy = "prefilling", cached, busy + 1
            out.append(m.KVReady(r.request, table, list(r.outputs), r.attempt, cached, now))
        self.waiting.extendleft(reversed(passed))
        return out

    def unadmit(self, handed: list[m.KVReady]) -> None:
        """These KVReadys were not sent (prefill's inbox was full): their requests wait again, in order."""
        for kv in reversed(handed):
            r = self.reqs[kv.request.req_id]
            self.blocks.free(r.req_id)
            self.blocks.unlookup(r.num_tokens, kv.cached_tokens)
            r.state = "waiting"
            i = 0  # ahead of the later arrivals only: a request passed over at the head keeps its place
            while i < len(self.waiting) and self.waiting[i].order < r.order:
                i += 1
            self.waiting.insert(i, r)

    # ---- the decode batch ---------------------------------------------------------------------
    def schedule(self, quiet: bool, hold: AbstractSet[str] = frozenset()) -> list[DecodeRequest] | None:
        """The next step's batch (every running request not in `hold`), each table grown to cover
        `tokens_needed`. When the pool is short: None if not `quiet` (a step is in flight, so nothing
        may be freed), else the latest admitted running requests are preempted until the rest fit.

        `hold`: ids whose grammar is still compiling (`GrammarBook.compiling`): they keep their seat
        and blocks but sit out the step (not grown; still preemptible), and join once ready. Such a
        request has no step in flight: it has never been in a batch of this worker."""
        for r in list(self.running):
            if r.state != "running" or r.req_id in hold:  # preempted as a victim earlier in this pass; held
                continue
            while not self.blocks.can_grow(r.req_id, r.tokens_needed):
                if not quiet:
                    return None
                victim = max(self.running, key=lambda x: x.order)
                self._preempt(victim)
                if victim is r:
                    break
            else:
                self.blocks.grow(r.req_id, r.tokens_needed)
        return [r for r in self.running if r.req_id not in hold]

    def launched(self, batch: list[DecodeRequest]) -> None:
        for r in batch:
            r.inflight += 1

    def record(self, batch: list[DecodeRequest], rows: list[Row]) -> list[m.TokenOut]:
        """A launched step has landed: its tokens, in batch order, with stops applied. A request that
        ended while the step ran gets no token and is freed now."""
        out: list[m.TokenOut] = []
        for r, (tok, lp, top) in zip(batch, rows, strict=True):
            r.inflight -= 1
            if r.state != "running":
                self._release(r)
                continue
            r.outputs.append(tok)
            if self.blocks.needs_commit(r.req_id, r.num_tokens - 1):  # the landed steps wrote all but the newest
                self.blocks.commit(r.req_id, r.tokens, r.num_tokens - 1)
            reason = check_stop(r.params, r.outputs, r.num_tokens, self.eos, self.context_cap)
            out.append(m.TokenOut(r.req_id, len(r.outputs) - 1, tok, lp, top, reason))
            if reason is not None:
                self._finish(r, reason, notify=False)  # the token carries the reason
        return out

    def fail(self, reqs: list[DecodeRequest], message: str, fault: str = "") -> None:
        """These requests end with an error (their rows failed; `fault`: m.Finished's); the caller ensured
        nothing writes their blocks any more."""
        for r in reqs:
            if r.state != "done":
                self._finish(r, "error", message=message, fault=fault)

    def fail_batch(self, inflight: list[DecodeRequest], message: str) -> None:
        """A step failed for no single row: every running request and the in-flight step's requests
        end (those already ended are freed). The caller ensured nothing in flight writes any more."""
        for r in list(self.running) + inflight:
            r.inflight = 0
            if r.state == "running":
                self._finish(r, "error", message=message)
            else:
                self._release(r)

    # ---- endings ------------------------------------------------------------------------------
    def _preempt(self, r: DecodeRequest) -> None:
        self.running.remove(r)
        self.blocks.free(r.req_id)
        r.state, r.attempt = "waiting", r.attempt + 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def _finish(self, r: DecodeRequest, reason: str, notify: bool = True, message: str = "",
                fault: str = "") -> None:
        """Done: out of every queue now; blocks back once no in-flight step writes them."""
        if r in self.running:
            self.running.remove(r)
        self._passed.pop(r.req_id, None)
        r.state = "done"
        if notify:
            self.finished.append(m.Finished(r.req_id, reason, message, fault))
        self._release(r)

    def _release(self, r: DecodeRequest) -> None:
        """Blocks back once nothing writes them; the id is forgotten once prefill answered every Drop."""
        if r.state != "done" or r.inflight or self.reqs.get(r.req_id) is not r:
            return
        self.blocks.free(r.req_id)  # at most once: nothing allocates under a held id
        if not r.drop_pending:
            del self.reqs[r.req_id]
