"""The KV pool's sizing flags as vLLM 0.26 takes them: --gpu-memory-utilization's default is vLLM's 0.92 wherever a
run starts (the CLI, `LLM`, build_engine_config, the tree). CPU only."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from rapidserve.cache_config import GPU_MEMORY_UTILIZATION, CacheConfig
from rapidserve.cli import build_parser
from rapidserve.config import SchedulerConfig
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


# ---- --kv-cache-memory-bytes (vLLM's; was refused) -------------------------------------------------------------------

def tiny_bytes_per_block(block_size: int = 16) -> int:
    """One KV block of preset:tiny-llama on a CPU (float32), from its config."""
    from rapidserve.loader import resolve_model

    m = resolve_model("preset:tiny-llama").config
    return m.num_layers * 2 * m.num_kv_heads * block_size * m.head_dim * 4


@pytest.mark.parametrize("text,want", [("8G", 8 * 2**30), ("8g", 8 * 10**9), ("512M", 2**29), ("1.5g", 1_500_000_000),
                                       ("123456", 123456)])
def test_the_flag_takes_vllms_integers(text: str, want: int) -> None:
    for command in (["generate", "--prompt", "x"], ["serve"], ["profile"]):
        assert build_parser().parse_args([*command, "--kv-cache-memory-bytes", text]).kv_cache_memory_bytes == want
    assert build_parser().parse_args(["serve"]).kv_cache_memory_bytes is None


@pytest.mark.parametrize("text,needle", [("1.5G", "Did you mean to use 1.5g instead?"),
                                         ("0", "0 must be an integer >= 1"), ("lots", "'lots' is not an integer")])
def test_the_flag_refuses_by_name(text: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-memory-bytes", text])
    err = capsys.readouterr().err
    assert "argument --kv-cache-memory-bytes: " in err and needle in err


def test_it_is_no_longer_refused() -> None:
    from rapidserve import llm_args
    from rapidserve.vllm_serve_flags import NO_OP, REFUSED

    assert "--kv-cache-memory-bytes" not in REFUSED and "--kv-cache-memory-bytes" not in NO_OP
    assert "--kv-cache-memory-bytes" in REFUSED["--swap-space"]  # the reason the others get names it as ours
    assert llm_args.HONOURED["kv_cache_memory_bytes"] == "kv_cache_memory_bytes"
    assert "kv_cache_memory_bytes" not in llm_args.VLLM_DEFAULTS
    assert llm_args.resolve({"kv_cache_memory_bytes": 2**30}, inspect.signature(build_engine_config).parameters) \
        == {"kv_cache_memory_bytes": 2**30}


def test_the_cpu_pool_takes_it(caplog: pytest.LogCaptureFixture) -> None:
    """On a CPU it is the pool's bytes (instead of 512 MiB): blocks == N // bytes per block, in the tree, the runner and
    the start-up line."""
    import logging

    from rapidserve import LLM, SamplingParams

    per_block = tiny_bytes_per_block()
    n = 37 * per_block + per_block // 2  # 37 and a half blocks' bytes: 37 blocks
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", kv_cache_memory_bytes=n, env={})
    assert cfg.cache.kv_cache_memory_bytes == cfg.cache.cpu_kv_bytes == n
    with caplog.at_level(logging.INFO, logger="rapidserve.runner.model_runner"):
        llm = LLM("preset:tiny-llama", device="cpu", kv_cache_memory_bytes=n, max_model_len=256, show_progress=False)
    assert llm.engine.runner.kv_pool.num_blocks == n // per_block == 37
    assert llm.engine.runner.kv_pool.spec.bytes_per_block == per_block
    assert f"KV cache: 37 blocks of 16 tokens, torch.float32 (--kv-cache-memory-bytes {n} (0.00 GiB))" in caplog.text
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_vllms_cpu_kv_cache_space_replaces_it(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's CPU platform sets kv_cache_memory_bytes from VLLM_CPU_KVCACHE_SPACE where that is set: so here, said."""
    import logging

    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", kv_cache_memory_bytes=2**20,
                                     env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert cfg.cache.cpu_kv_bytes == 2**30 and cfg.cache.kv_cache_memory_bytes is None
    assert "--kv-cache-memory-bytes 1048576: replaced by $VLLM_CPU_KVCACHE_SPACE=1" in caplog.text


def test_less_than_one_sequence_is_refused_by_name() -> None:
    from rapidserve import LLM
    from rapidserve.config_base import ConfigError

    per_block = tiny_bytes_per_block()
    with pytest.raises(ConfigError) as e:
        LLM("preset:tiny-llama", device="cpu", kv_cache_memory_bytes=10 * per_block, max_model_len=256,
            show_progress=False)
    assert str(e.value) == (f"--kv-cache-memory-bytes {10 * per_block}: the KV cache gets 10 blocks (0.00 GiB) but one "
                            f"sequence of 256 tokens needs 16 ({16 * per_block} bytes); give at least that, or use "
                            "--max-model-len <= 160 (what it holds)")


@pytest.mark.parametrize("kw", [{"num_kv_blocks": 64}, {"num_gpu_blocks_override": 64}])
def test_not_with_num_kv_blocks(kw: dict[str, int]) -> None:
    from rapidserve import LLM
    from rapidserve.config_base import ConfigError

    with pytest.raises(ConfigError, match=r"--kv-cache-memory-bytes 1073741824 and --num-kv-blocks 64 \(LLM's "
                                          "kv_cache_memory_bytes and num_gpu_blocks_override\\) both fix the KV "
                                          "pool's size: give one of them"):
        LLM("preset:tiny-llama", device="cpu", kv_cache_memory_bytes=2**30, show_progress=False, **kw)
    with pytest.raises(ConfigError, match="must be a positive number of bytes"):
        CacheConfig(kv_cache_memory_bytes=0)


def test_not_with_num_kv_blocks_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from test_cli import usage_error

    err = usage_error(capsys, "generate", "--prompt", "hi", "--model", "preset:tiny-llama", "--device", "cpu",
                      "--num-kv-blocks", "64", "--kv-cache-memory-bytes", "1G")
    assert "--kv-cache-memory-bytes 1073741824 and --num-kv-blocks 64" in err and "give one of them" in err


class FakeRunner:
    """What `KVSizing._given_kv_bytes` reads of a runner on a GPU."""

    def __init__(self, given: int) -> None:
        import torch

        self.cfg = type("Cfg", (), {"cache": CacheConfig(kv_cache_memory_bytes=given, gpu_memory_utilization=0.5)})()
        self.device = torch.device("cuda", 0)


@pytest.mark.parametrize("given,free,ok", [(8 * 2**30, 20 * 2**30, True), (20 * 2**30, 20 * 2**30, True),
                                           (21 * 2**30, 20 * 2**30, False)])
def test_on_a_gpu_the_bytes_are_taken_as_given(given: int, free: int, ok: bool) -> None:
    """A GPU's pool: the bytes as given, the share not read, no profiling step (`_gpu_kv_budget` never runs); more
    than the GPU has free after the weights is refused by name (not an out-of-memory error at the allocation)."""
    from unittest import mock

    from rapidserve.config_base import ConfigError
    from rapidserve.runner.kv_sizing import KVSizing

    runner = FakeRunner(given)
    with mock.patch("torch.cuda.mem_get_info", return_value=(free, 80 * 2**30)):
        if ok:
            assert KVSizing._given_kv_bytes(runner) == given  # type: ignore[arg-type]
            assert runner.kv_sizing.startswith(f"--kv-cache-memory-bytes {given} ({given / 2**30:.2f} GiB) as given: "
                                               "no memory profiling, --gpu-memory-utilization (0.5) not used, as "
                                               f"vLLM; {free / 2**30:.2f} of 80.00 GiB were free")
        else:
            with pytest.raises(ConfigError, match=f"--kv-cache-memory-bytes {given} \\(21.00 GiB\\): cuda:0 has 20.00 "
                                                  "of 80.00 GiB free once the weights are loaded; give less"):
                KVSizing._given_kv_bytes(runner)  # type: ignore[arg-type]


def test_the_gpu_path_skips_the_profiling_step() -> None:
    """`_allocate_kv_pool` with --kv-cache-memory-bytes on a GPU sizes from the given bytes and never runs the dummy
    prefill (`_gpu_kv_budget`)."""
    from unittest import mock

    import torch

    from rapidserve.kv_pool import KVPool
    from rapidserve.loader import resolve_model
    from rapidserve.runner.kv_sizing import KVSizing

    mcfg = resolve_model("preset:tiny-llama").config
    per_block = tiny_bytes_per_block()

    class Runner(KVSizing):
        def __init__(self) -> None:
            self.cfg = type("Cfg", (), {"cache": CacheConfig(kv_cache_memory_bytes=50 * per_block),
                                        "scheduler": SchedulerConfig()})()
            self.model = type("Model", (), {"cfg": mcfg})()
            self.device, self.tp, self.kv_dtype = torch.device("cuda", 0), None, torch.float32
            self.block_size, self.max_model_len, self.mcfg = 16, 256, mcfg

        def _gpu_kv_budget(self) -> int:
            raise AssertionError("profiled")

    allocated = []
    with mock.patch("torch.cuda.mem_get_info", return_value=(2**30, 2**31)), \
            mock.patch.object(KVPool, "allocate", side_effect=lambda spec, dev: allocated.append(spec)):
        Runner()._allocate_kv_pool(None)
    assert [s.num_blocks for s in allocated] == [50]
