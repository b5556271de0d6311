"""`--mode disagg` end to end on CPU (both instances on the CPU, decode's pool in shared memory): the
same greedy tokens as rapid mode for the same requests, through the same AsyncEngine, including a
prompt longer than the token budget (chunked, its blocks pushed chunk by chunk), a request that finds
its prefix cached in decode's pool (pulled into staging), several at once and an abort; afterwards
every decode block and every staging block is free. The same with tensor parallelism on either side (2P2D, and
2P1D: two prefill ranks each pushing its KV head into the one decode rank's pool, through a leader and a follower
that mirrors its KV moves and fences them). And a real server process in disagg mode."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import pytest

from rapidserve import SamplingParams
from rapidserve.config import EngineConfig, ParallelConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_hybrid_engine import wait_blocks_free
from tests.test_server import http, metric, start, stop

MODEL = "preset:tiny-llama"
NEW = 8
BUDGET = 32  # longer prompts are chunked
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

_rng = random.Random(17)


def _rand(n: int) -> list[int]:
    return [_rng.randrange(3, 1280) for _ in range(n)]


SYS = _rand(48)  # three full blocks, shared by the second of each pair below
ALONE = {"long": _rand(150), "sys+7": SYS + _rand(7), "sys+30": SYS + _rand(30)}  # one after another
TOGETHER = {"u5": _rand(5), "u40": _rand(40), "u100": _rand(100), "sys+2": SYS + _rand(2)}
ABORTED = _rand(200)


def config(mode: str, prefill_tp: int = 1, decode_tp: int = 1) -> EngineConfig:
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=24, max_model_len=256,
                                 max_num_batched_tokens=BUDGET)
    parallel = ParallelConfig(tensor_parallel_size=decode_tp, prefill_tensor_parallel_size=prefill_tp)
    return dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300),  # type: ignore[arg-type]
                               parallel=parallel if mode == "disagg" else ParallelConfig())


async def one(engine: AsyncEngine, rid: str, prompt: list[int]) -> tuple[list[int], int | None]:
    toks = [t async for t in engine.generate(rid, prompt, GREEDY)]
    return [t.token_id for t in toks], toks[0].cached_tokens


async def scenario(mode: str, prefill_tp: int = 1, decode_tp: int = 1) -> dict[str, tuple[list[int], int | None]]:
    engine = await AsyncEngine.start(config(mode, prefill_tp, decode_tp))
    try:
        out = {rid: await one(engine, rid, p) for rid, p in ALONE.items()}
        got = await asyncio.gather(*(one(engine, rid, p) for rid, p in TOGETHER.items()))
        out.update(zip(TOGETHER, got, strict=True))

        async def aborted() -> None:
            async for _ in engine.generate("aborted", ABORTED, GREEDY):
                break  # closing the stream aborts the request

        task = asyncio.create_task(aborted())
        await asyncio.sleep(0.05)  # mid-prefill, most likely (it takes 7 chunks)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        out["after-abort"] = await one(engine, "after-abort", ABORTED)
        await wait_blocks_free(engine)
        if mode == "disagg":
            deadline = time.monotonic() + 10
            while engine.heartbeat is None or engine.heartbeat.staging_in_use or engine.heartbeat.queued:
                assert time.monotonic() < deadline, engine.heartbeat
                await asyncio.sleep(0.05)
            ready = engine.workers.ready if engine.workers else {}
            assert ready["prefill"].info["mode"] == "disagg" and "peer copy" in ready["prefill"].info["kv_connector"]
            assert int(ready["prefill"].info["staging_blocks"]) == 24
            procs = sorted(engine.workers.procs)  # type: ignore[union-attr]
            assert procs == ["decode"] + [f"decode.{s}" for s in range(1, decode_tp)] + \
                ["prefill"] + [f"prefill.{r}" for r in range(1, prefill_tp)]
            assert ready["decode"].info["ranks"] == f"{prefill_tp}P{decode_tp}D"
            assert ready["prefill"].info["kv_connector"].count("peer copy") == max(1, decode_tp // prefill_tp)
        return out
    finally:
        await engine.shutdown()


@pytest.fixture(scope="module")
def rapid() -> dict[str, tuple[list[int], int | None]]:
    return asyncio.run(scenario("rapid"))


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 2), (2, 1)], ids=["1P1D", "2P2D", "2P1D"])
def test_disagg_gives_rapid_modes_tokens_and_frees_every_block(rapid: dict[str, tuple[list[int], int | None]],
                                                               prefill_tp: int, decode_tp: int) -> None:
    disagg = asyncio.run(scenario("disagg", prefill_tp, decode_tp))
    # how much of the aborted prompt was prefilled (and so cached) before the abort landed is a race in
    # either mode (CI once saw 192 cached tokens in rapid and 0 in disagg): its tokens must agree, and
    # its cached count be whole blocks of the prompt
    (toks_a, cached_a), (toks_b, cached_b) = disagg.pop("after-abort"), rapid["after-abort"]
    assert toks_a == toks_b and all(c is not None and c % 16 == 0 and c <= 192 for c in (cached_a, cached_b))
    assert disagg == {k: v for k, v in rapid.items() if k != "after-abort"}
    assert all(len(toks) == NEW for toks, _ in disagg.values())
    # the prefix cache was hit: the second request on SYS found its three full blocks in decode's pool
    assert disagg["sys+30"][1] == 48 and disagg["sys+2"][1] == 48
    assert disagg["long"][1] == 0


def test_serve_mode_disagg_answers_a_chat_completion() -> None:
    """A real server process: embedded SmolLM2 on CPU, a prompt chunked by the budget."""
    s = start("--mode", "disagg", "--max-num-batched-tokens", "16", "--num-kv-blocks", "128")
    try:
        status, _, body = http(s.url + "/v1/chat/completions", "POST", json.dumps({
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 24}).encode(), {"Content-Type": "application/json"})
        assert status == 200, body
        r = json.loads(body)
        assert "Paris" in r["choices"][0]["message"]["content"] and r["choices"][0]["finish_reason"] == "stop"
        assert http(s.url + "/health")[0] == 200
        deadline = time.monotonic() + 10  # stats arrive every 0.25 s
        while metric(s.url, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(s.url, "vllm:kv_cache_usage_perc") == 0
    finally:
        code = stop(s)
    assert code == 0  # SIGTERM: drain and exit 0
