"""What one forward pass tells the attention layers about the batch.

KV pool layout (see rapidserve/kv_pool.py): for each layer, `k_cache` and `v_cache` are views of
shape [num_blocks, num_kv_heads, block_size, head_dim], contiguous, so one (block, head) tile of
block_size x head_dim elements is one contiguous run of memory. Token `t` of a sequence lives in
block `block_tables[seq, t // block_size]` at offset `t % block_size`; its flat "slot" is
`block * block_size + offset`.

A forward pass is either a prefill (each sequence contributes q_len >= 1 new tokens, after
`context_len - q_len` tokens that are already in the cache: a cached prefix or earlier chunks), or a
decode (each sequence contributes exactly one token). The new tokens' K/V are written into the
cache first (at `slot_mapping`), then attention reads every key of the sequence from the cache.
Rows padded in for a CUDA graph have slot -1 (nothing is written) and context_len 0 (output 0).

A mixed step (hybrid batching: running decodes plus prompt chunks in one pass) is a prefill whose
first `num_decode_seqs` sequences add exactly one token each. Those rows go through the decode kernel
(one query row per sequence) and `prefill_part` describes the remaining sequences for the prefill
kernel, with `cu_seqlens_q` rebased to start at 0; see `rapidserve.attention.attend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # (rapidserve.ops imports this package's modules as it loads)
    from rapidserve.ops.fp8 import HalfRows, QuantizedRows


@dataclass
class AttentionMetadata:
    is_prefill: bool
    # [T] int64: cache slot of each new token, -1 for padding rows (not written).
    slot_mapping: torch.Tensor
    # [B, max_blocks_per_seq] int32: physical block ids of each sequence, in token order.
    block_tables: torch.Tensor
    # [B] int32: tokens of the sequence in the cache once this step's tokens are written.
    context_lens: torch.Tensor
    # Prefill only: [B + 1] int32 prefix sums of the new-token counts (q_len) per sequence.
    cu_seqlens_q: torch.Tensor | None = None
    # Host-side maxima, for kernel grid sizing (prefill) and reference paths.
    max_seqlen_q: int = 1
    max_context_len: int = 0
    # Mixed steps only: leading one-token sequences served by decode_attention, and the rest.
    num_decode_seqs: int = 0
    prefill_part: AttentionMetadata | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


def split_decode_rows(meta: AttentionMetadata, q_lens: Sequence[int]) -> AttentionMetadata:
    """Mark a prefill batch's leading one-token sequences (a mixed step's decodes) for the decode
    kernel: sets num_decode_seqs and, when longer sequences follow, prefill_part (device slices of
    meta, cu_seqlens_q rebased to 0; nothing is read back from the device). q_lens: host copy."""
    if not meta.is_prefill or meta.cu_seqlens_q is None:
        raise ValueError("split_decode_rows needs prefill metadata with cu_seqlens_q")
    nd = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    if nd == 0:
        return meta
    part = None
    if nd < len(q_lens):
        part = AttentionMetadata(
            is_prefill=True, slot_mapping=meta.slot_mapping[nd:], block_tables=meta.block_tables[nd:],
            context_lens=meta.context_lens[nd:], cu_seqlens_q=meta.cu_seqlens_q[nd:] - nd,
            max_seqlen_q=max(q_lens[nd:]), max_context_len=meta.max_context_len)
    return replace(meta, num_decode_seqs=nd, prefill_part=part)


Scale = torch.Tensor | None  # an fp8 cache's per-layer scale, float32 [1] (None: a cache of the model's dtype)


class WriteKV(Protocol):
    """A backend's `write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)`."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: Scale = None, v_scale: Scale = None, /) -> None: ...


class PrefillAttention(Protocol):
    """A backend's `prefill_attention(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, window=None)`
    (rapidserve/attention): `k_scale` / `v_scale` an fp8 cache's scales; `window` W (a sliding-window layer) limits
    each query to the last W keys, itself included."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, k_scale: Scale = None, v_scale: Scale = None, /, *,
                 window: int | None = None) -> torch.Tensor: ...


class DecodeAttentionFp8(Protocol):
    """A backend's `decode_attention_fp8(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None,
    v_scale=None, *, out_fp8, window=None)`: `decode_attention`'s output [B, heads * head_dim] quantized per token to
    `out_fp8` for an fp8 o projection (`ops.fp8.QuantizedRows`, the numbers of `fp8.quantize_rows` of that output), or
    with `out_fp8` float16 W8A16's rows (`ops.fp8.HalfRows`, `fp8.half_rows` of it; or the float output [B, heads *
    head_dim] where the backend writes none)."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: Scale = None, v_scale: Scale = None, /, *,
                 out_fp8: torch.dtype, window: int | None = None) -> QuantizedRows | HalfRows | torch.Tensor: ...


class DecodeAttention(Protocol):
    """A backend's `decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None,
    v_scale=None, window=None)`."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, k_scale: Scale = None, v_scale: Scale = None, /, *,
                 window: int | None = None) -> torch.Tensor: ...
