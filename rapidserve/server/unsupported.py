"""vLLM's request fields that ask for what this server does not do: refused with a 400 naming the field.

Users come from vLLM, so every field vLLM takes is declared in schemas.py; the ones this server does not
serve are accepted only while they ask for nothing (null, or vLLM's default), and refused by name
otherwise, never ignored. `IDLE` lists them with the values that ask for nothing and why the rest is
refused; `refuse_unsupported` checks a request against it and against the fields whose refusal depends
on others (`best_of` against `n`). Pure; no model, no server state.
"""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

from rapidserve.server.errors import bad_request
from rapidserve.server.schemas import ChatCompletionRequest, CompletionRequest, RequestBody

# field -> (the values that ask for nothing, besides null; why any other is refused)
IDLE: MappingProxyType[str, tuple[tuple[Any, ...], str]] = MappingProxyType({
    "use_beam_search": ((False,), "it samples; beam search is not implemented"),
    "prompt_logprobs": ((), "the logprobs of prompt tokens are not computed"),
    "suffix": (("",), "a completion is never followed by a suffix"),
    "priority": ((0,), "requests are served in arrival order (vLLM's fcfs policy, where any other priority is an "
                       "error too)"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them"),
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text"),
    "logits_processors": (([],), "no custom logits processors are loaded (vLLM refuses them too without "
                                 "--logits-processor-pattern)"),
    "cache_salt": ((), "the prefix cache is not salted per request"),
    "kv_transfer_params": (({},), "KV is never transferred between servers"),
    "vllm_xargs": (({},), "no extensions read extra arguments"),
    "mm_processor_kwargs": (({},), "the models served here take text only"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "guided_decoding_backend": ((), "the one grammar engine is llguidance"),
    "guided_whitespace_pattern": ((), "JSON whitespace follows the grammar engine's default"),
    "structural_tag": ((), "structural tags are not supported; use structured_outputs, response_format or tools"),
})
CHAT_IDLE: MappingProxyType[str, tuple[tuple[Any, ...], str]] = MappingProxyType({  # chat's own (completions echo)
    "echo": ((False,), "a chat answer is never prefixed with the last message"),
    "thinking_token_budget": ((), "no cap on reasoning tokens is enforced; bound the whole answer with max_tokens"),
})


def _idle(v: Any, values: tuple[Any, ...]) -> bool:
    return v is None or any(type(v) is type(i) and v == i for i in values)


def refuse_unsupported(r: RequestBody, n: int) -> None:
    """A 400 naming the first field of `r` that asks for what this server does not do (see IDLE)."""
    for name, (values, why) in [*IDLE.items(), *(CHAT_IDLE.items() if isinstance(r, ChatCompletionRequest) else ())]:
        v = getattr(r, name, None)
        if not _idle(v, values):
            only = " or ".join(["null", *(json.dumps(i) for i in values)])
            raise bad_request(name, f"'{name}' is not supported by this server ({why}): send {only}, or leave it out")
    if isinstance(r, CompletionRequest | ChatCompletionRequest) and r.best_of is not None and r.best_of != n:
        raise bad_request("best_of", f"'best_of' is not supported by this server (it returns every sample it "
                                     f"draws): only null or equal to n ({n})")
