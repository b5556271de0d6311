"""One decoder layer of `CausalLM` (transformer.py), which builds its layers from `layer_class` (Gemma 3's subclass:
gemma3.py): `pre_attention` (the input norm, the fused q|k|v projection, (q/k norm,) RoPE and the K/V write into the
cache), attention over the paged cache with the layer's scale and sliding window, `post_attention` (the o projection,
the residual add and norm, the MLP; under tensor parallelism the all-reduces of o_proj's and down_proj's outputs).
Projections are fused (qkv, gate|up), so a dense layer is four GEMMs (`models/projections.py` calls them).

Mixture-of-experts (issue 40; mixtral, qwen3_moe): a layer the config's `moe` makes sparse has a
`models/moe.py` `MoeBlock` (router and stacked experts) instead of the dense gate|up and down projections.

FP8 (issue 39; `quant`, rapidserve/quant_config.py): each fused projection the scheme quantizes is an
`ops.fp8.Fp8Linear` (fp8 weight, float32 scales) instead of a float parameter, computed by `ops.fp8_linear`.
A projection with dynamic per-token activations and per-row weight scales gets its input already quantized by the op
that makes it (`projections.fused_fp8`: the RMSNorm before q|k|v and gate|up, the SiLU-and-mul before down, and in a
decode step the attention before o_proj: `attention.attend`'s `out_fp8`), the same numbers as its own quantizer's
without the extra launch and pass (issue 39; `ops.unfused_fp8` turns it off).
An fp8 KV cache (`kv_dtype`): each layer holds its `k_scale` / `v_scale` (float32 [1] parameters, from the config
tree, never from the weight stream; shared with the prefill worker like every parameter), which its K/V write
(`ops.rope_write`) and its attention (`attention.attend`) take (rapidserve/ops/kv_quant.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from rapidserve.attention import AttentionBackend, AttentionMetadata, attend
from rapidserve.config import ModelConfig
from rapidserve.models.moe import MoeBlock
from rapidserve.models.projections import (
    HALF,
    Hidden,
    Rows,
    Weight,
    attention_rows,
    fused_fp8,
    linear,
    linear_sums,
    mlp,
    norm_input,
)
from rapidserve.ops import Ops
from rapidserve.ops.fp8 import Fp8Linear, HalfRows, QuantizedRows, SplitSums, fp8_dtype
from rapidserve.quant_config import FUSED_PROJECTIONS, QuantizationConfig

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]  # a layer's (k_cache, v_cache) views of the pool


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    # Whether this class's layers may pass split-K sums between them (`forward`'s `sums_out`, read by `norm_for`):
    # `CausalLM.run_layers` asks for them only between two layers that both say so (a subclass with its own
    # pre_attention or post_attention says False).
    split_sums: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
                 quant: QuantizationConfig | None = None, index: int = 0, fp8: torch.dtype | None = None,
                 kv_scales: tuple[float, float] | None = None) -> None:
        """`cfg`: this rank's shard of the model (the whole model without `tp`). `quant`: the fp8 scheme, for layer
        `index` (its projections' HF names) in weight format `fp8` (default: the device's, `ops.fp8.fp8_dtype`).
        `kv_scales`: an fp8 KV cache's (k_scale, v_scale) for this layer, as its pool's format takes them
        (`CausalLM`), kept as float32 [1] parameters `k_scale` / `v_scale` (None: a cache of the model's dtype)."""
        super().__init__()
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        self.cfg, self.tp = cfg, tp
        self.scale, self.window = cfg.attn_scale, cfg.layer_window(index)  # attention's softmax scale, sliding window
        fp8 = fp8 or fp8_dtype(device)

        def weight(fused: str, n: int, k: int) -> Weight:
            if quant is not None and quant.quantized(f"model.layers.{index}.{FUSED_PROJECTIONS[fused][0]}"):
                return Fp8Linear(n, k, fp8, quant.activations, quant.block, device)
            return _param((n, k), dtype, device)

        self.qkv_proj = weight("qkv_proj", qkv, h)
        self.qkv_bias = _param((qkv,), dtype, device) if cfg.attention_bias else None
        self.o_proj = weight("o_proj", h, cfg.q_size)
        self.q_norm = _param((cfg.head_dim,), dtype, device) if cfg.qk_norm else None
        self.k_norm = _param((cfg.head_dim,), dtype, device) if cfg.qk_norm else None
        # a sparse layer's experts instead of the dense MLP (models/moe.py)
        self.moe = MoeBlock(cfg.moe, h, dtype, device) if cfg.moe is not None and cfg.moe.sparse(index) else None
        if self.moe is None:
            self.gate_up_proj = weight("gate_up_proj", 2 * cfg.intermediate_size, h)
            self.down_proj = weight("down_proj", h, cfg.intermediate_size)
        self.input_layernorm = _param((h,), dtype, device)
        self.post_attention_layernorm = _param((h,), dtype, device)
        self.k_scale: nn.Parameter | None = None
        self.v_scale: nn.Parameter | None = None
        if kv_scales is not None:  # the same on every tensor-parallel rank: one scale per layer's whole tensor
            self.k_scale, self.v_scale = (
                nn.Parameter(torch.full((1,), float(s), dtype=torch.float32, device=device), requires_grad=False)
                for s in kv_scales)

    def forward(
        self,
        hidden: Hidden,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
        ops: Ops,
        attn: AttentionBackend,
        sums_out: bool = False,
    ) -> tuple[Hidden, torch.Tensor]:
        """The layer: `pre_attention`, attention over the cache, `post_attention` (a piecewise prefill graph,
        rapidserve/runner/prefill_graphs.py, captures the two halves and runs attention between them). `sums_out`:
        the next layer of a class with `split_sums` reads the output (`post_attention`'s); `hidden` may be sums."""
        q, residual = self.pre_attention(hidden, residual, positions, cos_sin, kv, meta.slot_mapping, ops)
        o = self.attention(q, kv, meta, attn, fused_fp8(ops, self.o_proj, q.shape[0], q.dtype))
        if sums_out:
            return self.post_attention(o, residual, ops, sums_out=True)
        return self.post_attention(o, residual, ops)

    def attention(self, q: torch.Tensor, kv: KVCache, meta: AttentionMetadata, attn: AttentionBackend,
                  out_fp8: torch.dtype | None = None) -> torch.Tensor | QuantizedRows | HalfRows:
        """This layer's attention of its queries over the cache (its scale and sliding window; an fp8 cache read
        with the layer's scales). `out_fp8`: o_proj's format where it takes quantized rows, or float16 for W8A16's
        rows (`fused_fp8`); a decode step's output is then those rows (`attention.attend`)."""
        return attend(attn, q, kv[0], kv[1], meta, self.scale, self.k_scale, self.v_scale, window=self.window,
                      out_fp8=out_fp8)

    def pre_attention(
        self,
        hidden: Hidden,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: KVCache,
        slot_mapping: torch.Tensor,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before attention, row by row: the input norm (with the residual add), the qkv
        projection, (q/k norm,) RoPE and the K/V write into the cache at `slot_mapping` (slot -1: nothing
        written). `hidden`: the previous layer's output, or its down_proj's split-K sums (`post_attention`'s
        `sums_out`), which the input norm adds (`norm_for`). Returns (q [T, heads, head_dim], residual)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        normed, residual = self.norm_for(ops, self.qkv_proj, hidden, residual, self.input_layernorm)
        qkv = linear(ops, normed, self.qkv_proj, self.qkv_bias)
        t = qkv.shape[0]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        k_cache, v_cache = kv
        # (q/k norm,) RoPE and the K/V write in one launch on GPUs; from here on k and v are read from the cache
        q = ops.rope_write(q, k, v, self.q_norm, self.k_norm, eps, positions, cos_sin, k_cache, v_cache,
                           slot_mapping, self.k_scale, self.v_scale)
        return q, residual

    def norm_for(self, ops: Ops, w: Weight | None, hidden: Hidden, residual: torch.Tensor | None,
                 weight: torch.Tensor) -> tuple[Rows, torch.Tensor]:
        """The RMSNorm (after the residual add, unless `residual` is None: the first layer's, whose residual is
        `hidden`) whose output feeds projection `w`: quantized for it where `fused_fp8` says so. `hidden` may be a
        split-K GEMM's sums (`projections.linear_sums`): the fused norm adds them itself, any other is given them
        reduced. Returns (the normed rows, the residual stream)."""
        rows = hidden.ws.shape[1] if isinstance(hidden, SplitSums) else hidden.shape[0]
        eps, fp8 = self.cfg.rms_norm_eps, fused_fp8(ops, w, rows, hidden.dtype)
        if isinstance(hidden, SplitSums):
            if fp8 is not None and fp8 != HALF and residual is not None:
                return ops.add_rms_norm_fp8_sums(hidden, residual, weight, eps, fp8)
            hidden = norm_input(ops, hidden)
        if fp8 == HALF:  # W8A16's fp16 rows (`fused_fp8`)
            if residual is None:
                return ops.rms_norm_half(hidden, weight, eps), hidden
            return ops.add_rms_norm_half(hidden, residual, weight, eps)
        if residual is None:
            normed = ops.rms_norm(hidden, weight, eps) if fp8 is None else ops.rms_norm_fp8(hidden, weight, eps, fp8)
            return normed, hidden
        if fp8 is None:
            return ops.add_rms_norm(hidden, residual, weight, eps)
        return ops.add_rms_norm_fp8(hidden, residual, weight, eps, fp8)

    def post_attention(self, o: torch.Tensor | QuantizedRows | HalfRows, residual: torch.Tensor,
                       ops: Ops, sums_out: bool = False) -> tuple[Hidden, torch.Tensor]:
        """Everything after attention, row by row: the o projection, the residual add and norm, the MLP
        (with the tensor-parallel all-reduces). `o`: attention's output, [T, heads, head_dim] or
        [T, heads * head_dim], or those rows quantized for o_proj. Returns (hidden, residual) for the next layer;
        `sums_out` (without tensor parallelism): hidden may be down_proj's split-K sums, for the next layer's input
        norm. o_proj's own sums go to the post-attention norm (`linear_sums`; none under tensor parallelism, whose
        all-reduce needs the output, or before an MoE block's norm, which reads float rows)."""
        cfg = self.cfg
        rows = attention_rows(o, cfg.q_size)
        if self.tp is None and self.moe is None:
            hidden: Hidden = linear_sums(ops, rows, self.o_proj)
        else:
            hidden = linear(ops, rows, self.o_proj)
        if self.tp is not None:
            assert isinstance(hidden, torch.Tensor)
            self.tp.all_reduce(hidden)

        if self.moe is not None:
            assert isinstance(hidden, torch.Tensor)
            hidden, residual = ops.add_rms_norm(hidden, residual, self.post_attention_layernorm, cfg.rms_norm_eps)
            hidden = self.moe(hidden, ops)
        else:
            normed, residual = self.norm_for(ops, self.gate_up_proj, hidden, residual, self.post_attention_layernorm)
            hidden = mlp(ops, normed, self.gate_up_proj, self.down_proj, sums=sums_out and self.tp is None)
        if self.tp is not None:
            assert isinstance(hidden, torch.Tensor)
            self.tp.all_reduce(hidden)
        return hidden, residual
