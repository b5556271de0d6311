"""A checkpoint's fp8 KV cache scales (issue 39): its declaration (compressed-tensors' `kv_cache_scheme`), its
per-layer scale tensors found in the safetensors headers, checked, and read (two numbers a layer, read when the
folder is resolved, so a bad one is refused before any weight loads).

The declaration, as llm-compressor writes it: `quantization_config.kv_cache_scheme` = {"type": "float",
"num_bits": 8, "strategy": "tensor", "dynamic": false, "symmetric": true}: one static scale per layer for the keys
and one for the values. Refused by name (`kv_scheme_problem`): another type or width, per-head scales (strategy
"attn_head"), dynamic or asymmetric ones.

The tensors, under every name vLLM reads (its `maybe_remap_kv_scale_name` and compressed-tensors'
`get_cache_scale`), per layer N (`KV_SCALE_FORMS`):
- `model.layers.N.self_attn.k_scale` / `v_scale`: llm-compressor's kv_cache_scheme, vLLM's fp8 checkpoints;
- `model.layers.N.self_attn.k_proj.k_scale` / `v_proj.v_scale`: NVIDIA ModelOpt's names;
- `model.layers.N.self_attn.k_proj.output_scale` / `v_proj.output_scale`: older compressed-tensors;
- `model.layers.N.self_attn.kv_scale`: one scale for both (deprecated in vLLM, read the same: k and v alike).
Each is [] or [1] (per tensor) in F32 / BF16 / F16 and a positive finite number; a layer has all of its scales or
none, and the checkpoint has them for every layer or for none (`check_kv_scale_tensors`, ModelLoadError naming the
tensor). A checkpoint that declares a kv_cache_scheme must carry them. Scales found without a declaration are read
too (they describe the cache, not the weights), and used with `--kv-cache-dtype fp8`.

The values are e4m3fn units (the cache stores fp8(k / k_scale)), as calibrated; a ROCm gfx94x pool (e4m3fnuz)
doubles them where the layer is built (models/transformer.py), as vLLM does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from rapidserve.config import ModelConfig
from rapidserve.loader.source import ModelLoadError
from rapidserve.quant_config import KVScales

KV_SCALE_DTYPES = ("F32", "BF16", "F16")
# the leaf after `model.layers.N.self_attn.` -> which of the layer's scales it is ("k", "v", or "kv": both)
KV_SCALE_FORMS: dict[str, str] = {
    "k_scale": "k", "v_scale": "v",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v",
    "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "kv_scale": "kv",
}
_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(.+)")


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v" | "kv") of a KV scale tensor's name (`KV_SCALE_FORMS`), else None."""
    m = _NAME.fullmatch(name)
    if m is None or m.group(2) not in KV_SCALE_FORMS:
        return None
    return int(m.group(1)), KV_SCALE_FORMS[m.group(2)]


def kv_scheme_problem(scheme: Any) -> str | None:
    """What of a compressed-tensors `kv_cache_scheme` is not served (None: per-tensor static fp8, served)."""
    if not isinstance(scheme, Mapping):
        return "its kv_cache_scheme is not a JSON object"
    if (scheme.get("type"), scheme.get("num_bits")) != ("float", 8):
        return (f"its kv_cache_scheme is {scheme.get('type')} {scheme.get('num_bits')}-bit (served: 8-bit float, "
                "--kv-cache-dtype fp8)")
    strategy = scheme.get("strategy", "tensor")
    if strategy != "tensor":
        return (f"its kv_cache_scheme has {strategy!r} scales (served: one per tensor, strategy 'tensor'; "
                "per-head scales are not)")
    if scheme.get("dynamic", False) is not False:
        return "its kv_cache_scheme is dynamic (served: static calibrated scales)"
    if scheme.get("symmetric", True) is not True:
        return "its kv_cache_scheme is asymmetric (zero points)"
    return None


def declares_kv_cache(config_json: Mapping[str, Any]) -> bool:
    """Whether config.json's quantization config (or compressed-tensors' older `compression_config`, also inside
    `text_config`) declares an fp8 KV cache (a kv_cache_scheme; checked by `kv_scheme_problem` where the scheme is
    read, loader/fp8_checkpoint.py)."""
    for scope in (config_json, config_json.get("text_config")):
        if not isinstance(scope, Mapping):
            continue
        for key in ("quantization_config", "compression_config"):
            q = scope.get(key)
            if isinstance(q, Mapping) and q.get("kv_cache_scheme") is not None:
                return True
    return False


def check_kv_scale_tensors(found: Mapping[str, tuple[str, tuple[int, ...], str]], config: ModelConfig,
                           declared: bool, folder: str) -> dict[str, tuple[int, str]]:
    """The KV scale tensors of a checkpoint's headers (`found`: name -> (file, shape, dtype)), checked: name ->
    (layer, "k" | "v" | "kv"); {} when it has none. ModelLoadError naming a tensor of another shape or dtype, of a
    layer the model lacks, a layer given a scale twice or only one of its two, or layers without scales while
    others (or the declaration, `declared`) have them."""
    scales: dict[str, tuple[int, str]] = {}
    per_layer: dict[int, dict[str, str]] = {}
    for name, (file, shape, dtype) in found.items():
        which = kv_scale_name(name)
        if which is None:
            continue
        layer, kind = which
        if layer >= config.num_layers:
            raise ModelLoadError(file, f"tensor {name} is a KV cache scale of layer {layer}; the model has "
                                       f"{config.num_layers} layers")
        if tuple(shape) not in ((), (1,)):
            raise ModelLoadError(file, f"tensor {name} has shape {list(shape)}: KV cache scales are one per tensor "
                                       "([] or [1]); per-head scales are not served")
        if dtype not in KV_SCALE_DTYPES:
            raise ModelLoadError(file, f"tensor {name} is stored as {dtype}; KV cache scales are "
                                       f"{'/'.join(KV_SCALE_DTYPES)}")
        mine = per_layer.setdefault(layer, {})
        for part in ("k", "v") if kind == "kv" else (kind,):
            if part in mine:
                raise ModelLoadError(file, f"tensors {mine[part]} and {name} both give layer {layer}'s {part}_scale")
            mine[part] = name
        scales[name] = which
    if not scales and not declared:
        return {}
    for layer in range(config.num_layers):
        mine = per_layer.get(layer, {})
        for part in ("k", "v"):
            if part not in mine:
                why = ("its kv_cache_scheme declares an fp8 KV cache" if declared else
                       f"the checkpoint has KV cache scales ({next(iter(scales))}, ...)")
                raise ModelLoadError(folder, f"tensor model.layers.{layer}.self_attn.{part}_scale is missing: {why}, "
                                             "and every layer needs its k_scale and v_scale")
    return scales


def read_kv_scales(scales: Mapping[str, tuple[int, str]], files: Mapping[str, str], num_layers: int,
                   folder: str, stored: Mapping[str, str] | None = None) -> KVScales:
    """The values of the checked scale tensors (`check_kv_scale_tensors`; `files`: name -> safetensors file), each a
    positive finite number (else ModelLoadError naming the tensor and its value). `stored`: our name -> the name the
    file holds it under, where they differ (a gemma3 multimodal checkpoint's text model, hf_arch.text_weights)."""
    from safetensors import SafetensorError, safe_open

    values: dict[int, dict[str, float]] = {}
    for name, (layer, kind) in scales.items():
        try:
            with safe_open(files[name], framework="pt") as f:
                value = float(f.get_tensor(stored.get(name, name) if stored else name).float().reshape(-1)[0])
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(files[name], f"cannot read tensor {name}: {e}") from e
        if not (math.isfinite(value) and value > 0):
            raise ModelLoadError(files[name], f"tensor {name} is {value}: a KV cache scale must be a positive finite "
                                              "number (recalibrate the checkpoint, or drop --kv-cache-dtype fp8)")
        for part in ("k", "v") if kind == "kv" else (kind,):
            values.setdefault(layer, {})[part] = value
    names = sorted({n.split(".self_attn.", 1)[1] for n in scales})
    return KVScales(tuple((values[i]["k"], values[i]["v"]) for i in range(num_layers)),
                    origin=f"{folder}: self_attn.{{{', '.join(names)}}}")


__all__ = ["KV_SCALE_FORMS", "check_kv_scale_tensors", "declares_kv_cache", "kv_scale_name", "kv_scheme_problem",
           "read_kv_scales"]
