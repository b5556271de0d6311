"""The KV pool's sizing flags as vLLM 0.26 takes them: --gpu-memory-utilization's default is vLLM's 0.92 wherever a
run starts (the CLI, `LLM`, build_engine_config, the tree). CPU only."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from rapidserve.cache_config import GPU_MEMORY_UTILIZATION, CacheConfig
from rapidserve.cli import build_parser
from rapidserve.config_builder import build_engine_config
from rapidserve.engine_settings import engine_sections

API = json.loads((Path(__file__).parent / "data" / "vllm_0_26_python_api.json").read_text())


def test_the_default_utilization_is_vllms() -> None:
    """vLLM 0.26's LLM(...) and EngineArgs default (read from its wheel into the surface file): 0.92, ours too."""
    assert API["llm_init"]["gpu_memory_utilization"] == API["engine_args"]["gpu_memory_utilization"] == 0.92
    assert GPU_MEMORY_UTILIZATION == 0.92
    assert CacheConfig().gpu_memory_utilization == 0.92
    for fn in (build_engine_config, engine_sections):
        assert inspect.signature(fn).parameters["gpu_memory_utilization"].default == 0.92
    for command in (["generate", "--prompt", "x"], ["serve"], ["profile"]):
        assert build_parser().parse_args(command).gpu_memory_utilization == 0.92
    assert build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.9"]).gpu_memory_utilization == 0.9


@pytest.mark.parametrize("kw", [{}, {"gpu_memory_utilization": 0.5}])
def test_the_tree_carries_it(kw: dict[str, float]) -> None:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", env={}, **kw)  # type: ignore[arg-type]
    assert cfg.cache.gpu_memory_utilization == kw.get("gpu_memory_utilization", 0.92)


def test_llm_takes_the_default() -> None:
    """`LLM` gives build_engine_config only what it was given: an LLM without it runs at 0.92."""
    from rapidserve import LLM

    llm = LLM("preset:tiny-llama", device="cpu", num_kv_blocks=8, max_model_len=64, show_progress=False)
    assert llm.config.cache.gpu_memory_utilization == 0.92
