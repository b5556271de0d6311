"""FP8 checkpoints (issue 39): their quantization_config read into the tree's `QuantizationConfig`, and their
tensors checked from the safetensors headers before any weight is read.

Forms served, each read as vLLM reads it:
- compressed-tensors (llm-compressor): quant_method "compressed-tensors", format "float-quantized" (or
  "naive-quantized"), `config_groups` whose `weights` are {"type": "float", "num_bits": 8, "symmetric": true,
  "strategy": "tensor" | "channel" | "block" (with `block_structure` [bn, bk])} and whose `input_activations` are
  8-bit float too: dynamic "token" or "tensor", static "tensor" (an `input_scale` tensor per projection), or dynamic
  "group" of bk columns (block weights). A group's `targets` ("Linear", "re:<regex>" matched at the start of a
  module name, or a module name) and the `ignore` list (the same forms) say which projections are fp8; the rest
  stay float. Tensors: <module>.weight F8_E4M3 [N, K], <module>.weight_scale, <module>.input_scale (static).
- Hugging Face fp8 (transformers' FineGrainedFP8, the DeepSeek-V3 / Qwen3-FP8 form): quant_method "fp8",
  `activation_scheme` "dynamic" | "static", `weight_block_size` [bn, bk] (scales named weight_scale_inv, dynamic
  activations per token-group of bk) or null (one weight_scale per projection, input_scale when static),
  `modules_to_not_convert` (substrings of module names, as transformers matches them) kept float.

A compressed-tensors `kv_cache_scheme` (an fp8 KV cache with calibrated per-tensor k/v scales) is served: with or
without fp8 weights (no config_groups: float weights, the cache alone quantized); its declaration is checked here
(`kv_scales.kv_scheme_problem`), its scale tensors are `loader/kv_scales.py`'s, split out of the headers before
`check_fp8_tensors` sees them.

Refused by name, from config.json alone (UnsupportedQuantization): every other method (AWQ, GPTQ, bitsandbytes,
int8 compressed-tensors, NVFP4, ModelOpt, fbgemm_fp8...), and of these forms: weight-only fp8 (no
input_activations), weight scales per group (MXFP8), asymmetric scales, e5m2 weights, output activations, a
kv_cache_scheme not per-tensor static fp8 (per-head scales, int8), config groups with different schemes, block
weights with static activations, a fused projection (q/k/v, gate/up) partly ignored, and block scales that the
fused projections would split (`parallel.shard.block_shard_problem`). From the headers (`check_fp8_tensors`): a
missing scale, a scale of the wrong shape or dtype, an fp8 weight where the scheme has a float one or the reverse
(an fp8 lm_head: the LM head stays float), and a quantizer tensor the scheme does not read (a q_scale, zero points).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from rapidserve.config import ModelConfig
from rapidserve.loader.kv_scales import kv_scheme_problem
from rapidserve.loader.quant import (
    FLOAT_DTYPES,
    Quantization,
    UnsupportedQuantization,
    is_quantizer_tensor,
    quantization_method,
)
from rapidserve.loader.source import ModelLoadError, expected_tensor_shapes
from rapidserve.parallel.shard import block_shard_problem
from rapidserve.quant_config import FUSED_PROJECTIONS, QuantizationConfig, QuantizationError

FP8_WEIGHT_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
_CT_FORMATS = ("float-quantized", "naive-quantized")
SERVED_METHODS = ("compressed-tensors", "fp8")  # as `quant.quantization_method` names them


class _NotServed(Exception):
    """What of an FP8 scheme rapidserve does not serve (becomes the refusal's reason)."""


def projection_groups(config: ModelConfig) -> list[tuple[str, ...]]:
    """The Hugging Face module names of every decoder layer's projections, fused groups together."""
    return [tuple(f"model.layers.{n}.{p}" for p in parts) for n in range(config.num_layers)
            for parts in FUSED_PROJECTIONS.values()]


def _ct_match(name: str, pattern: str) -> bool:
    """compressed-tensors' target / ignore rule: "Linear" (every projection), "re:<regex>" matched at the start of
    the module name, or the module name itself."""
    if pattern == "Linear":
        return True
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _block(value: Any) -> tuple[int, int]:
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):
        value = [int(v) for v in value.split("x")]
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    raise _NotServed(f"block size {value!r} is not two positive integers")


def _fp8_args(args: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(args, Mapping):
        raise _NotServed(f"{what} are not described")
    if (args.get("type"), args.get("num_bits")) != ("float", 8):
        raise _NotServed(f"{what} are {args.get('type')} {args.get('num_bits')}-bit, not 8-bit float")
    if args.get("symmetric", True) is not True:
        raise _NotServed(f"{what} are asymmetric (zero points)")
    return args


def _ct_scheme(group: Mapping[str, Any]) -> tuple[str, tuple[int, int] | None, str]:
    """(weights, block, activations) of one compressed-tensors config group."""
    w = _fp8_args(group.get("weights"), "its weights")
    strategy = w.get("strategy", "tensor")
    if w.get("dynamic", False) is not False or strategy not in ("tensor", "channel", "block"):
        raise _NotServed(f"fp8 weight scales {'dynamic' if w.get('dynamic') else strategy!r} (served: per "
                         "tensor, per channel, per block)")
    block = _block(w.get("block_structure")) if strategy == "block" else None
    if group.get("output_activations") is not None:
        raise _NotServed("it quantizes output activations")
    if group.get("input_activations") is None:
        raise _NotServed("fp8 weights without fp8 activations (weight-only, W8A16) are not served")
    a = _fp8_args(group["input_activations"], "its input activations")
    kind, dynamic = a.get("strategy", "tensor"), a.get("dynamic", False)
    if block is not None:
        if (kind, dynamic) != ("group", True) or a.get("group_size") != block[1]:
            raise _NotServed(f"block weight scales take dynamic activation scales per token-group of {block[1]}; "
                             f"it declares {'dynamic' if dynamic is True else 'static'} {kind!r} "
                             f"(group_size {a.get('group_size')})")
        return "block", block, "group"
    acts = {("token", True): "token", ("tensor", True): "tensor", ("tensor", False): "static"}.get((kind, dynamic))
    if acts is None:
        raise _NotServed(f"activation scales {'dynamic' if dynamic is True else 'static'} {kind!r} (served: dynamic "
                         "per token or per tensor, static per tensor)")
    return str(strategy), None, acts


def _compressed_tensors(d: Mapping[str, Any], groups: list[tuple[str, ...]],
                        ) -> tuple[str, tuple[int, int] | None, str, str, set[str]] | None:
    """(weights, block, activations, scale name, modules kept float) of a compressed-tensors config; None for one
    that quantizes only the KV cache (a kv_cache_scheme and no config_groups: float weights)."""
    config_groups = d.get("config_groups")
    if d.get("kv_cache_scheme") is not None and (problem := kv_scheme_problem(d["kv_cache_scheme"])) is not None:
        raise _NotServed(problem)
    if not config_groups and d.get("kv_cache_scheme") is not None:
        return None  # an fp8 KV cache alone: float weights (loader/kv_scales.py reads the cache's scales)
    if not isinstance(config_groups, Mapping) or not config_groups:
        raise _NotServed("it has no config_groups")
    fmts = {d.get("format")} | {g.get("format") for g in config_groups.values() if isinstance(g, Mapping)}
    fmts.discard(None)
    if not fmts or not fmts <= set(_CT_FORMATS):
        raise _NotServed(f"format {'/'.join(sorted(map(str, fmts))) or 'none'} (served: float-quantized, "
                         "naive-quantized)")
    sparsity = d.get("sparsity_config")
    if isinstance(sparsity, Mapping) and sparsity and sparsity.get("format", "dense") != "dense":
        raise _NotServed(f"it is sparse ({sparsity.get('format')})")
    schemes: dict[tuple[str, tuple[int, int] | None, str], list[str]] = {}
    for g in config_groups.values():
        if not isinstance(g, Mapping):
            raise _NotServed("a config group is not a JSON object")
        targets = g.get("targets") or []
        schemes.setdefault(_ct_scheme(g), []).extend(str(t) for t in targets)
    if len(schemes) > 1:
        raise _NotServed("its config groups have different schemes (served: one scheme for every fp8 projection)")
    (scheme, targets), = schemes.items()
    ignore = [str(p) for p in d.get("ignore") or []]
    kept = {m for group in groups for m in group
            if not any(_ct_match(m, t) for t in targets) or any(_ct_match(m, p) for p in ignore)}
    return (*scheme, "weight_scale", kept)


def _hf_fp8(d: Mapping[str, Any], groups: list[tuple[str, ...]],
            ) -> tuple[str, tuple[int, int] | None, str, str, set[str]]:
    """(weights, block, activations, scale name, modules kept float) of a Hugging Face fp8 config."""
    fmt = str(d.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _NotServed(f"fmt {fmt!r} (served: e4m3)")
    scheme = d.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _NotServed(f"activation_scheme {scheme!r} (served: dynamic, static)")
    skip = [str(p) for p in (d.get("modules_to_not_convert") or d.get("ignored_layers") or [])]
    kept = {m for group in groups for m in group if any(p in m for p in skip)}
    if d.get("weight_block_size") is None:
        return "tensor", None, "static" if scheme == "static" else "tensor", "weight_scale", kept
    block = _block(d["weight_block_size"])
    if scheme != "dynamic":
        raise _NotServed("block weight scales with static activations (served: dynamic, as vLLM)")
    return "block", block, "group", "weight_scale_inv", kept


def fp8_scheme(q: Quantization, config: ModelConfig) -> QuantizationConfig | None:
    """The tree's QuantizationConfig of a declared FP8 form (None: a compressed-tensors config of an fp8 KV cache
    alone, whose weights are float); _NotServed saying what is not served."""
    d = q.config
    kv_only = isinstance(d, Mapping) and not d.get("config_groups") and d.get("kv_cache_scheme") is not None
    if config.moe is not None and not kv_only:
        raise _NotServed(f"fp8 weights of a mixture-of-experts model ({config.arch}; served: fp8 for dense models, "
                         "MoE models in bf16/fp16/fp32)")
    groups = projection_groups(config)
    if not isinstance(d, Mapping):
        raise _NotServed("its quantization config is not a JSON object")
    if q.method == "compressed-tensors":
        scheme = _compressed_tensors(d, groups)
        if scheme is None:
            return None
        weights, block, acts, scale, kept = scheme
    elif q.method == "fp8" and q.where.startswith("config.json"):
        weights, block, acts, scale, kept = _hf_fp8(d, groups)
    else:
        raise _NotServed("")
    for group in groups:
        if 0 < len(kept & set(group)) < len(group):
            raise _NotServed(f"its ignore list keeps part of the fused {', '.join(group)} in float (served: all of "
                             "q/k/v, all of gate/up, or none)")
    if block is not None and (problem := block_shard_problem(config, 1, block)) is not None:
        raise _NotServed(problem)
    try:
        return QuantizationConfig(method="fp8", weights=weights, block=block, activations=acts, scale_name=scale,
                                  float_layers=tuple(m for group in groups for m in group if m in kept),
                                  origin=f"{q.detail} ({q.where})")
    except QuantizationError as e:
        raise _NotServed(str(e)) from None


def declared_quantization(d: Mapping[str, Any], folder: str) -> Quantization | None:
    """The quantization a folder declares (`quant.quantization_method`: config.json `d` and the side files), None
    for a float checkpoint; UnsupportedQuantization naming any method but the FP8 forms' (before the model's
    config is read)."""
    q = quantization_method(d, folder)
    if q is not None and q.method not in SERVED_METHODS:
        raise UnsupportedQuantization(folder, q.message())
    return q


def checkpoint_quantization(q: Quantization | None, folder: str, config: ModelConfig) -> QuantizationConfig | None:
    """The FP8 scheme of a declared quantization (`declared_quantization`; None: float weights), or
    UnsupportedQuantization naming what of it is not served (module docstring). No weight is read."""
    if q is None:
        return None
    try:
        return fp8_scheme(q, config)
    except _NotServed as e:
        raise UnsupportedQuantization(folder, q.message(str(e))) from None


def fp8_tensor_specs(config: ModelConfig, quant: QuantizationConfig,
                     ) -> dict[str, tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]]:
    """Every tensor an FP8 checkpoint of `config` holds, in load order: name -> (the shapes it may have, the
    safetensors dtypes it may have). Float tensors as `expected_tensor_shapes`; an fp8 projection's weight
    F8_E4M3, its weight scale ([] or [1]; [N, 1] or [N]; [ceil(N/bn), ceil(K/bk)]) and static input_scale
    ([] or [1]) in float."""
    out: dict[str, tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]] = {}
    for name, shape in expected_tensor_shapes(config).items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and name.startswith("model.layers.") and quant.quantized(module)
                and module.rsplit(".", 1)[-1].endswith("_proj")):
            out[name] = ((shape,), FLOAT_DTYPES)
            continue
        n, k = shape
        out[name] = ((shape,), (FP8_WEIGHT_DTYPE,))
        if quant.block is not None:
            bn, bk = quant.block
            scales: tuple[tuple[int, ...], ...] = ((-(-n // bn), -(-k // bk)),)
        else:
            scales = ((), (1,)) if quant.weights == "tensor" else ((n, 1), (n,))
        out[f"{module}.{quant.scale_name}"] = (scales, SCALE_DTYPES)
        if quant.activations == "static":
            out[f"{module}.input_scale"] = (((), (1,)), SCALE_DTYPES)
    return out


def check_fp8_tensors(found: Mapping[str, tuple[str, tuple[int, ...], str]], config: ModelConfig,
                      quant: QuantizationConfig, folder: str) -> dict[str, tuple[int, ...]]:
    """The tensors to load (name -> shape on disk) of an FP8 checkpoint, checked from its headers (`found`: name ->
    (file, shape, dtype)): ModelLoadError naming a missing tensor or a wrong shape, UnsupportedQuantization naming
    a wrong dtype or a quantizer tensor the scheme does not read (module docstring)."""
    specs = fp8_tensor_specs(config, quant)
    how = f"the checkpoint's scheme ({quant.describe()})"
    for name, (shapes, dtypes) in specs.items():
        if name not in found:
            raise ModelLoadError(folder, f"tensor {name} is missing ({how} needs it)")
        file, shape, dtype = found[name]
        if tuple(shape) not in shapes:
            raise ModelLoadError(file, f"tensor {name} has shape {list(shape)}, {how} needs "
                                       f"{' or '.join(str(list(s)) for s in shapes)}")
        if dtype not in dtypes:
            raise UnsupportedQuantization(folder, f"tensor {name} is stored as {dtype}, {how} needs "
                                                  f"{'/'.join(dtypes)}")
    for name in found:
        if name not in specs and is_quantizer_tensor(name):
            raise UnsupportedQuantization(folder, f"its safetensors hold tensor {name}, which {how} does not read "
                                                  "(rapidserve would ignore it): not served")
    return {name: tuple(found[name][1]) for name in specs}


__all__ = ["check_fp8_tensors", "checkpoint_quantization", "declared_quantization", "fp8_scheme", "fp8_tensor_specs",
           "projection_groups"]
