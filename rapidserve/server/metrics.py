"""Prometheus metrics of the HTTP server, under vLLM's names wherever vLLM has the same series.

A dashboard, alert, autoscaler or router built for vLLM reads a rapidserve server unchanged: every series
whose meaning matches one of vLLM v1's (vllm/v1/metrics/loggers.py) carries vLLM's name with the ``vllm:``
prefix, its type, its buckets and its labels ``model_name`` and ``engine``. What vLLM has no series for keeps the
``rapidserve:`` prefix, labelled ``model_name`` only (server/metrics_own.py). Counters carry prometheus_client's
``_total`` suffix as vLLM's do; no ``_created`` series is exposed (they would double the series for nothing a
dashboard reads): they are filtered at render, so no global prometheus_client setting is touched. Every `Metrics`
owns a private `CollectorRegistry`, so several servers (or tests) in one process never share series.

``engine`` is the engine's index, as vLLM 0.26's `PrometheusStatLogger` labels each engine core of a data-parallel
front end: with one engine every series has ``engine="0"``; with ``--data-parallel-size N`` every ``vllm:`` series
exists once per engine, ``engine="0"`` .. ``"N-1"``, all pre-created (counters and histograms at 0), each with that
engine's own values. Per engine: the gauges from its own Stats and the server's count of the requests it holds
(`request_gauges`; with several engines a request admitted but not yet dispatched is in no engine's gauges, as one
vLLM's API server has not yet sent to an engine core is in no scheduler's); the counters of its Stats
(preemptions, prefix cache); and every request series of the requests it served. As vLLM 0.26 records them
(vllm/v1/metrics/loggers.py `PrometheusStatLogger.record(..., engine_idx)`, fed per engine's outputs by
engine/async_llm.py): a request is an engine request, a prompt's sample, counted on the engine that ran it, with its
``request_params_max_tokens``; ``request_params_n`` and ``request_max_num_generation_tokens`` are per prompt (vLLM's
parent request, engine/parallel_sampling.py), observed when its last sample ends, on that sample's engine. A request
that never reached an engine (the client left while a stream began; no engine running) is counted on none (with one
engine: as an abort on engine 0, as before data parallelism). Under data parallelism an engine that is not running
(restarting, down) reports no KV usage (0) and keeps its counts (one engine alone: its last Stats stand).
``vllm:cache_config_info`` is one series per engine with the same labels, its ``num_gpu_blocks`` the sum of the
engines' pools, as vLLM 0.26's (vllm/v1/engine/core_client.py `_apply_ready_response` adds each engine's count into
the front end's one CacheConfig before the loggers exist), so a dashboard reading a vLLM server's capacity from it
reads ours the same: exposed once every engine has reported its pool (never a partial sum), replaced when a restarted
engine's pool differs; each engine's own pool is in its Stats (`kv_usage_perc` is per engine). An engine index outside
0..N-1 is a ValueError.

vLLM's series (see docs/operations.md for what to watch):

* gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (the server's own count of engine
  requests in flight at the scrape: `request_gauges`), ``vllm:kv_cache_usage_perc`` (0..1),
  ``vllm:cache_config_info`` (1; the KV cache settings as labels, vLLM's ``CacheConfig.metrics_info()`` keys:
  `cache_config_labels`; exposed once every engine has reported its pool);
* counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt tokens looked up in the prefix
  cache, and found there), ``vllm:request_success_total{finished_reason}`` (stop, length; abort: the server
  aborted the engine request, its client having gone away, the server stopping, or a sibling sample on another
  engine failing; error: its own engine failed it; repetition: pre-created at 0 as vLLM 0.26's, never counted);
* histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:request_time_per_output_token_seconds`` (per request: (e2e - ttft) / (output tokens - 1)),
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (arrival to the first prompt chunk
  queued on the device), ``vllm:request_prefill_time_seconds`` (first chunk queued to first token sampled),
  ``vllm:request_decode_time_seconds`` (first token to the end), ``vllm:request_inference_time_seconds`` (first
  chunk queued to the end), ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``,
  ``vllm:request_max_num_generation_tokens`` (per prompt: the most output tokens among its ``n`` samples),
  ``vllm:request_params_n`` (per prompt), ``vllm:request_params_max_tokens`` (per sample).

Checked against vLLM 0.26's vllm/v1/metrics/loggers.py: its request_success has a child per FinishReason, pre-created
(``repetition`` included: so here); it exports ``vllm:inter_token_latency_seconds`` only, the older
``vllm:time_per_output_token_seconds`` being gone (not even behind --show-hidden-metrics-for-version: not exported
here either). Aborts differ, deliberately: vLLM 0.26 counts none of the front end's aborts (a client gone:
AsyncLLM.abort drops the request in OutputProcessor.abort_requests without stats, and EngineCore.abort_requests'
Scheduler.finish_requests sends no output), so its ``abort`` counts only requests an engine core ended itself (a pause
with mode "abort") and an aborted request is in none of its finished-request histograms; nor does it count requests
failed by a dead engine (EngineDeadError), its ``error`` being a request-level failure the engine core reports.
rapidserve counts every engine request the server aborts, and every one an engine failed, as a finished request
(``abort``, ``error``) in all of them: the soak harness checks ``request_success{abort}`` against the aborts its
clients made, and an error rate is what to alert on. Compare abort rates and e2e latency with a vLLM server with that
in mind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from rapidserve.config import CacheConfig
from rapidserve.engine.messages import StepKindStats
from rapidserve.server.metrics_own import OwnSeries, delta

# Bucket boundaries as vLLM's (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

# Reasons pre-created at 0 so that rate() works before the first request of each kind finishes: vLLM 0.26's
# FinishReason, in its order (vllm/v1/engine/__init__.py; loggers.py pre-creates one child per reason and engine).
# rapidserve never ends a request with "repetition" (repetition_detection is refused), but the series is there.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# How the prefix cache's blocks are hashed for KV events (engine/kv_events.py): vLLM's default.
PREFIX_CACHING_HASH_ALGO = "sha256"

_V = "vllm:"


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
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory_bytes), "num_cpu_blocks": "None",
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


class _Engine:
    """One engine's series (the children of vLLM's families labelled with its index) and what its Stats said last."""

    def __init__(self, fams: dict[str, Any], success: Counter, model_name: str, index: int) -> None:
        who = (model_name, str(index))
        self.s = {name: fam.labels(*who) for name, fam in fams.items()}
        self.success = {reason: success.labels(*who, reason) for reason in FINISH_REASONS}
        self.preemptions_seen = 0
        self.prefix_seen = (0, 0)
        self.cache_info: dict[str, str] | None = None  # the labels of its current cache_config_info series
        self.pool_blocks = 0  # its KV pool, as its latest Stats said (0: not reported yet)


class Metrics:
    """The server's metrics for one model served by `engines` engines; render() gives the /metrics response.
    `max_model_len` bounds the token-count buckets (vLLM's); `cache` is described by ``vllm:cache_config_info``.
    Each `engine` argument is an engine's index (module doc)."""

    def __init__(self, model_name: str, max_model_len: int, cache: CacheConfig, engines: int = 1) -> None:
        self.model_name = model_name
        self.cache = cache
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab = self.registry, ["model_name", "engine"]
        tokens = build_1_2_5_buckets(max_model_len)
        lat = REQUEST_LATENCY_BUCKETS
        # short name -> (vLLM's name without the prefix, documentation, buckets; None: a gauge, (): a counter)
        spec: dict[str, tuple[str, str, tuple[float, ...] | None]] = {
            "ttft": ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            "itl": ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            "tpot": ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per "
                     "request: (e2e - ttft) / (output tokens - 1).", ITL_BUCKETS),
            "e2e": ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat),
            "queue": ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request: arrival "
                      "to its first prompt chunk queued.", lat),
            "prefill": ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request: first "
                        "prompt chunk queued to first token sampled.", lat),
            "decode": ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", lat),
            "inference": ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                          lat),
            "req_prompt": ("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
            "req_gen": ("request_generation_tokens", "Number of generation tokens processed.", tokens),
            "req_max_gen": ("request_max_num_generation_tokens", "Histogram of maximum number of requested "
                            "generation tokens.", tokens),
            "params_n": ("request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
            "params_max_tokens": ("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                  tokens),
            "running": ("num_requests_running", "Number of requests in model execution batches.", None),
            "waiting": ("num_requests_waiting", "Number of requests waiting to be processed.", None),
            "kv_usage": ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", None),
            "prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed.", ()),
            "gen_tokens": ("generation_tokens", "Number of generation tokens processed.", ()),
        }
        fams: dict[str, Any] = {}
        for key, (name, doc, buckets) in spec.items():
            if buckets is None:
                fams[key] = Gauge(_V + name, doc, lab, registry=reg)
            elif buckets == ():
                fams[key] = Counter(_V + name, doc, lab, registry=reg)
            else:
                fams[key] = Histogram(_V + name, doc, lab, buckets=buckets, registry=reg)
            if key == "kv_usage":  # vLLM's order of families, for an unchanged exposition
                self._cache_info = Gauge(_V + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                         ["engine", *cache_config_labels(cache, 0)], registry=reg)
        self._success = Counter(_V + "request_success", "Count of successfully processed requests.",
                                [*lab, "finished_reason"], registry=reg)
        for key, name, doc in (("preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
                               ("prefix_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number "
                                "of queried tokens."),
                               ("prefix_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                "tokens.")):
            fams[key] = Counter(_V + name, doc, lab, registry=reg)
        self._fams = fams
        self._engines = [_Engine(fams, self._success, model_name, i) for i in range(max(1, engines))]
        self.own = OwnSeries(reg, model_name, TTFT_BUCKETS)

    def _of(self, engine: int) -> _Engine:
        """Engine `engine`'s series; ValueError for an index that is not one of the engines given at construction
        (their series are all made there, as vLLM pre-creates each engine's)."""
        if not 0 <= engine < len(self._engines):
            raise ValueError(f"no engine {engine!r}: the engines are 0..{len(self._engines) - 1}")
        return self._engines[engine]

    # ---- per request (the engine that served it) --------------------------------------------
    def observe_first_token(self, ttft_s: float, engine: int = 0) -> None:
        """A request's first output token arrived `ttft_s` seconds after the request did."""
        self._of(engine).s["ttft"].observe(ttft_s)

    def observe_phases(self, arrival: float, admitted: float, started: float, sampled: float, held: float,
                       engine: int = 0) -> None:
        """Where one request's time to first token went, on one monotonic clock: the server got it at
        `arrival`, the engine allocated its blocks at `admitted`, queued its first prompt chunk at `started`
        and had its first token at `sampled`; the server held that token at `held`. A phase that comes out
        negative (the engine's stamp precedes the server's by a hair) counts as 0."""
        s = self._of(engine).s
        s["queue"].observe(max(0.0, started - arrival))
        self.own.admission.observe(max(0.0, admitted - arrival))
        s["prefill"].observe(max(0.0, sampled - started))
        self.own.handoff.observe(max(0.0, held - sampled))

    def observe_token(self, itl_s: float, engine: int = 0) -> None:
        """A later output token arrived `itl_s` seconds after the previous one of its request."""
        self._of(engine).s["itl"].observe(itl_s)

    def observe_samples_done(self, output_tokens: list[int], n: int | None = None, engine: int = 0) -> None:
        """Every sample of one prompt (a parent request: a request of several prompts is several, as vLLM counts
        them) ended, with these output token counts, the last on engine `engine`: the most of them is the
        prompt's ``request_max_num_generation_tokens``, and `n` (unless None) its ``request_params_n``, as vLLM 0.26
        records both when a parent request's last child finishes, on the engine that finished it."""
        s = self._of(engine).s
        if output_tokens:
            s["req_max_gen"].observe(max(output_tokens))
        if n is not None:
            s["params_n"].observe(n)

    def observe_finished(self, e2e_s: float, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str,
                         ttft_s: float | None = None, queue_s: float | None = None, max_tokens: int | None = None,
                         engine: int = 0) -> None:
        """An engine request (a prompt's sample) finished on engine `engine` (any reason, aborts included); counts
        its output tokens.

        With `ttft_s` and more than one output token, also observes the time per output token
        ``(e2e_s - ttft_s) / (num_output_tokens - 1)``; with `ttft_s`, the decode time ``e2e_s - ttft_s``;
        with `queue_s` (arrival to its first prompt chunk queued), the inference time ``e2e_s - queue_s``; its
        `max_tokens` parameter, as vLLM 0.26 observes ``request_params_max_tokens`` with each finished engine
        request (one left unset or 0 is not observed, as vLLM's ``if finished_request.max_tokens_param``).
        """
        e = self._of(engine)
        s = e.s
        if max_tokens:
            s["params_max_tokens"].observe(max_tokens)
        if ttft_s is not None:
            s["decode"].observe(max(0.0, e2e_s - ttft_s))
        if queue_s is not None:
            s["inference"].observe(max(0.0, e2e_s - queue_s))
        s["e2e"].observe(e2e_s)
        s["req_prompt"].observe(num_prompt_tokens)
        s["req_gen"].observe(num_output_tokens)
        if num_output_tokens > 0:
            s["gen_tokens"].inc(num_output_tokens)
        reason = str(finish_reason)
        (e.success.get(reason) or self._success.labels(self.model_name, str(engine), reason)).inc()
        if ttft_s is not None and num_output_tokens > 1:
            s["tpot"].observe(max(0.0, e2e_s - ttft_s) / (num_output_tokens - 1))

    def add_prompt_tokens(self, n: int, engine: int = 0) -> None:
        """`n` prompt tokens were handed to engine `engine`."""
        if n > 0:
            self._of(engine).s["prompt_tokens"].inc(n)

    def observe_rejected(self, reason: str) -> None:
        """A request was refused with a 503 before reaching the engine; `reason` is the error code it got."""
        self.own.observe_rejected(reason)

    # ---- per engine, at a scrape ------------------------------------------------------------
    def set_requests(self, num_running: int, num_waiting: int, engine: int = 0) -> None:
        """The request gauges of engine `engine` (the server's own counts: `request_gauges`)."""
        s = self._of(engine).s
        s["running"].set(num_running)
        s["waiting"].set(num_waiting)

    def set_engine(self, engine: int, num_running: int, num_waiting: int, kv_blocks_total: int, kv_blocks_free: int,
                   num_preemptions: int, prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        """Engine `engine`'s latest stats, with its request gauges (as `set_requests`; the server derives them from
        its own counts, `request_gauges`); `num_preemptions` and the prefix cache's tokens are the engine's
        cumulative counts (a drop is taken as a restart of its workers: counting starts again from the new value)."""
        e = self._of(engine)
        q0, h0 = e.prefix_seen
        e.s["prefix_queries"].inc(delta(q0, prefix_queries))
        e.s["prefix_hits"].inc(delta(h0, prefix_hits))
        e.prefix_seen = (prefix_queries, prefix_hits)
        self.set_requests(num_running, num_waiting, engine)
        used = 1.0 - kv_blocks_free / kv_blocks_total if kv_blocks_total > 0 else 0.0
        e.s["kv_usage"].set(min(1.0, max(0.0, used)))
        e.s["preemptions"].inc(delta(e.preemptions_seen, num_preemptions))
        e.preemptions_seen = num_preemptions
        if kv_blocks_total > 0 and kv_blocks_total != e.pool_blocks:
            e.pool_blocks = kv_blocks_total
            if all(x.pool_blocks for x in self._engines):  # once every engine has reported its pool (vLLM sets it
                total = sum(x.pool_blocks for x in self._engines)  # once all are ready): their sum, on each
                for i, x in enumerate(self._engines):
                    self._set_cache_info(x, i, total)

    def engine_down(self, engine: int) -> None:
        """Engine `engine` is not running (restarting, down): it holds no KV cache; its counts and its
        ``cache_config_info`` stay."""
        self._of(engine).s["kv_usage"].set(0.0)

    def _set_cache_info(self, e: _Engine, engine: int, num_gpu_blocks: int) -> None:
        labels = {"engine": str(engine), **cache_config_labels(self.cache, num_gpu_blocks)}
        if labels == e.cache_info:
            return
        if e.cache_info is not None:  # the pool changed size (a restart): one current series per engine
            self._cache_info.remove(*e.cache_info.values())
        self._cache_info.labels(**labels).set(1)
        e.cache_info = labels

    # ---- the whole server (rapidserve's own series) -----------------------------------------
    def set_partition(self, partition: str, partition_switches: int = 0,
                      partition_steps: dict[str, int] | None = None) -> None:
        """The compute partition now, and the cumulative switches and steps per configuration (metrics_own.py)."""
        self.own.set_partition(partition, partition_switches, partition_steps)

    def set_engine_stats(self, num_running: int, num_waiting: int, kv_blocks_total: int, kv_blocks_free: int,
                         num_preemptions: int, partition: str, prefix_queries: int = 0,
                         prefix_hits: int = 0, partition_switches: int = 0,
                         partition_steps: dict[str, int] | None = None) -> None:
        """One engine's whole Stats: engine 0's series (`set_engine`) and the partition (`set_partition`)."""
        self.set_engine(0, num_running, num_waiting, kv_blocks_total, kv_blocks_free, num_preemptions,
                        prefix_queries, prefix_hits)
        self.set_partition(partition, partition_switches, partition_steps)

    def set_hand_overs(self, num_hand_overs: int) -> None:
        """The engine's cumulative prompts handed from decode's fused chunks to the prefill worker
        (`Stats.num_hand_overs`; a drop is taken as an engine restart): metrics_own.py."""
        self.own.set_hand_overs(num_hand_overs)

    def set_step_stats(self, step_kinds: dict[str, StepKindStats], correction: dict[str, float]) -> None:
        """The engine's cumulative step counts by shape kind (`Stats.step_kinds`; a drop is taken as an engine
        restart) and its policy's correction ratios now (`Stats.step_correction`)."""
        self.own.set_step_stats(step_kinds, correction)

    def set_engine_counters(self, restarts_total: int, deaths_total: int) -> None:
        """The engine's cumulative worker restarts and deaths (they only grow)."""
        self.own.set_engine_counters(restarts_total, deaths_total)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for the /metrics response."""
        return generate_latest(_WithoutCreated(self.registry)), CONTENT_TYPE_LATEST  # type: ignore[arg-type]


def request_gauges(queued: int, pending: int, decoding: int, engine_active: int | None) -> tuple[int, int]:
    """(running, waiting) engine requests at a scrape, from the server's exact counts of its requests in flight:
    `queued` (admitted, not yet handed to the engine), `pending` (in the engine, no token yet) and `decoding`
    (a token came). Only which pending ones are being prefilled is the engine's to know: `engine_active`
    (running + prefilling in the workers' latest periodic stats; None before any) minus those decoding, capped
    at `pending`, as stale stats may count requests that have ended since. A request that has ended is in
    neither, whatever the stats say; a decoding one that the engine preempted still counts as running.
    With several engines: one engine's counts and stats."""
    known = 0 if engine_active is None else min(pending, max(0, engine_active - decoding))
    return decoding + known, queued + pending - known
