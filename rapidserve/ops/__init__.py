"""Elementwise and normalisation ops of the decoder layers, in a torch and a Triton flavour.

``get_ops(device)`` returns an ``Ops`` bundle: the fused Triton kernels on CUDA/ROCm GPUs, the torch
reference (numerically identical to transformers) elsewhere. Signatures:

- ``rms_norm(x [..., N], weight [N], eps) -> [..., N]``
- ``add_rms_norm(x, residual, weight, eps) -> (rms_norm(residual + x), residual + x)``
- ``apply_rope(q [T, Hq, D], k [T, Hkv, D], positions [T], cos_sin_cache [max_pos, D] fp32) -> (q, k)``;
  the torch version returns new tensors, the Triton version rotates in place and returns its inputs,
  so callers must use the returned tensors and must not rely on the inputs being preserved.
- ``qk_norm_rope(q, k, q_weight [D], k_weight [D], eps, positions, cos_sin_cache) -> (q, k)``: Qwen3's
  per-head q/k RMSNorm then RoPE (the Triton version in one launch, in place, like apply_rope)
- ``silu_and_mul(x [..., 2I]) -> [..., I]``

Triton is imported only when the Triton ops are requested.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rapidserve.ops import torch_ops


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    apply_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                         tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    qk_norm_rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor,
                            torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def torch_ops_bundle() -> Ops:
    return Ops("torch", torch_ops.rms_norm, torch_ops.add_rms_norm, torch_ops.apply_rope,
               torch_ops.silu_and_mul, torch_ops.qk_norm_rope)


def triton_ops_bundle() -> Ops:
    from rapidserve.ops import triton_ops

    return Ops("triton", triton_ops.rms_norm, triton_ops.add_rms_norm, triton_ops.apply_rope,
               triton_ops.silu_and_mul, triton_ops.qk_norm_rope)


def get_ops(device: torch.device | str) -> Ops:
    """Triton ops on CUDA / ROCm devices (ROCm torch calls them "cuda"), torch ops otherwise."""
    if torch.device(device).type == "cuda":
        return triton_ops_bundle()
    return torch_ops_bundle()


__all__ = ["Ops", "get_ops", "torch_ops_bundle", "triton_ops_bundle"]
