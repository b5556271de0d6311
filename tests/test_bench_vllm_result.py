"""rapidserve.benchmark.serving_result: a run as vLLM's `bench serve` reports it (its figures, its printed table, its
--save-result JSON and file name), and --burstiness's gamma arrivals. Pure functions, hand-made records."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rapidserve.benchmark.arrivals import arrival_times, rate_rng
from rapidserve.benchmark.serving_result import (
    DETAILED,
    metric_stats,
    peak_output,
    percentile_word,
    result_block,
    result_filename,
    saved_result,
    serving_metrics,
)
from rapidserve.benchmark.stats import RequestRecord, summarize

# vLLM's `bench serve --save-result` fields (vllm/benchmarks/serve.py): the setup, the traffic, the run, then
# mean/median/std/p<P> of each metric; DETAILED only with --save-detailed.
VLLM_HEAD = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput"]
VLLM_LISTS = ["input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
              "generated_texts", "errors"]
VLLM_TAIL = ["max_output_tokens_per_s", "max_concurrent_requests", "rtfx"]


def records() -> list[RequestRecord]:
    """r0: 4 tokens at 0.1, 0.3, 0.6, 1.0 s (held 0.05 s by the concurrency cap); r1: one token at 0.7 s; r2 failed."""
    return [
        RequestRecord(0, 10, 4, scheduled_s=0.0, start_s=0.05, success=True, output_tokens=4, ttft_s=0.1, e2e_s=1.0,
                      itl_s=[0.2, 0.3, 0.4], generated_text="a b c d"),
        RequestRecord(1, 20, 4, scheduled_s=0.5, start_s=0.5, success=True, output_tokens=1, ttft_s=0.2, e2e_s=0.2,
                      generated_text="e"),
        RequestRecord(2, 7, 4, scheduled_s=0.6, start_s=0.6, error="HTTP 400: no"),
    ]


def run_of(recs: list[RequestRecord], rate: float | str = 2.0, **extra: object) -> dict[str, object]:
    return {"rate": rate, "summary": summarize(recs, {"ttft": 150.0}), "requests": [r.to_json() for r in recs],
            **extra}


def test_serving_metrics_are_vllms_figures() -> None:
    recs = records()
    m = serving_metrics(recs, summarize(recs, {"ttft": 150.0}), ("ttft", "tpot", "itl", "e2el", "client_queue_time"),
                        (50.0, 99.0))
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 5)
    assert m["duration"] == pytest.approx(1.0) and m["request_throughput"] == pytest.approx(2.0)
    assert m["request_goodput"] == pytest.approx(1.0)  # r0's TTFT 100 ms <= 150; r1's 200 is not; r2 failed
    assert m["input_lens"] == [10, 20, 7] and m["output_lens"] == [4, 1, 0]  # a failure's output: 0, as vLLM
    assert m["ttfts"] == [0.1, 0.2, 0.0] and m["itls"] == [[0.2, 0.3, 0.4], [], []]
    assert m["latencies"] == [1.0, 0.2, 0.0]
    assert m["errors"] == ["", "", "HTTP 400: no"] and m["generated_texts"] == ["a b c d", "e", ""]
    assert m["queue_times"] == pytest.approx([0.05, 0.0, 0.0]) and m["start_times"] == [0.05, 0.5, 0.6]
    assert (m["max_output_tokens_per_s"], m["max_concurrent_requests"]) == (4.0, 2)
    # ttft over the completed requests; tpot only over those with more than one output token
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["std_ttft_ms"]) == pytest.approx((150.0, 150.0, 50.0))
    assert m["p99_ttft_ms"] == pytest.approx(float(np.percentile([100.0, 200.0], 99)))
    assert m["p50_ttft_ms"] == pytest.approx(150.0)
    assert (m["mean_tpot_ms"], m["std_tpot_ms"], m["p99_tpot_ms"]) == pytest.approx((300.0, 0.0, 300.0))
    assert (m["mean_itl_ms"], m["median_itl_ms"]) == pytest.approx((300.0, 300.0))
    assert m["mean_e2el_ms"] == pytest.approx(600.0) and m["mean_client_queue_time_ms"] == pytest.approx(25.0)
    assert not any(k.endswith("_e2el_including_client_queue_ms") for k in m)  # not asked for


def test_statistics_over_nothing_are_zero_as_vllm_writes_them() -> None:
    failed = [RequestRecord(0, 5, 3, error="timeout after 1 s")]
    m = serving_metrics(failed, summarize(failed))
    stats = ("mean", "median", "std", "p99")
    assert all(m[f"{s}_{k}_ms"] == 0.0 for s in stats for k in ("ttft", "tpot", "itl", "e2el"))
    assert (m["max_output_tokens_per_s"], m["max_concurrent_requests"]) == (0.0, 0) and m["request_goodput"] is None
    assert metric_stats([], [90.0]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0}


@pytest.mark.parametrize("p,word", [(99.0, "99"), (50.0, "50"), (99.9, "99.9"), (0.0, "0"), (12.5, "12.5")])
def test_percentile_word(p: float, word: str) -> None:
    assert percentile_word(p) == word


def test_peak_concurrency_counts_an_end_before_a_start_at_the_same_time() -> None:
    a = RequestRecord(0, 1, 1, start_s=0.0, success=True, output_tokens=1, ttft_s=0.5, e2e_s=1.0)
    b = RequestRecord(1, 1, 1, start_s=1.0, success=True, output_tokens=1, ttft_s=0.5, e2e_s=1.0)
    assert peak_output([a, b]) == (1.0, 1)  # [0, 1) and [1, 2): never both in flight; one token in each second


def table_row(label: str, value: str) -> str:
    return f"{label:<40} {value:<10}"


def test_result_block_is_vllms_table() -> None:
    recs = records()
    run = run_of(recs, prefix_cache={"hit_rate": 0.25}, ttft_phases_ms={"queue": 1.5},
                 partition={"switches": 3, "decode_steps": {"split16": 30, "overallocated": 10}},
                 server_steps={"fused": {"steps": 75, "over_slo": 3}, "alone": {"steps": 25, "over_slo": 0}})
    m = serving_metrics(recs, run["summary"], ("ttft", "itl"), (50.0, 99.0))  # type: ignore[arg-type]
    lines = result_block(run, m, ("ttft", "itl"), (50.0, 99.0), max_concurrency=4).splitlines()
    assert lines[:2] == ["Failed requests during benchmark run detected (capping to 10):", "Error (1x): HTTP 400: no"]
    top = lines.index("============ Serving Benchmark Result ============")
    assert lines[-1] == "=" * 50 and all(len(x) == 50 for x in lines[top:] if not x[0].isalnum())
    assert lines[top + 1:top + 6] == [table_row("Successful requests:", "2"), table_row("Failed requests:", "1"),
                                      table_row("Maximum request concurrency:", "4"),
                                      table_row("Request rate configured (RPS):", "2.00"),
                                      table_row("Benchmark duration (s):", "1.00")]
    for row in (table_row("Total input tokens:", "30"), table_row("Total generated tokens:", "5"),
                table_row("Request goodput (req/s):", "1.00"), table_row("Peak concurrent requests:", "2.00"),
                table_row("Peak output token throughput (tok/s):", "4.00"),
                table_row("Median TTFT (ms):", "150.00"), table_row("P50 TTFT (ms):", "150.00"),
                table_row("Mean ITL (ms):", "300.00"), table_row("Prefix cache hit rate (%):", "25.00"),
                table_row("Mean queue time to 1st token (ms):", "1.50"), table_row("Partition switches:", "3"),
                table_row("Decode steps on split16 (%):", "75.00"),
                table_row("Steps fused (% / % over SLO):", "75.0 / 4.0"),
                table_row("Steps alone (% / % over SLO):", "25.0 / 0.0")):
        assert row in lines, row
    sections = [x.strip("-") for x in lines if x.startswith("-")]
    assert sections == ["Time to First Token", "Inter-token Latency", "Server counters (/metrics)"]
    assert "TPOT" not in "\n".join(lines) and "{" not in "\n".join(lines)  # only the metrics asked; no raw dicts
    closed = result_block(run_of(recs[:2], "inf"), serving_metrics(recs[:2], summarize(recs[:2])))
    assert "Request rate configured" not in closed and "Maximum request concurrency" not in closed
    assert "Request goodput" not in closed and "Error" not in closed and "End-to-end Latency" in closed


def test_saved_result_has_vllms_fields_in_its_order() -> None:
    recs = records()
    run = run_of(recs)
    result = {"model": "org/m", "config": {"label": None, "burstiness": 0.5, "max_concurrency": 4}, "runs": [run]}
    m = serving_metrics(recs, run["summary"], ("ttft", "tpot"), (99.0,))  # type: ignore[arg-type]
    metric_keys = [f"{s}_{k}_ms" for k in ("ttft", "tpot") for s in ("mean", "median", "std", "p99")]
    short = saved_result(result, run, m, "20261128-101500", metadata={"tp": "1"})
    kept = [k for k in VLLM_LISTS if k not in DETAILED]
    assert list(short) == [*VLLM_HEAD[:7], "tp", *VLLM_HEAD[7:], *kept, *VLLM_TAIL, *metric_keys]
    assert (short["date"], short["backend"], short["endpoint_type"], short["model_id"]) == (
        "20261128-101500", "openai", "openai", "org/m")
    assert (short["label"], short["tokenizer_id"], short["num_prompts"], short["request_rate"]) == (None, None, 3, 2.0)
    assert (short["burstiness"], short["max_concurrency"], short["tp"]) == (0.5, 4, "1")
    detailed = saved_result(result, {**run, "rate": "inf"}, m, "d", detailed=True)
    assert list(detailed) == [*VLLM_HEAD, *VLLM_LISTS, *VLLM_TAIL, *metric_keys] and detailed["request_rate"] == "inf"
    turns = [RequestRecord(i, 5, 2, conversation=i // 3, turn=i % 3) for i in range(6)]
    assert saved_result(result, run_of(turns), m, "d")["num_prompts"] == 2  # multi-turn: conversations


@pytest.mark.parametrize("args,name", [
    ((None, 8.0, None, "org/m", "D"), "openai-8.0qps-m-D.json"),
    (("rapid", math.inf, 16, "m", "D"), "rapid-infqps-concurrency16-m-D.json"),
    (("x", 0.5, None, "/models/qwen", "D", "out"), "out/x-0.5qps-qwen-D.json"),
    (("x", 0.5, None, "m", "D", "out", "mine.json"), "out/mine.json"),
    (("x", 0.5, None, "m", "D", None, "mine.json"), "mine.json"),
])
def test_result_filename_is_vllms(args: tuple, name: str) -> None:  # type: ignore[type-arg]
    assert result_filename(*args) == name


def gaps(b: float, rate: float = 10.0) -> np.ndarray:
    return np.diff(arrival_times(rate, "poisson", rate_rng(3, 0), num=20001, burstiness=b))


@pytest.mark.parametrize("b", [0.25, 1.0, 4.0])
def test_burstiness_is_the_gamma_shape_of_the_gaps(b: float) -> None:
    g = gaps(b)  # seeded: the same draws every time
    assert g.mean() == pytest.approx(0.1, rel=0.05)  # the offered rate is kept
    assert g.var() / g.mean() ** 2 == pytest.approx(1.0 / b, rel=0.1)  # squared coefficient of variation: 1 / shape


def test_burstiness_one_is_the_poisson_schedule_and_fixed_has_none() -> None:
    plain = arrival_times(5.0, "poisson", rate_rng(7, 1), num=50)
    assert plain.tolist() == arrival_times(5.0, "poisson", rate_rng(7, 1), num=50, burstiness=1.0).tolist()
    with pytest.raises(ValueError, match="fixed process has none"):
        arrival_times(5.0, "fixed", rate_rng(7, 1), num=5, burstiness=0.5)
    with pytest.raises(ValueError, match="positive finite"):
        arrival_times(5.0, "poisson", rate_rng(7, 1), num=5, burstiness=0.0)
