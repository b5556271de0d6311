"""`StructuredOutputs`: a constraint on the generated text (vLLM's `StructuredOutputsParams`, by its field names).

It travels inside `SamplingParams` (sampling_params.py), so it is a frozen `msgspec.Struct`, validated on
construction and on decode; errors are `SamplingParamsError`s naming the field. Besides the constraint itself,
vLLM's other fields are taken as vLLM's Python users give them:
- `json` may be a schema object (a dict), kept as its JSON text; `json_object=None` is False (vLLM's default);
- `disable_additional_properties`: honoured, each object schema of `json` that does not say is closed
  (`closed_objects`; applying it again changes nothing, so a decoded copy is the same);
- `disable_any_whitespace`: accepted with any value, it changes nothing (vllm_reasons.NO_EFFECT);
- `whitespace_pattern`, `structural_tag`: refused unless None, for vllm_reasons.WHY's reasons (the HTTP API's).
"""

from __future__ import annotations

from json import dumps, loads
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from rapidserve.sampling_checks import SamplingParamsError, check, unsupported
from rapidserve.vllm_reasons import WHY

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "contains",
            "additionalItems", "unevaluatedProperties", "unevaluatedItems")  # a schema or a list of schemas


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True):
    """A constraint on the generated text, enforced by the grammar engine (vLLM's field names).

    Exactly one is set:
    - json: a JSON schema, as JSON text (or a dict, kept as its text); the output is one JSON value that validates
      against it;
    - json_object: True = any JSON object;
    - regex: the whole output matches this regular expression;
    - choice: the output is exactly one of these strings;
    - grammar: an EBNF / Lark grammar (as the grammar engine reads it).
    And vLLM's options (see the module docstring): disable_additional_properties (closes json's objects),
    disable_any_whitespace (no effect), whitespace_pattern and structural_tag (refused unless None).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            force_setattr(self, "choice", tuple(self.choice))
        if self.json_object is None:
            force_setattr(self, "json_object", False)
        if isinstance(self.json, dict):
            force_setattr(self, "json", dumps(self.json, ensure_ascii=False))
        self.validate()
        if self.disable_additional_properties and self.json is not None:
            try:
                schema = loads(self.json)
            except ValueError:
                return  # not JSON: the grammar engine's compile names it
            closed = closed_objects(schema)
            if closed != schema:
                force_setattr(self, "json", dumps(closed, ensure_ascii=False))

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        for name in STRUCTURED_KINDS:
            v = getattr(self, name)
            if v is not None and v is not False:
                return name
        raise SamplingParamsError("structured_outputs: no constraint set")

    def validate(self) -> None:
        """Raise `SamplingParamsError` naming the first invalid field."""
        set_ = [n for n in STRUCTURED_KINDS if getattr(self, n) is not None and getattr(self, n) is not False]
        check(len(set_) == 1, f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                              f"got {set_ or 'none'}")
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            check(isinstance(v, bool), f"structured_outputs.{name}={v!r} must be a bool")
        check(not self.disable_additional_properties or self.json is not None,
              f"structured_outputs.disable_additional_properties=True closes the objects of a JSON schema (json), and "
              f"this constraint is {set_[0]}, which it would not change: leave it False")
        for name in ("json", "regex", "grammar"):
            v = getattr(self, name)
            check(v is None or (isinstance(v, str) and v.strip() != ""),
                  f"structured_outputs.{name} must be a non-empty string")
        check(self.choice is None or (isinstance(self.choice, tuple) and len(self.choice) > 0
                                      and all(isinstance(c, str) and c for c in self.choice)),
              f"structured_outputs.choice={self.choice!r} must be a non-empty list of non-empty strings")
        for name in ("whitespace_pattern", "structural_tag"):
            v = getattr(self, name)
            if v is not None:
                raise unsupported(f"structured_outputs.{name}", v, "None", WHY[f"structured_outputs.{name}"])


StructuredOutputsParams = StructuredOutputs  # vLLM's name for it


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that does not say (vLLM's
    structured_outputs.disable_additional_properties)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in (*_SCHEMAS, "additionalProperties"):
        if key in out:
            out[key] = closed_objects(out[key])
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
