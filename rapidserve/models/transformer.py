"""One decoder-only transformer for the Llama, Qwen2, Qwen3 and Mistral families (Gemma 3: gemma3.py builds on it).

The families differ only by flags of `ModelConfig`: q/k/v bias (qwen2), per-head q/k RMSNorm
(qwen3), llama3 RoPE scaling, tied embeddings, sliding-window attention (mistral: each layer's `window`, which it
passes to the attention backend). Each layer is a `layer_class` (`DecoderLayer`, decoder_layer.py: its fused
projections, qkv and gate|up, so a dense layer is four GEMMs; a sparse layer's mixture-of-experts block; its fp8
inputs); `load_weights` maps Hugging Face parameter names onto the fused tensors. `registry.causal_lm_class`
picks the model class of an architecture.

The forward pass takes a flat batch of tokens (all sequences end to end) and an
`AttentionMetadata`; the elementwise ops and the attention backend are injected (`Ops`,
`AttentionBackend`), torch reference versions on CPU and Triton kernels on GPUs.
The KV cache is not owned here: each layer receives its (k_cache, v_cache) views of the pool.

Tensor parallelism (`tp`, rapidserve/parallel): the model is built at the rank's shard of the config
(`shard_config`: its heads, KV heads, MLP features, vocabulary rows) and loads HF-named slices
(`parallel/shard.py`); the forward adds three collectives per layer pair: the row-parallel o_proj and
down_proj outputs are all-reduced, the vocabulary-parallel embedding looks up the rank's rows (others
zero) and all-reduces, and `compute_logits` gathers every rank's vocabulary slice (all ranks get the
whole [T, vocab] logits; only the leader samples).

FP8 (issue 39; `quant`, rapidserve/quant_config.py): each fused projection the scheme quantizes is an
`ops.fp8.Fp8Linear` (fp8 weight, float32 scales) instead of a float parameter, computed by `ops.fp8_linear`;
`models/fp8_weights.py` loads its HF-named weight, scales and input scales (or quantizes float weights at load).
An fp8 KV cache (`kv_dtype`): each layer keeps its `k_scale` / `v_scale` (decoder_layer.py), from the config tree
(`_kv_layer_scales`: as the pool's format takes them), never from the weight stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rapidserve.attention import AttentionBackend, AttentionMetadata
from rapidserve.config import ModelConfig
from rapidserve.models import fp8_weights
from rapidserve.models.decoder_layer import DecoderLayer, KVCache, _param
from rapidserve.models.projections import Hidden
from rapidserve.models.rope import cos_sin_table
from rapidserve.ops import Ops
from rapidserve.ops.fp8 import Fp8Linear
from rapidserve.ops.kv_quant import FP8_KV_DTYPES
from rapidserve.parallel.shard import shard_config
from rapidserve.quant_config import QuantizationConfig

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup


class WeightError(ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape."""


def _kv_layer_scales(num_layers: int, kv_dtype: torch.dtype | None,
                     kv_scales: Sequence[tuple[float, float]] | None) -> list[tuple[float, float] | None]:
    """Each layer's (k_scale, v_scale) as a pool of `kv_dtype` takes them (doubled for e4m3fnuz), or None each for
    a pool of the model's dtype."""
    if kv_dtype is None:
        if kv_scales is not None:
            raise ValueError("kv_scales are an fp8 KV cache's: give its kv_dtype")
        return [None] * num_layers
    if kv_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype}: an fp8 KV pool is one of {FP8_KV_DTYPES} (None: the model's dtype)")
    scales = list(kv_scales) if kv_scales is not None else [(1.0, 1.0)] * num_layers
    if len(scales) != num_layers:
        raise ValueError(f"{len(scales)} layers' kv scales for {num_layers} layers")
    factor = 2.0 if kv_dtype == torch.float8_e4m3fnuz else 1.0
    return [(k * factor, v * factor) for k, v in scales]


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer  # an architecture's subclass puts its own here

    def __init__(
        self,
        cfg: ModelConfig,
        ops: Ops,
        attn: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
        tp: TPGroup | None = None,
        quant: QuantizationConfig | None = None,
        fp8: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        kv_scales: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        """`cfg`: the whole model; with `tp`, this process builds and loads rank `tp.rank`'s shard. `quant`: the
        fp8 scheme (None or method "none": float weights), its weights in `fp8` (default: the device's format).
        `kv_dtype`: the KV pool's dtype when it is fp8 (None: the model's dtype), whose per-layer `kv_scales` (in
        e4m3fn units, `CacheConfig.layer_kv_scales`) each layer keeps; an e4m3fnuz pool (ROCm's gfx94x) doubles
        them, as its weights' scales (`ops.fp8.to_fnuz`): the same numbers stored, half the values' bits."""
        super().__init__()
        layer_scales = _kv_layer_scales(cfg.num_layers, kv_dtype, kv_scales)
        self.full_cfg, self.tp = cfg, tp
        if tp is not None:
            cfg = shard_config(cfg, tp.layout)
        self.cfg, self.ops, self.attn = cfg, ops, attn
        self.dtype, self.device = dtype, device
        self.quant = quant if quant is not None and quant.enabled else None
        self.embed_tokens = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.kv_dtype = kv_dtype
        self.layers = nn.ModuleList(self.layer_class(cfg, dtype, device, tp, self.quant, n, fp8, layer_scales[n])
                                    for n in range(cfg.num_layers))
        self.norm = _param((cfg.hidden_size,), dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else _param(
            (cfg.vocab_size, cfg.hidden_size), dtype, device
        )
        n = max_positions or cfg.max_position_embeddings
        self.register_buffer("cos_sin", cos_sin_table(cfg, n, device), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for every input token.

        The same three pieces a block-wise prefill calls one at a time (rapidserve/runner/prefill_task.py):
        `embed`, `run_layers` over [0, L), `final_norm`; the same operations in the same order, so a
        forward split at layer boundaries gives bit-identical hidden states."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(self.layers)} layers")
        hidden, residual = self.run_layers(self.embed(input_ids), None, positions, kv_caches, meta, 0,
                                           len(self.layers))
        return self.final_norm(hidden, residual)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden] (a collective under tensor parallelism)."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocabulary-parallel: this rank holds rows [start, start + rows); other ids look up row 0 and are
        # zeroed, and the all-reduce sums the one rank's row into every rank's hidden state.
        rows = self.cfg.vocab_size
        local = input_ids - self.tp.rank * rows
        inside = (local >= 0) & (local < rows)
        hidden = F.embedding(local.clamp(0, rows - 1), self.embed_tokens) * inside.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(hidden)

    @torch.inference_mode()
    def run_layers(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        start: int,
        end: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layers [start, end) over (hidden, residual) as the previous layer left them (residual
        None before layer 0), writing each layer's new K/V into `kv_caches[i]`; every kernel is queued
        on the current stream."""
        if not 0 <= start <= end <= len(self.layers):
            raise ValueError(f"layers [{start}, {end}) out of 0..{len(self.layers)}")
        out: Hidden = hidden
        for i in range(start, end):
            # between two layers of this call that both take them, down_proj's split-K sums unreduced (the next
            # layer's input norm adds them: ops/fold_table.py); never out of the last layer of the call
            sums = i + 1 < end and self.layers[i].split_sums and self.layers[i + 1].split_sums
            out, residual = self.layers[i](out, residual, positions, self.cos_sin, kv_caches[i], meta, self.ops,
                                           self.attn, **({"sums_out": True} if sums else {}))
        assert isinstance(out, torch.Tensor)
        return out, residual

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The final RMSNorm after the last layer: hidden states [T, hidden] for `compute_logits`."""
        if residual is None:
            raise ValueError("final_norm needs the residual of the last layer (run every layer first)")
        hidden, _ = self.ops.add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [T, vocab] (every rank gets them whole under tensor parallelism); written into `out`
        (float32 [T, vocab]) when given, as the decode graphs' shared output buffer."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = F.linear(hidden, weight)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        return logits.float() if out is None else out.copy_(logits)

    # ---- weights -------------------------------------------------------------------------
    def _targets(self) -> dict[str, tuple[torch.Tensor, int, int] | fp8_weights.Fp8Part]:
        """HF name -> (destination tensor, row offset, rows): fused tensors take slices; an fp8 projection's names
        -> where in its Fp8Linear (`fp8_weights.fp8_parts`)."""
        cfg = self.cfg
        q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        out: dict[str, tuple[torch.Tensor, int, int] | fp8_weights.Fp8Part] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, cfg.vocab_size),
            "model.norm.weight": (self.norm, 0, cfg.hidden_size),
        }
        if self.lm_head is not None:
            out["lm_head.weight"] = (self.lm_head, 0, cfg.vocab_size)
        for n, layer in enumerate(self.layers):
            p = f"model.layers.{n}."
            projections = [("self_attn.q_proj", layer.qkv_proj, 0, q), ("self_attn.k_proj", layer.qkv_proj, q, kv),
                           ("self_attn.v_proj", layer.qkv_proj, q + kv, kv),
                           ("self_attn.o_proj", layer.o_proj, 0, cfg.hidden_size)]
            if layer.moe is not None:
                out.update(layer.moe.targets(cfg.arch, n))
            else:
                projections += [("mlp.gate_proj", layer.gate_up_proj, 0, i), ("mlp.up_proj", layer.gate_up_proj, i, i),
                                ("mlp.down_proj", layer.down_proj, 0, cfg.hidden_size)]
            for proj, w, off, rows in projections:
                if isinstance(w, Fp8Linear) and self.quant is not None:
                    out.update(fp8_weights.fp8_parts(p + proj, w, off, rows, self.quant))
                else:
                    out[f"{p}{proj}.weight"] = (w, off, rows)
            if layer.qkv_bias is not None:
                out[p + "self_attn.q_proj.bias"] = (layer.qkv_bias, 0, q)
                out[p + "self_attn.k_proj.bias"] = (layer.qkv_bias, q, kv)
                out[p + "self_attn.v_proj.bias"] = (layer.qkv_bias, q + kv, kv)
            if layer.q_norm is not None and layer.k_norm is not None:
                out[p + "self_attn.q_norm.weight"] = (layer.q_norm, 0, cfg.head_dim)
                out[p + "self_attn.k_norm.weight"] = (layer.k_norm, 0, cfg.head_dim)
            out[p + "input_layernorm.weight"] = (layer.input_layernorm, 0, cfg.hidden_size)
            out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm, 0, cfg.hidden_size)
        return out

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model; every parameter must be covered exactly once."""
        targets = self._targets()
        fp8_weights.begin([m for m in self.modules() if isinstance(m, Fp8Linear)])
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in targets:
                if name == "lm_head.weight" and self.lm_head is None:
                    continue  # tied checkpoints sometimes carry a copy of the embedding
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise WeightError(f"unexpected tensor {name!r} for a {self.cfg.arch} model")
            target = targets[name]
            if isinstance(target, fp8_weights.Fp8Part):
                try:
                    fp8_weights.store(target, name, tensor, self.quant or QuantizationConfig())
                except fp8_weights.Fp8WeightError as e:
                    raise WeightError(str(e)) from None
                seen.add(name)
                continue
            dest, off, rows = target
            want = (rows, *dest.shape[1:])
            if tuple(tensor.shape) != want:
                raise WeightError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
            dest[off : off + rows].copy_(tensor, non_blocking=True)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise WeightError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}{more}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())
