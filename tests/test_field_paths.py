"""Request fields that were honoured (or refused) on one path and silently dropped on another, one table each.

- /tokenize's chat `tools`: rendered as /v1/chat/completions renders them (tools.template_tools: a tool's
  `defer_loading` handed to its function, no null keys, parameters defaulted, the same checks), so both count the
  same prompt tokens;
- the nested message fields refused on the chat route (`refusal`, `tools`, `task`, ...) are refused on /tokenize too,
  and `tool_call_id` on a message other than a tool message is refused on both (it was dropped);
- on a model without a tokenizer (token ids only), completions' `echo` and `logprobs` are refused by name, as `stop`
  is (they answered nothing: the prompt text and the logprobs' token texts cannot be made), and `LLM` refuses stop
  strings there (it ignored them).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from rapidserve import LLM, SamplingParams
from rapidserve.sampling_params import SamplingParamsError
from rapidserve.server.errors import APIError
from rapidserve.server.requests import ProtocolContext, parse_request
from rapidserve.tokenizer import Tokenizer
from tests.test_utility_routes import MSGS, Call, with_client

# a template that writes what it is given: every message and the tools, as JSON
DUMP_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m | tojson }}\n{% endfor %}{{ tools | tojson }}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
FN = {"name": "lookup"}
TOOL_CASES: list[tuple[str, dict[str, Any], str]] = [  # (case, the tool, what the template must show of it)
    ("defer_loading at the tool's level", {"type": "function", "defer_loading": True, "function": FN},
     '"name": "lookup", "parameters": {"type": "object", "properties": {}}, "defer_loading": true}'),
    ("no parameters, no description", {"type": "function", "function": FN},
     '"function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}'),
    ("strict", {"type": "function", "function": {**FN, "strict": True, "parameters": {"type": "object"}}},
     '"function": {"name": "lookup", "parameters": {"type": "object"}, "strict": true}'),
]


def _served(tok: Tokenizer) -> Tokenizer:
    served = copy.copy(tok)
    served.chat_template = DUMP_TEMPLATE
    return served


@pytest.mark.parametrize("case,tool,shown", TOOL_CASES, ids=[c[0] for c in TOOL_CASES])
def test_tokenize_renders_tools_as_the_chat_route(tok: Tokenizer, case: str, tool: dict[str, Any],
                                                  shown: str) -> None:
    served = _served(tok)

    async def check(call: Call) -> None:
        body = {"messages": MSGS, "tools": [tool]}
        status, out = await call("POST", "/tokenize", body)
        assert status == 200, out
        text = tok.decode(out["tokens"], skip_special_tokens=False)
        assert shown in text and "null" not in text, text
        status, chat = await call("POST", "/v1/chat/completions", {**body, "tool_choice": "none", "max_tokens": 1})
        assert status == 200 and chat["usage"]["prompt_tokens"] == out["count"], (chat, out["count"])

    with_client(served, check)


BAD_TOOLS = [  # (tools, what the 400 says): the chat route's checks, on /tokenize too
    ([{"function": FN}, {"function": FN}], "two functions named 'lookup'"),
    ([{"function": {**FN, "parameters": {"type": "string"}}}], "JSON schema of an object"),
]


@pytest.mark.parametrize("tools,words", BAD_TOOLS)
def test_tokenize_checks_tools_as_the_chat_route(tok: Tokenizer, tools: list[dict[str, Any]], words: str) -> None:
    async def check(call: Call) -> None:
        for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"tool_choice": "none"})):
            status, out = await call("POST", path, {"messages": MSGS, "tools": tools, **extra})
            assert status == 400 and out["error"]["param"] == "tools" and words in out["error"]["message"], out

    with_client(tok, check)


MESSAGE_CASES: list[tuple[dict[str, Any], str]] = [  # (a message that asks for what is not done, what the 400 names)
    ({"role": "assistant", "content": "x", "refusal": "no"}, "messages[1].refusal"),
    ({"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]}, "messages[1].annotations"),
    ({"role": "assistant", "content": "x", "audio": {"id": "a1"}}, "messages[1].audio"),
    ({"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call"),
    ({"role": "developer", "content": "x", "tools": [{"type": "function", "function": FN}]}, "messages[1].tools"),
    ({"role": "assistant", "content": "x", "task": "chat"}, "messages[1].task"),
    ({"role": "user", "content": "x", "tool_call_id": "call_1"}, "messages[1].tool_call_id"),
    ({"role": "assistant", "content": "x", "tool_call_id": "call_1"}, "messages[1].tool_call_id"),
]


@pytest.mark.parametrize("message,named", MESSAGE_CASES, ids=[c[1] + "@" + c[0]["role"] for c in MESSAGE_CASES])
def test_message_fields_refused_on_chat_and_tokenize_alike(tok: Tokenizer, message: dict[str, Any],
                                                           named: str) -> None:
    async def check(call: Call) -> None:
        for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
            status, out = await call("POST", path, {"messages": [MSGS[0], message], **extra})
            assert status == 400 and out["error"]["param"] == "messages", (path, out)
            assert f"'{named}'" in out["error"]["message"], (path, out)
        tool_answer = {"role": "tool", "content": "42", "tool_call_id": "call_1"}  # where tool_call_id belongs
        status, out = await call("POST", "/tokenize", {"messages": [MSGS[0], tool_answer]})
        assert status == 200, out

    with_client(tok, check)


VOCAB = 1280  # preset:tiny-llama's
TOKENLESS_CASES: list[tuple[dict[str, Any], str | None]] = [  # (completion fields, the field refused; None: served)
    ({"stop": "x"}, "stop"),
    ({"echo": True}, "echo"),
    ({"logprobs": 0}, "logprobs"),
    ({"logprobs": 2, "n": 2}, "logprobs"),
    ({"echo": False, "logprobs": None, "stop": []}, None),
    ({"return_token_ids": True, "skip_special_tokens": False, "include_stop_str_in_output": True}, None),
]


@pytest.mark.parametrize("fields,refused", TOKENLESS_CASES)
def test_text_fields_without_a_tokenizer(fields: dict[str, Any], refused: str | None) -> None:
    ctx = ProtocolContext(None, ("m",), 64, VOCAB, 8)
    body = json.dumps({"prompt": [1, 2, 3], **fields}).encode()
    if refused is None:
        assert parse_request("completion", body, ctx).prompts == [[1, 2, 3]]
        return
    with pytest.raises(APIError) as ei:
        parse_request("completion", body, ctx)
    assert ei.value.status == 400 and ei.value.param == refused and "no tokenizer" in ei.value.message


@pytest.fixture(scope="module")
def bare_llm() -> LLM:
    return LLM("preset:tiny-llama", device="cpu", show_progress=False, num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize("stop,refused", [(["x"], True), ("x", True), ([], False), (None, False)])
def test_llm_without_a_tokenizer_refuses_stop_strings(bare_llm: LLM, stop: Any, refused: bool) -> None:
    params = SamplingParams(max_tokens=3, temperature=0, stop=stop, ignore_eos=True)
    if refused:
        with pytest.raises(SamplingParamsError, match=r"^stop=.*no tokenizer.*stop_token_ids"):
            bare_llm.generate([[1, 2, 3]], params, use_tqdm=False)
        return
    out = bare_llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == ""


STORY = ("Once upon a time, in a quiet village by the sea, a curious cat named Miso explored every alley, chased "
         "gulls along the harbour wall, napped on warm fishing nets, and listened to the old sailors' stories about "
         "storms, lighthouses, distant islands and treasure that nobody had ever found.")


@pytest.mark.parametrize("start,end", [(5, 9), (10, 40), (3, 60)])  # stop strings of 4, 30 and 57 tokens
def test_llm_stop_string_ends_the_request_as_it_ends(tok: Tokenizer, start: int, end: int) -> None:
    """A stop string of many tokens ends the generation at the token that completes it (it was searched for only
    in the last 16 tokens' text: a longer one ran on to max_tokens, its text cut afterwards)."""
    llm = LLM.__new__(LLM)  # only the tokenizer is read
    llm.tokenizer = tok
    ids = tok.encode(STORY, add_special_tokens=False)
    stop = tok.decode(ids[start:end])
    assert STORY.count(stop) == 1
    params = SamplingParams(stop=[stop], max_tokens=len(ids))

    class Seq:
        def __init__(self, n: int) -> None:
            self.params, self.output_token_ids = params, ids[:n]

    first = next(n for n in range(1, len(ids) + 1) if llm._stop_string_hit(Seq(n)))  # type: ignore[arg-type]
    assert first == end
