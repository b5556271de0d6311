"""Structured outputs end to end with the openai client against a real `rapidserve serve` of the
embedded model: every schema of tests/data/json_schemas.json (nested objects, arrays, enums, required
fields, bounded numbers and strings, anyOf, $ref...) in RAPID mode, a subset in hybrid mode, regex,
choice and json_object, streamed too; every json_schema answer parses and validates, and bad
constraints are 400s naming their field while the workers live on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.test_server import Srv, http, start, stop

jsonschema = pytest.importorskip("jsonschema")

CORPUS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
HYBRID_SUBSET = ("nested_address", "enum_array", "anyof_id")  # hybrid is slow on 2 CPU cores: a few suffice
PROMPT = [{"role": "user", "content": "Answer with one JSON value for the schema."}]


@pytest.fixture(scope="module", params=["rapid", "hybrid"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Srv, Any]]:
    """rapid: the session's default-flag server (tests/conftest.py; rapid is the default mode); hybrid: its own.
    (openai is imported here, not at collection: about 2 CPU-s in each pytest-xdist worker that never runs this.)"""
    openai = pytest.importorskip("openai")
    s = request.getfixturevalue("smol_server") if request.param == "rapid" else start("--mode", request.param)
    try:
        yield request.param, s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    finally:
        if request.param != "rapid":
            assert stop(s) == 0


def _schema_answer(client: Any, item: dict[str, Any], i: int) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=PROMPT, max_tokens=160, temperature=0.7, seed=i,
        response_format={"type": "json_schema",
                         "json_schema": {"name": item["name"], "schema": item["schema"], "strict": True}})


def test_every_json_schema_answer_parses_and_validates(served: tuple[str, Srv, Any]) -> None:
    mode, s, client = served
    corpus = CORPUS if mode == "rapid" else [c for c in CORPUS if c["name"] in HYBRID_SUBSET]
    assert mode != "rapid" or len(corpus) >= 20
    with ThreadPoolExecutor(len(corpus)) as pool:  # all at once: they share batches
        answers = list(pool.map(lambda a: _schema_answer(client, *a), [(c, i) for i, c in enumerate(corpus)]))
    wrong = []
    for item, r in zip(corpus, answers, strict=True):
        text = r.choices[0].message.content
        try:
            assert r.choices[0].finish_reason == "stop", "cut by max_tokens"
            jsonschema.validate(json.loads(text), item["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            wrong.append(f"{item['name']}: {str(e)[:200]}: {text[:200]!r}")
    assert not wrong, "\n".join(wrong)
    assert http(s.url + "/health")[0] == 200


def test_regex_choice_and_json_object_streamed_and_not(served: tuple[str, Srv, Any]) -> None:
    mode, s, client = served
    if mode == "hybrid":
        pytest.skip("hybrid: regex, choice and streaming are covered by tests/test_request_fields.py")
    model = client.models.list().data[0].id

    def choice() -> Any:
        return client.completions.create(model=model, prompt="Pick one:", max_tokens=8, extra_body={
            "guided_choice": ["alpha", "beta", "gamma"]})

    def regex_streamed() -> str:
        stream = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=24, stream=True, extra_body={
            "structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{2}"}})
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)

    def json_object() -> Any:
        return client.chat.completions.create(model=model, messages=PROMPT, max_tokens=64, temperature=0.7, seed=2,
                                              response_format={"type": "json_object"})

    with ThreadPoolExecutor(3) as pool:  # all at once: they share batches (each grammar masks its own row)
        r_choice, r_regex, r_json = (pool.submit(f) for f in (choice, regex_streamed, json_object))
        r, text, j = r_choice.result(), r_regex.result(), r_json.result()
    assert r.choices[0].text in ("alpha", "beta", "gamma") and r.choices[0].finish_reason == "stop"
    assert re.fullmatch("[a-c]{2,5}-[0-9]{2}", text), text
    c = j.choices[0]
    assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict), c


@pytest.mark.parametrize(("field", "value", "param"), [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
     "response_format.json_schema.schema"),
    ("guided_regex", "a(b", "guided_regex"),
    ("guided_grammar", "start: (", "guided_grammar"),
    ("structured_outputs", {"json": {"properties": {"a": {"$ref": "#/missing"}}}}, "structured_outputs.json"),
])
def test_bad_constraints_are_400_naming_the_field(served: tuple[str, Srv, Any], field: str, value: Any,
                                                  param: str) -> None:
    _, s, _ = served
    body = {"messages": PROMPT, "max_tokens": 4, field: value}
    status, _, raw = http(s.url + "/v1/chat/completions", "POST", json.dumps(body).encode(),
                          {"Content-Type": "application/json"})
    assert status == 400 and json.loads(raw)["error"]["param"] == param, raw
    assert http(s.url + "/health")[0] == 200


BEYOND_LIMITS = "(b{1000}){1000}"  # compiles, then runs llguidance's lexer out of fuel at the first mask


def _post(s: Srv, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, _, raw = http(s.url + path, "POST", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, raw if body.get("stream") else json.loads(raw)


@pytest.mark.parametrize(("field", "value", "param"), [
    ("guided_regex", BEYOND_LIMITS, "guided_regex"),
    ("structured_outputs", {"regex": BEYOND_LIMITS}, "structured_outputs.regex"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": f"^{BEYOND_LIMITS}$"}}}, "response_format.json_schema.schema"),
])
def test_a_constraint_beyond_the_grammar_engine_is_a_400_every_time_it_is_sent(
        served: tuple[str, Srv, Any], field: str, value: Any, param: str) -> None:
    """The reproduction: this request passed admission, then failed while sampling (a 503 engine_unavailable),
    and sent again got a 200 whose text did not match (the constraint dropped). Now it is tried at
    admission with the model's tokenizer: a 400 naming the field with the engine's reason, both times."""
    _, s, _ = served
    body = {"messages": PROMPT, "max_tokens": 8, field: value}
    for _ in range(2):
        status, got = _post(s, "/v1/chat/completions", body)
        assert status == 400, got
        err = got["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert f"'{param}' cannot be enforced" in err["message"] and "lexer error" in err["message"], err
        assert len(err["message"]) < 400, err
    assert http(s.url + "/health")[0] == 200


def test_a_constraint_that_breaks_while_generating_fails_alone_as_a_400_and_free_text_is_served(
        served: tuple[str, Srv, Any]) -> None:
    """LATE_FAILING_SCHEMA passes admission and breaks the worker's lexer once the answer reaches "b": that
    request ends with a 400 naming its field (an error event then [DONE] when streamed), never a 503 and
    never a 200 with the text so far; sent again (the worker remembers the failure) the same; a free-text
    request at the same time gets its 200; the workers live on."""
    from tests.test_structured import LATE_FAILING_SCHEMA

    _, s, _ = served
    constrained = {"messages": PROMPT, "max_tokens": 32, "temperature": 0,
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "late", "schema": LATE_FAILING_SCHEMA}}}
    free = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        late = pool.submit(_post, s, "/v1/chat/completions", constrained)
        story = pool.submit(_post, s, "/v1/completions", free)
        (status, got), (free_status, free_got) = late.result(), story.result()
    assert free_status == 200 and free_got["choices"][0]["finish_reason"] == "length", free_got
    for _ in range(2):
        assert status == 400, got
        err = got["error"]
        assert err["param"] == "response_format.json_schema.schema" and err["code"] == "structured_output_failed"
        assert "cannot serve this json constraint: lexer error" in err["message"], err
        status, got = _post(s, "/v1/chat/completions", constrained)
    status, raw = _post(s, "/v1/chat/completions", {**constrained, "stream": True})
    events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", raw
    err = json.loads(events[-2])["error"]
    assert err["code"] == "structured_output_failed" and err["param"] == "response_format.json_schema.schema", err
    assert http(s.url + "/health")[0] == 200
