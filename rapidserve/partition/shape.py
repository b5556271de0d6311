"""The shape of one engine step, chosen at each step boundary (DuetServe's design, arXiv 2511.04791).

One engine serves every policy. At each step boundary the decode worker (the KV pool's owner, which
knows the decode batch, the pending prompts and the ITL SLO) asks its `StepPolicy` for one of:

* `Fused(chunk_tokens)`: one mixed step in the decode worker, the running decodes plus prompt chunks
  of at most `chunk_tokens` tokens (an SLO-aware budget: the predicted step meets the ITL SLO). The
  decode rows ride on the prefill's weight reads: the throughput shape.
* `Split(config, prefill_batch_tokens, lookahead)`: decode-only steps on `config`'s share of the GPU
  (`lookahead` decode steps per launch where the worker supports it) beside the prefill worker's forward
  on the rest; admitted prompts go to the prefill worker (`KVReady`) in batches of at most
  `prefill_batch_tokens`. The shape when a fused step would break the SLO.
* `DecodeAlone(config)`: decode steps only, no prompt work this step (nothing pending, or the prefill
  worker still holds prompts handed to it earlier and runs them on the rest of a split).

The policies (partition/policies.py) are pure: `decide(ShapeState) -> StepShape`, tested with tables of
cases on CPU. The worker carries a decision out and feeds back the measured step times
(`observe`), from which a policy may correct its cost model online.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from rapidserve.partition.policy import WaitingPrefill

OVERALLOCATED = "overallocated"  # the whole GPU for one phase (partition/backend.py's name for it)


@dataclass(frozen=True)
class Fused:
    chunk_tokens: int  # prompt tokens this mixed step may take (0: a decode-only step on the whole GPU)

    def __post_init__(self) -> None:
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens={self.chunk_tokens} must be >= 0")


@dataclass(frozen=True)
class Split:
    config: str  # the partition configuration: decode on its share, the prefill worker on the rest
    prefill_batch_tokens: int  # tokens of one prefill-worker batch
    lookahead: int = 1  # decode steps per launch (DuetServe's k)

    def __post_init__(self) -> None:
        if self.prefill_batch_tokens < 1 or self.lookahead < 1:
            raise ValueError(f"prefill_batch_tokens={self.prefill_batch_tokens} and lookahead={self.lookahead} "
                             "must be >= 1")


@dataclass(frozen=True)
class DecodeAlone:
    config: str = OVERALLOCATED  # decode's configuration (the whole GPU unless the prefill worker still runs)


StepShape = Fused | Split | DecodeAlone


@dataclass(frozen=True)
class ShapeState:
    """What a policy is told at one step boundary.

    `waiting` may be only the head of the queue, for a policy that says it reads no further
    (`reads_queue_head = True`, an optional attribute of a `StepPolicy`; absent: False): then it is
    `queue_head(queue, max_chunk_tokens)` (the worker builds it lazily: engine/decode_views.py `pending_prefill`).
    What such a policy may rely on, and all it may read: `pending_tokens` is the whole queue's when that is at
    most `max_chunk_tokens` and above `max_chunk_tokens` otherwise (so `min(max_chunk_tokens, pending_tokens)` and
    whether a chunk of at most `max_chunk_tokens` finishes every pending prompt are the whole queue's), and the
    first `max_chunk_tokens` tokens of the queue are listed as in the whole one (partition/policies.py `chunks`)."""

    decode_contexts: tuple[int, ...]  # each running request's context (tokens in the cache)
    waiting: tuple[WaitingPrefill, ...]  # admitted-or-waiting prompt work not yet computed, arrival order
    prefill_worker_tokens: int  # prompt tokens handed to the prefill worker and not yet done (0: it is idle)
    current: StepShape  # the shape of the step before
    slo_itl_ms: float | None  # None: no ITL SLO, maximise throughput
    max_chunk_tokens: int  # the most prompt tokens one step may take (--max-num-batched-tokens)

    def __post_init__(self) -> None:
        if self.prefill_worker_tokens < 0 or self.max_chunk_tokens < 1:
            raise ValueError("prefill_worker_tokens must be >= 0 and max_chunk_tokens >= 1")
        if self.slo_itl_ms is not None and self.slo_itl_ms <= 0:
            raise ValueError(f"slo_itl_ms={self.slo_itl_ms} must be positive (or None: no SLO)")

    @property
    def pending_tokens(self) -> int:
        return sum(w.tokens for w in self.waiting)


def queue_head(waiting: Iterable[WaitingPrefill], tokens: int) -> tuple[WaitingPrefill, ...]:
    """The head of a queue in arrival order: its entries up to and including the one whose tokens take their sum
    past `tokens` (all of them when their sum is at most `tokens`). `waiting` is read no further than that, so a
    lazily made queue's later entries are never made. Pure."""
    out: list[WaitingPrefill] = []
    total = 0
    for w in waiting:
        out.append(w)
        total += w.tokens
        if total > tokens:
            break
    return tuple(out)


@dataclass(frozen=True)
class StepTiming:
    """A landed step, as measured by the worker: what the policy predicted and what it took."""

    shape: StepShape
    decode_batch: int
    chunk_tokens: int  # prompt tokens in the step (fused) or 0
    predicted_ms: float | None
    measured_ms: float
    # what the worker's host saw around the step (engine/step_cycle.py `Landed`; None where it could not tell):
    # the token gap it made (from the previous landed step's recording to this one's, when a request decoded in
    # both: the gap its stream got, host time included), the device's idle time before it (the previous step's
    # end to this one's start, on a GPU) and the host's time to plan and launch it
    gap_ms: float | None = None
    idle_ms: float | None = None
    host_ms: float | None = None  # the host's time to plan and launch the step (wall time: it runs beside the device)
    # the prediction the policy compared with the SLO (its raw one times its correction then), where it made one
    planned_ms: float | None = None


class StepPolicy(Protocol):
    """A policy of the one engine. `workers`: the processes it needs ("decode", or "decode" and "prefill");
    `decide` is pure given the policy's own state; `observe` feeds back a landed step's time."""

    name: str
    workers: tuple[str, ...]

    def decide(self, state: ShapeState) -> StepShape: ...

    def observe(self, timing: StepTiming) -> None: ...
