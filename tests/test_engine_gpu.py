"""The two-process RAPID engine on the GPU (AsyncEngine, rapid mode, green-context partitions, MPS auto).

- greedy tokens equal to the single-process reference (`LLM` on the same GPU, prefill launched eagerly; the
  engine's prefill worker replays its piecewise prefill graphs, per partition stream), with a static split
  and with the adaptive manager switching between splits (hysteresis 0; chunked prompts, so prefill
  switches stream between the chunks of one prompt);
- kill -9 of the decode worker, then of the prefill worker, with requests in flight: each request
  ends with EngineError within 2 s, the engine restarts and serves the next request correctly.

fp32 and a tiny preset model: it starts in seconds, and a mismatch at near-tied logits would be
numerics, not the engine. Graph buckets are cut to 1-16 so each start captures few graphs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import random
import signal
import time

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig, LaunchConfig, PartitionConfig
from rapidserve.engine.client import AsyncEngine, EngineError
from rapidserve.llm import build_engine_config
from tests.test_engine import wait_blocks_free

MODEL = "preset:tiny-llama"
MAX_LEN = 1024  # the preset's max_position_embeddings
KV_BLOCKS = 256  # 4096 tokens: no preemption here (the CPU engine tests cover it)
BUDGET = 64  # prefill token budget: the longer prompts go in chunks
NEW = 16
LENGTHS = [5, 150, 12, 70, 33, 90, 8, 41]
GRAPH_SIZES = (1, 2, 4, 8, 16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 1280) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[list[int]]]:
    import torch

    prompts = make_prompts()
    llm = LLM(MODEL, dtype="float32", device="cuda", show_progress=False, max_model_len=MAX_LEN,
              num_kv_blocks=KV_BLOCKS, prefill_graph_tokens=())  # eager prefill: the engine's graphs are checked
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the workers are other processes: give the memory back
    return prompts, want


def engine_config(partition: str) -> EngineConfig:
    """`adaptive` runs --policy rapid; `adaptive-duet` --policy duet with an SLO no step meets (1 ns: the
    roofline predicts this tiny model's mixed step at ~0.4 us), so prefill beside decode splits."""
    cfg, _ = build_engine_config(MODEL, device="cuda", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=MAX_LEN,
                                 max_num_batched_tokens=BUDGET)
    policy = dict(policy="duet", slo_itl_ms=1e-6) if partition == "adaptive-duet" else dict(policy="rapid")
    return dataclasses.replace(
        cfg,
        runner=dataclasses.replace(cfg.runner, graph_batch_sizes=GRAPH_SIZES),
        partition=PartitionConfig.parse(partition.removesuffix("-duet"), backend="cuda-green",
                                        decode_shares=(0.25, 0.5), hysteresis_steps=0, **policy),
        launch=LaunchConfig(mode="rapid", mps="auto", startup_timeout_s=120, on_worker_death="restart"),
    )


async def collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams,
                  first: asyncio.Event | None = None) -> list[int]:
    toks = []
    async for t in engine.generate(rid, prompt, params):
        assert t.index == len(toks)
        toks.append(t.token_id)
        if first is not None:
            first.set()
    return toks




def assert_green_split(engine: AsyncEngine) -> str:
    assert engine.workers is not None
    info = engine.workers.ready["decode"].info
    assert "cuda-green" in info["partition"], info
    assert any(n.startswith("split") for n in info["configurations"].split(",")), info
    return f"{info['partition']} [{info['configurations']}]; {engine.events[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("partition", ["static:0.25", "adaptive", "adaptive-duet"])
def test_engine_on_gpu_with_green_partitions_matches_llm(
        partition: str, reference: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, want = reference

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config(partition))
        try:
            print(assert_green_split(engine))
            # twice: the second round runs on warm workers, with the partition left by the first
            for round_ in range(2):
                got = await asyncio.gather(*(collect(engine, f"r{round_}-{i}", p, GREEDY)
                                             for i, p in enumerate(prompts)))
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert g == w, f"round {round_}, request {i} ({len(prompts[i])} prompt tokens) diverged"
                await wait_blocks_free(engine)
            assert engine.stats is not None
            if partition.startswith("adaptive"):  # prefill pending -> a split, idle -> back: it did switch
                assert engine.stats.partition_switches > 0, engine.stats
            else:
                assert engine.stats.partition_switches == 0 and engine.stats.partition.startswith("split")
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.gpu
def test_killed_gpu_worker_fails_requests_fast_and_engine_recovers(
        reference: tuple[list[list[int]], list[list[int]]]) -> None:
    """kill -9 of decode, then of prefill (uses `engine.running` and `engine.restarts`)."""
    prompts, want = reference
    long = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 200, ignore_eos=True)

    async def kill(engine: AsyncEngine, who: str) -> None:
        assert engine.workers is not None
        firsts = [asyncio.Event() for _ in range(3)]
        doomed = [asyncio.create_task(collect(engine, f"{who}-{i}", prompts[i], long, firsts[i])) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)  # all three decoding
        # and one whose long prompt is still with prefill (or just past it)
        doomed.append(asyncio.create_task(collect(engine, f"{who}-late", prompts[1] * 4, long)))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        os.kill(engine.workers.procs[who].pid, signal.SIGKILL)  # type: ignore[arg-type]
        for t in doomed:
            with pytest.raises(EngineError):
                await asyncio.wait_for(t, 5.0)
        assert time.monotonic() - t0 < 2.0, f"in-flight requests took {time.monotonic() - t0:.2f} s to fail"

    async def main() -> None:
        engine = await AsyncEngine.start(engine_config("static:0.25"))
        try:
            print(assert_green_split(engine))
            for n, who in enumerate(("decode", "prefill"), start=1):
                await kill(engine, who)
                deadline = time.monotonic() + 180
                while not engine.running and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert engine.running, engine.events
                assert engine.restarts == n, engine.events
                assert await collect(engine, f"after-{who}", prompts[0], GREEDY) == want[0]
                assert_green_split(engine)
            print("\n".join(engine.events))
        finally:
            await engine.shutdown()

    asyncio.run(main())
