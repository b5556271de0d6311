"""Disagg mode under `--max-model-len auto` with a staging pool smaller than decode's pool: the router takes the
smaller of the two as every request's context cap (WorkerSet.pool_tokens, from the workers' Ready), rejects prompts
beyond it, and gives each request the max_tokens the cap leaves (AsyncEngine.generate), so decode's stop rule, at
its own larger pool, never lets a request outgrow what the prefill worker could stage again after a preemption.
The prefill worker's side (it starts, capped, instead of refusing): tests/test_disagg_worker.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rapidserve.engine import messages as m
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.errors import RequestRejected
from rapidserve.engine.launch import WorkerSet
from rapidserve.llm import build_engine_config
from rapidserve.sampling_params import SamplingParams

BS = 16


def cfg_auto() -> Any:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", max_model_len="auto")
    return cfg


def worker_set(cfg: Any, ready: dict[str, dict[str, str]]) -> WorkerSet:
    return WorkerSet(cfg, None, {}, {}, dict.fromkeys(ready), None, {},  # type: ignore[arg-type]
                     {who: m.Ready(who, 1, info) for who, info in ready.items()})


@pytest.mark.parametrize("ready, engine_tokens, pool_tokens", [
    ({"decode": {"kv_blocks": "60"}, "prefill": {}}, 960, 960),  # rapid: one pool
    ({"decode": {"kv_blocks": "60"}, "prefill": {"staging_blocks": "16"}}, 960, 256),  # disagg, smaller staging
    ({"decode": {"kv_blocks": "60"}, "prefill": {"staging_blocks": "80"}}, 960, 960),  # disagg, larger staging
    ({"hybrid": {"kv_blocks": "24"}}, 384, 384),
])
def test_pool_tokens_is_the_smallest_pool(ready: dict[str, dict[str, str]], engine_tokens: int,
                                          pool_tokens: int) -> None:
    ws = worker_set(cfg_auto(), ready)
    assert (ws.engine_pool_tokens, ws.pool_tokens) == (engine_tokens, pool_tokens)


class Submitted:
    """Stands in for the launched workers: records what the router submits."""

    def __init__(self, engine_pool: int, pool: int) -> None:
        self.engine_pool_tokens, self.pool_tokens = engine_pool, pool
        self.sent: list[m.NewRequest] = []

    def submit(self, msg: m.NewRequest) -> bool:
        self.sent.append(msg)
        return True

    def abort(self, req_id: str) -> bool:
        return True


async def _submit(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> m.NewRequest:
    gen = engine.generate("r", prompt, params)
    task = asyncio.ensure_future(gen.__anext__())
    while not engine.workers.sent and not task.done():  # type: ignore[union-attr]
        await asyncio.sleep(0.001)
    if task.done():
        task.result()  # raises what generate raised
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await gen.aclose()
    return engine.workers.sent[-1]  # type: ignore[union-attr]


@pytest.mark.parametrize("engine_pool, pool, params, want_max", [
    (960, 256, SamplingParams(max_tokens=None), 156),  # no max_tokens: what staging's cap leaves a 100-token prompt
    (960, 256, SamplingParams(max_tokens=500, min_tokens=400), 156),
    (960, 256, SamplingParams(max_tokens=20), 20),  # within the cap: as asked
    (960, 960, SamplingParams(max_tokens=None), None),  # one cap for all: the worker applies it, params as sent
])
def test_requests_get_the_cap_the_router_applies(engine_pool: int, pool: int, params: SamplingParams,
                                                 want_max: int | None) -> None:
    engine = AsyncEngine(cfg_auto())
    engine.workers, engine.state = Submitted(engine_pool, pool), "ready"  # type: ignore[assignment]
    sent = asyncio.run(_submit(engine, list(range(3, 103)), params))
    assert sent.params.max_tokens == want_max
    assert sent.params.min_tokens <= (want_max if want_max is not None else 1 << 30)
    assert (sent.params == params) == (want_max == params.max_tokens)


def test_a_prompt_beyond_the_staging_cap_is_rejected() -> None:
    engine = AsyncEngine(cfg_auto())
    engine.workers, engine.state = Submitted(960, 256), "ready"  # type: ignore[assignment]
    with pytest.raises(RequestRejected, match="maximum context length is 256 tokens"):
        asyncio.run(_submit(engine, [5] * 256, SamplingParams(max_tokens=None)))
    assert not engine.workers.sent  # type: ignore[union-attr]
