"""Results of `LLM.generate`, shaped like vLLM's (`outputs[0].token_ids`, `.text`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[float] | None = None  # of each chosen token, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None  # (token id, logprob) per position
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why, when finish_reason is "error" (e.g. its structured-output constraint failed)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (by its first sample)
