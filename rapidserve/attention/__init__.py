"""Paged attention backends: a torch reference (any device) and Triton kernels (CUDA / ROCm).

Every backend offers the same three functions (layouts in rapidserve/attention/metadata.py):

- ``write_kv(k, v, k_cache, v_cache, slot_mapping) -> None``
- ``prefill_attention(q, k_cache, v_cache, meta, scale) -> Tensor [T, num_heads, head_dim]``
- ``decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
  -> Tensor [B, num_heads, head_dim]``

`attend` dispatches one layer's attention: decode, prefill, or a mixed step split between the two
kernels (decode rows first).

Triton is imported only when the Triton backend is requested, so CPU installs need not have it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rapidserve.attention.metadata import AttentionMetadata, split_decode_rows
from rapidserve.config import ConfigError

BACKEND_NAMES: tuple[str, ...] = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """The three attention entry points of one implementation.

    ``graph_safe`` says whether write_kv/decode_attention may be captured in a CUDA graph (they
    read no device values on the host).
    """

    name: str
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    prefill_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float],
                                torch.Tensor]
    decode_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                               torch.Tensor]
    graph_safe: bool = False


def _is_gpu(device: torch.device) -> bool:
    # ROCm builds of torch also report their GPUs as "cuda" devices.
    return device.type == "cuda"


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Pick the attention implementation: "auto" (Triton on CUDA/ROCm GPUs, torch on CPU), "torch"
    or "triton" (GPU only). Raises ConfigError for an unknown name or Triton without a GPU."""
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ConfigError(f"attention_backend={name!r} is not supported; use one of {list(BACKEND_NAMES)}")
    if name == "auto":
        name = "triton" if _is_gpu(device) else "torch"
    if name == "triton":
        if not _is_gpu(device):
            raise ConfigError(f"attention_backend='triton' needs a CUDA or ROCm GPU, but the device is "
                              f"{str(device)!r}; use attention_backend='torch' or 'auto' on CPU")
        try:
            from rapidserve.attention import triton_paged
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ConfigError(f"attention_backend='triton' needs the triton package, which failed to "
                              f"import ({e}); install triton or use attention_backend='torch'") from e
        return AttentionBackend("triton", triton_paged.write_kv, triton_paged.prefill_attention,
                                triton_paged.decode_attention, graph_safe=True)
    from rapidserve.attention import torch_ref
    return AttentionBackend("torch", torch_ref.write_kv, torch_ref.prefill_attention,
                            torch_ref.decode_attention, graph_safe=False)


def attend(attn: AttentionBackend, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of this step's queries (keys and values already written to the cache).

    A mixed step's leading decode rows use the decode kernel: the prefill kernel would give each of
    them a whole query tile (one useful row of BLOCK_M) and recompute a tile of work per key block."""
    if not meta.is_prefill:
        return attn.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    nd = meta.num_decode_seqs
    if nd == 0:
        return attn.prefill_attention(q, k_cache, v_cache, meta, scale)
    decoded = attn.decode_attention(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd],
                                    scale)
    if meta.prefill_part is None:  # every sequence adds one token
        return decoded
    rest = attn.prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_part, scale)
    return torch.cat([decoded, rest])


__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "attend", "get_attention_backend",
           "split_decode_rows"]
