"""config.json of the mixture-of-experts families (mixtral, qwen3_moe; rapidserve/moe_config.py) both ways.

`moe_config_from_hf` reads one: its attention half is the dense family it extends (Mixtral: Llama's, Qwen3-MoE:
Qwen3's), parsed by hf.py's own parser (`dense`, passed in: hf.py imports this module), and its experts are the
`MoeConfig`. `moe_hf_config_dict` writes one from the dense family's dict (presets.py's `hf_config_dict`), in the
fields transformers' MixtralConfig / Qwen3MoeConfig read. What these families can set and rapidserve does not
serve is refused by name: sliding-window attention, a model without experts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rapidserve.config import ModelConfig
from rapidserve.config_base import ConfigError
from rapidserve.loader.source import ModelLoadError
from rapidserve.moe_config import MOE_ARCHES, MoeConfig

_DENSE_TWIN = {"mixtral": "llama", "qwen3_moe": "qwen3"}
_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _int(d: dict[str, Any], key: str, path: str, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None:
        raise ModelLoadError(path, f"config field {key!r} is missing (a {d.get('model_type')} model needs it)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(path, f"config field {key}={value!r} must be an integer")
    return value


def _no_sliding_window(d: dict[str, Any], path: str) -> None:
    """Refuse sliding-window attention (Qwen3-MoE's use_sliding_window; a Mixtral window shorter than its
    context), which the attention kernels do not apply."""
    window = d.get("sliding_window")
    if d.get("model_type") == "qwen3_moe":
        if d.get("use_sliding_window"):
            raise ModelLoadError(path, f"use_sliding_window=true (sliding_window={window}) is not supported: "
                                       "rapidserve attends over the whole context")
        return
    max_pos = d.get("max_position_embeddings", 4096)
    if window is not None and not (isinstance(max_pos, int) and isinstance(window, int) and window >= max_pos):
        raise ModelLoadError(path, f"sliding_window={window} (sliding-window attention over fewer positions than "
                                   f"max_position_embeddings={max_pos}) is not supported: rapidserve attends over "
                                   "the whole context")


def moe_config_from_hf(d: dict[str, Any], path: str, dense: Callable[[dict[str, Any]], ModelConfig]) -> ModelConfig:
    """The ModelConfig of a mixtral / qwen3_moe config.json: `dense(d')` parses its attention half (d' is `d` as
    the dense family it extends), then its experts are added."""
    arch = d.get("model_type")
    if arch not in MOE_ARCHES:
        raise ModelLoadError(path, f"model_type {arch!r} is not a mixture-of-experts family ({', '.join(MOE_ARCHES)})")
    _no_sliding_window(d, path)
    base = dense({**d, "model_type": _DENSE_TWIN[arch]})
    layers = base.num_layers
    if arch == "mixtral":
        experts, inter = _int(d, "num_local_experts", path, 8), base.intermediate_size
        renormalize, dense_layers = True, ()
    else:
        experts, inter = _int(d, "num_experts", path, 128), _int(d, "moe_intermediate_size", path, 768)
        renormalize = bool(d.get("norm_topk_prob", False))
        step = _int(d, "decoder_sparse_step", path, 1)
        if step < 1:
            raise ModelLoadError(path, f"decoder_sparse_step={step} must be >= 1")
        only = d.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in only):
            raise ModelLoadError(path, f"mlp_only_layers={only!r} must be a list of layer indices")
        dense_layers = tuple(n for n in range(layers) if n in only or (n + 1) % step)
    if experts < 1:
        raise ModelLoadError(path, f"{'num_local_experts' if arch == 'mixtral' else 'num_experts'}={experts}: a "
                                   f"{arch} model without experts is not served (use its dense family's config)")
    try:
        moe = MoeConfig(num_experts=experts, top_k=_int(d, "num_experts_per_tok", path, 2 if arch == "mixtral" else 8),
                        intermediate_size=inter, renormalize=renormalize, dense_layers=dense_layers)
        return base.replace(arch=arch, moe=moe)
    except ConfigError as e:
        raise ModelLoadError(path, f"invalid config: {e}") from e


def dense_twin(config: ModelConfig) -> ModelConfig:
    """The dense family's ModelConfig of an MoE one (its attention; its dense MLP where it has one)."""
    return config.replace(arch=_DENSE_TWIN[config.arch], moe=None)


def moe_hf_config_dict(config: ModelConfig, dense: dict[str, Any]) -> dict[str, Any]:
    """config.json of an MoE `config`, given the dict its dense twin (`dense_twin`) writes."""
    moe = config.moe
    if moe is None or config.arch not in MOE_ARCHES:
        raise ValueError(f"{config.name} ({config.arch}) is not a mixture-of-experts model")
    d = {**dense, "architectures": [_ARCHITECTURES[config.arch]], "model_type": config.arch,
         "num_experts_per_tok": moe.top_k, "output_router_logits": False}
    if config.arch == "mixtral":
        d.pop("attention_bias", None)
        d.update(num_local_experts=moe.num_experts, intermediate_size=moe.intermediate_size, sliding_window=None,
                 router_aux_loss_coef=0.02, router_jitter_noise=0.0)
        if moe.dense_layers or not moe.renormalize:
            raise ValueError("a mixtral config.json cannot say dense layers or un-renormalised routing")
    else:
        d.update(num_experts=moe.num_experts, moe_intermediate_size=moe.intermediate_size,
                 norm_topk_prob=moe.renormalize, decoder_sparse_step=1, mlp_only_layers=list(moe.dense_layers),
                 router_aux_loss_coef=0.001, use_sliding_window=False)
    return d
