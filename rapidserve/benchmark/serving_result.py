"""A run of a sweep as vLLM's `bench serve` reports one: the figures of its result JSON (`--save-result`), the
"Serving Benchmark Result" table it prints, and the file name it saves under, so that runs of the two
compare line by line (pure functions, no I/O).

The figures are this package's (stats.py), computed over one run's records; where vLLM's differ:
- ITL is per token: a streamed chunk carrying k tokens adds k gaps of (gap / k); vLLM adds one gap per chunk.
  The same whenever every chunk carries one token (rapidserve and vLLM stream one token per chunk).
- The duration runs from the first request's send to the last one's end (vLLM: from before the first
  release to after the last response), so throughputs are the same figures as the markdown report's.
- `tokenizer_id` is null: prompts are token ids and output tokens are the server's usage counts, so no
  tokenizer is used (vLLM counts "Total generated tokens" with one).
- `num_prompts` is the arrivals this run released (requests; multi-turn: conversations).
As vLLM: a statistic over no values is 0.0; std is the population's (numpy's); percentiles interpolate
linearly; a request with one output token has no TPOT; a failed request's ttft and latency are 0.0, its
output length 0. The per-request lists `input_lens`, `output_lens`, `start_times`, `ttfts`, `itls`,
`generated_texts` and `errors` are kept only with `--save-detailed` (`latencies` and `queue_times` always).
`start_times` are seconds from the run's start (vLLM's are perf_counter readings).

Metrics (`--percentile-metrics`, SERVING_METRICS; default ttft,tpot,itl,e2el: vLLM's default leaves out
e2el): for each, `mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms` and `p<P>_<m>_ms` for each percentile P of
`--metric-percentiles` (default 99; P written as an integer when it is one: p99, p99.9). client_queue_time is
how long `--max-concurrency` held a request after its release; e2el_including_client_queue adds it to e2el.
Also `max_output_tokens_per_s` (the most tokens that arrived within one second, counted in one-second
buckets from the first send) and `max_concurrent_requests` (the most requests in flight at once).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rapidserve.benchmark.stats import RequestRecord

# metric -> (its name in the table, its section's title), in vLLM's order
SERVING_METRICS: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
}
DEFAULT_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES: tuple[float, ...] = (99.0,)
DETAILED: tuple[str, ...] = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
BACKEND = "openai"  # what vLLM calls a /v1/completions client
WIDTH = 50


def _zero_nan(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def queue_s(r: RequestRecord) -> float:
    """How long the concurrency cap held a request after its release (s)."""
    return max(0.0, r.start_s - r.scheduled_s)


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """The values (seconds) one metric's statistics are taken over: the completed requests' (every token's for itl;
    those with more than one output token for tpot)."""
    ok = [r for r in records if r.success]
    if metric == "ttft":
        return [r.ttft_s for r in ok]
    if metric == "tpot":
        return [r.tpot_s for r in ok if r.output_tokens > 1]
    if metric == "itl":
        return [x for r in ok for x in r.itl_s]
    if metric == "e2el":
        return [r.e2e_s for r in ok]
    if metric == "client_queue_time":
        return [queue_s(r) for r in ok]
    if metric == "e2el_including_client_queue":
        return [r.e2e_s + queue_s(r) for r in ok]
    raise ValueError(f"metric {metric!r} is not one of {', '.join(SERVING_METRICS)}")


def percentile_word(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9' (as vLLM names its keys and rows)."""
    return str(int(p)) if int(p) == p else str(p)


def metric_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and each percentile ('p99', ...) of durations in seconds, in ms (0.0 for none)."""
    xs = np.asarray(values_s if len(values_s) else [0.0], dtype=float)
    out = {"mean": float(np.mean(xs)) * 1e3, "median": float(np.median(xs)) * 1e3, "std": float(np.std(xs)) * 1e3}
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(np.percentile(xs, p)) * 1e3
    return out


def peak_output(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(the most output tokens that arrived within one one-second bucket counted from the first send, the most
    completed requests in flight at once)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_s for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        t = r.start_s + r.ttft_s
        for gap in [0.0, *r.itl_s]:
            t += gap
            buckets[int(t - t0)] = buckets.get(int(t - t0), 0) + 1
    events = sorted([(r.start_s, 1) for r in ok] + [(r.end_s, -1) for r in ok])  # an end before a start at a tie
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    return float(max(buckets.values())), peak


def serving_metrics(records: Sequence[RequestRecord], summary: Mapping[str, Any],
                    metrics: Sequence[str] = DEFAULT_METRICS,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The figures of vLLM's result JSON for one run (its keys, in its order), from the run's records and its
    summary (`stats.summarize`: the duration, counts, throughputs and SLO goodput)."""
    peak_tps, peak_conc = peak_output(records)
    s = summary
    out: dict[str, Any] = {
        "duration": s["duration_s"], "completed": s["completed"], "failed": s["failed"],
        "total_input_tokens": s["total_input_tokens"], "total_output_tokens": s["total_output_tokens"],
        "request_throughput": s["request_throughput"], "request_goodput": s["goodput"],
        "output_throughput": s["output_throughput"], "total_token_throughput": s["total_token_throughput"],
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [_zero_nan(r.ttft_s) if r.success else 0.0 for r in records],
        "itls": [list(r.itl_s) if r.success else [] for r in records],
        "latencies": [_zero_nan(r.e2e_s) if r.success else 0.0 for r in records],
        "start_times": [r.start_s for r in records],
        "queue_times": [queue_s(r) for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "max_output_tokens_per_s": peak_tps, "max_concurrent_requests": peak_conc, "rtfx": 0.0,
    }
    for m in metrics:
        for k, v in metric_stats(metric_values(records, m), percentiles).items():
            out[f"{k}_{m}_ms"] = v
    return out


def title_line(text: str, fill: str) -> str:
    return f"{text:{fill}^{WIDTH}}"


def table_row(label: str, value: Any) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value!s:<10}"


def server_rows(run: Mapping[str, Any]) -> list[str]:
    """The server's own counts over the run (GET /metrics before and after it), as table rows."""
    rows = []
    pc = (run.get("prefix_cache") or {}).get("hit_rate")
    if pc is not None:
        rows.append(table_row("Prefix cache hit rate (%):", 100.0 * pc))
    for name, ms in (run.get("ttft_phases_ms") or {}).items():
        rows.append(table_row(f"Mean {name} time to 1st token (ms):", float(ms)))
    part = run.get("partition")
    if part:
        rows.append(table_row("Partition switches:", int(part.get("switches", 0))))
        steps = part.get("decode_steps") or {}
        total = sum(steps.values()) or 1
        for k, v in sorted(steps.items(), key=lambda kv: -kv[1]):
            rows.append(table_row(f"Decode steps on {k} (%):", 100.0 * v / total))
    kinds = run.get("server_steps") or {}
    total = sum(d["steps"] for d in kinds.values()) or 1
    for k, d in kinds.items():  # the decode worker's steps by shape kind (step_mix.py)
        rows.append(table_row(f"Steps {k} (% / % over SLO):",
                              f"{100.0 * d['steps'] / total:.1f} / {100.0 * d['over_slo'] / d['steps']:.1f}"))
    return rows


def result_block(run: Mapping[str, Any], m: Mapping[str, Any], metrics: Sequence[str] = DEFAULT_METRICS,
                 percentiles: Sequence[float] = DEFAULT_PERCENTILES, max_concurrency: int | None = None) -> str:
    """One run's "Serving Benchmark Result" table, as `vllm bench serve` prints it (`m`: `serving_metrics`), with
    the failures' texts above it and rapidserve's own rows (the TTFT-rule goodput, outputs of another length, the
    server's counters) where they apply."""
    s = run["summary"]
    rate = float(run["rate"])
    lines = []
    if s["errors"]:
        lines.append("Failed requests during benchmark run detected (capping to 10):")
        lines += [f"Error ({n}x): {text}" for text, n in list(s["errors"].items())[:10]]
    lines += [title_line(" Serving Benchmark Result ", "="), table_row("Successful requests:", m["completed"]),
              table_row("Failed requests:", m["failed"])]
    if max_concurrency is not None:
        lines.append(table_row("Maximum request concurrency:", max_concurrency))
    if math.isfinite(rate):
        lines.append(table_row("Request rate configured (RPS):", rate))
    if run.get("time_scale") is not None:
        lines.append(table_row("Trace time scale:", float(run["time_scale"])))
    lines += [table_row("Benchmark duration (s):", float(m["duration"])),
              table_row("Total input tokens:", m["total_input_tokens"]),
              table_row("Total generated tokens:", m["total_output_tokens"]),
              table_row("Request throughput (req/s):", float(m["request_throughput"]))]
    if m["request_goodput"] is not None:
        lines.append(table_row("Request goodput (req/s):", float(m["request_goodput"])))
    lines += [table_row("Goodput, TTFT <= 1 s/1K prompt (req/s):", float(s["goodput_rapid_ttft"])),
              table_row("Output token throughput (tok/s):", float(m["output_throughput"])),
              table_row("Peak output token throughput (tok/s):", float(m["max_output_tokens_per_s"])),
              table_row("Peak concurrent requests:", float(m["max_concurrent_requests"])),
              table_row("Total token throughput (tok/s):", float(m["total_token_throughput"]))]
    if s.get("output_len_mismatches"):
        lines.append(table_row("Outputs not of the asked length:", s["output_len_mismatches"]))
    for key in metrics:
        name, header = SERVING_METRICS[key]
        lines += [title_line(header, "-"), table_row(f"Mean {name} (ms):", float(m[f"mean_{key}_ms"])),
                  table_row(f"Median {name} (ms):", float(m[f"median_{key}_ms"]))]
        lines += [table_row(f"P{percentile_word(p)} {name} (ms):", float(m[f"p{percentile_word(p)}_{key}_ms"]))
                  for p in percentiles]
    server = server_rows(run)
    if server:
        lines += [title_line("Server counters (/metrics)", "-"), *server]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def run_arrivals(run: Mapping[str, Any]) -> int:
    """The arrivals a run released: its requests, or its conversations (multi-turn)."""
    reqs = run.get("requests", [])
    convs = {q.get("conversation") for q in reqs if q.get("conversation") is not None}
    return len(convs) if convs else len(reqs)


def saved_result(result: Mapping[str, Any], run: Mapping[str, Any], m: Mapping[str, Any], date: str,
                 detailed: bool = False, metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What `vllm bench serve --save-result` writes for one run (its keys, in its order): the setup (`date`:
    YYYYmmdd-HHMMSS), `metadata` (--metadata KEY=VALUE), the traffic, then `m`, less the per-request lists
    DETAILED unless `detailed`."""
    cfg = result.get("config", {})
    rate = float(run["rate"])
    out: dict[str, Any] = {"date": date, "endpoint_type": BACKEND, "backend": BACKEND, "label": cfg.get("label"),
                           "model_id": result.get("model"), "tokenizer_id": None, "num_prompts": run_arrivals(run),
                           **dict(metadata or {}),
                           "request_rate": rate if math.isfinite(rate) else "inf",
                           "burstiness": cfg.get("burstiness", 1.0), "max_concurrency": cfg.get("max_concurrency")}
    out.update({k: v for k, v in m.items() if detailed or k not in DETAILED})
    return out


def result_filename(label: str | None, rate: float, max_concurrency: int | None, model_id: str, date: str,
                    result_dir: str | None = None, result_filename: str | None = None) -> str:
    """vLLM's name for a saved result: `<label>-<rate>qps[-concurrency<N>]-<model's last path part>-<date>.json`
    (label: --label, else the backend), or `result_filename`; in `result_dir` when given."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    name = result_filename or f"{label or BACKEND}-{float(rate)}qps{conc}-{model_id.split('/')[-1]}-{date}.json"
    return os.path.join(result_dir, name) if result_dir else name
