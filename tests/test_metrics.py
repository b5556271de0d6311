"""The server's Prometheus metrics: vLLM's names, types, labels and buckets, observations, engine stats,
isolation, parsing."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rapidserve.config import CacheConfig
from rapidserve.engine.messages import STEP_KINDS, StepKindStats
from rapidserve.server.metrics import Metrics, build_1_2_5_buckets, request_gauges

MODEL = "smollm2-135m"
MAX_LEN = 2048
CACHE = CacheConfig(block_size=16, gpu_memory_utilization=0.85)


def new() -> Metrics:
    return Metrics(MODEL, MAX_LEN, CACHE)


def samples(m: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """All exposed samples, keyed by (name, labels)."""
    body, _ = m.render()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def value(m: Metrics, name: str, **labels: str) -> float:
    """A sample's value; vLLM's series carry `engine` "0" besides `model_name`, rapidserve's only `model_name`."""
    own = {"model_name": MODEL} if name.startswith("rapidserve:") else {"model_name": MODEL, "engine": "0"}
    return samples(m)[(name, frozenset({**own, **labels}.items()))]


def test_render_lists_every_metric_with_model_label() -> None:
    m = new()
    m.set_engine_stats(1, 2, 100, 50, 0, "p60-d40")
    body, content_type = m.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    label = f'model_name="{MODEL}"'
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "e2e_request_latency_seconds"):
        for suffix in ("_bucket", "_sum", "_count"):
            assert any(line.startswith(f"vllm:{hist}{suffix}{{") and label in line and 'engine="0"' in line
                       for line in text.splitlines()), hist + suffix
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "request_success_total"):
        assert any(line.startswith(f"vllm:{name}{{") and label in line for line in text.splitlines()), name
    assert any(line.startswith("rapidserve:partition_info{") and label in line for line in text.splitlines())
    # counters are not doubly suffixed
    assert "_total_total" not in text
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0


def test_histograms_move_with_observations() -> None:
    m = new()
    assert value(m, "vllm:time_to_first_token_seconds_count") == 0
    m.observe_first_token(0.2)
    m.observe_token(0.03)
    m.observe_token(0.05)
    assert value(m, "vllm:time_to_first_token_seconds_count") == 1
    assert value(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.25") == 1
    assert value(m, "vllm:time_to_first_token_seconds_bucket", le="0.1") == 0
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.08)

    m.observe_finished(2.2, 7, 11, "stop", ttft_s=0.2)  # (2.2 - 0.2) / 10 = 0.2 s per output token
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(2.2)
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(m, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "vllm:generation_tokens_total") == 11
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="length") == 0

    # one output token, or no ttft: no time per output token
    m.observe_finished(0.5, 3, 1, "length", ttft_s=0.5)
    m.observe_finished(0.1, 3, 0, "abort")
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_count") == 3
    assert value(m, "vllm:generation_tokens_total") == 12
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1


def test_prompt_tokens_counter() -> None:
    m = new()
    m.add_prompt_tokens(5)
    m.add_prompt_tokens(0)
    m.add_prompt_tokens(37)
    assert value(m, "vllm:prompt_tokens_total") == 42


def test_gauges_follow_engine_stats() -> None:
    m = new()
    m.set_engine_stats(num_running=3, num_waiting=4, kv_blocks_total=200, kv_blocks_free=150, num_preemptions=2,
                       partition="none")
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 4
    assert value(m, "vllm:kv_cache_usage_perc") == pytest.approx(0.25)
    assert value(m, "vllm:num_preemptions_total") == 2
    m.set_engine_stats(0, 0, 200, 200, 5, "none")
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0
    assert value(m, "vllm:num_preemptions_total") == 5  # cumulative engine count, not summed
    m.set_engine_stats(0, 0, 200, 0, 1, "none")  # engine restarted: its count starts again
    assert value(m, "vllm:kv_cache_usage_perc") == 1
    assert value(m, "vllm:num_preemptions_total") == 6
    m.set_engine_stats(0, 0, 0, 0, 1, "none")  # no pool yet
    assert value(m, "vllm:kv_cache_usage_perc") == 0


def test_partition_info_switches() -> None:
    m = new()
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
    a, b = new(), new()  # same name twice: no duplicate-registration error
    a.observe_first_token(0.1)
    a.add_prompt_tokens(9)
    a.set_engine_stats(2, 0, 10, 5, 0, "x")
    assert value(a, "vllm:time_to_first_token_seconds_count") == 1
    assert value(b, "vllm:time_to_first_token_seconds_count") == 0
    assert value(b, "vllm:prompt_tokens_total") == 0
    assert value(b, "vllm:num_requests_running") == 0
    assert a.registry is not b.registry


def test_output_parses_with_expected_types() -> None:
    m = new()
    m.observe_first_token(0.01)
    m.observe_finished(1.0, 2, 3, "stop", ttft_s=0.01)
    m.set_engine_stats(1, 1, 4, 2, 1, "none")
    body, _ = m.render()
    types = {fam.name: fam.type for fam in text_string_to_metric_families(body.decode())}
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["vllm:e2e_request_latency_seconds"] == "histogram"
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["rapidserve:partition_info"] == "gauge"
    assert types["vllm:prompt_tokens"] == "counter"
    assert types["vllm:request_success"] == "counter"


def test_engine_restart_and_death_counters_follow_the_engine() -> None:
    m = new()
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
    m = new()
    for reason in ("stop", "length", "abort", "error"):
        assert value(m, "vllm:request_success_total", finished_reason=reason) == 0


def test_partition_steps_and_switches_count_deltas() -> None:
    m = new()
    m.set_engine_stats(0, 0, 10, 10, 0, "a", partition_switches=2, partition_steps={"a": 5, "b": 3})
    m.set_engine_stats(0, 0, 10, 10, 0, "b", partition_switches=3, partition_steps={"a": 5, "b": 10})
    assert value(m, "rapidserve:partition_switches_total") == 3
    assert value(m, "rapidserve:partition_steps_total", config="a") == 5
    assert value(m, "rapidserve:partition_steps_total", config="b") == 10
    m.set_engine_stats(0, 0, 10, 10, 0, "a", partition_switches=1, partition_steps={"a": 4})  # engine restarted
    assert value(m, "rapidserve:partition_switches_total") == 4
    assert value(m, "rapidserve:partition_steps_total", config="a") == 9


def test_prompts_handed_over_count_deltas() -> None:
    m = new()
    assert value(m, "rapidserve:prompts_handed_over_total") == 0  # exposed from the start
    m.set_hand_overs(3)
    m.set_hand_overs(7)
    assert value(m, "rapidserve:prompts_handed_over_total") == 7  # the engine's cumulative count, not summed
    m.set_hand_overs(2)  # the engine restarted: its new count adds on
    assert value(m, "rapidserve:prompts_handed_over_total") == 9


def test_step_series_by_kind_count_deltas_in_seconds() -> None:
    m = new()
    for kind in STEP_KINDS:  # pre-created at 0
        assert value(m, "rapidserve:steps_total", kind=kind) == 0
    assert not [k for k in samples(m) if k[0] == "rapidserve:step_correction_ratio"]  # no policy reported one
    m.set_step_stats({"fused": StepKindStats(10, 400.0, 2, 380.0, 400.0), "split": StepKindStats(4, 80.0)},
                     {"fused": 1.05, "split": 0.9, "decode": 1.0})
    m.set_step_stats({"fused": StepKindStats(12, 500.0, 3, 470.0, 490.0, 11, 560.0, 4, 6.0, 36.0),
                      "split": StepKindStats(4, 80.0)}, {"fused": 1.1, "split": 0.9, "decode": 1.0})
    want = {"rapidserve:steps_total": 12, "rapidserve:step_seconds_total": 0.5, "rapidserve:steps_over_slo_total": 3,
            "rapidserve:step_predicted_seconds_total": 0.47, "rapidserve:step_predicted_measured_seconds_total": 0.49,
            "rapidserve:step_gaps_total": 11, "rapidserve:step_gap_seconds_total": 0.56,
            "rapidserve:step_gaps_over_slo_total": 4, "rapidserve:step_idle_seconds_total": 0.006,
            "rapidserve:step_host_seconds_total": 0.036}
    for name, w in want.items():
        assert value(m, name, kind="fused") == pytest.approx(w), name
    assert value(m, "rapidserve:steps_total", kind="split") == 4
    assert value(m, "rapidserve:step_seconds_total", kind="split") == pytest.approx(0.08)
    assert value(m, "rapidserve:step_predicted_seconds_total", kind="split") == 0
    assert value(m, "rapidserve:steps_total", kind="alone") == 0
    assert value(m, "rapidserve:step_correction_ratio", kind="fused") == pytest.approx(1.1)
    assert value(m, "rapidserve:step_correction_ratio", kind="split") == pytest.approx(0.9)
    m.set_step_stats({"fused": StepKindStats(2, 60.0)}, {})  # the engine restarted: its new counts add on
    assert value(m, "rapidserve:steps_total", kind="fused") == 14
    assert value(m, "rapidserve:step_seconds_total", kind="fused") == pytest.approx(0.56)
    assert value(m, "rapidserve:step_correction_ratio", kind="fused") == pytest.approx(1.1)  # last reported


@pytest.mark.parametrize(("arrival", "admitted", "started", "sampled", "held", "want"), [
    # queue, admission, prefill, hand-off (seconds)
    (10.0, 10.01, 10.05, 10.15, 10.17, (0.05, 0.01, 0.1, 0.02)),
    # an engine stamp a hair before the server's arrival (clock read order): 0, never negative
    (10.0, 9.9999, 9.9999, 10.1, 10.1, (0.0, 0.0, 0.1001, 0.0)),
])
def test_ttft_phases(arrival: float, admitted: float, started: float, sampled: float, held: float,
                     want: tuple[float, float, float, float]) -> None:
    m = new()
    m.observe_phases(arrival, admitted, started, sampled, held)
    names = ("vllm:request_queue_time_seconds", "rapidserve:request_admission_time_seconds",
             "vllm:request_prefill_time_seconds", "rapidserve:request_first_token_handoff_seconds")
    for name, w in zip(names, want, strict=True):
        assert value(m, f"{name}_count") == 1
        assert value(m, f"{name}_sum") == pytest.approx(w, abs=1e-9), name


def test_decode_and_inference_time() -> None:
    m = new()
    m.observe_finished(2.0, 5, 10, "stop", ttft_s=0.5, queue_s=0.1)
    m.observe_finished(1.0, 5, 0, "abort")  # never got a first token: neither
    assert value(m, "vllm:request_decode_time_seconds_count") == 1
    assert value(m, "vllm:request_decode_time_seconds_sum") == pytest.approx(1.5)
    assert value(m, "vllm:request_inference_time_seconds_count") == 1
    assert value(m, "vllm:request_inference_time_seconds_sum") == pytest.approx(1.9)


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
    m = new()
    for reason in ("overloaded", "engine_unavailable", "server_shutting_down"):
        assert value(m, "rapidserve:request_rejected_total", reason=reason) == 0  # exposed from the start
    m.observe_rejected("engine_unavailable")
    m.observe_rejected("engine_unavailable")
    m.observe_rejected("overloaded")
    assert value(m, "rapidserve:request_rejected_total", reason="engine_unavailable") == 2
    assert value(m, "rapidserve:request_rejected_total", reason="overloaded") == 1
    assert value(m, "vllm:prompt_tokens_total") == 0
    assert value(m, "vllm:request_success_total", finished_reason="error") == 0


def test_request_gauges_are_set_without_engine_stats() -> None:
    m = new()
    m.set_requests(2, 5)
    assert value(m, "vllm:num_requests_running") == 2
    assert value(m, "vllm:num_requests_waiting") == 5


# vLLM 0.26's series (vllm/v1/metrics/loggers.py): type, extra labels beyond model_name and engine, buckets. (No
# vllm:time_per_output_token_seconds: 0.26 exports only its newer name, inter_token_latency_seconds.)
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # 1-2-5 up to max_model_len 2048
VLLM: dict[str, tuple[str, tuple[str, ...], list[float] | None]] = {
    "vllm:num_requests_running": ("gauge", (), None),
    "vllm:num_requests_waiting": ("gauge", (), None),
    "vllm:kv_cache_usage_perc": ("gauge", (), None),
    "vllm:prefix_cache_queries": ("counter", (), None),
    "vllm:prefix_cache_hits": ("counter", (), None),
    "vllm:num_preemptions": ("counter", (), None),
    "vllm:prompt_tokens": ("counter", (), None),
    "vllm:generation_tokens": ("counter", (), None),
    "vllm:request_success": ("counter", ("finished_reason",), None),
    "vllm:time_to_first_token_seconds": ("histogram", (), TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", (), ITL),
    "vllm:request_time_per_output_token_seconds": ("histogram", (), ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", (), LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", (), LATENCY),
    "vllm:request_prompt_tokens": ("histogram", (), TOKENS),
    "vllm:request_generation_tokens": ("histogram", (), TOKENS),
    "vllm:request_max_num_generation_tokens": ("histogram", (), TOKENS),
    "vllm:request_params_n": ("histogram", (), [1, 2, 5, 10, 20]),
    "vllm:request_params_max_tokens": ("histogram", (), TOKENS),
}
OWN = {"rapidserve:request_admission_time_seconds", "rapidserve:request_first_token_handoff_seconds",
       "rapidserve:partition_info", "rapidserve:partition_steps", "rapidserve:partition_switches",
       "rapidserve:engine_restarts", "rapidserve:engine_worker_deaths", "rapidserve:request_rejected",
       "rapidserve:steps", "rapidserve:step_seconds", "rapidserve:steps_over_slo", "rapidserve:step_predicted_seconds",
       "rapidserve:step_predicted_measured_seconds", "rapidserve:step_correction_ratio", "rapidserve:step_gaps",
       "rapidserve:step_gap_seconds", "rapidserve:step_gaps_over_slo", "rapidserve:step_idle_seconds",
       "rapidserve:step_host_seconds", "rapidserve:prompts_handed_over"}


def test_vllm_names_types_labels_and_buckets() -> None:
    m = new()
    m.observe_first_token(0.1)
    m.observe_token(0.02)
    m.observe_phases(1.0, 1.1, 1.2, 1.3, 1.4)
    m.observe_finished(1.0, 10, 5, "stop", ttft_s=0.1, queue_s=0.2, max_tokens=64)
    m.observe_samples_done([5, 3], 2)
    m.set_engine_stats(1, 0, 100, 50, 0, "none", partition_steps={"none": 1})
    m.set_step_stats({"fused": StepKindStats(1, 20.0)}, {"fused": 1.0})
    fams = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    for name, (typ, extra, buckets) in VLLM.items():
        fam = fams[name]
        assert fam.type == typ, name
        for s in fam.samples:
            want = {"model_name", "engine", *extra} | ({"le"} if s.name.endswith("_bucket") else set())
            assert set(s.labels) == want, (name, s.labels)
            assert s.labels["engine"] == "0" and s.labels["model_name"] == MODEL
        if buckets is not None:
            les = [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")]
            assert les == [*buckets, float("inf")], name
    assert set(fams) == set(VLLM) | OWN | {"vllm:cache_config_info"}  # every other series is rapidserve's own
    assert all(set(s.labels) - {"le", "config", "reason", "kind"} == {"model_name"} for n in OWN
               for s in fams[n].samples)


def test_no_created_series_and_no_global_switch() -> None:
    import prometheus_client.metrics as pm

    before = pm._use_created
    m = new()
    m.observe_finished(1.0, 3, 2, "stop", ttft_s=0.5)
    m.add_prompt_tokens(3)
    text = m.render()[0].decode()
    assert "_created" not in text
    assert not any(s.name.endswith("_created") for f in text_string_to_metric_families(text) for s in f.samples)
    assert pm._use_created == before  # prometheus_client's module setting is left alone


def test_cache_config_info() -> None:
    m = new()
    assert not any(n == "vllm:cache_config_info" for n, _ in samples(m))  # not before the engine reports its pool
    m.set_engine_stats(0, 0, 500, 500, 0, "none")
    info = [dict(labels) for (n, labels), v in samples(m).items() if n == "vllm:cache_config_info" and v == 1]
    assert info == [{"engine": "0", "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
                     "gpu_memory_utilization": "0.85", "kv_cache_memory_bytes": "None", "num_cpu_blocks": "None",
                     "num_gpu_blocks": "500",
                     "num_gpu_blocks_override": "None", "prefix_caching_hash_algo": "sha256", "swap_space": "0"}]
    m.set_engine_stats(0, 0, 400, 400, 0, "none")  # a restart with another pool size: one current series
    info = [dict(labels)["num_gpu_blocks"] for (n, labels), _ in samples(m).items() if n == "vllm:cache_config_info"]
    assert info == ["400"]


def test_request_params_and_max_generation_tokens() -> None:
    """vLLM 0.26: max_tokens with each finished engine request (a sample), n and the most generation tokens once per
    prompt (its parent request) when its samples are done."""
    m = new()
    for _ in range(3):
        m.observe_finished(1.0, 3, 4, "length", max_tokens=100)
    m.observe_finished(1.0, 3, 4, "length", max_tokens=None)  # max_tokens unset: not observed, as vLLM's
    assert value(m, "vllm:request_params_max_tokens_count") == 3
    assert value(m, "vllm:request_params_max_tokens_bucket", le="100.0") == 3
    m.observe_samples_done([4, 9, 2], 3)
    m.observe_samples_done([4], 1)
    m.observe_samples_done([])  # (no n: not observed)
    assert value(m, "vllm:request_params_n_count") == 2
    assert value(m, "vllm:request_params_n_sum") == 4
    assert value(m, "vllm:request_max_num_generation_tokens_count") == 2
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == 13


@pytest.mark.parametrize(("top", "want"), [(1, (1,)), (4, (1, 2)), (100, (1, 2, 5, 10, 20, 50, 100)),
                                           (32768, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000,
                                                    20000))])
def test_1_2_5_buckets(top: int, want: tuple[int, ...]) -> None:
    assert build_1_2_5_buckets(top) == want
