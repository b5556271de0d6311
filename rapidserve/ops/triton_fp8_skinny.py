"""Decode's fp8 linear layers (at most MAX_ROWS = 64 rows, per-row weight scales, per-token activations): the rows
quantized by `triton_fp8.quantize_tokens` (or already quantized by the op before, `skinny_fp8_linear_rows`), then one
Triton kernel that multiplies fp8 by fp8, reading each weight byte once (issue 39), and with split-K a second, small
one that adds its K slices.

Why: a decode step at batch 1-64 is a read of every weight once, so fp8 weights should halve it. Through
`torch._scaled_mm` (cuBLASLt's row-wise fp8 GEMM) plus the quantizer the Qwen3-8B projections at one row took
13-35 us on the H200, no faster than bf16 (8-52 us); widening the fp8 weight to bf16 inside the bf16 skinny
kernel was slower still (the conversions bound it), and quantizing the rows inside each program (IEEE division
of 16 x K values in every one of ~200 programs) took 88-275 us: bench/results/fp8_linear_probe.md. At 64 rows
cuBLASLt's fp8 kernel read the weights at ~2.1 TB/s (bench/results/decode_profile_fp8/).

The math is `fp8.reference_linear`'s for "token" activations, up to the order of float32 sums:
    x8, sx = quantize_tokens(x)                     (quantize_input's numbers, bit for bit on the GPU)
    out[m, n] = (sum_k x8[m, k] w8[n, k]) * sx[m] * sw[n] (+ bias[n])
Program p computes output columns [p * BLOCK_N, (p + 1) * BLOCK_N) for all M rows (one row tile of BLOCK_M >= M,
rows past M masked), accumulating tl.dot in float32 over K in BLOCK_K steps, scaled in its epilogue.

The tiles (`fp8_tiles.Fp8Tiles`) decide which tensor-core instruction Triton emits on Hopper (compiled for sm_90 on
a CPU, Triton 3.9): with BLOCK_M = 16 or 32 the product is x8 @ w8^T on mma.sync, which has no fp8 form there, so
both operands are widened to fp16 in registers every K step (cvt.rn.f16x2.e4m3x2); with BLOCK_M = 64, or with SWAP
(the product computed as w8 @ x8^T, the weight tile the tall operand, then transposed for the epilogue) and
BLOCK_N >= 64, at 4 or 8 warps, it is wgmma's native e4m3 x e4m3 from shared memory (a swapped tile narrower than 64
falls back to mma.sync). Both operands are K-major, as fp8 wgmma needs, and reach shared memory by 16-byte cp.async
in num_stages pipeline stages. Which family reads the weights fastest is measured, not assumed: the sweep times them.

Split-K (`Fp8Tiles.split_k` = S > 1), for the shapes whose N gives fewer column tiles than the GPU has SMs (Qwen3-8B's
q|k|v, o and down at BLOCK_N 32-64: 96-128 programs on the H200's 132 SMs, one program a SM with the few loads it keeps
in flight): K is cut into slices of K_PER = ceil(ceil(K / S) / BLOCK_K) * BLOCK_K (whole K steps, so a tile with K %
BLOCK_K == 0 keeps its unmasked loads), splits = ceil(K / K_PER) <= S of them (`split_slices`), and program (p, s) sums
the products of slice s into its float32 tile of a workspace [splits, M, N]: raw sums, no scale, every element written,
so the workspace is a torch.empty (nothing to zero, no atomics). A second kernel (`_fp8_split_reduce_kernel`) adds the
splits in the order 0, 1, ..., then applies sx[m] * sw[n] and the bias once, as the one-pass epilogue does
(`_epilogue`, shared), and writes the output. The sums' order is fixed, so a split launch gives the same bits on every
run, as the one-pass one does; the two differ only in where the float32 sums are cut. Costs: the second launch and a
workspace of splits x M x N x 4 bytes, written then read again (0.1 MB for q|k|v at one row and S = 4, 6.3 MB at 64
rows, against 25 MB of weight), which stays in L2. Not taken: one launch where the last program of a column tile to
finish adds the slices (a counter a tile, atomics): its counters must start at zero on every call, so either a memset
launch beside it (two launches again) or a buffer kept between calls, which every stream's calls would share (no module
state here, and a race between streams). Which (tiles, S) a shape takes is measured, never assumed: the sweep times S
of 2, 4 and 8, both kernels in each timing, against the one-pass tiles. Where the output goes straight into an RMSNorm
(o_proj's and down_proj's in a small decode step, `ops/fold_table.py`), `skinny_fp8_linear_sums` returns
the workspace with the scales (`fp8.SplitSums`) instead of launching the reduce, and the norm adds the slices itself
in the same order with the same epilogue (ops/triton_fp8_fold.py): the same numbers, one launch fewer.

Programmatic dependent launch (`ops.pdl`; NVIDIA sm_90+, on by default there, `pdl=False` off), as the bf16 kernel's
(triton_skinny): a program pulls the first bytes of its weight rows (of its K slice) into L2 before it waits for the
kernel before (`prefetch_rows`, `prefetch_bytes`: triton_skinny.PREFETCH_BYTES over the launch) and lets the next
kernel start after its K loop; the split-K reduce kernel waits first and lets the next start at once (it is small).

W8A16 (ops/triton_w8a16.py) runs on this kernel too, its `A16` form: x8_ptr holds fp16 rows (or bf16 rows cast to fp16
in registers, CAST_X), there is no sx, and each K step widens the weight tile to fp16 before an fp16 product (`_k_step`,
ops/fp8_skinny_steps.py); its GATED form takes cat(gate, up) and writes silu_and_mul of the product. W8A8's launches
pass none of these constexprs and compile to the same PTX as before them (Triton 3.9).

Which call goes here, with which tiles, is `plan`, a pure function of (rows, N, K, device, tables): the tuned table of
this GPU (`fp8_tiles`, measured by bench/decode_profile.py --quantization fp8 --sweep) where it covers the call, its
entry either tiles (split-K where the entry says so) or "scaled_mm"; else the untuned rule, the kernel as it was before
the tables (one pass over K): at most RULE_ROWS = 16 rows, tiles of the bf16 skinny kernel with K steps twice as long
(`fp8_config`), on a grid of at least MIN_PROGRAMS programs (a thin grid, a tensor-parallel shard or a small model,
stays on `torch._scaled_mm`), and 17-64 rows on `torch._scaled_mm`. Graph-safe (no host reads of device values). NVIDIA
only (`fp8_gpu.gpu_linear` routes here when torch.version.hip is None): on ROCm the kernels are not measured, and its
calls go to `torch._scaled_mm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops import triton_skinny
from rapidserve.ops.fp8 import QuantizedRows, SplitSums, cdiv
from rapidserve.ops.fp8_skinny_steps import _epilogue, _gated_epilogue, _k_step
from rapidserve.ops.fp8_tiles import MAX_ROWS, SCALED_MM, Fp8Tables, Fp8Tiles, load_tables, lookup
from rapidserve.ops.triton_fp8 import quantize_tokens, to_half
from rapidserve.ops.triton_skinny import MIN_PROGRAMS, SkinnyConfig, prefetch_bytes, prefetch_rows, skinny_config

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Products of K summed in wgmma's fp8 accumulator before they are added into fp32 (sm_90 only; `max_num_imprecise_acc`).
# Triton's default on sm_90 never promotes: on the H200 (2026-11-29) the native-wgmma tiles then missed the fp32
# reference at K = 12288 (down_proj) by up to 1.9x the test's tolerance on 1-3 outputs in 4096-262144. 128 is the
# interval DeepSeek-V3's report gives for fp8 GEMMs on Hopper.
PROMOTE_EVERY = 128
RULE_ROWS = 16  # the untuned rule's rows: more go to torch._scaled_mm unless a table says otherwise
TUNED: Fp8Tables = load_tables()  # the packaged tables, validated once at import (read-only)


def fp8_config(n: int, k: int) -> SkinnyConfig:
    """The untuned rule's tiles for an [N, K] fp8 weight: the bf16 kernel's BLOCK_N with K steps twice as long (the
    same bytes a step), at most 1024."""
    cfg = skinny_config(n, k)
    return cfg._replace(block_k=min(1024, 2 * cfg.block_k))


def rule_tiles(rows: int, n: int, k: int) -> Fp8Tiles:
    """Untuned tiles for `rows` rows: `fp8_config` on a 16-row tile up to RULE_ROWS rows (what the rule routes here),
    above that a 64-row tile with 32 columns in K steps of 256 (wgmma; only for direct calls and tests: the rule
    sends these rows to torch._scaled_mm)."""
    if rows <= RULE_ROWS:
        cfg = fp8_config(n, k)
        return Fp8Tiles(16, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, False)
    return Fp8Tiles(64, 32, 256, 4, 4, False)


def plan(rows: int, n: int, k: int, device_name: str, tables: Fp8Tables) -> Fp8Tiles | None:
    """The tiles for `rows` rows of an [n, k] fp8 weight on `device_name`, or None for torch._scaled_mm (module
    docstring): the table's entry where one covers the call, else the untuned rule."""
    if not 0 < rows <= MAX_ROWS:
        return None
    entry = lookup(tables, device_name, n, k, rows) if tables else None
    if entry == SCALED_MM:
        return None
    if isinstance(entry, Fp8Tiles):
        return entry
    if rows > RULE_ROWS or -(-n // fp8_config(n, k).block_n) < MIN_PROGRAMS:
        return None
    return rule_tiles(rows, n, k)


def split_slices(k: int, tiles: Fp8Tiles) -> tuple[int, int]:
    """(K_PER, splits) of a launch over K input features (module docstring): slices of whole BLOCK_K steps, as even
    as that allows, at most `tiles.split_k` of them and none empty; (k, 1) without split-K."""
    if tiles.split_k <= 1:
        return k, 1
    k_per = cdiv(cdiv(k, tiles.split_k), tiles.block_k) * tiles.block_k
    return k_per, cdiv(k, k_per)


def reduce_tile(rows: int) -> tuple[int, int]:
    """The reduce kernel's [BLOCK_M, BLOCK_N] tile for `rows` rows: the rows (a power of two >= 1, at most 16) times
    1024 // that columns (1024 outputs a program, 8 a thread at 4 warps: 6 programs for one row of q|k|v)."""
    bm = min(16, triton.next_power_of_2(rows))
    return bm, 1024 // bm


def device_name(device: torch.device) -> str:
    """The name tables are keyed by: torch.cuda.get_device_name on a GPU (no device read), else the device type (the
    interpreter's "cpu", the compile check's "meta"), which no packaged table names."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _planned(rows: int, weight: torch.Tensor, tables: Fp8Tables | None) -> Fp8Tiles | None:
    tables = TUNED if tables is None else tables
    return plan(rows, *weight.shape, device_name(weight.device) if tables else "", tables)


@triton.jit
def _fp8_skinny_kernel(x8_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, M, N, K, K_PER, stride_xm, stride_wn,
                       stride_om, prefetch, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PROMOTE: tl.constexpr, USE_GDC: tl.constexpr, PREFETCH: tl.constexpr,
                       A16: tl.constexpr = False, CAST_X: tl.constexpr = False, GATED: tl.constexpr = False,
                       BF16: tl.constexpr = True, HALF_OUT: tl.constexpr = False):
    """Column tile program_id(0) over all of K; SPLIT: over K slice program_id(1), [s * K_PER, (s + 1) * K_PER) cut at
    K, its raw float32 sums stored at out_ptr, the workspace [splits, M, N] (module docstring). USE_GDC (`ops.pdl`):
    PREFETCH pulls the first `prefetch` bytes of its weight rows' slice into L2, then it waits for the kernel before;
    it lets the next one start after its K loop. A16 (W8A16, ops/triton_w8a16.py): x8_ptr holds float rows, not fp8,
    and there is no sx: each K step's weight tile is widened to fp16 and the rows are fp16 already or, CAST_X, cast to
    it in registers (clamped to +-65504 first: a saturating cast, `triton_fp8.to_half`). GATED (A16, one pass, no
    bias): w is [2N, K] = cat(gate, up) and the output silu_and_mul of the product in the rows' dtype (BF16: bfloat16,
    else float16), HALF_OUT: stored as W8A16's float16 rows (`_gated_epilogue`)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x8_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    u_rows = w_ptr + (rn[:, None] + N).to(tl.int64) * stride_wn  # GATED: the up rows, N past the gate rows
    if SPLIT:
        k_lo = tl.program_id(1) * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
    else:  # the whole of K, as before split-K (the same loop)
        k_lo = 0
        k_hi = K
    if USE_GDC:
        if PREFETCH:  # the weights (no kernel writes them; fp8: a byte an element), rows past N clamped to the last
            rows = tl.minimum(rn, N - 1).to(tl.int64)
            prefetch_rows(w_ptr + rows * stride_wn + k_lo, tl.minimum(prefetch, k_hi - k_lo))
            if GATED:
                prefetch_rows(w_ptr + (rows + N) * stride_wn + k_lo, tl.minimum(prefetch, k_hi - k_lo))
        tl.extra.cuda.gdc_wait()  # x8 and sx are the kernel before's output
    # SWAP: acc^T [BLOCK_N, BLOCK_M] = w8 @ x8^T, the weight tile as wgmma's 64-tall operand
    acc_t = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        x8 = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if CAST_X:  # bf16 rows to fp16, saturating (`fp8.to_half`'s numbers)
            x8 = to_half(x8.to(tl.float32))
        acc_t = _k_step(x8, w_rows, kk, rn, N, K, acc_t, EVEN, SWAP, A16, PROMOTE)
        if GATED:
            acc_u = _k_step(x8, u_rows, kk, rn, N, K, acc_u, EVEN, SWAP, A16, PROMOTE)
    if USE_GDC:  # after the K loop (`ops.pdl`, rule 3)
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.trans(acc_t) if SWAP else acc_t
    if SPLIT:  # this slice's raw sums; `_fp8_split_reduce_kernel` scales them
        part = out_ptr + tl.program_id(1).to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
    elif GATED:
        up = tl.trans(acc_u) if SWAP else acc_u
        _gated_epilogue(acc, up, rm, rn, sw_ptr, out_ptr, M, N, stride_om, BF16, HALF_OUT)
    else:
        _epilogue(acc, rm, rn, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS, not A16)


@triton.jit
def _fp8_split_reduce_kernel(ws_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
                             SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             USE_GDC: tl.constexpr, HAS_SX: tl.constexpr = True):
    """out[rm, rn] for rows [program_id(0) * BLOCK_M, ...) and columns [program_id(1) * BLOCK_N, ...): the SPLITS
    slices' float32 sums of the workspace [SPLITS, M, N] added in order 0, 1, ..., then `_epilogue` (HAS_SX False:
    W8A16's sums, no activation scales). USE_GDC (`ops.pdl`): waits for the split kernel, then lets the next kernel
    start."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    part = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    acc = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part + s * M * N, mask=mask, other=0.0)
    _epilogue(acc, rm, rn, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS, HAS_SX)


def _fits(rows: int, cols: int, dense: bool, dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return (0 < rows <= MAX_ROWS and dtype in (torch.bfloat16, torch.float16) and weight.dtype in FP8_DTYPES
            and dense and weight.is_contiguous() and cols == weight.shape[1] and scale.dtype == torch.float32
            and tuple(scale.shape) == (weight.shape[0],) and scale.is_contiguous())


def fp8_ok(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `skinny_fp8_linear` may take this call: 1..MAX_ROWS rows of a 2-D bf16/fp16 x with a contiguous
    last dim, a contiguous fp8 weight [N, K] and float32 scales [N]."""
    return x.dim() == 2 and _fits(x.shape[0], x.shape[1], x.stride(-1) == 1, x.dtype, weight, scale)


def rows_ok(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """`fp8_ok` for rows already quantized (`skinny_fp8_linear_rows`): the same bounds on q [M, K] (of the weight's
    fp8 format, scale [M, 1] float32) and the rows' dtype."""
    q = rows.q
    return (q.dim() == 2 and q.dtype == weight.dtype and rows.scale.dtype == torch.float32
            and tuple(rows.scale.shape) == (q.shape[0], 1) and rows.scale.is_contiguous()
            and _fits(q.shape[0], q.shape[1], q.stride(-1) == 1, rows.dtype, weight, scale))


def routed(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tables: Fp8Tables | None = None) -> bool:
    """Whether `fp8_gpu.gpu_linear` sends this call here: on a GPU, a call that `fp8_ok` and that `plan` gives tiles
    (`tables`: default the packaged ones)."""
    return x.is_cuda and fp8_ok(x, weight, scale) and _planned(x.shape[0], weight, tables) is not None


def routed_rows(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
                tables: Fp8Tables | None = None) -> bool:
    """`routed` for quantized rows (`fp8_gpu.gpu_linear_rows`): the same calls of the same rows go here."""
    return rows.q.is_cuda and rows_ok(rows, weight, scale) and _planned(rows.q.shape[0], weight, tables) is not None


def _launch(x8: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            dtype: torch.dtype, config: Fp8Tiles | None, pdl: bool | None, prefetch: int | None,
            defer: bool = False, a16: bool = False, gated: bool = False,
            half_out: bool = False) -> torch.Tensor | SplitSums:
    """The kernel's launch (and the reduce's where K is split). `a16` (ops/triton_w8a16.py): x8 is float rows (fp16
    or `dtype`), sx unused; `gated` (with a16): weight is cat(gate, up) [2I, K], the output silu_and_mul of the product
    [M, I] in `dtype`, or with `half_out` as float16 rows for a W8A16 down, in one pass over K (split_k of the tiles
    ignored)."""
    n, k = weight.shape
    n_out = n // 2 if gated else n
    m = x8.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    cfg = config or _planned(m, weight, None) or rule_tiles(m, n, k)
    if cfg.block_m < m:
        raise ValueError(f"tiles {cfg.label()} hold {cfg.block_m} rows; the call has {m}")
    if gated:
        cfg = cfg._replace(split_k=1)
    b = bias if bias is not None else scale
    k_per, splits = split_slices(k, cfg)
    deferred = defer and splits > 1  # the sums are the result: no output tensor
    out_dtype = torch.float16 if half_out else dtype
    out = torch.empty((m, n_out), dtype=out_dtype, device=x8.device) if not deferred else None
    # splits > 1: the kernel writes its slices' sums to a float32 workspace, which the reduce kernel scales into out
    ws = torch.empty((splits, m, n_out), dtype=torch.float32, device=x8.device) if splits > 1 else out
    tiles = triton.cdiv(n_out, cfg.block_n)
    on = pdl_launch.use_pdl(pdl, x8.device)
    budget = triton_skinny.PREFETCH_BYTES if prefetch is None else prefetch
    ahead = prefetch_bytes(weight, tiles * splits * cfg.block_n * (2 if gated else 1), k_per, budget) if on else 0
    # W8A16's constexprs only where on: W8A8's launches keep their arguments
    half = {"A16": True, "CAST_X": x8.dtype != torch.float16, "GATED": gated} if a16 else {}
    if gated:
        half.update(BF16=dtype == torch.bfloat16, HALF_OUT=half_out)
    _fp8_skinny_kernel[(tiles, splits)](
        x8, sx, weight, scale, b, ws, m, n_out, k, k_per, x8.stride(0), weight.stride(0), n_out, ahead,
        HAS_BIAS=bias is not None, EVEN=n_out % cfg.block_n == 0 and k % cfg.block_k == 0, SWAP=cfg.swap,
        SPLIT=splits > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PROMOTE=min(cfg.block_k, PROMOTE_EVERY), PREFETCH=ahead > 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **half, **pdl_launch.launch_options(on))
    if deferred:
        return SplitSums(ws, sx, scale, bias, dtype)
    assert out is not None
    return _reduce(SplitSums(ws, sx, scale, bias, dtype), out, on, not a16) if splits > 1 else out


def _reduce(sums: SplitSums, out: torch.Tensor, on: bool, has_sx: bool = True) -> torch.Tensor:
    """The reduce kernel's launch: `sums` added and scaled into `out` [M, N]; `on`: with PDL; `has_sx` False:
    W8A16's sums, whose sx is not read."""
    splits, m, n = sums.ws.shape
    bm, bn = reduce_tile(m)
    _fp8_split_reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        sums.ws, sums.sx, sums.sw, sums.bias if sums.bias is not None else sums.sw, out, m, n, out.stride(0),
        HAS_BIAS=sums.bias is not None, SPLITS=splits, BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
        **({} if has_sx else {"HAS_SX": False}), **pdl_launch.launch_options(on))
    return out


def reduce_sums(sums: SplitSums, pdl: bool | None = None) -> torch.Tensor:
    """The [M, N] output that `sums` stand for (`fp8.SplitSums`), by the reduce kernel that `skinny_fp8_linear_sums`
    left out: the same launch, the same bits. For a consumer that cannot read the sums itself. `pdl`: its
    programmatic dependent launch (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    _, m, n = sums.ws.shape
    out = torch.empty((m, n), dtype=sums.dtype, device=sums.ws.device)
    return _reduce(sums, out, pdl_launch.use_pdl(pdl, sums.ws.device)) if m else out


def skinny_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      config: Fp8Tiles | None = None, pdl: bool | None = None,
                      prefetch: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) through an fp8 projection (weight [N, K], float32 scale [N]) -> [M, N] in x's
    dtype (module docstring), on `config`'s tiles (default: `plan`'s, else `rule_tiles`). `pdl`: programmatic
    dependent launch of its launches, the quantizer's included (`ops.pdl.use_pdl`; None: where the GPU has it), with
    `prefetch` bytes of weight pulled into L2 before the wait (default triton_skinny.PREFETCH_BYTES; 0: none).
    ValueError for what it cannot take; callers check `fp8_ok` first."""
    n, k = weight.shape
    if not fp8_ok(x, weight, scale):
        raise ValueError(f"skinny_fp8_linear takes 1..{MAX_ROWS} rows of bf16/fp16 [M, {k}] with a contiguous last "
                         f"dim, a contiguous fp8 weight and float32 scales [{n}]; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
    x8, sx = quantize_tokens(x, weight.dtype, pdl=pdl)
    out = _launch(x8, sx, weight, scale, bias, x.dtype, config, pdl, prefetch)
    assert isinstance(out, torch.Tensor)  # not deferred
    return out


def skinny_fp8_linear_rows(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, config: Fp8Tiles | None = None, pdl: bool | None = None,
                           prefetch: int | None = None) -> torch.Tensor:
    """`skinny_fp8_linear` of the rows that `rows` quantize (the fused producers' output, triton_fp8_fused): the
    same kernel and tiles on the same x8 and scales, out in rows.dtype; `pdl`, `prefetch` as there. ValueError unless
    `rows_ok`."""
    out = _rows_launch(rows, weight, scale, bias, config, pdl, prefetch, False)
    assert isinstance(out, torch.Tensor)  # not deferred
    return out


def skinny_fp8_linear_sums(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, config: Fp8Tiles | None = None, pdl: bool | None = None,
                           prefetch: int | None = None) -> torch.Tensor | SplitSums:
    """`skinny_fp8_linear_rows`, except that where the tiles split K it returns the slices' sums (`fp8.SplitSums`)
    without launching the reduce, for the RMSNorm that adds them itself (ops/triton_fp8_fold.py); the output where K
    is not split."""
    return _rows_launch(rows, weight, scale, bias, config, pdl, prefetch, True)


def _rows_launch(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 config: Fp8Tiles | None, pdl: bool | None, prefetch: int | None,
                 defer: bool) -> torch.Tensor | SplitSums:
    if not rows_ok(rows, weight, scale):
        n, k = weight.shape
        raise ValueError(f"skinny_fp8_linear_rows takes 1..{MAX_ROWS} rows q [M, {k}] of the weight's fp8 with "
                         f"scale [M, 1] float32 (of bf16/fp16 rows), a contiguous weight and float32 scales [{n}]; "
                         f"got q {tuple(rows.q.shape)} {rows.q.dtype}, scale {tuple(rows.scale.shape)}, rows of "
                         f"{rows.dtype}, weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)}")
    return _launch(rows.q, rows.scale, weight, scale, bias, rows.dtype, config, pdl, prefetch, defer)


__all__ = ["RULE_ROWS", "TUNED", "device_name", "fp8_config", "fp8_ok", "plan", "reduce_sums", "reduce_tile", "routed",
           "routed_rows", "rows_ok", "rule_tiles", "skinny_fp8_linear", "skinny_fp8_linear_rows",
           "skinny_fp8_linear_sums", "split_slices"]
