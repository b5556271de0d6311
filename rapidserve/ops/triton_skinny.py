"""Linear layers of small decode batches (at most MAX_ROWS = 16 rows) as one Triton kernel that reads the
weight at close to the memory bandwidth (issue 16).

Why: a decode step at batch 1-16 is a read of every weight once. cuBLAS picks tiles of 64 output
columns for these shapes, which leaves Qwen3-8B's o projection (4096 columns: 64 tiles) on half the SMs.
Measured over the 36 layers' own weights (bench/decode_profile.py --sweep, 2026-11-27; us per call at
batch 1 / 16; the configurations below are the ones the table picks):

| layer [N, K] | H100 cuBLAS | H100 this kernel | H200 cuBLAS | H200 this kernel |
|---|---|---|---|---|
| qkv [6144, 4096] | 21.1 / 21.5 | 19.7 / 20.6 | 16.4 / 16.4 | 15.0 / 15.6 |
| o [4096, 4096] | 16.4 / 17.8 | 14.0 / 14.4 | 13.3 / 14.1 | 11.4 / 11.6 |
| gate_up [24576, 4096] + SiLU-and-mul | 74.1 / 76.2 | 68.9 / 70.2 | 49.8 / 51.2 | 47.6 / 48.8 |
| down [4096, 12288] | 39.3 / 41.8 | 36.7 / 38.0 | 29.7 / 30.5 | 25.8 / 27.6 |

With the whole GPU only: it reads at a lower rate per SM than cuBLAS, so on a partition a decode step at
batch 1-16 was 23-37% slower with it on 16 SMs and 11-19% on 32 (H100 profile, 2026-11-27 06:29 UTC); the
runner captures graphs of a partial partition with `ops.cublas_linears`.

Each call of a small weight also pays about 2.7 us of launch, pipeline fill and tail. Programmatic dependent
launch (`ops.pdl`; NVIDIA sm_90+, on by default there, `pdl=False` off): the kernel's programs start while the
kernel before (a norm, SiLU-and-mul) still runs; before waiting for it (`gdc_wait`) each pulls the first bytes of
its weight rows into L2 (`prefetch_rows`: one bulk prefetch a row, cp.async.bulk.prefetch.L2; PREFETCH_BYTES over
the launch, so the weights' first tiles arrive while the kernel before ends), and it lets the next kernel start only
after its K loop (its grid may exceed one wave). A chain of these GEMMs alone with PDL and no prefetch was no faster
(bench/experiments/2026-11/pdl_probe.py: 14.0 us a layer plain, 14.8 with the dependents launched after the K loop);
what the prefetch and the small kernels between the GEMMs change is measured by bench/decode_profile.py's "no PDL"
column. At 24-64 rows (a
wider row tile, measured on the H200 and removed since) cuBLAS was faster (qkv 16.0 vs 20.6 us at 24 rows),
so the kernel takes at most 16 rows. A variant
that formed SiLU-and-mul in the down projection's loads ran 4x slower than cuBLAS (its activation tile
went through registers and a layout change every K step) and was dropped; the gate|up projection takes
it in its epilogue instead (`gated`).

The kernel: program p computes output columns [p * BLOCK_N, (p + 1) * BLOCK_N) for all M rows, looping
over K in BLOCK_K steps: a [BLOCK_N, BLOCK_K] tile of the weight (row-major [N, K], as nn.Linear holds
it) and the matching [16, BLOCK_K] tile of x (rows past M masked), multiplied on the tensor cores (tl.dot,
fp32 accumulation). num_stages is Triton's software pipelining; whether a build pipelines these loads (or
keeps them in registers) was not checked, and the table's s3/s4 choices differ by less than the
run-to-run noise. No split-K, so no partial sums to reduce: `linear` routes a weight here only when it
gives at least MIN_PROGRAMS programs (the fewest measured to beat cuBLAS: qkv's 96), so a thin grid (a
tensor-parallel shard, a small model) stays on cuBLAS.

Results differ from cuBLAS's only in the order of the fp32 sums. Graph-safe (no host reads of device
values). Only bf16/fp16 rows with a contiguous last dim; callers route everything else to F.linear
(`rapidserve/ops/__init__.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch

MAX_ROWS = 16  # BLOCK_M: the tensor-core tile's rows; more rows go to cuBLAS (measured faster there)
MIN_PROGRAMS = 96  # `linear` uses the kernel only for weights whose grid has at least this many programs
# With PDL, the weight bytes a launch prefetches into L2 before its wait (`prefetch_bytes`) when the caller gives none:
# about what the H200 reads in the ~2-3 us of the small kernel before it (4.8 TB/s), a sixth of its L2; a first choice
# (measured against none, not against other sizes). The engine passes its GPU's entry of ops/pdl_table.json.
PREFETCH_BYTES = 8 << 20
PREFETCH_ALIGN = 16  # cp.async.bulk.prefetch: a 16-byte aligned address and a multiple of 16 bytes


def prefetch_bytes(weight: torch.Tensor, rows: int, span: int, budget: int = PREFETCH_BYTES) -> int:
    """Bytes of each weight row a program prefetches into L2 before its PDL wait: the launch's `budget` over its
    `rows` rows (programs x rows a program), at most the program's K `span` (in elements; its slices start at
    multiples of it), a multiple of PREFETCH_ALIGN; 0 (none) where the rows' or slices' starts are not 16-byte
    aligned or a row would get less than 128 bytes (one L2 line)."""
    size = weight.element_size()
    if rows <= 0 or any(b % PREFETCH_ALIGN for b in (weight.data_ptr(), weight.stride(0) * size, span * size)):
        return 0
    got = min(span * size, budget // rows) // PREFETCH_ALIGN * PREFETCH_ALIGN
    return got if got >= 128 else 0


@triton.jit
def prefetch_rows(row_ptrs, nbytes):
    """Pull the first `nbytes` (> 0, a multiple of 16) at each of the 16-byte aligned `row_ptrs` into L2 (sm_90's
    cp.async.bulk.prefetch.L2: one instruction a row, no registers or shared memory taken, nothing waited for).
    Only with PDL (`ops.pdl`): what the kernel reads before its wait, which no kernel writes."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;", "=r,l,r",
                              [row_ptrs, tl.zeros(row_ptrs.shape, tl.int32) + nbytes], dtype=tl.int32,
                              is_pure=False, pack=1)


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def skinny_config(n: int, k: int) -> SkinnyConfig:
    """Tile sizes for an [N, K] weight: the sweep's best on both the H100 and the H200 for each of
    Qwen3-8B's shapes (table above), extended to other sizes by the same rule."""
    if k > 8192:  # long reductions: longer K steps
        return SkinnyConfig(32, 512, 4, 4)
    if n > 4096:
        return SkinnyConfig(64, 256, 4, 4)
    return SkinnyConfig(32, 256, 4, 4)


def gated_config(n2: int, k: int) -> SkinnyConfig:
    """`skinny_linear(gated=True)` of a [2I, K] weight: two weight tiles (gate and up) per K step, each
    half as wide as the ungated kernel's; wide ones (2I >= 16384) in 128-long K steps, 3 stages (the
    sweep's best on the H200, within 0.4 us of it on the H100)."""
    if n2 >= 16384 and k <= 8192:
        return SkinnyConfig(32, 128, 4, 3)
    cfg = skinny_config(n2, k)
    return cfg._replace(block_n=max(16, cfg.block_n // 2))


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om, prefetch,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
                   PREFETCH: tl.constexpr):
    """out[:, n] = x @ w[n] (+ b[n]) for this program's BLOCK_N columns n; GATED: w is [2N, K] =
    cat(gate, up) and out[:, n] = silu(x @ w[n]) * (x @ w[N + n]), each product rounded to the output
    dtype first (as silu_and_mul of the linear's output). USE_GDC (`ops.pdl`): PREFETCH pulls the first `prefetch`
    bytes of its weight rows into L2, then it waits for the kernel before; it lets the next one start after its K
    loop."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    u_rows = w_ptr + (rn[:, None] + N).to(tl.int64) * stride_wn  # int64: I * K may pass 2^31
    if USE_GDC:
        if PREFETCH:  # the weights (no kernel writes them), rows past N clamped to the last
            rows = tl.minimum(rn, N - 1).to(tl.int64)
            prefetch_rows(w_ptr + rows * stride_wn, prefetch)
            if GATED:
                prefetch_rows(w_ptr + (rows + N) * stride_wn, prefetch)
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
            w = tl.load(w_rows + kk[None, :])
        else:
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            if EVEN:
                u = tl.load(u_rows + kk[None, :])
            else:
                u = tl.load(u_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
            acc_u = tl.dot(x, tl.trans(u), acc_u)
    if USE_GDC:  # after the K loop (`ops.pdl`, rule 3)
        tl.extra.cuda.gdc_launch_dependents()
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GATED:  # as silu_and_mul: silu(gate) rounded, times up, rounded
        g = acc.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        acc = act.to(tl.float32) * acc_u.to(dt).to(tl.float32)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(dt), mask=(rm[:, None] < M) & (rn[None, :] < N))


def skinny_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` may serve this call: at most MAX_ROWS rows of a 2-D bf16/fp16 x with a
    contiguous last dim, and a weight of the same dtype, contiguous."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous())


def routed(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether `linear` / `linear_silu_and_mul` send this call to the kernel: on a GPU, rows that
    `skinny_ok`, and a grid of at least MIN_PROGRAMS programs."""
    if not (x.is_cuda and skinny_ok(x, weight) and x.shape[1] == weight.shape[1]):
        return False
    return wide_enough(*weight.shape, gated)


def wide_enough(n: int, k: int, gated: bool = False) -> bool:
    """Whether an [N, K] weight (gated: cat(gate, up), N = 2I) gives the kernel at least MIN_PROGRAMS
    programs."""
    if gated:
        return n % 2 == 0 and -(-(n // 2) // gated_config(n, k).block_n) >= MIN_PROGRAMS
    return -(-n // skinny_config(n, k).block_n) >= MIN_PROGRAMS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           pdl: bool | None = None, prefetch: int | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): `skinny_linear` where `routed`, else torch's F.linear. `pdl`: programmatic dependent
    launch of the kernel (`ops.pdl.use_pdl`; None: where the GPU has it), `prefetch` its weight bytes pulled into L2
    before the wait (None: PREFETCH_BYTES; 0: none)."""
    if routed(x, weight):
        return skinny_linear(x, weight, bias, pdl=pdl, prefetch=prefetch)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, silu_and_mul: Callable[..., torch.Tensor],
                        pdl: bool | None = None, prefetch: int | None = None) -> torch.Tensor:
    """silu_and_mul(x @ weight.T) for an MLP's fused gate|up weight [2I, K]: one gated `skinny_linear`
    where `routed` (the [M, 2I] product is never written; `pdl`, `prefetch` as `linear`'s), else F.linear then
    `silu_and_mul` (given `pdl` when it is not None)."""
    if routed(x, weight, gated=True):
        return skinny_linear(x, weight, gated=True, pdl=pdl, prefetch=prefetch)
    return silu_and_mul(F.linear(x, weight), **pdl_launch.pdl_kwargs(pdl))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None, gated: bool = False, pdl: bool | None = None,
                  prefetch: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N], M <= MAX_ROWS, with `config` (default: the table's). With
    `gated`, weight is cat(gate, up) [2I, K] and the result is silu_and_mul of the product, [M, I]. `pdl`:
    programmatic dependent launch (`ops.pdl.use_pdl`; None: where the GPU has it), with `prefetch` bytes of the
    weight pulled into L2 before the wait (default PREFETCH_BYTES; 0: none). ValueError for shapes that do not fit;
    callers check `skinny_ok` first."""
    n, k = weight.shape
    m = x.shape[0]
    if not skinny_ok(x, weight):
        raise ValueError(f"skinny_linear takes 1..{MAX_ROWS} rows of bf16/fp16 with a contiguous last dim "
                         f"and a contiguous weight of the same dtype; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for a weight [{n}, {k}]; got {tuple(x.shape)}")
    if gated and (n % 2 or bias is not None):
        raise ValueError(f"gated=True takes a cat(gate, up) weight with an even row count and no bias; got "
                         f"weight {tuple(weight.shape)}{' and a bias' if bias is not None else ''}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    cfg = config or (gated_config(n, k) if gated else skinny_config(n, k))
    n_out = n // 2 if gated else n
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    programs = triton.cdiv(n_out, cfg.block_n)
    on = pdl_launch.use_pdl(pdl, x.device)
    ahead = prefetch_bytes(weight, programs * cfg.block_n * (2 if gated else 1), k,
                           PREFETCH_BYTES if prefetch is None else prefetch) if on else 0
    _skinny_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, out, m, n_out, k, x.stride(0), weight.stride(0),
        out.stride(0), ahead, HAS_BIAS=bias is not None, GATED=gated,
        EVEN=n_out % cfg.block_n == 0 and k % cfg.block_k == 0, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, PREFETCH=ahead > 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=False, **pdl_launch.launch_options(on))
    return out


__all__ = ["MAX_ROWS", "MIN_PROGRAMS", "PREFETCH_BYTES", "SkinnyConfig", "gated_config", "linear",
           "linear_silu_and_mul", "prefetch_bytes", "prefetch_rows", "routed", "skinny_config", "skinny_linear",
           "skinny_ok", "wide_enough"]
