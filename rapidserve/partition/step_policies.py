"""The step policies the engine carries out today (partition/shape.py's `StepPolicy`), and a scripted one for tests.

- `AlwaysFused` (`--mode hybrid`): every step fused, the running decodes plus prompt chunks in the rest of
  `--max-num-batched-tokens` (Sarathi-Serve / vLLM chunked prefill); no prefill worker.
- `AlwaysSplit` (`--mode rapid` and disagg, `--policy rapid|duet|drift`): every step split, decode-only
  steps on the configuration today's partition manager picks (`DecodePartition.advance`, `advance_duet`,
  `advance_drift`: the same calls with the same inputs as before the one engine), prompts handed to the
  prefill worker. It is the manager's adapter: `decide` moves the manager's own state (hysteresis, switch
  history), as each step boundary did before.
- `ScriptedPolicy` (tests): the shapes of a list, or of a function of the call count and the state, so a
  test forces fused -> split -> fused transitions where it wants them.
A policy may say it reads no queue (`reads_waiting = False`, an optional attribute; absent: True): the worker
then leaves `ShapeState.waiting` empty rather than look up every queued prompt's cached prefix each step.
The adaptive policy (DuetServe's: fused while the predicted step meets the ITL SLO, else split) is
partition/policies.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rapidserve.partition.policy import PendingWork
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import Fused, ShapeState, Split, StepShape, StepTiming

# The rapid policy's inputs, read from the decode scheduler as before the one engine (`DecodePartition.advance`):
# running requests, their mean context (tokens in the cache, the token in flight not counted), whether prompt
# work is pending, and the pending work counted up to the policy's cap (None: not asked).
RapidInputs = Callable[[], tuple[int, int, bool, PendingWork | None]]


class AlwaysFused:
    """Every step fused: decodes first, prompt chunks in what is left of the step's token budget (`max_chunk_tokens`,
    i.e. --max-num-batched-tokens, so a step never exceeds the largest forward the KV pool was sized after)."""

    name = "fused"
    workers: tuple[str, ...] = ("decode",)
    reads_waiting = False  # the worker may leave `ShapeState.waiting` empty (decode_views.shape_state)

    def decide(self, state: ShapeState) -> StepShape:
        return Fused(max(0, state.max_chunk_tokens - len(state.decode_contexts)))

    def observe(self, timing: StepTiming) -> None:
        """Nothing to learn: the shape never changes."""


class AlwaysSplit:
    """Every step split: the partition manager's configuration (`--policy rapid|duet|drift`), prompts to the
    prefill worker in batches of `prefill_batch_tokens` (the prefill worker's own --prefill-batch-tokens: it is
    not sent per step). `lookahead` stays 1: one decode step per launch."""

    workers: tuple[str, ...] = ("decode", "prefill")

    def __init__(self, partition: DecodePartition, prefill_batch_tokens: int, rapid: RapidInputs) -> None:
        self.partition, self.prefill_batch_tokens, self.rapid = partition, prefill_batch_tokens, rapid
        self.name = f"split ({partition.pcfg.policy})"
        self.reads_waiting = partition.pcfg.policy in ("duet", "drift")  # rapid reads the scheduler's `rapid`

    def decide(self, state: ShapeState) -> StepShape:
        p = self.partition
        if p.pcfg.policy == "duet":
            p.advance_duet(state.decode_contexts, state.waiting)
        elif p.pcfg.policy == "drift":  # prefill sizes its layer blocks to decode's step (`hint_ms`)
            p.advance_drift(state.decode_contexts, state.waiting)
        else:
            p.advance(*self.rapid())
        return Split(p.current, self.prefill_batch_tokens)

    def observe(self, timing: StepTiming) -> None:
        """The manager decides from its profile, not from measured steps."""


class ScriptedPolicy:
    """For tests: the shape of each call from `script` (a list, its last shape repeated; or a function of the
    call count and the state). It records the states it was given and the timings it was fed."""

    def __init__(self, script: Sequence[StepShape] | Callable[[int, ShapeState], StepShape],
                 workers: tuple[str, ...] = ("decode", "prefill"), name: str = "scripted") -> None:
        if not callable(script) and not script:
            raise ValueError("a scripted policy needs at least one shape")
        self.script, self.workers, self.name = script, workers, name
        self.calls = 0
        self.states: list[ShapeState] = []
        self.timings: list[StepTiming] = []

    def decide(self, state: ShapeState) -> StepShape:
        k, self.calls = self.calls, self.calls + 1
        self.states.append(state)
        if callable(self.script):
            return self.script(k, state)
        return self.script[min(k, len(self.script) - 1)]

    def observe(self, timing: StepTiming) -> None:
        self.timings.append(timing)
