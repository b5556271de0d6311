"""One decoder-only transformer for the Llama, Qwen2, Qwen3 and Mistral families (Gemma 3: gemma3.py builds on it).

The families differ only by flags of `ModelConfig`: q/k/v bias (qwen2), per-head q/k RMSNorm
(qwen3), llama3 RoPE scaling, tied embeddings, sliding-window attention (mistral: each layer's `window`, which it
passes to the attention backend). Projections are fused (qkv, gate|up) so a layer is
four GEMMs; `load_weights` maps Hugging Face parameter names onto the fused tensors. `registry.causal_lm_class`
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

Mixture-of-experts (issue 40; mixtral, qwen3_moe): a layer the config's `moe` makes sparse has a
`models/moe.py` `MoeBlock` (router and stacked experts) instead of the dense gate|up and down projections.

FP8 (issue 39; `quant`, rapidserve/quant_config.py): each fused projection the scheme quantizes is an
`ops.fp8.Fp8Linear` (fp8 weight, float32 scales) instead of a float parameter, computed by `ops.fp8_linear`;
`models/fp8_weights.py` loads its HF-named weight, scales and input scales (or quantizes float weights at load).
A projection with dynamic per-token activations and per-row weight scales gets its input already quantized by the op
that makes it (`projections.fused_fp8`: the RMSNorm before q|k|v and gate|up, the SiLU-and-mul before down, and in a
decode step the attention before o_proj: `attention.attend`'s `out_fp8`), the same numbers as its own quantizer's
without the extra launch and pass (issue 39; `ops.unfused_fp8` turns it off).
An fp8 KV cache (`kv_dtype`): each layer holds its `k_scale` / `v_scale` (float32 [1] parameters, from the config
tree, never from the weight stream; shared with the prefill worker like every parameter), which its K/V write
(`ops.rope_write`) and its attention (`attention.attend`) take (rapidserve/ops/kv_quant.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from rapidserve.attention import AttentionBackend, AttentionMetadata, attend
from rapidserve.config import ModelConfig
from rapidserve.models import fp8_weights
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
from rapidserve.models.rope import cos_sin_table
from rapidserve.ops import Ops
from rapidserve.ops.fp8 import Fp8Linear, HalfRows, QuantizedRows, SplitSums, fp8_dtype
from rapidserve.ops.kv_quant import FP8_KV_DTYPES
from rapidserve.parallel.shard import shard_config
from rapidserve.quant_config import FUSED_PROJECTIONS, QuantizationConfig

if TYPE_CHECKING:
    from rapidserve.parallel.group import TPGroup

KVCache = tuple[torch.Tensor, torch.Tensor]
class WeightError(ValueError):
    """A checkpoint tensor is missing, unexpected or of the wrong shape."""


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
