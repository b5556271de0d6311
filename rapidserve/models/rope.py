"""Rotary position embedding tables.

The inverse frequencies follow Hugging Face transformers' definitions exactly (default, "llama3" and
"linear" scaling), computed in float32, so CPU fp32 output is bit-compatible with transformers.
The table is laid out [max_positions, head_dim] float32: cos in the first head_dim/2 columns, sin in
the last head_dim/2 (the layout `rapidserve.ops.apply_rope` reads). Gemma 3 (`rope_local_theta` set) has two,
stacked [2, max_positions, head_dim]: [0] its sliding layers' (unscaled, base rope_local_theta), [1] its global
layers' (rope_theta, rope_scaling); each layer passes its own on (rapidserve/models/gemma3.py).
"""

from __future__ import annotations

import math

import torch

from rapidserve.config import ModelConfig, RopeScaling


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by `factor`, short kept, the band between blended."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def inv_freq_for(cfg: ModelConfig) -> torch.Tensor:
    inv = default_inv_freq(cfg.head_dim, cfg.rope_theta)
    if cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "linear":
        inv = inv / cfg.rope_scaling.factor
    elif cfg.rope_scaling is not None:
        inv = llama3_inv_freq(inv, cfg.rope_scaling)
    return inv


def _table(inv: torch.Tensor, max_positions: int) -> torch.Tensor:
    pos = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = pos[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def cos_sin_table(cfg: ModelConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(pos * inv_freq) | sin(pos * inv_freq); Gemma 3's two of them,
    [2, max_positions, head_dim] (local, global: the module docstring)."""
    table = _table(inv_freq_for(cfg), max_positions)
    if cfg.rope_local_theta is not None:
        table = torch.stack((_table(default_inv_freq(cfg.head_dim, cfg.rope_local_theta), max_positions), table))
    return table.to(device).contiguous()
