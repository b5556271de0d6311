"""The fp8 linear of GPUs that multiply fp8 (`Ops.fp8_linear` of the Triton bundle): which kernel takes a call.
The math every path computes, and the reference, are in rapidserve/ops/fp8.py; the paths:
- per-row weight scales: `torch._scaled_mm` with row-wise scales (`scaled_mm_linear`), per-token activations
  quantized by one Triton kernel (`triton_fp8.quantize_tokens`); at decode's 1-64 rows on NVIDIA the Triton
  skinny kernel where `triton_fp8_skinny.plan` gives it tiles (1-16 rows untuned, more where a measured table says);
- block scales: the Triton block GEMM (`triton_fp8.block_linear`);
- shapes none of them takes (K or N not a multiple of 16): `fp8.reference_linear`.
`gpu_linear_rows` takes rows already quantized per token by the op that made them (triton_fp8_fused: RMSNorm,
SiLU-and-mul) through the same routing, minus the quantizer; `gpu_linear_sums` the same, a split-K skinny GEMM's
output left unreduced for the RMSNorm after it where ops/fold_table.py says so.
W8A16 (ops/triton_w8a16.py: fp8 weights, fp16 rows, no per-token scale) takes float rows of per-token layers where the
W8A16 table says (`w8a16_routed`: ops/w8a16_table.py: no GPU's entry above 0 rows, so nothing goes there unless a GPU
measures a win or a caller passes a table, `w8a16=`): in `gpu_linear` (float rows, cast to fp16 in the kernel),
`gpu_linear_half` (`fp8.HalfRows`, the fp16 rows an RMSNorm, the decode attention or gate|up's epilogue wrote for it)
and `gpu_linear_silu_and_mul` (gate|up with SiLU-and-mul in the GEMM's epilogue, `HalfRows` out); the model asks
`w8a16_routed` first so that the producers of those rows write them in fp16 rather than quantize them.
"""

from __future__ import annotations

import torch

from rapidserve.ops import fold_table, triton_fp8, triton_fp8_skinny, triton_ops, triton_w8a16
from rapidserve.ops.fp8 import (
    Fp8Linear,
    HalfRows,
    QuantizedRows,
    SplitSums,
    check_rows,
    quantize_input,
    reference_linear,
    reference_linear_rows,
    takes_rows,
)
from rapidserve.ops.w8a16_table import W8a16Table

FAST_ACCUM = True  # `scaled_mm_linear`'s use_fast_accum (its docstring)


def scaled_mm_ok(x: torch.Tensor, layer: Fp8Linear) -> bool:
    """Whether `scaled_mm_linear` takes this call: per-row weight scales, and K, N multiples of 16 (its GEMM's
    alignment)."""
    n, k = layer.weight.shape
    return layer.block is None and k % 16 == 0 and n % 16 == 0 and x.shape[0] > 0


def scaled_mm_linear(x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None = None,
                     pdl: bool | None = None) -> torch.Tensor:
    """`torch._scaled_mm` with row-wise scales: scale_a [M, 1] (a per-tensor activation scale repeated over the
    rows), scale_b [1, N] (the weight's per-row scales); x8 row-major, the weight [N, K] row-major read as its
    transpose, column-major [K, N]. Out in bfloat16 (what row-wise scaling writes), then x's dtype. Per-token
    activations of a 2-D x on a GPU are quantized by one Triton kernel (`triton_fp8.quantize_tokens`: the torch
    code is six passes over x); the GEMM accumulates with `use_fast_accum` (Hopper's fp8 tensor-core sums without
    the periodic float32 promotion, as vLLM's CUTLASS fp8 kernels run). `pdl`: the quantizer's programmatic dependent
    launch (`ops.pdl.use_pdl`)."""
    if layer.activations == "token" and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1:
        x8, sx = triton_fp8.quantize_tokens(x, layer.weight.dtype, pdl=pdl)
    else:
        x8, sx = quantize_input(x, layer.activations, layer.weight.dtype, layer.input_scale, layer.group)
    return _scaled_mm(x8, sx, layer, x.dtype, bias)


def _scaled_mm(x8: torch.Tensor, sx: torch.Tensor, layer: Fp8Linear, dtype: torch.dtype,
               bias: torch.Tensor | None) -> torch.Tensor:
    if sx.shape[0] != x8.shape[0]:
        sx = sx.expand(x8.shape[0], 1).contiguous()
    out = torch._scaled_mm(x8, layer.weight.t(), scale_a=sx, scale_b=layer.weight_scale.reshape(1, -1),
                           out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    out = out.to(dtype)
    return out if bias is None else out + bias


def w8a16_routed(rows: int, layer: Fp8Linear, w8a16: W8a16Table | None = None, gated: bool = False) -> bool:
    """Whether `rows` float rows of `layer` run W8A16 (`gpu_linear`; gated: `gpu_linear_silu_and_mul`): a per-token
    layer with per-row weight scales (`fp8.takes_rows`) in e4m3fn on an NVIDIA GPU, the W8A16 table (`w8a16`: default
    the packaged one, ops/w8a16_table.py) taking the rows and `triton_w8a16.plan` giving tiles. `Ops.w8a16` of the
    Triton bundle: the model asks it before it lets a producer quantize the rows."""
    return (takes_rows(layer) and torch.version.hip is None and layer.weight.is_cuda
            and layer.weight.dtype == torch.float8_e4m3fn
            and triton_w8a16.planned(rows, layer.weight, w8a16, gated) is not None)


def _runs_w8a16(x: torch.Tensor | HalfRows, layer: Fp8Linear, w8a16: W8a16Table | None, gated: bool = False) -> bool:
    """Whether this call of `layer` goes to the W8A16 kernel: a per-token layer with per-row scales, not on ROCm,
    that `triton_w8a16.routed` takes (`w8a16`: the table, default the packaged one)."""
    return (takes_rows(layer) and torch.version.hip is None
            and triton_w8a16.routed(x, layer.weight, layer.weight_scale, w8a16, gated))


def gpu_linear(x: torch.Tensor, layer: Fp8Linear, bias: torch.Tensor | None = None,
               pdl: bool | None = None, prefetch: int | None = None, w8a16: W8a16Table | None = None) -> torch.Tensor:
    """The fp8 linear of GPUs with fp8: block scales through our Triton kernel, per-row scales with per-token
    activations at 1-64 rows on NVIDIA through W8A16 where `triton_w8a16.routed` (the W8A16 table `w8a16`, default the
    packaged one: 0 rows on the H200), else through the skinny kernel where `triton_fp8_skinny.routed`, other per-row
    ones through `torch._scaled_mm`, shapes it cannot take (K or N not a multiple of 16) through
    `reference_linear`. `pdl`: programmatic dependent launch of the skinny kernel and the per-token quantizer
    (`ops.pdl.use_pdl`; None: where the GPU has it); `prefetch`: the skinny kernel's weight bytes pulled into L2
    before its wait (None: triton_skinny.PREFETCH_BYTES; 0: none)."""
    if _runs_w8a16(x, layer, w8a16):
        return triton_w8a16.w8a16_linear(x, layer.weight, layer.weight_scale, bias, pdl=pdl, prefetch=prefetch,
                                         table=w8a16)
    if layer.block is not None:
        x8, sx = quantize_input(x, layer.activations, layer.weight.dtype, layer.input_scale, layer.group)
        out = triton_fp8.block_linear(x8, sx, layer.weight, layer.weight_scale, layer.block, x.dtype)
        return out if bias is None else out + bias
    if (layer.activations == "token" and layer.block is None and torch.version.hip is None
            and triton_fp8_skinny.routed(x, layer.weight, layer.weight_scale)):
        return triton_fp8_skinny.skinny_fp8_linear(x, layer.weight, layer.weight_scale, bias, pdl=pdl,
                                                   prefetch=prefetch)
    if scaled_mm_ok(x, layer):
        return scaled_mm_linear(x, layer, bias, pdl=pdl)
    return reference_linear(x, layer, bias)


def gpu_linear_half(rows: HalfRows, layer: Fp8Linear, bias: torch.Tensor | None = None, pdl: bool | None = None,
                    prefetch: int | None = None, w8a16: W8a16Table | None = None) -> torch.Tensor:
    """`gpu_linear` of the rows that W8A16's `rows` hold (a producer wrote them for this projection, where
    `w8a16_routed` said so): the W8A16 kernel on them where `triton_w8a16.routed` (`w8a16` as `gpu_linear`'s), else
    `gpu_linear` of them in their own dtype (float16 to bf16 is exact up to the saturation)."""
    if _runs_w8a16(rows, layer, w8a16):
        return triton_w8a16.w8a16_linear(rows, layer.weight, layer.weight_scale, bias, pdl=pdl, prefetch=prefetch,
                                         table=w8a16)
    return gpu_linear(rows.x.to(rows.dtype), layer, bias, pdl, prefetch, w8a16)


def gpu_linear_silu_and_mul(x: torch.Tensor | HalfRows, layer: Fp8Linear, pdl: bool | None = None,
                            prefetch: int | None = None, w8a16: W8a16Table | None = None) -> HalfRows | torch.Tensor:
    """silu_and_mul of an MLP's fp8 gate|up [2I, K] product of x, for a down projection that runs W8A16: one W8A16
    launch with SiLU-and-mul in its epilogue writing `HalfRows` where `triton_w8a16.routed(gated=True)` (`w8a16` as
    `gpu_linear`'s), else `gpu_linear` then `triton_ops.silu_and_mul` (float rows, which the W8A16 down casts
    itself): the same numbers either way up to the GEMM's float32 sums. `pdl`, `prefetch` as `gpu_linear`'s."""
    if _runs_w8a16(x, layer, w8a16, gated=True):
        return triton_w8a16.w8a16_linear_silu_and_mul(x, layer.weight, layer.weight_scale, pdl=pdl,
                                                      prefetch=prefetch, table=w8a16)
    rows = x.x.to(x.dtype) if isinstance(x, HalfRows) else x
    return triton_ops.silu_and_mul(gpu_linear(rows, layer, None, pdl, prefetch, w8a16), pdl=pdl)


def gpu_linear_rows(rows: QuantizedRows, layer: Fp8Linear, bias: torch.Tensor | None = None,
                    pdl: bool | None = None, prefetch: int | None = None) -> torch.Tensor:
    """`gpu_linear` of the rows x that `rows` quantize (a fused producer's output, triton_fp8_fused), for layers that
    `takes_rows`: the same routing on the same quantized numbers, so the same kernel and the same result as
    `gpu_linear(x, layer, bias)`, without the quantizer (the skinny kernel where routed on NVIDIA, else
    `torch._scaled_mm`, else the reference); `pdl`, `prefetch` as `gpu_linear`'s. ValueError for a layer or rows
    that do not fit (`fp8.check_rows`)."""
    check_rows(rows, layer)
    if torch.version.hip is None and triton_fp8_skinny.routed_rows(rows, layer.weight, layer.weight_scale):
        return triton_fp8_skinny.skinny_fp8_linear_rows(rows, layer.weight, layer.weight_scale, bias, pdl=pdl,
                                                        prefetch=prefetch)
    if scaled_mm_ok(rows.q, layer):
        return _scaled_mm(rows.q, rows.scale, layer, rows.dtype, bias)
    return reference_linear_rows(rows, layer, bias)


def gpu_linear_sums(rows: QuantizedRows, layer: Fp8Linear, bias: torch.Tensor | None = None,
                    pdl: bool | None = None, prefetch: int | None = None) -> torch.Tensor | SplitSums:
    """`gpu_linear_rows`, except that where the skinny kernel takes the call with K split and the GPU's fold rule
    takes its rows (`fold_table.fold_for_step`), the slices' sums unreduced (`fp8.SplitSums`: no reduce launch), for
    the RMSNorm that reads them (`triton_fp8_fold.add_rms_norm_fp8_sums`); the output itself everywhere else.
    `pdl`, `prefetch` as `gpu_linear`'s."""
    check_rows(rows, layer)
    if (torch.version.hip is None and triton_fp8_skinny.routed_rows(rows, layer.weight, layer.weight_scale)
            and fold_table.fold_for_step(rows.q.shape[0], triton_fp8_skinny.device_name(rows.q.device))):
        return triton_fp8_skinny.skinny_fp8_linear_sums(rows, layer.weight, layer.weight_scale, bias, pdl=pdl,
                                                        prefetch=prefetch)
    return gpu_linear_rows(rows, layer, bias, pdl, prefetch)


__all__ = ["FAST_ACCUM", "gpu_linear", "gpu_linear_half", "gpu_linear_rows", "gpu_linear_silu_and_mul",
           "gpu_linear_sums", "scaled_mm_linear", "scaled_mm_ok", "w8a16_routed"]
