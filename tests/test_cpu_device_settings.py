"""What a CPU run does with the settings that size or shape GPU work: the KV pool as vLLM's CPU backend sizes it
(VLLM_CPU_KVCACHE_SPACE), and the flags a CPU cannot use (--gpu-memory-utilization, --prefill-graph-tokens) said in
the log rather than dropped in silence."""

from __future__ import annotations

import pytest

from rapidserve.config_base import ConfigError


def test_prefill_graph_tokens_on_a_cpu_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """No CUDA graphs on a CPU: buckets given there change nothing, and the log says so (vLLM warns likewise); the
    default buckets, and `none`, say nothing."""
    import logging

    from rapidserve.config_builder import build_engine_config

    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        build_engine_config("preset:tiny-llama", device="cpu", prefill_graph_tokens=(16, 64))
    assert any("--prefill-graph-tokens 16,64: a CPU runs every forward eager" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        build_engine_config("preset:tiny-llama", device="cpu")
        build_engine_config("preset:tiny-llama", device="cpu", prefill_graph_tokens=())
    assert not any("--prefill-graph-tokens" in r.message for r in caplog.records)


@pytest.mark.parametrize(("env", "want"), [({}, 512 * 2**20), ({"VLLM_CPU_KVCACHE_SPACE": "2"}, 2 * 2**30),
                                           ({"VLLM_CPU_KVCACHE_SPACE": "0.25"}, 2**28)])
def test_the_cpu_kv_cache_is_sized_as_vllm_sizes_it(env: dict[str, str], want: int) -> None:
    """vLLM's CPU backend sizes its KV cache by VLLM_CPU_KVCACHE_SPACE (GiB): honoured; else 512 MiB."""
    from rapidserve.config_builder import build_engine_config

    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", env=env)
    assert cfg.cache.cpu_kv_bytes == want


@pytest.mark.parametrize("bad", ["0", "-1", "four", "inf", "nan"])
def test_a_bad_cpu_kv_cache_space_is_refused_by_name(bad: str) -> None:
    from rapidserve.config_builder import build_engine_config

    with pytest.raises(ConfigError, match="VLLM_CPU_KVCACHE_SPACE=.*positive number"):
        build_engine_config("preset:tiny-llama", device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": bad})


def test_gpu_memory_utilization_on_a_cpu_is_said(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from rapidserve.config_builder import build_engine_config

    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        build_engine_config("preset:tiny-llama", device="cpu", gpu_memory_utilization=0.5, env={})
    assert any("--gpu-memory-utilization 0.5: not read on a CPU" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        build_engine_config("preset:tiny-llama", device="cpu", env={})
        build_engine_config("preset:tiny-llama", device="cpu", gpu_memory_utilization=0.5, num_kv_blocks=64, env={})
    assert not any("--gpu-memory-utilization" in r.message for r in caplog.records)
