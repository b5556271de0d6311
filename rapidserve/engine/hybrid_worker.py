"""The hybrid worker (`rapidserve serve --mode hybrid`): one process, Sarathi-Serve / vLLM-style
chunked prefill, the baseline the RAPID engine is compared with.

It takes the decode worker's seat on the rings (worker_io.RING_TYPES): inbox `r2d` (NewRequest,
Abort, Shutdown), outbox `d2r` (Ready, TokenBatch, Finished, Stats, WorkerError), so the router
(`AsyncEngine`) is the same as in rapid mode. There is no prefill worker and nothing is shared with
another process. It is built and started like the others (`worker_build.build_hybrid`,
`worker_io.run_worker`).

Each step (`run`): the `HybridScheduler` plans decodes first, then prompt chunks up to the token
budget; `launch` runs the plan as ONE forward pass and samples on the device; the worker reads its
inbox while the device computes; `record` waits for the step (the one host sync of a step), fills in
the tokens, checks stops and frees what finished; `publish` sends the step's tokens in one
TokenBatch. Waiting for each step (`--no-async-scheduling`) records a step before planning the next;
both loops share `launch` and `record`.

Scheduling ahead (`SchedulerConfig.async_scheduling`, on by default, as vLLM's --async-scheduling):
step N+1 is planned and launched before step N's tokens are read, so the device never waits for the
host between steps. At launch a sampled sequence gets a placeholder output token (PLACEHOLDER) and
its planned tokens count as computed; the next step feeds that row the sampled token straight from
the device (`runner.Carry`). `record` then writes the real tokens over the placeholders, checks stops
(a request found finished has the token computed for it in the step in flight dropped) and registers
full blocks in the prefix cache, now that their token ids are known. A request whose token in flight
will certainly end it (max_tokens, the context cap) gets no further decode, but keeps its blocks until
that token is recorded: under memory pressure the next plan may preempt a request (or preempt the
finishing one, counted as a preemption) where waiting for each step would not have. A placeholder is always
resolved before any prompt recompute reads it: a preempted request is re-admitted by a later plan, and
the step before that plan has been recorded by then.

Forward passes:
- decode-only plan: `ModelRunner.decode`, which replays the captured decode graph of the smallest
  batch bucket that fits;
- otherwise one varlen `ModelRunner.prefill` over the decodes (one-token chunks at position
  num_tokens - 1) followed by the prompt chunks (same Triton kernels as the prefill worker). It
  returns logits for the decodes and for the chunks that end a prompt, in `plan.sampled` order.
Sampled tokens (and logprobs) are copied to pinned host memory without waiting, then an event is
recorded; the host reads them only after that event.

Structured outputs (rapidserve/structured): when a step samples a request with a constraint, `launch`
queues the forward first, then waits for the previous step's tokens on the host (only if a grammar
row's newest token is still a placeholder), advances those requests' matchers and fills their bitmask
rows on the CPU while the device computes, and the sampler applies the mask on the device. Batches
without a constraint never wait there. `publish` releases the matchers of requests no longer running.
A request's grammar starts compiling in the background when its NewRequest comes; until it is
compiled the request is not admitted (`schedule`'s `hold`) and the others keep stepping.

Blocks: only this worker changes block tables. A finished or aborted request's blocks return to the
pool at once, even while a step that writes them is in flight: there is one process and one
stream, so any later write into a reused block is queued behind that step. The in-flight token of a
request aborted meanwhile is dropped, so no token is emitted after an abort.
A request never outgrows the pool: its context is capped at the pool's capacity (finish reason
"length"; `ModelRunner.limits`), so a request alone always fits and the scheduler cannot stall.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.faults import RequestsFailed, describe, fill_or_blame, is_fatal, sample_or_blame
from rapidserve.engine.worker_io import WorkerIO, send_kv_events
from rapidserve.hybrid_scheduler import HybridScheduler
from rapidserve.logit_controls import seq_history
from rapidserve.runner import Carry, DecodeItem, ModelRunner, PrefillItem
from rapidserve.sampler import SamplerOutput
from rapidserve.sequence import Sequence, check_stop_at
from rapidserve.step_plan import StepPlan
from rapidserve.structured import GrammarBook, GrammarMask, GrammarRow

T = TypeVar("T")
PLACEHOLDER = -1  # an output token still in flight (scheduling ahead); never sent anywhere


@dataclass
class Launched:
    """A step handed to the device. `seqs`: the sequences it samples for, in logits row order."""

    plan: StepPlan
    seqs: list[Sequence]
    host: SamplerOutput | None  # tokens in (pinned) host memory, valid once `done`; None: no sampling
    done: torch.cuda.Event | None  # None on CPU, where everything is finished on return
    # Scheduling ahead: the sampled tokens on the device, each sequence's row, its output index.
    device_tokens: torch.Tensor | None = None
    rows: dict[int, int] | None = None  # id(seq) -> row
    index: list[int] | None = None


class HybridWorker:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO) -> None:
        self.cfg, self.runner, self.io, self.eos = cfg, runner, io, cfg.model_config.eos_token_ids
        self.blocks = runner.block_manager()
        # Running requests are capped like the decode worker's: at the largest decode graph bucket.
        max_seqs = min(cfg.scheduler.max_num_seqs, max(cfg.runner.graph_batch_sizes))
        self.sched = HybridScheduler(self.blocks, max_seqs, cfg.scheduler.max_num_batched_tokens)
        self.context_cap = runner.limits.context_cap
        self.seqs: dict[str, Sequence] = {}
        self.out = io.to_router
        self._tokens: list[m.TokenOut] = []
        self._arrivals = 0
        self._last_stats = 0.0
        self._stop = False
        self.grammar = GrammarBook.for_model(cfg.model, cfg.model_config.vocab_size, self.eos, cfg.tokenizer)
        if runner.device.type != "cpu":  # the first constraint finds its tokenizer loaded
            self.grammar.warm()

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        if self.cfg.scheduler.async_scheduling:
            self.run_ahead()
            return
        while not self._stop:
            plan = self.sched.schedule(hold=self.grammar.compiling())
            step = None if plan.is_empty else self.guarded(plan, self.launch, (plan, None))
            self.read_inbox(wait=plan.is_empty and not plan.preempted)  # while the device computes the step
            if step is not None:
                self.guarded(plan, self.record, step)
            self.publish()
            if not self.io.others_alive():
                return

    def run_ahead(self) -> None:
        """The loop scheduling one step ahead (`step_ahead`), then the last step's tokens at shutdown."""
        prev: Launched | None = None
        while not self._stop:
            prev = self.step_ahead(prev)
            if not self.io.others_alive():
                return
        if prev is not None:
            self.guarded(prev.plan, self.record, prev)
            self.publish()

    def step_ahead(self, prev: Launched | None) -> Launched | None:
        """Plan, launch (fed by `prev`, still in flight), read the inbox, record `prev`, publish."""
        plan = self.sched.schedule(self._finishing if prev is not None else None, self.grammar.compiling())
        step = None if plan.is_empty else self.guarded(plan, self.launch, (plan, prev))
        self.read_inbox(wait=step is None and prev is None and not plan.preempted)
        if prev is not None:
            self.guarded(prev.plan, self.record, prev)
        self.publish()
        return step

    def _finishing(self, seq: Sequence) -> bool:
        """Will the token in flight for `seq` certainly end it? (Then it gets no further decode.)"""
        if not seq.output_token_ids or seq.output_token_ids[-1] != PLACEHOLDER:
            return False
        n_out = len(seq.output_token_ids)
        return (seq.params.max_tokens is not None and n_out >= seq.params.max_tokens) or \
            seq.num_tokens >= self.context_cap

    def guarded(self, plan: StepPlan, fn: Callable[[Any], T], arg: Any) -> T | None:
        """Run `fn(arg)` for `plan`; a request never takes the worker down (engine/faults.py). Rows
        whose sampling raises alone fail; on any other error (device still usable) the suspects
        fail: the requests whose prompt chunks were in the step, or, in a decode-only step, all of
        its requests; a failure in `record` (which may have marked the plan computed) fails every
        request of the step. The rest are untouched: the step was not completed, so the scheduler
        plans their work again."""
        try:
            return fn(arg)
        except Exception as e:  # noqa: BLE001 - the blamed requests fail, the worker lives
            if is_fatal(e):
                raise
            self.runner.synchronize()  # nothing in flight writes the blocks freed below
            if isinstance(e, RequestsFailed):
                blamed, why = e.reqs, describe(e.error, "sampling")
            elif fn == self.record:  # the plan is marked computed already: retrying is not safe
                blamed, why = list(plan.decode) + [c.seq for c in plan.prefill], describe(e, "step")
            else:
                blamed, why = [c.seq for c in plan.prefill] or list(plan.decode), describe(e, "step")
            for seq in blamed:
                if not seq.is_finished and self.seqs.pop(seq.seq_id, None) is not None:
                    self.sched.finish(seq, "error")
                    self.out.send(m.Finished(seq.seq_id, "error", why))
            return None

    # ---- inbox ------------------------------------------------------------------------------
    def read_inbox(self, wait: bool) -> None:
        if wait:  # a compile's end rings no doorbell: poll while one holds a request back
            self.io.wait(self.grammar.idle_wait(0.1))
        for msg in self.io.drain():
            if isinstance(msg, m.NewRequest):
                self._new(msg)
            elif isinstance(msg, m.Abort):
                self._abort(msg.req_id)
            elif isinstance(msg, m.Shutdown):
                self._stop = True

    def _new(self, msg: m.NewRequest) -> None:
        """The router checked the prompt (rapidserve/prompt.py) and keeps request ids unique in flight."""
        if msg.req_id in self.seqs:
            self.out.send(m.Finished(msg.req_id, "error", f"request id {msg.req_id!r} is still in flight"))
            return
        self._arrivals += 1
        seq = Sequence(msg.req_id, list(msg.prompt_token_ids), msg.params, arrival=self._arrivals)
        self.seqs[seq.seq_id] = seq
        self.sched.add(seq)
        self.grammar.prepare(seq.seq_id, msg.params.structured_outputs)  # compiles off the loop

    def _abort(self, req_id: str) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self.sched.finish(seq, "abort")
            self.out.send(m.Finished(req_id, "abort"))

    # ---- one step ---------------------------------------------------------------------------
    def launch(self, arg: tuple[StepPlan, Launched | None]) -> Launched:
        """Queue the plan's forward pass and its sampling on the device; returns without waiting. Rows
        whose newest token is still in flight (a placeholder: scheduling ahead) take it from `prev`'s
        sampled tokens on the device. Once the step is queued, its planned tokens count as computed
        and each sampled sequence gets a placeholder for its coming token, which `record` fills in."""
        plan, prev = arg
        table = self.blocks.table
        rows = prev.rows if prev is not None and prev.rows is not None else {}
        carried: list[tuple[int, int]] = []
        decode_items = []
        for i, s in enumerate(plan.decode):
            tok = s.last_token_id
            if tok == PLACEHOLDER:
                carried.append((i, rows[id(s)]))
                tok = 0  # overwritten on the device
            decode_items.append((tok, s))
        carry = Carry(prev.device_tokens, carried) if carried and prev is not None and \
            prev.device_tokens is not None else None
        if plan.is_decode_only:
            logits = self.runner.decode([DecodeItem(t, s.num_tokens - 1, table(s.seq_id)) for t, s in decode_items],
                                        carry=carry)
        else:
            now = time.monotonic()
            for c in plan.prefill:  # where its time to first token went (PhaseTimes)
                if c.seq.started is None:
                    c.seq.started = now
            items = [PrefillItem([t], s.num_tokens - 1, table(s.seq_id)) for t, s in decode_items]
            items += [PrefillItem(c.seq.all_token_ids[c.start : c.start + c.length], c.start, table(c.seq.seq_id),
                                  need_logits=c.samples) for c in plan.prefill]
            logits = self.runner.prefill(items, carry=carry)
        seqs = plan.sampled
        out = None
        index = [len(s.output_token_ids) for s in seqs]  # output index of each sampled token
        if seqs:
            mask = self._grammar_mask(seqs, prev) if GrammarBook.needed(s.params for s in seqs) else None
            try:
                out = sample_or_blame(self.runner, logits, [s.params for s in seqs], index, self.eos, mask,
                                      history=lambda i: seq_history(seqs[i]))
            except RequestsFailed as e:
                e.reqs = [seqs[i] for i in e.rows]
                raise
        host = None if out is None else out.to_host()
        done = None if out is None else self.runner.mark()
        # Nothing below raises: the state moves on only for a step that is wholly queued.
        self.runner.record_sampled()  # the sampled tokens join their penalty slots (logit_controls.py)
        self.sched.complete(plan, commit=False)
        for s in seqs:
            s.output_token_ids.append(PLACEHOLDER)
        if out is None:  # only prompt chunks that end no prompt: nothing to sample or wait for
            return Launched(plan, [], None, None, rows={}, index=[])
        return Launched(plan, seqs, host, done, device_tokens=out.token_ids,
                        rows={id(s): i for i, s in enumerate(seqs)}, index=index)

    def _grammar_mask(self, seqs: list[Sequence], prev: Launched | None) -> GrammarMask:
        """The structured-output mask of this step's rows, filled while the device runs its forward
        (queued already). A row whose newest token is a placeholder needs `prev`'s tokens on the host:
        only batches with a grammar row wait for them here. Rows whose grammar rejects a token fail."""
        prev_tokens: list[int] | None = None
        rows: list[GrammarRow] = []
        for i, s in enumerate(seqs):
            if s.params.structured_outputs is None:
                continue
            known = s.output_token_ids
            if known and known[-1] == PLACEHOLDER:  # the row's newest token: `prev`'s, by its row there
                if prev_tokens is None:
                    assert prev is not None and prev.host is not None and prev.rows is not None
                    if prev.done is not None:
                        prev.done.synchronize()
                    prev_tokens = prev.host.token_ids.tolist()
                rows.append(GrammarRow(i, s.seq_id, s.params, known, prev_tokens[prev.rows[id(s)]]))
            else:
                rows.append(GrammarRow(i, s.seq_id, s.params, known))
        return fill_or_blame(self.grammar, rows, seqs, pin=self.runner.device.type == "cuda")

    def record(self, step: Launched) -> None:
        """Wait for the step, write its tokens over their placeholders: emit, stop, free what finished;
        then register the step's full blocks in the prefix cache."""
        if step.done is not None:
            step.done.synchronize()
        landed = time.monotonic()
        if step.host is not None and step.index is not None:
            for seq, idx, (tok, lp, top) in zip(step.seqs, step.index, step.host.rows([s.params for s in step.seqs]),
                                                strict=True):
                if seq.is_finished:  # aborted, or ended by its previous token, while the step ran
                    continue
                seq.output_token_ids[idx] = tok
                n_out = idx + 1
                reason = check_stop_at(seq.params, tok, n_out, len(seq.prompt_token_ids) + n_out, self.eos,
                                       self.context_cap)
                times = None
                if idx == 0:
                    started = seq.started if seq.started is not None else landed
                    times = m.PhaseTimes(started, started, landed)  # hybrid: admitted as it is scheduled
                self._tokens.append(m.TokenOut(seq.seq_id, idx, tok, lp, top, reason,
                                               seq.num_cached_tokens if idx == 0 else None, times))
                if reason is not None:  # the token carries the reason: no Finished message
                    self.sched.finish(seq, reason)
                    del self.seqs[seq.seq_id]
        self.sched.commit(step.plan)

    # ---- publishing ---------------------------------------------------------------------------
    def publish(self) -> None:
        if self.runner.tokens.in_use:  # penalty slots of requests that ended or were preempted are freed
            self.runner.tokens.retain(s.slot_key for s in self.sched.running)
        if len(self.grammar):  # matchers of requests no longer running (ended, preempted) are released,
            self.grammar.retain((s.seq_id for s in self.sched.running), known=self.seqs)  # compiles: ended
        if self._tokens:
            self.out.send(m.TokenBatch(self._tokens))
            self._tokens = []
        send_kv_events(self.out, self.blocks.events)  # with --kv-events-config
        now = time.monotonic()
        if now - self._last_stats >= self.cfg.launch.stats_interval_s:
            self._last_stats = now
            decoding, prefilling, waiting = self.sched.counts()
            self.out.try_send(m.Stats(num_running=decoding, num_waiting=waiting, num_prefilling=prefilling,
                                      kv_blocks_total=self.blocks.num_blocks, kv_blocks_free=self.blocks.num_free,
                                      num_preemptions=self.sched.num_preemptions,
                                      prefix_cache_queries=self.blocks.queries, prefix_cache_hits=self.blocks.hits,
                                      token_slots=self.runner.tokens.in_use))
