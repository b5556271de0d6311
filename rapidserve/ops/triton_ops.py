"""Fused Triton versions of the elementwise / normalisation ops (CUDA and ROCm): RMSNorm (with the residual add) and
SiLU-and-mul here; the rotary-embedding ops (RoPE, Qwen3's q/k RMSNorm + RoPE, RoPE + the KV-cache write) in
rapidserve/ops/triton_rope.py, which keeps the conventions below.

Same signatures and numerics as rapidserve/ops/torch_ops.py: fp32 internal math, with results rounded
to the tensor dtype at the same points where transformers rounds (e.g. ``weight * h.to(x.dtype)``),
and floating-point contraction (FMA) disabled so products and sums round like torch's separate ops.
Reduction order differs from torch, so fp32 sums can differ in the last bit.

No op reads a device value on the host or allocates value-dependent memory: all are CUDA-graph safe.
Inputs need a contiguous last dim; leading dims may be strided (e.g. q/k views of a fused qkv).

Programmatic dependent launch (`ops.pdl`; NVIDIA sm_90+, on by default there, `pdl=False` off) for the ops of a decode
step: RMSNorm (with the residual add), RoPE + KV write (triton_rope's `rope_write`) and SiLU-and-mul wait for the
kernel before first, then let the next kernel start (they are small: one wave or less at decode). The unfused
fallbacks (triton_rope's `apply_rope` and `qk_norm_rope`, triton_kv's `write_kv`) launch without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.triton_fp8 import to_half


def _warps(block: int) -> int:
    return min(16, max(1, block // 512))


# ----------------------------------------------------------------------------------------- RMSNorm
@triton.jit
def _rms_row(x_ptr, r_ptr, w_ptr, res_out_ptr, row, n_inner, stride_xo, stride_xi, stride_ro, stride_ri, n_cols, eps,
             HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """(Row `row` normalised, weight * h.to(dtype), in float32 before its rounding to the output dtype ([BLOCK],
    0 past n_cols); rsqrt(mean(h^2) + eps), the scalar h was multiplied by). With HAS_RESIDUAL the sum residual + x,
    rounded to x's dtype, is what is normalised and (STORE_RESIDUAL) is stored to res_out's row first. Row ``row``
    of x is at ``(row // n_inner) * stride_xo + (row % n_inner) * stride_xi``. (Shared with triton_fp8_fused's
    RMSNorm that quantizes its output: the same numbers.)"""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    outer = row // n_inner
    inner = row % n_inner
    x = tl.load(x_ptr + outer * stride_xo + inner * stride_xi + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + outer * stride_ro + inner * stride_ri + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        if STORE_RESIDUAL:
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n_cols
    rstd = tl.rsqrt(variance + eps)
    h = h * rstd
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return h.to(x.dtype).to(tl.float32) * w.to(tl.float32), rstd


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, n_inner,
                     stride_xo, stride_xi, stride_ro, stride_ri, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
                     HALF: tl.constexpr = False):
    """HALF (W8A16's rows of a bf16 x, ops/triton_w8a16.py): out is float16, each value the bf16 output clamped to
    +-65504 first (`fp8.to_half` of the plain output)."""
    if USE_GDC:  # `ops.pdl`: the kernel before complete first, then the next may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    y, _ = _rms_row(x_ptr, r_ptr, w_ptr, res_out_ptr, row, n_inner, stride_xo, stride_xi, stride_ro, stride_ri,
                    n_cols, eps, HAS_RESIDUAL, True, BLOCK)
    if HALF:
        y = to_half(y.to(x_ptr.dtype.element_ty).to(tl.float32))
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x', n_inner, stride_outer, stride_inner) describing x's rows of its last dim."""
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, 1, 0, 0


def _rms_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, pdl: bool | None, half: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`half` (weight of x's dtype): the output in float16, saturated from bf16 (the kernel's HALF; an fp16 x's is
    its own output, `fp8.to_half`)."""
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must be [{n_cols}] (the last dim of x); got {tuple(weight.shape)}")
    dtype = torch.float16 if half else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    num_rows = x.numel() // n_cols if n_cols else 0
    if num_rows == 0:
        return out, res_out
    xv, n_inner, sxo, sxi = _rows_view(x)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
        rv, r_inner, sro, sri = _rows_view(residual)
        if r_inner != n_inner:
            rv, r_inner, sro, sri = _rows_view(residual.contiguous())
    else:
        rv, sro, sri = xv, 0, 0
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(num_rows,)](
        xv, rv, weight, out, res_out if res_out is not None else out, n_inner, sxo, sxi, sro, sri,
        n_cols, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block),
        enable_fp_fusion=False, **({"HALF": True} if half and x.dtype != torch.float16 else {}),
        **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool | None = None) -> torch.Tensor:
    """RMSNorm over the last dim (x [..., N], weight [N]); returns a new contiguous tensor. `pdl`: programmatic
    dependent launch (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    return _rms_launch(x, None, weight, eps, pdl)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) in one pass; returns new tensors. `pdl` as `rms_norm`'s."""
    out, res_out = _rms_launch(x, residual, weight, eps, pdl)
    assert res_out is not None
    return out, res_out


# ------------------------------------------------------------------------------------ SiLU and mul
@triton.jit
def _silu_mul(gate, up):
    """silu(gate) * up in float32 before its rounding to the output dtype, silu rounded to gate's dtype first (as
    torch). (Shared with triton_fp8_fused's SiLU-and-mul that quantizes its output: the same numbers.)"""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, n_inter, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    if USE_GDC:  # `ops.pdl`: the kernel before complete first, then the next may start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_xt + n_inter + cols, mask=mask, other=0.0)
    out = _silu_mul(gate, up)
    tl.store(out_ptr + t * n_inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> silu(gate) * up, a new tensor [..., I]. `pdl`: programmatic dependent launch
    (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (cat(gate, up)); got {tuple(x.shape)}")
    n_inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], n_inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0 or n_inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_inter, block))](
        x2, out, x2.stride(0), n_inter, BLOCK=block, num_warps=4 if block >= 512 else 1,
        enable_fp_fusion=False, **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))
    return out
