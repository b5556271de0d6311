"""Results of `LLM.generate` / `LLM.chat`, shaped like vLLM 0.26's (`outputs[0].token_ids`, `.text`).

Every attribute of vLLM's `RequestOutput` and `CompletionOutput` is here, so code that reads one finds it: the ones
rapidserve fills (`stop_reason`, `num_cached_tokens`...) with their values, the ones of what it does not serve (LoRA,
prompt logprobs, per-request metrics, encoder-decoder prompts, KV transfer, routed experts) as None, which is what
vLLM's LLM holds there when those are off. One difference: `logprobs` is the list of each chosen token's logprob
(and `top_logprobs` the (token id, logprob) pairs per position), not vLLM's list of {token id: Logprob} dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str  # "" when the parameters say detokenize=False
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None  # of each chosen token, when asked for
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
