"""`--max-model-len auto` / -1, vLLM 0.26's "the length that fits the KV cache": the model's max_position_embeddings
where the KV pool holds one sequence of it, else what the pool holds (SchedulerConfig.fit_max_model_len). It was
refused as "not an integer". On CPU:

- the flag's values (auto in any case, -1) and what it still refuses; `engine_sections` / `LLM`'s -1 and "auto";
- the pool is sized with one block as its floor (a pool of fewer tokens than the model's length is no error), the
  start-up log says what a request may reach, and every request stops or is refused there (`LLM`);
- the server reports and checks the fitted length (/v1/models, a 400 naming it), one engine or the least of several.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from types import SimpleNamespace

import pytest
from test_cache_flags import tiny_bytes_per_block

from rapidserve.cli import build_parser
from rapidserve.cli_args import positive_human_int_or_auto
from rapidserve.config import SchedulerConfig
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.engine_settings import engine_sections, fit_max_model_len
from rapidserve.human_int import AUTO


@pytest.mark.parametrize(("text", "want"), [("auto", AUTO), ("AUTO", AUTO), (" Auto ", AUTO), ("-1", AUTO),
                                            ("2048", 2048), ("8k", 8000), ("8K", 8192)])
def test_the_flag_takes_auto(text: str, want: int) -> None:
    assert positive_human_int_or_auto(text) == want
    assert build_parser().parse_args(["serve", "--max-model-len", text]).max_model_len == want


@pytest.mark.parametrize(("text", "needle"), [("-2", "-2 must be an integer >= 1"), ("0", "0 must be an integer >= 1"),
                                              ("lots", "or auto / -1 (the length that fits the KV cache)"),
                                              ("autofit", "'autofit' is not an integer")])
def test_the_flag_refuses_the_rest(text: str, needle: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(needle)):
        positive_human_int_or_auto(text)


@pytest.mark.parametrize(("given", "want"), [(None, (None, False)), (512, (512, False)), (AUTO, (None, True)),
                                             ("auto", (None, True)), ("AUTO", (None, True)), ("-1", (None, True))])
def test_the_settings_read_auto(given: int | str | None, want: tuple[int | None, bool]) -> None:
    assert fit_max_model_len(given) == want
    s = engine_sections(max_model_len=given).scheduler
    assert (s.max_model_len, s.fit_max_model_len) == want


def test_the_settings_refuse_other_words_and_both() -> None:
    with pytest.raises(ConfigError, match="max_model_len='big': give a positive integer, -1 or 'auto'"):
        engine_sections(max_model_len="big")
    with pytest.raises(ConfigError, match="must be a positive integer"):
        engine_sections(max_model_len=-2)
    with pytest.raises(ConfigError, match="max_model_len=64 with fit_max_model_len: give one"):
        SchedulerConfig(max_model_len=64, fit_max_model_len=True)


def test_the_tree_keeps_the_models_length_until_the_pool_is_sized() -> None:
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", max_model_len="auto", env={})
    assert cfg.scheduler.fit_max_model_len and cfg.scheduler.max_model_len is None
    assert cfg.max_model_len == cfg.model_config.max_position_embeddings


@pytest.mark.parametrize("given", [-1, "auto"])
def test_llm_fits_the_length_to_a_small_pool(given: int | str, caplog: pytest.LogCaptureFixture) -> None:
    """10 blocks (160 tokens) where one sequence of the model's length needs more: without auto a ConfigError
    (test_cache_flags.test_less_than_one_sequence_is_refused_by_name); with it the engine starts, says so, refuses a
    prompt of 160 tokens naming 160, and stops a request at 160 tokens ("length")."""
    from rapidserve import LLM, SamplingParams

    per_block = tiny_bytes_per_block()
    with caplog.at_level(logging.WARNING, logger="rapidserve.runner.kv_sizing"):
        llm = LLM("preset:tiny-llama", device="cpu", kv_cache_memory_bytes=10 * per_block, max_model_len=given,
                  show_progress=False)
    model_len = llm.engine.runner.max_model_len
    assert model_len > 160
    assert (f"--max-model-len auto: the KV cache holds 160 tokens, fewer than the model's {model_len}: a request's "
            "prompt and output may reach 160 tokens (max_model_len 160)") in caplog.text
    assert llm.engine.limits.context_cap == 160
    with pytest.raises(ValueError, match="maximum context length is 160 tokens"):
        llm.generate([{"prompt_token_ids": [5] * 160}], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [5] * 150}], SamplingParams(max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_a_pool_that_holds_the_models_length_keeps_it(caplog: pytest.LogCaptureFixture) -> None:
    from rapidserve import LLM

    with caplog.at_level(logging.WARNING, logger="rapidserve.runner.kv_sizing"):
        llm = LLM("preset:tiny-llama", device="cpu", max_model_len="auto", show_progress=False)
    assert llm.engine.limits.context_cap == llm.engine.runner.max_model_len
    assert "--max-model-len auto" not in caplog.text


def test_the_server_reports_the_fitted_length() -> None:
    from rapidserve.server.serve import fitted_max_model_len

    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", max_model_len="auto", env={})
    fitted = fitted_max_model_len(cfg, 160)
    assert fitted.max_model_len == 160 and not fitted.scheduler.fit_max_model_len
    assert fitted_max_model_len(cfg, cfg.max_model_len + 16) is cfg  # the pool holds more: the model's length


def test_several_engines_fit_to_the_least() -> None:
    from rapidserve.engine.data_parallel import DataParallelEngine

    engines = SimpleNamespace(engines=[SimpleNamespace(context_cap=4096), SimpleNamespace(context_cap=160)])
    assert DataParallelEngine.context_cap.fget(engines) == 160  # type: ignore[attr-defined]


def test_serve_with_auto_reports_and_enforces_it() -> None:
    """`rapidserve serve --max-model-len auto` with a pool of 10 blocks: /v1/models says 160, and a prompt of 170
    tokens is a 400 naming 160."""
    from test_server import http, start, stop

    s = start("--model", "preset:tiny-llama", "--max-model-len", "auto",
              "--kv-cache-memory-bytes", str(10 * tiny_bytes_per_block()))
    try:
        models = json.loads(http(s.url + "/v1/models")[2])
        assert [m["max_model_len"] for m in models["data"]] == [160]
        body = json.dumps({"model": models["data"][0]["id"], "prompt": [5] * 170, "max_tokens": 1}).encode()
        status, _, out = http(s.url + "/v1/completions", "POST", body, {"Content-Type": "application/json"})
        assert status == 400 and "maximum context length is 160 tokens" in out.decode()
    finally:
        assert stop(s) == 0
