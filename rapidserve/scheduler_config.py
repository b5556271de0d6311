"""The scheduler section of the config tree: `SchedulerConfig` (continuous batching limits, max_model_len).

Plain data; `rapidserve.config` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidserve.config_base import check as _check


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # rapid mode's prefill worker: a batch stops taking more whole prompts once it holds this many
    # tokens (None: only max_num_batched_tokens bounds it). Smaller batches answer the prompts of a
    # queue one batch sooner each (TTFT) once a forward is big enough to keep the GPU's GEMMs busy.
    prefill_batch_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # --max-model-len auto / -1 (vLLM 0.26's): the model's length where the KV pool holds one sequence of it, else
    # what the pool holds (runner/kv_sizing.py sizes the pool without the one-sequence check and says so at start;
    # every path caps a request's context at the pool, `PromptLimits.context_cap`; the server reports that length)
    fit_max_model_len: bool = False
    # A max_model_len above the model's max_position_embeddings is refused unless this is set (from
    # $RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN at the CLI / `LLM`; EngineConfig checks it).
    allow_long_max_model_len: bool = False
    # The decode worker (every mode: its one step loop) plans and launches the next step before the last
    # one's tokens reach the host (as vLLM's --async-scheduling); False: each step is recorded first.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check(self.max_num_seqs > 0, f"max_num_seqs={self.max_num_seqs} must be > 0")
        _check(self.max_num_batched_tokens > 0,
               f"max_num_batched_tokens={self.max_num_batched_tokens} must be > 0")
        _check(self.prefill_batch_tokens is None or 0 < self.prefill_batch_tokens <= self.max_num_batched_tokens,
               f"prefill_batch_tokens={self.prefill_batch_tokens} must be between 1 and max_num_batched_tokens="
               f"{self.max_num_batched_tokens}, or unset for max_num_batched_tokens")
        _check(self.max_model_len is None or self.max_model_len > 0,
               f"max_model_len={self.max_model_len} must be a positive integer, or unset for the model's "
               "max_position_embeddings")
        _check(not (self.fit_max_model_len and self.max_model_len is not None),
               f"max_model_len={self.max_model_len} with fit_max_model_len: give one (auto fits the model's length "
               "to the KV pool)")

