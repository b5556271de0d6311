"""The request edge before any model knowledge: headers, then body bytes -> the endpoint's typed Struct.

`check_headers` refuses a POST not declared as `Content-Type: application/json` (charset utf-8 or
none) with 415 and a declared body over the server's limit with 413. `decode_body` refuses, with
400: an empty body, bytes that are not UTF-8, arrays/objects nested more than MAX_DEPTH deep (found
by C-speed passes over the bytes, never by recursion), JSON that does not parse (the message shows
where, and names the field whose value is malformed), and any value of the wrong type or out of
the static ranges of schemas.py, where msgspec's `$.path` becomes `param` and the message quotes
the field's description, and any field the Struct does not declare (named, with the nearest field it does).
"""

from __future__ import annotations

import difflib
import re
from typing import TypeVar

import msgspec
import msgspec.inspect as mi
import numpy as np

from rapidserve.server.errors import APIError, bad_request, show
from rapidserve.server.schemas import RequestBody, body_type

S = TypeVar("S", bound=msgspec.Struct)

MAX_DEPTH = 64  # arrays/objects nested deeper than this are refused (the schemas need 4)
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", bytes([1, 1, 255, 255]))  # +1 / -1 as int8
_JSON = "send 'Content-Type: application/json' and a JSON object as the body"
_ERROR_AT = re.compile(r"(?s)(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?")


def check_headers(content_type: str | None, content_length: int | None, max_body_bytes: int) -> None:
    """Refuse a POST whose body is not declared as JSON (415) or is declared too large (413)."""
    if content_type is None or not content_type.strip():
        raise APIError(415, f"the request has no Content-Type: {_JSON}", code="unsupported_media_type")
    mime, *params = (p.strip() for p in content_type.split(";"))
    if mime.lower() != "application/json":
        raise APIError(415, f"Content-Type {show(mime)} is not supported: {_JSON}", code="unsupported_media_type")
    for p in params:
        key, _, value = p.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise APIError(415, f"charset {show(charset)} is not supported: the body must be UTF-8 ({_JSON})",
                           code="unsupported_media_type")
    if content_length is not None and content_length > max_body_bytes:
        raise APIError(413, f"the request body is {content_length} bytes, more than this server's limit of "
                            f"{max_body_bytes} bytes", code="request_too_large")


def nesting_depth(body: bytes) -> int:
    """How deep arrays and objects nest in the JSON `body` (brackets in strings do not count); 0 when
    the body has at most MAX_DEPTH brackets at all. C-speed passes over the bytes, no recursion."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return 0
    # drop escaped backslashes, then escaped quotes: every quote left delimits a string
    outside = b"".join(body.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    steps = np.frombuffer(outside.translate(_BRACKET_STEPS, _NOT_BRACKETS), np.int8)
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def _field_help(typ: type[msgspec.Struct], name: str) -> str | None:
    """The `description` of field `name` of `typ` (what it allows), if it has one."""
    for f in mi.type_info(typ).fields:  # type: ignore[attr-defined]
        if f.encode_name != name:
            continue
        t = f.type
        if isinstance(t, mi.UnionType):  # `X | None`: the description is X's
            members = [m for m in t.types if not isinstance(m, mi.NoneType)]
            t = members[0] if len(members) == 1 else t
        if isinstance(t, mi.Metadata) and t.extra_json_schema:
            return t.extra_json_schema.get("description")
    return None


def _validation_error(e: msgspec.ValidationError, typ: type[msgspec.Struct]) -> APIError:
    m = _ERROR_AT.fullmatch(str(e))
    what, path = (m["what"], m["path"] or "") if m else (str(e), "")
    missing = re.fullmatch(r"Object missing required field `(.+)`", what)
    if missing:
        path = f"{path}.{missing[1]}"
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", what)
    if unknown:
        return _unknown_field(f"{path}.{unknown[1]}".removeprefix("."), typ)
    where = path.removeprefix(".")
    if not where:
        return bad_request(None, f"the request body must be a JSON object: {what[:1].lower()}{what[1:]}")
    param = re.match(r"[^.\[]*", where)[0]  # type: ignore[index]
    message = f"'{where}' is required" if missing else f"invalid '{where}': {what[:1].lower()}{what[1:]}"
    # the field's help, also for errors inside the list fields whose help describes their items
    help = _field_help(typ, param) if "." not in where or param in ("messages", "tools", "tool_choice") else None
    return bad_request(param, message + (f" ('{param}' is {help})" if help else ""))


def _unknown_field(where: str, typ: type[msgspec.Struct]) -> APIError:
    """400 for a field the body's Struct does not declare: named, never dropped (vLLM ignores such fields)."""
    param = re.match(r"[^.\[]*", where)[0]  # type: ignore[index]
    near = difflib.get_close_matches(where, typ.__struct_fields__, n=1) if param == where else []
    hint = f"; did you mean '{near[0]}'?" if near else ": remove it"
    return bad_request(param, f"'{where}' is not a field this server knows (vLLM would ignore it; this server "
                              f"refuses it rather than drop what was asked for){hint}", code="unknown_field")


def _malformed(e: msgspec.DecodeError, body: bytes, typ: type[msgspec.Struct]) -> APIError:
    """400 for JSON that does not parse: where, the text around it, and the field whose value it is."""
    at = re.search(r"\(byte (\d+)\)", str(e))
    if at is None:
        return bad_request(None, f"the request body is not valid JSON: {e}")
    pos = int(at[1])
    key = re.search(rb'"(\w{1,64})"\s*:\s*-?$', body[max(0, pos - 80):pos])
    param = key[1].decode() if key and key[1].decode() in typ.__struct_fields__ else None
    near = body[max(0, pos - 12):pos + 12].decode(errors="replace")
    what = f" (the value of '{param}')" if param else ""
    hint = " (NaN and Infinity are not JSON numbers)" if "NaN" in near or "Infinity" in near else ""
    return bad_request(param, f"the request body is not valid JSON: {e}{what}, near {near!r}{hint}")


def decode_body(kind: str, body: bytes) -> RequestBody:
    """The body as the `kind` endpoint's Struct: UTF-8 JSON, an object, of the right types and ranges."""
    return decode_as(body_type(kind), body)


def decode_as(typ: type[S], body: bytes) -> S:
    """The body as `typ` (any request Struct, e.g. server/utility_routes.py's), checked as `decode_body` says."""
    if not body.strip():
        raise bad_request(None, f"the request body is empty: {_JSON}")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(None, f"the request body is not valid UTF-8 (at byte {e.start}): send JSON encoded "
                                "as UTF-8") from None
    if nesting_depth(body) > MAX_DEPTH:
        raise bad_request(None, f"the request body nests arrays or objects more than {MAX_DEPTH} levels deep")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise _validation_error(e, typ) from None
    except msgspec.DecodeError as e:
        raise _malformed(e, body, typ) from None
    except RecursionError:
        raise bad_request(None, "the request body is not valid JSON: it is nested too deeply") from None
