"""The prefill worker under `--policy drift` (DRIFT, the PD-multiplexing paper, sections 3.3-3.5).

Same seat, messages and invariants as `PrefillWorker` (engine/prefill_worker.py), whose queue, sampling,
publishing and failure isolation it reuses; what differs is how a batch runs:
* block-wise: a batch is a `PrefillTask` (rapidserve/runner/prefill_task.py) launched a block of layers at a
  time, each block sized (`layers_per_block`) to return before decode's concurrent step ends, so a
  decision is due every block;
* query-based synchronisation: after launching a block the loop never waits for it; it polls the
  block's event (`PrefillTask.query`) and meanwhile drains its inbox (the doorbell wakes it for a
  message); only the first token's sampling, after the last block and the logits, waits on the host;
* the dispatcher: at each block boundary (the last block's event has completed) `decide_drift` is fed
  the queue (arrival times, lengths), the running batch and its progress, the preempted one, the TTFT
  SLO, the linear prefill model of the configuration decode chose and decode's predicted step there
  (SetPartition.decode_step_ms; the ITL SLO until decode says), and says: start a batch, continue,
  preempt the running batch for a short request, or resume the preempted one (first, before anything
  new). A stack of one: while a batch is preempted nothing else is.
The partition itself is decode's choice (partition/drift_plan.py says who decides what).

Invariants (beyond PrefillWorker's):
- A preempted batch keeps its task: its KV writes of the layers done stay in its blocks and its partial
  hidden state on the device; it resumes at the layer it stopped at, so its logits, K/V and tokens are
  those of an unpreempted run (tests/test_prefill_task.py: bit-identical on CPU).
- A Drop of a request inside a launched batch (running or preempted) is answered (Dropped) only once
  that batch has ended: later blocks still write its blocks, so decode must not free them before; it
  gets no PrefillDone.
- Stream ordering: every piece (task, block, logits, sampling) runs on the current configuration's
  prefill stream; after a SetPartition the new stream first waits for the one the last piece ran on
  (`_stream`), so a task resumed on another stream reads its own earlier writes. A task is dropped only
  after its first tokens were read on the host (or, on a failure, after `runner.synchronize()`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.faults import is_fatal
from rapidserve.engine.prefill_worker import Job, PrefillWorker
from rapidserve.engine.worker_io import WorkerIO
from rapidserve.partition.backend import PartitionBackend, on_stream
from rapidserve.partition.drift import DriftDecision, LinearModel, RunningPrefill, decide_drift
from rapidserve.partition.policy import PolicyState, WaitingPrefill
from rapidserve.runner import ModelRunner, PrefillItem
from rapidserve.runner.prefill_task import PrefillTask

POLL_S = 0.0002  # a block in flight: how long the loop sleeps between polls (a message wakes it sooner)
IDLE_S = 0.1  # nothing to do: the doorbell wakes the loop for the next message
SLO_MARGIN = 0.9  # decide_drift's: decode's step must stay within this share of the ITL SLO
log = logging.getLogger(__name__)


@dataclass
class Launch:
    """A prefill batch launched block-wise: each job's chunk of `n` tokens, its task, and its logits once
    every layer is queued."""

    batch: list[tuple[Job, int]]
    task: PrefillTask
    logits: torch.Tensor | None = None

    @property
    def jobs(self) -> list[Job]:
        return [j for j, _ in self.batch]

    def holds(self, req_id: str) -> bool:
        return any(j.req.req_id == req_id for j, _ in self.batch)


class DriftPrefillWorker(PrefillWorker):
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, backend: PartitionBackend,
                 partition: str, models: Mapping[str, LinearModel],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`models`: each configuration's prefill time model (PlanWire.prefill_models); `clock`: the
        router's clock (NewRequest.arrival is its time.monotonic())."""
        super().__init__(cfg, runner, io, backend, partition)
        missing = set(backend.names) - set(models)
        if missing:
            raise ValueError(f"drift: no prefill time model for configurations {sorted(missing)}")
        self.models, self.clock = dict(models), clock
        self.num_layers = len(runner.model.layers)
        self.step_ms: float | None = None  # decode's predicted step beside prefill (SetPartition); None: the SLO
        self.running: Launch | None = None
        self.preempted: Launch | None = None
        self.preemptions = 0
        self.last: DriftDecision | None = None  # the latest decision (tests, debugging)
        self._dropping: set[str] = set()  # requests of a launched batch whose Drop is answered at its end

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            for msg in self.io.drain():
                self.handle(msg)
            nap = self.tick()
            if nap > 0:
                self.io.wait(nap)
            self.heartbeat()
            if not self.io.others_alive():
                return

    def tick(self) -> float:
        """One turn: poll the block in flight; at a block boundary finish a batch whose logits landed, or
        carry out the dispatcher's decision. Returns how long the loop may sleep (0: turn again now)."""
        run = self.running
        if run is not None and not run.task.query():
            return POLL_S  # never block on the block in flight
        if run is not None and run.logits is not None:
            self._guarded(run, self._finish)
            if len(self.grammar):  # compile state of the jobs that left (done, failed)
                self.grammar.retain((), known=(j.req.req_id for j in self.waiting_prefill))
            return 0.0
        d = self.last = self.decide()
        if d.action == "idle":
            return IDLE_S
        launch = self._carry_out(d)
        if launch is not None:
            self._guarded(launch, lambda x: self._launch_block(x, d.layers_per_block))
        return 0.0

    def heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self.cfg.launch.stats_interval_s:
            self._last_beat = now
            self.io.to_router.try_send(m.Heartbeat("prefill", len(self.waiting_prefill),
                                                   preemptions=self.preemptions))

    def handle(self, msg: object) -> None:
        if isinstance(msg, m.Drop) and any(x is not None and x.holds(msg.req_id)
                                           for x in (self.running, self.preempted)):
            self._dropping.add(msg.req_id)  # its blocks are still written by that batch: answered at its end
            return
        if isinstance(msg, m.SetPartition):
            self.step_ms = msg.decode_step_ms
        super().handle(msg)

    # ---- decisions ----------------------------------------------------------------------------------
    def state(self) -> PolicyState:
        """The dispatcher's view now: the queue beyond the launched batches, in arrival order of admission."""
        p = self.cfg.partition
        skip = {j.req.req_id for x in (self.running, self.preempted) if x is not None for j in x.jobs}
        skip |= self._dropping | self.grammar.compiling()  # held until their grammar compiles (off the loop)
        waiting = tuple(WaitingPrefill(j.req.req_id, j.req.arrival, len(j.tokens) - j.done_tokens, j.done_tokens)
                        for j in self.waiting_prefill if j.req.req_id not in skip)
        return PolicyState(self.clock(), (), waiting, p.slo_itl_ms, p.slo_ttft_ms, prefill_budget=self.budget,
                           slo_ttft_ms_per_1k_tokens=p.slo_ttft_ms_per_1k_tokens)

    def decide(self) -> DriftDecision:
        """`decide_drift` over the configuration decode chose (its step there: decode's estimate, else
        the limit the ITL SLO puts on it)."""
        c = self.partition
        step = self.step_ms if self.step_ms is not None else SLO_MARGIN * self.cfg.partition.slo_itl_ms
        return decide_drift(self.state(), models={c: self.models[c]}, decode_ms_beside={c: step},
                            prefill_units={c: 1}, num_layers=self.num_layers, running=self._info(self.running),
                            preempted=self._info(self.preempted))

    def _info(self, x: Launch | None) -> RunningPrefill | None:
        if x is None:
            return None
        jobs = x.jobs
        return RunningPrefill(tuple(j.req.req_id for j in jobs), tuple(j.req.arrival for j in jobs),
                              sum(n for _, n in x.batch), self.partition, x.task.layers_done, self.num_layers,
                              tuple(len(j.tokens) for j in jobs))

    def _carry_out(self, d: DriftDecision) -> Launch | None:
        """The batch the decision launches a block of: the running one (continue), the preempted one
        (resume), or a new one (start; preempt, which stacks the running one). None: a new batch whose
        inputs could not be built (its requests were isolated)."""
        if d.action == "resume":
            self.running, self.preempted = self.preempted, None
        elif d.action == "preempt":
            assert self.running is not None and self.preempted is None
            self.preempted, self.preemptions = self.running, self.preemptions + 1
            log.debug("drift: %s", d.reason)
            self.running = self._start(d.batch)
        elif d.action == "start":
            self.running = self._start(d.batch)
        return self.running

    def _launch_block(self, x: Launch, n_layers: int) -> None:
        with self._stream():
            x.task.step(n_layers)
            if x.task.done:  # the logits queue behind the last block: one event covers both
                x.logits = x.task.logits()

    def _start(self, batch: tuple[tuple[str, int, int], ...]) -> Launch | None:
        jobs = {j.req.req_id: j for j in self.waiting_prefill}
        chunks = [(jobs[rid], min(n, self.budget)) for rid, n, _ in batch]
        items = [PrefillItem(j.tokens[j.done_tokens: j.done_tokens + n], j.done_tokens, j.blocks,
                             need_logits=j.done_tokens + n == len(j.tokens)) for j, n in chunks]
        now = time.monotonic()
        for j, _ in chunks:
            j.mark_started(now)
        try:
            with self._stream():
                return Launch(chunks, self.runner.prefill_task(items))
        except Exception as e:  # noqa: BLE001 - its inputs could not be built: its requests are isolated
            if is_fatal(e):
                raise
            self.runner.synchronize()
            self._isolate(chunks, e)
            return None

    def _guarded(self, x: Launch, fn: Callable[[Launch], None]) -> None:
        try:
            fn(x)
        except Exception as e:  # noqa: BLE001 - the batch's requests are isolated
            if is_fatal(e):
                raise
            self._failed(x, e)

    # ---- ends -----------------------------------------------------------------------------------------
    def _finish(self, x: Launch) -> None:
        """Every layer and the logits have landed: sample the first tokens of the prompts this batch
        completes and publish them (PrefillFailed rows through the base's isolation if sampling raises)."""
        assert x.logits is not None
        finished = [j for j, n in x.batch if j.done_tokens + n == len(j.tokens)]
        keep = [i for i, j in enumerate(finished) if j.req.req_id not in self._dropping]
        with self._stream():
            logits = x.logits if len(keep) == len(finished) else x.logits[keep]
            firsts, dones = self._sample([finished[i] for i in keep], logits) if keep else ([], [])
        self.running = None
        for j, n in x.batch:
            j.done_tokens += n
        for j in finished:
            self.waiting_prefill.remove(j)
        self._answer_drops(x)
        if firsts:
            self.io.to_router.send(m.TokenBatch(firsts))
        for d in dones:
            self.io.to_decode.send(d)

    def _failed(self, x: Launch, e: BaseException) -> None:
        """A piece of the batch (a block, the logits, the sampling) raised: nothing of it is in flight any
        more once synchronized; its requests are computed again one at a time in one shot, and the ones
        that still raise fail alone (the base's isolation)."""
        self.runner.synchronize()
        if self.running is x:
            self.running = None
        if self.preempted is x:
            self.preempted = None
        self._answer_drops(x)
        self._isolate([(j, n) for j, n in x.batch if j in self.waiting_prefill], e)

    def _isolate(self, batch: list[tuple[Job, int]], e: BaseException) -> None:
        with self._stream():
            super()._isolate(batch, e)

    def _answer_drops(self, x: Launch) -> None:
        for j in x.jobs:
            rid = j.req.req_id
            if rid in self._dropping:
                self._dropping.discard(rid)
                if j in self.waiting_prefill:
                    self.waiting_prefill.remove(j)
                self.io.to_decode.send(m.Dropped(rid))

    @contextlib.contextmanager
    def _stream(self) -> Iterator[None]:
        """The current configuration's prefill stream, ordered after the stream of the last piece."""
        stream = self.backend.stream(self.partition, "prefill")
        last, self._last_stream = self._last_stream, stream
        if stream is not None and last is not None and last is not stream:
            stream.wait_stream(last)
        with on_stream(stream):
            yield

