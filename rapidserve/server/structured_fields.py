"""A request's structured-output fields -> one `StructuredOutputs`, checked before admission.

`structured_outputs.disable_additional_properties` closes a json schema's objects (structured_outputs.closed_objects);
`disable_any_whitespace` is always so here (JSON is compact); `whitespace_pattern`, `structural_tag` (there and as
a response_format type) are refused by name (unsupported.py, here).
Accepted (vLLM's and OpenAI's names), on every endpoint: `response_format` `{"type": "json_object"}` and
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (OpenAI's on chat, vLLM's on
completions too), `structured_outputs` ({json, regex, choice, grammar, json_object}) and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. At most one of them may be set (a text
response_format counts as none); more is a 400 naming them. The constraint is compiled here, in the
server process (`rapidserve.structured.check`, cached per constraint in the `ProtocolContext`), so an
invalid schema, regex or grammar is a 400 naming its field and never reaches a worker; a server
without the grammar engine answers 501 naming the field and stays up. Then (`check_servable`, off the
event loop: it takes a compile and a few masks, seconds for the worst) it is compiled against the
model's tokenizer and tried on its first steps (`rapidserve.structured.trial`), so a constraint beyond
the grammar engine's limits (e.g. the regex `(b{1000}){1000}`, which runs its lexer out of fuel) is a 400
naming its field with the engine's reason, each time it is sent (the verdict is cached as a failure).
"""

from __future__ import annotations

import json
from typing import Any

from rapidserve.sampling_params import SamplingParamsError, StructuredOutputs
from rapidserve.server.errors import APIError, bad_request
from rapidserve.server.schemas import RequestBody
from rapidserve.structured import GrammarCache, GrammarError, GrammarTrials
from rapidserve.structured_outputs import closed_objects


def _schema_text(v: dict[str, Any] | str, param: str) -> str:
    if isinstance(v, str):
        try:
            json.loads(v)
        except ValueError as e:
            raise bad_request(param, f"'{param}' must be a JSON schema (an object or its JSON text): {e}") from None
        return v
    return json.dumps(v, ensure_ascii=False)


def _candidates(r: RequestBody) -> list[tuple[str, StructuredOutputs]]:
    """Every structured-output field the request sets, as (its name, the constraint)."""
    out: list[tuple[str, StructuredOutputs]] = []
    rf = r.response_format
    if rf is not None and rf.type == "structural_tag":
        raise bad_request("response_format", "'response_format' of type structural_tag is not supported by this "
                                             "server: use json_schema, json_object, structured_outputs or tools")
    for name in ("structures", "triggers", "format"):
        if rf is not None and getattr(rf, name) is not None:
            raise bad_request("response_format", f"'response_format.{name}' goes only with type structural_tag, "
                                                 "which this server does not support: leave it out")
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise bad_request("response_format", f"'response_format.json_schema' goes only with type json_schema, and "
                                             f"type is {rf.type}, which would not enforce it: send type "
                                             "json_schema, or leave json_schema out")
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", StructuredOutputs(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format", "'response_format' of type json_schema needs 'json_schema': "
                                                 "{\"name\": ..., \"schema\": {...}}")
        out.append(("response_format.json_schema.schema",
                    StructuredOutputs(json=_schema_text(rf.json_schema.schema, "response_format"))))
    if r.guided_json is not None:
        out.append(("guided_json", StructuredOutputs(json=_schema_text(r.guided_json, "guided_json"))))
    if r.guided_regex is not None:
        out.append(("guided_regex", StructuredOutputs(regex=r.guided_regex)))
    if r.guided_choice is not None:
        out.append(("guided_choice", StructuredOutputs(choice=tuple(r.guided_choice))))
    if r.guided_grammar is not None:
        out.append(("guided_grammar", StructuredOutputs(grammar=r.guided_grammar)))
    so = r.structured_outputs
    if so is not None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(so, k) is not None and getattr(so, k) is not False]
        if len(set_) != 1:
            raise bad_request("structured_outputs", "'structured_outputs' must set exactly one of json, regex, "
                                                    f"choice, grammar, json_object; got {set_ or 'none'}")
        k = set_[0]
        v = getattr(so, k)
        if so.disable_additional_properties and k != "json":
            raise bad_request("structured_outputs", "'structured_outputs.disable_additional_properties' closes the "
                                                    f"objects of a JSON schema ('json'), and this one is '{k}', "
                                                    "which it would not change: leave it out")
        if so.disable_additional_properties and k == "json":
            v = closed_objects(json.loads(v) if isinstance(v, str) else v)
        c = StructuredOutputs(json=_schema_text(v, "structured_outputs.json")) if k == "json" else \
            StructuredOutputs(choice=tuple(v)) if k == "choice" else StructuredOutputs(**{k: v})
        out.append((f"structured_outputs.{k}", c))
    return out


def structured_field_of(r: RequestBody) -> str | None:
    """The name of the structured-output field the request sets (one, once `structured_outputs_of` passed)."""
    found = _candidates(r)
    return found[0][0] if found else None


def check_servable(so: StructuredOutputs, param: str, trials: GrammarTrials) -> None:
    """APIError naming `param` when the grammar engine cannot serve `so` with the model's tokenizer (slow
    the first time per constraint: call it off the event loop unless `trials.known(so)`)."""
    try:
        trials.check(so)
    except GrammarError as e:
        raise refusal(e, param, "cannot be enforced") from None


def structured_outputs_of(r: RequestBody, grammars: GrammarCache) -> StructuredOutputs | None:
    """The request's one constraint (compiled and validated through `grammars`), or None; APIError
    naming the field otherwise."""
    try:
        found = _candidates(r)
    except SamplingParamsError as e:
        raise bad_request("structured_outputs", str(e)) from None
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(n.split(".")[0] for n, _ in found)
        raise bad_request(found[1][0].split(".")[0], f"set at most one structured-output field; this request sets "
                                                     f"{names}")
    param, so = found[0]
    try:
        grammars.compile(so)
    except GrammarError as e:
        raise refusal(e, param, "is invalid") from None
    return so


def refusal(e: GrammarError, param: str, what: str) -> APIError:
    """The error a constraint the grammar engine refused gets: 501 when the engine cannot serve that kind of
    constraint at all, else a 400 naming `param` (`what`: how the constraint failed)."""
    if e.kind == "engine":
        return APIError(501, f"'{param}' cannot be served: {e}", type="not_implemented_error", param=param)
    return bad_request(param, f"'{param}' {what}: {e}")
