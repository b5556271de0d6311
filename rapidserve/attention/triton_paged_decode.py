"""Triton split-K decode attention (CUDA and ROCm): `decode_attention`, and `decode_attention_fp8` whose output is
quantized for an fp8 o projection. The cache's layout, the sliding window and the fp8 cache:
rapidserve/ops/triton_kv.py; the launch configuration (key tile, warps, stages, splits):
rapidserve/attention/decode_config.py.

Nothing here reads a device value on the host, and the launch shape depends only on tensor shapes, so
decode_attention can be captured in a CUDA graph (as write_kv) and replayed with other slots and context lengths.

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

For a W8A16 o projection (`decode_attention_fp8(out_fp8=float16)`, ops/triton_w8a16.py) the reduce kernel stores each
head of a bf16 output a second time in float16, saturated at +-65504 (`fp8.HalfRows`, `fp8.half_rows` of the output:
no amax, no counters); an fp16 output is its own rows, and one split (no reduce kernel) returns the float output, which
the projection casts in its registers.

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
from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.fp8 import HalfRows, QuantizedRows
from rapidserve.ops.triton_fp8 import quantize_tokens, to_fp8, to_half, token_constants, token_scale
from rapidserve.ops.triton_kv import _LOG2E, _dot, _last_dim_contiguous, _window, check_cache


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
                          MIN_AMAX: tl.constexpr, HALF_OUT: tl.constexpr = False):
    """Program (b * num_heads + h): merge the splits' partial outputs by their log2-sum-exp. USE_GDC (`ops.pdl`):
    waits for the split kernel, then lets the next kernel start. FP8_OUT: then the row's last program quantizes it
    (`_quantize_row`, module docstring). HALF_OUT (a bf16 output for a W8A16 o projection): its head also stored at
    q8_ptr as float16, saturated at +-65504 (`fp8.to_half`)."""
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
    if HALF_OUT:
        tl.store(q8_ptr + row * HEAD_DIM + d, to_half(o.to(tl.float32)), mask=d < HEAD_DIM)
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


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter on CPU


# ROCm launch parameters (torch.version.hip set): chosen from the kernels compiled for gfx942 (MI300X) on a CPU
# machine, never run on one (bench/amd_compile_check.py; its table: bench/results/amd_compile/). The ROCm Triton
# guides recommend num_stages=1 for loops with two dots (flash attention) and the 16x16 MFMA
# (matrix_instr_nonkdim=16) where registers are short. NVIDIA's num_stages=3 gives the decode kernel 32 KiB of LDS
# a workgroup (2 waves per SIMD); one stage halves it (3 waves, VGPR-bound). Prefill's: triton_paged_prefill.py.
# Decode's table, split rule and reduce-kernel warps (ROCm's split cap among them):
# rapidserve/attention/decode_config.py.
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
                         config: DecodeConfig | None = None,
                         pdl: bool | None = None) -> QuantizedRows | HalfRows | torch.Tensor:
    """`decode_attention`'s output [B, num_heads * head_dim] quantized per token to `out_fp8` for an fp8 o
    projection (module docstring): the bits of `triton_fp8.quantize_tokens` of that output, with the quantization in
    the reduce kernel (one split: the quantizer's launch after it). `out_fp8` float16: the rows of a W8A16 o projection
    (`fp8.HalfRows`, `fp8.half_rows` of the output: written by the reduce kernel beside the output; an fp16 output is
    itself; one split of a bf16 one: the output [B, heads * head_dim] itself, which the projection casts). ValueError
    for another format."""
    if out_fp8 not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float16):
        raise ValueError(f"out_fp8 must be float8_e4m3fn or float8_e4m3fnuz (the o projection's format), or float16 "
                         f"(W8A16's rows); got {out_fp8}")
    out, rows = _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, out_fp8,
                        num_splits, None, None, None, window, config, pdl)
    return rows if rows is not None else out.view(out.shape[0], -1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            out_fp8: torch.dtype | None, num_splits: int | None, block_n: int | None, num_warps: int | None,
            num_stages: int | None, window: int | None, config: DecodeConfig | None,
            pdl: bool | None) -> tuple[torch.Tensor, QuantizedRows | HalfRows | None]:
    """The decode launches: (the output [B, num_heads, head_dim], its rows quantized to `out_fp8` (float16: W8A16's
    rows, None where the output itself is what the projection takes) or None)."""
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
    half = out_fp8 == torch.float16  # W8A16's rows: the output itself (fp16), or written beside it (bf16)
    if half:
        out_fp8 = None
        rows_16 = HalfRows(out.view(batch, width) if q.dtype == torch.float16 else torch.empty(
            (batch, width), dtype=torch.float16, device=q.device), q.dtype)

    def new_rows(fp8_dtype: torch.dtype) -> QuantizedRows:
        return QuantizedRows(torch.empty((batch, width), dtype=fp8_dtype, device=q.device),
                             torch.empty((batch, 1), dtype=torch.float32, device=q.device), q.dtype)

    if batch == 0:
        return out, rows_16 if half else None if out_fp8 is None else new_rows(out_fp8)
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
        halves = half and q.dtype == torch.bfloat16  # the reduce kernel writes W8A16's rows beside the output
        if halves:
            quant["q8_ptr"] = rows_16.x
        _decode_reduce_kernel[(batch * num_heads,)](
            out, lse, part, num_splits, count_ptr=counts, HEAD_DIM=head_dim, BLOCK_S=block_s, BLOCK_D=block_d,
            FP8_OUT=rows is not None, num_warps=reduce_warps(block_s, block_d, hip), **quant,
            **({"HALF_OUT": True} if halves else {}), **gdc)
    elif out_fp8 is not None:  # one split: the output is written by the split kernel, then quantized
        rows = QuantizedRows(*quantize_tokens(out.view(batch, width), out_fp8, pdl=on), q.dtype)
    if half:  # an fp16 output is its own rows; a bf16 one's are written by the reduce kernel (none with one split:
        # the projection casts the output itself), a float32 one has none (W8A16 takes bf16 / fp16 rows)
        written = q.dtype == torch.float16 or (q.dtype == torch.bfloat16 and not direct)
        return out, rows_16 if written else None
    return out, rows

