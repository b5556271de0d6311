"""The preset table: name -> `ModelConfig` of real architectures (and tiny test models), no weights.

Its own module because `ModelLoadError`'s message lists the preset names (loader/source.py) while
presets.py, which draws the weights, builds on source.py.
"""

from __future__ import annotations

from rapidserve.config import ModelConfig, RopeScaling
from rapidserve.moe_config import MoeConfig

_LLAMA3 = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
               num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
               bos_token_id=128000)
_QWEN = dict(rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643)


def _gemma3_layers(n: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer_types: every `pattern`-th layer global, the others sliding (transformers' default)."""
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))


def preset_table() -> dict[str, ModelConfig]:
    """The preset table (built on each call: no module-level mutable state)."""
    c = ModelConfig
    return {
        "llama-3-8b": c(arch="llama", max_position_embeddings=8192, eos_token_ids=(128001, 128009),
                        name="llama-3-8b", **_LLAMA3),
        "llama-3.1-70b": c(arch="llama", **{**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672,
                                           "num_layers": 80, "num_heads": 64},
                           rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=8192),
                           max_position_embeddings=131072, eos_token_ids=(128001, 128008, 128009),
                           name="llama-3.1-70b"),
        "qwen3-8b": c(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True,
                      max_position_embeddings=40960, eos_token_ids=(151645,), name="qwen3-8b", **_QWEN),
        "qwen3-14b": c(arch="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
                       num_layers=40, num_heads=40, num_kv_heads=8, head_dim=128, qk_norm=True,
                       max_position_embeddings=40960, eos_token_ids=(151645,), name="qwen3-14b", **_QWEN),
        "qwen2-7b": c(arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                      num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, attention_bias=True,
                      max_position_embeddings=32768, eos_token_ids=(151645,), name="qwen2-7b", **_QWEN),
        "smollm2-135m": c(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                          rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
                          bos_token_id=1, eos_token_ids=(2,), name="smollm2-135m"),
        # Mistral-7B-v0.1 (v0.2/v0.3 have no window, v0.3 a 32768 vocabulary and rope_theta 1e6).
        "mistral-7b": c(arch="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position_embeddings=32768, sliding_window=4096, bos_token_id=1, eos_token_ids=(2,),
                        name="mistral-7b"),
        # Gemma 3 12B's text model (google/gemma-3-12b-it's text_config; its 0.4B vision tower is not served).
        "gemma3-12b": c(arch="gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_layers=48,
                        num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                        rope_scaling=RopeScaling(factor=8.0, rope_type="linear"), rope_local_theta=10000.0,
                        max_position_embeddings=131072, tie_word_embeddings=True, qk_norm=True,
                        sliding_window=1024, layer_types=_gemma3_layers(48), query_pre_attn_scalar=256.0,
                        bos_token_id=2, eos_token_ids=(1, 106), name="gemma3-12b"),
        "mixtral-8x7b": c(arch="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
                          num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
                          max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), name="mixtral-8x7b",
                          moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=14336)),
        "qwen3-30b-a3b": c(arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                           num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True,
                           max_position_embeddings=40960, eos_token_ids=(151645,), name="qwen3-30b-a3b",
                           moe=MoeConfig(num_experts=128, top_k=8, intermediate_size=768), **_QWEN),
        # Tiny models for tests: each exercises one feature of the families (the MoE ones: Mixtral's
        # renormalised top-2 of 8; Qwen3-MoE's top-4 of 16 without renormalisation and a dense layer, 1).
        "tiny-llama": c(arch="llama", vocab_size=1280, hidden_size=64, intermediate_size=160,
                        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=1024,
                        rope_scaling=RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=128),
                        bos_token_id=1, eos_token_ids=(2,), name="tiny-llama"),
        "tiny-llama-tied": c(arch="llama", vocab_size=1000, hidden_size=96, intermediate_size=192,
                             num_layers=2, num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                             rope_theta=100000.0, max_position_embeddings=2048, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_ids=(2,), name="tiny-llama-tied"),
        "tiny-qwen2": c(arch="qwen2", vocab_size=1200, hidden_size=128, intermediate_size=256,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True,
                        max_position_embeddings=2048, eos_token_ids=(2, 3), name="tiny-qwen2",
                        **{**_QWEN, "bos_token_id": 1}),
        "tiny-qwen3": c(arch="qwen3", vocab_size=1500, hidden_size=64, intermediate_size=128,
                        num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, qk_norm=True,
                        max_position_embeddings=2048, eos_token_ids=(2,), name="tiny-qwen3",
                        **{**_QWEN, "bos_token_id": 1}),
        # A window shorter than most test prompts, and odd, so that it matters and falls inside tiles and blocks.
        "tiny-mistral": c(arch="mistral", vocab_size=1100, hidden_size=64, intermediate_size=160, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                          max_position_embeddings=1024, sliding_window=13, bos_token_id=1, eos_token_ids=(2,),
                          name="tiny-mistral"),
        # Two sliding layers then a global one (sliding_window_pattern 3), head_dim != hidden / heads, a query scale
        # of its own, linear RoPE scaling on the global layer, and final logit soft-capping (Gemma 3 has none).
        "tiny-gemma3": c(arch="gemma3", vocab_size=1300, hidden_size=64, intermediate_size=128, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         rope_scaling=RopeScaling(factor=2.0, rope_type="linear"), rope_local_theta=10000.0,
                         max_position_embeddings=2048, tie_word_embeddings=True, qk_norm=True, sliding_window=11,
                         layer_types=_gemma3_layers(3, 3), query_pre_attn_scalar=24.0, final_logit_softcapping=30.0,
                         bos_token_id=2, eos_token_ids=(1,), name="tiny-gemma3"),
        "tiny-mixtral": c(arch="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=96, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1000000.0,
                          max_position_embeddings=2048, bos_token_id=1, eos_token_ids=(2,), name="tiny-mixtral",
                          moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=96)),
        "tiny-qwen3-moe": c(arch="qwen3_moe", vocab_size=1200, hidden_size=64, intermediate_size=128, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=2048,
                            eos_token_ids=(2,), name="tiny-qwen3-moe",
                            moe=MoeConfig(num_experts=16, top_k=4, intermediate_size=32, renormalize=False,
                                          dense_layers=(1,)),
                            **{**_QWEN, "bos_token_id": 1}),
    }


def list_presets() -> list[str]:
    """The preset names, in table order."""
    return list(preset_table())
