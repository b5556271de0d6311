"""The decode worker: owns the weights, the KV pool and the block tables; runs the engine's one step loop.

It serves every mode: rapid and disagg (beside a prefill worker) and hybrid (alone, no prefill worker). Its
decisions are the `DecodeScheduler`'s (engine/decode_scheduler.py: states, admission, growth, preemption,
stops, block ownership) and its `StepPolicy`'s (partition/shape.py: the shape of each step); this loop only
moves messages and runs the device (`turn`): drain the inbox -> ask the policy for this step's shape and
carry it out (switch the compute partition, hand prompts to prefill) -> step -> publish. The step itself (plan ->
launch -> record, faults) is `StepCycle`'s (engine/step_cycle.py), which `LLM`'s in-process engine runs too.

Step shapes, asked at every turn (`begin_step`):
- `Fused(chunk_tokens)`: one step of every running decode plus prompt chunks computed here (arrival order,
  prompts in progress first, then local admissions: blocks allocated as for prefill, prefix cache included),
  on the whole GPU (`overallocated`, where the plan has it). A prompt whose last chunk is in the step samples
  its first token there and joins the running batch; nothing goes to a prefill worker.
- `Split(config, ...)`: decode-only steps on `config`'s share; prompts being chunked here, then waiting ones,
  go to the prefill worker (KVReady), which computes them on the rest. (`lookahead` > 1 is carried out as 1:
  one decode step a launch.)
- `DecodeAlone(config)`: decode-only steps on `config`, no prompt work.
A request handed to the prefill worker stays there until PrefillDone, PrefillFailed or Dropped, whatever the
later shapes; a prompt being chunked here goes on here at the next fused step, or goes to the prefill worker
at the next split step once its chunks have landed (`DecodeScheduler.hand_over`, from its last full block; a
decode-alone step pauses it; the policy sees it among `ShapeState.waiting`). Switching configuration after a
step in flight synchronizes the old stream first: the step's sampled tokens, its KV writes and the graphs' static inputs
(shared by every configuration's graphs) are read or overwritten by the next step on the new stream, which
nothing else orders after it; the prefill worker hears of the switch (SetPartition) before the KVReady of the
work it concerns (same ring, in order). Each landed step's measured time goes back to the policy (`observe`),
and is counted by kind for the Stats the router gets (`step_timed`, engine/step_tally.py: /metrics' step series).

A step is launched one ahead (`SchedulerConfig.async_scheduling`, the default): the tokens of the step in
flight stay on the device and feed the next step's inputs directly (`runner.Carry`); the host records them
(emit, stop, free) while the next one runs. `--no-async-scheduling` records each step before planning the next.
A step in flight that has already landed when the next one is to be planned (the host late) is recorded and
published first (`step_landed_early`, engine/step_cycle.py's docstring: the order), so its tokens never wait for
the next step's planning and launch.

Structured outputs (rapidserve/structured): the matcher state is not sent by prefill; this worker builds its
own matcher by replaying the tokens it knows (the first token from PrefillDone; after a preemption, every
output), which reaches the same state. A step with a grammar row queues the forward, then waits for the
in-flight step's tokens (only if such a row's token is in flight), advances the matchers and fills the
bitmask on the CPU while the device runs, and samples with the mask (engine/step_launch.py). A request's
grammar starts compiling in the background at NewRequest; until it is compiled the request is not admitted
here (`plan`'s `hold`) and, arriving from prefill, sits out the decode batch; the others keep stepping.
Matchers, penalty slots and compile states of requests no longer running are released at `publish`.
"""

from __future__ import annotations

import logging
import time

import torch

from rapidserve.batch_limits import seats
from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeScheduler, StepBatch
from rapidserve.engine.sampling_step import retain
from rapidserve.engine.step_cycle import StepCycle
from rapidserve.engine.step_launch import InFlight, slot_key
from rapidserve.engine.step_tally import StepTally, correction_ratios
from rapidserve.engine.step_trace import StepTrace
from rapidserve.engine.worker_io import WorkerIO, send_kv_events
from rapidserve.partition.backend import PartitionBackend
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.policy import PendingWork
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import OVERALLOCATED, DecodeAlone, Fused, Split, StepPolicy, StepShape, StepTiming
from rapidserve.partition.step_policies import AlwaysSplit, RapidInputs, make_step_policy
from rapidserve.runner import ModelRunner
from rapidserve.structured import GrammarBook

LOG = logging.getLogger(__name__)
AWAIT_POLL_S = 50e-6  # how often a decode worker waiting for a step looks at the step and its inbox
IDLE_WAIT_S = 0.1  # the longest nap of an idle loop (a message wakes it at once)


class DecodeWorker(StepCycle):
    def __init__(self, cfg: EngineConfig, runner: ModelRunner, io: WorkerIO, partition: DecodePartition,
                 backend: PartitionBackend | None, policy: StepPolicy | None = None) -> None:
        """`backend`: the partition streams (None: the current stream, no partition: hybrid mode). `policy`:
        the step shapes (None: `AlwaysSplit`, rapid mode's partition manager)."""
        self.cfg, self.runner, self.io = cfg, runner, io
        self.partition, self.backend = partition, backend
        sc = cfg.scheduler
        max_seqs = seats(sc.max_num_seqs, cfg.runner.graph_batch_sizes, sc.max_num_batched_tokens)
        self.sched = DecodeScheduler(runner.block_manager(), max_seqs, cfg.model_config.eos_token_ids,
                                     runner.limits.context_cap)
        self.policy: StepPolicy = policy or default_policy(cfg, partition, self._rapid_inputs)
        self.has_prefill = "prefill" in self.policy.workers
        # A policy that reads no queue (`reads_waiting = False`) is told none: a prefix lookup per queued prompt
        # each step saved (ms a step with a thousand queued on a CPU core)
        self.reads_queue = bool(getattr(self.policy, "reads_waiting", True))
        # one that reads only the queue's head (`reads_queue_head`: DuetPolicy) is told only that: a lookup per prompt
        # in the first step's token budget, however long the queue (partition/shape.py ShapeState)
        self.queue_head = bool(getattr(self.policy, "reads_queue_head", False))
        self.step_tokens, self.ahead = sc.max_num_batched_tokens, sc.async_scheduling
        self.config = partition.current  # the configuration whose stream and graphs the steps use
        self.shape: StepShape = DecodeAlone(self.config)
        names = [c.name for c in partition.plan.configurations]
        self.fused_config = OVERALLOCATED if OVERALLOCATED in names else self.config  # a fused step: the whole GPU
        self.inflight: list[InFlight] = []  # launched, not recorded, oldest first (at most one between turns)
        self._launching: StepBatch | None = None
        self._out: list[m.TokenOut] = []  # the landed steps' tokens (StepCycle)
        self._first: list[m.TokenOut] = []  # first tokens from PrefillDone, sent at the publish after the next launch
        self._last_stats = 0.0
        self.tally = StepTally(cfg.partition.slo_itl_ms)  # the landed steps by kind, for Stats (engine/step_tally.py)
        self.trace = StepTrace(cfg.launch.step_trace) if cfg.launch.step_trace else None  # --step-trace
        self._stop = False
        self.grammar = GrammarBook.for_model(cfg.model, cfg.model_config.vocab_size, cfg.model_config.eos_token_ids,
                                            cfg.tokenizer)
        if runner.device.type != "cpu":  # the first constraint finds its tokenizer loaded
            self.grammar.warm()

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._stop:
                self.turn()
                if not self.io.others_alive():
                    return
            self.step_guarded(self._complete_all)  # the last steps' tokens go out before the worker ends
            self.publish()
        finally:  # a peer's death or an error too: the lines buffered since the last Stats (the process ends in
            if self.trace is not None:  # os._exit, which writes out nothing)
                self.trace.close()

    def turn(self) -> None:
        """One turn of the loop: messages, this step's shape, the step, what it produced."""
        for msg in self.io.drain():
            self.handle(msg)
        self.begin_step()
        s = self.sched
        work = bool(self.inflight or s.running or s.chunking or
                    (isinstance(self.shape, Fused) and self.shape.chunk_tokens and s.waiting))
        launched = self.step() if work else False
        self.publish()
        if not launched and not self.inflight:  # idle, or every request waits (a compile's end rings no doorbell)
            self.io.wait(self.grammar.idle_wait(IDLE_WAIT_S if not s.running else 0.0))

    def handle(self, msg: object) -> None:
        if isinstance(msg, m.NewRequest):
            if self.sched.add(msg):  # its grammar compiles off the loop meanwhile (`hold`)
                self.grammar.prepare(msg.req_id, msg.params.structured_outputs)
        elif isinstance(msg, m.PrefillDone):
            first = self.sched.prefill_done(msg)
            if first is not None:
                self._first.append(first)  # streamed with this loop's publish, once the next step is launched
        elif isinstance(msg, m.PrefillFailed):
            self.sched.prefill_failed(msg)
        elif isinstance(msg, m.Dropped):
            self.sched.dropped(msg.req_id)
        elif isinstance(msg, m.Abort):
            if self.sched.abort(msg.req_id):
                self.io.to_prefill.send(m.Drop(msg.req_id))
        elif isinstance(msg, m.Shutdown):
            self._stop = True

    # ---- the step's shape -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Ask the policy for this step's shape and carry out its configuration before admission, so prefill
        hears of a switch before the KVReady of the work it concerns (same ring, in order)."""
        state = self.sched.shape_state(self.shape, self.cfg.partition.slo_itl_ms, self.step_tokens, self.reads_queue,
                                       self.queue_head)
        shape = self.policy.decide(state)
        if isinstance(shape, Split) and not self.has_prefill:
            raise RuntimeError(f"step policy {self.policy.name!r} asked for a split step, but it runs without a "
                               f"prefill worker (its workers: {self.policy.workers})")
        self.shape = shape
        target = self.fused_config if isinstance(shape, Fused) else shape.config
        synced = False
        if target != self.config:
            last = getattr(self.policy, "last", None)  # a policy that explains its choice (DuetPolicy)
            synced = self._switch(target, f"{type(shape).__name__}: {last.reason}" if last is not None
                                  else type(shape).__name__)
        elif self.has_prefill and self.partition.hint_due():  # drift: a new step estimate alone never blocks
            p = self.partition
            if self.io.to_prefill.try_send(m.SetPartition(p.current, p.hint_ms)):
                p.sent_hint()
        if isinstance(shape, Split):
            if synced and self.inflight and self.sched.chunking:
                # the switch synchronized the stream the step in flight ran on: it has landed, so it is recorded now
                # (no look at its event) and a prompt whose last chunk it computed goes to prefill in this split
                self.step_guarded(self.record_early)
            self.admit()

    def _switch(self, target: str, why: str) -> bool:
        """Decode onto `target`'s configuration; True when the stream the steps in flight ran on was synchronized
        (a GPU's: they have landed)."""
        old = None
        if self.backend is not None:
            self.backend.stream(target, "decode")  # PartitionError naming the plan's configurations, if not one
            old = self.backend.stream(self.config, "decode")
        elif target not in (c.name for c in self.partition.plan.configurations):
            raise ValueError(f"step policy {self.policy.name!r} chose configuration {target!r}; this engine has "
                             f"{[c.name for c in self.partition.plan.configurations]}")
        if old is not None:
            # Stream ordering (module doc): the step in flight ran on the old stream; the next runs on the new.
            old.synchronize()
        self.partition.use(target, f"step shape {why}")  # the policy's manager may have moved there already
        LOG.info("decode on %s (was %s): %s", target, self.config, why)
        self.config = target
        if self.has_prefill:
            self.io.to_prefill.send(m.SetPartition(target, self.partition.sent_hint()))
        return old is not None

    def admit(self) -> None:
        """Prompts to the prefill worker (a split step): those chunked here whose chunks have landed, then the
        waiting ones."""
        handed = self.sched.admit(time.monotonic())
        for i, kv in enumerate(handed):
            # Decode never blocks on prefill: with prefill's inbox full the rest wait, and decode keeps
            # stepping and sending heartbeats, so a hung prefill is the one taken as hung.
            if not self.io.to_prefill.try_send(kv):
                self.sched.unadmit(handed[i:])
                return

    def _rapid_inputs(self) -> tuple[int, int, bool, PendingWork | None]:
        """What the rapid policy decides from (`DecodePartition.advance`)."""
        s = self.sched
        return len(s.running), s.mean_context(), s.has_pending, self._pending_work()

    def _pending_work(self) -> PendingWork | None:
        """Prompt tokens prefill has yet to compute (counted up to where it matters) and its longest prompt,
        for the rapid policy."""
        p = self.partition
        if not p.adaptive or p.pcfg.policy != "rapid":
            return None
        return self.sched.pending_work(p.prefill_tokens_cap)

    # ---- one step: a request never takes the worker down (engine/faults.py) -------------------
    def step(self) -> bool:
        """One step of the current shape; False when nothing was launched."""
        return self.step_guarded(self._step)

    def step_stream(self) -> torch.cuda.Stream | None:
        return self.backend.stream(self.config, "decode") if self.backend is not None else None

    def step_noted(self) -> None:
        self.partition.note_step()

    def step_timed(self, timing: StepTiming) -> None:
        self.tally.add(timing)

    def step_landed_early(self) -> None:
        self.publish(landed=True)  # the landed step's tokens go out before this step is planned (engine/step_cycle.py)

    def _await(self, done: torch.cuda.Event) -> None:
        """Wait for a step to land while serving the inbox: in a split step, a new request gets its blocks and
        goes to prefill at once when the partition would stay as it is with prefill pending
        (`keeps_with_prefill`; otherwise the next step boundary decides first, so prefill hears of a switch
        before the work it concerns). Other messages are handled as at the top of the loop (nothing here frees
        a block the in-flight step writes); first tokens from PrefillDone still stream once the step has
        landed, so the gap to the second token stays one step."""
        while not done.query():
            msgs = self.io.drain()
            if not msgs:
                time.sleep(AWAIT_POLL_S)
                continue
            for msg in msgs:
                self.handle(msg)
            s = self.sched
            if s.waiting and isinstance(self.shape, Split) and \
                    self.partition.keeps_with_prefill(len(s.running), s.mean_context(), self._pending_work()):
                self.admit()

    def publish(self, landed: bool = False) -> None:
        """What the steps produced, to the router. `landed`: a step recorded before this one's planning
        (`step_landed_early`): the first tokens from PrefillDone wait for the publish after this step's launch."""
        s = self.sched
        # penalty slots and matchers of requests no longer running (ended, preempted) are released; compiles: ended
        retain(self.runner, self.grammar, ((r.req_id, slot_key(r)) for r in s.running), known=s.reqs)
        out = self._out if landed else self._first + self._out
        if out:
            self.io.to_router.send(m.TokenBatch(out))
            self._out = []
            if not landed:
                self._first = []
        for fin in s.finished:
            self.io.to_router.send(fin)
        s.finished.clear()
        send_kv_events(self.io.to_router, s.blocks.events)  # the prefix cache's block events (--kv-events-config)
        now = time.monotonic()
        if now - self._last_stats >= self.cfg.launch.stats_interval_s:
            self._last_stats = now
            if self.trace is not None:
                self.trace.flush()
            p = self.partition
            self.io.to_router.try_send(s.stats(p.current, p.num_switches, p.steps, self.runner.tokens.in_use,
                                               self.tally.snapshot(), correction_ratios(self.policy)))


def default_policy(cfg: EngineConfig, partition: DecodePartition, rapid: RapidInputs) -> StepPolicy:
    """The policy of a decode worker with a prefill worker beside it: `--policy duet` runs DuetServe's adaptive
    policy (partition/policies.py: fused while the predicted step meets the ITL SLO, else split) where the plan
    can switch configurations, and with no ITL SLO (`--slo-itl-ms none`) on every plan (every step fused with the
    whole token budget: it never splits); `rapid` and `drift` (and duet with an SLO on a plan of one configuration)
    run today's partition manager as `AlwaysSplit`."""
    sc = cfg.scheduler
    if fused_steps(cfg, partition.plan):
        return make_step_policy(cfg, partition.plan)
    return AlwaysSplit(partition, sc.prefill_batch_tokens or sc.max_num_batched_tokens, rapid)


def fused_steps(cfg: EngineConfig, plan: PartitionPlan) -> bool:
    """Whether `default_policy` runs fused steps in the decode worker (DuetServe's adaptive policy): `--policy duet`
    with no ITL SLO, or with one on a plan that can switch configurations (a profile of several, the roofline's
    peaks measured). Pure."""
    p = cfg.partition
    return p.policy == "duet" and (p.slo_itl_ms is None or (plan.adaptive and plan.peaks is not None))


def fused_graph_key(cfg: EngineConfig, plan: PartitionPlan) -> str:
    """The configuration whose decode stream the fused steps run on (`DecodeWorker.fused_config`: the whole GPU,
    `overallocated`, where the plan has it, else the plan's initial one) when the decode worker runs any, for the
    piecewise prefill graphs of those steps (`PlanWire.fused_graphs`); "" when it runs none. Pure."""
    if not fused_steps(cfg, plan):
        return ""
    names = [c.name for c in plan.configurations]
    return OVERALLOCATED if OVERALLOCATED in names else plan.initial
