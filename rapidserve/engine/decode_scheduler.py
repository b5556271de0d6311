"""The decode worker's decisions: pure Python, no torch, no I/O; tested on CPU against a BlockManager.

The decode worker (`engine/decode_worker.py`) owns the block tables and asks this scheduler what to
do; it only moves messages and runs the device. Messages in (`add`, `abort`, `prefill_done`,
`prefill_failed`, `dropped`) change request states; `admit` hands waiting requests to the prefill
worker; `schedule` gives the next decode batch and `plan` a fused step's (decodes, then prompt chunks
computed here); `launched` / `record` / `chunks_landed` follow a step onto the device and back. What the
router must hear (`Finished`) collects in `finished`, which the worker publishes. Admission (`admit`, `hand_over`,
`unadmit`) and its policy, waiting for a prefix in flight included, are engine/decode_admission.py's; the policies'
views of the queues, engine/decode_views.py's; the records, engine/decode_request.py's.

Request states: waiting (holds no blocks: new, or preempted) -> prefilling (blocks allocated and
handed to the prefill worker in a KVReady, which carries the request; prefill writes them) or
chunking (blocks allocated here; this worker computes the prompt, a chunk per fused step) -> running
(in the decode batch) -> done. Requests are admitted in arrival order; a preempted one goes back to the
head of the queue. A request handed to the prefill worker stays there until PrefillDone, PrefillFailed
or Dropped; one chunked here goes on here, a chunk per fused step, until a split step hands the rest of its
prompt to the prefill worker (`hand_over`, once its chunks have landed): a split step computes no chunk here.

Policy:
- A fused step (`plan(chunk_tokens, step_tokens)`): every running request decodes (as `schedule`), then
  prompt chunks in arrival order up to `chunk_tokens` and the step's `step_tokens` in all: the prompts
  being chunked first, then new local admissions. A chunk that ends its prompt samples the first token in
  that step: the request joins the running batch at launch, its token in flight. Local admission passes over
  requests in `hold` (their grammar still compiling: this worker samples their first token), keeping their place,
  and admits nothing in a step that preempted.
- The prefix cache: admission shares a request's cached prefix (engine/decode_admission.py); its full blocks are
  registered in the cache once their K/V are written: the prompt's when PrefillDone comes (prefill's writes landed
  before it answered) or as its chunks land, decode's as its steps land.
- Growth: before each step every running request's table grows to cover its tokens, counting the
  token of the step still in flight. A request whose token in flight will certainly end it
  (`stop_rules.reaches_length`: max_tokens, the context cap) gets no further step; it keeps its blocks
  until that token is recorded. When the pool is short, the most recently admitted running or chunking
  request is preempted by recompute (its blocks are freed; it goes back to waiting with its outputs,
  which are computed again after the prompt, so no token is lost or repeated). Preemption frees
  blocks, so it needs a quiet pool: with a step in flight `schedule` / `plan` return None and the worker
  lets that step land first.
- Stops: after each token, `check_stop` (the one stop check) against the context cap, which is the
  model's window or the pool's capacity where that is smaller, so a request alone always fits.

Block ownership (docs/architecture.md): a request's blocks are freed only when nothing can still write into them:
- while prefilling, prefill writes them: an abort asks prefill to drop the request (`abort` returns
  True: the worker sends Drop) and frees on Dropped, PrefillDone or PrefillFailed, whichever comes;
  the request's id stays held until the Dropped comes (prefill answers every Drop), so a request
  that reuses the id is refused meanwhile and a late Dropped never frees a newer request's blocks;
- while a step that includes the request is in flight (`DecodeRequest.writing`: a decode row or a prompt
  chunk), that step writes its K/V: a request finished or aborted meanwhile is freed when that step is
  recorded, and the step's token for it is dropped, so no token is emitted after the end. (So a block
  freed here is never handed to the prefill worker, another process, while a step of this one still
  writes it.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from rapidserve.block_manager import BlockManager
from rapidserve.engine import messages as m
from rapidserve.engine.decode_admission import SchedulerAdmission
from rapidserve.engine.decode_request import Chunk, DecodeRequest, Row, State, StepBatch
from rapidserve.stop_rules import check_stop, reaches_length

__all__ = ["SHARE_MIN_TOKENS", "Chunk", "DecodeRequest", "DecodeScheduler", "Row", "State", "StepBatch"]

SHARE_MIN_TOKENS = 512  # a prefix in flight this long is worth waiting for (Mooncake's hash blocks are 512 tokens)


class DecodeScheduler(SchedulerAdmission):
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
        self.chunking: list[DecodeRequest] = []  # prompts computed here, in admission order
        self.finished: list[m.Finished] = []  # for the router; the worker publishes and clears it
        self.num_preemptions = 0
        # prompts chunked here, then handed to the prefill worker by a split step (`hand_over`), cumulative; one
        # un-admitted (prefill's inbox full: `unadmit`) is taken back, so this counts the hand-overs prefill was sent
        self.num_hand_overs = 0
        self._arrivals = 0

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
        self._finish(r, "abort")  # chunking or running: freed once no step in flight writes its blocks
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

    # ---- the next step ------------------------------------------------------------------------
    def schedule(self, quiet: bool, hold: AbstractSet[str] = frozenset()) -> list[DecodeRequest] | None:
        """The next step's decode batch (every running request not in `hold` whose token in flight does
        not certainly end it), each table grown to cover `tokens_needed`. When the pool is short: None if
        not `quiet` (a step is in flight, so nothing may be freed), else the latest admitted running or
        chunking requests are preempted until the rest fit.

        `hold`: ids whose grammar is still compiling (`GrammarBook.compiling`): they keep their seat
        and blocks but sit out the step (not grown; still preemptible), and join once ready. Such a
        request has no step in flight: it has never been in a batch of this worker."""
        batch: list[DecodeRequest] = []
        blocks = self.blocks
        for r in list(self.running):
            if r.state != "running" or r.req_id in hold or (r.inflight and self._ends_in_flight(r)):
                continue  # preempted as a victim earlier in this pass; held; finishing
            need = r.tokens_needed
            while not blocks.try_grow(r.req_id, need):  # grown when the pool allows, else a victim is freed
                if not quiet:
                    return None
                victim = max(self.running + self.chunking, key=lambda x: x.order)
                self._preempt(victim)
                if victim is r:
                    break
            else:
                batch.append(r)
        return [r for r in batch if r.state == "running"]

    def _ends_in_flight(self, r: DecodeRequest) -> bool:
        """Its token in flight will certainly end it (the length rule): it gets no further step."""
        return r.inflight > 0 and reaches_length(r.params, len(r.outputs) + r.inflight, r.tokens_needed,
                                                 self.context_cap)

    def plan(self, chunk_tokens: int, step_tokens: int, quiet: bool, hold: AbstractSet[str] = frozenset(),
             now: float = 0.0) -> StepBatch | None:
        """A fused step: the decode batch (`schedule`; None as there), then prompt chunks computed here, in
        arrival order, of at most `chunk_tokens` tokens and `step_tokens` in the whole step: first the
        prompts being chunked, then waiting requests admitted locally (not those in `hold`; none in a
        step that preempted: the pool is short), each given the blocks of all its tokens at `now`."""
        preemptions = self.num_preemptions
        decode = self.schedule(quiet, hold)
        if decode is None:
            return None
        batch = StepBatch(decode)
        budget = max(0, min(chunk_tokens, step_tokens - len(decode)))
        for r in self.chunking:
            if budget == 0:
                break
            n = min(r.num_tokens - r.computed, budget)
            batch.chunks.append(Chunk.of(r, n))
            budget -= n
        if self.num_preemptions != preemptions:
            return batch
        passed: list[DecodeRequest] = []
        busy = self.busy
        while budget > 0 and (r := self._admit_head(hold, passed, busy, now)) is not None:
            r.state, r.computed, busy = "chunking", r.cached, busy + 1
            self.chunking.append(r)
            n = min(r.num_tokens - r.computed, budget)
            batch.chunks.append(Chunk.of(r, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return batch

    def launched(self, batch: list[DecodeRequest] | StepBatch, now: float = 0.0) -> None:
        """The step is queued on the device: its decodes' tokens are in flight and its chunks count as
        computed; a chunk that ends its prompt puts its request in the running batch, its first token in
        flight."""
        step = batch if isinstance(batch, StepBatch) else StepBatch(batch)
        for r in step.decode:
            r.inflight += 1
        for c in step.chunks:
            r = c.req
            if r.started is None:
                r.started = now
            r.computed = c.end
            if c.samples:
                r.inflight += 1
                self.chunking.remove(r)
                r.state = "running"
                self.running.append(r)
            else:
                r.chunks_inflight += 1

    # ---- a step has landed --------------------------------------------------------------------
    def record(self, batch: list[DecodeRequest], rows: list[Row], landed: float = 0.0) -> list[m.TokenOut]:
        """A launched step has landed (at `landed`): its tokens, in `sampled` order, with stops applied. A
        request that ended while the step ran gets no token and is freed now. A request's first token
        (its prompt chunked here) carries its cached prefix and where its time to first token went."""
        out: list[m.TokenOut] = []
        for r, (tok, lp, top, rank) in zip(batch, rows, strict=True):
            r.inflight -= 1
            if r.state != "running":
                self._release(r)
                continue
            first = not r.outputs
            r.outputs.append(tok)
            if self.blocks.needs_commit(r.req_id, r.num_tokens - 1):  # the landed steps wrote all but the newest
                self.blocks.commit(r.req_id, r.tokens, r.num_tokens - 1)
            reason = check_stop(r.params, r.outputs, r.num_tokens, self.eos, self.context_cap)
            times = m.PhaseTimes(r.admitted, landed if r.started is None else r.started, landed) if first else None
            out.append(m.TokenOut(r.req_id, len(r.outputs) - 1, tok, lp, top, reason, r.cached if first else None,
                                  times, rank))
            if reason is not None:
                self._finish(r, reason, notify=False)  # the token carries the reason
        return out

    def chunks_landed(self, chunks: Iterable[Chunk]) -> None:
        """The chunks of a landed step that sample nothing: their K/V are written, so their full blocks join
        the prefix cache; a request that ended while the step ran is freed now."""
        for c in chunks:
            if c.samples:  # recorded with the step's tokens (`record`)
                continue
            r = c.req
            r.chunks_inflight -= 1
            if r.state == "done":
                self._release(r)
            elif self.blocks.needs_commit(r.req_id, c.end):
                self.blocks.commit(r.req_id, r.tokens, c.end)

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
            r.inflight = r.chunks_inflight = 0
            if r.state in ("running", "chunking"):
                self._finish(r, "error", message=message)
            else:
                self._release(r)

    # ---- endings ------------------------------------------------------------------------------
    def _preempt(self, r: DecodeRequest) -> None:
        (self.running if r.state == "running" else self.chunking).remove(r)
        self.blocks.free(r.req_id)
        r.state, r.attempt, r.computed, r.started, r.handed = "waiting", r.attempt + 1, 0, None, False
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def _finish(self, r: DecodeRequest, reason: str, notify: bool = True, message: str = "",
                fault: str = "") -> None:
        """Done: out of every queue now; blocks back once no in-flight step writes them."""
        if r.state == "running":
            self.running.remove(r)
        elif r.state == "chunking":
            self.chunking.remove(r)
            self.blocks.unpend(r.req_id)  # requests waiting for its prefix stop waiting
        self._passed.pop(r.req_id, None)
        r.state = "done"
        if notify:
            self.finished.append(m.Finished(r.req_id, reason, message, fault))
        self._release(r)

    def _release(self, r: DecodeRequest) -> None:
        """Blocks back once nothing writes them; the id is forgotten once prefill answered every Drop."""
        if r.state != "done" or r.writing or self.reqs.get(r.req_id) is not r:
            return
        self.blocks.free(r.req_id)  # at most once: nothing allocates under a held id
        if not r.drop_pending:
            del self.reqs[r.req_id]
