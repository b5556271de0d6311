"""The request edge and response shaping under one name, for `server/app.py` (`proto.*`).

The code lives in its own modules: schemas.py (the request bodies as msgspec Structs), body.py
(headers; body bytes -> the typed body), requests.py (-> `GenRequest`), responses.py (the answers),
errors.py (`APIError` and the OpenAI error body), openapi.py (GET /openapi.json). New code imports
those directly; this module only re-exports what the server's handlers use.
"""

from __future__ import annotations

from rapidserve.server.body import check_headers
from rapidserve.server.errors import APIError
from rapidserve.server.openapi import openapi_document
from rapidserve.server.requests import (
    GenRequest,
    ProtocolContext,
    parse_request,
    parse_request_async,
)
from rapidserve.server.responses import (
    chat_role_chunk,
    final_response,
    stream_chunk,
    usage_chunk,
    usage_dict,
)

__all__ = ["APIError", "GenRequest", "ProtocolContext", "chat_role_chunk", "check_headers", "final_response",
           "openapi_document", "parse_request", "parse_request_async", "stream_chunk", "usage_chunk", "usage_dict"]
