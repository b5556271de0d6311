"""The server's Prometheus metrics: names, labels, observations, engine stats, isolation, parsing."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rapidserve.server.metrics import Metrics, request_gauges

MODEL = "smollm2-135m"


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """All exposed samples, keyed by (name, labels)."""
    body, _ = m.render()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def value(m: Metrics, name: str, **labels: str) -> float:
    return samples(m)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_render_lists_every_metric_with_model_label() -> None:
    m = Metrics(MODEL)
    m.set_engine_stats(1, 2, 100, 50, 0, "p60-d40")
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    label = f'model_name="{MODEL}"'
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds"):
        for suffix in ("_bucket", "_sum", "_count"):
            assert any(line.startswith(f"rapidserve:{hist}{suffix}{{") and label in line
                       for line in text.splitlines()), hist + suffix
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "partition_info", "prompt_tokens_total", "generation_tokens_total", "request_success_total"):
        assert any(line.startswith(f"rapidserve:{name}{{") and label in line for line in text.splitlines()), name
    # counters are not doubly suffixed
    assert "_total_total" not in text
    assert value(m, "rapidserve:request_success_total", finished_reason="stop") == 0


def test_histograms_move_with_observations() -> None:
    m = Metrics(MODEL)
    assert value(m, "rapidserve:time_to_first_token_seconds_count") == 0
    m.observe_first_token(0.2)
    m.observe_token(0.03)
    m.observe_token(0.05)
    assert value(m, "rapidserve:time_to_first_token_seconds_count") == 1
    assert value(m, "rapidserve:time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "rapidserve:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(m, "rapidserve:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert value(m, "rapidserve:inter_token_latency_seconds_count") == 2
    assert value(m, "rapidserve:inter_token_latency_seconds_sum") == pytest.approx(0.08)

    m.observe_finished(2.2, 7, 11, "stop", ttft_s=0.2)  # (2.2 - 0.2) / 10 = 0.2 s per output token
    assert value(m, "rapidserve:e2e_request_latency_seconds_count") == 1
    assert value(m, "rapidserve:e2e_request_latency_seconds_sum") == pytest.approx(2.2)
    assert value(m, "rapidserve:request_time_per_output_token_seconds_count") == 1
    assert value(m, "rapidserve:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "rapidserve:generation_tokens_total") == 11
    assert value(m, "rapidserve:request_success_total", finished_reason="stop") == 1
    assert value(m, "rapidserve:request_success_total", finished_reason="length") == 0

    # one output token, or no ttft: no time per output token
    m.observe_finished(0.5, 3, 1, "length", ttft_s=0.5)
    m.observe_finished(0.1, 3, 0, "abort")
    assert value(m, "rapidserve:request_time_per_output_token_seconds_count") == 1
    assert value(m, "rapidserve:e2e_request_latency_seconds_count") == 3
    assert value(m, "rapidserve:generation_tokens_total") == 12
    assert value(m, "rapidserve:request_success_total", finished_reason="length") == 1
    assert value(m, "rapidserve:request_success_total", finished_reason="abort") == 1


def test_prompt_tokens_counter() -> None:
    m = Metrics(MODEL)
    m.add_prompt_tokens(5)
    m.add_prompt_tokens(0)
    m.add_prompt_tokens(37)
    assert value(m, "rapidserve:prompt_tokens_total") == 42


def test_gauges_follow_engine_stats() -> None:
    m = Metrics(MODEL)
    m.set_engine_stats(num_running=3, num_waiting=4, kv_blocks_total=200, kv_blocks_free=150, num_preemptions=2,
                       partition="none")
    assert value(m, "rapidserve:num_requests_running") == 3
    assert value(m, "rapidserve:num_requests_waiting") == 4
    assert value(m, "rapidserve:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(m, "rapidserve:num_preemptions_total") == 2
    m.set_engine_stats(0, 0, 200, 200, 5, "none")
    assert value(m, "rapidserve:num_requests_running") == 0
    assert value(m, "rapidserve:kv_cache_usage_perc") == 0
    assert value(m, "rapidserve:num_preemptions_total") == 5  # cumulative engine count, not summed
    m.set_engine_stats(0, 0, 200, 0, 1, "none")  # engine restarted: its count starts again
    assert value(m, "rapidserve:kv_cache_usage_perc") == 1
    assert value(m, "rapidserve:num_preemptions_total") == 6
    m.set_engine_stats(0, 0, 0, 0, 1, "none")  # no pool yet
    assert value(m, "rapidserve:kv_cache_usage_perc") == 0


def test_partition_info_switches() -> None:
    m = Metrics(MODEL)
    m.set_engine_stats(0, 0, 10, 10, 0, "p50-d50")
    assert value(m, "rapidserve:partition_info", config="p50-d50") == 1
    m.set_engine_stats(0, 0, 10, 10, 0, "p70-d30")
    current = {dict(labels)["config"]: v for (name, labels), v in samples(m).items()
               if name == "rapidserve:partition_info"}
    assert current == {"p70-d30": 1}
    m.set_engine_stats(0, 0, 10, 10, 0, "p70-d30")
    m.set_engine_stats(0, 0, 10, 10, 0, "p50-d50")
    current = {dict(labels)["config"]: v for (name, labels), v in samples(m).items()
               if name == "rapidserve:partition_info"}
    assert current == {"p50-d50": 1}


def test_instances_are_independent() -> None:
    a, b = Metrics(MODEL), Metrics(MODEL)  # same name twice: no duplicate-registration error
    a.observe_first_token(0.1)
    a.add_prompt_tokens(9)
    a.set_engine_stats(2, 0, 10, 5, 0, "x")
    assert value(a, "rapidserve:time_to_first_token_seconds_count") == 1
    assert value(b, "rapidserve:time_to_first_token_seconds_count") == 0
    assert value(b, "rapidserve:prompt_tokens_total") == 0
    assert value(b, "rapidserve:num_requests_running") == 0
    assert a.registry is not b.registry


def test_output_parses_with_expected_types() -> None:
    m = Metrics(MODEL)
    m.observe_first_token(0.01)
    m.observe_finished(1.0, 2, 3, "stop", ttft_s=0.01)
    m.set_engine_stats(1, 1, 4, 2, 1, "none")
    body, _ = m.render()
    types = {fam.name: fam.type for fam in text_string_to_metric_families(body.decode())}
    assert types["rapidserve:time_to_first_token_seconds"] == "histogram"
    assert types["rapidserve:e2e_request_latency_seconds"] == "histogram"
    assert types["rapidserve:num_requests_running"] == "gauge"
    assert types["rapidserve:partition_info"] == "gauge"
    assert types["rapidserve:prompt_tokens"] == "counter"
    assert types["rapidserve:request_success"] == "counter"


def test_engine_restart_and_death_counters_follow_the_engine() -> None:
    m = Metrics(MODEL)
    assert value(m, "rapidserve:engine_restarts_total") == 0
    assert value(m, "rapidserve:engine_worker_deaths_total") == 0
    m.set_engine_counters(restarts_total=1, deaths_total=2)
    m.set_engine_counters(restarts_total=1, deaths_total=2)  # read again: not summed
    assert value(m, "rapidserve:engine_restarts_total") == 1
    assert value(m, "rapidserve:engine_worker_deaths_total") == 2
    m.set_engine_counters(restarts_total=3, deaths_total=3)
    assert value(m, "rapidserve:engine_restarts_total") == 3
    assert value(m, "rapidserve:engine_worker_deaths_total") == 3


def test_every_finish_reason_is_exposed_from_the_start() -> None:
    m = Metrics(MODEL)
    for reason in ("stop", "length", "abort", "error"):
        assert value(m, "rapidserve:request_success_total", finished_reason=reason) == 0


def test_partition_steps_and_switches_count_deltas() -> None:
    m = Metrics(MODEL)
    m.set_engine_stats(0, 0, 10, 10, 0, "a", partition_switches=2, partition_steps={"a": 5, "b": 3})
    m.set_engine_stats(0, 0, 10, 10, 0, "b", partition_switches=3, partition_steps={"a": 5, "b": 10})
    assert value(m, "rapidserve:partition_switches_total") == 3
    assert value(m, "rapidserve:partition_steps_total", config="a") == 5
    assert value(m, "rapidserve:partition_steps_total", config="b") == 10
    m.set_engine_stats(0, 0, 10, 10, 0, "a", partition_switches=1, partition_steps={"a": 4})  # engine restarted
    assert value(m, "rapidserve:partition_switches_total") == 4
    assert value(m, "rapidserve:partition_steps_total", config="a") == 9


@pytest.mark.parametrize(("arrival", "admitted", "started", "sampled", "held", "want"), [
    # queue, admission, prefill, hand-off (seconds)
    (10.0, 10.01, 10.05, 10.15, 10.17, (0.05, 0.01, 0.1, 0.02)),
    # an engine stamp a hair before the server's arrival (clock read order): 0, never negative
    (10.0, 9.9999, 9.9999, 10.1, 10.1, (0.0, 0.0, 0.1001, 0.0)),
])
def test_ttft_phases(arrival: float, admitted: float, started: float, sampled: float, held: float,
                     want: tuple[float, float, float, float]) -> None:
    m = Metrics(MODEL)
    m.observe_phases(arrival, admitted, started, sampled, held)
    names = ("request_queue_time_seconds", "request_admission_time_seconds", "request_prefill_time_seconds",
             "request_first_token_handoff_seconds")
    for name, w in zip(names, want, strict=True):
        assert value(m, f"rapidserve:{name}_count") == 1
        assert value(m, f"rapidserve:{name}_sum") == pytest.approx(w, abs=1e-9), name


def test_decode_and_inference_time() -> None:
    m = Metrics(MODEL)
    m.observe_finished(2.0, 5, 10, "stop", ttft_s=0.5, queue_s=0.1)
    m.observe_finished(1.0, 5, 0, "abort")  # never got a first token: neither
    assert value(m, "rapidserve:request_decode_time_seconds_count") == 1
    assert value(m, "rapidserve:request_decode_time_seconds_sum") == pytest.approx(1.5)
    assert value(m, "rapidserve:request_inference_time_seconds_count") == 1
    assert value(m, "rapidserve:request_inference_time_seconds_sum") == pytest.approx(1.9)


@pytest.mark.parametrize(("queued", "pending", "decoding", "engine_active", "want"), [
    (0, 0, 0, None, (0, 0)),
    (0, 0, 0, 5, (0, 0)),  # stale worker stats after every request ended: nothing is running
    (0, 3, 0, None, (0, 3)),  # no worker stats yet: none known to be prefilled
    (0, 3, 0, 1, (1, 2)),  # one of the three without a token is being prefilled
    (0, 3, 2, 3, (3, 2)),
    (0, 3, 2, 1, (2, 3)),  # stats older than the second decoder, or a preemption: decoding counts as running
    (2, 1, 1, 10, (2, 2)),  # stale and too high: capped at the pending ones; queued in the server always wait
    (1, 0, 0, 0, (0, 1)),
])
def test_request_gauges(queued: int, pending: int, decoding: int, engine_active: int | None,
                        want: tuple[int, int]) -> None:
    assert request_gauges(queued, pending, decoding, engine_active) == want
    running, waiting = want
    assert running + waiting == queued + pending + decoding  # every request in flight, once


def test_rejected_requests_are_counted_by_reason_without_prompt_tokens() -> None:
    m = Metrics(MODEL)
    for reason in ("overloaded", "engine_unavailable", "server_shutting_down"):
        assert value(m, "rapidserve:request_rejected_total", reason=reason) == 0  # exposed from the start
    m.observe_rejected("engine_unavailable")
    m.observe_rejected("engine_unavailable")
    m.observe_rejected("overloaded")
    assert value(m, "rapidserve:request_rejected_total", reason="engine_unavailable") == 2
    assert value(m, "rapidserve:request_rejected_total", reason="overloaded") == 1
    assert value(m, "rapidserve:prompt_tokens_total") == 0
    assert value(m, "rapidserve:request_success_total", finished_reason="error") == 0


def test_request_gauges_are_set_without_engine_stats() -> None:
    m = Metrics(MODEL)
    m.set_requests(2, 5)
    assert value(m, "rapidserve:num_requests_running") == 2
    assert value(m, "rapidserve:num_requests_waiting") == 5
