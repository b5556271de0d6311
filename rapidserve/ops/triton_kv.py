"""The Triton KV cache's store primitives and the paged-attention kernels' common ground (CUDA and ROCm): the KV
cache's layout and checks (`check_cache`), its fp8 store (`to_cache`), the KV write (`write_kv`), and the device
helpers both attention kernels use. It sits in ops/, below the attention package, because both sides use it: the
attention kernels (split-K decode in rapidserve/attention/triton_paged_decode.py, varlen prefill in
rapidserve/attention/triton_paged_prefill.py) and the Triton op bundle's fused qk-norm + RoPE + KV write
(rapidserve/ops/triton_rope.py, `to_cache`; `unfused_ops`' separate write, rapidserve/ops/__init__.py). Its torch
reference: rapidserve/ops/torch_kv.py.

Layouts (see rapidserve/attention/metadata.py):

- ``k_cache`` / ``v_cache``: [num_blocks, num_kv_heads, block_size, head_dim], contiguous, so one
  (block, kv head) page is a contiguous [block_size, head_dim] tile. Token ``t`` of sequence ``i`` is
  at block ``block_tables[i, t // block_size]``, offset ``t % block_size``. Prefill gathers its key tiles
  token by token through the block table; decode's tiles are whole pages (or a slice of one page), one table
  read a page. Tile sizes are independent of block_size (both powers of two).
- ``q``: [T, num_heads, head_dim] (prefill, sequences end to end) or [B, num_heads, head_dim]
  (decode); any strides on the first two dims, the last dim must be contiguous.
- Outputs are new contiguous tensors [*, num_heads, head_dim] in q's dtype.

Sliding-window attention (`window` W: Mistral, Gemma 3's local layers): the query at position p sees keys
p - W < t <= p. The window is a compile-time constant of both kernels (WINDOW, 0: none, `_window`; a model has at most
two variants of each): decode's key tiles start at the page (or page slice) of each sequence's first key in the window
(the keys before it masked), prefill's at the first key its query tile's first row sees, every one of them masked
(causal and window).

write_kv reads no device value on the host and its launch shape depends only on tensor shapes, so it can be captured
in a CUDA graph and replayed with other slots (decode_attention too: its module). The attention kernels' softmax runs
in fp32 with exp2 (`_LOG2E`); fp32 inputs use IEEE (not tf32) dots (`_dot`).

An fp8 cache (float8_e4m3fn, or e4m3fnuz on ROCm's gfx94x; rapidserve/ops/kv_quant.py) takes the layer's
``k_scale`` / ``v_scale`` (float32 [1] device tensors, loaded by the kernels; `check_cache`): write_kv stores
fp8(clamp(x / scale, +-fp8_max)) (`to_cache`); the attention kernels load fp8 tiles, convert them to q's dtype (exact:
every e4m3 value is a bf16/fp16/fp32 value) for the same dots, and fold the scales in once: the scores are multiplied
by k_scale with the softmax scale, the output by v_scale (the weighted sum is linear in v). Decode under a bf16 q
converts them to fp16 instead where its table says so (F16_DOTS, NVIDIA: one conversion an element pair instead of
three; rapidserve/attention/decode_config.py), q with them.

write_kv and prefill launch without programmatic dependent launch; decode with it (its module).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops.kv_quant import cache_scales

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


def _window(window: int | None) -> int:
    """The kernels' WINDOW constant: the window, 0 for none."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"a sliding window of {window} tokens; it must be >= 1 (None: no window)")
    return int(window)


# ----------------------------------------------------------------------------------------- write_kv
@triton.jit
def to_cache(x, scale_ptr, cache_ptr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as the cache at cache_ptr stores it: fp8(clamp(x / scale, +-FP8_MAX)) for an fp8 cache, else x cast. The
    division is IEEE's (div_rn, as torch's), so the stored bits are the torch reference's."""
    if KV_FP8:
        y = tl.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(cache_ptr.dtype.element_ty)
    else:
        return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, ks_ptr, vs_ptr,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # Padding rows (slot < 0) mask every head. (The limit is folded into the head bound because the
    # interpreter cannot broadcast a scalar boolean into a mask.)
    live_heads = NUM_KV_HEADS * (slot >= 0).to(tl.int32)
    mask = (h[:, None] < live_heads) & (d[None, :] < HEAD_DIM)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = (block * (NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM) + h[:, None] * (BLOCK_SIZE * HEAD_DIM)
           + offset * HEAD_DIM + d[None, :])
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, to_cache(k, ks_ptr, kc_ptr, KV_FP8, FP8_MAX), mask=mask)
    tl.store(vc_ptr + dst, to_cache(v, vs_ptr, vc_ptr, KV_FP8, FP8_MAX), mask=mask)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> dict[str, object]:
    """The checks every kernel makes of the cache, and its fp8 launch arguments: ks_ptr / vs_ptr (the scales, or
    the cache itself, never read, for a float cache), KV_FP8, FP8_MAX."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim] of one "
                         f"dtype; got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                         f"{v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    scales = cache_scales(k_cache, k_scale, v_scale)
    if scales is None:
        return {"ks_ptr": k_cache, "vs_ptr": v_cache, "KV_FP8": False, "FP8_MAX": 0.0}
    if any(t.dtype != torch.float32 or t.numel() != 1 or t.device != k_cache.device for t in scales):
        raise ValueError(f"k_scale and v_scale must be float32 [1] tensors on {k_cache.device}; got "
                         f"{[(t.dtype, tuple(t.shape), str(t.device)) for t in scales]}")
    return {"ks_ptr": scales[0], "vs_ptr": scales[1], "KV_FP8": True,
            "FP8_MAX": float(torch.finfo(k_cache.dtype).max)}


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store new keys/values ([T, num_kv_heads, head_dim]) at their slots; rows with slot < 0 are skipped (an fp8
    cache: quantized with `k_scale` / `v_scale`)."""
    fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (k_cache.shape[1], k_cache.shape[3]):
        raise ValueError(f"k and v must both be [T, {k_cache.shape[1]}, {k_cache.shape[3]}]; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    num_tokens = k.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries; k has {num_tokens} tokens")
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 1024 else 4, **fp8)
