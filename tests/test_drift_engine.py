"""`--policy drift` end to end on CPU: the RAPID engine's prefill worker launches prompts a layer block
at a time (engine/drift_prefill.py), a short request preempts a long prompt's prefill at a block
boundary and the long one resumes, an abort lands on a prompt whose batch is launched, and every request
gets the greedy tokens of the one-shot `LLM`; afterwards every KV block is free. Also at tensor-parallel
size 2 (gloo), where the prefill follower replays the blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig, ParallelConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from rapidserve.partition_config import PartitionConfig
from tests.test_engine import chat_prompts, collect, wait_blocks_free

NEW = 8
LONG = 900  # SmolLM2-135M on one CPU thread: ~1.6 s of prefill, 30 blocks of one layer here
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# The dispatcher decides on predicted times, so the preemption is forced, not raced: predicted prefill 1 s a token;
# TTFT SLO 21 s + 1200 s per 1K tokens. The long prompt (900 s predicted, SLO 1101 s) has the slack for a 20-token
# one (20 s predicted, SLO 45 s), which behind even the last of its 30 layers (30 s predicted) would miss: seen at
# any block boundary of the long prompt within 25 s of its arrival (real time), the short request preempts it.
# The short request is sent after the long one, so its batch (the whole budget) starts first.
DRIFT = PartitionConfig(policy="drift", slo_ttft_ms=21000.0, slo_ttft_ms_per_1k_tokens=1_200_000.0,
                        drift_prefill_model=(0.0, 1000.0))


def _prompts(llm: LLM) -> dict[str, list[int]]:
    chats = chat_prompts(llm, 10)
    long = (chats[-1] * 60)[:LONG]
    return {"long": long, "short": chats[0][:20], "aborted": (chats[-2] * 60)[:800],
            **{f"c{i}": p for i, p in enumerate(chats)}}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    llm = LLM(dtype="float32", device="cpu", show_progress=False, max_model_len=1024)
    prompts = _prompts(llm)
    kept = [k for k in prompts if k != "aborted"]  # the aborted request's tokens are never compared (800 tokens)
    outs = llm.generate([prompts[k] for k in kept], GREEDY, use_tqdm=False)
    return prompts, {k: o.outputs[0].token_ids for k, o in zip(kept, outs, strict=True)}


def drift_config() -> EngineConfig:
    cfg, _ = build_engine_config(None, device="cpu", dtype="float32", num_kv_blocks=240, max_model_len=1024,
                                 max_num_batched_tokens=LONG)  # the long prompt fills a batch: alone in it
    return dataclasses.replace(cfg, launch=LaunchConfig(mps="off", startup_timeout_s=300), partition=DRIFT)


async def _preemptions(engine: AsyncEngine, at_least: int, timeout: float = 5.0) -> int:
    """The prefill worker's count, from its heartbeats (every 0.25 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hb = engine.heartbeat
        if hb is not None and hb.preemptions >= at_least:
            return hb.preemptions
        await asyncio.sleep(0.05)
    return engine.heartbeat.preemptions if engine.heartbeat is not None else 0


def test_drift_engine_preempts_and_matches_llm(reference: tuple[dict[str, list[int]], dict[str, list[int]]],
                                               ) -> None:
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(drift_config())
        try:
            assert engine.heartbeat is None or engine.heartbeat.preemptions == 0
            long = asyncio.create_task(collect(engine, "long", prompts["long"], GREEDY))
            short = asyncio.create_task(collect(engine, "short", prompts["short"], GREEDY))
            gen = engine.generate("aborted", prompts["aborted"], GREEDY)
            first = asyncio.create_task(gen.__anext__())
            await asyncio.sleep(0.3)  # its prompt is queued or launched in prefill by now
            await engine.abort("aborted")
            with pytest.raises(StopAsyncIteration):
                await first
            rest = {k: asyncio.create_task(collect(engine, k, p, GREEDY)) for k, p in prompts.items()
                    if k.startswith("c")}
            assert await short == want["short"]
            assert await long == want["long"]
            for k, t in rest.items():
                assert await t == want[k], k
            assert await _preemptions(engine, 1) >= 1  # the short request preempted the long prompt
            await wait_blocks_free(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_drift_engine_at_tp2_matches_one_process() -> None:
    model = "preset:tiny-llama"
    llm = LLM(model, dtype="float32", device="cpu", show_progress=False, max_model_len=1024)
    prompts = {"long": [(7 * i) % 1200 + 3 for i in range(LONG)], "short": [5, 9, 11, 300, 42] * 4,
               **{f"p{i}": [(13 * i + j) % 1200 + 3 for j in range(40 + 30 * i)] for i in range(6)}}
    want = {k: o.outputs[0].token_ids
            for k, o in zip(prompts, llm.generate(list(prompts.values()), GREEDY, use_tqdm=False), strict=True)}
    cfg, _ = build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=160, max_model_len=1024,
                                 max_num_batched_tokens=LONG)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mps="off", startup_timeout_s=300), partition=DRIFT,
                              parallel=ParallelConfig(tensor_parallel_size=2))

    async def main() -> tuple[dict[str, list[int]], list[str], int]:
        engine = await AsyncEngine.start(cfg)
        try:
            procs = sorted(engine.workers.procs)  # type: ignore[union-attr]
            got = await asyncio.gather(*(collect(engine, k, p, GREEDY) for k, p in prompts.items()))
            await wait_blocks_free(engine)
            preempted = await _preemptions(engine, 1)
            return dict(zip(prompts, got, strict=True)), procs, preempted
        finally:
            await engine.shutdown()

    got, procs, preempted = asyncio.run(main())
    assert got == want
    assert preempted >= 1  # the short prompt, sent with the long one, preempted it: the follower replayed both
    assert procs == ["decode", "decode.1", "prefill", "prefill.1"]
