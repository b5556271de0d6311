"""GET /openapi.json: an OpenAPI 3.1 document of the server's routes, generated from its msgspec types.

The request bodies (schemas.py) and the error body (errors.py) are the types the server decodes and
answers with, so the document cannot drift from what is validated. Generated answers are described
loosely (an object, or an SSE stream when `stream` is true); every error status a route can answer
(400/401/404/413/415/503) carries the OpenAI error body.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import msgspec

from rapidserve import __version__
from rapidserve.server.errors import ErrorResponse
from rapidserve.server.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest, prompt_json_schema
from rapidserve.server.utility_routes import DetokenizeRequest, TokenizeRequest

_ERRORS = MappingProxyType({
    "400": "invalid request: `error.param` names the field at fault",
    "401": "missing or invalid API key (only when the server runs with --api-key)",
    "404": "unknown model",
    "413": "the request body is larger than the server's limit",
    "415": "the body is not sent as `Content-Type: application/json`",
    "503": "the server is at capacity or shutting down: retry after `Retry-After` seconds",
})


def _json(schema: dict[str, Any], description: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"description": description, "content": {content_type: {"schema": schema}}}


def _errors(*statuses: str) -> dict[str, Any]:
    return {s: _json({"$ref": "#/components/schemas/ErrorResponse"}, _ERRORS[s]) for s in statuses}


def _op(summary: str, responses: dict[str, Any], public: bool, body: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses,
                          "security": [] if public else [{}, {"bearer": []}]}  # the key only with --api-key
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def _generation(summary: str, body: dict[str, Any]) -> dict[str, Any]:
    ok = {"description": "the generated answer; with `stream: true`, server-sent events ending with `data: [DONE]`",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {"post": _op(summary, {"200": ok, **_errors("400", "401", "404", "413", "415", "503")}, False, body)}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route (served at GET /openapi.json)."""
    (completion, chat, generate, _, tokenize, detokenize), components = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, GenerateRequest, ErrorResponse, TokenizeRequest, DetokenizeRequest],
        ref_template="#/components/schemas/{name}")
    components["CompletionRequest"]["properties"]["prompt"].update(prompt_json_schema())
    health = {"type": "object", "properties": {"status": {"type": "string"}, "reason": {"type": "string"}},
              "required": ["status"]}
    obj = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rapidserve", "version": __version__,
                 "description": "OpenAI-compatible LLM serving. A request field the server does not know, or a "
                                "feature it lacks, is refused with a 400 naming it (never ignored)."},
        "paths": {
            "/v1/completions": _generation("Text completions (OpenAI)", completion),
            "/v1/chat/completions": _generation("Chat completions (OpenAI)", chat),
            "/generate": _generation("Plain generation: {text, meta_info} (with return_token_ids also token_ids, "
                                     "prompt_token_ids)", generate),
            "/v1/models": {"get": _op("The served model", {"200": _json(obj, "the model list"),
                                                           **_errors("401")}, False)},
            "/health": {"get": _op("Readiness", {"200": _json(health, "ready"),
                                                 "503": _json(health, "starting, restarting, down or draining")},
                                   True)},
            "/metrics": {"get": _op("Prometheus metrics", {"200": _json({"type": "string"}, "metrics in the "
                                                                        "Prometheus text format", "text/plain")},
                                    False)},  # public with --metrics-public
            "/openapi.json": {"get": _op("This document", {"200": _json(obj, "the OpenAPI document")}, True)},
            "/tokenize": {"post": _op("Token ids of a text or a chat (vLLM): {count, max_model_len, tokens, "
                                      "token_strs}", {"200": _json(obj, "the tokens"),
                                                      **_errors("400", "401", "404", "413", "415")}, False, tokenize)},
            "/detokenize": {"post": _op("The text of token ids (vLLM): {prompt}", {"200": _json(obj, "the text"),
                                        **_errors("400", "401", "404", "413", "415")}, False, detokenize)},
            "/version": {"get": _op("rapidserve's version: {version}", {"200": _json(obj, "the version")}, True)},
            "/ping": {m: _op("Readiness, as /health (vLLM, SageMaker)", {
                "200": _json(health, "ready"), "503": _json(health, "starting, restarting, down or draining")}, True)
                for m in ("get", "post")},
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
