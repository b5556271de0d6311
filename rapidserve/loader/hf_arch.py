"""What is architecture-specific in Hugging Face folders: model types, config.json fields beyond the Llama-shaped
ones (hf.py reads those), the text model's weights in a multimodal checkpoint, and the config.json fields presets
write for these architectures (`arch_config_json`, presets.py's `save_as_hf_folder`).

- `MODEL_TYPES`: config.json's model_type -> `ModelConfig.arch`; any other model_type is refused by name, listing
  these (`model_type_problem`).
- mistral: `sliding_window` (transformers' MistralConfig default, 4096, when the key is absent; null: none) over
  every layer. qwen2 / qwen3 with `use_sliding_window`: the window on the layers `layer_types` names (transformers:
  the layers from `max_window_layers` on).
- gemma3_text (Gemma3ForCausalLM) and gemma3 (Gemma3ForConditionalGeneration: its `text_config`, the language model
  only): Gemma3TextConfig's defaults for the fields a config leaves out; `layer_types` as given or from
  `sliding_window_pattern` (every pattern-th layer global); RoPE as transformers 5 writes it (`rope_parameters` per
  layer type) or 4 (`rope_theta`, `rope_local_base_freq`, `rope_scaling` of the global layers). Refused by name:
  another activation than gelu_pytorch_tanh, `attn_logit_softcapping` (Gemma 2's; transformers' Gemma 3 leaves it
  unapplied), `use_bidirectional_attention`, `attention_bias`. A gemma3 checkpoint is served from its weights named
  `language_model.model.*` (`language_model.lm_head.*`; or transformers 5's `model.language_model.*`), its vision
  tower left unread; one without them is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rapidserve.config import ModelConfig, RopeScaling
from rapidserve.config_base import ConfigError
from rapidserve.loader.source import ModelLoadError

MODEL_TYPES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                               "gemma3_text": "gemma3", "gemma3": "gemma3", "mixtral": "mixtral",
                               "qwen3_moe": "qwen3_moe"}
MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig.sliding_window when config.json has no such key
_QWEN_MAX_WINDOW_LAYERS = 28  # transformers' Qwen2Config / Qwen3Config default
# Gemma3TextConfig's defaults (transformers 5), for the fields a Gemma 3 config.json leaves out.
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "eos_token_id": 1, "bos_token_id": 2,
    "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "use_bidirectional_attention": False, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))


def model_type_problem(model_type: Any) -> str | None:
    """Why config.json's model_type cannot be served (None: it can)."""
    if model_type in MODEL_TYPES:
        return None
    return (f"model_type {model_type!r} is not supported; supported model types: {', '.join(MODEL_TYPES)} "
            "(gemma3: its text model)")


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_scaling(scaling: Any, path: str) -> RopeScaling | None:
    """The RopeScaling of one RoPE parameter dict (transformers 4's rope_scaling or one of 5's rope_parameters);
    None for default (unscaled) RoPE."""
    if not isinstance(scaling, dict):
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type not in ("llama3", "linear"):
        raise ModelLoadError(path, f"rope scaling type {rope_type!r} is not supported "
                                   "(supported: none/default, llama3, linear)")
    try:
        if rope_type == "linear":
            return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
        return RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise ModelLoadError(path, f"invalid {rope_type} rope scaling {scaling}: {e}") from e


def sliding_fields(d: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    """ModelConfig's sliding_window and layer_types of a llama / mistral / qwen2 / qwen3 config.json."""
    if arch == "mistral":
        window = d.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
        return {"sliding_window": None if window is None else int(window)}
    if arch not in ("qwen2", "qwen3") or not d.get("use_sliding_window"):
        return {}
    window = d.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
    if window is None:
        return {}
    types = d.get("layer_types")
    if types is None:
        first = int(d.get("max_window_layers", _QWEN_MAX_WINDOW_LAYERS))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def gemma3_text_config(d: dict[str, Any], path: str) -> dict[str, Any]:
    """The text model's config of a gemma3_text or gemma3 config.json, Gemma3TextConfig's defaults filled in (a
    gemma3 config's own eos/bos token ids and tie_word_embeddings win over its text_config's)."""
    if d.get("model_type") == "gemma3_text":
        return {**GEMMA3_DEFAULTS, **d}
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(path, "a gemma3 (Gemma3ForConditionalGeneration) config.json needs a text_config object: "
                                   "only its text model is served")
    top = {k: d[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if d.get(k) is not None}
    return {**GEMMA3_DEFAULTS, **text, **top}


def _gemma3_rope(t: dict[str, Any], path: str) -> tuple[float, RopeScaling | None, float]:
    """(global rope_theta, global rope scaling, local rope_theta)."""
    params = t.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full, local = params["full_attention"], params.get("sliding_attention") or {}
    else:
        full, local = (t.get("rope_scaling") or {}), {}
    if rope_scaling(local, path) is not None:
        raise ModelLoadError(path, f"gemma3 sliding layers' rope scaling {local} is not supported (only default RoPE)")
    theta = float(full.get("rope_theta", t.get("rope_theta", GEMMA3_DEFAULTS["rope_theta"])))
    local_theta = float(local.get("rope_theta", t.get("rope_local_base_freq", GEMMA3_DEFAULTS["rope_local_base_freq"])))
    return theta, rope_scaling(full, path), local_theta


def gemma3_config(d: dict[str, Any], path: str, name: str) -> ModelConfig:
    """The ModelConfig of a gemma3_text or gemma3 config.json (the module docstring)."""
    t = gemma3_text_config(d, path)
    act = t.get("hidden_activation") or t.get("hidden_act")
    refused = [(act != "gelu_pytorch_tanh", f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"),
               (t.get("attn_logit_softcapping") is not None,
                f"attn_logit_softcapping={t.get('attn_logit_softcapping')} is not supported (Gemma 2's attention "
                "soft-capping; Gemma 3 sets null)"),
               (bool(t.get("use_bidirectional_attention")), "use_bidirectional_attention=true is not supported "
                                                            "(a causal language model is served)"),
               (bool(t.get("attention_bias")), "attention_bias=true is not supported for gemma3")]
    for bad, problem in refused:
        if bad:
            raise ModelLoadError(path, problem)
    try:
        layers = int(t["num_hidden_layers"])
        types = t.get("layer_types")
        if types is None:
            pattern = int(t["sliding_window_pattern"])
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        theta, scaling, local_theta = _gemma3_rope(t, path)
        window = t.get("sliding_window")
        cap = t.get("final_logit_softcapping")
        return ModelConfig(
            arch="gemma3", vocab_size=int(t["vocab_size"]), hidden_size=int(t["hidden_size"]),
            intermediate_size=int(t["intermediate_size"]), num_layers=layers,
            num_heads=int(t["num_attention_heads"]), num_kv_heads=int(t["num_key_value_heads"]),
            head_dim=int(t["head_dim"]), rms_norm_eps=float(t["rms_norm_eps"]), rope_theta=theta,
            rope_scaling=scaling, max_position_embeddings=int(t["max_position_embeddings"]),
            tie_word_embeddings=bool(t["tie_word_embeddings"]), qk_norm=True,
            sliding_window=None if window is None else int(window), layer_types=tuple(types),
            query_pre_attn_scalar=float(t["query_pre_attn_scalar"]), rope_local_theta=local_theta,
            final_logit_softcapping=None if cap is None else float(cap),
            bos_token_id=t["bos_token_id"] if isinstance(t.get("bos_token_id"), int) else None,
            eos_token_ids=token_ids(t.get("eos_token_id")), name=name)
    except KeyError as e:
        raise ModelLoadError(path, f"config field {e.args[0]!r} is missing") from e
    except (TypeError, ValueError, ConfigError) as e:
        raise ModelLoadError(path, f"invalid config: {e}") from e


def text_weights(names: Iterable[str], model_type: Any, path: str) -> dict[str, str] | None:
    """A gemma3 (multimodal) checkpoint's text model: our name (as a Gemma3ForCausalLM's) -> the checkpoint's name
    of each of its tensors; None for the other model types, whose names are ours."""
    if model_type != "gemma3":
        return None
    names = list(names)
    out: dict[str, str] = {}
    for n in names:
        for prefix, ours in _TEXT_PREFIXES:
            if n.startswith(prefix):
                out[ours + n[len(prefix):]] = n
        if n == "lm_head.weight":  # transformers 5 keeps the head at the top
            out.setdefault(n, n)
    if not any(k.startswith("model.") for k in out):
        raise ModelLoadError(path, "this gemma3 (Gemma3ForConditionalGeneration) checkpoint has no weights named "
                                   "language_model.model.* (or model.language_model.*): only its text model is "
                                   f"served, from those; found e.g. {sorted(names)[:3]}")
    return out


def arch_config_json(config: ModelConfig, d: dict[str, Any]) -> dict[str, Any]:
    """`d`, the Llama-shaped config.json presets.hf_config_dict writes, as a mistral or gemma3 ModelConfig's (other
    architectures: `d`), so that transformers and `read_hf_config` read the same model back."""
    if config.arch == "mistral":
        return {**d, "architectures": ["MistralForCausalLM"], "sliding_window": config.sliding_window}
    if config.arch != "gemma3":
        return d
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        if config.rope_scaling.rope_type != "linear":
            raise ValueError("a gemma3 config.json is written with linear (or no) RoPE scaling")
        full = {"rope_type": "linear", "factor": config.rope_scaling.factor, "rope_theta": config.rope_theta}
    return {
        **{k: v for k, v in d.items() if k not in ("hidden_act", "rope_scaling")},
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _number(config.query_pre_attn_scalar),
        "sliding_window": config.sliding_window, "layer_types": list(config.layer_types),
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta},
                            "full_attention": full},
        "rope_local_base_freq": config.rope_local_theta,
        "final_logit_softcapping": config.final_logit_softcapping, "attn_logit_softcapping": None,
        "attention_bias": False,
    }


def _number(x: float | None) -> float | int | None:
    """An integral float as an int (Gemma3TextConfig types query_pre_attn_scalar as int)."""
    return int(x) if x is not None and float(x).is_integer() else x
