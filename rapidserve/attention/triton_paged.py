"""Triton paged-attention kernels (CUDA and ROCm): KV write, split-K decode, varlen prefill.

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
p - W < t <= p. The window is a compile-time constant of both kernels (WINDOW, 0: none; a model has at most two
variants of each): decode's key tiles start at the page (or page slice) of each sequence's first key in the window
(the keys before it masked), prefill's at the first key its query tile's first row sees, every one of them masked
(causal and window).

Nothing here reads a device value on the host, and decode's launch shape depends only on tensor
shapes, so write_kv and decode_attention can be captured in a CUDA graph and replayed with other
slots and context lengths. Softmax runs in fp32 with exp2; fp32 inputs use IEEE (not tf32) dots.

An fp8 cache (float8_e4m3fn, or e4m3fnuz on ROCm's gfx94x; rapidserve/attention/kv_quant.py) takes the layer's
``k_scale`` / ``v_scale`` (float32 [1] device tensors, loaded by the kernels): write_kv stores
fp8(clamp(x / scale, +-fp8_max)); the attention kernels load fp8 tiles, convert them to q's dtype (exact: every
e4m3 value is a bf16/fp16/fp32 value) for the same dots, and fold the scales in once: the scores are multiplied by
k_scale with the softmax scale, the output by v_scale (the weighted sum is linear in v). Decode under a bf16 q
converts them to fp16 instead where its table says so (F16_DOTS, NVIDIA: one conversion an element pair instead of
three; rapidserve/attention/decode_config.py), q with them.

Decode's output quantized for an fp8 o projection (`decode_attention_fp8`: issue 39, the projection's per-token
quantizer fused into the attention): each row of the output [B, heads x head_dim] as `fp8.QuantizedRows`, the bits of
`triton_fp8.quantize_tokens` of `decode_attention`'s output. A row's scale needs the amax over all its heads, and the
reduce kernel's programs are per (sequence, head): each stores its head's output (the model's dtype, as before) and
its amax, then counts itself in the sequence's int32 counter (acquire-release, GPU scope, after a barrier: every
thread's stores first); the program that brings the count to the head count takes the heads' amaxes, re-reads the
row from L2 (.cg) and writes its fp8 values and scale. The counters are zeroed by the split kernel (program (b, 0, 0)
of each sequence), which completes before the reduce kernel reads them. One split (DIRECT: no reduce kernel) keeps the
separate quantizer launch. Costs: one atomic a (sequence, head) and one program a sequence that quantizes the row
(heads x head_dim divisions), against the quantizer's launch of about 2 us a layer (H200, Qwen3-8B at batch 1-64,
bench/results/fp8_sweep_h200/decode_profile.md).

Programmatic dependent launch (`rapidserve/ops/pdl.py`; NVIDIA sm_90+, on by default there, `pdl=False` off) for
decode: the split kernel waits for the kernel before (RoPE + KV write) first and lets the next start after its key
loop (its grid is `waves` x the SMs); the reduce kernel waits, then lets the next start at once. write_kv and prefill
launch without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.attention.decode_config import (
    DecodeConfig,
    decode_block_s,
    decode_config,
    launch_splits,
    reduce_warps,
    uses_fp16_dots,
)
from rapidserve.attention.kv_quant import cache_scales
from rapidserve.attention.metadata import AttentionMetadata
from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.fp8 import QuantizedRows
from rapidserve.ops.triton_fp8 import quantize_tokens, to_fp8, token_constants, token_scale

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


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


# ------------------------------------------------------------------------------------------- decode
# Eager decode (hybrid mode's mixed steps, LLM without graphs) sees a new split count and block-table width almost
# every step: specialized (== 1, % 16 == 0) they compiled variants mid-serving, as the prefill kernel's counts did.
# The reduce kernel's BLOCK_S is the process's largest split count rounded up, capped at 64 (decode_block_s), not
# each step's: one variant with 2 x SMs / 64 kv heads per rank or more (5+ on an H100), two or three below that.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, lse_ptr, part_ptr, count_ptr,
                         qk_scale, stride_qb, stride_qh, stride_bt, num_splits, ks_ptr, vs_ptr,
                         NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
                         FP8_MAX: tl.constexpr, WINDOW: tl.constexpr, F16_DOTS: tl.constexpr,
                         PREFETCH: tl.constexpr, USE_GDC: tl.constexpr, ZERO_COUNTS: tl.constexpr):
    """Program (b, kv head, split): the GQA group's queries against one slice of the sequence's keys (its last
    WINDOW keys when WINDOW > 0).

    DIRECT (one split): writes the normalised output. Otherwise writes the fp32 partial output
    ``part[b, h, split, :]`` (normalised within the split) and its log2-sum-exp ``lse[b, h, split]``.
    KV_FP8: the tiles are fp8, converted to q's dtype; k_scale joins qk_scale, v_scale scales the output.
    F16_DOTS (an fp8 cache under a bf16 q): q is converted to fp16 once, so the tiles convert to fp16 (exact, one
    instruction per element pair on sm_89+; bf16 takes three: rapidserve/attention/decode_config.py) and both dots
    run in fp16 with fp32 accumulation. bf16 -> fp16 is exact for |q| in [2^-14, 65504]; a program whose largest
    |q| exceeds 2^15 first multiplies q by 2^15 / max|q| and divides qk_scale by the same factor.
    PREFETCH: each iteration loads the next tile's block-table entries, so the K/V addresses come from the previous
    iteration (rapidserve/attention/decode_config.py, DecodeConfig.prefetch).
    USE_GDC (`ops.pdl`): waits for the kernel before (the new keys' write) first; lets the next kernel start after
    the key loop. ZERO_COUNTS (the reduce kernel quantizes for an fp8 o projection: module docstring): program
    (b, 0, 0) zeroes sequence b's counter.
    """
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if ZERO_COUNTS:  # noqa: SIM102 (a compile-time branch of the kernel)
        if (kvh == 0) & (split == 0):
            tl.store(count_ptr + b, 0)
    ctx = tl.load(ctx_ptr + b)
    # Each key tile is PAGES whole pages of ROWS keys (block_size and BLOCK_N are powers of two: BLOCK_N / block_size
    # pages, or a BLOCK_N-key slice of one page), one block-table read a page. Tiles start at the ROWS-aligned slice
    # holding the window's first key (0 without one), so every tile holds a visible key; the keys before the
    # window's first and from ctx on are masked.
    PAGES: tl.constexpr = (BLOCK_N + BLOCK_SIZE - 1) // BLOCK_SIZE
    ROWS: tl.constexpr = BLOCK_N // PAGES
    HEAD_ALIGN: tl.constexpr = HEAD_DIM & -HEAD_DIM  # the largest power of two dividing HEAD_DIM
    first = 0
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    start0 = first // ROWS * ROWS
    num_tiles = tl.cdiv(ctx - start0, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)
    if F16_DOTS:
        q32 = q.to(tl.float32)
        big = tl.max(tl.max(tl.abs(q32), axis=1), axis=0)
        shrink = tl.where(big > 32768.0, 32768.0 / big, 1.0)
        q = (q32 * shrink).to(tl.float16)
        qk_scale = qk_scale / shrink

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * (BLOCK_SIZE * HEAD_DIM)
    page_stride = NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM  # elements per block (all kv heads)
    pages = tl.arange(0, PAGES)
    if PREFETCH:  # the first tile's pages; each iteration then loads the next tile's (entries past ctx: masked)
        pg_next = (start0 + tile_lo * BLOCK_N) // BLOCK_SIZE + pages
        blk_next = tl.load(bt_row + pg_next, mask=pg_next * BLOCK_SIZE < ctx, other=0)
    for tile in range(tile_lo, tile_hi):
        start = start0 + tile * BLOCK_N
        tok = start + n
        tok_mask = tok < ctx
        if WINDOW > 0:
            tok_mask = tok_mask & (tok >= first)
        if PREFETCH:
            blk = blk_next.to(tl.int64)
            pg_next = (start + BLOCK_N) // BLOCK_SIZE + pages
            blk_next = tl.load(bt_row + pg_next, mask=pg_next * BLOCK_SIZE < ctx, other=0)
        else:
            pg = start // BLOCK_SIZE + pages
            blk = tl.load(bt_row + pg, mask=pg * BLOCK_SIZE < ctx, other=0).to(tl.int64)
        rows = (start % BLOCK_SIZE + tl.arange(0, ROWS)) * HEAD_DIM  # 0.. unless a tile is a slice of its page
        # Each key's row starts at a multiple of HEAD_DIM. Said explicitly: tl.reshape drops what Triton knows of
        # its input's divisibility, and without it Triton 3.6 (the GPU machines') loads the tiles one element a
        # thread per instruction (sm_90 SASS: 256 LDG.E.U16 a thread per 64-key bf16 tile, LDG.E.U8 for fp8) and,
        # as cp.async needs 4 bytes or more, never pipelines them. With it: 16-byte cp.async, staged ahead.
        base = tl.multiple_of(tl.reshape((blk * page_stride + head_off)[:, None] + rows[None, :], [BLOCK_N]),
                              HEAD_ALIGN)
        off = base[:, None] + d[None, :]
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + off, mask=kv_mask, other=0.0).to(q.dtype)
        s = _dot(q, tl.trans(k), IEEE) * qk_scale
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vc_ptr + off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    if USE_GDC:  # after the key loop (`ops.pdl`, rule 3)
        tl.extra.cuda.gdc_launch_dependents()
    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_FP8:
        acc = acc * tl.load(vs_ptr)
    out_mask = g_mask[:, None] & d_mask[None, :]
    row = b.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads  # (b, h) flattened
    if DIRECT:
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=out_mask)
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * num_splits + split, lse, mask=g_mask)
        tl.store(part_ptr + (row[:, None] * num_splits + split) * HEAD_DIM + d[None, :], acc,
                 mask=out_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(out_ptr, lse_ptr, part_ptr, num_splits, amax_ptr, count_ptr, q8_ptr, s8_ptr,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_GDC: tl.constexpr, FP8_OUT: tl.constexpr, NUM_HEADS: tl.constexpr,
                          BLOCK_H: tl.constexpr, Q_BLOCK: tl.constexpr, TOP: tl.constexpr, RCP: tl.constexpr,
                          MIN_AMAX: tl.constexpr):
    """Program (b * num_heads + h): merge the splits' partial outputs by their log2-sum-exp. USE_GDC (`ops.pdl`):
    waits for the split kernel, then lets the next kernel start. FP8_OUT: then the row's last program quantizes it
    (`_quantize_row`, module docstring)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + (row * num_splits + s[:, None]) * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(w, axis=0)
    o = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * HEAD_DIM + d, o, mask=d < HEAD_DIM)
    if FP8_OUT:
        _quantize_row(out_ptr, amax_ptr, count_ptr, q8_ptr, s8_ptr, row, tl.max(tl.abs(o.to(tl.float32)), axis=0),
                      HEAD_DIM, NUM_HEADS, BLOCK_H, Q_BLOCK, TOP, RCP, MIN_AMAX)


@triton.jit
def _quantize_row(out_ptr, amax_ptr, count_ptr, q8_ptr, s8_ptr, row, amax, HEAD_DIM: tl.constexpr,
                  NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, Q_BLOCK: tl.constexpr, TOP: tl.constexpr,
                  RCP: tl.constexpr, MIN_AMAX: tl.constexpr):
    """The reduce kernel's program `row` = (b, h) of an fp8 output, its head stored in out and `amax` its largest
    |value| (of the stored values): stores the amax at amax[row] and counts itself in b's counter; the program that
    counts last quantizes b's row of out [B, NUM_HEADS * HEAD_DIM] as `triton_fp8.quantize_tokens` does (the heads'
    amaxes' max, which is the row's; the same division and cast) into q8 [B, NUM_HEADS * HEAD_DIM] and s8 [B]."""
    tl.store(amax_ptr + row, amax)
    tl.debug_barrier()  # every thread's stores of the head before the counter says so (release)
    b = row // NUM_HEADS
    if tl.atomic_add(count_ptr + b, 1, sem="acq_rel", scope="gpu") == NUM_HEADS - 1:
        tl.debug_barrier()  # the acquire before any thread's loads
        heads = tl.arange(0, BLOCK_H)
        amaxes = tl.load(amax_ptr + b * NUM_HEADS + heads, mask=heads < NUM_HEADS, other=0.0, cache_modifier=".cg")
        scale = token_scale(amaxes, RCP, MIN_AMAX)
        width: tl.constexpr = NUM_HEADS * HEAD_DIM
        cols = tl.arange(0, Q_BLOCK)
        for k0 in range(0, width, Q_BLOCK):
            mask = k0 + cols < width
            x = tl.load(out_ptr + b * width + k0 + cols, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(q8_ptr + b * width + k0 + cols, to_fp8(x.to(tl.float32), scale, TOP, q8_ptr.dtype.element_ty),
                     mask=mask)
        tl.store(s8_ptr + b, scale)


def _window(window: int | None) -> int:
    """The kernels' WINDOW constant: the window, 0 for none."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"a sliding window of {window} tokens; it must be >= 1 (None: no window)")
    return int(window)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on CPU


# ROCm launch parameters (torch.version.hip set): chosen from the kernels compiled for gfx942 (MI300X) on a CPU
# machine, never run on one (bench/amd_compile_check.py; its table: bench/results/amd_compile/). The ROCm Triton
# guides recommend num_stages=1 for loops with two dots (flash attention) and the 16x16 MFMA
# (matrix_instr_nonkdim=16) where registers are short. NVIDIA's num_stages=3 gives the decode kernel 32 KiB of LDS
# a workgroup (2 waves per SIMD); one stage halves it (3 waves, VGPR-bound). NVIDIA's prefill tiles spill on gfx942
# (256 VGPRs and scratch) with the default 32x32 MFMA; with the 16x16 one and one stage they fit (204 VGPRs at
# head_dim 128: 2 waves; 123 at 64: 4). fp32 prefill needs waves_per_eu=2 to stay out of scratch. Decode's table,
# split rule and reduce-kernel warps (ROCm's split cap among them): rapidserve/attention/decode_config.py.
def _decode_config(dtype: torch.dtype, head_dim: int, kv_fp8: bool = False) -> DecodeConfig:
    """This platform's DECODE_TABLE entry for a launch."""
    return decode_config(bool(torch.version.hip), dtype, kv_fp8, head_dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     window: int | None = None, config: DecodeConfig | None = None,
                     pdl: bool | None = None) -> torch.Tensor:
    """Flash-decoding: q [B, num_heads, head_dim] (one token per sequence) over each sequence's
    context_lens[b] cached tokens (its last `window` with a window); context_len 0 gives zeros.
    Returns [B, num_heads, head_dim]. An fp8 cache is read with `k_scale` / `v_scale`.

    The launch configuration is decode_config.DECODE_TABLE's for this platform, dtype, cache and head_dim; the
    optional arguments override it (for benchmarks and tuning): `config` the whole entry, then `block_n`,
    `num_warps`, `num_stages` its fields, `num_splits` the split rule. `pdl`: programmatic dependent launch of both
    kernels (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, None, num_splits,
                   block_n, num_warps, num_stages, window, config, pdl)[0]


def decode_attention_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                         out_fp8: torch.dtype, num_splits: int | None = None, window: int | None = None,
                         config: DecodeConfig | None = None, pdl: bool | None = None) -> QuantizedRows:
    """`decode_attention`'s output [B, num_heads * head_dim] quantized per token to `out_fp8` for an fp8 o
    projection (module docstring): the bits of `triton_fp8.quantize_tokens` of that output, with the quantization in
    the reduce kernel (one split: the quantizer's launch after it). ValueError for a format that is not fp8."""
    if out_fp8 not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise ValueError(f"out_fp8 must be float8_e4m3fn or float8_e4m3fnuz (the o projection's format); got {out_fp8}")
    rows = _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, out_fp8, num_splits,
                   None, None, None, window, config, pdl)[1]
    assert rows is not None
    return rows


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            out_fp8: torch.dtype | None, num_splits: int | None, block_n: int | None, num_warps: int | None,
            num_stages: int | None, window: int | None, config: DecodeConfig | None,
            pdl: bool | None) -> tuple[torch.Tensor, QuantizedRows | None]:
    """The decode launches: (the output [B, num_heads, head_dim], its rows quantized to `out_fp8` or None)."""
    fp8 = check_cache(k_cache, v_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q [B, {num_heads}, {head_dim}] does not fit the cache with {num_kv_heads} "
                         f"kv heads of head_dim {cache_head_dim} (num_heads must be a multiple of "
                         "num_kv_heads)")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_tables must be [{batch}, max_blocks] and context_lens [{batch}]; got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    width = num_heads * head_dim

    def new_rows(fp8_dtype: torch.dtype) -> QuantizedRows:
        return QuantizedRows(torch.empty((batch, width), dtype=fp8_dtype, device=q.device),
                             torch.empty((batch, 1), dtype=torch.float32, device=q.device), q.dtype)

    if batch == 0:
        return out, None if out_fp8 is None else new_rows(out_fp8)
    q = _last_dim_contiguous(q)
    block_tables = _last_dim_contiguous(block_tables)
    group = num_heads // num_kv_heads
    kv_fp8 = bool(fp8["KV_FP8"])
    hip = bool(torch.version.hip)
    cfg = config or _decode_config(q.dtype, head_dim, kv_fp8)
    cfg = cfg._replace(block_n=block_n or cfg.block_n, num_warps=num_warps or cfg.num_warps,
                       num_stages=num_stages or cfg.num_stages)
    if num_splits is None:
        num_splits = launch_splits(batch, num_kv_heads, block_tables.shape[1], block_size, head_dim, cfg,
                                   _num_sms(q.device), hip)
    direct = num_splits == 1
    if direct:
        lse = part = out  # unused
    else:
        lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    fused = out_fp8 is not None and not direct  # the reduce kernel quantizes; its counters zeroed by the split kernel
    rows = new_rows(out_fp8) if fused and out_fp8 is not None else None
    counts = torch.empty(batch, dtype=torch.int32, device=q.device) if fused else out
    block_d = triton.next_power_of_2(head_dim)
    on = pdl_launch.use_pdl(pdl, q.device)
    gdc = pdl_launch.launch_options(on)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, lse, part, counts,
        scale * _LOG2E, q.stride(0), q.stride(1), block_tables.stride(0), num_splits,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        DIRECT=direct, IEEE=q.dtype == torch.float32, WINDOW=_window(window),
        F16_DOTS=uses_fp16_dots(cfg, q.dtype, kv_fp8), PREFETCH=cfg.prefetch, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, ZERO_COUNTS=fused, **fp8, **gdc)
    if not direct:
        block_s = decode_block_s(num_splits, num_kv_heads, _num_sms(q.device), cfg.waves)
        if rows is not None:
            quant = {"amax_ptr": torch.empty(batch * num_heads, dtype=torch.float32, device=q.device),
                     "q8_ptr": rows.q, "s8_ptr": rows.scale, "NUM_HEADS": num_heads,
                     "BLOCK_H": triton.next_power_of_2(num_heads), "Q_BLOCK": min(1024, triton.next_power_of_2(width)),
                     **token_constants(rows.q.dtype)}
        else:  # one compiled variant for every model: nothing of the quantization is read
            quant = {"amax_ptr": out, "q8_ptr": out, "s8_ptr": out, "NUM_HEADS": 1, "BLOCK_H": 1, "Q_BLOCK": 1,
                     "TOP": 0.0, "RCP": 0.0, "MIN_AMAX": 0.0}
        _decode_reduce_kernel[(batch * num_heads,)](
            out, lse, part, num_splits, count_ptr=counts, HEAD_DIM=head_dim, BLOCK_S=block_s, BLOCK_D=block_d,
            FP8_OUT=rows is not None, num_warps=reduce_warps(block_s, block_d, hip), **quant, **gdc)
    elif out_fp8 is not None:  # one split: the output is written by the split kernel, then quantized
        rows = QuantizedRows(*quantize_tokens(out.view(batch, width), out_fp8, pdl=on), q.dtype)
    return out, rows


# ------------------------------------------------------------------------------------------ prefill
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
    sequence; tiles past a sequence's end exit at once. KV_FP8: as _decode_split_kernel.
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


