"""rapidserve's own Prometheus series (``rapidserve:`` prefix): what vLLM has no series for. Part of the server's
`Metrics` (server/metrics.py), in its registry.

They are labelled ``model_name`` only, never ``engine``: with ``--data-parallel-size N`` each is the whole server's,
over the N engines behind it (the workers' counts summed and kept monotonic across one engine's restart, the
configurations joined, the correction ratios averaged: engine/dp_stats.py; the request histograms over every
request, whichever engine served it). With one engine nothing differs.

Histograms ``rapidserve:request_admission_time_seconds`` (arrival to its KV blocks allocated: in rapid mode the
decode worker's handing it to prefill; part of the queue time) and ``rapidserve:request_first_token_handoff_seconds``
(first token sampled to the server holding it: in rapid mode the route prefill -> decode -> router); gauge
``rapidserve:partition_info{config}`` (1, current only; under data parallelism the engines' configurations, distinct,
joined by "+"); counters ``rapidserve:partition_steps_total{config}`` (decode steps launched in each compute partition
configuration), ``rapidserve:partition_switches_total``, ``rapidserve:prompts_handed_over_total`` (hand-overs of
prompts whose first chunks the decode worker computed in fused steps and whose rest a split step handed to the
prefill worker, a prompt preempted and chunked again counted again: ``--policy duet``'s, engine/decode_scheduler.py
`hand_over`), ``rapidserve:engine_restarts_total``,
``rapidserve:engine_worker_deaths_total`` and ``rapidserve:request_rejected_total{reason}`` (HTTP requests refused
with a 503 before reaching the engine, by the error code the client got: overloaded, engine_unavailable,
server_shutting_down; they count no prompt tokens and are not in ``vllm:request_success_total``).

The step series: what the decode worker's step loop ran, by the shape its policy chose (label ``kind``: ``fused``, a
mixed step with prompt tokens; ``fused_decode``, a fused step without any; ``split``, decode beside the prefill
worker; ``alone``, decode alone on its configuration; engine/step_tally.py), each kind pre-created at 0. Counters
``rapidserve:steps_total{kind}`` (landed steps), ``rapidserve:step_seconds_total{kind}`` (their measured device time;
on a CPU the wall time), ``rapidserve:steps_over_slo_total{kind}`` (of them, those that took longer than
``--slo-itl-ms``; none without an SLO), ``rapidserve:step_predicted_seconds_total{kind}`` (the policy's raw
cost-model prediction, summed over the steps that had one: ``--policy duet``'s) and
``rapidserve:step_predicted_measured_seconds_total{kind}`` (the measured time of those same steps: the rate of this
over the rate of the predicted one is how far off the model is, by kind); gauge ``rapidserve:step_correction_ratio
{kind}`` (the online correction the policy applies now, measured / predicted per correction kind ``fused``,
``split``, ``decode``: partition/correction.py; exposed once a policy that corrects reported it; beside them
``kind="slo_margin"``, duet's share of the ITL SLO its steps are planned within now, partition/margin.py). Mean step
time of a kind: rate(step_seconds_total) / rate(steps_total). What the worker's host saw (engine/step_cycle.py's
``Landed``): ``rapidserve:step_gaps_total{kind}``, ``rapidserve:step_gap_seconds_total{kind}`` and
``rapidserve:step_gaps_over_slo_total{kind}`` (the token gaps that ended at a step of the kind, host time included:
a gap over the SLO from a step within it is time outside the step), ``rapidserve:step_idle_seconds_total{kind}``
(the device idle before those steps), ``rapidserve:step_host_seconds_total{kind}`` (the host's time to plan and
launch them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rapidserve.engine.messages import STEP_KINDS, StepKindStats

_R = "rapidserve:"
# Reasons pre-created at 0 so that rate() works before the first refusal of each kind.
REJECT_REASONS = ("overloaded", "engine_unavailable", "server_shutting_down")


def delta(seen: float, now: float) -> float:
    """How much a cumulative engine count grew since `seen` (all of `now` after an engine restart)."""
    return now - seen if now >= seen else now


class OwnSeries:
    """rapidserve's series of one model in `registry` (the module doc), with `phase_buckets` for its two request
    histograms (vLLM's TTFT buckets)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, phase_buckets: tuple[float, ...]) -> None:
        self.model_name = model_name
        reg = registry

        def phase(name: str, doc: str) -> Histogram:
            return Histogram(_R + name, doc, ["model_name"], buckets=phase_buckets, registry=reg).labels(model_name)

        def own(name: str, doc: str) -> Counter:
            return Counter(_R + name, doc, ["model_name"], registry=reg).labels(model_name)

        self.admission = phase("request_admission_time_seconds", "Arrival to the request's KV blocks allocated.")
        self.handoff = phase("request_first_token_handoff_seconds", "First token sampled to the server holding it.")
        self._partition = Gauge(_R + "partition_info", "Current compute partition (value 1 for the current config).",
                                ["model_name", "config"], registry=reg)
        self._partition_now: str | None = None
        self._rejected = Counter(_R + "request_rejected", "Requests refused (503) before reaching the engine, by "
                                 "error code.", ["model_name", "reason"], registry=reg)
        for reason in REJECT_REASONS:
            self._rejected.labels(model_name, reason)
        self._restarts = own("engine_restarts", "Engine worker restarts since the server started.")
        self._deaths = own("engine_worker_deaths", "Engine worker deaths since the server started.")
        self._restarts_seen = self._deaths_seen = 0
        self._partition_steps = Counter(_R + "partition_steps", "Decode steps launched, per compute partition "
                                        "configuration.", ["model_name", "config"], registry=reg)
        self._partition_switches = own("partition_switches", "Compute partition switches.")
        self._steps_seen: dict[str, int] = {}
        self._switches_seen = 0
        self._hand_overs = own("prompts_handed_over", "Hand-overs of prompts whose first chunks the decode worker "
                               "computed in fused steps and whose rest a split step handed to the prefill worker.")
        self._hand_overs_seen = 0

        def by_kind(name: str, doc: str) -> Counter:
            c = Counter(_R + name, doc, ["model_name", "kind"], registry=reg)
            for kind in STEP_KINDS:
                c.labels(model_name, kind)
            return c

        # StepKindStats' fields -> (counter, scale to the exposed unit)
        self._kind_series: dict[str, tuple[Counter, float]] = {
            "steps": (by_kind("steps", "Decode-worker steps landed, by the shape the policy chose."), 1.0),
            "measured_ms": (by_kind("step_seconds", "Measured time of those steps, by shape kind."), 1e-3),
            "over_slo": (by_kind("steps_over_slo", "Steps whose measured time exceeded the ITL SLO, by shape kind."),
                         1.0),
            "predicted_ms": (by_kind("step_predicted_seconds", "The policy's raw prediction of the steps that had "
                                     "one, by shape kind."), 1e-3),
            "predicted_measured_ms": (by_kind("step_predicted_measured_seconds", "Measured time of the steps that "
                                              "had a prediction, by shape kind."), 1e-3),
            "gaps": (by_kind("step_gaps", "Token gaps that ended at a step of this kind (a request decoded in it and "
                             "in the step before), as the decode worker's host saw them."), 1.0),
            "gap_ms": (by_kind("step_gap_seconds", "The sum of those token gaps, by shape kind."), 1e-3),
            "gaps_over_slo": (by_kind("step_gaps_over_slo", "Of those token gaps, those longer than the ITL SLO, by "
                                      "shape kind."), 1.0),
            "idle_ms": (by_kind("step_idle_seconds", "The device's idle time before the steps of this kind "
                                "(previous step's end to this one's start), by shape kind."), 1e-3),
            "host_ms": (by_kind("step_host_seconds", "The host's wall time to plan and launch the steps of this "
                                "kind, by shape kind."), 1e-3),
        }
        self._kind_seen: dict[tuple[str, str], float] = {}
        self._correction = Gauge(_R + "step_correction_ratio", "The policy's online correction now: measured / "
                                 "predicted step time, per correction kind.", ["model_name", "kind"], registry=reg)

    def observe_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def set_partition(self, partition: str, partition_switches: int = 0,
                      partition_steps: dict[str, int] | None = None) -> None:
        """The configuration now and the cumulative switches and steps per configuration (a drop is taken as an
        engine restart: counting starts again from the new value)."""
        self._partition_switches.inc(delta(self._switches_seen, partition_switches))
        self._switches_seen = partition_switches
        for config, n in (partition_steps or {}).items():
            self._partition_steps.labels(self.model_name, config).inc(delta(self._steps_seen.get(config, 0), n))
            self._steps_seen[config] = n
        if partition != self._partition_now:
            if self._partition_now is not None:
                self._partition.remove(self.model_name, self._partition_now)
            self._partition.labels(self.model_name, partition).set(1)
            self._partition_now = partition

    def set_hand_overs(self, num_hand_overs: int) -> None:
        """The engine's cumulative prompts handed over (`Stats.num_hand_overs`; a drop is taken as an engine restart:
        counting starts again from the new value)."""
        self._hand_overs.inc(delta(self._hand_overs_seen, num_hand_overs))
        self._hand_overs_seen = num_hand_overs

    def set_step_stats(self, step_kinds: dict[str, StepKindStats], correction: dict[str, float]) -> None:
        """Cumulative step counts by shape kind (a drop is taken as an engine restart) and correction ratios now."""
        for kind, st in step_kinds.items():
            for f, (series, scale) in self._kind_series.items():
                now = float(getattr(st, f))
                seen = self._kind_seen.get((kind, f), 0.0)
                self._kind_seen[(kind, f)] = now
                if now != seen:
                    series.labels(self.model_name, kind).inc(delta(seen, now) * scale)
        for kind, ratio in correction.items():
            self._correction.labels(self.model_name, kind).set(ratio)

    def set_engine_counters(self, restarts_total: int, deaths_total: int) -> None:
        """The engine's cumulative worker restarts and deaths (they only grow)."""
        if restarts_total > self._restarts_seen:
            self._restarts.inc(restarts_total - self._restarts_seen)
            self._restarts_seen = restarts_total
        if deaths_total > self._deaths_seen:
            self._deaths.inc(deaths_total - self._deaths_seen)
            self._deaths_seen = deaths_total
