"""Prometheus metrics of the HTTP server, under vLLM's names wherever vLLM has the same series.

A dashboard, alert, autoscaler or router built for vLLM reads a rapidserve server unchanged: every series
whose meaning matches one of vLLM v1's (vllm/v1/metrics/loggers.py) carries vLLM's name with the ``vllm:``
prefix, its type, its buckets and its labels ``model_name`` and ``engine``. ``engine`` is always "0": with
``--data-parallel-size N`` the series are the sum over the N engines behind this server (engine/dp_stats.py),
where vLLM would label each engine. What vLLM has no series for keeps the ``rapidserve:`` prefix, labelled
``model_name`` only. Counters carry prometheus_client's ``_total`` suffix as vLLM's do; no ``_created``
series is exposed (they would double the series for nothing a dashboard reads): they are filtered at render,
so no global prometheus_client setting is touched. Every `Metrics` owns a private `CollectorRegistry`, so
several servers (or tests) in one process never share series.

vLLM's series (see docs/operations.md for what to watch):

* gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (the server's own count of engine
  requests in flight at the scrape: `request_gauges`), ``vllm:kv_cache_usage_perc`` (0..1),
  ``vllm:cache_config_info`` (1; the KV cache settings as labels, vLLM's ``CacheConfig.metrics_info()`` keys:
  `cache_config_labels`; exposed once the engine has reported its pool);
* counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt tokens looked up in the prefix
  cache, and found there), ``vllm:request_success_total{finished_reason}`` (stop, length, abort: the client went
  away or the server stopped it; and error: the engine failed it);
* histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and its older name
  ``vllm:time_per_output_token_seconds`` (the same observations, as vLLM still exposes both),
  ``vllm:request_time_per_output_token_seconds`` (per request: (e2e - ttft) / (output tokens - 1)),
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (arrival to the first prompt chunk
  queued on the device), ``vllm:request_prefill_time_seconds`` (first chunk queued to first token sampled),
  ``vllm:request_decode_time_seconds`` (first token to the end), ``vllm:request_inference_time_seconds`` (first
  chunk queued to the end), ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``,
  ``vllm:request_max_num_generation_tokens`` (per prompt: the most output tokens among its ``n`` samples),
  ``vllm:request_params_n``, ``vllm:request_params_max_tokens``.

rapidserve's own: histograms ``rapidserve:request_admission_time_seconds`` (arrival to its KV blocks allocated:
in rapid mode the decode worker's handing it to prefill; part of the queue time) and
``rapidserve:request_first_token_handoff_seconds`` (first token sampled to the server holding it: in rapid mode
the route prefill -> decode -> router); gauge ``rapidserve:partition_info{config}`` (1, current only); counters
``rapidserve:partition_steps_total{config}`` (decode steps launched in each compute partition configuration),
``rapidserve:partition_switches_total``, ``rapidserve:engine_restarts_total``,
``rapidserve:engine_worker_deaths_total`` and ``rapidserve:request_rejected_total{reason}`` (HTTP requests
refused with a 503 before reaching the engine, by the error code the client got: overloaded,
engine_unavailable, server_shutting_down; they count no prompt tokens and are not in
``vllm:request_success_total``).

rapidserve's step series: what the decode worker's step loop ran, by the shape its policy chose (label ``kind``:
``fused``, a mixed step with prompt tokens; ``fused_decode``, a fused step without any; ``split``, decode beside
the prefill worker; ``alone``, decode alone on its configuration; engine/step_tally.py), each kind pre-created at
0. Counters ``rapidserve:steps_total{kind}`` (landed steps), ``rapidserve:step_seconds_total{kind}`` (their
measured device time; on a CPU the wall time), ``rapidserve:steps_over_slo_total{kind}`` (of them, those that took
longer than ``--slo-itl-ms``; none without an SLO), ``rapidserve:step_predicted_seconds_total{kind}`` (the policy's
raw cost-model prediction, summed over the steps that had one: ``--policy duet``'s) and
``rapidserve:step_predicted_measured_seconds_total{kind}`` (the measured time of those same steps: the rate of this
over the rate of the predicted one is how far off the model is, by kind); gauge
``rapidserve:step_correction_ratio{kind}`` (the online correction the policy applies now, measured / predicted per
correction kind ``fused``, ``split``, ``decode``: partition/correction.py; exposed once a policy that corrects
reported it; beside them ``kind="slo_margin"``, duet's share of the ITL SLO its steps are planned within now,
partition/margin.py). Mean step time of a kind: rate(step_seconds_total) / rate(steps_total). What the worker's host saw
(engine/step_cycle.py's ``Landed``): ``rapidserve:step_gaps_total{kind}``, ``rapidserve:step_gap_seconds_total{kind}``
and ``rapidserve:step_gaps_over_slo_total{kind}`` (the token gaps that ended at a step of the kind, host time
included: a gap over the SLO from a step within it is time outside the step), ``rapidserve:step_idle_seconds_total
{kind}`` (the device idle before those steps), ``rapidserve:step_host_seconds_total{kind}`` (the host's time to plan
and launch them).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from rapidserve.config import CacheConfig
from rapidserve.engine.messages import STEP_KINDS, StepKindStats

# Bucket boundaries as vLLM's (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

# Reasons pre-created at 0 so that rate() works before the first request of each kind finishes.
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("overloaded", "engine_unavailable", "server_shutting_down")
ENGINE = "0"  # vLLM's `engine` label: one combined engine (module doc)
# How the prefix cache's blocks are hashed for KV events (engine/kv_events.py): vLLM's default.
PREFIX_CACHING_HASH_ALGO = "sha256"

_V = "vllm:"
_R = "rapidserve:"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def cache_config_labels(cache: CacheConfig, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM's CacheConfig field names, values as Python's str() of
    them as vLLM prints them (``"True"``, ``"None"``, ``"0.9"``), for the settings rapidserve has (``cache_dtype``: the
    resolved one, "auto" or "fp8")."""
    return {"block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization), "num_cpu_blocks": "None",
            "num_gpu_blocks": str(num_gpu_blocks), "num_gpu_blocks_override": str(cache.num_blocks),
            "prefix_caching_hash_algo": PREFIX_CACHING_HASH_ALGO, "swap_space": "0"}


class _WithoutCreated:
    """A registry's series without the ``_created`` samples prometheus_client adds to counters and histograms."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            yield out


class Metrics:
    """The server's metrics for one model; render() gives the /metrics response. `max_model_len` bounds the
    token-count buckets (vLLM's); `cache` is described by ``vllm:cache_config_info``."""

    def __init__(self, model_name: str, max_model_len: int, cache: CacheConfig) -> None:
        self.model_name = model_name
        self.cache = cache
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab, who = self.registry, ["model_name", "engine"], (model_name, ENGINE)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(_V + name, doc, lab, buckets=buckets, registry=reg).labels(*who)

        def counter(name: str, doc: str) -> Counter:
            return Counter(_V + name, doc, lab, registry=reg).labels(*who)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(_V + name, doc, lab, registry=reg).labels(*who)

        tokens = build_1_2_5_buckets(max_model_len)
        self._ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                          TTFT_BUCKETS)
        self._itl = hist("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self._tpot_old = hist("time_per_output_token_seconds", "Histogram of time per output token in seconds "
                              "(the inter-token latency's older name).", ITL_BUCKETS)
        self._tpot = hist("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds "
                          "per request: (e2e - ttft) / (output tokens - 1).", ITL_BUCKETS)
        self._e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                         REQUEST_LATENCY_BUCKETS)
        self._queue = hist("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request: "
                           "arrival to its first prompt chunk queued.", REQUEST_LATENCY_BUCKETS)
        self._prefill = hist("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request: "
                             "first prompt chunk queued to first token sampled.", REQUEST_LATENCY_BUCKETS)
        self._decode = hist("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self._inference = hist("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for "
                               "request.", REQUEST_LATENCY_BUCKETS)
        self._req_prompt = hist("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self._req_gen = hist("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self._req_max_gen = hist("request_max_num_generation_tokens",
                                 "Histogram of maximum number of requested generation tokens.", tokens)
        self._params_n = hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self._params_max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                       tokens)

        self._running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._cache_info = Gauge(_V + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                 ["engine", *cache_config_labels(cache, 0)], registry=reg)
        self._cache_info_now: dict[str, str] | None = None

        self._prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._gen_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(_V + "request_success", "Count of successfully processed requests.",
                                [*lab, "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self._success.labels(*who, reason)
        self._preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self._prefix_queries = counter("prefix_cache_queries",
                                       "Prefix cache queries, in terms of number of queried tokens.")
        self._prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._preemptions_seen = 0
        self._prefix_seen = (0, 0)

        # rapidserve's own series (vLLM has none of these)
        def phase(name: str, doc: str) -> Histogram:
            return Histogram(_R + name, doc, ["model_name"], buckets=TTFT_BUCKETS, registry=reg).labels(model_name)

        def own(name: str, doc: str) -> Counter:
            return Counter(_R + name, doc, ["model_name"], registry=reg).labels(model_name)

        self._admission = phase("request_admission_time_seconds", "Arrival to the request's KV blocks allocated.")
        self._handoff = phase("request_first_token_handoff_seconds", "First token sampled to the server holding it.")
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

    def observe_first_token(self, ttft_s: float) -> None:
        """A request's first output token arrived `ttft_s` seconds after the request did."""
        self._ttft.observe(ttft_s)

    def observe_phases(self, arrival: float, admitted: float, started: float, sampled: float, held: float) -> None:
        """Where one request's time to first token went, on one monotonic clock: the server got it at
        `arrival`, the engine allocated its blocks at `admitted`, queued its first prompt chunk at `started`
        and had its first token at `sampled`; the server held that token at `held`. A phase that comes out
        negative (the engine's stamp precedes the server's by a hair) counts as 0."""
        self._queue.observe(max(0.0, started - arrival))
        self._admission.observe(max(0.0, admitted - arrival))
        self._prefill.observe(max(0.0, sampled - started))
        self._handoff.observe(max(0.0, held - sampled))

    def observe_token(self, itl_s: float) -> None:
        """A later output token arrived `itl_s` seconds after the previous one of its request."""
        self._itl.observe(itl_s)
        self._tpot_old.observe(itl_s)

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        """One prompt of a request was admitted with these sampling parameters (a request of several
        prompts is several, as vLLM counts them); a `max_tokens` left unset is not observed, as vLLM's."""
        self._params_n.observe(n)
        if max_tokens:
            self._params_max_tokens.observe(max_tokens)

    def observe_samples_done(self, output_tokens: list[int]) -> None:
        """Every sample of one prompt ended, with these output token counts: the most of them is the
        prompt's ``request_max_num_generation_tokens``."""
        if output_tokens:
            self._req_max_gen.observe(max(output_tokens))

    def observe_finished(self, e2e_s: float, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str,
                         ttft_s: float | None = None, queue_s: float | None = None) -> None:
        """A request finished (any reason, aborts included); counts its output tokens.

        With `ttft_s` and more than one output token, also observes the time per output token
        ``(e2e_s - ttft_s) / (num_output_tokens - 1)``; with `ttft_s`, the decode time ``e2e_s - ttft_s``;
        with `queue_s` (arrival to its first prompt chunk queued), the inference time ``e2e_s - queue_s``.
        """
        if ttft_s is not None:
            self._decode.observe(max(0.0, e2e_s - ttft_s))
        if queue_s is not None:
            self._inference.observe(max(0.0, e2e_s - queue_s))
        self._e2e.observe(e2e_s)
        self._req_prompt.observe(num_prompt_tokens)
        self._req_gen.observe(num_output_tokens)
        if num_output_tokens > 0:
            self._gen_tokens.inc(num_output_tokens)
        self._success.labels(self.model_name, ENGINE, str(finish_reason)).inc()
        if ttft_s is not None and num_output_tokens > 1:
            self._tpot.observe(max(0.0, e2e_s - ttft_s) / (num_output_tokens - 1))

    def observe_rejected(self, reason: str) -> None:
        """A request was refused with a 503 before reaching the engine; `reason` is the error code it got."""
        self._rejected.labels(self.model_name, reason).inc()

    def set_requests(self, num_running: int, num_waiting: int) -> None:
        """The request gauges (the server's own counts: `request_gauges`)."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)

    def add_prompt_tokens(self, n: int) -> None:
        """`n` prompt tokens were admitted."""
        if n > 0:
            self._prompt_tokens.inc(n)

    def set_engine_stats(self, num_running: int, num_waiting: int, kv_blocks_total: int, kv_blocks_free: int,
                         num_preemptions: int, partition: str, prefix_queries: int = 0,
                         prefix_hits: int = 0, partition_switches: int = 0,
                         partition_steps: dict[str, int] | None = None) -> None:
        """Latest engine stats, with the request gauges (as `set_requests`; the server derives them from its
        own counts, `request_gauges`); `num_preemptions` and the prefix cache's tokens are the engine's
        cumulative counts (a drop is taken as an engine restart: counting starts again from the new value)."""
        q0, h0 = self._prefix_seen
        self._prefix_queries.inc(_delta(q0, prefix_queries))
        self._prefix_hits.inc(_delta(h0, prefix_hits))
        self._prefix_seen = (prefix_queries, prefix_hits)
        self._partition_switches.inc(_delta(self._switches_seen, partition_switches))
        self._switches_seen = partition_switches
        for config, n in (partition_steps or {}).items():
            self._partition_steps.labels(self.model_name, config).inc(_delta(self._steps_seen.get(config, 0), n))
            self._steps_seen[config] = n
        self.set_requests(num_running, num_waiting)
        used = 1.0 - kv_blocks_free / kv_blocks_total if kv_blocks_total > 0 else 0.0
        self._kv_usage.set(min(1.0, max(0.0, used)))
        self._preemptions.inc(_delta(self._preemptions_seen, num_preemptions))
        self._preemptions_seen = num_preemptions
        if kv_blocks_total > 0:
            self._set_cache_info(kv_blocks_total)
        if partition != self._partition_now:
            if self._partition_now is not None:
                self._partition.remove(self.model_name, self._partition_now)
            self._partition.labels(self.model_name, partition).set(1)
            self._partition_now = partition

    def set_step_stats(self, step_kinds: dict[str, StepKindStats], correction: dict[str, float]) -> None:
        """The engine's cumulative step counts by shape kind (`Stats.step_kinds`; a drop is taken as an engine
        restart, as `set_engine_stats`'s counters) and its policy's correction ratios now (`Stats.step_correction`)."""
        for kind, st in step_kinds.items():
            for f, (series, scale) in self._kind_series.items():
                now = float(getattr(st, f))
                seen = self._kind_seen.get((kind, f), 0.0)
                self._kind_seen[(kind, f)] = now
                if now != seen:
                    series.labels(self.model_name, kind).inc(_delta(seen, now) * scale)
        for kind, ratio in correction.items():
            self._correction.labels(self.model_name, kind).set(ratio)

    def _set_cache_info(self, num_gpu_blocks: int) -> None:
        labels = {"engine": ENGINE, **cache_config_labels(self.cache, num_gpu_blocks)}
        if labels == self._cache_info_now:
            return
        if self._cache_info_now is not None:  # the pool changed size (a restart): one current series only
            self._cache_info.remove(*self._cache_info_now.values())
        self._cache_info.labels(**labels).set(1)
        self._cache_info_now = labels

    def set_engine_counters(self, restarts_total: int, deaths_total: int) -> None:
        """The engine's cumulative worker restarts and deaths (they only grow)."""
        if restarts_total > self._restarts_seen:
            self._restarts.inc(restarts_total - self._restarts_seen)
            self._restarts_seen = restarts_total
        if deaths_total > self._deaths_seen:
            self._deaths.inc(deaths_total - self._deaths_seen)
            self._deaths_seen = deaths_total

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for the /metrics response."""
        return generate_latest(_WithoutCreated(self.registry)), CONTENT_TYPE_LATEST  # type: ignore[arg-type]


def request_gauges(queued: int, pending: int, decoding: int, engine_active: int | None) -> tuple[int, int]:
    """(running, waiting) engine requests at a scrape, from the server's exact counts of its requests in flight:
    `queued` (admitted, not yet handed to the engine), `pending` (in the engine, no token yet) and `decoding`
    (a token came). Only which pending ones are being prefilled is the engine's to know: `engine_active`
    (running + prefilling in the workers' latest periodic stats; None before any) minus those decoding, capped
    at `pending`, as stale stats may count requests that have ended since. A request that has ended is in
    neither, whatever the stats say; a decoding one that the engine preempted still counts as running."""
    known = 0 if engine_active is None else min(pending, max(0, engine_active - decoding))
    return decoding + known, queued + pending - known


def _delta(seen: float, now: float) -> float:
    """How much a cumulative engine count grew since `seen` (all of `now` after an engine restart)."""
    return now - seen if now >= seen else now
