"""Every message that crosses a process boundary in the RAPID engine, as declared msgspec types.

Which message rides which ring is declared once, in `engine/worker_io.py:RING_TYPES`.

Request flow (docs/architecture.md): the router sends NewRequest to the decode worker only. Decode
allocates the prompt's blocks and hands the request to prefill in a KVReady; prefill computes the
prompt into those blocks, samples the first token and sends PrefillDone (carrying it) to decode,
which adds the request to its running batch and streams that token and the rest to the router; a
first token that already ends the request goes from prefill to the router at once. An abort goes
to decode only: if prefill holds the request, decode sends Drop and frees the blocks only when
prefill answers Dropped (or PrefillDone / PrefillFailed, if it got there first). Only decode
changes block tables.

Failure of one request: an exception while prefill computes or samples a request fails that
request alone (PrefillFailed -> decode frees its blocks -> Finished(reason="error") to the router);
the worker goes on serving. Liveness: every worker sends the router something at least every
`stats_interval_s` (decode and hybrid: Stats; prefill: Heartbeat); silence past the heartbeat bound
is taken as a hung worker. Shutdown reaches decode (or hybrid) as a message; prefill is stopped by
the router with SIGTERM, before decode, since decode owns the memory prefill uses.
"""

from __future__ import annotations

import msgspec

from rapidserve.kv_events import KVEvent
from rapidserve.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, tag=True, frozen=True):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # router's time.monotonic() at admission


class Abort(msgspec.Struct, tag=True, frozen=True):
    req_id: str


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    reason: str = ""


class PhaseTimes(msgspec.Struct, array_like=True, frozen=True):
    """Where a request's time to first token went, on the engine host's `time.monotonic()` (one clock for
    every process on the host): `admitted` when its KV blocks were allocated (rapid: the KVReady to
    prefill), `started` when its first prompt chunk was queued on the device, `sampled` when its first
    token reached the host. The router observes the phases (server/metrics.py) on the request's first token."""

    admitted: float
    started: float
    sampled: float


class KVReady(msgspec.Struct, tag=True, frozen=True):
    """Decode -> prefill: compute this request's tokens into these blocks.

    The request travels here (prefill hears of it from decode only, and forgets it once it has sent
    PrefillDone). `outputs` is empty for a first prefill; after a preemption by recompute it holds
    the outputs so far, which are computed after the prompt. `attempt` counts preemptions, so a
    stale PrefillDone of an earlier attempt is recognised. `computed_tokens` > `cached_tokens`: decode
    computed the prompt's first chunks itself in fused steps, then a split step handed the rest over
    (`DecodeScheduler.admit`); prefill computes from there, and still reports only `cached_tokens` as
    found in the prefix cache.
    """

    request: NewRequest
    block_ids: list[int]
    outputs: list[int] = []
    attempt: int = 0
    cached_tokens: int = 0  # leading tokens found in the prefix cache (the first token's usage reports them)
    admitted: float = 0.0  # decode's time.monotonic() when it allocated the blocks (PhaseTimes.admitted)
    # leading tokens already in the blocks: the cached ones, or more where decode's fused chunks wrote them (a
    # multiple of the block size); prefill computes the rest. 0: as many as cached_tokens
    computed_tokens: int = 0
    started: float | None = None  # decode queued the prompt's first fused chunk then (PhaseTimes.started), if it did

    @property
    def start_tokens(self) -> int:
        """Where prefill starts: the leading tokens whose K/V the blocks hold already."""
        return max(self.cached_tokens, self.computed_tokens)

    @property
    def req_id(self) -> str:
        return self.request.req_id


class Drop(msgspec.Struct, tag=True, frozen=True):
    """Decode -> prefill: forget this request; answer Dropped (or PrefillDone if already done)."""

    req_id: str


class SetPartition(msgspec.Struct, tag=True, frozen=True):
    """Decode -> prefill: switch to this compute partition configuration at the next forward.

    `decode_step_ms` (drift only): decode's predicted step beside prefill on that configuration, to
    which prefill sizes its layer blocks; None: no estimate (prefill uses the ITL SLO). Under drift it
    also comes alone, with the configuration unchanged, when the estimate changes."""

    config: str
    decode_step_ms: float | None = None


class Dropped(msgspec.Struct, tag=True, frozen=True):
    req_id: str


class TokenOut(msgspec.Struct, array_like=True, frozen=True):
    """One generated token; `index` is its position among the request's outputs (0 = first)."""

    req_id: str
    index: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None  # on a request's first token: prompt tokens found in the prefix cache
    times: PhaseTimes | None = None  # on a request's first token: where its time to first token went
    rank: int | None = None  # with logprob: the token's rank among the vocabulary (1: the most likely)


class PrefillDone(msgspec.Struct, tag=True, frozen=True):
    """Prefill -> decode: the prompt is in the KV blocks and `token` is the next token, sampled.

    Decode streams `token` when the request joins its batch, so the client's gap to the following
    token is one decode step (as in vLLM's P/D disaggregation, where the decode side streams every
    token). A token with a `finish_reason` ends the request: prefill has sent it to the router already."""

    req_id: str
    attempt: int
    token: TokenOut


class PrefillFailed(msgspec.Struct, tag=True, frozen=True):
    """Prefill -> decode: computing or sampling this request raised; decode ends it with an error
    (and frees its blocks: prefill writes no more into them)."""

    req_id: str
    attempt: int
    message: str
    fault: str = ""  # as Finished.fault


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    """Prefill -> router, every `stats_interval_s` while its loop turns: it is alive."""

    worker: str
    queued: int = 0  # prompts waiting for or in prefill
    staging_in_use: int = 0  # disagg: blocks of the prefill instance's own staging pool held by its jobs
    preemptions: int = 0  # drift: prefill batches preempted so far by a short request (each resumed later)


class TokenBatch(msgspec.Struct, tag=True, frozen=True):
    tokens: list[TokenOut]


STRUCTURED_FAULT = "structured_outputs"  # Finished.fault: the grammar engine could not serve the constraint


class Finished(msgspec.Struct, tag=True, frozen=True):
    """Decode -> router: the request is over and its blocks are free (abort acknowledged, error...)."""

    req_id: str
    reason: str  # "stop" | "length" | "abort" | "error"
    message: str = ""
    # with "error": STRUCTURED_FAULT when the request's constraint could not be served (its own fault: the
    # server answers 400), "" for a failure of the engine (503)
    fault: str = ""


# The keys of `Stats.step_kinds`: a step's shape as its policy chose it (engine/step_tally.py says which is which)
STEP_KINDS: tuple[str, ...] = ("fused", "fused_decode", "split", "alone")


class StepKindStats(msgspec.Struct, frozen=True):
    """One kind of step's counts in `Stats.step_kinds`, cumulative since the worker started (engine/step_tally.py
    says which kinds there are and how a step is counted): landed steps, their measured time (ms), how many took
    longer than the ITL SLO, and over the steps that had a prediction (the policy's raw cost-model figure,
    `StepTiming.predicted_ms`) the predictions' sum and those same steps' measured sum, whose ratio is how far off
    the model was. Then what the host saw (`StepTiming.gap_ms`, `idle_ms`): the token gaps that ended at steps of
    this kind (count, their sum in ms, those longer than the ITL SLO), the device's idle time before them and the
    host's time to plan and launch them (ms)."""

    steps: int = 0
    measured_ms: float = 0.0
    over_slo: int = 0
    predicted_ms: float = 0.0
    predicted_measured_ms: float = 0.0
    gaps: int = 0
    gap_ms: float = 0.0
    gaps_over_slo: int = 0
    idle_ms: float = 0.0
    host_ms: float = 0.0


class Stats(msgspec.Struct, tag=True, frozen=True):
    num_running: int
    num_waiting: int
    num_prefilling: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    partition: str = "none"
    partition_switches: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache so far
    prefix_cache_hits: int = 0  # of those, tokens found
    partition_steps: dict[str, int] = {}  # decode steps launched so far, per compute partition configuration
    token_slots: int = 0  # penalty / bad-word slots in use on the device (logit_controls.py)
    step_kinds: dict[str, StepKindStats] = {}  # landed steps per shape kind, cumulative (engine/step_tally.py)
    # the policy's online correction now, measured / predicted per correction kind (partition/correction.py): gauges;
    # empty when the policy corrects nothing
    step_correction: dict[str, float] = {}
    # prompts whose first chunks this worker computed in fused steps and whose rest a split step handed to the prefill
    # worker (DecodeScheduler.hand_over), cumulative; an un-admitted hand-over (prefill's inbox full) is not counted
    num_hand_overs: int = 0


class KVEvents(msgspec.Struct, tag=True, frozen=True):
    """Decode (every mode's step loop, hybrid's lone worker too) -> router, with --kv-events-config: the prefix
    cache's block events since the last (rapidserve/kv_events.py), in order; the router publishes them for KV-aware
    routers (engine/kv_publisher.py)."""

    events: list[KVEvent]


class Ready(msgspec.Struct, tag=True, frozen=True):
    worker: str  # "decode" | "prefill"
    pid: int
    info: dict[str, str] = {}


class WorkerError(msgspec.Struct, tag=True, frozen=True):
    worker: str
    message: str


ALL_MESSAGES: tuple[type[msgspec.Struct], ...] = (
    NewRequest, Abort, Shutdown, KVReady, Drop, SetPartition, PrefillDone, PrefillFailed, Dropped, Heartbeat,
    TokenBatch, Finished, Stats, KVEvents, Ready, WorkerError,
)
