"""An FP8 checkpoint through the engines on CPU (issue 39): the two-process RAPID engine (decode worker loads the
fp8 weights, scales and input scales; the prefill worker computes with the same memory, attached through shared
memory) gives the greedy tokens `LLM` gives, for prompts that are chunked (a budget of 32 tokens) and batched."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from fp8_folders import float_folder, fp8_folder

from rapidserve import LLM, SamplingParams
from rapidserve.engine.client import AsyncEngine
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[(5 * i + 2) % 500 + 3 for i in range(n)] for n in (3, 20, 45, 70)]
KW = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("fp8-engine")
    return fp8_folder(float_folder(tmp / "float", "llama"), tmp / "fp8", "ct-tensor-static")


def test_rapid_engine_gives_llms_greedy_tokens(folder: Path) -> None:
    llm = LLM(str(folder), show_progress=False, **KW)  # type: ignore[arg-type]
    assert llm.config.quantization.activations == "static"
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    cfg, _ = build_engine_config(str(folder), **KW)  # type: ignore[arg-type]
    cfg = dataclasses.replace(cfg, launch=LaunchConfig(mode="rapid", mps="off", startup_timeout_s=300))

    async def main() -> list[list[int]]:
        engine = await AsyncEngine.start(cfg)
        try:
            async def one(i: int, prompt: list[int]) -> list[int]:
                return [t.token_id async for t in engine.generate(f"r{i}", prompt, GREEDY)]
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == want
