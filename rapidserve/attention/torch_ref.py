"""Reference attention backend in plain torch: runs anywhere, favours faithfulness over speed.

Layouts (see rapidserve/attention/metadata.py):

- ``k_cache`` / ``v_cache``: [num_blocks, num_kv_heads, block_size, head_dim], contiguous. Token ``t``
  of sequence ``i`` lives at block ``block_tables[i, t // block_size]``, offset ``t % block_size``.
- ``q`` (prefill): [T, num_heads, head_dim], the new tokens of all sequences laid end to end
  (``cu_seqlens_q``). ``q`` (decode): [B, num_heads, head_dim], one token per sequence.
- GQA: query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``.

Sliding-window attention (`window` W, Mistral and Gemma 3's local layers): the query at position p sees keys
p - W < t <= p (the last W tokens, itself included), as transformers' sliding-window mask.

The attention itself is torch.nn.functional.scaled_dot_product_attention on contiguous K/V gathered
from the cache, with the same arguments Hugging Face transformers' "sdpa" attention uses (``enable_gqa``
when there is no mask, ``repeat_kv`` + boolean mask otherwise), so fp32 outputs match a transformers
model as closely as possible: per sequence for prefill; decode batched with a padding mask.

The KV write is rapidserve/ops/torch_kv.py's `write_kv` (the torch backend's, attention/__init__.py). An fp8 cache
(rapidserve/ops/kv_quant.py) takes the layer's ``k_scale`` / ``v_scale``: written quantized (``kv_quant.quantize``,
by that write), read dequantized to q's dtype (``kv_quant.dequantize``) before the same attention.

These functions read lengths on the host (``.tolist()``): they are not CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rapidserve.attention.metadata import AttentionMetadata
from rapidserve.ops.fp8 import HalfRows, QuantizedRows, half_rows, quantize_rows
from rapidserve.ops.kv_quant import cache_scales, dequantize


def _tiles(cache: torch.Tensor, blocks: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """cache[blocks] (a copy), dequantized to `dtype` when the cache is fp8 (`scale`: its scale, else None)."""
    tiles = cache[blocks]
    return tiles if scale is None else dequantize(tiles, scale, dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[num_kv_heads, context_len, head_dim] contiguous copy of one sequence's keys or values (an fp8 cache's
    dequantized with `scale` to `dtype`)."""
    block_size = cache.shape[2]
    num_used = (context_len + block_size - 1) // block_size
    blocks = block_table[:num_used].to(torch.int64)
    tiles = _tiles(cache, blocks, scale, dtype)  # [num_used, Hkv, block_size, D]
    kv = tiles.permute(1, 0, 2, 3).reshape(cache.shape[1], num_used * block_size, cache.shape[3])
    return kv[:, :context_len].contiguous()


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv * n_rep, L, D], kv head j serving query heads j*n_rep .. j*n_rep+n_rep-1."""
    if n_rep == 1:
        return x
    b, h, seq, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, seq, d).reshape(b, h * n_rep, seq, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their whole sequences in the cache.

    Sequence ``i`` has ``q_len = cu_seqlens_q[i+1] - cu_seqlens_q[i]`` new tokens, which are the last
    ``q_len`` of its ``context_lens[i]`` tokens; new token ``j`` attends to keys ``0 .. prefix + j``
    with ``prefix = context_len - q_len`` (with a `window` W, only those after ``prefix + j - W``).
    Sequences with context_len 0 produce zeros. Returns [T, num_heads, head_dim] in q's dtype. An fp8 cache is
    read with `k_scale` / `v_scale`.
    """
    if meta.cu_seqlens_q is None:
        raise ValueError("prefill_attention needs meta.cu_seqlens_q (got None)")
    ks, vs = cache_scales(k_cache, k_scale, v_scale) or (None, None)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    cu = meta.cu_seqlens_q.tolist()
    ctx_lens = meta.context_lens.tolist()
    for i, ctx in enumerate(ctx_lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0 or ctx == 0:
            continue
        prefix = ctx - q_len
        if prefix < 0:
            raise ValueError(f"sequence {i}: context_len={ctx} is smaller than its q_len={q_len}")
        # [1, Hq, q_len, D], a transposed view as in transformers.
        qi = q[start:end].transpose(0, 1).unsqueeze(0)
        ki = _gather_kv(k_cache, meta.block_tables[i], ctx, ks, q.dtype).unsqueeze(0)
        vi = _gather_kv(v_cache, meta.block_tables[i], ctx, vs, q.dtype).unsqueeze(0)
        windowed = window is not None and window < ctx  # a window no shorter than the context hides nothing
        if prefix == 0 and not windowed:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=q_len > 1, scale=scale,
                                               enable_gqa=group > 1)
        else:
            rows = torch.arange(q_len, device=q.device)[:, None] + prefix
            cols = torch.arange(ctx, device=q.device)[None, :]
            mask = cols <= rows
            if windowed:
                mask &= cols > rows - window
            o = F.scaled_dot_product_attention(qi, _repeat_kv(ki, group), _repeat_kv(vi, group),
                                               attn_mask=mask[None, None], scale=scale)
        out[start:end] = o[0].transpose(0, 1)
    return out


DECODE_GROUP_TOKENS = 1 << 18  # padded context tokens per decode group: bounds the gathered K/V copy


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """One new token per sequence (q: [B, num_heads, head_dim]) attending to all its context_lens[b]
    cached tokens (with a `window` W, the last W of them). Rows with context_len 0 produce zeros.
    Returns [B, num_heads, head_dim].

    Sequences are batched (a per-sequence loop of gathers and SDPA calls cost ~30 ops per sequence and
    layer, most of a CPU decode step at batch 16 and more; batched: 1.3-3x faster at batch 4-80): in groups of
    at most DECODE_GROUP_TOKENS padded tokens, each group's K/V gathered to its longest context and the tail
    masked (a boolean mask, GQA by `enable_gqa`). A masked key adds an exact zero to the softmax, so a
    sequence's output differs from attending alone only by the reduction's rounding (~1 ulp in fp32). An fp8
    cache is read with `k_scale` / `v_scale`."""
    scales = cache_scales(k_cache, k_scale, v_scale)
    num_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads")
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lens = context_lens.tolist()
    live = [b for b, n in enumerate(lens) if n > 0]
    # longest first, so each group pads to a context near its own
    live.sort(key=lambda b: -lens[b])
    start = 0
    while start < len(live):
        longest = lens[live[start]]
        size = max(1, min(len(live) - start, DECODE_GROUP_TOKENS // longest))
        rows = torch.tensor(live[start:start + size], device=q.device)
        out[rows] = _decode_group(q[rows], k_cache, v_cache, block_tables[rows], context_lens[rows], longest,
                                  group, scale, scales, window)
        start += size
    return out


def decode_attention_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                         out_fp8: torch.dtype, window: int | None = None) -> QuantizedRows | HalfRows:
    """`decode_attention`'s output [B, num_heads * head_dim] quantized per token to `out_fp8` (`fp8.quantize_rows`:
    the reference of the Triton kernels' fused quantization, the numbers of the o projection's own quantizer), or
    with `out_fp8` float16 as W8A16's rows (`fp8.half_rows`)."""
    out = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, window)
    flat = out.reshape(out.shape[0], -1)
    return half_rows(flat) if out_fp8 == torch.float16 else quantize_rows(flat, out_fp8)


def _decode_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, longest: int, group: int, scale: float,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None) -> torch.Tensor:
    """decode_attention of rows that all have context_len >= 1, padded to `longest` (`scales`: an fp8 cache's)."""
    batch, block_size = q.shape[0], k_cache.shape[2]
    num_used = (longest + block_size - 1) // block_size
    blocks = block_tables[:, :num_used].to(torch.int64).clamp(min=0)  # a padding entry reads some block: masked

    cols, ctx = torch.arange(longest, device=q.device)[None, :], context_lens.to(q.device)[:, None]
    mask = cols < ctx  # [B, L]
    if window is not None and window < longest:
        mask &= cols >= ctx - window

    def gather(cache: torch.Tensor, cache_scale: torch.Tensor | None) -> torch.Tensor:
        tiles = _tiles(cache, blocks, cache_scale, q.dtype)  # [B, num_used, Hkv, block_size, D]
        kv = tiles.permute(0, 2, 1, 3, 4).reshape(batch, cache.shape[1], num_used * block_size, cache.shape[3])
        # what lies past a context (a stale slot, another sequence's block, NaN) is zeroed, as 0 x NaN is NaN
        # (in place: `cache[blocks]` is a copy, never the cache)
        return kv[:, :, :longest].masked_fill_(~mask[:, None, :, None], 0.0)

    ks, vs = scales or (None, None)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), gather(k_cache, ks), gather(v_cache, vs),
                                       attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=group > 1)
    return o[:, :, 0]
