"""The mistral and gemma3 tiny presets served by the worker engines on CPU (issue 40): rapid mode (a decode and a
prefill worker sharing the weights and the KV pool: the prefill worker's model attached to the decode worker's, with
Gemma's class and RoPE tables) and hybrid mode give `LLM.generate`'s greedy tokens, with prompts and outputs past
the sliding windows, and every KV block comes back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.config import EngineConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_engine import wait_blocks_free

NEW = 24
LENGTHS = [3, 14, 40, 25, 90, 9]  # past the windows (13, 11)


def _prompts(vocab: int) -> list[list[int]]:
    return [[(11 * i + 7 * n) % vocab for i in range(n)] for n in LENGTHS]


def _config(model: str, mode: str) -> EngineConfig:
    cfg, _ = build_engine_config(model, device="cpu", dtype="float32", num_kv_blocks=40, max_model_len=256,
                                 max_num_batched_tokens=128)
    launch = LaunchConfig(mode=mode, mps="off", startup_timeout_s=300)  # type: ignore[arg-type]
    return dataclasses.replace(cfg, launch=launch)


@pytest.mark.parametrize(("model", "mode"), [("preset:tiny-mistral", "rapid"), ("preset:tiny-gemma3", "rapid"),
                                             ("preset:tiny-gemma3", "hybrid")])
def test_engine_serves_the_preset_as_llm_does(model: str, mode: str) -> None:
    llm = LLM(model, dtype="float32", device="cpu", show_progress=False, max_model_len=256)
    prompts = _prompts(llm.config.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    async def main() -> list[list[int]]:
        engine = await AsyncEngine.start(_config(model, mode))
        try:
            async def one(i: int, p: list[int]) -> list[int]:
                return [t.token_id async for t in engine.generate(f"r{i}", p, params)]

            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            await wait_blocks_free(engine)
            return list(got)
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want
