"""vLLM's prompt-truncation fields of a request body: `truncate_prompt_tokens` and `truncation_side`.

- `truncate_prompt_tokens` k >= 1: a prompt (a chat's rendered prompt too) longer than k tokens keeps k of them;
  -1: as many as fit beside the requested max tokens (at least one generated token), vLLM's "the model's limit";
  0 (an empty prompt in vLLM, which then fails) is a 400 naming it;
- `truncation_side`: "left" (the default, vLLM's for generation) keeps the last tokens, "right" the first.
Pure; a 400 naming the field otherwise.
"""

from __future__ import annotations

from rapidserve.prompt import Side, truncated
from rapidserve.server.errors import bad_request
from rapidserve.server.schemas import ChatCompletionRequest, GenerateRequest, RequestBody

__all__ = ["Side", "asked_max_tokens", "truncated", "truncation"]


def asked_max_tokens(r: RequestBody) -> tuple[str, int | None]:
    """The field that asks for the max tokens and its value, by the field that wins: a chat's max_completion_tokens,
    then max_tokens, then /generate's max_new_tokens (value None: the request asks for none)."""
    if isinstance(r, ChatCompletionRequest) and r.max_completion_tokens is not None:
        return "max_completion_tokens", r.max_completion_tokens
    if isinstance(r, GenerateRequest) and r.max_tokens is None and r.max_new_tokens is not None:
        return "max_new_tokens", r.max_new_tokens
    return "max_tokens", r.max_tokens


def truncation(r: RequestBody, max_model_len: int) -> tuple[int | None, Side]:
    """How many prompt tokens `r` keeps (None: all) and from which side ("left": the last ones)."""
    side: Side = r.truncation_side or "left"
    k = r.truncate_prompt_tokens
    if k == 0:
        raise bad_request("truncate_prompt_tokens", "'truncate_prompt_tokens' 0 would leave no prompt: give an "
                                                    "integer >= 1, or -1 for as many as fit")
    if k == -1:
        k = max(1, max_model_len - (asked_max_tokens(r)[1] or 1))
    if r.truncation_side is not None and k is None:
        raise bad_request("truncation_side", "'truncation_side' says which end 'truncate_prompt_tokens' cuts: give "
                                             "that too, or leave truncation_side out")
    return k, side

