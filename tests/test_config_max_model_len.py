"""A max_model_len above the model's max_position_embeddings is refused when the config tree is built (before
any weights, RoPE table or KV pool), in every engine path, unless $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's
VLLM_ALLOW_LONG_MAX_MODEL_LEN), read once where the run starts. Tables on CPU; the CLI's in test_cli.py."""

from __future__ import annotations

import dataclasses
import logging
from unittest import mock

import pytest

from rapidserve.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import allow_long_max_model_len, build_engine_config
from rapidserve.launch_config import LaunchConfig

LIMIT = 1024
MODEL = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, max_position_embeddings=LIMIT, name="tiny")


def engine_config(max_model_len: int | None, allow_long: bool = False, **kw: object) -> EngineConfig:
    sched = SchedulerConfig(max_model_len=max_model_len, allow_long_max_model_len=allow_long)
    return EngineConfig(model="preset:tiny", model_config=MODEL, scheduler=sched, **kw)  # type: ignore[arg-type]


# (max_model_len, allow_long, the resolved max_model_len, or None where refused)
CASES = [
    (None, False, LIMIT),  # unset: the model's max_position_embeddings
    (1, False, 1),
    (LIMIT - 1, False, LIMIT - 1),  # below
    (LIMIT, False, LIMIT),  # equal
    (LIMIT + 1, False, None),  # above
    (10**12, False, None),  # far above (a RoPE table of 10^12 rows, were it accepted)
    (None, True, LIMIT),
    (LIMIT, True, LIMIT),
    (LIMIT + 1, True, LIMIT + 1),  # above, allowed
    (10**12, True, 10**12),  # allowed here; the KV pool's own check refuses it later (test_cli)
]


@pytest.mark.parametrize("max_model_len,allow_long,want", CASES)
def test_max_model_len_problem(max_model_len: int | None, allow_long: bool, want: int | None) -> None:
    problem = MODEL.max_model_len_problem(max_model_len, allow_long)
    assert (problem is None) == (want is not None)
    if problem is not None:
        assert problem.startswith(f"--max-model-len {max_model_len} is more than the model's "
                                  f"max_position_embeddings={LIMIT} (tiny)")
        assert f"Lower --max-model-len to at most {LIMIT}" in problem
        assert f"set the environment variable {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to allow it anyway" in problem


@pytest.mark.parametrize("max_model_len,allow_long,want", CASES)
def test_engine_config_checks_max_model_len(max_model_len: int | None, allow_long: bool, want: int | None) -> None:
    if want is None:
        with pytest.raises(ConfigError, match=f"--max-model-len {max_model_len} .*max_position_embeddings={LIMIT}"):
            engine_config(max_model_len, allow_long)
    else:
        assert engine_config(max_model_len, allow_long).max_model_len == want


@pytest.mark.parametrize("kw", [
    {},
    {"launch": LaunchConfig(mode="hybrid", mps="off")},
    {"launch": LaunchConfig(mode="disagg", mps="off")},
    {"parallel": ParallelConfig(tensor_parallel_size=2)},
    {"parallel": ParallelConfig(data_parallel_size=2)},
    {"launch": LaunchConfig(mode="hybrid", mps="off"), "parallel": ParallelConfig(tensor_parallel_size=2)},
])
def test_every_engine_path_refuses_it(kw: dict[str, object]) -> None:
    """The tree every engine starts from refuses it, whether built so or changed so later (dataclasses.replace,
    as `rapidserve serve` adds the launch, partition and parallel parts)."""
    with pytest.raises(ConfigError, match="RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1"):
        engine_config(LIMIT + 1, **kw)
    ok = engine_config(LIMIT, **kw)
    with pytest.raises(ConfigError, match="RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1"):
        dataclasses.replace(ok, scheduler=SchedulerConfig(max_model_len=LIMIT + 1))
    assert engine_config(LIMIT + 1, True, **kw).max_model_len == LIMIT + 1


def test_scheduler_refuses_a_max_model_len_below_one() -> None:
    with pytest.raises(ConfigError, match="max_model_len=0 must be a positive integer"):
        SchedulerConfig(max_model_len=0)


@pytest.mark.parametrize("env,want", [
    ({}, False),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: ""}, False),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "0"}, False),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "false"}, False),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "False"}, False),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "1"}, True),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: " 1\n"}, True),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "true"}, True),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "TRUE"}, True),
    ({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}, False),  # vLLM's own variable is not ours
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "yes"}, "'yes': use 1 to allow"),
    ({ALLOW_LONG_MAX_MODEL_LEN_ENV: "2"}, "'2': use 1 to allow"),
])
def test_allow_long_max_model_len_from_env(env: dict[str, str], want: bool | str) -> None:
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}={want}"):
            allow_long_max_model_len(env)
    else:
        assert allow_long_max_model_len(env) is want


def test_build_engine_config_refuses_or_warns(caplog: pytest.LogCaptureFixture) -> None:
    kw = dict(device="cpu", dtype="float32", max_model_len=2048)  # tiny-llama: max_position_embeddings 1024
    with pytest.raises(ConfigError, match="--max-model-len 2048 is more than the model's max_position_embeddings="
                                          "1024 \\(tiny-llama\\)"):
        build_engine_config("preset:tiny-llama", **kw)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        cfg, _ = build_engine_config("preset:tiny-llama", allow_long_max_model_len=True, **kw)  # type: ignore[arg-type]
    assert cfg.max_model_len == 2048 and cfg.scheduler.allow_long_max_model_len
    assert "max_model_len 2048 is more than the model's max_position_embeddings 1024" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rapidserve.config"):
        build_engine_config("preset:tiny-llama", allow_long_max_model_len=True, device="cpu", max_model_len=1024)
    assert caplog.text == ""


def test_llm_refuses_before_building_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM` reads $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN once; an explicit allow_long_max_model_len wins over it."""
    from rapidserve import llm as llm_mod

    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    with mock.patch.object(llm_mod, "EngineCore", side_effect=AssertionError("the engine was built")):
        with pytest.raises(ConfigError, match=f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to allow it anyway"):
            llm_mod.LLM("preset:tiny-llama", device="cpu", max_model_len=1025, show_progress=False)
        monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
        with pytest.raises(ConfigError, match="--max-model-len 1025"):
            llm_mod.LLM("preset:tiny-llama", device="cpu", max_model_len=1025, show_progress=False,
                        allow_long_max_model_len=False)
        monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "maybe")
        with pytest.raises(ConfigError, match="'maybe': use 1"):
            llm_mod.LLM("preset:tiny-llama", device="cpu", show_progress=False)


def test_llm_runs_with_the_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidserve import LLM, SamplingParams

    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")
    llm = LLM("preset:tiny-llama", dtype="float32", device="cpu", max_model_len=1100, num_kv_blocks=80,
              show_progress=False)
    assert llm.config.max_model_len == 1100 and llm.config.scheduler.allow_long_max_model_len
    prompt = [1 + i % 200 for i in range(1090)]  # positions up to 1099, past the model's 1024
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 10
