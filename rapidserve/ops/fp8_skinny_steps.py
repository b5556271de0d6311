"""The skinny fp8 kernel's pieces (ops/triton_fp8_skinny.py, issue 39): its K step and its epilogues, Triton device
functions that `_fp8_skinny_kernel` and `_fp8_split_reduce_kernel` inline. W8A8 (fp8 rows with per-token scales sx) and
W8A16 (ops/triton_w8a16.py: fp16 rows, no sx) share them:

    K step:    acc += x @ w^T over BLOCK_K columns (SWAP: acc^T += w @ x^T), w the fp8 weight tile; W8A16 widens it
               to fp16 first (e4m3 -> fp16 is exact), so the product is fp16 x fp16 with float32 sums
    epilogue:  out[m, n] = acc[m, n] (* sx[m], W8A8 only) * sw[n] (+ bias[n] after a rounding to out's dtype)
    gated:     out[m, n] = silu_and_mul(gate, up), gate and up each the epilogue's value rounded to the rows' dtype
               (the up rows N past the gate rows), `triton_ops._silu_mul`'s operations: the numbers of
               `triton_ops.silu_and_mul` of the ungated output; for a W8A16 down, then saturated to fp16
"""

from __future__ import annotations

import triton
import triton.language as tl

from rapidserve.ops.triton_fp8 import to_half
from rapidserve.ops.triton_ops import _silu_mul


@triton.jit
def _k_step(x8, w_rows, kk, rn, N, K, acc_t, EVEN: tl.constexpr, SWAP: tl.constexpr, A16: tl.constexpr,
            PROMOTE: tl.constexpr):
    """acc_t plus the product of the rows' K step `kk` with the weight rows `w_rows` there (the kernel's loop body)."""
    if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
        w = tl.load(w_rows + kk[None, :])
    else:
        w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
    if A16:  # W8A16: e4m3 widened to fp16 (exact), an fp16 x fp16 product
        w = w.to(tl.float16)
    # PROMOTE: on sm_90 native fp8 wgmma sums in the tensor core at reduced precision; every PROMOTE products of
    # K the partial sum is added into the fp32 accumulator (ignored by mma.sync, fp16 products and other targets)
    if SWAP:
        acc_t = tl.dot(w, tl.trans(x8), acc_t, max_num_imprecise_acc=PROMOTE)
    else:
        acc_t = tl.dot(x8, tl.trans(w), acc_t, max_num_imprecise_acc=PROMOTE)
    return acc_t


@triton.jit
def _scaled(acc, rm, rn, sx_ptr, sw_ptr, b_ptr, M, N, dt: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_SX: tl.constexpr):
    """acc * sx[rm] (HAS_SX: W8A8's per-token scales; W8A16 has none) * sw[rn] (+ bias[rn] after a rounding to `dt`),
    float32."""
    if HAS_SX:
        acc = acc * tl.load(sx_ptr + rm, mask=rm < M, other=0.0)[:, None]
    acc = acc * tl.load(sw_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:  # as reference_linear: the product in the output dtype, then the bias added
        acc = acc.to(dt).to(tl.float32) + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _epilogue(acc, rm, rn, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr,
              HAS_SX: tl.constexpr = True):
    """out[rm, rn] = acc * sx[rm] * sw[rn] (+ bias[rn]) in out's dtype, for the rows rm < M and columns rn < N."""
    dt = out_ptr.dtype.element_ty
    acc = _scaled(acc, rm, rn, sx_ptr, sw_ptr, b_ptr, M, N, dt, HAS_BIAS, HAS_SX)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(dt), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _gated_epilogue(gate, up, rm, rn, sw_ptr, out_ptr, M, N, stride_om, BF16: tl.constexpr, HALF_OUT: tl.constexpr):
    """out[rm, rn] = silu_and_mul of the gate and up products, each scaled (sw[rn], sw[N + rn]) and rounded to the
    rows' dtype first (BF16: bfloat16, else float16): `triton_ops.silu_and_mul` of the ungated launch's output, the
    same operations; HALF_OUT: out is float16, that value clamped to +-65504 first where it was bf16 (`fp8.to_half`),
    W8A16's rows for the down projection."""
    g = _scaled(gate, rm, rn, sw_ptr, sw_ptr, sw_ptr, M, N, tl.float32, False, False)
    u = _scaled(up, rm, rn + N, sw_ptr, sw_ptr, sw_ptr, M, 2 * N, tl.float32, False, False)
    if BF16:
        y = _silu_mul(g.to(tl.bfloat16), u.to(tl.bfloat16)).to(tl.bfloat16).to(tl.float32)
        if HALF_OUT:  # saturated to fp16 (an fp16 model's own value is stored as it is)
            y = to_half(y).to(tl.float32)
    else:
        y = _silu_mul(g.to(tl.float16), u.to(tl.float16)).to(tl.float16).to(tl.float32)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))
