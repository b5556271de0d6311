"""How a structured-output constraint that fails is told apart from a failure of the engine, on CPU without
a model: each failed row keeps its own message (`fill_or_blame`, `RequestsFailed.blame`), the fault
travels in `Finished.fault` (old senders decode as ""), the router raises `ConstraintFailed` for it, and
the server answers that with a 400 naming the request's field, never a 503 engine_unavailable."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from rapidserve.engine import messages as m
from rapidserve.engine.client import _error_of
from rapidserve.engine.errors import ConstraintFailed, EngineError
from rapidserve.engine.faults import RequestsFailed, describe, fault_of, fill_or_blame
from rapidserve.sampling_params import SamplingParams, StructuredOutputs
from rapidserve.server.middleware import api_error, error_body
from rapidserve.structured import GrammarError
from rapidserve.structured.matchers import GrammarRow


class FailingBook:
    """A GrammarBook whose fill fails the rows it is told to, each with its own message."""

    def __init__(self, failed: dict[int, str]) -> None:
        self.failed = failed

    def fill(self, rows: Any, pin: bool) -> tuple[str, dict[int, str]]:
        return "mask", {r.row: self.failed[r.row] for r in rows if r.row in self.failed}


def _row(i: int, **so: Any) -> GrammarRow:
    return GrammarRow(i, f"r{i}", SamplingParams(structured_outputs=StructuredOutputs(**so)), [])


def test_each_failed_row_keeps_its_own_message_and_the_constraint_fault() -> None:
    rows = [_row(0, regex="a"), _row(2, json='{"type": "object"}'), _row(3, regex="b")]
    batch = ["req0", "free1", "req2", "req3"]
    assert fill_or_blame(FailingBook({}), rows, batch, pin=False) == "mask"
    with pytest.raises(RequestsFailed) as ei:
        fill_or_blame(FailingBook({0: "a's secret grammar broke", 3: "b broke"}), rows, batch, pin=False)
    e = ei.value
    assert e.rows == [0, 3] and e.reqs == ["req0", "req3"]
    assert e.blame("sampling") == [("req0", "a's secret grammar broke", m.STRUCTURED_FAULT),
                                   ("req3", "b broke", m.STRUCTURED_FAULT)]  # never the other's message
    assert all(isinstance(x, GrammarError) and x.kind == "regex" for x in e.errors.values())


@pytest.mark.parametrize(("error", "message", "fault"), [
    (GrammarError("regex", "the grammar engine cannot serve this regex constraint: lexer error"),
     "the grammar engine cannot serve this regex constraint: lexer error", m.STRUCTURED_FAULT),
    (RuntimeError("boom"), "sampling failed: RuntimeError: boom", ""),
    (MemoryError("no room"), "sampling failed: MemoryError: no room", ""),
])
def test_describe_and_fault_of(error: BaseException, message: str, fault: str) -> None:
    assert describe(error, "sampling") == message and fault_of(error) == fault
    failed = RequestsFailed([1], error)
    failed.reqs = ["x"]
    assert failed.blame("sampling") == [("x", message, fault)]


def test_the_fault_travels_in_finished_and_prefill_failed_and_old_messages_decode_without_one() -> None:
    for msg in (m.Finished("r", "error", "why", m.STRUCTURED_FAULT), m.PrefillFailed("r", 0, "why", "x")):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg)) == msg
    old = msgspec.msgpack.encode({"type": "Finished", "req_id": "r", "reason": "error", "message": "w"})
    assert msgspec.msgpack.decode(old, type=m.Finished).fault == ""


@pytest.mark.parametrize(("finished", "raised"), [
    (m.Finished("r", "stop"), None),
    (m.Finished("r", "abort"), None),
    (m.Finished("r", "error", "worker trouble"), EngineError),
    (m.Finished("r", "error", "the grammar engine cannot serve ...", m.STRUCTURED_FAULT), ConstraintFailed),
])
def test_the_router_raises_constraint_failed_only_for_the_constraint_fault(finished: m.Finished,
                                                                        raised: type | None) -> None:
    err = _error_of(finished)
    assert (err is None) if raised is None else (type(err) is raised and str(err) == finished.message)


def test_the_server_answers_a_failed_constraint_400_naming_its_field_and_an_engine_failure_503() -> None:
    e = api_error(ConstraintFailed("the grammar engine cannot serve this regex constraint: lexer error"),
                   "guided_regex")
    assert e.status == 400 and e.param == "guided_regex" and e.type == "invalid_request_error"
    assert e.code == "structured_output_failed" and "'guided_regex' could not be enforced" in e.message
    assert "lexer error" in e.message
    body = error_body(ConstraintFailed("x broke"), "response_format.json_schema.schema")  # a stream's error event
    assert body["param"] == "response_format.json_schema.schema" and body["code"] == "structured_output_failed"
    down = api_error(EngineError("decode worker died"), "guided_regex")
    assert down.status == 503 and down.code == "engine_unavailable"
