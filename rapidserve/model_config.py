"""The model section of the config tree: `ModelConfig` (a decoder-only transformer's architecture) and its
`RopeScaling`, with the checks that need only the model (`tp_problem`, `max_model_len_problem`).

Plain data; `rapidserve.config` re-exports every name here. Imports only the config layer (config_base, moe_config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from rapidserve.config_base import check as _check
from rapidserve.config_base import divisors
from rapidserve.moe_config import MoeConfig

Arch = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe"]
ARCHES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "mixtral", "qwen3_moe")
# A layer's attention (ModelConfig.layer_types, transformers' names): over every earlier token, or the last
# ModelConfig.sliding_window of them.
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
ROPE_TYPES: tuple[str, ...] = ("llama3", "linear")
# Read once where a run starts (the CLI, `LLM`; config_builder.allow_long_max_model_len), never below: it becomes
# SchedulerConfig.allow_long_max_model_len (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
ALLOW_LONG_MAX_MODEL_LEN_ENV = "RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama 3.1's "llama3" (every field), or "linear" (every frequency divided by `factor`;
    Gemma 3's global layers). The rope types of ROPE_TYPES are supported."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self) -> None:
        _check(self.rope_type in ROPE_TYPES,
               f"rope_scaling.rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        _check(self.factor >= 1.0, f"rope_scaling.factor={self.factor} must be >= 1")
        _check(self.high_freq_factor > self.low_freq_factor,
               "rope_scaling.high_freq_factor must be greater than low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer. One set of layers serves these families:

    - llama: Llama 2/3/3.1 (optionally llama3 RoPE scaling), SmolLM2
    - qwen2: q/k/v projections carry a bias
    - qwen3: per-head RMSNorm on q and k before RoPE
    - mistral: Llama's layers, attention over the last `sliding_window` tokens when that is set
    - gemma3: Gemma 3's text model (rapidserve/models/gemma3.py): scaled embeddings, (1 + weight) RMSNorms around
      attention and the MLP, q/k norms, GELU-tanh MLP, sliding-window local layers and global layers
      (`layer_types`) with RoPE bases of their own, `query_pre_attn_scalar`, optional final logit soft-capping
    - mixtral, qwen3_moe: Llama / Qwen3 attention with mixture-of-experts MLPs (`moe`, rapidserve/moe_config.py)
    """

    arch: Arch
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # Sliding-window attention: a query attends to the last `sliding_window` tokens, itself included, in the layers
    # `layer_types` (one of LAYER_TYPES per layer) marks "sliding_attention"; in every layer when it is () (Mistral).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3: the attention scale is query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); its sliding layers'
    # RoPE base (their RoPE is unscaled; rope_theta and rope_scaling are the global layers'); the final logits'
    # tanh soft-cap (None: none).
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    moe: MoeConfig | None = None  # the experts of mixtral / qwen3_moe (None: every MLP dense)

    def __post_init__(self) -> None:
        _check(self.arch in ARCHES, f"model arch={self.arch!r} is not supported; supported: {list(ARCHES)}")
        _check((self.moe is not None) == (self.arch in ("mixtral", "qwen3_moe")),
               f"model arch={self.arch!r} {'needs' if self.moe is None else 'takes no'} moe section")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            _check(isinstance(v, int) and v > 0, f"model {f}={v!r} must be a positive integer")
        _check(self.num_heads % self.num_kv_heads == 0,
               f"model num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        _check(self.rms_norm_eps > 0, f"model rms_norm_eps={self.rms_norm_eps} must be > 0")
        _check(self.sliding_window is None or (isinstance(self.sliding_window, int) and self.sliding_window > 0),
               f"model sliding_window={self.sliding_window!r} must be a positive integer or unset (no window)")
        _check(not self.layer_types or (len(self.layer_types) == self.num_layers
                                        and all(t in LAYER_TYPES for t in self.layer_types)),
               f"model layer_types={list(self.layer_types)} must give one of {list(LAYER_TYPES)} for each of the "
               f"{self.num_layers} layers, or be empty")
        _check("sliding_attention" not in self.layer_types or self.sliding_window is not None,
               "model layer_types has sliding_attention layers but sliding_window is unset: give the window")
        for f in ("query_pre_attn_scalar", "rope_local_theta", "final_logit_softcapping"):
            v = getattr(self, f)
            _check(v is None or v > 0, f"model {f}={v!r} must be > 0 or unset")
        _check((self.arch == "gemma3") == (self.rope_local_theta is not None),
               f"model rope_local_theta={self.rope_local_theta!r} is Gemma 3's (arch gemma3) and needed there")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        """The attention softmax's scale of q.k."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`'s attention (None: it attends to every earlier token)."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def num_params(self) -> int:
        """Parameter count (embedding and lm_head counted once each; once in total when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + (4 if self.arch == "gemma3" else 2) * h  # Gemma 3: norms before and after both
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        if self.moe is not None:  # sparse layers: experts and router instead of the dense MLP
            return self.num_layers * layer + self.moe.num_sparse(self.num_layers) * (
                self.moe.layer_params(h) - 3 * h * i) + emb + h
        return self.num_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.num_layers * 2 * self.kv_size * dtype_bytes

    def replace(self, **kw: object) -> ModelConfig:
        return dataclasses.replace(self, **kw)

    def tp_problem(self, tp: int, flag: str = "--tensor-parallel-size") -> str | None:
        """Why this model cannot be split over `tp` tensor-parallel ranks (None: it can). Attention heads and
        MLP features must divide; KV heads must divide, or (fewer KV heads than ranks) divide tp. `flag`: the
        flag the message names (disagg's prefill side: --prefill-tensor-parallel-size)."""
        if tp < 1:
            return f"{flag} {tp} must be >= 1"
        if self.num_heads % tp:
            return (f"{flag} {tp} must divide the model's {self.num_heads} attention heads; "
                    f"use one of {divisors(self.num_heads)}")
        if self.intermediate_size % tp:
            return f"{flag} {tp} must divide the MLP's {self.intermediate_size} features"
        if self.moe is not None and self.moe.intermediate_size % tp:
            return (f"{flag} {tp} must divide each expert's {self.moe.intermediate_size} features "
                    "(every rank holds a slice of every expert)")
        if self.num_kv_heads >= tp and self.num_kv_heads % tp:
            return (f"{flag} {tp} must divide the model's {self.num_kv_heads} KV heads, or be a "
                    f"multiple of them; use one of {divisors(self.num_kv_heads)}")
        if self.num_kv_heads < tp and tp % self.num_kv_heads:
            return (f"{flag} {tp} is more than the model's {self.num_kv_heads} KV heads and not "
                    "a multiple of them: each KV head must be replicated on a whole number of ranks")
        return None

    def max_model_len_problem(self, max_model_len: int | None, allow_long: bool) -> str | None:
        """Why `max_model_len` cannot be used with this model (None: it can), as vLLM decides: not above
        max_position_embeddings (the positions it was trained on; the RoPE table and the KV pool are sized by
        max_model_len) unless `allow_long` (RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN=1)."""
        limit = self.max_position_embeddings
        if max_model_len is None or max_model_len <= limit or allow_long:
            return None
        return (f"--max-model-len {max_model_len} is more than the model's max_position_embeddings={limit} "
                f"({self.name}): it was not trained on positions past {limit}. Lower --max-model-len to at most "
                f"{limit} (or leave it out: it defaults to {limit}), or set the environment variable "
                f"{ALLOW_LONG_MAX_MODEL_LEN_ENV}=1 to allow it anyway (as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN; "
                f"outputs past position {limit} may be garbage)")

