"""Every SamplingParams field and request option through every engine path, on CPU.

Paths: the RAPID two-process engine and the hybrid engine, each behind a real `rapidserve serve`
(embedded SmolLM2), and the single-process `LLM`. One case per field per path, so a field can never
again work in one path and crash another (min_tokens once killed the RAPID prefill worker). After
each case the server must still be healthy with the same worker processes: a request never kills a
worker.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.sampling_params import StructuredOutputs
from tests.chat_field_cases import CHAT_CASES, SMOL_THINK
from tests.test_server import Srv, http, start, stop

QUESTION = "Name three colours."
Check = Callable[[list[dict[str, Any]]], None]


def _ntok(c: dict[str, Any]) -> int:
    return int(c["_completion_tokens"])


@dataclass(frozen=True)
class Case:
    """One field (or request option) with a non-default value and what must hold of the choices."""

    name: str
    fields: dict[str, Any]
    check: Check = lambda cs: None
    llm: bool = True  # a SamplingParams field (also run through LLM), not only an HTTP option
    extra: dict[str, Any] = field(default_factory=dict)  # HTTP-only additions (e.g. stream)
    llm_fields: dict[str, Any] | None = None  # the SamplingParams fields, where they differ from the HTTP ones


def _all(pred: Callable[[dict[str, Any]], bool], what: str) -> Check:
    def check(cs: list[dict[str, Any]]) -> None:
        assert cs and all(pred(c) for c in cs), f"{what}: {cs}"
    return check


CASES = [
    Case("n", {"n": 2, "temperature": 1.0, "seed": 5}, lambda cs: _len(cs, 2)),
    Case("temperature", {"temperature": 0.7, "seed": 1}),
    Case("top_p", {"temperature": 1.0, "top_p": 0.5, "seed": 2}),
    Case("top_k", {"temperature": 1.0, "top_k": 5, "seed": 3}),
    Case("top_k_off", {"temperature": 1.0, "top_k": -1, "seed": 3}),
    Case("top_k_beyond_vocab", {"temperature": 1.0, "top_k": 2**31 - 1, "seed": 3}),
    Case("min_p", {"temperature": 1.0, "min_p": 0.2, "seed": 4}),
    Case("seed", {"temperature": 1.0, "seed": 2**63 - 1}),
    Case("max_tokens", {"max_tokens": 3, "ignore_eos": True},
         _all(lambda c: _ntok(c) == 3 and c["finish_reason"] == "length", "3 tokens, length")),
    Case("min_tokens", {"min_tokens": 6, "max_tokens": 8}, _all(lambda c: _ntok(c) >= 6, ">= 6 tokens")),
    Case("min_tokens_with_stop_ids", {"min_tokens": 4, "max_tokens": 6, "stop_token_ids": [2]},
         _all(lambda c: _ntok(c) >= 4, ">= 4 tokens")),
    Case("stop_token_ids", {"stop_token_ids": [2, 13]}),
    Case("stop", {"stop": [",", "\n"], "max_tokens": 24}, _all(lambda c: "," not in c["_text"], "no ','")),
    Case("ignore_eos", {"ignore_eos": True, "max_tokens": 12}, _all(lambda c: _ntok(c) == 12, "12 tokens")),
    Case("logprobs", {"logprobs": 3}, _all(lambda c: c["logprobs"] is not None, "logprobs present")),
    Case("logprobs_0", {"logprobs": 0}, _all(lambda c: c["logprobs"] is not None, "logprobs present")),
    Case("skip_special_tokens", {"skip_special_tokens": False}),
    # logit controls (issue 19); ids of SmolLM2's tokenizer: 198 "\n", 104 "x", 17 "!", 47 "?"
    Case("presence_penalty", {"presence_penalty": 1.5, "max_tokens": 12}),
    Case("frequency_penalty", {"frequency_penalty": 2.0, "max_tokens": 12}),
    Case("repetition_penalty", {"repetition_penalty": 1.3, "max_tokens": 12}),
    Case("penalties_negative", {"presence_penalty": -2, "frequency_penalty": -0.5, "repetition_penalty": 0.7}),
    Case("logit_bias_ban", {"logit_bias": {"198": -100}}, _all(lambda c: "\n" not in c["_text"], "no newline")),
    Case("logit_bias_force", {"logit_bias": {"104": 100}, "max_tokens": 4, "ignore_eos": True},
         _all(lambda c: c["_text"] == "xxxx", "xxxx")),
    Case("allowed_token_ids", {"allowed_token_ids": [17, 47], "max_tokens": 5, "ignore_eos": True},
         _all(lambda c: len(c["_text"]) == 5 and set(c["_text"]) <= {"!", "?"}, "only ! and ?")),
    Case("bad_words", {"bad_words": ["answer", "The", "is:"], "max_tokens": 12},
         _all(lambda c: "answer" not in c["_text"] and "The" not in c["_text"] and "is:" not in c["_text"],
              "no bad word")),
    Case("controls_n_seeded", {"n": 2, "temperature": 1.0, "seed": 4, "presence_penalty": 1.0,
                               "repetition_penalty": 1.2, "logit_bias": {"198": -5}, "bad_words": ["colour"]},
         lambda cs: _len(cs, 2)),
    Case("controls_stream", {"frequency_penalty": 1.0, "bad_words": ["answer"], "logprobs": 2},
         _all(lambda c: "answer" not in c["_text"] and c["logprobs"] is not None, "no bad word, logprobs"), llm=False,
         extra={"stream": True}),
    # include_stop_str_in_output (vLLM's): "x" (id 104) forced, so the stop string / stop token surely comes
    Case("stop_string_left_out", {"logit_bias": {"104": 100}, "stop": ["xx"], "max_tokens": 6, "ignore_eos": True},
         _all(lambda c: c["_text"] == "" and c["finish_reason"] == "stop", "nothing before the stop string")),
    Case("include_stop_str_in_output", {"logit_bias": {"104": 100}, "stop": ["xx"], "max_tokens": 6,
                                        "ignore_eos": True, "include_stop_str_in_output": True},
         _all(lambda c: c["_text"] == "xx" and c["finish_reason"] == "stop", "the stop string kept")),
    Case("include_stop_str_stream", {"logit_bias": {"104": 100}, "stop": ["xx"], "max_tokens": 6,
                                     "ignore_eos": True, "include_stop_str_in_output": True},
         _all(lambda c: c["_text"] == "xx" and c["finish_reason"] == "stop", "the stop string kept"), llm=False,
         extra={"stream": True}),
    Case("stop_token_text_left_out", {"logit_bias": {"104": 100}, "stop_token_ids": [104], "max_tokens": 6},
         _all(lambda c: c["_text"] == "" and c["finish_reason"] == "stop" and _ntok(c) == 1, "no stop token text")),
    Case("include_stop_token_text", {"logit_bias": {"104": 100}, "stop_token_ids": [104], "max_tokens": 6,
                                     "include_stop_str_in_output": True},
         _all(lambda c: c["_text"] == "x" and c["finish_reason"] == "stop" and _ntok(c) == 1, "the stop token kept")),
    Case("include_stop_token_stream", {"logit_bias": {"104": 100}, "stop_token_ids": [104], "max_tokens": 6,
                                       "include_stop_str_in_output": True},
         _all(lambda c: c["_text"] == "x" and c["finish_reason"] == "stop", "the stop token kept"), llm=False,
         extra={"stream": True}),
    # vLLM matches no stop string that ends within the first min_tokens tokens' text: "x" forced, stop "x"
    Case("min_tokens_with_stop_string", {"logit_bias": {"104": 100}, "stop": ["x"], "min_tokens": 4, "max_tokens": 6,
                                         "ignore_eos": True},
         _all(lambda c: c["_text"] == "xxxx" and c["finish_reason"] == "stop", "4 tokens' text, then the stop")),
    Case("min_tokens_with_stop_string_kept", {"logit_bias": {"104": 100}, "stop": ["x"], "min_tokens": 4,
                                              "max_tokens": 6, "ignore_eos": True, "include_stop_str_in_output": True},
         _all(lambda c: c["_text"] == "xxxxx" and c["finish_reason"] == "stop", "5 x, the stop string kept")),
    Case("min_tokens_with_stop_string_stream", {"logit_bias": {"104": 100}, "stop": ["x"], "min_tokens": 4,
                                                "max_tokens": 6, "ignore_eos": True},
         _all(lambda c: c["_text"] == "xxxx" and c["finish_reason"] == "stop", "4 tokens' text, then the stop"),
         llm=False, extra={"stream": True}),
    # request options: HTTP only
    Case("stream", {}, llm=False, extra={"stream": True}),
    Case("stream_usage", {}, llm=False, extra={"stream": True, "stream_options": {"include_usage": True}}),
    Case("stream_n_logprobs", {"n": 2, "logprobs": 2, "temperature": 1.0, "seed": 9}, lambda cs: _len(cs, 2),
         llm=False, extra={"stream": True}),
    Case("echo", {}, _all(lambda c: c["_text"].startswith(QUESTION), "echoed prompt"), llm=False,
         extra={"echo": True}),
    Case("user", {}, llm=False, extra={"user": "someone"}),
    Case("stream_min_tokens", {"min_tokens": 5, "max_tokens": 7}, _all(lambda c: _ntok(c) >= 5, ">= 5 tokens"),
         llm=False, extra={"stream": True}),
    # vLLM's response and prompt options (the audit of 2026-11-29): every engine path, streamed and not
    Case("request_id", {}, llm=False, extra={"request_id": "mine-1"}),
    Case("return_token_ids", {"max_tokens": 4, "ignore_eos": True},
         _all(lambda c: len(c["token_ids"]) == 4 and len(c["prompt_token_ids"]) > 0, "4 token ids and the prompt's"),
         llm=False, extra={"return_token_ids": True}),
    Case("return_token_ids_stream", {"max_tokens": 4, "ignore_eos": True}, llm=False,
         extra={"stream": True, "return_token_ids": True}),
    Case("stream_continuous_usage", {}, llm=False,
         extra={"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    Case("truncate_prompt_tokens", {"truncate_prompt_tokens": 3}, llm=False),
    Case("truncate_prompt_tokens_all_that_fit", {"truncate_prompt_tokens": -1}, llm=False),
    Case("truncation_side_right", {"truncate_prompt_tokens": 2}, llm=False, extra={"truncation_side": "right"}),
]


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WORDS = ["red", "green", "blue"]


def _person(c: dict[str, Any]) -> bool:
    v = json.loads(c["_text"])
    return c["finish_reason"] == "stop" and set(v) == {"name", "age"} and isinstance(v["age"], int) \
        and 0 <= v["age"] <= 120 and len(v["name"]) <= 12


def _so(**kw: Any) -> dict[str, Any]:
    return {"structured_outputs": StructuredOutputs(**kw)}


STRUCTURED_CASES = [
    Case("guided_json", {"guided_json": PERSON, "max_tokens": 48}, _all(_person, "a valid person"),
         llm_fields={"max_tokens": 48, **_so(json=json.dumps(PERSON))}),
    Case("guided_regex", {"guided_regex": "[a-z]{3}-[0-9]{2}", "max_tokens": 16},
         _all(lambda c: re.fullmatch("[a-z]{3}-[0-9]{2}", c["_text"]) is not None, "matches the regex"),
         llm_fields={"max_tokens": 16, **_so(regex="[a-z]{3}-[0-9]{2}")}),
    Case("guided_choice", {"guided_choice": WORDS}, _all(lambda c: c["_text"] in WORDS, "one of the choices"),
         llm_fields=_so(choice=tuple(WORDS))),
    Case("guided_grammar", {"guided_grammar": 'start: "yes" | "no"'}, _all(lambda c: c["_text"] in ("yes", "no"),
                                                                          "yes or no"),
         llm_fields=_so(grammar='start: "yes" | "no"')),
    Case("structured_outputs_json_object", {"structured_outputs": {"json_object": True}, "max_tokens": 64,
                                            "temperature": 0.8, "seed": 4},
         _all(lambda c: c["finish_reason"] == "length" or isinstance(json.loads(c["_text"]), dict), "a JSON object"),
         llm_fields={"max_tokens": 64, "temperature": 0.8, "seed": 4, **_so(json_object=True)}),
    Case("structured_n2", {"structured_outputs": {"choice": WORDS}, "n": 2, "temperature": 1.0, "seed": 8},
         lambda cs: _len(cs, 2) or _all(lambda c: c["_text"] in WORDS, "one of the choices")(cs),
         llm_fields={"n": 2, "temperature": 1.0, "seed": 8, **_so(choice=tuple(WORDS))}),
    # a complete grammar ends the request below min_tokens; max_tokens may cut a JSON short ("length")
    Case("structured_min_tokens", {"guided_choice": WORDS, "min_tokens": 6, "max_tokens": 8},
         _all(lambda c: c["_text"] in WORDS and c["finish_reason"] == "stop", "a choice, stopped"),
         llm_fields={"min_tokens": 6, "max_tokens": 8, **_so(choice=tuple(WORDS))}),
    Case("structured_max_tokens", {"guided_json": PERSON, "max_tokens": 3},
         _all(lambda c: c["finish_reason"] == "length" and c["_text"].startswith('{"'), "cut short"),
         llm_fields={"max_tokens": 3, **_so(json=json.dumps(PERSON))}),
    Case("structured_stop_string", {"guided_json": PERSON, "max_tokens": 48, "stop": [","]},
         _all(lambda c: "," not in c["_text"] and c["_text"].startswith('{"name":'), "stopped at ','"),
         llm_fields={"max_tokens": 48, "stop": (",",), **_so(json=json.dumps(PERSON))}),
    Case("structured_stream", {"guided_regex": "[a-z]{3}-[0-9]{2}", "max_tokens": 16},
         _all(lambda c: re.fullmatch("[a-z]{3}-[0-9]{2}", c["_text"]) is not None, "matches the regex"),
         llm=False, extra={"stream": True}),
]
CASES += STRUCTURED_CASES


def _len(cs: list[dict[str, Any]], n: int) -> None:
    assert len(cs) == n, cs


# chat requests with tools (issue 19): HTTP only (LLM has no chat API); the server runs with
# --enable-auto-tool-choice (SmolLM2's template ignores tools; its Llama family gives llama3_json)
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
TOOL_CASES = {
    "tools_auto": {"tools": [TOOL], "tool_choice": "auto"},
    "tools_none": {"tools": [TOOL], "tool_choice": "none"},
    "tools_required": {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    "tools_auto_not_parallel": {"tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False},
    "tools_auto_not_parallel_stream": {"tools": [TOOL], "parallel_tool_calls": False, "stream": True},
    "tools_named": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "tools_history": {"tools": [TOOL], "messages": HISTORY},
    "tools_stream_n_stop": {"tools": [TOOL], "stream": True, "n": 2, "temperature": 1.0, "seed": 3,
                            "stop": ["\n"]},
    "tools_required_stream_usage": {"tools": [TOOL], "tool_choice": "required", "stream": True,
                                    "stream_options": {"include_usage": True}},
}


# ---------------------------------------------------------------- HTTP paths (rapid, hybrid)


@dataclass
class Served:
    srv: Srv
    results: dict[str, list[dict[str, Any]] | BaseException]  # case name -> its choices, or what went wrong
    tool_results: dict[str, dict[str, Any] | list[dict[str, Any]] | BaseException]  # chat: body, or its events
    # (TOOL_CASES and chat_field_cases.CHAT_CASES, by name)


# Every engine path: rapid with its default policy (duet: fused steps in the decode worker, split when the SLO
# needs it) and with --policy rapid (every prompt through the prefill worker), hybrid (--policy fused), disagg
# (prefill and decode instances, the KV moved between their pools) and rapid at tensor-parallel size 3 (SmolLM2's
# 9 heads and 3 KV heads split three ways; gloo on CPU), and --policy drift (block-wise prefill in the prefill
# worker).
ENGINE_PATHS = {"rapid": ("--mode", "rapid"), "rapid-split": ("--mode", "rapid", "--policy", "rapid"),
                "hybrid": ("--mode", "hybrid"), "disagg": ("--mode", "disagg"),
                "rapid-tp3": ("--mode", "rapid", "-tp", "3"), "drift": ("--mode", "rapid", "--policy", "drift")}


@pytest.fixture(scope="module", params=list(ENGINE_PATHS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A server of that engine path, with every case's request sent once, all at the same time (they share
    batches, as real traffic does); each test then checks its own case's answer. Its chat template is
    SmolLM2's own plus an enable_thinking switch (chat_field_cases.SMOL_THINK), given by --chat-template."""
    template = tmp_path_factory.mktemp("chat") / "smol_think.jinja"
    template.write_text(SMOL_THINK, encoding="utf-8")
    s = start(*ENGINE_PATHS[request.param], "--enable-auto-tool-choice", "--chat-template", str(template),
              "--trust-request-chat-template")
    chats = {**TOOL_CASES, **{name: fields for name, (fields, _) in CHAT_CASES.items()}}
    try:
        async def run_all(pool: ThreadPoolExecutor) -> list[Any]:
            loop = asyncio.get_running_loop()
            return await asyncio.gather(*(loop.run_in_executor(pool, _completion, s, _body(c)) for c in CASES),
                                        *(loop.run_in_executor(pool, _chat, s, b) for b in chats.values()),
                                        return_exceptions=True)

        # a thread per request: the default executor's few threads (6 on 2 cores) would send them in waves
        with ThreadPoolExecutor(len(CASES) + len(chats)) as pool:
            got = asyncio.run(run_all(pool))
        yield Served(s, dict(zip((c.name for c in CASES), got[:len(CASES)], strict=True)),
                     dict(zip(chats, got[len(CASES):], strict=True)))
    finally:
        assert stop(s) == 0


def _body(case: Case) -> dict[str, Any]:
    return {"prompt": QUESTION, "max_tokens": 8, "temperature": 0, **case.fields, **case.extra}


def _completion(s: Srv, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST /v1/completions; the choices, each with `_text` and `_completion_tokens` (streams joined)."""
    status, _, raw = http(s.url + "/v1/completions", "POST", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    assert status == 200, raw
    if not body.get("stream"):
        r = json.loads(raw)
        out = r["choices"]
        for c in out:  # token counts per choice: from the usage when there is one choice
            c["_text"] = c["text"]
            c["_completion_tokens"] = r["usage"]["completion_tokens"] if len(out) == 1 else None
        return out
    events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    choices: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        d = json.loads(e)
        assert "error" not in d, d
        for c in d["choices"]:
            cur = choices.setdefault(c["index"], {"_text": "", "_completion_tokens": 0, "finish_reason": None,
                                                  "logprobs": None})
            cur["_text"] += c["text"]
            cur["_completion_tokens"] += 1
            cur["finish_reason"] = c["finish_reason"] or cur["finish_reason"]
            cur["logprobs"] = c.get("logprobs") or cur["logprobs"]
    return [choices[i] for i in sorted(choices)]


def _chat(s: Srv, fields: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    """POST /v1/chat/completions; the answer, or a stream's events (checked to end with [DONE], no error)."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0, **fields}
    status, _, raw = http(s.url + "/v1/chat/completions", "POST", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    assert status == 200, raw
    if not body.get("stream"):
        return dict(json.loads(raw))
    events = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-300:]
    out = [json.loads(e) for e in events[:-1]]
    assert not any("error" in e for e in out), out
    return out


@pytest.mark.parametrize("name", list(TOOL_CASES))
def test_tool_field_through_server(server: Served, name: str) -> None:
    got = server.tool_results[name]
    if isinstance(got, BaseException):
        raise got
    fields = TOOL_CASES[name]
    if isinstance(got, dict):  # whole: each choice is a message with text or calls of the given tool
        assert len(got["choices"]) == fields.get("n", 1) and got["usage"]["completion_tokens"] > 0
        for c in got["choices"]:
            m = c["message"]
            assert isinstance(m["content"], str) or m["tool_calls"], c
            assert all(t["function"]["name"] == "get_weather" for t in m.get("tool_calls") or [])
            assert fields.get("parallel_tool_calls") is not False or len(m.get("tool_calls") or []) <= 1
            assert c["finish_reason"] in ("stop", "length", "tool_calls")
    else:  # streamed: every choice ends with a finish reason; usage when asked
        ends = {c["index"]: c["finish_reason"] for e in got for c in e["choices"] if c["finish_reason"]}
        assert sorted(ends) == list(range(fields.get("n", 1))), got[-3:]
        assert all(r in ("stop", "length", "tool_calls") for r in ends.values())
        if fields.get("parallel_tool_calls") is False:  # only call 0 is streamed
            assert all(t["index"] == 0 for e in got for c in e["choices"] for t in c["delta"].get("tool_calls") or [])
        if fields.get("stream_options"):
            assert got[-1]["usage"]["completion_tokens"] > 0
    assert http(server.srv.url + "/health")[0] == 200  # no worker died of it


@pytest.mark.parametrize("name", list(CHAT_CASES))
def test_chat_field_through_server(server: Served, name: str) -> None:
    """vLLM's chat fields (chat_field_cases.py): the template's inputs, include_stop_str_in_output, created."""
    got = server.tool_results[name]
    if isinstance(got, BaseException):
        raise got
    CHAT_CASES[name][1](got, server.tool_results)
    assert http(server.srv.url + "/health")[0] == 200


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_field_through_server(server: Served, case: Case) -> None:
    got = server.results[case.name]
    if isinstance(got, BaseException):
        raise got
    case.check(got)
    status, _, _ = http(server.srv.url + "/health")
    assert status == 200  # no worker died of it (nor of any other case)


def test_generate_return_token_ids_through_server(server: Served) -> None:
    """/generate's return_token_ids on every engine path, whole and streamed: the ids come back (it dropped them)."""
    body = {"prompt": QUESTION, "max_tokens": 4, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
    status, _, raw = http(server.srv.url + "/generate", "POST", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    out = json.loads(raw)
    assert status == 200 and len(out["token_ids"]) == 4 and len(out["prompt_token_ids"]) > 0, raw
    status, _, raw = http(server.srv.url + "/generate", "POST", json.dumps({**body, "stream": True}).encode(),
                          {"Content-Type": "application/json"})
    events = [json.loads(ln[6:]) for ln in raw.decode().split("\n") if ln.startswith("data: {")]
    assert status == 200 and [len(e["token_ids"]) for e in events] == [1, 1, 1, 1], raw
    assert events[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert http(server.srv.url + "/health")[0] == 200


BAD_CONTROLS = [
    ("presence_penalty", 3), ("presence_penalty", "1"), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("logit_bias", {"49152": 1}), ("logit_bias", {"a": 1}), ("logit_bias", {"1": "x"}), ("allowed_token_ids", []),
    ("allowed_token_ids", [49152]), ("bad_words", [""]), ("bad_words", [" "]), ("bad_words", "answer"),
    # vLLM's fields this server refuses by name
    ("use_beam_search", True), ("prompt_logprobs", 0), ("prompt_logprobs", 5), ("best_of", 3),
    ("include_stop_str_in_output", "yes"), ("priority", 1), ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 0),
]


@pytest.mark.parametrize(("field_name", "value"), BAD_CONTROLS, ids=lambda v: str(v))
def test_invalid_control_is_a_400_naming_it(server: Served, field_name: str, value: Any) -> None:
    for path, base in (("/v1/completions", {"prompt": QUESTION}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}]})):
        status, _, raw = http(server.srv.url + path, "POST", json.dumps({**base, field_name: value}).encode(),
                              {"Content-Type": "application/json"})
        assert status == 400, raw
        assert json.loads(raw)["error"]["param"] == field_name, raw
    assert http(server.srv.url + "/health")[0] == 200


# ---------------------------------------------------------------- single-process LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(show_progress=False, max_model_len=1024)


LLM_CASES = [c for c in CASES if c.llm]


def _llm_params(case: Case) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0,
                             **(case.fields if case.llm_fields is None else case.llm_fields)})


def _llm_choices(out: Any) -> list[dict[str, Any]]:
    return [{"_text": c.text, "_completion_tokens": len(c.token_ids), "finish_reason": c.finish_reason,
             "logprobs": c.logprobs} for c in out.outputs]


@pytest.fixture(scope="module")
def llm_results(llm: LLM) -> dict[str, list[dict[str, Any]] | BaseException]:
    """Every LLM case's choices from one `generate` call (they share batches, as the server's cases do: one
    call instead of one each, which took a second per case on 2 cores). Should that call raise, each case runs
    alone, so that each test reports its own error."""
    params: dict[str, SamplingParams | BaseException] = {}
    for case in LLM_CASES:
        try:
            params[case.name] = _llm_params(case)
        except Exception as e:  # noqa: BLE001 - the case's own test raises it
            params[case.name] = e
    ok = {name: p for name, p in params.items() if isinstance(p, SamplingParams)}
    results: dict[str, list[dict[str, Any]] | BaseException] = {
        name: p for name, p in params.items() if isinstance(p, BaseException)}
    try:
        outs = llm.generate([QUESTION] * len(ok), list(ok.values()), use_tqdm=False)
        results.update({name: _llm_choices(o) for name, o in zip(ok, outs, strict=True)})
    except Exception:  # noqa: BLE001 - one at a time below: each case's test gets its own outcome
        for name, p in ok.items():
            try:
                results[name] = _llm_choices(llm.generate([QUESTION], p, use_tqdm=False)[0])
            except Exception as e:  # noqa: BLE001 - raised by that case's test
                results[name] = e
    return results


@pytest.mark.parametrize("case", LLM_CASES, ids=lambda c: c.name)
def test_field_through_llm(llm: LLM, llm_results: dict[str, list[dict[str, Any]] | BaseException],
                           case: Case) -> None:
    got = llm_results[case.name]
    if isinstance(got, BaseException):
        raise got
    case.check(got)
    assert llm.engine.runner.tokens.in_use == 0  # every penalty slot freed
