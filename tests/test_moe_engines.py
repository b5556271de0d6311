"""The tiny mixture-of-experts presets (issue 40) through every engine path on CPU: `LLM`, the RAPID engine (a decode
and a prefill worker sharing the weights and the KV pool) and the hybrid engine give `LLM`'s tokens, greedy and
seeded random, with a small pool (preemptions) and long prompts chunked; at tensor-parallel size 2 (gloo) a
ModelRunner per rank and the RAPID engine give one process's tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import ParallelConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from rapidserve.runner import ModelRunner
from tests.test_prefix_cache_engines import quiet_stats
from tests.test_tp_cpu import _config, _greedy, _greedy_sampled, _run_tp

_rng = random.Random(40)
PROMPTS = [[_rng.randrange(3, 1000) for _ in range(n)] for n in (3, 40, 17, 90, 25, 8, 61, 33)]
KV_BLOCKS = 14  # 224 tokens for ~300 prompt tokens and their outputs: preemptions happen
BUDGET = 48  # max_num_batched_tokens: the long prompts are chunked


def _params() -> list[SamplingParams]:
    base = dict(max_tokens=12, ignore_eos=True)
    return [SamplingParams(temperature=0.0, **base) if i % 2 else
            SamplingParams(temperature=0.8, top_k=50, seed=100 + i, **base) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe"])
def expected(request: pytest.FixtureRequest) -> tuple[str, list[list[int]]]:
    """(model, each prompt's tokens from an `LLM` with a large pool, every prompt alone)."""
    model = f"preset:{request.param}"
    llm = LLM(model, dtype="float32", device="cpu", show_progress=False, max_model_len=256)
    params = _params()
    return model, [llm.generate([p], s, use_tqdm=False)[0].outputs[0].token_ids for p, s in zip(PROMPTS, params,
                                                                                                 strict=True)]


def test_llm_batched_with_preemption(expected: tuple[str, list[list[int]]]) -> None:
    model, want = expected
    llm = LLM(model, dtype="float32", device="cpu", show_progress=False, max_model_len=256,
              num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=BUDGET)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
    assert got == want
    assert llm.engine.num_preemptions > 0
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def _serve(model: str, mode: str, tp: int = 1) -> tuple[list[list[int]], int]:
    cfg, _ = build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=KV_BLOCKS, max_model_len=256,
                                 max_num_batched_tokens=BUDGET)
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode=mode, mps="off", startup_timeout_s=300),  # type: ignore[arg-type]
                              parallel=ParallelConfig(tensor_parallel_size=tp))

    async def main() -> tuple[list[list[int]], int]:
        engine = await AsyncEngine.start(cfg)
        try:
            async def one(i: int, params: SamplingParams) -> list[int]:
                return [t.token_id async for t in engine.generate(f"r{i}", PROMPTS[i], params)]

            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(_params())))
            stats = await quiet_stats(engine)
            return list(got), stats.num_preemptions
        finally:
            await engine.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["rapid", "hybrid"])
def test_engines_give_llms_tokens(expected: tuple[str, list[list[int]]], mode: str) -> None:
    model, want = expected
    got, preemptions = _serve(model, mode)
    assert got == want
    assert preemptions > 0


def test_rapid_engine_at_tp2(expected: tuple[str, list[list[int]]]) -> None:
    """Both workers each lead a follower rank holding half of every expert."""
    model, want = expected
    got, _ = _serve(model, "rapid", tp=2)
    assert got == want


@pytest.mark.parametrize("model", ["preset:tiny-mixtral", "preset:tiny-qwen3-moe"])
def test_tp2_runner_matches_one_process(model: str) -> None:
    """tests/test_tp_cpu.py's check on the MoE presets: each rank's greedy tokens (prefill, then decode steps,
    some fed from the device) equal one process's; the rank holds half of every expert's features."""
    cfg, source = _config(model)
    runner = ModelRunner(cfg, source, show_progress=False)
    want = _greedy(runner)
    moe = cfg.model_config.moe
    assert moe is not None
    layer = runner.model.layers[0]
    assert layer.moe is not None and tuple(layer.moe.w13.shape) == (moe.num_experts, 2 * moe.intermediate_size,
                                                                    cfg.model_config.hidden_size)
    for rank, (tokens, _, _) in _run_tp(model, 2).items():
        assert tokens == want, f"rank {rank}"
    got = _run_tp(model, 2, mirrored=True)  # the followers replay the leader's calls
    assert got[0][0] == _greedy_sampled(ModelRunner(cfg, source, show_progress=False))
    assert got[1][0] == "done"
