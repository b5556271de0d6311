"""Data parallelism with real workers on CPU (`preset:tiny-llama`, token ids only).

- `rapidserve serve --data-parallel-size 2` (rapid mode): concurrent greedy requests are spread over
  both engines and answer exactly what one engine answers; /health lists both, /metrics labels each one's
  vLLM series by its index (each engine's own prefix cache, KV usage and pool).
- Two hybrid engines in-process: a worker killed in one ends that engine's requests with its error and
  nothing else; the other engine's requests go on and take the new ones while it restarts; an abort
  reaches the engine that holds the request.
- Two hybrid engines of two tensor-parallel ranks each (gloo): the tokens of one process.
- (gpu) Two engines on two GPUs: engine i's workers on cuda:i, one MPS plan, the tokens of one GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rapidserve import LLM, SamplingParams
from rapidserve.config import ParallelConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.data_parallel import DataParallelEngine
from rapidserve.engine.errors import EngineError
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_server import http, start, stop

SMALL = {"num_kv_blocks": 64, "max_model_len": 256}
PROMPTS = [[1, *range(10 + 7 * i, 10 + 7 * i + 3 + i)] for i in range(8)]  # distinct, 4..11 tokens
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


async def reference_outputs() -> list[list[int]]:
    """What one engine answers to PROMPTS (all at once, as the server gets them)."""
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", **SMALL)  # type: ignore[arg-type]
    engine = await AsyncEngine.start(dataclasses.replace(cfg, launch=LaunchConfig(mps="off")))
    params = SamplingParams(**GREEDY)  # type: ignore[arg-type]

    async def one(i: int) -> list[int]:
        return [t.token_id async for t in engine.generate(f"ref{i}", PROMPTS[i], params)]

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
    finally:
        await engine.shutdown()


def per_engine(url: str, name: str) -> dict[str, dict[str, Any]]:
    """Sample `name` of each engine in /metrics, by its `engine` label: its labels and its value (`value`)."""
    got = {s.labels["engine"]: {**s.labels, "value": float(s.value)}
           for fam in text_string_to_metric_families(http(url + "/metrics")[2].decode())
           for s in fam.samples if s.name == name}
    assert got, f"{name} not in /metrics"
    return got


def test_two_engines_behind_one_server_answer_as_one_engine() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = loop.run_in_executor(None, start, "--model", "preset:tiny-llama", "--data-parallel-size", "2",
                                      "--num-kv-blocks", "64", "--max-model-len", "256")
        want = await reference_outputs()  # while the server starts
        srv = await server
        try:
            code, _, raw = http(srv.url + "/health")
            assert code == 200 and [e["state"] for e in json.loads(raw)["engines"]] == ["ready", "ready"]
            async with aiohttp.ClientSession() as session:
                async def one(prompt: list[int]) -> list[int]:
                    async with session.post(srv.url + "/v1/completions",
                                            json={"prompt": prompt, **GREEDY}) as r:
                        body: dict[str, Any] = await r.json()
                        assert r.status == 200, body
                        return list(body["choices"][0]["token_ids"])

                got = await asyncio.gather(*(one(p) for p in PROMPTS))
            assert got == want
            engines = json.loads(http(srv.url + "/health")[2])["engines"]
            assert [e["in_flight"] for e in engines] == [0, 0]
            served = [e["requests"] for e in engines]
            assert sum(served) == len(PROMPTS) and min(served) > 0, served  # both engines served some
            deadline = time.monotonic() + 30  # each engine reports its Stats every 0.25 s
            queried = sum(len(p) for p in PROMPTS)  # every prompt token was looked up in one of the caches

            def settled() -> tuple[dict[str, float], dict[str, float]]:  # each engine's own, from its latest Stats:
                # wait for both, one engine's Stats from after its last lookup can predate its last blocks' release
                return tuple({e: s["value"] for e, s in per_engine(srv.url, name).items()}  # type: ignore[return-value]
                             for name in ("vllm:prefix_cache_queries_total", "vllm:kv_cache_usage_perc"))

            while True:
                queries, usage = settled()
                if sum(queries.values()) == queried and usage == {"0": 0.0, "1": 0.0}:
                    break
                assert time.monotonic() < deadline, (queries, usage)
                await asyncio.sleep(0.1)
            assert min(queries.values()) > 0  # each engine looked up the prompts it served
            # --num-kv-blocks is each engine's; cache_config_info's num_gpu_blocks is their sum on each, as vLLM 0.26
            info = per_engine(srv.url, "vllm:cache_config_info")
            assert {e: s["num_gpu_blocks"] for e, s in info.items()} == {"0": "128", "1": "128"}
        finally:
            assert stop(srv) == 0

    asyncio.run(main())


async def tokens(engine: DataParallelEngine, rid: str, n: int, got: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    async for t in engine.generate(rid, [1, 5, 6, 7], params):
        got.append(t.token_id)


async def wait_for(pred: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        await asyncio.sleep(0.02)


def test_a_worker_death_in_one_engine_leaves_the_other_alone() -> None:
    async def main() -> None:
        # 8000-token requests, past tiny-llama's 1024 positions (random weights: no text to spoil)
        cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", num_kv_blocks=512,  # type: ignore[arg-type]
                                     max_model_len=8192, allow_long_max_model_len=True)
        cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps="off", mode="hybrid"),
                                  parallel=ParallelConfig(data_parallel_size=2))
        dp = await DataParallelEngine.start(cfg)
        try:
            got: dict[str, list[int]] = {"a": [], "b": []}
            runs = {rid: asyncio.create_task(tokens(dp, rid, 8000, got[rid])) for rid in ("a", "b")}
            await wait_for(lambda: got["a"] and got["b"], 30)
            assert (dp.owner("a"), dp.owner("b")) == (0, 1)
            victim = dp.engines[1].workers.procs["hybrid"]  # type: ignore[union-attr]
            os.kill(victim.pid, signal.SIGKILL)
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(runs["b"], 5)
                raise AssertionError("request b outlived its worker")
            except EngineError as e:
                assert "the hybrid worker died (killed by SIGKILL" in str(e)
            assert time.monotonic() - t0 < 2.0
            assert dp.engines[1].state == "restarting" and dp.state == "ready"
            # while engine 1 is away a new request goes to engine 0, though it holds more
            short: list[int] = []
            c = asyncio.create_task(tokens(dp, "c", 4, short))
            await asyncio.sleep(0)
            assert dp.owner("c") == 0 and dp.in_flight == [2, 0]
            # engine 0 goes on: both its requests keep streaming
            seen = len(got["a"])
            await asyncio.wait_for(c, 30)
            assert len(short) == 4
            await wait_for(lambda: len(got["a"]) > seen + 10, 10)
            # an abort reaches the engine that holds the request: its stream ends, nothing else
            await dp.abort("a")
            await asyncio.wait_for(runs["a"], 5)
            assert not runs["a"].cancelled() and dp.owner("a") is None and dp.in_flight == [0, 0]
            assert "a" not in dp.engines[0].streams  # type: ignore[attr-defined]
            await wait_for(lambda: dp.engines[1].state == "ready", 60)
            assert (dp.deaths_total, dp.restarts_total) == (1, 1) and not dp.fatal.is_set()
            assert dp.engines[0].deaths_total == 0
            both: dict[str, list[int]] = {"d": [], "e": []}
            await asyncio.gather(*(tokens(dp, rid, 3, both[rid]) for rid in both))
            assert both["d"] == both["e"] and len(both["d"]) == 3
        finally:
            await dp.shutdown()

    asyncio.run(main())


def test_two_engines_of_two_tensor_parallel_ranks_each() -> None:
    llm = LLM("preset:tiny-llama", dtype="float32", device="cpu", show_progress=False, max_model_len=256)
    params = SamplingParams(**GREEDY)  # type: ignore[arg-type]
    want = [o.outputs[0].token_ids for o in llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)]

    async def main() -> None:
        cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32",  # type: ignore[arg-type]
                                     **SMALL)
        cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps="off", mode="hybrid"),
                                  parallel=ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
        dp = await DataParallelEngine.start(cfg)
        try:
            assert [len(e.workers.procs) for e in dp.engines] == [2, 2]  # type: ignore[attr-defined]

            async def one(i: int) -> list[int]:
                return [t.token_id async for t in dp.generate(f"r{i}", PROMPTS[i], params)]

            got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            assert got == want and min(dp.dispatched) > 0
        finally:
            await dp.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_two_engines_on_two_gpus(mode: str) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    llm = LLM("preset:tiny-llama", dtype="float32", device="cuda", show_progress=False, max_model_len=256,
              num_kv_blocks=64)
    params = SamplingParams(**GREEDY)  # type: ignore[arg-type]
    want = [o.outputs[0].token_ids for o in llm.generate([list(p) for p in PROMPTS], params, use_tqdm=False)]
    del llm

    async def main() -> None:
        cfg, _ = build_engine_config("preset:tiny-llama", device="cuda", dtype="float32",  # type: ignore[arg-type]
                                     **SMALL)
        cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, startup_timeout_s=300),  # type: ignore[arg-type]
                                  parallel=ParallelConfig(data_parallel_size=2))
        dp = await DataParallelEngine.start(cfg)
        try:
            role = "hybrid" if mode == "hybrid" else "decode"
            devices = [e.workers.ready[role].info["device"] for e in dp.engines]  # type: ignore[attr-defined]
            assert devices == ["cuda:0", "cuda:1"]
            plans = [e.mps_plan for e in dp.engines]  # type: ignore[attr-defined]
            if mode == "rapid":  # one daemon (or none) for both engines
                assert plans[0] is plans[1] is dp.mps_plan
            else:  # one process per engine: no MPS
                assert dp.mps_plan is None and not any(p.active for p in plans)

            async def one(i: int) -> list[int]:
                return [t.token_id async for t in dp.generate(f"r{i}", PROMPTS[i], params)]

            got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            assert got == want and min(dp.dispatched) > 0
        finally:
            await dp.shutdown()

    asyncio.run(main())
