"""EngineCore: the engine behind `rapidserve.LLM`, in this process: the one step loop without its worker's I/O.

It is hybrid mode's engine run in place: the decode worker's step cycle (engine/step_cycle.py) over the same
`DecodeScheduler` (engine/decode_scheduler.py: admission, prefix cache, chunking, growth, preemption by recompute,
stops, block ownership) with the `AlwaysFused` policy: every step decodes each running request and fills the rest
of `max_num_batched_tokens` with prompt chunks in arrival order; there is no prefill worker. Steps are launched one
ahead (`SchedulerConfig.async_scheduling`, the default) as in the worker. A request goes in (`add`) as the
`NewRequest` record the worker's scheduler takes; each `step()` plans and launches a step, records the one before it
and returns a `TokenEvent` per token that landed and per request that ended without one.

Each request's results collect in its `Generation` (its tokens are its scheduler record's `outputs`, which hold
exactly the tokens that landed for it). Stop strings need the text: `text_stop` (LLM's) is asked after every token
that ends nothing, and a hit ends the request as "stop" (aborted in the scheduler: a token of it still in flight is
dropped and its blocks are freed once that step has landed, as for any request that ends while a step runs).

Structured outputs: a request's grammar starts compiling in the background at `add` (`LLM.generate` first compiles
and tries each constraint, `check_constraint`, through the same grammar cache, so nothing is compiled twice); a
request whose grammar still compiles sits out the steps that would sample it, as in the worker. A constraint that
fails later (its matcher errs or rejects a token) ends its request alone with finish reason "error" and the message
in its TokenEvent, never with its output unconstrained. Any other failure of a step ends the requests it concerned,
as in the worker, and is then raised to the caller (`LLM.generate` aborts the rest of its requests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rapidserve.batch_limits import seats
from rapidserve.block_manager import BlockManager
from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.decode_request import DecodeRequest
from rapidserve.engine.decode_scheduler import DecodeScheduler
from rapidserve.engine.sampling_step import retain
from rapidserve.engine.step_cycle import StepCycle
from rapidserve.engine.step_launch import slot_key
from rapidserve.loader import ModelSource, load_hf_tokenizer
from rapidserve.partition.shape import Fused, StepShape
from rapidserve.partition.step_policies import AlwaysFused
from rapidserve.runner import ModelRunner
from rapidserve.runner.prefill_graphs import PREFILL_WORKER_MAX_BUCKET
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.structured import GrammarBook, GrammarError

GRAPH_KEY = "default"  # the graphs' key: one configuration, the current stream


@dataclass(eq=False)
class Generation:
    """One sample of a request as `LLM` reads it: its scheduler record and what the landed tokens carried."""

    req: DecodeRequest
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_ranks: list[int | None] = field(default_factory=list)  # each chosen token's rank, with its logprob
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_cached_tokens: int = 0  # prompt tokens its first token found in the prefix cache

    @property
    def seq_id(self) -> str:
        return self.req.req_id

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens that landed for it, in order (its scheduler record's outputs)."""
        return self.req.outputs

    @property
    def num_tokens(self) -> int:
        return self.req.num_tokens

    @property
    def num_computed(self) -> int:
        """While its prompt is chunked: the tokens computed or queued so far (its cached prefix included)."""
        return self.req.computed

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class TokenEvent:
    """A token that landed for `seq` (`token_id`), or its end without one (`token_id` -1: it failed)."""

    seq: Generation
    token_id: int
    finish_reason: str | None
    message: str = ""  # why, when finish_reason is "error"


class EngineCore(StepCycle):
    def __init__(self, cfg: EngineConfig, source: ModelSource, show_progress: bool = True,
                 eos_token_ids: tuple[int, ...] | None = None,
                 text_stop: Callable[[Generation], str | None] | None = None) -> None:
        """`eos_token_ids`: the ids that end a request (default: the model's; `LLM` adds its tokenizer's);
        `text_stop`: the stop check on the text (stop strings), returning a finish reason or None."""
        self.cfg = cfg
        self.runner = ModelRunner(cfg, source, show_progress=show_progress)
        self.runner.capture_decode_graphs(show_progress=show_progress, key=GRAPH_KEY)
        # offline: no stream waits on a step's tokens, so the larger buckets a server's fused steps capture buy nothing
        self.runner.capture_prefill_graphs(show_progress=show_progress, key=GRAPH_KEY,
                                           max_bucket=PREFILL_WORKER_MAX_BUCKET)
        self.limits = self.runner.limits  # the prompt check (rapidserve/prompt.py) and the context cap
        self.eos_token_ids = eos_token_ids or cfg.model_config.eos_token_ids
        sc = cfg.scheduler
        self.sched = DecodeScheduler(self.runner.block_manager(), seats(sc.max_num_seqs, cfg.runner.graph_batch_sizes,
                                     sc.max_num_batched_tokens), self.eos_token_ids, self.limits.context_cap)
        self.grammar = GrammarBook(lambda: load_hf_tokenizer(source), cfg.model_config.vocab_size,
                                   self.eos_token_ids)
        self.policy = AlwaysFused()
        self.shape: StepShape = Fused(0)
        self.config, self.step_tokens, self.ahead = GRAPH_KEY, sc.max_num_batched_tokens, sc.async_scheduling
        self.inflight, self._launching, self._out = [], None, []
        self.text_stop = text_stop
        self._live: dict[str, Generation] = {}  # requests not yet ended, by id

    @property
    def blocks(self) -> BlockManager:
        return self.sched.blocks

    @property
    def num_preemptions(self) -> int:
        return self.sched.num_preemptions

    @property
    def has_work(self) -> bool:
        """Requests not yet ended, or steps not yet recorded."""
        return bool(self.sched.reqs or self.inflight)

    def check_constraint(self, so: StructuredOutputs) -> None:
        """ValueError naming the field when the grammar engine cannot serve `so` (compiled and tried here,
        through the grammar cache: a request of it then finds it compiled, or remembered as failed)."""
        try:
            self.grammar.cache.compile(so)
        except GrammarError as e:
            raise ValueError(f"structured_outputs.{so.kind}: {e}") from None

    # ---- requests in ----------------------------------------------------------------------------
    def add(self, seq_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Generation:
        """Queue a request (ValueError naming what is wrong with its prompt or parameters, or an id in use)."""
        self.limits.check(prompt_token_ids)  # PromptError (a ValueError) naming what is wrong
        self.limits.check_params(params)
        if seq_id in self.sched.reqs:
            raise ValueError(f"request id {seq_id!r} is still in flight: use unique ids")
        self.sched.add(m.NewRequest(seq_id, list(prompt_token_ids), params, time.monotonic()))
        gen = Generation(self.sched.reqs[seq_id])
        self._live[seq_id] = gen
        self.grammar.prepare(seq_id, params.structured_outputs)  # compiles in the background meanwhile
        return gen

    def abort(self, seq: Generation) -> None:
        """End the request now (no event): its blocks are freed once no step in flight writes them."""
        if self._live.pop(seq.seq_id, None) is None:
            return
        seq.finish_reason = "abort"
        self.sched.abort(seq.seq_id)
        self.grammar.release(seq.seq_id)
        self._retain()

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Plan and launch a step (its shape: `AlwaysFused`), record the one before it; what landed and what
        ended. Waits a little instead while every request left waits for its grammar's compile."""
        s = self.sched
        self.shape = self.policy.decide(s.shape_state(self.shape, None, self.step_tokens, queue=False))
        work = bool(self.inflight or s.running or s.chunking or s.waiting)
        launched = self.step_guarded(self._step) if work else False
        events = self._events()
        self._retain()
        if not launched and not self.inflight and s.waiting:
            time.sleep(self.grammar.idle_wait(0.0))  # a compile's end: nothing to wake us but time
        return events

    def step_failed(self, error: BaseException) -> None:
        """A row's constraint failure ends that request alone; any other failure (its requests ended, as in the
        worker) is raised to the caller."""
        if not isinstance(error, GrammarError):
            raise error

    def _events(self) -> list[TokenEvent]:
        """The landed tokens (stop strings checked), then the requests that ended without a token."""
        events: list[TokenEvent] = []
        for t in self._out:
            gen = self._live.get(t.req_id)
            if gen is None:
                continue
            if t.logprob is not None:
                gen.output_logprobs.append(t.logprob)
                gen.output_ranks.append(t.rank)
            if t.top_logprobs is not None:
                gen.output_top_logprobs.append(t.top_logprobs)
            if t.cached_tokens is not None:
                gen.num_cached_tokens = t.cached_tokens
            reason = t.finish_reason
            if reason is None and self.text_stop is not None:
                reason = self.text_stop(gen)
                if reason is not None:
                    self.sched.abort(t.req_id)  # its Finished("abort") is dropped below: it ended here
            if reason is not None:
                gen.finish_reason = reason
                del self._live[t.req_id]
            events.append(TokenEvent(gen, t.token_id, reason))
        self._out = []
        for f in self.sched.finished:
            gen = self._live.pop(f.req_id, None)
            if gen is not None:
                gen.finish_reason = f.reason
                events.append(TokenEvent(gen, -1, f.reason, f.message))
        self.sched.finished.clear()
        return events

    def _retain(self) -> None:
        """Free the penalty slots and matchers of requests no longer running (ended, preempted) and the compile
        states of requests the scheduler no longer knows."""
        s = self.sched
        retain(self.runner, self.grammar, ((r.req_id, slot_key(r)) for r in s.running), known=s.reqs)
