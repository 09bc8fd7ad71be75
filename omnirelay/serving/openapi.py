"""The OpenAPI description of the routes that read their body themselves.

The endpoints take a raw ``Request`` and parse it with :mod:`omnirelay.serving.protocol`
(a size cap while reading, a depth cap, messages that name the field), so FastAPI cannot
see their bodies. :func:`json_operation` gives such a route a real ``requestBody`` (the
pydantic model's JSON schema, references inlined) and its error responses, through
``openapi_extra``: the schema is built once at start-up and nothing runs per request.
Clients, code generators and the fuzzing suite read it from ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["ERROR_SCHEMA", "error_responses", "json_operation"]

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_ERRORS = {
    "400": "the body or a header is invalid (the message names the field)",
    "401": "no valid API key (the server was started with --api-key)",
    "403": "the request comes from a browser origin that is not allowed",
    "404": "the model does not exist on this server",
    "409": "the X-Request-Id is already in flight",
    "413": "the body is larger than the server accepts",
    "415": "the body is not sent as application/json",
    "429": "over capacity; retry after the Retry-After header's seconds",
    "503": "the pipeline cannot take requests",
}


def error_responses(*statuses: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses (all when none are named)."""
    chosen = statuses or tuple(_ERRORS)
    out: dict[int | str, dict[str, Any]] = {
        s: {"description": _ERRORS[s], "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        for s in chosen
    }
    return out


def json_operation(model: type[BaseModel], ok: dict[str, Any], served: str) -> dict[str, Any]:
    """``openapi_extra`` of a route whose JSON body is ``model`` and whose 200 is ``ok``;
    the body's ``model`` field names the one model ``served``."""
    schema = _inline(model.model_json_schema())
    if "model" in schema.get("properties", {}):
        schema["properties"]["model"] = {"anyOf": [{"enum": [served]}, {"type": "null"}], "default": None}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {"200": ok, **error_responses()},
    }


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``#/$defs/...`` references replaced by the definitions (the
    request models are not recursive), so it stands alone inside the OpenAPI document."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    out: dict[str, Any] = resolve(schema)
    return out
