"""Why rapidserve does not serve a vLLM request field that its HTTP API and its Python API share: one reason each.

vLLM's users meet the same field in a request body (`/v1/completions`, `/v1/chat/completions`) and in Python
(`SamplingParams`, `StructuredOutputs`, the prompts and arguments of `LLM.generate`). Where rapidserve refuses what
it asks (any value but those that ask for nothing), both sides give the reason from `WHY`, so they never disagree:
server/unsupported.py's tables and the Python side's (vllm_sampling_fields.py, structured_outputs.py,
llm_inputs.py) read it. Which values ask for nothing is each side's own (JSON null and vLLM's defaults there, None
and vLLM's defaults here). A few fields are Python's only (vLLM's HTTP API has no such field); their reasons are here
too, so every reason for a vLLM field lives in one table.

Pure: imports nothing of rapidserve's, so any layer may read it.
"""

from __future__ import annotations

from types import MappingProxyType

WHY: MappingProxyType[str, str] = MappingProxyType({
    # request fields, in a body and in SamplingParams
    "prompt_logprobs": "the logprobs of prompt tokens are not computed",
    "spaces_between_special_tokens": "special tokens are decoded as the tokenizer joins them",
    "logprob_token_ids": "logprobs are those of the top tokens: ask with logprobs (completions) or top_logprobs "
                         "(chat)",
    "repetition_detection": "repeated n-grams do not end a generation here: bound it with max_tokens, or discourage "
                            "repeats with repetition_penalty or frequency_penalty",
    "thinking_token_budget": "no cap on reasoning tokens is enforced; bound the whole answer with max_tokens",
    "vllm_xargs": "no extensions read extra arguments",  # SamplingParams.extra_args in Python
    # request fields, in a body and in LLM.generate's arguments or prompts
    "priority": "requests are served in arrival order (vLLM's fcfs policy, where any other priority is an error "
                "too)",
    "mm_processor_kwargs": "the models served here take text only",
    "cache_salt": "the prefix cache is not salted per request",
    "prompt_embeds": "prompts are text or token ids",
    # structured outputs' own fields
    "structured_outputs.whitespace_pattern": "JSON whitespace is always compact here",
    "structured_outputs.structural_tag": "structural tags are not supported; use json, regex, choice or grammar",
    # Python's only
    "flat_logprobs": "logprobs come in vLLM's default form only: per position a {token id: Logprob} dict "
                     "(CompletionOutput.logprobs; chosen_logprobs() gives the chosen tokens' as floats)",
    "routed_experts_prompt_start": "routed experts are not returned: enable_return_routed_experts is refused",
})
NO_EFFECT: MappingProxyType[str, str] = MappingProxyType({  # accepted with any valid value: why nothing changes
    "structured_outputs.disable_any_whitespace": "JSON is always generated without whitespace between tokens here "
                                                 "(false, vLLM's default, allows that too)",
})
