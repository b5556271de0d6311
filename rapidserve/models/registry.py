"""Which model class computes an architecture (`ModelConfig.arch`): the one place the runner asks.

llama, qwen2, qwen3, mistral, mixtral and qwen3_moe are transformer.py's `CausalLM` (flags of the config; MoE
layers from `ModelConfig.moe`); gemma3 is gemma3.py's subclass of it.
"""

from __future__ import annotations

from rapidserve.config import ModelConfig
from rapidserve.models.gemma3 import Gemma3CausalLM
from rapidserve.models.transformer import CausalLM


def causal_lm_class(cfg: ModelConfig) -> type[CausalLM]:
    """The CausalLM (sub)class of `cfg.arch`; each takes CausalLM's constructor arguments."""
    if cfg.arch == "gemma3":
        return Gemma3CausalLM
    return CausalLM
