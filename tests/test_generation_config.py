"""The model's recommended sampling defaults (generation_config.json), as vLLM's --generation-config applies
them: read once into the config tree, a request's own value always wins; `LLM.generate` without parameters
takes them. Over HTTP with the openai client: tests/test_vllm_fields_openai.py."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rapidserve.cli import build_parser, main
from rapidserve.cli_args import engine_kwargs
from rapidserve.cli_serve import server_config
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config, resolve_generation_config
from rapidserve.generation_config import GenerationConfigError, SamplingDefaults, sampling_defaults
from rapidserve.loader import resolve_model
from rapidserve.server import requests as rq
from rapidserve.server_config import FALLBACK_MAX_TOKENS, ServerConfig
from rapidserve.tokenizer import Tokenizer

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def test_the_fields_vllm_reads() -> None:
    d = sampling_defaults(QWEN3, "qwen3")
    assert d.params() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    d = sampling_defaults({"temperature": 1, "min_p": 0, "repetition_penalty": 1.05, "max_new_tokens": 512,
                           "top_k": None, "do_sample": False, "num_beams": 4}, "f")
    assert d.params() == {"temperature": 1.0, "min_p": 0.0, "repetition_penalty": 1.05, "max_tokens": 512}
    assert isinstance(d.params()["temperature"], float) and sampling_defaults({}, "f").params() == {}
    assert "temperature=0.6" in sampling_defaults(QWEN3, "the model's x").describe()
    assert "vLLM's" in SamplingDefaults(source="a GGUF file has no generation_config.json").describe()


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.1), ("temperature", "0.7"), ("temperature", math.inf), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True), ("min_p", 1.1), ("repetition_penalty", 0),
    ("max_new_tokens", 0), ("max_new_tokens", 1.0),
])
def test_a_bad_value_names_the_file_and_field(field: str, value: Any) -> None:
    with pytest.raises(GenerationConfigError) as ei:
        sampling_defaults({field: value}, "/m/generation_config.json")
    assert f"/m/generation_config.json: {field}=" in str(ei.value) and "--generation-config vllm" in str(ei.value)


@pytest.fixture
def hf_folder(tmp_path: Path) -> Path:
    """A Hugging Face folder of the tiny-llama preset with its SmolLM2-free weights (no tokenizer)."""
    from rapidserve.loader.presets import save_as_hf_folder

    save_as_hf_folder(resolve_model("preset:tiny-llama"), str(tmp_path / "m"))
    return tmp_path / "m"


def test_resolve_auto_vllm_and_a_folder(hf_folder: Path, tmp_path: Path) -> None:
    source = resolve_model(str(hf_folder))
    assert resolve_generation_config("auto", source, str(hf_folder)).params() == {}  # the folder has no file
    (hf_folder / "generation_config.json").write_text(json.dumps(QWEN3))
    auto = resolve_generation_config("auto", source, str(hf_folder))
    assert auto.params() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert str(hf_folder) in auto.source
    assert resolve_generation_config("vllm", source, str(hf_folder)).params() == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 9, "temperature": 0.2}))
    assert resolve_generation_config(str(other), source, str(hf_folder)).params() == {"temperature": 0.2,
                                                                                      "max_tokens": 9}
    for spec, says in ((str(tmp_path), "has no generation_config.json"),):
        with pytest.raises(ConfigError, match=says):
            resolve_generation_config(spec, source, str(hf_folder))
    (other / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read it as JSON"):
        resolve_generation_config(str(other), source, str(hf_folder))
    (other / "generation_config.json").write_text("[1]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        resolve_generation_config(str(other), source, str(hf_folder))
    (hf_folder / "generation_config.json").write_text(json.dumps({"top_p": 2}))
    with pytest.raises(ConfigError, match="top_p=2"):
        build_engine_config(str(hf_folder), device="cpu")
    # GGUF files and presets have none
    preset = resolve_model("preset:tiny-llama")
    assert "a preset has no" in resolve_generation_config("auto", preset, "preset:tiny-llama").source


def test_the_config_tree_holds_them(hf_folder: Path) -> None:
    (hf_folder / "generation_config.json").write_text(json.dumps({**QWEN3, "max_new_tokens": 40}))
    cfg, _ = build_engine_config(str(hf_folder), device="cpu")
    assert cfg.generation.params() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 40}
    cfg, _ = build_engine_config(str(hf_folder), device="cpu", load_format="dummy")  # random weights, its defaults
    assert cfg.generation.params() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 40}
    cfg, _ = build_engine_config(str(hf_folder), device="cpu", generation_config="vllm")
    assert cfg.generation.params() == {}
    with pytest.raises(ConfigError, match="--generation-config 'nowhere'"):
        build_engine_config(str(hf_folder), device="cpu", generation_config="nowhere")


def test_serve_refuses_a_bad_one_before_binding_its_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --generation-config needs no model to be refused: `rapidserve serve` exits 2 before `run` binds."""
    from unittest import mock

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    (tmp_path / "empty").mkdir()
    with mock.patch("rapidserve.server.serve.run", side_effect=AssertionError("bound the port")):
        assert main(["serve", "/no/such/model", "--generation-config", "nowhere"]) == 2
        assert "--generation-config 'nowhere'" in capsys.readouterr().err
        assert main(["serve", "/no/such/model", "--generation-config", str(tmp_path / "empty")]) == 2
        assert "has no generation_config.json" in capsys.readouterr().err
        assert main(["serve", "/no/such/model", "--generation-config", str(tmp_path)]) == 2
        assert "temperature=-1 must be a number >= 0" in capsys.readouterr().err


def test_serve_flags() -> None:
    a = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert engine_kwargs(a, {})["generation_config"] == "vllm"
    assert engine_kwargs(build_parser().parse_args(["serve"]), {})["generation_config"] == "auto"
    assert server_config(build_parser().parse_args(["serve"]), {}).default_max_tokens is None
    # max_tokens of a request that gives none: the flag, else the model's max_new_tokens, else 256
    model = SamplingDefaults(max_tokens=40)
    assert ServerConfig().max_tokens_default(model) == 40
    assert ServerConfig(default_max_tokens=100).max_tokens_default(model) == 100
    assert ServerConfig().max_tokens_default(SamplingDefaults()) == FALLBACK_MAX_TOKENS


def test_a_request_field_wins_over_the_models_default(tok: Tokenizer) -> None:
    model = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1,
                             max_tokens=40, source="test")
    ctx = rq.ProtocolContext(tok, ("smol",), 256, 49152, ServerConfig().max_tokens_default(model), defaults=model)
    for kind, base in (("completion", {"prompt": "hi"}), ("chat", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("generate", {"prompt": "hi"})):
        p = rq.parse_request(kind, json.dumps(base).encode(), ctx).params
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
            (0.6, 0.95, 20, 0.05, 1.1, 40)
        own = {"temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1, "max_tokens": 5}
        p = rq.parse_request(kind, json.dumps({**base, **own}).encode(), ctx).params
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0, 1, 0, 0, 1, 5)
        nulls = {k: None for k in own}
        assert rq.parse_request(kind, json.dumps({**base, **nulls}).encode(), ctx).params.top_k == 20
    # the default max_tokens is still capped by what the prompt leaves of the context
    short = replace(ctx, max_model_len=tok_len(tok, "hi") + 10)
    assert rq.parse_request("completion", b'{"prompt": "hi"}', short).params.max_tokens == 10
    # without the model's defaults: vLLM's
    plain = rq.ProtocolContext(tok, ("smol",), 256, 49152, 16)
    p = rq.parse_request("completion", b'{"prompt": "hi"}', plain).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)


def tok_len(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text))


def test_llm_generate_without_parameters_takes_them(hf_folder: Path) -> None:
    from rapidserve import LLM, SamplingParams

    (hf_folder / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 0.9,
                                                                  "max_new_tokens": 5}))
    llm = LLM(str(hf_folder), device="cpu", show_progress=False, max_model_len=256)
    assert llm.get_default_sampling_params() == SamplingParams(top_k=1, temperature=0.9, max_tokens=5)
    prompt = [3, 14, 15, 92, 65]
    got = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0]
    assert got.token_ids == greedy.token_ids and len(got.token_ids) <= 5  # top_k 1: greedy; max_new_tokens 5
    # given parameters are used as they are (vLLM's LLM), whatever the model recommends
    own = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(own.token_ids) == 3
    plain = LLM(str(hf_folder), device="cpu", show_progress=False, max_model_len=256, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
