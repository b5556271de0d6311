"""The fp8 KV cache's arithmetic (issue 39), which every attention backend implements: the definition here in torch.

A pool of dtype float8_e4m3fn (float8_e4m3fnuz on ROCm's gfx94x, kv_pool.py) holds each layer's keys and values
quantized with that layer's per-tensor scales, float32 device tensors of shape [1] (`k_scale`, `v_scale`: the
layer's parameters, models/decoder_layer.py; read by the kernels on the device, so every call is CUDA-graph safe):

    write:  k8 = fp8(clamp(k / k_scale, -fp8_max, fp8_max))     (saturating: 448 for e4m3fn, 240 for e4m3fnuz)
    read:   k  = k8 * k_scale                                      (values alike with v_scale)

computed in float32 from the model dtype's k (as rotated by RoPE) and rounded to nearest even. A pool of the model's
dtype takes no scales (None), and stores k as it is. Readers fold the scales into the attention: the scores take
k_scale (q . k8 * k_scale), the output v_scale (sum p v8 * v_scale); the torch reference dequantizes first
(`dequantize`), the same numbers up to float32 rounding.
"""

from __future__ import annotations

import torch

FP8_KV_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a cache (or pool) tensor stores fp8."""
    return cache.dtype in FP8_KV_DTYPES


def cache_scales(cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The scales a cache takes: both for an fp8 cache (ValueError when either is missing), None otherwise (they
    must then be None too: a float cache with scales means a caller mixed two configurations up)."""
    if is_fp8(cache):
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {cache.dtype} KV cache needs the layer's k_scale and v_scale (float32 [1] tensors)")
        return k_scale, v_scale
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale given for a {cache.dtype} KV cache, which stores values unscaled")
    return None


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x as an fp8 cache of `dtype` stores it: fp8(clamp(x / scale, +-fp8_max)), in float32."""
    top = float(torch.finfo(dtype).max)
    return (x.float() / scale.float()).clamp(-top, top).to(dtype)


def dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values an fp8 cache holds, x8 * scale, in `dtype` (computed in float32)."""
    return (x8.float() * scale.float()).to(dtype)


__all__ = ["FP8_KV_DTYPES", "cache_scales", "dequantize", "is_fp8", "quantize"]
