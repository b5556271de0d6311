"""The decode worker: owns the weights, the KV pool and the block tables; decodes the running batch.

Its decisions are the `DecodeScheduler`'s (engine/decode_scheduler.py: states, admission, growth,
preemption, stops, block ownership); this loop only moves messages and runs the device:
drain the inbox -> choose the compute partition -> admit (KVReady to prefill) -> step -> publish.

A step is launched one ahead (async scheduling): the tokens of the step in flight stay on the device
and feed the next step's inputs directly; the host records them (emit, stop, free) while the next
one runs.

Structured outputs (rapidserve/structured): the matcher state is not sent by prefill; decode builds
its own matcher by replaying the tokens it knows (the first token from PrefillDone; after a
preemption, every output), which reaches the same state. Each step with a grammar row queues the
forward, then waits for the in-flight step's tokens, advances the matchers and fills the bitmask on
the CPU while the device runs, and samples with the mask; steps without one are unchanged. Matchers
of requests no longer running (ended, aborted, preempted, failed) are released at `publish`.
A request's grammar starts compiling in the background when its NewRequest comes (so mostly while
prefill computes it); until it is compiled the request sits out the decode batch (`schedule`'s
`hold`) and the others keep stepping. Its compile state is released once the scheduler forgets it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeRequest, DecodeScheduler
from rapidserve.engine.faults import RequestsFailed, describe, fill_or_blame, is_fatal, sample_or_blame
from rapidserve.engine.worker_io import WorkerIO, send_kv_events
from rapidserve.logit_controls import TokenHistory
from rapidserve.partition.backend import PartitionBackend, on_stream
from rapidserve.partition.policy import PendingWork
from rapidserve.partition.runtime import DecodePartition
from rapidserve.runner import Carry, DecodeItem, ModelRunner
from rapidserve.sampler import SamplerOutput
from rapidserve.structured import GrammarBook, GrammarMask, GrammarRow

AWAIT_POLL_S = 50e-6  # how often a decode worker waiting for a step looks at the step and its inbox


@dataclass
class InFlight:
    """A launched decode step: its sampled tokens stay on the device until the step has landed."""

    batch: list[DecodeRequest]
    out: SamplerOutput  # on the device: token_ids [n] feed the next step's inputs directly
    host: SamplerOutput  # the same, copied to pinned host memory without waiting
    done: torch.cuda.Event | None


class DecodeWorker:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, partition: DecodePartition,
                 backend: PartitionBackend) -> None:
        self.cfg, self.runner, self.io = cfg, runner, io
        self.partition, self.backend = partition, backend
        max_seqs = min(cfg.scheduler.max_num_seqs, max(cfg.runner.graph_batch_sizes))  # the largest graph
        self.sched = DecodeScheduler(runner.block_manager(), max_seqs, cfg.model_config.eos_token_ids,
                                     runner.limits.context_cap)
        self.inflight: InFlight | None = None
        self._out: list[m.TokenOut] = []
        self._last_stats = 0.0
        self._stop = False
        self.grammar = GrammarBook.for_model(cfg.model, cfg.model_config.vocab_size, cfg.model_config.eos_token_ids,
                                            cfg.tokenizer)
        if runner.device.type != "cpu":  # the first constraint finds its tokenizer loaded
            self.grammar.warm()

    def run(self) -> None:
        while not self._stop:
            for msg in self.io.drain():
                self.handle(msg)
            self.repartition()
            self.admit()
            if self.sched.running or self.inflight is not None:
                self.step()
            else:
                self.io.wait(0.1)
            self.publish()
            if self.inflight is None and self.sched.running:  # every running request waits for its grammar,
                self.io.wait(self.grammar.idle_wait(0.0))  # whose end rings no doorbell: poll (0 s: none is)
            if not self.io.others_alive():
                return

    def handle(self, msg: object) -> None:
        if isinstance(msg, m.NewRequest):
            if self.sched.add(msg):  # its grammar compiles off the loop meanwhile (`_step`'s hold)
                self.grammar.prepare(msg.req_id, msg.params.structured_outputs)
        elif isinstance(msg, m.PrefillDone):
            first = self.sched.prefill_done(msg)
            if first is not None:
                self._out.append(first)  # streamed with this loop's publish, once the next step is launched
        elif isinstance(msg, m.PrefillFailed):
            self.sched.prefill_failed(msg)
        elif isinstance(msg, m.Dropped):
            self.sched.dropped(msg.req_id)
        elif isinstance(msg, m.Abort):
            if self.sched.abort(msg.req_id):
                self.io.to_prefill.send(m.Drop(msg.req_id))
        elif isinstance(msg, m.Shutdown):
            self._stop = True

    def admit(self) -> None:
        handed = self.sched.admit(time.monotonic())
        for i, kv in enumerate(handed):
            # Decode never blocks on prefill: with prefill's inbox full the rest wait, and decode keeps
            # stepping and sending heartbeats, so a hung prefill is the one taken as hung.
            if not self.io.to_prefill.try_send(kv):
                self.sched.unadmit(handed[i:])
                return

    def repartition(self) -> None:
        """Decide this step's configuration before admission, so prefill hears of a switch before
        the KVReady of the work it concerns (same ring, in order)."""
        s, policy = self.sched, self.partition.pcfg.policy
        if policy == "duet":
            sw = self.partition.advance_duet(s.decode_contexts(), s.pending_prefill())
        elif policy == "drift":  # prefill sizes its layer blocks to decode's step: told when it changes
            sw = self.partition.advance_drift(s.decode_contexts(), s.pending_prefill())
        else:
            sw = self.partition.advance(len(s.running), s.mean_context(), s.has_pending, self._pending_work())
        if sw is None:  # a new step estimate alone never blocks decode: with prefill's inbox full, next step
            p = self.partition
            if p.hint_due() and self.io.to_prefill.try_send(m.SetPartition(p.current, p.hint_ms)):
                p.sent_hint()
            return
        old = self.backend.stream(sw.old, "decode")
        if old is not None:
            # Stream ordering: the step in flight ran on the old stream. Its sampled tokens, its KV
            # writes and the graphs' static inputs (shared by every configuration's graphs) are read
            # or overwritten by the next step on the new stream, which nothing else orders after it.
            old.synchronize()
        self.io.to_prefill.send(m.SetPartition(sw.new, self.partition.sent_hint()))

    def _pending_work(self) -> PendingWork | None:
        """Prompt tokens prefill has yet to compute (counted up to where it matters) and its longest prompt,
        for the rapid policy."""
        p = self.partition
        if not p.adaptive or p.pcfg.policy != "rapid":
            return None
        return self.sched.pending_work(p.prefill_tokens_cap)

    # ---- one step: a request never takes the worker down (engine/faults.py) --------------------
    def step(self) -> None:
        """Rows whose sampling raises fail alone (the step in flight still lands); any other error of
        the step (device still usable) fails its whole batch."""
        try:
            try:
                self._step()
            except RequestsFailed as e:
                self.runner.synchronize()  # the failed step's forward may still write the blocks freed below
                self.sched.fail(e.reqs, describe(e.error, "sampling"))
                self._complete()
        except Exception as e:  # noqa: BLE001 - the batch fails, the worker lives
            if is_fatal(e):
                raise
            self.runner.synchronize()  # nothing in flight writes the blocks freed below
            f, self.inflight = self.inflight, None
            self.sched.fail_batch(f.batch if f is not None else [], describe(e, "decode step"))

    def _step(self) -> None:
        hold = self.grammar.compiling()  # requests whose grammar still compiles sit this step out
        batch = self.sched.schedule(quiet=self.inflight is None, hold=hold)
        if batch is None:
            self._complete()  # preemption needs a quiet pool: let the in-flight step land first
            batch = self.sched.schedule(quiet=True, hold=hold)
        if not batch:
            self._complete()
            return
        with on_stream(self.backend.stream(self.partition.current, "decode")):
            launched = self._launch(batch)
        self._complete()
        self.inflight = launched

    def _launch(self, batch: list[DecodeRequest]) -> InFlight:
        prev = self.inflight
        table = self.sched.blocks.table
        items = [DecodeItem(r.outputs[-1] if not r.inflight else 0, r.tokens_needed - 1, table(r.req_id))
                 for r in batch]
        carry = None
        if prev is not None and any(r.inflight for r in batch):  # tokens of the step in flight, from the device
            where = {id(r): i for i, r in enumerate(prev.batch)}
            carry = Carry(prev.out.token_ids, [(i, where[id(r)]) for i, r in enumerate(batch) if r.inflight])
        logits = self.runner.decode(items, graph_key=self.partition.current, carry=carry)
        index = [len(r.outputs) + r.inflight for r in batch]  # output index of this step's token
        mask = self._grammar_mask(batch, prev) if GrammarBook.needed(r.params for r in batch) else None
        try:
            out = sample_or_blame(self.runner, logits, [r.params for r in batch], index, self.sched.eos, mask,
                                  history=lambda i: history(batch[i]))
        except RequestsFailed as e:
            e.reqs = [batch[i] for i in e.rows]
            raise
        host = out.to_host()  # queued before the next step: reading it later never waits for that step
        self.runner.record_sampled()  # the sampled tokens join their penalty slots (logit_controls.py)
        self.sched.launched(batch)
        self.partition.note_step()
        return InFlight(batch, out, host, self.runner.mark())

    def _grammar_mask(self, batch: list[DecodeRequest], prev: InFlight | None) -> GrammarMask:
        """The structured-output mask of this step, filled on the CPU while the device runs the forward
        just queued. Each matcher replays the tokens known so far (the first token from PrefillDone,
        every output after a preemption) plus the in-flight step's token, for which only a batch with
        a grammar row waits here. Rows whose grammar rejects a token fail alone."""
        prev_tokens: list[int] | None = None
        where: dict[int, int] = {}
        rows: list[GrammarRow] = []
        for i, r in enumerate(batch):
            if r.params.structured_outputs is None:
                continue
            known = r.outputs
            if r.inflight:
                if prev_tokens is None:
                    assert prev is not None
                    if prev.done is not None:
                        prev.done.synchronize()
                    prev_tokens = prev.host.token_ids.tolist()
                    where = {id(x): k for k, x in enumerate(prev.batch)}
                known = known + [prev_tokens[where[id(r)]]]
            rows.append(GrammarRow(i, r.req_id, r.params, known))
        return fill_or_blame(self.grammar, rows, batch, pin=self.runner.device.type == "cuda")

    def _complete(self) -> None:
        """Record the in-flight step's tokens (emit, stop, free what finished)."""
        f = self.inflight  # cleared only once recorded: if this raises, step() still sees its requests
        if f is None:
            return
        if f.done is not None:
            self._await(f.done)
        rows = f.host.rows([r.params for r in f.batch])
        self.inflight = None
        self._out += self.sched.record(f.batch, rows)

    def _await(self, done: torch.cuda.Event) -> None:
        """Wait for a step to land while serving the inbox: a new request gets its blocks and goes to
        prefill at once when the partition would stay as it is with prefill pending (`keeps_with_prefill`;
        otherwise the next step boundary decides first, so prefill hears of a switch before the work it
        concerns). Other messages are handled as at the top of the loop (nothing here frees a block the
        in-flight step writes); first tokens from PrefillDone still stream once the step has landed, so
        the gap to the second token stays one step."""
        while not done.query():
            msgs = self.io.drain()
            if not msgs:
                time.sleep(AWAIT_POLL_S)
                continue
            for msg in msgs:
                self.handle(msg)
            s = self.sched
            if s.waiting and self.partition.keeps_with_prefill(len(s.running), s.mean_context(),
                                                               self._pending_work()):
                self.admit()

    def publish(self) -> None:
        if self.runner.tokens.in_use:  # penalty slots of requests that ended or were preempted are freed
            self.runner.tokens.retain(slot_key(r) for r in self.sched.running)
        if len(self.grammar):  # matchers of requests no longer running (ended, preempted) are released,
            self.grammar.retain((r.req_id for r in self.sched.running), known=self.sched.reqs)  # compiles: ended
        if self._out:
            self.io.to_router.send(m.TokenBatch(self._out))
            self._out = []
        for fin in self.sched.finished:
            self.io.to_router.send(fin)
        self.sched.finished.clear()
        send_kv_events(self.io.to_router, self.sched.blocks.events)  # with --kv-events-config
        now = time.monotonic()
        if now - self._last_stats >= self.cfg.launch.stats_interval_s:
            self._last_stats = now
            p = self.partition
            self.io.to_router.try_send(self.sched.stats(p.current, p.num_switches, p.steps, self.runner.tokens.in_use))


def slot_key(r: DecodeRequest) -> tuple[str, int]:
    """The key of a request's penalty slot (logit_controls.py): a new one after each preemption."""
    return (r.req_id, r.attempt)


def history(r: DecodeRequest) -> TokenHistory:
    """What a running request's penalty slot is filled from, at its first decode sample after PrefillDone
    (nothing of it is in flight then: `outputs` is complete)."""
    return TokenHistory(slot_key(r), r.request.prompt_token_ids, r.outputs)
