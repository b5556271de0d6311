"""The rotary-embedding ops in Triton (CUDA and ROCm): neox-style RoPE of q and k (`apply_rope`), Qwen3's per-head
q/k RMSNorm then RoPE (`qk_norm_rope`), and both with the KV-cache write in one launch (`rope_write`: a layer's op
between its qkv projection and attention). The conventions of rapidserve/ops/triton_ops.py (its docstring) hold:
torch_ops' signatures and numerics (fp32 math, rounded where transformers rounds, no FMA contraction), CUDA-graph
safe, a contiguous last dim with strided leading dims.

Programmatic dependent launch (`ops.pdl`; NVIDIA sm_90+, on by default there, `pdl=False` off): `rope_write` waits
for the kernel before first, then lets the next kernel start. The unfused fallbacks (`apply_rope`, `qk_norm_rope`,
triton_kv's `write_kv`) launch without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.triton_kv import check_cache, to_cache, write_kv
from rapidserve.ops.triton_ops import _warps, rms_norm


# ------------------------------------------------------------------------------------------- RoPE
@triton.jit
def _rotated(a1, a2, c, s, dt: tl.constexpr):
    """x * cos + rotate_half(x) * sin of the two halves (fp32), rounding each product and the sum to
    `dt` as torch does."""
    o1 = (a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)
    o2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
    return o1, o2


@triton.jit
def _cos_sin(cs_ptr, pos, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, dt: tl.constexpr):
    """Row `pos` of the cos|sin table, cast to the activations' dtype first (as transformers does)."""
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    c = tl.load(cs_ptr + pos * (2 * HALF) + j, mask=jm, other=0.0).to(dt).to(tl.float32)[None, :]
    s = tl.load(cs_ptr + pos * (2 * HALF) + HALF + j, mask=jm, other=0.0).to(dt).to(tl.float32)[None, :]
    return c, s


@triton.jit
def _head_tile(ptr, t, stride_t, stride_h, NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_HALF: tl.constexpr):
    """Pointers to the first halves of token t's heads [BLOCK_H, BLOCK_HALF], and their mask."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < NUM_HEADS) & (j[None, :] < HALF)
    return ptr + t * stride_t + h[:, None] * stride_h + j[None, :], mask


@triton.jit
def _normed_rotated(p1, mask, w_ptr, c, s, eps, HAS_NORM: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HALF: tl.constexpr):
    """The heads at p1 (first halves; second halves HALF further), RMS-normalised per head when HAS_NORM
    (as _rms_norm_kernel: weight * h.to(dtype), rounded to the dtype), then rotated (as _rotated);
    returned in the activations' dtype."""
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    if HAS_NORM:
        j = tl.arange(0, BLOCK_HALF)
        jm = j < HALF
        variance = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF)
        r = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=jm, other=0.0).to(tl.float32)[None, :]
        a1 = ((a1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        a2 = ((a2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1, o2 = _rotated(a1, a2, c, s, dt)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _rope_rotate(ptr, t, stride_t, stride_h, c, s, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    p1, mask = _head_tile(ptr, t, stride_t, stride_h, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    o1, o2 = _normed_rotated(p1, mask, ptr, c, s, 0.0, False, HALF, BLOCK_HALF)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c, s = _cos_sin(cs_ptr, pos, HALF, BLOCK_HALF, q_ptr.dtype.element_ty)
    _rope_rotate(q_ptr, t, stride_qt, stride_qh, c, s, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rope_rotate(k_ptr, t, stride_kt, stride_kh, c, s, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q [T, Hq, D] and k [T, Hkv, D] in one launch, IN PLACE.

    Returns (q, k) (the same storage when their last dim is contiguous; otherwise rotated copies).
    cos_sin_cache: [max_pos, D] float32, cos in the first D/2 columns, sin in the last D/2.
    """
    q, k, cache, blocks = _rope_args(q, k, positions, cos_sin_cache)
    num_tokens, num_q_heads = q.shape[:2]
    if num_tokens == 0:
        return q, k
    _rope_kernel[(num_tokens,)](
        q, k, positions, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], **blocks, enable_fp_fusion=False)
    return q, k


def _rope_args(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, int]]:
    """The checks and launch sizes shared by the RoPE kernels: (q, k with a contiguous last dim, the
    contiguous cos|sin table, HALF / BLOCK_QH / BLOCK_KH / BLOCK_HALF / num_warps). ValueError naming
    the tensor that has the wrong shape or dtype."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] and k [T, Hkv, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have one dtype; got {q.dtype} and {k.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] with an even head_dim; "
                         f"got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}]; got {tuple(positions.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cache = cos_sin_cache if cos_sin_cache.is_contiguous() else cos_sin_cache.contiguous()
    half = head_dim // 2
    block_half, block_qh = triton.next_power_of_2(half), triton.next_power_of_2(num_q_heads)
    return q, k, cache, {"HALF": half, "BLOCK_QH": block_qh, "BLOCK_KH": triton.next_power_of_2(k.shape[1]),
                         "BLOCK_HALF": block_half, "num_warps": _warps(block_qh * block_half * 2)}


# ------------------------------------------------------------------ Qwen3's q/k RMSNorm, then RoPE
@triton.jit
def _norm_rotate(ptr, w_ptr, t, stride_t, stride_h, c, s, eps, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    p1, mask = _head_tile(ptr, t, stride_t, stride_h, NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF)
    o1, o2 = _normed_rotated(p1, mask, w_ptr, c, s, eps, True, HALF, BLOCK_HALF)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, stride_qt, stride_qh, stride_kt,
                         stride_kh, eps, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                         BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c, s = _cos_sin(cs_ptr, pos, HALF, BLOCK_HALF, q_ptr.dtype.element_ty)
    _norm_rotate(q_ptr, qw_ptr, t, stride_qt, stride_qh, c, s, eps, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _norm_rotate(k_ptr, kw_ptr, t, stride_kt, stride_kh, c, s, eps, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k, then RoPE, in one launch, IN PLACE (one read and one write of
    q and k instead of three of each). Same results as rms_norm then apply_rope. Weights of another dtype
    than q (whose product would promote) take that unfused path."""
    if q_weight.dtype != q.dtype or k_weight.dtype != k.dtype or q.dim() != 3 or k.dim() != 3:
        return apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), positions, cos_sin_cache)
    q, k, cache, blocks = _rope_args(q, k, positions, cos_sin_cache)
    if q_weight.shape != (q.shape[2],) or k_weight.shape != (q.shape[2],):
        raise ValueError(f"q/k norm weights must be [{q.shape[2]}]; got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}")
    if q.shape[0] == 0:
        return q, k
    _qk_norm_rope_kernel[(q.shape[0],)](
        q, k, q_weight, k_weight, positions, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), eps,
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1], **blocks, enable_fp_fusion=False)
    return q, k


# ------------------------------------------------------- (q/k norm,) RoPE and the KV-cache write, one launch
@triton.jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, cs_ptr, slot_ptr, kc_ptr, vc_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, eps, ks_ptr, vs_ptr,
                       NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                       CACHE_BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_QH: tl.constexpr,
                       BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_FP8: tl.constexpr,
                       FP8_MAX: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # `ops.pdl`: the qkv projection complete first, then the attention may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c, s = _cos_sin(cs_ptr, pos, HALF, BLOCK_HALF, q_ptr.dtype.element_ty)
    p1, mask = _head_tile(q_ptr, t, stride_qt, stride_qh, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    o1, o2 = _normed_rotated(p1, mask, qw_ptr, c, s, eps, HAS_NORM, HALF, BLOCK_HALF)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    # k, rotated, and v go straight to the token's cache slot (layout as write_kv's: [blocks, heads,
    # CACHE_BLOCK, 2 * HALF]); a padding row (slot < 0) writes nothing. (The slot test is folded into
    # the head bound because the interpreter cannot broadcast a scalar boolean into a mask.)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    live = NUM_K_HEADS * (slot >= 0).to(tl.int32)
    p1, mask = _head_tile(k_ptr, t, stride_kt, stride_kh, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)
    o1, o2 = _normed_rotated(p1, mask, kw_ptr, c, s, eps, HAS_NORM, HALF, BLOCK_HALF)
    h = tl.arange(0, BLOCK_KH)
    j = tl.arange(0, BLOCK_HALF)
    wmask = (h[:, None] < live) & (j[None, :] < HALF)
    dst = ((slot // CACHE_BLOCK) * (NUM_K_HEADS * CACHE_BLOCK * 2 * HALF) + h[:, None] * (CACHE_BLOCK * 2 * HALF)
           + (slot % CACHE_BLOCK) * (2 * HALF) + j[None, :])
    tl.store(kc_ptr + dst, to_cache(o1, ks_ptr, kc_ptr, KV_FP8, FP8_MAX), mask=wmask)
    tl.store(kc_ptr + dst + HALF, to_cache(o2, ks_ptr, kc_ptr, KV_FP8, FP8_MAX), mask=wmask)
    pv = v_ptr + t * stride_vt + h[:, None] * stride_vh + j[None, :]
    v1 = tl.load(pv, mask=wmask, other=0.0)
    v2 = tl.load(pv + HALF, mask=wmask, other=0.0)
    tl.store(vc_ptr + dst, to_cache(v1, vs_ptr, vc_ptr, KV_FP8, FP8_MAX), mask=wmask)
    tl.store(vc_ptr + dst + HALF, to_cache(v2, vs_ptr, vc_ptr, KV_FP8, FP8_MAX), mask=wmask)


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               pdl: bool | None = None) -> torch.Tensor:
    """One launch for what a layer does between its qkv projection and attention: (Qwen3's per-head q/k
    RMSNorm when the weights are given,) RoPE of q IN PLACE, and the rotated k and v written to their
    cache slots (rows with slot < 0 write nothing; an fp8 cache quantized with `k_scale` / `v_scale`, as
    triton_kv.write_kv). Returns q (rotated); k is left as it was. Same results as qk_norm_rope / apply_rope
    then write_kv. Norm weights of another dtype than q take that unfused path. `pdl`: programmatic dependent
    launch (`ops.pdl.use_pdl`; None: where the GPU has it).

    Why its own launch (about 3 us a layer at decode, H200): folded into the qkv GEMM's epilogue, a program would
    need whole heads (the q/k norm spans a head, RoPE pairs column j with j + head_dim / 2), so column tiles of
    head_dim or more aligned to heads (the tuned 64-wide tiles give q|k|v's 6144 columns 96 programs; 128-wide ones
    48 on 132 SMs), and under split-K the epilogue is the reduce kernel's; folded into the attention's split kernel,
    the new token's k and v must reach the cache before any split of its sequence reads them (or the split holding
    the last key takes them from registers, fp8 cache rounding included) in a loop every decode configuration
    shares. Neither is clearly cheaper than the launch, whose start PDL overlaps with the qkv GEMM's tail."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope_write takes both q/k norm weights or neither")
    if q_weight is not None and k_weight is not None and (q_weight.dtype != q.dtype or k_weight.dtype != k.dtype):
        q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
        write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return q
    q, k, cache, blocks = _rope_args(q, k, positions, cos_sin_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    if q_weight is not None and k_weight is not None and (q_weight.shape != (head_dim,)
                                                          or k_weight.shape != (head_dim,)):
        raise ValueError(f"q/k norm weights must be [{head_dim}]; got {tuple(q_weight.shape)} and "
                         f"{tuple(k_weight.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}; got {tuple(v.shape)}")
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[1] != k.shape[1]
            or k_cache.shape[3] != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"k_cache and v_cache must both be contiguous [num_blocks, {k.shape[1]}, block_size, "
                         f"{head_dim}]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}]; got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return q
    v = v if v.stride(-1) == 1 else v.contiguous()
    _rope_write_kernel[(num_tokens,)](
        q, k, v, q_weight if q_weight is not None else q, k_weight if k_weight is not None else k, positions,
        cache, slot_mapping, k_cache, v_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), eps, NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], CACHE_BLOCK=k_cache.shape[2],
        HAS_NORM=q_weight is not None, **blocks, **fp8, enable_fp_fusion=False,
        **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, q.device)))
    return q
