"""A prefix in flight, through the RAPID engine on CPU (decode worker + prefill worker processes): requests
sent at once that share a long prefix (a system prompt of more than `SHARE_MIN_TOKENS`) compute it once.
The first is admitted; the others wait for its prefill to land (`DecodeScheduler`'s "waiting for a prefix
in flight"), then find the shared blocks cached. Greedy outputs equal a cache-off `LLM`'s, and every block
is free at the end. The decision itself is table-tested in tests/test_decode_scheduler_cache.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import deque
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.engine import messages as m
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.decode_scheduler import SHARE_MIN_TOKENS
from rapidserve.engine.prefill_worker import Job, enqueue
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config

MODEL = "preset:tiny-llama"
BS = 16
MAX_LEN = 1024
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

_rng = random.Random(1815)
SYSTEM = [_rng.randrange(3, 1280) for _ in range(SHARE_MIN_TOKENS + 88)]  # 600 tokens: 37 full blocks
SHARED = len(SYSTEM) // BS * BS
PROMPTS = {f"sys{i}": SYSTEM + [_rng.randrange(3, 1280) for _ in range(5 + 7 * i)] for i in range(4)}
PROMPTS["short"] = SYSTEM[:100] + [7, 8, 9]  # shares less than SHARE_MIN_TOKENS: admitted at once


def test_requests_sent_at_once_compute_a_long_shared_prefix_once() -> None:
    ref = LLM(MODEL, dtype="float32", device="cpu", show_progress=False, max_model_len=MAX_LEN,
              enable_prefix_caching=False)
    want = {k: o.outputs[0].token_ids for k, o in zip(PROMPTS, ref.generate(list(PROMPTS.values()), GREEDY,
                                                                            use_tqdm=False), strict=True)}
    cfg, _ = build_engine_config(MODEL, device="cpu", dtype="float32", num_kv_blocks=512, max_model_len=MAX_LEN)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode="rapid", mps="off", startup_timeout_s=300))

    async def main() -> tuple[dict[str, list[int]], dict[str, int | None], int]:
        engine = await AsyncEngine.start(cfg)
        try:
            async def one(rid: str, prompt: list[int]) -> tuple[list[int], int | None]:
                toks = [t async for t in engine.generate(rid, prompt, GREEDY)]
                return [t.token_id for t in toks], toks[0].cached_tokens

            got = await asyncio.gather(*(one(k, p) for k, p in PROMPTS.items()))
            for _ in range(500):  # the stats that follow the last token: every block free again
                s = engine.stats
                if s is not None and s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0:
                    break
                await asyncio.sleep(0.02)
            free = -1 if s is None else s.kv_blocks_total - s.kv_blocks_free
        finally:
            await engine.shutdown()
        return ({k: g[0] for k, g in zip(PROMPTS, got, strict=True)},
                {k: g[1] for k, g in zip(PROMPTS, got, strict=True)}, free)

    tokens, cached, held = asyncio.run(main())
    assert tokens == want
    assert held == 0, f"{held} blocks still held after every request ended"
    # one of the sys* requests computed the system prompt; the others waited for it and found it cached
    hits = sorted(cached[k] or 0 for k in PROMPTS if k.startswith("sys"))
    assert hits == [0, SHARED, SHARED, SHARED], cached
    assert cached["short"] in (0, 96), cached  # admitted at once: finds the first blocks only if they landed


# ---- prefill's queue: arrival order (engine/prefill_worker.py:enqueue) -------------------
def _job(name: str, arrival: float, started: bool = False) -> Job:
    kv = m.KVReady(m.NewRequest(name, [5, 6, 7], SamplingParams(), arrival), [0], [], 0, 0, 0.0)
    job = Job.of(kv)
    if started:
        job.mark_started(1.0)
    return job


@pytest.mark.parametrize("queue,new,want", [
    ([], ("a", 1.0), ["a"]),
    ([("a", 1.0), ("b", 2.0)], ("c", 3.0), ["a", "b", "c"]),  # the usual case: decode admits in arrival order
    ([("a", 1.0), ("c", 3.0), ("d", 4.0)], ("b", 2.0), ["a", "b", "c", "d"]),  # passed over, then admitted
    ([("c", 3.0), ("d", 4.0)], ("b", 2.0), ["b", "c", "d"]),
    ([("c", 3.0, True), ("d", 4.0)], ("b", 2.0), ["b", "c", "d"]),  # ahead of a later one's started chunks too
    ([("a", 1.0, True), ("d", 4.0, True)], ("b", 2.0), ["a", "b", "d"]),
    ([("a", 2.0), ("b", 2.0)], ("c", 2.0), ["a", "b", "c"]),  # equal stamps keep their order
])
def test_prefill_queues_jobs_in_arrival_order(queue: list[tuple[Any, ...]], new: tuple[str, float],
                                              want: list[str]) -> None:
    q: deque[Job] = deque(_job(*j) for j in queue)
    enqueue(q, _job(*new))
    assert [j.req.req_id for j in q] == want
