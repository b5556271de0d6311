"""The `quantization` section of the config tree (`EngineConfig.quantization`): how the decoder layers' linear
layers are stored and computed.

`QuantizationConfig()` (method "none"): the checkpoint's float weights, computed in the model dtype, as always.
Method "fp8": every projection of the decoder layers (q|k|v, o, gate|up, down) that `quantized` names holds
float8 e4m3 weights with float32 scales, and its input is quantized to fp8 too (W8A8); the embedding, the norms
and the LM head stay in the model dtype. Where it comes from (`config_builder`):

- an FP8 checkpoint's `quantization_config` (`loader/fp8_checkpoint.py` reads it: compressed-tensors
  `float-quantized` / `naive-quantized` with 8-bit float weights, or Hugging Face's `fp8`);
- `--quantization fp8` (vLLM's flag; `LLM(quantization="fp8")`) on a float checkpoint or a preset: `online`, the
  float weights quantized as they load, one scale per output row, activations per token (`ONLINE_FP8`);
- `--load-format dummy` of an FP8 checkpoint: its scheme, the random float weights quantized as they load.

Scales, as the checkpoint stores them (the model's own layout: `ops/fp8.py`); the weight is W = w8 * scale:
- weights "tensor": one scale per Hugging Face projection, shape [] or [1]
- weights "channel": one per output row, [N, 1] or [N]
- weights "block": one per `block` = (rows, cols) tile, [ceil(N / rows), ceil(K / cols)]; the HF `fp8` form calls
  it `weight_scale_inv` (`scale_name`), multiplied all the same (the name is DeepSeek-V3's)
Activations x (x8 = fp8(x / s), fp8_max the format's largest value: 448 for e4m3fn, 240 for ROCm's e4m3fnuz):
- "token": dynamic, s = max|x[t, :]| / fp8_max for each token row t
- "tensor": dynamic, one s = max|x| / fp8_max over the whole [T, K] input
- "static": s = the checkpoint's `input_scale` (one per projection)
- "group": dynamic, one s per token and `block[1]` input columns (block weights only)

The fp8 KV cache (`--kv-cache-dtype fp8`, `CacheConfig.kv_cache_dtype`) has its own small piece here: the values
the flag takes (`KV_CACHE_FLAGS`) and a checkpoint's calibrated per-tensor scales (`KVScales`), which the cache
section carries: each layer's keys and values are stored as fp8(x / scale) and read back as x8 * scale.

Plain data: imports nothing of rapidserve (config.py imports it); its errors are its own `QuantizationError`
(a ValueError), which the builder turns into a ConfigError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

QUANTIZATION_METHODS = ("none", "fp8")
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
ACTIVATION_STRATEGIES = ("token", "tensor", "static", "group")
SCALE_NAMES = ("weight_scale", "weight_scale_inv")
# the projections of a decoder layer as Hugging Face names them, by the fused tensor that holds them
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


class QuantizationError(ValueError):
    """A quantization section that cannot be honoured; the message names the field and what is allowed."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise QuantizationError(msg)


@dataclass(frozen=True)
class QuantizationConfig:
    """How the decoder layers' projections are stored and computed (see the module docstring).

    `method`: "none" or "fp8". `weights`, `block`, `activations`: the scheme (module docstring). `scale_name`:
    the checkpoint's weight-scale tensor (`<projection>.weight_scale` or `.weight_scale_inv`). `online`: the
    checkpoint holds float weights that are quantized at load (no scale tensors are read). `float_layers`: Hugging
    Face module names of projections the checkpoint keeps in float (its ignore list resolved against the model,
    whole fused groups only). `origin`: where the scheme was read, for logs and errors."""

    method: str = "none"
    weights: str = "channel"
    block: tuple[int, int] | None = None
    activations: str = "token"
    scale_name: str = "weight_scale"
    online: bool = False
    float_layers: tuple[str, ...] = ()
    origin: str = ""

    def __post_init__(self) -> None:
        _check(self.method in QUANTIZATION_METHODS,
               f"quantization method {self.method!r}; rapidserve runs {', '.join(QUANTIZATION_METHODS)}")
        _check(self.weights in WEIGHT_STRATEGIES,
               f"fp8 weight scales {self.weights!r}; use one of {', '.join(WEIGHT_STRATEGIES)}")
        _check(self.activations in ACTIVATION_STRATEGIES,
               f"fp8 activation scales {self.activations!r}; use one of {', '.join(ACTIVATION_STRATEGIES)}")
        _check(self.scale_name in SCALE_NAMES, f"scale_name {self.scale_name!r}; use one of {', '.join(SCALE_NAMES)}")
        _check((self.block is not None) == (self.weights == "block"),
               f"fp8 block={self.block} goes with weights='block' (got weights={self.weights!r})")
        if self.block is not None:
            _check(len(self.block) == 2 and all(isinstance(b, int) and b > 0 for b in self.block),
                   f"fp8 block={self.block}: give two positive integers (rows, cols) such as (128, 128)")
        _check((self.activations == "group") == (self.weights == "block"),
               f"fp8 activations={self.activations!r} with weights={self.weights!r}: block weight scales take "
               "dynamic per-token-group activation scales ('group'), and only they do")
        _check(not (self.online and self.activations == "static"),
               "fp8 weights quantized at load have no calibrated input_scale: use dynamic activations")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def group(self) -> int | None:
        """Input columns per activation scale ("group" activations), else None."""
        return self.block[1] if self.activations == "group" and self.block is not None else None

    def quantized(self, module: str) -> bool:
        """Whether the projection of Hugging Face module name `module` (model.layers.N.self_attn.q_proj) is fp8."""
        return self.enabled and module not in self.float_layers

    def describe(self) -> str:
        """One line for logs: the method, its scales and where it came from."""
        if not self.enabled:
            return "none (the checkpoint's float weights)"
        w = f"block {self.block[0]}x{self.block[1]}" if self.block is not None else f"per-{self.weights}"
        a = {"token": "dynamic per-token", "tensor": "dynamic per-tensor", "static": "static per-tensor",
             "group": f"dynamic per-token-group of {self.group}"}[self.activations]
        kept = f", {len(self.float_layers)} projection(s) kept in float" if self.float_layers else ""
        how = "quantized at load" if self.online else "from the checkpoint"
        return f"fp8 weights ({w} scales, {how}), {a} activation scales{kept}; {self.origin}"


ONLINE_FP8 = QuantizationConfig(method="fp8", weights="channel", activations="token", online=True,
                                origin="--quantization fp8: per-channel weight scales computed at load")


# --kv-cache-dtype (vLLM's flag) -> what the KV pool holds: "auto" the model's dtype (or fp8 when the checkpoint's
# kv_cache_scheme asks for it, as vLLM resolves auto), "fp8" float8 e4m3 (e4m3fnuz on ROCm's gfx94x); vLLM's
# explicit float names keep the cache unquantized and must be the model's dtype (config_builder.resolve_kv_cache)
KV_CACHE_FLAGS: dict[str, str] = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "bfloat16": "bfloat16",
                                  "float16": "float16", "float32": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8")  # CacheConfig.kv_cache_dtype once resolved
KV_CACHE_REFUSED: dict[str, str] = {  # vLLM's other values, refused by name with the reason
    "fp8_e5m2": "e5m2 (no scales, 2 mantissa bits) is not built here: use fp8 (e4m3 with per-tensor scales)",
    "fp8_inc": "Intel Gaudi's fp8 cache: use fp8",
    "fp8_ds_mla": "DeepSeek MLA's cache: no MLA models here; use fp8",
    "int8": "an int8 cache is not built here: use fp8",
    "nvfp4": "an nvfp4 cache is not built here: use fp8",
}


@dataclass(frozen=True)
class KVScales:
    """A checkpoint's calibrated fp8 KV cache scales, one per tensor: `scales[i]` = layer i's (k_scale, v_scale),
    in e4m3fn units (the cache stores fp8(k / k_scale); a ROCm gfx94x pool, e4m3fnuz, uses them doubled).
    `origin`: where they were read (the tensors' names), for logs."""

    scales: tuple[tuple[float, float], ...]
    origin: str = ""

    def __post_init__(self) -> None:
        _check(len(self.scales) > 0, "KVScales needs one (k_scale, v_scale) per layer")
        for i, pair in enumerate(self.scales):
            _check(len(pair) == 2 and all(isinstance(s, float) and math.isfinite(s) and s > 0 for s in pair),
                   f"layer {i}'s kv scales {pair!r}: give two positive finite floats (k_scale, v_scale)")

    def describe(self) -> str:
        ks, vs = [k for k, _ in self.scales], [v for _, v in self.scales]
        return (f"calibrated per-tensor scales of {len(self.scales)} layers (k {min(ks):.4g}..{max(ks):.4g}, "
                f"v {min(vs):.4g}..{max(vs):.4g}; {self.origin})")
