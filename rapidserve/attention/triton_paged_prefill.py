"""Triton varlen prefill attention (CUDA and ROCm): `prefill_attention`, causal, of new tokens over their sequences
in the paged cache (a cached prefix included), and `prefill_flops` for benchmarks. The cache's layout, the sliding
window and the fp8 cache: rapidserve/ops/triton_kv.py. Prefill launches without programmatic dependent launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.attention.metadata import AttentionMetadata
from rapidserve.ops.triton_kv import _LOG2E, _dot, _last_dim_contiguous, _window, check_cache


@triton.jit
def _prefill_unmasked(q, kc_ptr, vc_ptr, bt_row, head_off, page_stride, qk_scale, hi, m_i, l_i, acc, d_mask, n, d,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """The prefill kernel's keys [0, hi) that every row of its query tile sees (no mask): (m_i, l_i, acc) updated."""
    for start in range(0, hi, BLOCK_N):
        tok = start + n
        blk = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
        off = (blk * page_stride + head_off + (tok % BLOCK_SIZE) * HEAD_DIM)[:, None] + d[None, :]
        k = tl.load(kc_ptr + off, mask=d_mask[None, :], other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off, mask=d_mask[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return m_i, l_i, acc


# num_seqs and num_m_tiles change from step to step: specialized (== 1, % 16 == 0), each new combination compiled a
# variant mid-serving, a 0.5-1 s stall of every request in flight on a fresh machine (py-spy of hybrid mode,
# 2026-11-27, bench/results/h100_1127/prefill_graphs/README.md). Unspecialized, one variant serves every step.
@triton.jit(do_not_specialize=["num_seqs", "num_m_tiles"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, cu_ptr, out_ptr,
                    qk_scale, stride_qt, stride_qh, stride_bt, num_seqs, num_m_tiles, ks_ptr, vs_ptr,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                    WINDOW: tl.constexpr):
    """Program (q head, tile): BLOCK_M new tokens of one sequence against its keys 0 .. diagonal (the last
    WINDOW of them for each row when WINDOW > 0).

    Tiles are numbered so that the first programs take the last (heaviest) query tile of every
    sequence; tiles past a sequence's end exit at once. KV_FP8: as _decode_split_kernel (triton_paged_decode.py).
    """
    h = tl.program_id(0)
    pid = tl.program_id(1)
    seq = pid % num_seqs
    m_tile = num_m_tiles - 1 - pid // num_seqs
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)
    prefix = ctx - q_len
    kvh = h // (NUM_HEADS // NUM_KV_HEADS)

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh * (BLOCK_SIZE * HEAD_DIM)
    page_stride = NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM  # elements per block (all kv heads)

    # Keys [0, masked_lo) are visible to every row of the tile; [masked_lo, end) need the causal mask. With a window
    # the keys from the first row's first one (tiles start there: keys are gathered one by one) are all masked
    # (causal and window), and there is no unmasked loop.
    end = tl.maximum(tl.minimum(prefix + (m_tile + 1) * BLOCK_M, ctx), 0)
    if WINDOW > 0:
        masked_lo = tl.maximum(prefix + m_tile * BLOCK_M - WINDOW + 1, 0)
    else:
        masked_lo = tl.minimum(tl.maximum((prefix + m_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, 0), end)
        m_i, l_i, acc = _prefill_unmasked(q, kc_ptr, vc_ptr, bt_row, head_off, page_stride, qk_scale, masked_lo,
                                          m_i, l_i, acc, d_mask, n, d, HEAD_DIM, BLOCK_SIZE, BLOCK_N, IEEE)
    for start in range(masked_lo, end, BLOCK_N):
        tok = start + n
        tok_mask = tok < end
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
        off = (blk * page_stride + head_off + (tok % BLOCK_SIZE) * HEAD_DIM)[:, None] + d[None, :]
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + off, mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale
        if WINDOW > 0:  # noqa: SIM108 (a compile-time branch of the kernel)
            back = (prefix + offs_m)[:, None] - tok[None, :]  # how far back each key is from each row's token
            visible = (back >= 0) & (back < WINDOW) & tok_mask[None, :]
        else:
            visible = (tok[None, :] <= prefix + offs_m[:, None]) & tok_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet (a window's first tiles)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * tl.load(vs_ptr)
    tl.store(out_ptr + (rows[:, None] * NUM_HEADS + h) * HEAD_DIM + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# ROCm launch parameters (torch.version.hip set), chosen as decode's were (triton_paged_decode.py): NVIDIA's prefill
# tiles spill on gfx942 (256 VGPRs and scratch) with the default 32x32 MFMA; with the 16x16 one and one stage they fit
# (204 VGPRs at head_dim 128: 2 waves; 123 at 64: 4). fp32 prefill needs waves_per_eu=2 to stay out of scratch.
def _prefill_config(dtype: torch.dtype, head_dim: int, kv_fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). `kv_fp8`: an fp8 cache, whose tiles' conversions take registers
    (on gfx942 the bf16 tile of 128 x 64 keys at head_dim 128 spilled 9 VGPRs with them; 32 keys fit)."""
    if torch.version.hip:
        if head_dim > 128:  # Gemma 3's 256: the 128 x 256 query tile and its accumulator spill, and with the fp8
            # cache's and the window's paths in the kernel 64 query rows left gfx942 under 2 waves a SIMD (compiled)
            return (32, 16, 4, 1) if dtype == torch.float32 else (32, 32, 4, 1)
        if dtype == torch.float32:
            return 64, 32, 4, 1
        return (128, 32, 8, 1) if kv_fp8 and head_dim > 64 else (128, 64, 8, 1)
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    if head_dim > 128:  # Gemma 3's 256: a 128 x 256 query tile and its fp32 accumulator would not fit (not measured)
        return 64, 32, 8, 2
    return 128, 64, 8, 2


def _prefill_amd_options(dtype: torch.dtype, kv_fp8: bool = False) -> dict[str, int]:
    """The AMD backend's own launch options (none on NVIDIA, whose backend refuses them). fp32 over an fp8 cache
    needs no waves_per_eu to stay out of scratch (gfx942: 137 VGPRs at head_dim 64, 251 at 128, neither spilling)."""
    if not torch.version.hip:
        return {}
    if dtype == torch.float32:
        return {} if kv_fp8 else {"waves_per_eu": 2}
    return {"matrix_instr_nonkdim": 16}


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, window: int | None = None) -> torch.Tensor:
    """Causal varlen attention of new tokens (q [T, num_heads, head_dim], sequences laid end to end by
    meta.cu_seqlens_q) over their sequences in the paged cache, including any cached prefix of
    ``context_len - q_len`` tokens (with a `window` W, each token over its last W). Uses meta.max_seqlen_q (host
    int) to size the grid.
    Returns [T, num_heads, head_dim] in q's dtype; sequences with context_len 0 give zeros. An fp8 cache is read
    with `k_scale` / `v_scale`.

    The optional arguments override the automatic launch configuration (for benchmarks/tuning)."""
    fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    if meta.cu_seqlens_q is None:
        raise ValueError("prefill_attention needs meta.cu_seqlens_q (got None)")
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q [T, {num_heads}, {head_dim}] does not fit the cache with {num_kv_heads} "
                         f"kv heads of head_dim {cache_head_dim} (num_heads must be a multiple of "
                         "num_kv_heads)")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = _last_dim_contiguous(q)
    block_tables = _last_dim_contiguous(meta.block_tables)
    cfg_m, cfg_n, cfg_warps, cfg_stages = _prefill_config(q.dtype, head_dim, bool(fp8["KV_FP8"]))
    block_m, block_n = block_m or cfg_m, block_n or cfg_n
    num_m_tiles = triton.cdiv(max(1, meta.max_seqlen_q), block_m)
    _prefill_kernel[(num_heads, num_seqs * num_m_tiles)](
        q, k_cache, v_cache, block_tables, meta.context_lens, meta.cu_seqlens_q, out,
        scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), num_seqs, num_m_tiles,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        IEEE=q.dtype == torch.float32, WINDOW=_window(window), num_warps=num_warps or cfg_warps,
        num_stages=num_stages or cfg_stages, **_prefill_amd_options(q.dtype, bool(fp8["KV_FP8"])), **fp8)
    return out


def prefill_flops(q_lens: list[int], prefixes: list[int], num_heads: int, head_dim: int) -> float:
    """Causal attention FLOPs (QK^T and PV) of a prefill batch, for benchmarks."""
    pairs = sum(q * (q + 1) / 2 + q * p for q, p in zip(q_lens, prefixes, strict=True))
    return 4.0 * pairs * head_dim * num_heads


