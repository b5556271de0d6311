"""Reference elementwise / normalisation ops in plain torch.

Each op performs the same operations, in the same order and dtypes, as Hugging Face transformers'
Llama / Qwen modelling code, so results are bit-identical to transformers in the same dtype.
All return new tensors and leave their inputs untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rapidserve.ops.fp8 import (
    Fp8Linear,
    HalfRows,
    QuantizedRows,
    SplitSums,
    half_rows,
    quantize_rows,
    reduce_sums_reference,
    reference_linear_half,
)
from rapidserve.ops.torch_kv import write_kv as torch_write_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (x [..., N], weight [N]), as transformers' LlamaRMSNorm."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the residual add of a decoder layer, then its norm."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps), new_residual


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / "rotate_half" rotary embedding, as transformers' apply_rotary_pos_emb.

    q [T, num_heads, D], k [T, num_kv_heads, D], positions [T] (int), cos_sin_cache [max_pos, D]
    float32 with cos in the first D/2 columns and sin in the last D/2. cos/sin are cast to q's dtype
    first, then ``x * cos + rotate_half(x) * sin``. Returns new tensors.
    """
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions]  # [T, D]
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1).to(q.dtype).unsqueeze(1)
    q_out = (q * cos) + (_rotate_half(q) * sin)
    k_out = (k * cos) + (_rotate_half(k) * sin)
    return q_out, k_out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k, then RoPE (transformers' order). Returns new tensors."""
    return apply_rope(rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), positions, cos_sin_cache)


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
               k_weight: torch.Tensor | None, eps: float, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """(q/k RMSNorm when the weights are given,) RoPE, then k and v written to their cache slots
    (`torch_kv.write_kv`, the torch attention backend's write too: an fp8 cache quantized with `k_scale` /
    `v_scale`). Returns the rotated q, a new tensor."""
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope_write takes both q/k norm weights or neither")
    if q_weight is not None and k_weight is not None:
        q, k = qk_norm_rope(q, k, q_weight, k_weight, eps, positions, cos_sin_cache)
    else:
        q, k = apply_rope(q, k, positions, cos_sin_cache)
    torch_write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): torch's F.linear."""
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)): an MLP's gate|up projection and its activation."""
    return silu_and_mul(F.linear(x, weight))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> silu(gate) * up [..., I], as transformers' LlamaMLP."""
    gate, up = x.chunk(2, dim=-1)
    # transformers applies silu to the contiguous output of gate_proj; on CPU silu's vectorised and
    # strided paths can differ in the last bit, so take the same (contiguous) path.
    return F.silu(gate.contiguous()) * up


# The fused producers of fp8 projections' inputs (issue 39), here as their definition: the op, then its rows
# quantized per token (`fp8.quantize_rows`). The Triton bundle's (ops/triton_fp8_fused.py) do both in one launch.
def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8: torch.dtype) -> QuantizedRows:
    """rms_norm(x [M, N]) quantized per token to `fp8`."""
    return quantize_rows(rms_norm(x, weight, eps), fp8)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     fp8: torch.dtype) -> tuple[QuantizedRows, torch.Tensor]:
    """add_rms_norm's (normed rows quantized per token to `fp8`, residual + x)."""
    normed, new_residual = add_rms_norm(x, residual, weight, eps)
    return quantize_rows(normed, fp8), new_residual


def add_rms_norm_fp8_sums(sums: SplitSums, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          fp8: torch.dtype) -> tuple[QuantizedRows, torch.Tensor]:
    """`add_rms_norm_fp8` of the x that a split-K GEMM's unreduced sums stand for (`fp8.reduce_sums_reference`)."""
    return add_rms_norm_fp8(reduce_sums_reference(sums), residual, weight, eps, fp8)


def silu_and_mul_fp8(x: torch.Tensor, fp8: torch.dtype) -> QuantizedRows:
    """silu_and_mul(x [M, 2I]) quantized per token to `fp8`."""
    return quantize_rows(silu_and_mul(x), fp8)


def no_w8a16(rows: int, layer: Fp8Linear) -> bool:
    """`Ops.w8a16` of bundles that never run W8A16 (the torch bundle; ops/triton_w8a16.py is NVIDIA's): False."""
    return False


def fp8_linear_silu_and_mul(x: torch.Tensor | HalfRows, layer: Fp8Linear) -> HalfRows:
    """silu_and_mul of the W8A16 product of rows x with an fp8 gate|up (`fp8.reference_linear_half`), as `HalfRows`
    for a W8A16 down: the reference of `fp8_gpu.gpu_linear_silu_and_mul` where it runs W8A16."""
    return half_rows(silu_and_mul(reference_linear_half(x, layer)))


def rms_norm_half(x: torch.Tensor, weight: torch.Tensor, eps: float) -> HalfRows:
    """rms_norm(x) as W8A16's rows (`fp8.half_rows`)."""
    return half_rows(rms_norm(x, weight, eps))


def add_rms_norm_half(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[HalfRows, torch.Tensor]:
    """add_rms_norm's (normed rows as W8A16's rows, residual + x)."""
    normed, res = add_rms_norm(x, residual, weight, eps)
    return half_rows(normed), res
