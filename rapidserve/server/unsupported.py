"""vLLM's request fields that ask for what this server does not do: refused with a 400 naming the field.

Users come from vLLM, so every field vLLM takes is declared in schemas.py (and schema_parts.py); the ones this
server does not serve are accepted only while they ask for nothing (null, or vLLM's default), and refused by
name otherwise, never ignored. `IDLE` lists them with the values that ask for nothing and why the rest is
refused (`CHAT_IDLE`: the chat endpoint's own, OpenAI's fields that vLLM does not declare among them; `NESTED`:
fields inside messages and structured outputs); `NO_EFFECT` lists the few accepted with any value because they
cannot change an answer here. The reasons for the fields that the Python API takes too (`SamplingParams`,
`LLM.generate`) are rapidserve/vllm_reasons.py's, which both sides read. `refuse_unsupported` checks a request
against them and against the fields whose refusal depends on others (`best_of` against `n`). Pure; no model, no
server state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

from rapidserve.server.errors import bad_request
from rapidserve.server.schemas import ChatCompletionRequest, CompletionRequest, RequestBody
from rapidserve.vllm_reasons import NO_EFFECT as SHARED_NO_EFFECT
from rapidserve.vllm_reasons import WHY

Idle = MappingProxyType[str, tuple[tuple[Any, ...], str]]  # field -> (the values besides null that ask for nothing,
#                                                              why any other is refused)
_RENDER = "vLLM answers it only on its /v1/chat/completions/render and /v1/completions/render, which this server does "
_TOKENS = "use POST /tokenize (return_token_strs), or return_token_ids and POST /detokenize"
IDLE: Idle = MappingProxyType({
    "use_beam_search": ((False,), "it samples; beam search is not implemented"),
    "prompt_logprobs": ((), WHY["prompt_logprobs"]),
    "suffix": (("",), "a completion is never followed by a suffix"),
    "priority": ((0,), WHY["priority"]),
    "spaces_between_special_tokens": ((True,), WHY["spaces_between_special_tokens"]),
    "return_tokens_as_token_ids": ((False,), "logprobs name tokens by their text; return_token_ids gives the ids"),
    "logits_processors": (([],), "no custom logits processors are loaded (vLLM refuses them too without "
                                 "--logits-processor-pattern)"),
    "cache_salt": ((), WHY["cache_salt"]),
    "kv_transfer_params": (({},), "KV is never transferred between servers"),
    "ec_transfer_params": (({},), "no encoder cache is transferred between servers (text-only models)"),
    "vllm_xargs": (({},), WHY["vllm_xargs"]),
    "mm_processor_kwargs": (({},), WHY["mm_processor_kwargs"]),
    "prompt_embeds": ((), WHY["prompt_embeds"]),
    "guided_decoding_backend": ((), "the one grammar engine is llguidance"),
    "guided_whitespace_pattern": ((), "JSON whitespace follows the grammar engine's default"),
    "structural_tag": ((), "structural tags are not supported; use structured_outputs, response_format or tools"),
    "return_token_offsets": ((False,), f"{_RENDER}not serve; {_TOKENS}"),
    "logprob_token_ids": (([],), WHY["logprob_token_ids"]),
    "repetition_detection": (({},), WHY["repetition_detection"]),
    "thinking_token_budget": ((-1,), WHY["thinking_token_budget"]),
    # SGLang's names, which vllm-router adds to every request it forwards (at the values that ask for nothing)
    "no_stop_trim": ((False,), "SGLang's name: use include_stop_str_in_output: true"),
    "return_hidden_states": ((False,), "hidden states are not returned"),
})
CHAT_IDLE: Idle = MappingProxyType({  # the chat endpoint's own (completions have an echo of their own)
    "echo": ((False,), "a chat answer is never prefixed with the last message"),
    "media_io_kwargs": (({},), "the models served here take text only"),
    "return_prompt_text": ((False,), f"the rendered prompt is not answered: {_TOKENS}"),
    "return_assistant_tokens_mask": ((False,), f"{_RENDER}not serve"),
    "separate_reasoning": ((True,), "SGLang's name: with --reasoning-parser the reasoning is always separated into "
                                    "reasoning_content; include_reasoning: false leaves it out"),
    "stream_reasoning": ((True,), "SGLang's name: the reasoning streams as it is generated"),
    # OpenAI's, which vLLM does not declare (and ignores)
    "store": ((False,), "nothing is stored"),
    "metadata": (({},), "nothing is stored to tag"),
    "service_tier": (("auto", "default"), "there is one tier"),
    "modalities": ((["text"],), "the answer is text"),
    "verbosity": ((), "there is no verbosity control: ask for it in the messages"),
    "prediction": ((), "predicted outputs are not used"),
    "audio": ((), "the answer is text"),
    "function_call": ((), "OpenAI's deprecated form: use tool_choice"),
    "functions": ((), "OpenAI's deprecated form: use tools"),
    "moderation": ((), "no moderation is run"),
    "web_search_options": ((), "the model has no web search"),
    "prompt_cache_retention": (("in_memory",), "the prefix cache lives in GPU memory while it has room"),
    "prompt_cache_options": ((), "the prefix cache is automatic and has no options"),
})
NESTED: Idle = MappingProxyType({  # "where.field": as IDLE (where: messages[] or structured_outputs)
    "messages[].tools": ((), "tools go in the request's 'tools'"),
    "messages[].task": ((), "no model here reads a task marker"),
    "messages[].refusal": ((), "a refusal is not rendered: put the text in 'content'"),
    "messages[].audio": ((), "messages are text"),
    "messages[].function_call": ((), "OpenAI's deprecated form: use 'tool_calls'"),
    "messages[].annotations": (([],), "annotations are not rendered"),
    "structured_outputs.whitespace_pattern": ((), WHY["structured_outputs.whitespace_pattern"]),
    "structured_outputs.structural_tag": ((), WHY["structured_outputs.structural_tag"]),
})
NO_EFFECT: MappingProxyType[str, str] = MappingProxyType({  # accepted with any (valid) value: why it changes nothing
    "length_penalty": "beam search's: no effect without beam search (as in vLLM), which this server does not do",
    "prompt_cache_key": "the prefix cache is automatic and shared by every request, so a key changes nothing",
    "safety_identifier": "an end-user id for abuse monitoring: written to the request's log line (as `user`); "
                         "it does not change the answer",
    "response_format.json_schema.name": "the schema's label: the schema is what is enforced (as in vLLM)",
    "response_format.json_schema.description": "not shown to the model (as in vLLM): say it in the messages",
    "response_format.json_schema.strict": "the schema is always enforced here, strict or not (as in vLLM)",
    **SHARED_NO_EFFECT,
})


def _idle(v: Any, values: tuple[Any, ...]) -> bool:
    return v is None or any(type(v) is type(i) and v == i for i in values)


def _refuse(name: str, param: str, values: tuple[Any, ...], why: str) -> None:
    only = " or ".join(["null", *(json.dumps(i) for i in values)])
    raise bad_request(param, f"'{name}' is not supported by this server ({why}): send {only}, or leave it out")


def _nested(r: Any) -> Iterator[tuple[str, str, str, Any]]:
    """(NESTED's key, the field's path, its top-level field, its value) of every nested field NESTED lists."""
    for key in NESTED:
        where, name = key.split(".", 1)
        if where == "messages[]":
            for i, m in enumerate(getattr(r, "messages", None) or []):
                yield key, f"messages[{i}].{name}", "messages", getattr(m, name)
        elif getattr(r, "structured_outputs", None) is not None:  # where == "structured_outputs"
            yield key, key, where, getattr(r.structured_outputs, name)


def refuse_nested(r: Any) -> None:
    """A 400 naming the first nested field of `r` (a request body, or /tokenize's: its messages, its
    structured_outputs where it has them) that asks for what this server does not do (see NESTED)."""
    for key, path, param, v in _nested(r):
        values, why = NESTED[key]
        if not _idle(v, values):
            _refuse(path, param, values, why)


def refuse_unsupported(r: RequestBody, n: int) -> None:
    """A 400 naming the first field of `r` that asks for what this server does not do (see IDLE)."""
    for name, (values, why) in [*IDLE.items(), *(CHAT_IDLE.items() if isinstance(r, ChatCompletionRequest) else ())]:
        v = getattr(r, name, None)
        if not _idle(v, values):
            _refuse(name, name, values, why)
    refuse_nested(r)
    if isinstance(r, CompletionRequest | ChatCompletionRequest) and r.best_of is not None and r.best_of != n:
        raise bad_request("best_of", f"'best_of' is not supported by this server (it returns every sample it "
                                     f"draws): only null or equal to n ({n})")
