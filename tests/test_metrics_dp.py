"""The server's metrics with several data-parallel engines: every ``vllm:`` series once per engine, labelled
``engine="<index>"`` as vLLM 0.26's PrometheusStatLogger labels each engine core's, with that engine's own values
(``vllm:cache_config_info`` labelled with the engines' summed pool on each, as vLLM 0.26); rapidserve's own series
stay the whole server's, labelled by model."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rapidserve.config import CacheConfig
from rapidserve.engine.messages import StepKindStats
from rapidserve.server.metrics import Metrics

MODEL = "smollm2-135m"
CACHE = CacheConfig(block_size=16, gpu_memory_utilization=0.85)


class Engine(NamedTuple):
    """One engine's row: its Stats and the requests it served."""

    index: int
    blocks: int  # its pool
    free: int
    running: int
    waiting: int
    preemptions: int
    prefix: tuple[int, int]  # prefix cache queries, hits
    ttfts: tuple[float, ...]  # one request each: its time to first token
    itl: float  # every later token's gap
    output: int  # output tokens of each request
    prompt: int  # prompt tokens of each request
    reason: str  # how each ended


# two engines of different pools and loads
TABLE = [
    Engine(0, 500, 100, 3, 1, 2, (40, 10), (0.05, 0.2, 0.3), 0.02, 6, 12, "stop"),
    Engine(1, 300, 300, 0, 2, 0, (8, 8), (1.5,), 0.4, 3, 100, "length"),
]


def two_engines() -> Metrics:
    m = Metrics(MODEL, 2048, CACHE, engines=2)
    for e in TABLE:
        for ttft in e.ttfts:
            m.add_prompt_tokens(e.prompt, e.index)
            m.observe_first_token(ttft, e.index)
            for _ in range(e.output - 1):
                m.observe_token(e.itl, e.index)
            m.observe_finished(ttft + e.itl * (e.output - 1), e.prompt, e.output, e.reason, ttft_s=ttft,
                               max_tokens=e.output, engine=e.index)
            m.observe_samples_done([e.output], 1, e.index)
        m.set_engine(e.index, e.running, e.waiting, e.blocks, e.free, e.preemptions, *e.prefix)
    m.set_partition("d25+none", 1, {"d25": 7})
    m.set_step_stats({"split": StepKindStats(9, 90.0)}, {"split": 1.1})
    return m


def parsed(m: Metrics) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """The exposition through prometheus_client's parser: family -> samples (name, labels, value)."""
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples]
            for f in text_string_to_metric_families(m.render()[0].decode())}


def of(fams: dict[str, list[tuple[str, dict[str, str], float]]], sample: str, engine: int,
       **labels: str) -> float:
    (v,) = [v for fam in fams.values() for n, lab, v in fam
            if n == sample and lab.get("engine") == str(engine) and labels.items() <= lab.items()]
    return v


@pytest.mark.parametrize("e", TABLE, ids=lambda e: f"engine{e.index}")
def test_each_engine_has_its_own_series(e: Engine) -> None:
    fams = parsed(two_engines())
    assert of(fams, "vllm:num_requests_running", e.index) == e.running
    assert of(fams, "vllm:num_requests_waiting", e.index) == e.waiting
    assert of(fams, "vllm:kv_cache_usage_perc", e.index) == pytest.approx(1 - e.free / e.blocks)
    assert of(fams, "vllm:num_preemptions_total", e.index) == e.preemptions
    assert (of(fams, "vllm:prefix_cache_queries_total", e.index),
            of(fams, "vllm:prefix_cache_hits_total", e.index)) == e.prefix
    n = len(e.ttfts)
    assert of(fams, "vllm:time_to_first_token_seconds_count", e.index) == n
    assert of(fams, "vllm:time_to_first_token_seconds_sum", e.index) == pytest.approx(sum(e.ttfts))
    assert of(fams, "vllm:inter_token_latency_seconds_count", e.index) == n * (e.output - 1)
    assert of(fams, "vllm:inter_token_latency_seconds_sum", e.index) == pytest.approx(n * (e.output - 1) * e.itl)
    assert of(fams, "vllm:request_time_per_output_token_seconds_sum", e.index) == pytest.approx(n * e.itl)
    assert of(fams, "vllm:e2e_request_latency_seconds_count", e.index) == n
    assert of(fams, "vllm:prompt_tokens_total", e.index) == n * e.prompt
    assert of(fams, "vllm:generation_tokens_total", e.index) == n * e.output
    assert of(fams, "vllm:request_prompt_tokens_sum", e.index) == n * e.prompt
    assert of(fams, "vllm:request_params_max_tokens_sum", e.index) == n * e.output
    assert of(fams, "vllm:request_max_num_generation_tokens_count", e.index) == n
    assert of(fams, "vllm:request_params_n_count", e.index) == n
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert of(fams, "vllm:request_success_total", e.index, finished_reason=reason) == (n if reason == e.reason
                                                                                            else 0)
    (info,) = [lab for _, lab, v in fams["vllm:cache_config_info"] if lab["engine"] == str(e.index) and v == 1]
    assert info["num_gpu_blocks"] == str(sum(x.blocks for x in TABLE)) and info["block_size"] == "16"  # vLLM's sum


def test_every_vllm_series_exists_for_every_engine_and_rapidserve_series_for_the_server() -> None:
    fams = parsed(Metrics(MODEL, 2048, CACHE, engines=2))  # nothing observed: all pre-created, as vLLM's
    for name, samples in fams.items():
        if name.startswith("vllm:"):
            if name == "vllm:cache_config_info":
                assert samples == []  # once each engine has reported its pool
                continue
            assert {lab["engine"] for _, lab, _ in samples} == {"0", "1"}, name
            assert {lab["model_name"] for _, lab, _ in samples} == {MODEL}, name
            assert all(v == 0 for _, _, v in samples), name
        else:
            assert name.startswith("rapidserve:") and all("engine" not in lab for _, lab, _ in samples), name
    # vLLM 0.26 pre-creates request_success for every FinishReason (vllm/v1/engine/__init__.py), in its order
    assert [(lab["engine"], lab["finished_reason"]) for _, lab, _ in fams["vllm:request_success"]] == [
        (e, r) for e in "01" for r in ("stop", "length", "abort", "error", "repetition")]
    fams = parsed(two_engines())
    assert {lab["engine"]: lab["num_gpu_blocks"] for _, lab, _ in fams["vllm:cache_config_info"]} == {
        "0": "800", "1": "800"}  # the engines' sum on each, as vLLM 0.26
    assert [(n, lab) for n, lab, _ in fams["rapidserve:partition_info"]] == [
        ("rapidserve:partition_info", {"model_name": MODEL, "config": "d25+none"})]
    assert [v for n, lab, v in fams["rapidserve:steps"] if lab["kind"] == "split"] == [9]


def test_one_engine_restarting_moves_only_its_own_series() -> None:
    m = two_engines()
    m.engine_down(1)  # restarting: no pool now, its counts stay
    fams = parsed(m)
    assert of(fams, "vllm:kv_cache_usage_perc", 1) == 0
    assert of(fams, "vllm:kv_cache_usage_perc", 0) == pytest.approx(0.8)
    assert of(fams, "vllm:prefix_cache_queries_total", 1) == 8
    # back with a smaller pool and its counts from 0: its cache_config_info is replaced, its counters grow on
    m.set_engine(1, 1, 0, 200, 150, 1, 5, 1)
    fams = parsed(m)
    assert {lab["engine"]: lab["num_gpu_blocks"] for _, lab, _ in fams["vllm:cache_config_info"]} == {
        "0": "700", "1": "700"}  # one current series each, the new sum
    assert of(fams, "vllm:prefix_cache_queries_total", 1) == 13
    assert of(fams, "vllm:num_preemptions_total", 1) == 1
    assert of(fams, "vllm:kv_cache_usage_perc", 1) == pytest.approx(0.25)
    assert of(fams, "vllm:prefix_cache_queries_total", 0) == 40  # engine 0 untouched


def test_cache_config_info_waits_for_every_engine() -> None:
    """vLLM 0.26 labels cache_config_info once, with every engine's pool summed (core_client's
    _apply_ready_response runs for each engine before the loggers exist): never a partial sum that a second series
    then replaces."""
    m = Metrics(MODEL, 2048, CACHE, engines=3)
    m.set_engine(0, 0, 0, 64, 64, 0)
    m.set_engine(2, 0, 0, 32, 32, 0)
    m.engine_down(1)  # still starting
    assert parsed(m)["vllm:cache_config_info"] == []
    m.set_engine(1, 0, 0, 64, 64, 0)
    m.set_engine(0, 0, 0, 64, 60, 0)  # (its pool unchanged)
    info = [(lab["engine"], lab["num_gpu_blocks"], v) for _, lab, v in parsed(m)["vllm:cache_config_info"]]
    assert sorted(info) == [("0", "160", 1), ("1", "160", 1), ("2", "160", 1)]


@pytest.mark.parametrize("engines", [1, 2])
def test_an_engine_index_outside_the_engines_is_refused(engines: int) -> None:
    """Every engine's series are made at construction (vLLM pre-creates them): an index outside 0..N-1 is a bug in
    the caller, not a new engine to add series for."""
    m = Metrics(MODEL, 2048, CACHE, engines=engines)
    for bad in (-1, engines):
        with pytest.raises(ValueError, match=f"no engine {bad}: the engines are 0..{engines - 1}"):
            m.observe_first_token(0.1, bad)
        with pytest.raises(ValueError, match="no engine"):
            m.set_engine(bad, 0, 0, 10, 10, 0)
    m.observe_first_token(0.1, engines - 1)
    fams = parsed(m)
    assert {lab["engine"] for _, lab, _ in fams["vllm:time_to_first_token_seconds"]} == {str(i) for i in
                                                                                          range(engines)}
