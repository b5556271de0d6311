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

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

CORPUS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
HYBRID_SUBSET = ("nested_address", "enum_array", "anyof_id")  # hybrid is slow on 2 CPU cores: a few suffice
PROMPT = [{"role": "user", "content": "Answer with one JSON value for the schema."}]


@pytest.fixture(scope="module", params=["rapid", "hybrid"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Srv, Any]]:
    s = start("--mode", request.param)
    try:
        yield request.param, s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
    finally:
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
    r = client.completions.create(model=model, prompt="Pick one:", max_tokens=8, extra_body={
        "guided_choice": ["alpha", "beta", "gamma"]})
    assert r.choices[0].text in ("alpha", "beta", "gamma") and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=24, stream=True,
                                            extra_body={"structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{2}"}})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert re.fullmatch("[a-c]{2,5}-[0-9]{2}", text), text
    r = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=64, temperature=0.7, seed=2,
                                       response_format={"type": "json_object"})
    c = r.choices[0]
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
