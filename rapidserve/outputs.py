"""Results of `LLM.generate` / `LLM.chat`, shaped like vLLM 0.26's (`outputs[0].token_ids`, `.text`).

Every attribute of vLLM's `RequestOutput` and `CompletionOutput` is here, so code that reads one finds it: the ones
rapidserve fills (`stop_reason`, `num_cached_tokens`...) with their values, the ones of what it does not serve (LoRA,
prompt logprobs, per-request metrics, encoder-decoder prompts, KV transfer, routed experts) as None, which is what
vLLM's LLM holds there when those are off. `logprobs` is vLLM's: per position a {token id: Logprob} dict holding the
chosen token and the top `logprobs` tokens (each `Logprob(logprob, rank, decoded_token)`: rank 1 is the most likely,
decoded_token the token's text where the output is detokenized); `top_logprobs` is rapidserve's own plainer form of
the top ones, (token id, logprob) pairs per position, and `chosen_logprobs()` the chosen tokens' log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    """vLLM's: one token's log-probability at a position, its rank among the vocabulary by it (1: the most likely)
    and its text (None when the output is not detokenized)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str  # "" when the parameters say detokenize=False
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per position, the chosen token and the top ones (vLLM's)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob) per position
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error" (e.g. its structured-output constraint failed)
    # vLLM's: the stop string, or the id of the stop token (one of stop_token_ids) that ended it; None when it ended
    # otherwise (EOS, length)
    stop_reason: int | str | None = None
    lora_request: None = None  # no LoRA adapters
    routed_experts: None = None  # routed experts are not returned

    def finished(self) -> bool:
        """vLLM's: whether it has ended."""
        return self.finish_reason is not None

    def chosen_logprobs(self) -> list[float]:
        """Each chosen token's log-probability (empty when logprobs were not asked for)."""
        if self.logprobs is None:
            return []
        return [d[t].logprob for d, t in zip(self.logprobs, self.token_ids, strict=True)]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (by its first sample)
    # vLLM's, for what rapidserve does not serve (the values vLLM's LLM holds when those are off)
    prompt_logprobs: None = None  # prompt logprobs are not computed
    metrics: None = None  # no per-request metrics (vLLM's LLM has none either unless disable_log_stats=False)
    lora_request: None = None
    encoder_prompt: None = None  # decoder-only models
    encoder_prompt_token_ids: None = None
    num_cache_creation_tokens: int | None = None  # not counted
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
