"""Gemma 3's text model (Gemma3ForCausalLM; the language model of Gemma3ForConditionalGeneration), on transformer.py.

What differs from the Llama-shaped layers, as transformers' modeling_gemma3 computes it:
- the token embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- every RMSNorm multiplies by (1 + weight): `load_weights` stores 1 + weight (computed in float32, rounded once
  to the model's dtype) so the shared norm ops (x_normed * weight) apply it; in float32 that is transformers' product
  exactly, in bf16 the stored weight is one rounding away from its float32 (1 + weight);
- a layer norms around both halves: input norm, attention, post-attention norm, residual add, pre-feedforward norm,
  MLP, post-feedforward norm, residual add. In the (hidden, residual) convention of transformer.py (the residual
  stream is hidden + residual) `post_attention` returns the MLP's normed output as `hidden`;
- q and k are RMSNormed per head before RoPE (ModelConfig.qk_norm, as Qwen3);
- the MLP is gelu_tanh(gate) * up (transformers' gelu_pytorch_tanh);
- the attention scale is query_pre_attn_scalar ** -0.5 (`ModelConfig.attn_scale`);
- sliding-window ("sliding_attention") layers attend to the last `sliding_window` tokens with RoPE base
  rope_local_theta; the others ("full_attention") to every token with rope_theta and rope_scaling (Gemma 3: linear,
  factor 8). The model's RoPE table holds both ([2, positions, head_dim], models/rope.py); each layer takes its own;
- the final logits are soft-capped, cap * tanh(logits / cap), when `final_logit_softcapping` is set (Gemma 3 has
  none; Gemma 2 had one). Attention logit soft-capping is refused by the loader (loader/hf_arch.py).
The K/V of every token stay in the pool for every layer (no memory saved on the sliding layers).
An fp8 KV cache (`kv_dtype`) works as in decoder_layer.py: each layer keeps its k_scale / v_scale, which the inherited
K/V write and attention take (a sliding layer's windowed attention over the fp8 cache included).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from rapidserve.attention import AttentionBackend
from rapidserve.config import ModelConfig
from rapidserve.models import fp8_weights
from rapidserve.models.decoder_layer import DecoderLayer, KVCache, _param
from rapidserve.models.projections import Rows, attention_rows, by_row_chunks, linear, row_wise
from rapidserve.models.transformer import CausalLM
from rapidserve.ops import Ops
from rapidserve.ops.fp8 import HalfRows, QuantizedRows
from rapidserve.quant_config import QuantizationConfig

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> gelu_tanh(gate) * up [..., I], as transformers' Gemma3MLP."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate.contiguous(), approximate="tanh") * up


class Gemma3DecoderLayer(DecoderLayer):
    """A Gemma 3 layer: decoder_layer.py's with norms around the MLP too, GELU-tanh, and its own RoPE table."""

    split_sums: ClassVar[bool] = False  # its own pre_attention / post_attention: no split-K sums between layers

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup | None = None,
                 quant: QuantizationConfig | None = None, index: int = 0, fp8: torch.dtype | None = None,
                 kv_scales: tuple[float, float] | None = None) -> None:
        """DecoderLayer's arguments (`kv_scales`: an fp8 KV cache's, kept as the layer's k_scale / v_scale, which
        DecoderLayer's K/V write and attention take)."""
        super().__init__(cfg, dtype, device, tp, quant, index, fp8, kv_scales)
        self.pre_feedforward_layernorm = _param((cfg.hidden_size,), dtype, device)
        self.post_feedforward_layernorm = _param((cfg.hidden_size,), dtype, device)
        self.rope_table = 0 if self.window is not None else 1  # rope.py: [0] the sliding layers', [1] the global

    def pre_attention(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      cos_sin: torch.Tensor, kv: KVCache, slot_mapping: torch.Tensor,
                      ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer's, with this layer's RoPE table of the model's two (`cos_sin` [2, positions, D])."""
        return super().pre_attention(hidden, residual, positions, cos_sin[self.rope_table], kv, slot_mapping, ops)

    def post_attention(self, o: torch.Tensor | QuantizedRows | HalfRows, residual: torch.Tensor,
                       ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """The o projection (of attention's output, or its rows quantized for an fp8 o_proj), its norm, the residual
        add and pre-feedforward norm, the GELU-tanh MLP and its norm. Returns (the MLP's normed output, the residual
        stream before it)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        hidden = linear(ops, attention_rows(o, cfg.q_size), self.o_proj)
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        hidden = ops.rms_norm(hidden, self.post_attention_layernorm, eps)
        # the pre-feedforward norm quantizes its rows for an fp8 gate|up as DecoderLayer's does (`fused_fp8`); the
        # GELU-tanh product has no fused quantizer, so down takes float rows
        normed, residual = self.norm_for(ops, self.gate_up_proj, hidden, residual, self.pre_feedforward_layernorm)
        gate_up, down = self.gate_up_proj, self.down_proj

        def ffn(rows: Rows) -> torch.Tensor:
            return linear(ops, gelu_tanh_and_mul(linear(ops, rows, gate_up)), down)

        # by row slices past MLP_ROW_CHUNK rows (projections.by_row_chunks), as DecoderLayer's MLP
        hidden = by_row_chunks(normed, ffn) if row_wise(gate_up) and row_wise(down) else ffn(normed)
        if self.tp is not None:
            self.tp.all_reduce(hidden)
        return ops.rms_norm(hidden, self.post_feedforward_layernorm, eps), residual


class Gemma3CausalLM(CausalLM):
    """Gemma 3's text model: scaled embeddings, Gemma3DecoderLayers, (1 + weight) norms, soft-capped logits."""

    layer_class = Gemma3DecoderLayer

    def __init__(self, cfg: ModelConfig, ops: Ops, attn: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None, tp: TPGroup | None = None, quant: QuantizationConfig | None = None,
                 fp8: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
                 kv_scales: Sequence[tuple[float, float]] | None = None) -> None:
        """CausalLM's arguments, an fp8 KV cache's `kv_dtype` and per-layer `kv_scales` included."""
        super().__init__(cfg, ops, attn, dtype, device, max_positions, tp, quant, fp8, kv_dtype, kv_scales)
        # transformers: a float32 tensor of sqrt(hidden) cast to the weights' dtype (3840: 61.968 -> 62.0 in bf16)
        self.embed_scale = float(torch.tensor(self.cfg.hidden_size**0.5).to(self.dtype))

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.embed_scale

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, out)
        cap = self.cfg.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap if out is None else out.copy_(torch.tanh(logits / cap) * cap)

    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int] | fp8_weights.Fp8Part]:
        out = super()._targets()
        h = self.cfg.hidden_size
        for n, layer in enumerate(self.layers):
            assert isinstance(layer, Gemma3DecoderLayer)
            out[f"model.layers.{n}.pre_feedforward_layernorm.weight"] = (layer.pre_feedforward_layernorm, 0, h)
            out[f"model.layers.{n}.post_feedforward_layernorm.weight"] = (layer.post_feedforward_layernorm, 0, h)
        return out

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """CausalLM's, each RMSNorm's weight w stored as 1 + w (the module docstring)."""
        super().load_weights(_norms_plus_one(weights))


def _norms_plus_one(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, (1.0 + tensor.float() if name.endswith("norm.weight") else tensor)
