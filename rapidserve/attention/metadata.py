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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])
