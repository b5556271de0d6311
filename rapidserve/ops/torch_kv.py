"""The KV write in plain torch: the reference of the Triton `write_kv` (rapidserve/ops/triton_kv.py), the write of
the torch op bundle's `rope_write` (rapidserve/ops/torch_ops.py) and of the torch attention backend (its `write_kv`,
rapidserve/attention/__init__.py; its attention: rapidserve/attention/torch_ref.py). Runs anywhere.

Layout (see rapidserve/attention/metadata.py): ``k_cache`` / ``v_cache`` [num_blocks, num_kv_heads, block_size,
head_dim], contiguous; slot ``s`` is block ``s // block_size``, offset ``s % block_size``. An fp8 cache
(rapidserve/ops/kv_quant.py) takes the layer's ``k_scale`` / ``v_scale`` and is written quantized
(``kv_quant.quantize``).

It reads the kept slots on the host (boolean indexing): it is not CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from rapidserve.ops.kv_quant import cache_scales, quantize


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store new keys/values ([T, num_kv_heads, head_dim]) at their slots; rows with slot < 0 are skipped. An fp8
    cache stores them quantized with `k_scale` / `v_scale` (kv_quant.py)."""
    scales = cache_scales(k_cache, k_scale, v_scale)
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, num_kv_heads, head_dim]; got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries; k has {k.shape[0]} tokens")
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    slots = slots[keep]
    blocks = slots // block_size
    offsets = slots % block_size
    # Advanced indexing on dims 0 and 2 puts the token dim first: [n, num_kv_heads, head_dim].
    if scales is not None:
        k_cache[blocks, :, offsets] = quantize(k[keep], k_cache.dtype, scales[0])
        v_cache[blocks, :, offsets] = quantize(v[keep], v_cache.dtype, scales[1])
        return
    k_cache[blocks, :, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v[keep].to(v_cache.dtype)
