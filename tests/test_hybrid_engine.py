"""Hybrid mode (one worker, chunked prefill mixed with decodes) behind the same AsyncEngine, on CPU:
same greedy tokens as LLM.generate with a small budget and a small KV pool, aborts, a killed worker."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.errors import EngineError
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_engine import wait_blocks_free

MODEL = "preset:tiny-llama"  # a tiny deterministic model: the test is about scheduling, not the weights
NEW = 24
BUDGET = 64  # small: prompts are chunked and share steps with decodes
KV_BLOCKS = 24  # 384 tokens for 12 requests of 5-150 tokens + 24 new each: preemptions happen


def shm_entries(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f"rapidserve-{pid}-" in f]


LENGTHS = [5, 150, 12, 70, 33, 90, 8, 64, 41, 120, 20, 57]  # chunked (> BUDGET) and shared steps (< BUDGET)


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1280) for _ in range(n)] for n in LENGTHS]


def reference_tokens(prompts: list[list[int]], device: str) -> list[list[int]]:
    llm = LLM(MODEL, dtype="float32", device=device, show_progress=False, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    prompts = make_prompts()
    return prompts, reference_tokens(prompts, "cpu")


def hybrid_config(device: str = "cpu") -> EngineConfig:
    cfg, _ = build_engine_config(MODEL, device=device, dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=512,
                                 max_num_batched_tokens=BUDGET)
    return dataclasses.replace(cfg, launch=LaunchConfig(mode="hybrid", mps="off", startup_timeout_s=300,
                                                        on_worker_death="restart"))


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    toks = [t async for t in engine.generate(rid, prompt, params)]
    assert [t.index for t in toks] == list(range(len(toks)))
    if params.logprobs:
        assert all(t.logprob is not None and len(t.top_logprobs or []) == params.logprobs for t in toks)
    return [t.token_id for t in toks]


def test_hybrid_engine_matches_llm_aborts_free_blocks_and_a_killed_worker_fails_fast_and_restarts(
        reference: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(hybrid_config())
        try:
            assert sorted(engine.workers.procs) == ["hybrid"]  # type: ignore[union-attr]
            greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
            tasks = [asyncio.create_task(collect(engine, f"r{i}", p, greedy.replace(logprobs=2) if i == 3 else greedy))
                     for i, p in enumerate(prompts)]

            # one request aborted while its long prompt is still being chunked ...
            gen = engine.generate("abort-prefill", prompts[-1] * 2, greedy)
            first = asyncio.create_task(gen.__anext__())
            await asyncio.sleep(0)
            await engine.abort("abort-prefill")
            with pytest.raises(StopAsyncIteration):
                await first
            # ... and one while it decodes, after a few tokens: nothing comes after the abort
            got = []
            async for t in engine.generate("abort-decode", prompts[0], greedy):
                got.append(t.token_id)
                if len(got) == 3:
                    await engine.abort("abort-decode")
            assert len(got) == 3
            # ... and one the worker has finished, every token queued and unread, aborted after 3: nothing more comes
            # either (forced: the consumer waits until the stream has its last token before it reads on)
            late = engine.generate("abort-late", prompts[0], greedy)
            got = [(await late.__anext__()).token_id]
            deadline = time.monotonic() + 60
            while not engine.streams["abort-late"].finished and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            assert engine.streams["abort-late"].finished and engine.streams["abort-late"].queue.qsize() == NEW - 1
            got += [(await late.__anext__()).token_id for _ in range(2)]
            await engine.abort("abort-late")
            got += [t.token_id async for t in late]
            assert got == want[0][:3] and "abort-late" not in engine.streams
            # a prompt the worker cannot serve ends with an error, and the engine goes on
            with pytest.raises(EngineError, match="token ids"):
                await collect(engine, "bad", [10**9], greedy)

            results = await asyncio.gather(*tasks)
            for i, (g, w) in enumerate(zip(results, want, strict=True)):
                assert g == w, f"request {i} (prompt of {len(prompts[i])} tokens) diverged"
            await wait_blocks_free(engine)
            assert engine.stats is not None and engine.stats.num_preemptions > 0  # the pool was too small

            # kill -9 of the worker: in-flight requests fail at once, then a new worker comes up and serves
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            doomed = [asyncio.create_task(collect(engine, f"k{i}", p, long)) for i, p in enumerate(prompts[:3])]
            deadline = time.monotonic() + 30
            while engine.stats.num_running == 0 and time.monotonic() < deadline:  # decoding, far from done
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            os.kill(engine.workers.procs["hybrid"].pid, signal.SIGKILL)  # type: ignore[union-attr,arg-type]
            for t in doomed:
                with pytest.raises(EngineError, match="hybrid worker died"):
                    await asyncio.wait_for(t, 5.0)
            assert time.monotonic() - t0 < 2.0
            deadline = time.monotonic() + 120
            while not engine.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await collect(engine, "after", prompts[0], greedy) == want[0]
            assert engine.restarts == 1 and sorted(engine.workers.procs) == ["hybrid"]  # type: ignore[union-attr]
        finally:
            await engine.shutdown()
        assert shm_entries(os.getpid()) == []

    asyncio.run(main())


def test_scheduling_ahead_gives_the_tokens_of_waiting_for_each_step(
        reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """--async-scheduling on and off: the same tokens and finish reasons for early stops (a stop token
    found while the next step is in flight), max_tokens of 1-3 (no decode after the last token), min_tokens,
    seeded sampling and logprobs, with preemptions in the small pool; every block back at the end."""
    prompts, want = reference
    stop_at = {i: w[4] for i, w in enumerate(want[:4])}  # each of these stops at its 5th token or sooner
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop_at[i]]) if i in stop_at
              else SamplingParams(temperature=0.0, max_tokens=i - 3) if i in (4, 5, 6)
              else SamplingParams(temperature=0.8, seed=i, max_tokens=NEW, ignore_eos=True, logprobs=1) if i in (7, 8)
              else SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, stop_token_ids=[want[i][2]])
              for i in range(len(prompts))]

    async def run(ahead: bool) -> list[tuple[list[int], str | None]]:
        cfg = hybrid_config()
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, async_scheduling=ahead))
        engine = await AsyncEngine.start(cfg)
        try:
            async def one(i: int) -> tuple[list[int], str | None]:
                toks = [t async for t in engine.generate(f"a{i}", prompts[i], params[i])]
                assert [t.index for t in toks] == list(range(len(toks)))
                return [t.token_id for t in toks], toks[-1].finish_reason
            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            await wait_blocks_free(engine)
            assert engine.stats is not None and engine.stats.num_preemptions > 0
            return got
        finally:
            await engine.shutdown()

    ahead, waiting = asyncio.run(run(True)), asyncio.run(run(False))
    assert ahead == waiting
    for i in stop_at:
        assert ahead[i][1] == "stop" and ahead[i][0][-1] == stop_at[i] and len(ahead[i][0]) <= 5
    assert [len(ahead[i][0]) for i in (4, 5, 6)] == [1, 2, 3]
    assert all(ahead[i][1] == "length" for i in (4, 5, 6, 9, 10, 11))
    for i in (9, 10, 11):  # min_tokens = max_tokens: the stop id is never sampled, every token comes
        assert len(ahead[i][0]) == NEW and want[i][2] not in ahead[i][0]


@pytest.mark.gpu
def test_hybrid_engine_on_gpu_matches_llm() -> None:
    """Decode-only steps replay decode graphs, mixed steps run the Triton varlen prefill kernel (fp32:
    a mismatch late in a sequence at near-tied logits would be numerics, not scheduling)."""
    prompts = make_prompts()
    want = reference_tokens(prompts, "cuda")

    async def main() -> None:
        engine = await AsyncEngine.start(hybrid_config("cuda"))
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
            got = await asyncio.gather(*(collect(engine, f"g{i}", p, greedy) for i, p in enumerate(prompts)))
            assert got == want
            await wait_blocks_free(engine)
            assert engine.stats is not None and engine.stats.num_preemptions > 0
        finally:
            await engine.shutdown()

    asyncio.run(main())
