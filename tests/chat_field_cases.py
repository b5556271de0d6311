"""vLLM's chat fields, as cases that tests/test_request_fields.py sends to a server of every engine path.

That server runs with `--chat-template` (SMOL_THINK: SmolLM2's own template, plus Qwen3's `enable_thinking`
switch, which a request sets through `chat_template_kwargs`) and `--trust-request-chat-template`. Each case
is the fields of one POST /v1/chat/completions and a check of its answer (a body, or a stream's events),
given every case's answer (some compare against `plain`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# SmolLM2-135M-Instruct's chat template, with a system turn written when enable_thinking is false
SMOL_THINK = (
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<|im_start|>system\\n/no_think<|im_end|>\\n' }}"
    "{% endif %}{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PREFILL = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "The capital of France is"}]
Answer = dict[str, Any] | list[dict[str, Any]]
Check = Callable[[Answer, dict[str, Any]], None]


def _prompt_tokens(a: Answer) -> int:
    body = a if isinstance(a, dict) else a[-1]
    return int(body["usage"]["prompt_tokens"])


def _text(a: Answer) -> str:
    if isinstance(a, dict):
        return str(a["choices"][0]["message"]["content"])
    return "".join(c["delta"].get("content") or "" for e in a for c in e["choices"])


def _finish(a: Answer) -> str:
    if isinstance(a, dict):
        return str(a["choices"][0]["finish_reason"])
    return next(c["finish_reason"] for e in a for c in e["choices"] if c["finish_reason"])


def _thinking_off(a: Answer, all_: dict[str, Any]) -> None:
    # the template's extra system turn: "<|im_start|>system\n/no_think<|im_end|>\n" is 9 more tokens
    assert _prompt_tokens(a) == _prompt_tokens(all_["plain"]) + 9, (a, all_["plain"])


def _same_prompt_as_plain(a: Answer, all_: dict[str, Any]) -> None:
    assert _prompt_tokens(a) == _prompt_tokens(all_["plain"]), a


def _continued(a: Answer, all_: dict[str, Any]) -> None:
    # the prompt ends inside the assistant's message: two tokens ("<|im_end|>", "\n") fewer than when closed
    assert _prompt_tokens(a) == _prompt_tokens(all_["prefill_closed"]) - 2, a
    assert "Paris" in _text(a), a


def _token_ids(a: Answer, all_: dict[str, Any]) -> None:
    """return_token_ids: the prompt's ids (the body's, or the first chunk's) and the 3 generated ids."""
    if isinstance(a, dict):
        assert len(a["choices"][0]["token_ids"]) == 3 and len(a["prompt_token_ids"]) > 0, a
        return
    assert len(a[0]["prompt_token_ids"]) > 0, a[0]
    assert sum(len(c.get("token_ids") or []) for e in a for c in e["choices"]) == 3, a


def _own_template(a: Answer, all_: dict[str, Any]) -> None:
    # the request's template writes the bare question: no system turn, no role headers
    assert _prompt_tokens(a) < _prompt_tokens(all_["plain"]) - 15, a


def _stop_string_kept(a: Answer, all_: dict[str, Any]) -> None:
    assert _text(a) == "xx" and _finish(a) == "stop", a


def _created_now(a: Answer, all_: dict[str, Any]) -> None:
    events = [a] if isinstance(a, dict) else a
    assert len({e["created"] for e in events}) == 1, events
    assert abs(events[0]["created"] - time.time()) < 600, events[0]  # the request's arrival, not the start


def _ok(a: Answer, all_: dict[str, Any]) -> None:
    assert _finish(a) in ("stop", "length"), a


FORCE_X = {"logit_bias": {"104": 100}, "stop": ["xx"], "max_tokens": 6, "ignore_eos": True}
ONE = {"max_tokens": 1}  # cases that check the prompt only: out of the shared batch after one step
CHAT_CASES: dict[str, tuple[dict[str, Any], Check]] = {
    "plain": (ONE, _created_now),
    "thinking_off": ({**ONE, "chat_template_kwargs": {"enable_thinking": False}}, _thinking_off),
    "thinking_on": ({**ONE, "chat_template_kwargs": {"enable_thinking": True}}, _same_prompt_as_plain),
    "thinking_off_stream": ({**ONE, "chat_template_kwargs": {"enable_thinking": False}, "stream": True,
                             "stream_options": {"include_usage": True}}, _thinking_off),
    "documents": ({**ONE, "documents": [{"title": "t", "text": "x"}]}, _same_prompt_as_plain),  # SmolLM2: unread
    "prefill_closed": ({**ONE, "messages": PREFILL, "add_generation_prompt": False}, _ok),
    "continue_final_message": ({"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True,
                                "max_tokens": 3}, _continued),
    "request_chat_template": ({**ONE, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
                              _own_template),
    "include_stop_str": ({**FORCE_X, "include_stop_str_in_output": True}, _stop_string_kept),
    "include_stop_str_stream": ({**FORCE_X, "include_stop_str_in_output": True, "stream": True}, _stop_string_kept),
    "created_stream": ({"stream": True, "n": 2, "temperature": 1.0, "seed": 1, "max_tokens": 3}, _created_now),
    # vLLM's (the audit of 2026-11-29): reasoning_effort "none" sets enable_thinking false, as vLLM does; the token
    # ids answered; an assistant message's reasoning reaches the template (SmolLM2's does not write it)
    "reasoning_effort_none": ({**ONE, "reasoning_effort": "none"}, _thinking_off),
    "return_token_ids": ({"max_tokens": 3, "ignore_eos": True, "return_token_ids": True}, _token_ids),
    "return_token_ids_stream": ({"max_tokens": 3, "ignore_eos": True, "return_token_ids": True, "stream": True},
                                _token_ids),
    "message_reasoning": ({**ONE, "messages": [*PREFILL[:1], {**PREFILL[1], "reasoning": "think"},
                                               {"role": "user", "content": "And Spain?"}]}, _ok),
}
