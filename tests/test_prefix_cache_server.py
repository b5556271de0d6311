"""Prefix caching (issue 15) through a real `rapidserve serve` on CPU (a tiny preset model, token-id prompts):
a prompt sent again reports its cached tokens in `usage.prompt_tokens_details.cached_tokens` (as OpenAI and
vLLM do), streamed with `stream_options.include_usage` too, and /metrics counts the prefix cache's queries
and hits under vLLM's names. `--no-enable-prefix-caching` finds nothing.

Requests here are sent one after another, so what the second of a pair finds is exact: the prompt's full
blocks of 16 tokens, leaving at least one token to compute (the largest multiple of 16 below its length).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.test_server import Srv, http, metric, start, stop

TINY = ("--model", "preset:tiny-llama", "--num-kv-blocks", "64", "--max-model-len", "1024")
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"
SERVERS = [("rapid", True), ("hybrid", True), ("rapid", False)]

_rng = random.Random(1515)


def _prompt(n: int) -> list[int]:
    return [_rng.randrange(3, 1280) for _ in range(n)]


def cached_of(n: int) -> int:
    """What an identical prompt of `n` tokens finds the second time."""
    return (n - 1) // 16 * 16


@pytest.fixture(scope="module", params=SERVERS, ids=lambda s: f"{s[0]}-cache-{'on' if s[1] else 'off'}")
def server(request: pytest.FixtureRequest) -> Iterator[tuple[Srv, bool]]:
    mode, caching = request.param
    s = start(*TINY, "--mode", mode, *(() if caching else ("--no-enable-prefix-caching",)))
    try:
        yield s, caching
    finally:
        assert stop(s) == 0


def post(s: Srv, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = http(s.url + path, "POST", json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw
    return json.loads(raw)  # type: ignore[no-any-return]


def post_stream(s: Srv, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, _, raw = http(s.url + path, "POST", json.dumps({**body, "stream": True}).encode(),
                          {"Content-Type": "application/json"})
    assert status == 200, raw
    events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    return [json.loads(e) for e in events[:-1]]


def body(prompt: list[int] | list[list[int]], **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, **kw}


def cached_in(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_second_request_reports_cached_tokens(server: tuple[Srv, bool]) -> None:
    s, caching = server
    for n in (70, 64, 12):  # many blocks; an exact multiple of the block size; below one block
        p = _prompt(n)
        first, second = post(s, "/v1/completions", body(p)), post(s, "/v1/completions", body(p))
        assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == n
        assert cached_in(first["usage"]) == 0
        assert cached_in(second["usage"]) == (cached_of(n) if caching else 0), second["usage"]
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # nothing changes but the work


def test_a_shared_prefix_is_found_by_another_prompt(server: tuple[Srv, bool]) -> None:
    s, caching = server
    system = _prompt(80)  # 5 full blocks
    post(s, "/v1/completions", body(system + _prompt(7)))
    r = post(s, "/v1/completions", body(system + _prompt(30)))
    assert cached_in(r["usage"]) == (80 if caching else 0)


def test_streamed_usage_reports_cached_tokens(server: tuple[Srv, bool]) -> None:
    s, caching = server
    p = _prompt(50)
    opts = {"stream_options": {"include_usage": True}}
    first = post_stream(s, "/v1/completions", body(p, **opts))
    second = post_stream(s, "/v1/completions", body(p, **opts))
    for events in (first, second):
        assert all("usage" not in e or e["usage"] is None for e in events[:-1])
        assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 50
    assert cached_in(first[-1]["usage"]) == 0
    assert cached_in(second[-1]["usage"]) == (48 if caching else 0)
    # without include_usage, no usage at all
    assert all(e.get("usage") is None for e in post_stream(s, "/v1/completions", body(p)))


def test_several_prompts_and_samples_count_each_prompt_once(server: tuple[Srv, bool]) -> None:
    s, caching = server
    a, b = _prompt(40), _prompt(100)
    post(s, "/v1/completions", body([a, b]))
    r = post(s, "/v1/completions", body([a, b]))
    assert r["usage"]["prompt_tokens"] == 140
    assert cached_in(r["usage"]) == (cached_of(40) + cached_of(100) if caching else 0)
    # n=2: the prompt is counted once (as in prompt_tokens), with what its first sample found
    r = post(s, "/v1/completions", body(a, n=2, temperature=1.0, seed=3))
    assert len(r["choices"]) == 2 and r["usage"]["prompt_tokens"] == 40
    assert cached_in(r["usage"]) == (cached_of(40) if caching else 0)


def test_openai_client_reads_cached_tokens(server: tuple[Srv, bool]) -> None:
    import openai

    s, caching = server
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    p = _prompt(33)
    c.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    r = c.completions.create(model=model, prompt=p, max_tokens=2, temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.usage.prompt_tokens_details.cached_tokens == (32 if caching else 0)


def settled(url: str, name: str, reads: int = 3, gap_s: float = 0.3, within_s: float = 20.0) -> float:
    """`name`'s value once it has stayed the same over `reads` reads `gap_s` apart (the engine publishes its stats
    every 0.25 s, so a request that ended before this call is counted by then however late its update comes)."""
    deadline = time.monotonic() + within_s
    last, same = metric(url, name), 1
    while same < reads:
        assert time.monotonic() < deadline, f"{name} did not settle within {within_s} s (last {last})"
        time.sleep(gap_s)
        now = metric(url, name)
        last, same = now, (same + 1 if now == last else 1)
    return last


def test_metrics_count_queries_and_hits(server: tuple[Srv, bool]) -> None:
    s, caching = server
    p = _prompt(90)
    q0, h0 = settled(s.url, QUERIES), metric(s.url, HITS)  # earlier tests' requests all counted before the baseline
    post(s, "/v1/completions", body(p))
    post(s, "/v1/completions", body(p))
    deadline = time.monotonic() + 10  # the engine's stats come every 0.25 s
    while caching and metric(s.url, QUERIES) < q0 + 180 and time.monotonic() < deadline:
        time.sleep(0.05)
    q, h = metric(s.url, QUERIES), metric(s.url, HITS)
    if caching:
        assert q == q0 + 180 and h == h0 + cached_of(90), (q0, h0, q, h)
        assert 0 < h < q
    else:
        time.sleep(0.6)
        assert metric(s.url, QUERIES) == metric(s.url, HITS) == 0


PHASES = ("queue_time", "admission_time", "prefill_time", "first_token_handoff")
PHASE_PREFIX = {"queue_time": "vllm", "prefill_time": "vllm", "admission_time": "rapidserve",
                "first_token_handoff": "rapidserve"}  # vLLM's series, and rapidserve's own


def test_time_to_first_token_is_split_into_phases(server: tuple[Srv, bool]) -> None:
    """Each request's first token carries where its TTFT went (PhaseTimes): the server observes one
    sample per phase, and the phases (queue, prefill, hand-off) add up to no more than the TTFT."""
    s, _ = server

    def snap() -> dict[str, float]:
        got = {f"{p}_{k}": metric(s.url, f"{PHASE_PREFIX[p]}:request_{p}_seconds_{k}") for p in PHASES
               for k in ("sum", "count")}
        got["ttft_sum"] = metric(s.url, "vllm:time_to_first_token_seconds_sum")
        got["ttft_count"] = metric(s.url, "vllm:time_to_first_token_seconds_count")
        got["decode_count"] = metric(s.url, "vllm:request_decode_time_seconds_count")
        got["inference_count"] = metric(s.url, "vllm:request_inference_time_seconds_count")
        return got

    before = snap()
    post(s, "/v1/completions", body(_prompt(70)))
    after = snap()
    d = {k: after[k] - before[k] for k in after}
    assert d["ttft_count"] == 1
    for p in PHASES:
        assert d[f"{p}_count"] == 1, (p, d)
        assert d[f"{p}_sum"] >= 0
    assert d["prefill_time_sum"] > 0
    assert d["admission_time_sum"] <= d["queue_time_sum"] + 1e-6  # blocks come before the first chunk
    parts = d["queue_time_sum"] + d["prefill_time_sum"] + d["first_token_handoff_sum"]
    assert parts <= d["ttft_sum"] + 1e-3, d
    assert d["decode_count"] == d["inference_count"] == 1
