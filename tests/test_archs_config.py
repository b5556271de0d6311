"""The mistral and gemma3 architectures (issue 40) as the loader reads them: config.json forms (transformers 4 and 5,
Gemma 3's multimodal config with its text_config), what is refused by name, the presets, the Hugging Face folder
round trip, a multimodal Gemma 3 checkpoint's text weights, and generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from rapidserve.config import RopeScaling
from rapidserve.config_base import ConfigError
from rapidserve.config_builder import build_engine_config
from rapidserve.loader import ModelLoadError, expected_tensor_shapes, rank_weights, resolve_model
from rapidserve.loader.hf import config_from_hf_dict
from rapidserve.loader.presets import hf_config_dict, load_preset, preset_config, save_as_hf_folder
from rapidserve.parallel.shard import shard_tensor, tp_layout

NEW = ["tiny-mistral", "tiny-gemma3"]

# Mistral-7B-v0.1's config.json, and google/gemma-3-12b-it's (its text_config leaves the rest to Gemma3TextConfig).
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
              "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "vocab_size": 32000}
GEMMA3_12B = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
              "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256, "model_type": "gemma3",
              "text_config": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                              "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
              "torch_dtype": "bfloat16",
              "vision_config": {"hidden_size": 1152, "image_size": 896, "model_type": "siglip_vision_model",
                                "num_hidden_layers": 27, "patch_size": 14}}
LLAMA = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}


# ------------------------------------------------------------------------------------------- config.json
def test_real_configs_give_the_presets() -> None:
    assert config_from_hf_dict(MISTRAL_7B, "c.json", name="mistral-7b") == preset_config("mistral-7b")
    assert config_from_hf_dict(GEMMA3_12B, "c.json", name="gemma3-12b") == preset_config("gemma3-12b")


@pytest.mark.parametrize(("given", "window"), [({}, 4096), ({"sliding_window": None}, None),
                                               ({"sliding_window": 13}, 13)])
def test_mistral_window(given: dict[str, Any], window: int | None) -> None:
    """transformers' MistralConfig windows 4096 tokens when config.json has no sliding_window; null: none."""
    cfg = config_from_hf_dict({**LLAMA, "model_type": "mistral", **given}, "c.json")
    assert cfg.arch == "mistral" and cfg.sliding_window == window and cfg.layer_types == ()
    assert [cfg.layer_window(i) for i in range(3)] == [window] * 3


def test_qwen_sliding_window_is_honoured_not_ignored() -> None:
    base = {**LLAMA, "model_type": "qwen2", "sliding_window": 8, "max_window_layers": 1}
    assert config_from_hf_dict({**base, "use_sliding_window": False}, "c.json").sliding_window is None
    on = config_from_hf_dict({**base, "use_sliding_window": True}, "c.json")
    assert [on.layer_window(i) for i in range(3)] == [None, 8, 8]  # layers from max_window_layers on
    given = config_from_hf_dict({**base, "model_type": "qwen3", "use_sliding_window": True,
                                 "layer_types": ["sliding_attention", "full_attention", "full_attention"]}, "c.json")
    assert [given.layer_window(i) for i in range(3)] == [8, None, None]


def test_gemma3_config_forms() -> None:
    """transformers 5's config.json (rope_parameters per layer type, layer_types) and 4's (rope_theta,
    rope_local_base_freq, rope_scaling, sliding_window_pattern) give the same model; a gemma3 config's text_config
    takes Gemma3TextConfig's defaults (gemma-3-4b-it's shapes)."""
    want = preset_config("tiny-gemma3")
    v5 = hf_config_dict(want)
    assert config_from_hf_dict(v5, "c.json", name=want.name) == want
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "layer_types")}
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
              sliding_window_pattern=3)
    assert config_from_hf_dict(v4, "c.json", name=want.name) == want
    four_b = config_from_hf_dict({"model_type": "gemma3", "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}, "c.json")
    assert (four_b.num_heads, four_b.num_kv_heads, four_b.head_dim, four_b.vocab_size, four_b.query_pre_attn_scalar,
            four_b.rope_local_theta, four_b.rope_theta, four_b.tie_word_embeddings) == (
        8, 4, 256, 262208, 256.0, 10000.0, 1e6, True)
    assert [four_b.layer_window(i) for i in range(6)] == [1024] * 5 + [None]  # every 6th layer global
    assert four_b.rope_scaling == RopeScaling(factor=8.0, rope_type="linear")
    assert abs(four_b.num_params() - 3.88e9) < 0.01e9  # gemma-3-4b's language model


@pytest.mark.parametrize(("change", "named"), [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}, "sliding layers' rope"),
    ({"layer_types": ["sliding_attention"] * 3, "sliding_window": None}, "sliding_window"),
    ({"layer_types": ["local"] * 3}, "layer_types"),
])
def test_gemma3_refusals_name_the_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match="gemma3|not supported|sliding_window|layer_types") as e:
        config_from_hf_dict({**hf_config_dict(preset_config("tiny-gemma3")), **change}, "c.json")
    assert named in str(e.value)


def test_final_logit_softcapping_is_read() -> None:
    """Gemma 3 has none (null); a config that sets one gets it applied (Gemma2-style), not ignored."""
    d = hf_config_dict(preset_config("tiny-gemma3"))
    assert config_from_hf_dict({**d, "final_logit_softcapping": None}, "c.json").final_logit_softcapping is None
    assert config_from_hf_dict(d, "c.json").final_logit_softcapping == 30.0


@pytest.mark.parametrize("model_type", ["phi3", "deepseek_v3", "gpt_oss", "gemma2"])
def test_unsupported_architectures_are_refused_listing_the_supported(model_type: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": model_type}))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    msg = str(e.value)
    assert f"model_type {model_type!r} is not supported" in msg
    assert "supported model types: llama, mistral, qwen2, qwen3, gemma3_text, gemma3" in msg
    assert "supported architectures: llama, qwen2, qwen3, mistral, gemma3" in msg


def test_gemma3_multimodal_config_needs_its_text_config() -> None:
    with pytest.raises(ModelLoadError, match="text_config"):
        config_from_hf_dict({"model_type": "gemma3"}, "c.json")


def test_model_config_checks() -> None:
    base = preset_config("tiny-gemma3")
    with pytest.raises(ConfigError, match="layer_types"):
        base.replace(layer_types=("sliding_attention",))
    with pytest.raises(ConfigError, match="sliding_window"):
        base.replace(sliding_window=0)
    with pytest.raises(ConfigError, match="rope_local_theta"):
        base.replace(rope_local_theta=None)
    with pytest.raises(ConfigError, match="rope_type='yarn'"):
        RopeScaling(rope_type="yarn")
    assert base.attn_scale == 24.0**-0.5 and preset_config("tiny-mistral").attn_scale == 16**-0.5


# ------------------------------------------------------------------------------------------------- presets
def test_presets() -> None:
    m7 = preset_config("mistral-7b")
    assert (m7.arch, m7.vocab_size, m7.hidden_size, m7.num_layers, m7.num_kv_heads, m7.sliding_window,
            m7.max_position_embeddings) == ("mistral", 32000, 4096, 32, 8, 4096, 32768)
    assert abs(m7.num_params() - 7.24e9) < 0.01e9
    g12 = preset_config("gemma3-12b")
    assert (g12.arch, g12.head_dim, g12.num_heads, g12.num_layers, g12.sliding_window, g12.eos_token_ids) == (
        "gemma3", 256, 16, 48, 1024, (1, 106))
    assert [g12.layer_window(i) for i in range(12)] == ([1024] * 5 + [None]) * 2
    assert abs(g12.num_params() - 11.77e9) < 0.01e9  # gemma-3-12b's language model (its vision tower: 0.4B more)
    tm, tg = preset_config("tiny-mistral"), preset_config("tiny-gemma3")
    assert tm.sliding_window == 13 and tm.layer_window(1) == 13
    assert [tg.layer_window(i) for i in range(3)] == [11, 11, None]
    assert tg.head_dim * tg.num_heads != tg.hidden_size and tg.final_logit_softcapping == 30.0


@pytest.mark.parametrize("name", NEW)
def test_preset_tensors(name: str) -> None:
    src = resolve_model(f"preset:{name}")
    names = [n for n, _ in src.weights()]
    assert names == list(expected_tensor_shapes(src.config)) and src.num_tensors == len(names)
    gemma = name == "tiny-gemma3"
    for n in ("model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight",
              "model.layers.0.self_attn.q_norm.weight"):
        assert (n in names) == gemma
    assert ("lm_head.weight" in names) == (not gemma)
    norm = dict(src.weights())["model.norm.weight"]
    assert abs(float(norm.mean()) - (0.0 if gemma else 1.0)) < 0.05  # Gemma's norms multiply by 1 + weight


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("sharded", [False, True])
def test_hf_folder_round_trip(tmp_path: Path, name: str, sharded: bool) -> None:
    src = load_preset(name)
    save_as_hf_folder(src, tmp_path, max_shard_bytes=200_000 if sharded else None)
    back = resolve_model(str(tmp_path))
    assert back.config == src.config.replace(name=tmp_path.name)
    want = dict(src.weights())
    got = dict(back.weights())
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)


# ------------------------------------------------------------------------------- a multimodal checkpoint
def multimodal_folder(path: Path, prefix: str = "language_model.", head: str = "language_model.") -> Path:
    """tiny-gemma3 as a Gemma3ForConditionalGeneration checkpoint: config.json with a text_config, the language
    model's weights under `prefix` (transformers 4: language_model.model.*; 5: model.language_model.*), and a
    vision tower and projector that must not be read."""
    src = load_preset("tiny-gemma3")
    text = hf_config_dict(src.config)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "eos_token_id": text.pop("eos_token_id"), "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8}}))
    tensors = {}
    for n, t in src.weights():
        ours = n.removeprefix("model.")
        tensors[f"{prefix}model.{ours}" if prefix == "language_model." else f"{prefix}{ours}"] = t
    tensors[f"{head}lm_head.weight" if head else "lm_head.weight"] = dict(src.weights())["model.embed_tokens.weight"]
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.ones(8, 3, 2, 2)
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.ones(8, 64)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(("prefix", "head"), [("language_model.", "language_model."), ("model.language_model.", "")],
                         ids=["transformers4", "transformers5"])
def test_multimodal_checkpoint_serves_its_text_model(tmp_path: Path, prefix: str, head: str) -> None:
    folder = multimodal_folder(tmp_path / "mm", prefix, head)
    src, want = resolve_model(str(folder)), load_preset("tiny-gemma3")
    assert src.config == want.config.replace(name="mm")
    got, ref = dict(src.weights()), dict(want.weights())
    assert list(got) == list(ref) and all(torch.equal(got[n], ref[n]) for n in ref)  # the vision tower unread
    cfg = src.config
    for rank in range(2):  # a tensor-parallel rank reads its slices of the renamed tensors
        lay = tp_layout(cfg, 2, rank)
        for n, part in rank_weights(src, lay):
            assert torch.equal(part, shard_tensor(n, ref[n], lay)), n


def test_multimodal_checkpoint_without_language_model_weights_is_refused(tmp_path: Path) -> None:
    folder = multimodal_folder(tmp_path / "mm")
    bare = {n.removeprefix("language_model."): t for n, t in _read(folder).items()}  # model.layers.*: no prefix
    save_file(bare, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no weights named language_model.model"):
        resolve_model(str(folder))


def _read(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_generation_config_of_a_gemma3_folder(tmp_path: Path) -> None:
    """generation_config.json is read as for any folder: Gemma 3's top_k 64 and top_p 0.95 (its do_sample and
    cache_implementation are not sampling defaults); Mistral's has none."""
    save_as_hf_folder(load_preset("tiny-gemma3"), tmp_path / "g")
    (tmp_path / "g" / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 2, "cache_implementation": "hybrid", "do_sample": True, "eos_token_id": [1, 106],
        "pad_token_id": 0, "top_k": 64, "top_p": 0.95}))
    cfg, _ = build_engine_config(str(tmp_path / "g"), device="cpu", dtype="float32")
    assert cfg.generation.params() == {"top_k": 64, "top_p": 0.95}
    save_as_hf_folder(load_preset("tiny-mistral"), tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    cfg, _ = build_engine_config(str(tmp_path / "m"), device="cpu", dtype="float32")
    assert cfg.generation.params() == {}

