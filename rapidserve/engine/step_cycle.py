"""The plan -> launch -> complete cycle of the one step loop: what the decode worker (engine/decode_worker.py) and
the in-process engine behind `LLM` (rapidserve/core.py) share.

`StepCycle` runs steps over a `DecodeScheduler` (the decisions: engine/decode_scheduler.py), a `ModelRunner`, a
`GrammarBook` and a `StepPolicy`, with no I/O of its own. Its owner sets the attributes below, sets `shape` (its
policy's answer) before each step, and publishes what the steps produced: the landed tokens collect in `_out`
(`TokenOut`, in step order), the requests that ended otherwise in `sched.finished`. One step (`_step`, run through
`step_guarded`): plan it (`DecodeScheduler.plan` for a `Fused` shape, `schedule` for a decode-only one; with a step
in flight the pool is not quiet, and a plan that must preempt waits for that step to land), launch it on the
owner's stream (engine/step_launch.py), then record the step before it (`ahead`, `SchedulerConfig.async_scheduling`:
one step in flight between steps) or this one, and give each landed step's time to the policy (`observe`).

The order, scheduling ahead. While the device is the bottleneck (its step takes longer than the host's turn) the
step in flight, N, is still running when step N+1 is planned, so N+1 is planned and launched first (its decode rows
fed N's tokens on the device, `runner.Carry`) and N is recorded as soon as it lands, with N+1 queued behind it: the
device never waits for the host. When the host is late (a turn longer than the device's step: a long queue, a
collector pause, a burst of arrivals), N has landed before N+1 is planned; recording it only after N+1's planning
and launch would hold its tokens back by that much for nothing (the device is idle either way). So a step in flight
whose end event has completed (`InFlight.landed`: a GPU's, asked without waiting) is recorded first and handed to
the owner (`step_landed_early`: the decode worker publishes its tokens then), and N+1 is planned with nothing in
flight, as `--no-async-scheduling` plans every step; the step after it is planned ahead again. On the CPU a step is
done when its launch returns (no event), and the order stays the ahead one. Recording N before N+1 is planned, never
between N+1's planning and its launch, keeps the block rule: a request that N ends is not in N+1, and its blocks
are freed only once nothing launched writes them (engine/decode_scheduler.py).

Hooks an owner may override: `step_stream` (the stream a step is queued on; default the current one),
`step_noted` (a step was queued), `step_timed` (a step landed: its `StepTiming`, after the policy's `observe`),
`step_landed_early` (the step in flight was recorded before this one's planning: publish it now),
`_await` (wait for a step to land; the worker serves its inbox meanwhile) and
`step_failed` (after a failed step was cleaned up: the worker goes on, `LLM`'s engine raises what is not a row's
own constraint failure).

Faults (engine/faults.py): rows whose sampling or constraint fails end alone; a fused step that raises at launch
fails the requests whose prompt chunks were in it (its decodes are planned again); any other error (the device
still usable) fails every running request and the steps in flight. A fatal error is raised as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

from rapidserve.engine import messages as m
from rapidserve.engine.decode_scheduler import DecodeScheduler, StepBatch
from rapidserve.engine.faults import RequestsFailed, describe, is_fatal
from rapidserve.engine.step_launch import InFlight, landed_rows, launch_step
from rapidserve.engine.step_tally import correction_ratios
from rapidserve.engine.step_trace import StepTrace
from rapidserve.partition.backend import on_stream
from rapidserve.partition.shape import Fused, StepPolicy, StepShape, StepTiming
from rapidserve.runner import ModelRunner
from rapidserve.structured import GrammarBook

# How a step was launched (`InFlight.launch`, for --step-trace): behind the step in flight (the device never waits for
# the host); after the step in flight had landed before this one was planned (the host late: recorded early); after a
# plan that needed a quiet pool waited for the step in flight (a preemption); with nothing in flight (the first step
# after an idle loop, or every step under --no-async-scheduling). All but the first may leave the device idle for the
# host's planning and launch: the bubbles a gap over the SLO with no step over it is made of.
AHEAD, LANDED, QUIET_POOL, IDLE = "ahead", "landed", "quiet-pool", "idle"
LAUNCHES = (AHEAD, LANDED, QUIET_POOL, IDLE)


class StepCycle:
    runner: ModelRunner
    sched: DecodeScheduler
    grammar: GrammarBook
    policy: StepPolicy
    shape: StepShape  # this step's, as the policy decided it
    config: str  # the graph key of the configuration the steps run on
    step_tokens: int  # a step's token budget (--max-num-batched-tokens)
    ahead: bool  # launch a step before the one in flight is recorded (async scheduling)
    inflight: list[InFlight]  # launched, not recorded, oldest first (at most one between steps)
    _launching: StepBatch | None  # the batch being launched (a failure at launch blames its chunks)
    _out: list[m.TokenOut]  # landed tokens, for the owner to publish
    _landed: Landed | None = None  # the last step recorded (for the next one's gap and idle time)
    _early: bool = False  # the owner recorded the step in flight before this step's turn (`record_early`)
    trace: StepTrace | None = None  # --step-trace: every landed step, a line each (engine/step_trace.py)

    # ---- hooks ----------------------------------------------------------------------------------
    def step_stream(self) -> torch.cuda.Stream | None:
        """The stream this step is queued on (None: the current one)."""
        return None

    def step_noted(self) -> None:
        """A step was queued."""

    def step_timed(self, timing: StepTiming) -> None:
        """A step landed; `timing` is what the policy was just told of it (`observe`)."""

    def step_landed_early(self) -> None:
        """The step in flight had landed before this one was planned and was recorded then: what it produced (`_out`,
        `sched.finished`) may go out now, ahead of this step's planning and launch."""

    def _await(self, done: torch.cuda.Event) -> None:
        """Wait for a step to land."""
        done.synchronize()

    def step_failed(self, error: BaseException) -> None:
        """A step failed with `error` and the requests it concerned were failed (the steps in flight cleaned up)."""

    # ---- one step -------------------------------------------------------------------------------
    def step_guarded(self, fn: Callable[[], bool]) -> bool:
        """`fn()` (a step, or recording what is in flight). Rows whose sampling raises fail alone; a fused step
        that raises at launch fails the requests whose prompt chunks were in it (its decodes are planned again);
        any other error (device still usable) fails every running request and the steps in flight."""
        error: BaseException
        try:
            try:
                return fn()
            except RequestsFailed as e:
                self._launching = None
                self.runner.synchronize()  # the failed step's forward may still write the blocks freed below
                for req, why, fault in e.blame("sampling"):  # each row its own message and fault (faults.py)
                    self.sched.fail([req], why, fault)
                self._complete_all()
                error = e.error
        except Exception as e:  # noqa: BLE001 - the blamed requests fail, the loop lives
            if is_fatal(e):
                raise
            self.runner.synchronize()  # nothing in flight writes the blocks freed below
            batch, self._launching = self._launching, None
            if batch is not None and batch.chunks:
                self.sched.fail([c.req for c in batch.chunks], describe(e, "step"))
            else:
                inflight, self.inflight = self.inflight, []
                self.sched.fail_batch([r for f in inflight for r in f.requests], describe(e, "decode step"))
            error = e
        self.step_failed(error)
        return False

    def _step(self) -> bool:
        """Plan and launch this step, then record the one before it (or, waiting for each step, this one). A step in
        flight that has landed already is recorded first, and handed to the owner (`step_landed_early`), before this
        step is planned (module docstring: the order)."""
        how = LANDED if self._early else AHEAD
        self._early = False
        if self.inflight and self.inflight[-1].landed:
            self._complete_all()
            self.step_landed_early()
            how = LANDED
        t0 = time.perf_counter()
        hold = self.grammar.compiling()  # requests whose grammar still compiles sit this step out
        batch = self._plan(hold)
        if batch is None:
            self._complete_all()  # preemption needs a quiet pool: let the step in flight land first
            batch = self._plan(hold)
            assert batch is not None
            how = QUIET_POOL
        if not batch:
            self._complete_all()
            return False
        now = time.monotonic()
        prev = self.inflight[-1] if self.inflight else None
        if prev is None and how == AHEAD:
            how = IDLE  # nothing was in flight to launch behind
        self._launching = batch
        with on_stream(self.step_stream()):
            f = launch_step(self.runner, self.grammar, self.sched.eos, self.sched.blocks.table, batch, prev,
                            self.config, self.shape)
        self._launching = None
        # what the policy predicted for this step (DuetPolicy.last.model_ms), fed back with its measured time, and
        # what it planned it at (corrected: `predicted_ms` of its decision), for the step trace
        last = getattr(self.policy, "last", None)
        f.predicted_ms = getattr(last, "model_ms", None)
        f.planned_ms = getattr(last, "predicted_ms", None)
        f.host_ms = (time.perf_counter() - t0) * 1e3
        if self.trace is not None:  # the contexts the rows attend to: their counts once recorded are one more each
            f.context_sum = sum(r.tokens_needed for r in batch.decode)
            f.launch = how
        self.sched.launched(batch, now)
        self.step_noted()
        self.inflight.append(f)
        while len(self.inflight) > (1 if self.ahead else 0):
            self._complete()
        return True

    def record_early(self) -> bool:
        """Record the steps in flight, which the owner knows have landed (it synchronized their stream), and hand them
        over (`step_landed_early`); the next step's trace says `landed`, as `_step`'s own early record does."""
        self._complete_all()
        self.step_landed_early()
        self._early = True
        return False

    def _plan(self, hold: AbstractSet[str]) -> StepBatch | None:
        quiet = not self.inflight
        if isinstance(self.shape, Fused):
            return self.sched.plan(self.shape.chunk_tokens, self.step_tokens, quiet, hold, time.monotonic())
        decode = self.sched.schedule(quiet, hold)
        return None if decode is None else StepBatch(decode)

    def _complete_all(self) -> bool:
        while self.inflight:
            self._complete()
        return False

    def _complete(self) -> None:
        """Record the oldest step in flight: its tokens, stops, what finished freed, its time fed back."""
        f = self.inflight[0]  # dropped only once recorded: if this raises, `step_guarded` still sees its requests
        if f.done is not None:
            self._await(f.done)
        rows = landed_rows(f)
        self.inflight.pop(0)
        now = time.monotonic()
        self._out += self.sched.record(f.sampled, rows, now)
        self.sched.chunks_landed(f.batch.chunks)
        gap, idle = self._landed.next(f, now) if self._landed is not None else (None, None)
        self._landed = Landed.of(f, now)
        timing = StepTiming(f.shape, len(f.batch.decode), f.batch.chunk_tokens, f.predicted_ms,
                            f.clock.elapsed_ms(), gap, idle, f.host_ms, f.planned_ms)
        self.policy.observe(timing)
        if self.trace is not None:
            self.trace.add(f.batch, f.context_sum, f.launch, timing, correction_ratios(self.policy), now)
        self.step_timed(timing)


@dataclass(frozen=True)
class Landed:
    """The last recorded step, as the next one's `StepTiming.gap_ms` and `idle_ms` need it: when the host recorded
    it (its tokens go out with the turn's publish, right after), which requests it decoded, and its end event (a
    GPU's; None on the CPU).

    gap: the host time from this record to the next step's, counted when a request decoded in both (so it is a
    gap that request's stream got; a step after an idle loop, or whose decodes all joined since, has none). It
    holds the device time of the next step, the device's idle time before it and how late the host recorded it
    (a launch, an inbox served, a policy decision before it noticed the step had landed).
    idle: the device's time between this step's end and the next step's start events (host-bound bubbles: a step
    launched one ahead has none; a switch of configuration synchronizes, so the bubble is real there too)."""

    at: float
    decoded: frozenset[int]
    end: torch.cuda.Event | None

    @classmethod
    def of(cls, f: InFlight, at: float) -> Landed:
        return cls(at, frozenset(id(r) for r in f.batch.decode), f.clock.end)

    def next(self, f: InFlight, at: float) -> tuple[float | None, float | None]:
        """(gap_ms, idle_ms) of step `f`, recorded at `at`, after this one."""
        gap = (at - self.at) * 1e3 if any(id(r) in self.decoded for r in f.batch.decode) else None
        start = f.clock.start
        idle = None
        if self.end is not None and start is not None:
            idle = max(0.0, float(self.end.elapsed_time(start)))
        return gap, idle

