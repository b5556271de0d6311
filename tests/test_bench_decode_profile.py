"""bench/decode_profile.py's engine config on CPU: built through model_runner.engine_config(fp8=...), it is the config
the script built by hand before (the bf16 config with `quantization` replaced by quant_config.ONLINE_FP8), KV cache
untouched."""

from __future__ import annotations

import dataclasses

import pytest
from bench_module import load_bench

from rapidserve.loader.presets import preset_config
from rapidserve.quant_config import ONLINE_FP8, QuantizationConfig

decode_profile = load_bench("decode_profile")
model_runner = load_bench("model_runner")


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_the_profiled_config_is_the_one_built_by_hand_before(quantization: str) -> None:
    mcfg = preset_config("qwen3-8b")
    batches = (1, 8, 32)
    got = decode_profile.profile_config("qwen3-8b", mcfg, batches, quantization)
    before = model_runner.engine_config("qwen3-8b", mcfg, "bfloat16", batches, 8192, 0.9)
    if quantization == "fp8":
        before = dataclasses.replace(before, quantization=ONLINE_FP8)
    assert got == before
    assert got.quantization == (ONLINE_FP8 if quantization == "fp8" else QuantizationConfig())
    assert got.cache.kv_cache_dtype == "auto" and got.runner.graph_batch_sizes == batches
