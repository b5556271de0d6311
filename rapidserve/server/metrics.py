"""Prometheus metrics of the HTTP server, named like vLLM's under the ``rapidserve:`` prefix.

Every `Metrics` owns a private `CollectorRegistry`, so several servers (or tests) in one process
never share series. Every series carries a ``model_name`` label. Exposed names:

* histograms ``rapidserve:time_to_first_token_seconds``, ``rapidserve:inter_token_latency_seconds``,
  ``rapidserve:request_time_per_output_token_seconds``, ``rapidserve:e2e_request_latency_seconds``,
  ``rapidserve:request_prompt_tokens``, ``rapidserve:request_generation_tokens``
  (each as ``_bucket``/``_sum``/``_count``);
* where the time to first token went, per request (histograms, seconds; the engine's `PhaseTimes`):
  ``rapidserve:request_queue_time_seconds`` (arrival to its first prompt chunk on the device) and
  ``rapidserve:request_prefill_time_seconds`` (first chunk queued to first token sampled), as vLLM's;
  ``rapidserve:request_admission_time_seconds`` (arrival to its KV blocks allocated: in rapid mode,
  the decode worker's handing it to prefill; part of the queue time) and
  ``rapidserve:request_first_token_handoff_seconds`` (first token sampled to the server holding it:
  in rapid mode the route prefill -> decode -> router); and, as vLLM's,
  ``rapidserve:request_decode_time_seconds`` (first token to the end) and
  ``rapidserve:request_inference_time_seconds`` (first chunk queued to the end);
* gauges ``rapidserve:num_requests_running``, ``rapidserve:num_requests_waiting`` (engine requests, from
  the server's own count of those in flight at the scrape: `request_gauges`), ``rapidserve:kv_cache_usage_perc``
  (0..1), ``rapidserve:partition_info{config="..."}`` (1, current only);
* counters ``rapidserve:prompt_tokens_total``, ``rapidserve:generation_tokens_total``,
  ``rapidserve:request_success_total{finished_reason="..."}`` (stop, length, abort: the client went
  away or the server stopped it, error: the engine failed it), ``rapidserve:num_preemptions_total``,
  ``rapidserve:engine_restarts_total``, ``rapidserve:engine_worker_deaths_total``,
  ``rapidserve:prefix_cache_queries_total`` and ``rapidserve:prefix_cache_hits_total`` (prompt tokens
  looked up in the prefix cache, and found there; vLLM's names), ``rapidserve:partition_steps_total{config="..."}``
  (decode steps launched in each compute partition configuration) and ``rapidserve:partition_switches_total``;
  ``rapidserve:request_rejected_total{reason="..."}``: HTTP requests refused with a 503 before reaching the
  engine, by the error code the client got (overloaded, engine_unavailable, server_shutting_down); they count
  no prompt tokens and are not in ``request_success_total``.

prometheus_client adds ``_total`` to counter names itself, so counters are created without it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Bucket boundaries as in vLLM (vllm/engine/metrics.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

# Reasons pre-created at 0 so that rate() works before the first request of each kind finishes.
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("overloaded", "engine_unavailable", "server_shutting_down")

_P = "rapidserve:"


class Metrics:
    """The server's metrics for one model; render() gives the /metrics response."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        reg, lab = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(_P + name, doc, lab, buckets=buckets, registry=reg)

        self._ttft = hist("time_to_first_token_seconds", "Time to first token in seconds.",
                          TTFT_BUCKETS).labels(model_name)
        self._itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens in seconds.",
                         ITL_BUCKETS).labels(model_name)
        self._tpot = hist("request_time_per_output_token_seconds",
                          "Per request: (e2e - ttft) / (output tokens - 1), in seconds.",
                          ITL_BUCKETS).labels(model_name)
        self._e2e = hist("e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                         E2E_BUCKETS).labels(model_name)
        self._req_prompt = hist("request_prompt_tokens", "Prompt tokens per finished request.",
                                TOKEN_BUCKETS).labels(model_name)
        self._req_gen = hist("request_generation_tokens", "Output tokens per finished request.",
                             TOKEN_BUCKETS).labels(model_name)

        def phase(name: str, doc: str) -> Histogram:
            return hist(name, doc, TTFT_BUCKETS).labels(model_name)

        self._queue = phase("request_queue_time_seconds", "Arrival to the first prompt chunk queued on the device.")
        self._prefill = phase("request_prefill_time_seconds", "First prompt chunk queued to the first token sampled.")
        self._admission = phase("request_admission_time_seconds", "Arrival to the request's KV blocks allocated.")
        self._handoff = phase("request_first_token_handoff_seconds",
                              "First token sampled to the server holding it.")
        self._decode = hist("request_decode_time_seconds", "First token to the request's end.",
                            E2E_BUCKETS).labels(model_name)
        self._inference = hist("request_inference_time_seconds", "First prompt chunk queued to the request's end.",
                               E2E_BUCKETS).labels(model_name)

        self._running = Gauge(_P + "num_requests_running", "Requests being prefilled or decoded.", lab,
                              registry=reg).labels(model_name)
        self._waiting = Gauge(_P + "num_requests_waiting", "Requests waiting (engine and server queues).", lab,
                              registry=reg).labels(model_name)
        self._kv_usage = Gauge(_P + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", lab,
                               registry=reg).labels(model_name)
        self._partition = Gauge(_P + "partition_info", "Current compute partition (value 1 for the current config).",
                                ["model_name", "config"], registry=reg)
        self._partition_now: str | None = None

        self._prompt_tokens = Counter(_P + "prompt_tokens", "Prompt tokens admitted.", lab,
                                      registry=reg).labels(model_name)
        self._gen_tokens = Counter(_P + "generation_tokens", "Output tokens of finished requests.", lab,
                                   registry=reg).labels(model_name)
        self._success = Counter(_P + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self._success.labels(model_name, reason)
        self._rejected = Counter(_P + "request_rejected", "Requests refused (503) before reaching the engine, by "
                                 "error code.", ["model_name", "reason"], registry=reg)
        for reason in REJECT_REASONS:
            self._rejected.labels(model_name, reason)
        self._preemptions = Counter(_P + "num_preemptions", "Preemptions by the engine.", lab,
                                    registry=reg).labels(model_name)
        self._preemptions_seen = 0
        self._restarts = Counter(_P + "engine_restarts", "Engine worker restarts since the server started.", lab,
                                 registry=reg).labels(model_name)
        self._deaths = Counter(_P + "engine_worker_deaths", "Engine worker deaths since the server started.", lab,
                               registry=reg).labels(model_name)
        self._restarts_seen = self._deaths_seen = 0
        self._prefix_queries = Counter(_P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                       lab, registry=reg).labels(model_name)
        self._prefix_hits = Counter(_P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", lab,
                                    registry=reg).labels(model_name)
        self._prefix_seen = (0, 0)
        self._partition_steps = Counter(_P + "partition_steps", "Decode steps launched, per compute partition "
                                        "configuration.", ["model_name", "config"], registry=reg)
        self._partition_switches = Counter(_P + "partition_switches", "Compute partition switches.", lab,
                                           registry=reg).labels(model_name)
        self._steps_seen: dict[str, int] = {}
        self._switches_seen = 0

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
        self._success.labels(self.model_name, str(finish_reason)).inc()
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
        seen = self._preemptions_seen
        delta = num_preemptions - seen if num_preemptions >= seen else num_preemptions
        if delta > 0:
            self._preemptions.inc(delta)
        self._preemptions_seen = num_preemptions
        if partition != self._partition_now:
            if self._partition_now is not None:
                self._partition.remove(self.model_name, self._partition_now)
            self._partition.labels(self.model_name, partition).set(1)
            self._partition_now = partition

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
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def request_gauges(queued: int, pending: int, decoding: int, engine_active: int | None) -> tuple[int, int]:
    """(running, waiting) engine requests at a scrape, from the server's exact counts of its requests in flight:
    `queued` (admitted, not yet handed to the engine), `pending` (in the engine, no token yet) and `decoding`
    (a token came). Only which pending ones are being prefilled is the engine's to know: `engine_active`
    (running + prefilling in the workers' latest periodic stats; None before any) minus those decoding, capped
    at `pending`, as stale stats may count requests that have ended since. A request that has ended is in
    neither, whatever the stats say; a decoding one that the engine preempted still counts as running."""
    known = 0 if engine_active is None else min(pending, max(0, engine_active - decoding))
    return decoding + known, queued + pending - known


def _delta(seen: int, now: int) -> int:
    """How much a cumulative engine count grew since `seen` (all of `now` after an engine restart)."""
    return now - seen if now >= seen else now
