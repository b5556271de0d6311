"""DRIFT's dispatcher (the PD-multiplexing paper, sections 3.3-3.5) as pure decision functions.

Prefill runs beside decode on its own partition, launched block-wise: a slice of layers at a time,
sized so that one block returns before the concurrent decode step ends (the launch loop polls events
and never blocks). Each boundary the dispatcher decides:
1. Resume first: a batch preempted earlier (the stack holds at most one) runs again before anything new.
2. Preempt: while a long batch runs, a waiting request whose TTFT SLO would be missed if it waited for
   the rest of that batch, but met if it ran now, preempts it at the next layer-block boundary,
   provided the preempted batch's own requests still meet their TTFT after the delay. At most one batch
   is preempted at a time. With one TTFT SLO for every request this needs the short request to have
   waited longer than the batch's (in the engine, whose queues are FCFS, it then never happens);
   `PolicyState.slo_ttft_ms_per_1k_tokens` gives each request an SLO growing with its length (as the
   bench's goodput rule does), so a long batch has the slack a short request may take.
3. Otherwise the next batch in arrival order within the token budget, on the partition with the most
   prefill units whose decode step beside prefill meets the TBT SLO (the profile's p95), with the
   predicted batch time from a contention-free linear model per partition, fitted from profiles:
   t(tokens) = a + b * tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rapidserve.partition.policy import PolicyState, prefill_batch


@dataclass(frozen=True)
class LinearModel:
    """Prefill batch time (ms) on one partition: a + b * tokens."""

    a_ms: float
    b_ms_per_token: float

    def ms(self, tokens: int) -> float:
        return self.a_ms + self.b_ms_per_token * tokens


def fit_linear(points: Sequence[tuple[int, float]]) -> LinearModel:
    """Least squares over (tokens, ms) points (at least two distinct token counts); a and b kept >= 0."""
    if len({t for t, _ in points}) < 2:
        raise ValueError("fit_linear needs points at two or more token counts")
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    b = sum((t - mx) * (y - my) for t, y in points) / sum((t - mx) ** 2 for t, _ in points)
    b = max(b, 0.0)
    return LinearModel(max(my - b * mx, 0.0), b)


@dataclass(frozen=True)
class RunningPrefill:
    """The batch on the prefill partition now: its requests' arrival times and tokens, and progress."""

    req_ids: tuple[str, ...]
    arrivals_s: tuple[float, ...]
    tokens: int
    config: str
    layers_done: int
    num_layers: int
    lengths: tuple[int, ...] = ()  # each request's whole length (its TTFT SLO's); () = the base SLO for all


@dataclass(frozen=True)
class DriftDecision:
    action: Literal["idle", "continue", "start", "resume", "preempt"]
    batch: tuple[tuple[str, int, int], ...]  # start / preempt: (req_id, chunk tokens, prefix)
    config: str  # the partition the batch runs on
    layers_per_block: int
    predicted_ms: float  # the batch's predicted time on that partition
    reason: str


def layers_per_block(num_layers: int, batch_ms: float, decode_step_ms: float) -> int:
    """Layers per launch so that one block takes no longer than a decode step (at least one layer)."""
    if batch_ms <= 0:
        return num_layers
    return max(1, min(num_layers, int(num_layers * decode_step_ms / batch_ms)))


def choose_partition(decode_ms_beside: Mapping[str, float], prefill_units: Mapping[str, int], limit_ms: float,
                     ) -> tuple[str, bool]:
    """The configuration with the most prefill units whose decode step beside prefill is within the limit
    (else the one with the fastest decode step, and False)."""
    ok = [c for c, ms in decode_ms_beside.items() if ms <= limit_ms]
    if ok:
        return max(ok, key=lambda c: (prefill_units[c], -decode_ms_beside[c], c)), True
    return min(decode_ms_beside, key=lambda c: (decode_ms_beside[c], c)), False


def decide_drift(state: PolicyState, *, models: Mapping[str, LinearModel], decode_ms_beside: Mapping[str, float],
                 prefill_units: Mapping[str, int], num_layers: int, running: RunningPrefill | None = None,
                 preempted: RunningPrefill | None = None, margin: float = 0.9) -> DriftDecision:
    """The dispatcher's decision at a layer-block boundary. Pure: same inputs, same outputs."""
    if set(models) != set(decode_ms_beside) or set(models) != set(prefill_units) or not models:
        raise ValueError("models, decode_ms_beside and prefill_units must name the same configurations")
    limit = margin * state.slo_tbt_ms
    config, meets = choose_partition(decode_ms_beside, prefill_units, limit)
    step_ms = decode_ms_beside[config]
    slo_ttft = state.slo_ttft_ms

    if running is not None:
        left_ms = models[running.config].ms(running.tokens) * (1 - running.layers_done / running.num_layers)
        if preempted is None and slo_ttft is not None:
            short = _preemptor(state, models[config], left_ms)
            if short is not None:
                delay = models[config].ms(short[1])
                lengths = running.lengths or (0,) * len(running.arrivals_s)
                if all((state.now_s - a) * 1e3 + left_ms + delay <= _slo(state, n)
                       for a, n in zip(running.arrivals_s, lengths, strict=True)):
                    per = layers_per_block(num_layers, delay, step_ms)
                    return DriftDecision("preempt", (short,), config, per, delay,
                                         f"preempt: {short[0]} would miss its TTFT behind {left_ms:.1f} ms of "
                                         f"the running batch; that batch still meets its TTFT after {delay:.1f} ms")
        per = layers_per_block(num_layers, models[running.config].ms(running.tokens), decode_ms_beside[running.config])
        return DriftDecision("continue", (), running.config, per, left_ms,
                             f"continue the running batch ({running.layers_done}/{running.num_layers} layers)")
    if preempted is not None:
        t = models[preempted.config].ms(preempted.tokens)
        per = layers_per_block(num_layers, t, decode_ms_beside[preempted.config])
        return DriftDecision("resume", (), preempted.config, per,
                             t * (1 - preempted.layers_done / preempted.num_layers),
                             f"resume the preempted batch first ({preempted.layers_done}/{preempted.num_layers} "
                             "layers done)")
    batch = prefill_batch(state)
    if not batch:
        return DriftDecision("idle", (), config, num_layers, 0.0, "no prefill waiting")
    t = models[config].ms(sum(n for _, n, _ in batch))
    per = layers_per_block(num_layers, t, step_ms)
    why = "" if meets else f"; no partition meets the TBT SLO ({state.slo_tbt_ms:g} ms): the fastest decode"
    return DriftDecision("start", batch, config, per, t,
                         f"start {len(batch)} request(s) on {config}, {per} layers per block{why}")


def _slo(state: PolicyState, tokens: int) -> float:
    slo = state.ttft_slo_ms(tokens)
    assert slo is not None
    return slo


def _preemptor(state: PolicyState, model: LinearModel, wait_ms: float) -> tuple[str, int, int] | None:
    """The first waiting request (arrival order) that misses its TTFT after `wait_ms` but meets it now
    (its TTFT SLO: `PolicyState.ttft_slo_ms` of its whole length, prefix included)."""
    for w in state.waiting:
        waited = (state.now_s - w.arrival_s) * 1e3
        alone = model.ms(w.tokens)
        if waited + wait_ms + alone > _slo(state, w.prefix + w.tokens) >= waited + alone:
            return (w.req_id, w.tokens, w.prefix)
    return None
