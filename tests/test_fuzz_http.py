"""Schemathesis against a real CPU server, from its own /openapi.json: no 5xx, and every 4xx an OpenAI error body.

Every route is fuzzed with bodies that fit the schema (positive) and bodies that do not (negative);
the generation routes with `stream` forced off and on. The document is fetched from the server;
only the test's copy is narrowed so generation stays quick on 2 cores: at most 4 new tokens, n <= 2,
batches of at most 3 prompts and token ids inside the vocabulary (so valid requests do run).
Examples are bounded (MAX_EXAMPLES per route x mode x stream) to keep the test under two minutes. In
positive mode some generation must have run (200), so the narrowing cannot silently drift into
testing only refusals; negative mode may see 200s where the narrowed copy is stricter than the server.
Hypothesis draws a test's examples first (derandomized: the same ones every run, whatever the server
answers); they are then sent all at once, as concurrent clients would (the generating ones share the
engine's batches: one at a time, each waited for its few decode steps alone), and every answer is checked.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.test_server import Srv, http, start, stop

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

VOCAB = 49152  # SmolLM2
MAX_EXAMPLES = {"positive": 25, "negative": 60}  # per route x stream mode: about 100 s in all on 2 cores
GENERATION = ("/v1/completions", "/v1/chat/completions", "/generate")
GETS = ("/v1/models", "/health", "/metrics", "/openapi.json")


@pytest.fixture(autouse=True)
def _same_examples_in_any_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypothesis (6.131+) also draws constants it finds in the source of every non-test module loaded so far,
    so which examples came depended on what else the session had imported: in the whole suite they included
    max_tokens=104 (a constant of some module), each such example a 104-token generation (~85 s of the run;
    ~2 s alone). Its built-in constants only, as in any session: `derandomize` gives the same examples again."""
    from hypothesis.internal.conjecture import providers

    if hasattr(providers, "_get_local_constants"):
        monkeypatch.setattr(providers, "_get_local_constants", lambda: providers.Constants())
        providers.CONSTANTS_CACHE.cache.clear()  # (type, constraints) -> (global, local) constants drawn before


@pytest.fixture(scope="module")
def srv() -> Iterator[Srv]:
    s = start("--default-max-tokens", "4")  # requests that leave max_tokens out stay quick too
    yield s
    assert stop(s) == 0


@pytest.fixture(scope="module")
def schema(srv: Srv) -> Any:
    status, _, raw = http(srv.url + "/openapi.json")
    assert status == 200
    schemathesis.openapi.from_dict(json.loads(raw)).validate()  # the server's own document is valid OpenAPI
    models = json.loads(http(srv.url + "/v1/models")[2])["data"]
    schema = schemathesis.openapi.from_dict(_narrowed(json.loads(raw), models[0]["id"]))
    schema.config.max_stream_events = 10_000  # read whole streams (the default stops after 20 events)
    return schema


def _narrowed(doc: dict[str, Any], model: str) -> dict[str, Any]:
    """The test's copy of the document, narrowed so that positive cases mostly generate (the server still
    validates against its own): few new tokens and samples, short batches and texts, token ids in the
    vocabulary, the served model, the features the server refuses (tools...) and the logit controls whose valid
values depend on the model (logit_bias keys, allowed_token_ids, bad_words) left neutral; the penalties vary."""
    doc = copy.deepcopy(doc)
    limits = {"max_tokens": 4, "max_completion_tokens": 4, "max_new_tokens": 4, "min_tokens": 4, "n": 2}
    neutral = {"model": [model], "logit_bias": [{}], "allowed_token_ids": [None], "bad_words": [None],
               "tools": [[]], "tool_choice": ["none", "auto"], "suffix": [""], "best_of": [None]}

    def walk(node: Any, field: str) -> None:  # every schema under one property (structs are their own entries)
        if isinstance(node, dict):
            if node.get("type") == "integer" and field in limits:
                node["maximum"] = min(node.get("maximum", limits[field]), limits[field])
            if node.get("type") == "integer" and field in ("prompt", "stop_token_ids"):
                node["maximum"] = VOCAB - 1
            if node.get("type") == "array" and field in ("prompt", "messages", "stop_token_ids"):
                node["maxItems"] = min(node.get("maxItems", 3), 3)
            if node.get("type") == "string" and field in ("prompt", "stop", "content", "text"):
                node["maxLength"] = min(node.get("maxLength", 40), 40)
            for child in node.values():
                walk(child, field)
        elif isinstance(node, list):
            for child in node:
                walk(child, field)

    schemas = doc["components"]["schemas"]
    for struct in schemas.values():
        for name, prop in struct.get("properties", {}).items():
            walk(prop, name)
            if name in neutral:
                struct["properties"][name] = {"enum": neutral[name]}
    message = schemas["ChatMessage"]  # content may be null or left out only for the assistant: always send it
    message["properties"]["content"]["anyOf"] = [s for s in message["properties"]["content"]["anyOf"]
                                                 if s.get("type") != "null"]
    message["required"] = ["role", "content"]
    schemas["ResponseFormat"]["properties"]["type"] = {"enum": ["text"]}
    return doc


def _as_sent(body: dict[str, Any], stream: bool) -> None:
    """A positive body as a client sends it: integral numbers as JSON integers (JSON Schema lets a
    fuzzer write 38.0 for an integer; the server, like OpenAI's clients, takes 38), `stream` forced,
    and `stream_options` only with a stream."""
    def ints(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            return int(v)
        if isinstance(v, list):
            return [ints(x) for x in v]
        return {k: ints(x) for k, x in v.items()} if isinstance(v, dict) else v

    for key in [k for k in body if k not in ("temperature", "top_p", "min_p")]:
        body[key] = ints(body[key])
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)


def _check(response: Any, stream: bool | None) -> None:
    status = response.status_code
    body = response.content
    assert status < 500, f"{status}: {body[:500]!r}"
    if 400 <= status < 500:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
        assert "param" in err and "code" in err, err
    elif status == 200 and stream:
        assert not response.stream_cut_short
        text = body.decode()
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        for event in text.split("\n\n")[:-2]:
            assert "error" not in json.loads(event.removeprefix("data: ")), event


def _fuzz(srv: Srv, schema: Any, method: str, path: str, mode: str, stream: bool | None) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    op = schema[path][method]
    strategy = op.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    cases: list[Any] = []

    @settings(max_examples=MAX_EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def draw(case: Any) -> None:
        if stream is not None and isinstance(case.body, dict):
            if mode == "positive":
                _as_sent(case.body, stream)
            else:
                case.body["stream"] = stream
        cases.append(case)

    draw()
    assert cases

    def send(case: Any) -> tuple[int, str | None]:
        response = case.call(base_url=srv.url, timeout=120)
        try:
            _check(response, stream if isinstance(case.body, dict) else None)
        except AssertionError as e:
            return response.status_code, f"{case.method} {case.path} {case.body!r:.500}: {e}"
        return response.status_code, None

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(send, cases))
    statuses = [status for status, _ in results]
    failed = [why for _, why in results if why is not None]
    assert not failed, f"{len(failed)} of {len(cases)} answers wrong:\n" + "\n".join(failed)
    if mode == "positive":  # the narrowing keeps valid requests coming: some must have generated
        assert 200 in statuses, statuses


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", GENERATION)
def test_fuzz_generation(srv: Srv, schema: Any, path: str, mode: str, stream: bool) -> None:
    _fuzz(srv, schema, "POST", path, mode, stream)


@pytest.mark.parametrize("path", GETS)
def test_fuzz_gets(srv: Srv, schema: Any, path: str) -> None:
    _fuzz(srv, schema, "GET", path, "positive", None)


def test_server_still_healthy(srv: Srv) -> None:
    assert http(srv.url + "/health")[0] == 200
