"""The server's request gauges and refusal counts over HTTP, in-process against a stand-in engine.

`num_requests_running` / `num_requests_waiting` come from the server's own view of each request
(admitted, in the engine without a first token, decoding, ended), with the workers' periodic stats
used only to tell how many of those without a first token are already being prefilled: a scrape right
after a response ends never shows it, however stale the worker stats. A request refused with 503
(at capacity, engine not ready, shutting down) never reached the engine: no prompt tokens, not an
engine `error`, counted in `request_rejected_total` by the code the client got.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from msgspec.structs import replace
from prometheus_client.parser import text_string_to_metric_families

from rapidserve.engine.data_parallel import DataParallelEngine
from rapidserve.engine.errors import EngineError
from rapidserve.engine.messages import Stats, StepKindStats
from rapidserve.server.app import Server
from rapidserve.server.generation import Choice
from rapidserve.server.requests import parse_request
from rapidserve.server_config import ServerConfig
from tests.server_fakes import ECFG, FakeEngine, running_server

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(s: aiohttp.ClientSession, url: str) -> Samples:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return {(x.name, frozenset((k, v) for k, v in x.labels.items() if k not in ("model_name", "engine"))): x.value
            for fam in text_string_to_metric_families(text) for x in fam.samples}


def gauges(m: Samples) -> tuple[float, float]:
    return m[("vllm:num_requests_running", frozenset())], m[("vllm:num_requests_waiting", frozenset())]


def stats(running: int, prefilling: int, waiting: int) -> Stats:
    return Stats(num_running=running, num_waiting=waiting, num_prefilling=prefilling, kv_blocks_total=100,
                 kv_blocks_free=50, num_preemptions=0)


async def wait_until(check: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if await got if not isinstance(got, bool) else got:
            return
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_scrape_right_after_a_response_ends_shows_it_gone() -> None:
    async def main() -> None:
        engine = FakeEngine(delay=0.001)
        engine.stats = stats(running=3, prefilling=1, waiting=2)  # the workers' last stats, from before
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            for stream in (False, True):
                async with s.post(url + "/v1/completions",
                                  json={"prompt": [1, 2], "max_tokens": 3, "n": 2, "stream": stream}) as r:
                    assert r.status == 200
                    await r.read()
                assert gauges(await scrape(s, url)) == (0, 0)

    run(main)


def test_gauges_follow_each_request_from_admission_to_its_end() -> None:
    async def main() -> None:
        engine = FakeEngine(delay=0.01)
        engine.first_token.clear()  # requests are held in the engine before their first token
        async with running_server(engine) as (server, url), aiohttp.ClientSession() as s:
            body = {"prompt": [1, 2], "max_tokens": 2000}  # ended below by engine.die
            plain = [asyncio.create_task(s.post(url + "/v1/completions", json=body)) for _ in range(2)]
            streamed = asyncio.create_task(s.post(url + "/v1/completions", json={**body, "n": 2, "stream": True}))
            await wait_until(lambda: len(engine.live) == 4)
            assert gauges(await scrape(s, url)) == (0, 4)  # no worker stats yet: none known to be running
            engine.stats = stats(running=0, prefilling=1, waiting=3)
            assert gauges(await scrape(s, url)) == (1, 3)  # one of them is being prefilled
            engine.stats = stats(running=9, prefilling=9, waiting=0)  # stale and too high: capped at what is live
            assert gauges(await scrape(s, url)) == (4, 0)
            engine.stats = stats(running=0, prefilling=0, waiting=4)  # stale the other way
            engine.first_token.set()
            # once each has its first token it is decoding, whatever the stats say
            await wait_until(lambda: _is(scrape(s, url), (4, 0)))
            engine.die.set()  # they all end (503 / an error event)
            for r in (*await asyncio.gather(*plain), await streamed):
                await r.read()
                r.release()
            assert gauges(await scrape(s, url)) == (0, 0)

    run(main)


async def _is(m: Awaitable[Samples], want: tuple[float, float]) -> bool:
    return gauges(await m) == want


def test_503_refusals_are_rejected_not_engine_errors_and_count_no_prompt_tokens() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine, max_waiting=0) as (server, url), aiohttp.ClientSession() as s:
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            engine.state, engine.dead_reason = "restarting", "the prefill worker died"
            for stream in (False, True):
                async with s.post(url + "/v1/completions", json={**body, "stream": stream}) as r:
                    assert r.status == 503 and (await r.json())["error"]["code"] == "engine_unavailable"
            engine.state = "ready"
            engine.first_token.clear()
            full = asyncio.create_task(s.post(url + "/v1/completions", json={**body, "n": server.capacity}))
            await wait_until(lambda: server.inflight == server.capacity)
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "overloaded"
            engine.first_token.set()
            assert (await full).status == 200
            server.draining = True
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "server_shutting_down"
            m = await scrape(s, url)

        def count(name: str, **labels: str) -> float:
            prefix = "rapidserve:" if name.startswith("request_rejected") else "vllm:"
            return m[(prefix + name, frozenset(labels.items()))]

        assert count("prompt_tokens_total") == 3 * server.capacity  # only the request that reached the engine
        assert count("request_success_total", finished_reason="error") == 0
        assert count("request_success_total", finished_reason="length") == server.capacity
        assert count("request_rejected_total", reason="engine_unavailable") == 2
        assert count("request_rejected_total", reason="overloaded") == 1
        assert count("request_rejected_total", reason="server_shutting_down") == 1
        assert count("request_prompt_tokens_count") == server.capacity  # the refused ones are no finished requests

    run(main)


def test_metrics_route_speaks_vllm_names_and_labels_without_created_series() -> None:
    """GET /metrics after requests: vLLM's series with `model_name` (the served name) and `engine`, the request
    parameters observed as vLLM 0.26 does (n per prompt, max_tokens per sample), no `_created` sample anywhere;
    rapidserve's own series keep their prefix."""
    async def main() -> None:
        engine = FakeEngine(delay=0.001)
        engine.stats = stats(running=0, prefilling=0, waiting=0)
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 3, "n": 2}) as r:
                assert r.status == 200
                await r.read()
            async with s.get(url + "/metrics") as r:
                text = await r.text()
        assert "_created" not in text
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:cache_config_info", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
                     "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds", "vllm:request_params_n", "vllm:request_params_max_tokens",
                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"):
            assert fams[name].samples, name
            for x in fams[name].samples:  # (cache_config_info: vLLM labels it with the cache settings, no model)
                assert x.labels.get("model_name", "fake") == "fake" and x.labels["engine"] == "0", (name, x.labels)
        assert not [n for n in fams if not n.startswith(("vllm:", "rapidserve:"))]
        samples = {(x.name, x.labels.get("le")): x.value for f in fams.values() for x in f.samples}
        assert samples[("vllm:request_params_n_count", None)] == 2  # two prompts, n=2 each
        assert samples[("vllm:request_params_max_tokens_sum", None)] == 12  # per sample, as vLLM 0.26
        assert samples[("vllm:request_max_num_generation_tokens_count", None)] == 2
        done = {x.labels["finished_reason"]: x.value for x in fams["vllm:request_success"].samples}
        assert done["length"] == 4

    run(main)


def test_metrics_route_exposes_the_workers_step_counts() -> None:
    """The workers' Stats carry their steps by shape kind and the policy's correction (engine/step_tally.py), and the
    prompts handed from decode's fused chunks to prefill: /metrics exposes them as rapidserve's step series, in
    seconds, and its hand-over counter, growing by what each Stats adds."""
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            m = await scrape(s, url)
            assert m[("rapidserve:steps_total", frozenset({("kind", "split")}))] == 0
            assert m[("rapidserve:prompts_handed_over_total", frozenset())] == 0
            engine.stats = replace(stats(1, 0, 0), step_kinds={"split": StepKindStats(8, 160.0, 1, 120.0, 160.0)},
                                   step_correction={"split": 1.3}, num_hand_overs=2)
            await scrape(s, url)
            engine.stats = replace(engine.stats, step_kinds={"split": StepKindStats(10, 220.0, 2, 150.0, 220.0)},
                                   num_hand_overs=5)
            m = await scrape(s, url)

        def got(name: str, kind: str) -> float:
            return m[("rapidserve:" + name, frozenset({("kind", kind)}))]

        assert (got("steps_total", "split"), got("steps_over_slo_total", "split")) == (10, 2)
        assert got("step_seconds_total", "split") == pytest.approx(0.22)
        assert got("step_predicted_seconds_total", "split") == pytest.approx(0.15)
        assert got("step_predicted_measured_seconds_total", "split") == pytest.approx(0.22)
        assert got("step_correction_ratio", "split") == pytest.approx(1.3)
        assert got("steps_total", "fused") == 0
        assert m[("rapidserve:prompts_handed_over_total", frozenset())] == 5  # the Stats' count, not summed per scrape

    run(main)


class Member(FakeEngine):
    """A FakeEngine as one engine of a DataParallelEngine."""

    def __init__(self, delay: float) -> None:
        super().__init__(delay)
        self.events: list[str] = []

    async def abort(self, req_id: str) -> None:
        pass

    async def shutdown(self) -> None:
        self.state = "down"


def test_two_engines_each_expose_their_own_vllm_series() -> None:
    """Behind a DataParallelEngine of two engines of different pools: each engine's gauges from its own Stats and
    the requests it holds, each request's series on the engine that served it, each pool in its cache_config_info;
    a restarting engine shows no KV usage."""
    async def main() -> None:
        a, b = Member(delay=0.001), Member(delay=0.001)
        for e in (a, b):
            e.first_token.clear()
        dp = DataParallelEngine(ECFG, [a, b])
        try:
            async with running_server(dp) as (_, url), aiohttp.ClientSession() as s:  # type: ignore[arg-type]
                body = {"prompt": [1, 2, 3], "max_tokens": 2}
                posts = [asyncio.create_task(s.post(url + "/v1/completions", json=body)) for _ in range(3)]
                await wait_until(lambda: (len(a.live), len(b.live)) == (2, 1))  # least loaded, ties to engine 0
                a.stats = replace(stats(0, 1, 1), kv_blocks_total=64, kv_blocks_free=32, prefix_cache_queries=6)
                b.stats = replace(stats(0, 0, 1), kv_blocks_total=128, kv_blocks_free=128, prefix_cache_queries=3)
                held = await scrape_engines(s, url)
                for e in (a, b):
                    e.first_token.set()
                for r in await asyncio.gather(*posts):
                    assert r.status == 200
                    await r.read()
                    r.release()
                done = await scrape_engines(s, url)
                b.state = "restarting"
                restarting = await scrape_engines(s, url)
        finally:
            await dp.shutdown()

        def at(m: Samples, name: str, engine: str, **labels: str) -> float:
            return m[(name, frozenset({("engine", engine), *labels.items()}))]

        assert [(at(held, "vllm:num_requests_running", e), at(held, "vllm:num_requests_waiting", e))
                for e in "01"] == [(1, 1), (0, 1)]  # engine 0 prefills one of its two
        assert [at(held, "vllm:kv_cache_usage_perc", e) for e in "01"] == [0.5, 0.0]
        assert [at(done, "vllm:prefix_cache_queries_total", e) for e in "01"] == [6, 3]
        assert [at(done, "vllm:prompt_tokens_total", e) for e in "01"] == [6, 3]
        assert [at(done, "vllm:time_to_first_token_seconds_count", e) for e in "01"] == [2, 1]
        assert [at(done, "vllm:request_success_total", e, finished_reason="length") for e in "01"] == [2, 1]
        assert [at(done, "vllm:request_params_max_tokens_sum", e) for e in "01"] == [4, 2]
        assert [at(done, n, e) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting")
                for e in "01"] == [0, 0, 0, 0]
        info = sorted((dict(lab)["engine"], dict(lab)["num_gpu_blocks"]) for n, lab in done
                      if n == "vllm:cache_config_info")
        assert info == [("0", "192"), ("1", "192")]  # the engines' sum on each series, as vLLM 0.26
        assert [at(restarting, "vllm:kv_cache_usage_perc", e) for e in "01"] == [0.5, 0.0]
        assert at(restarting, "vllm:prefix_cache_queries_total", "1") == 3  # its counts stay
        assert held[("rapidserve:partition_info", frozenset({("config", "none")}))] == 1  # the whole server's

    run(main)


async def scrape_engines(s: aiohttp.ClientSession, url: str) -> Samples:
    """The samples of /metrics keyed by name and labels, the `engine` label kept (`model_name` left out)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return {(x.name, frozenset((k, v) for k, v in x.labels.items() if k != "model_name")): x.value
            for fam in text_string_to_metric_families(text) for x in fam.samples}


def at(m: Samples, name: str, engine: str, **labels: str) -> float:
    return m[(name, frozenset({("engine", engine), *labels.items()}))]


def test_a_sample_whose_engine_died_is_the_error_and_its_sibling_an_abort_on_its_own_engine() -> None:
    """n=2 with sample 0 on engine 0 and sample 1 on engine 1, whose worker dies: the error is engine 1's only;
    sample 0, cancelled with the request, is an engine request the server aborted on engine 0 (counted as every
    abort the server makes: metrics.py), not an error of an engine that never failed."""
    async def main() -> None:
        a, b = Member(delay=0.02), Member(delay=0.02)
        dp = DataParallelEngine(ECFG, [a, b])
        try:
            async with running_server(dp) as (_, url), aiohttp.ClientSession() as s:  # type: ignore[arg-type]
                post = asyncio.create_task(s.post(url + "/v1/completions",
                                                  json={"prompt": [1, 2, 3], "max_tokens": 50, "n": 2}))
                await wait_until(lambda: (len(a.live), len(b.live)) == (1, 1))
                b.die.set()
                r = await post
                assert r.status == 503
                r.release()
                m = await scrape_engines(s, url)
        finally:
            await dp.shutdown()
        reasons = ("error", "abort", "length")
        assert [at(m, "vllm:request_success_total", "0", finished_reason=x) for x in reasons] == [0, 1, 0]
        assert [at(m, "vllm:request_success_total", "1", finished_reason=x) for x in reasons] == [1, 0, 0]
        assert [at(m, "vllm:e2e_request_latency_seconds_count", e) for e in "01"] == [1, 1]
        assert a.aborted  # its engine request was aborted, as counted

    run(main)


def test_request_parameters_are_counted_on_the_engines_vllm_counts_them_on() -> None:
    """vLLM 0.26 (vllm/v1/metrics/loggers.py record, engine/parallel_sampling.py): max_tokens with each finished
    sample on its engine; n and the most generation tokens once per prompt, when its last sample finishes, on that
    sample's engine. Sample 1 runs on the slower engine 1 and ends last."""
    async def main() -> None:
        a, b = Member(delay=0.001), Member(delay=0.05)
        dp = DataParallelEngine(ECFG, [a, b])
        try:
            async with running_server(dp) as (_, url), aiohttp.ClientSession() as s:  # type: ignore[arg-type]
                async with s.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "n": 2}) as r:
                    assert r.status == 200
                    await r.read()
                m = await scrape_engines(s, url)
        finally:
            await dp.shutdown()
        assert [at(m, "vllm:e2e_request_latency_seconds_count", e) for e in "01"] == [1, 1]  # one sample each
        assert [at(m, "vllm:request_params_max_tokens_count", e) for e in "01"] == [1, 1]
        assert [at(m, "vllm:request_params_max_tokens_sum", e) for e in "01"] == [3, 3]
        assert [at(m, "vllm:request_params_n_count", e) for e in "01"] == [0, 1]
        assert at(m, "vllm:request_params_n_sum", "1") == 2
        assert [at(m, "vllm:request_max_num_generation_tokens_count", e) for e in "01"] == [0, 1]

    run(main)


def test_a_request_that_reached_no_engine_is_counted_on_none() -> None:
    """With several engines, a request that never reached one (the client left while its stream began; dispatch
    found no engine running) is no engine's: vLLM counts a request only on the engine core that ran it. With one
    engine, one whose stream never began is an abort on engine 0, as before data parallelism."""
    body = b'{"prompt": [1, 2, 3], "max_tokens": 3, "n": 2, "stream": true}'

    async def prelude() -> None:
        raise ConnectionResetError("client went away")

    async def counted(engine: FakeEngine | DataParallelEngine, left: bool) -> Samples:
        server = Server(ServerConfig(port=0), ECFG, engine, None, "m")  # type: ignore[arg-type]
        req = parse_request("completion", body, server.ctx)
        choices = [Choice(j, [1, 2, 3]) for j in range(2)]
        if not left:  # every engine goes down after the request's admission, before its dispatch
            server.gen.refusal = lambda: None  # type: ignore[method-assign]
            for e in getattr(engine, "engines", [engine]):
                e.state = "restarting"
        with pytest.raises((ConnectionError, EngineError)):
            await server.gen.generate("cmpl-x", req, choices, None, prelude if left else None)
        assert all(c.engine is None for c in choices)
        return {(x.name, frozenset((k, v) for k, v in x.labels.items() if k != "model_name")): x.value
                for fam in text_string_to_metric_families(server.metrics.render()[0].decode()) for x in fam.samples}

    async def main() -> None:
        for left in (True, False):
            dp = DataParallelEngine(ECFG, [Member(0.001), Member(0.001)])
            m = await counted(dp, left)
            await dp.shutdown()
            for e in "01":
                assert [at(m, "vllm:request_success_total", e, finished_reason=x)
                        for x in ("stop", "length", "abort", "error")] == [0, 0, 0, 0], (left, e)
                for name in ("e2e_request_latency_seconds", "request_prompt_tokens",
                             "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens"):
                    assert at(m, f"vllm:{name}_count", e) == 0, (left, name, e)
                assert at(m, "vllm:prompt_tokens_total", e) == 0
        m = await counted(FakeEngine(), True)
        assert at(m, "vllm:request_success_total", "0", finished_reason="abort") == 2
        assert at(m, "vllm:request_max_num_generation_tokens_count", "0") == 1
        assert [at(m, f"vllm:{x}", "0") for x in ("request_params_n_count", "request_params_max_tokens_count",
                                                    "prompt_tokens_total")] == [0, 0, 0]

    run(main)
