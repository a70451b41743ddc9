"""The OpenAPI document made to state what the API does: the real 422 shape, request-body $defs moved
to components (so their references resolve), and the errors every route can answer."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

VALIDATION_ERROR = {
    "title": "ValidationErrorOut",
    "type": "object",
    "required": ["detail"],
    "properties": {
        "detail": {"type": "string", "description": "Every problem, '<loc>: <msg>; ...'"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["loc", "msg"],
                "properties": {"loc": {"type": "string"}, "msg": {"type": "string"}},
            },
        },
    },
}
ERROR = {"type": "object", "required": ["detail"], "properties": {"detail": {"type": "string"}}}
# Answers any route can give: a body over its cap, a bad Content-Length, an unexpected error, the
# database unavailable (with Retry-After).
COMMON_ERRORS = {
    "400": "Malformed request",
    "408": "The body did not arrive in time (too slow, or past its deadline once its turn came); send it "
    "again",
    "413": "Body over its cap",
    "500": "Internal error",
    "503": "The database is unavailable (unreachable, restarting or out of connections); try again "
    "after Retry-After seconds",
}
UNSUPPORTED_ENCODING = "The body is compressed (a Content-Encoding other than identity): send it uncompressed"
AUTH_ERRORS = {"401": "No valid credential", "403": "The credential lacks the scope or source"}


def _hoist_defs(node: Any, defs: dict[str, Any]) -> Any:
    """Move ``$defs`` of embedded model schemas into ``defs`` and point their references there."""
    if isinstance(node, dict):
        for name, schema in node.pop("$defs", {}).items():
            defs[name] = _hoist_defs(schema, defs)
        return {key: _hoist_defs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_hoist_defs(item, defs) for item in node]
    return node


def _error_response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def fix_openapi(document: dict[str, Any]) -> dict[str, Any]:
    components = document.setdefault("components", {}).setdefault("schemas", {})
    components["HTTPValidationError"] = VALIDATION_ERROR
    components.pop("ValidationError", None)
    text = json.dumps(document).replace('"#/$defs/', '"#/components/schemas/')
    document = json.loads(text)
    defs: dict[str, Any] = {}
    document["paths"] = _hoist_defs(document["paths"], defs)
    for name, schema in defs.items():
        document["components"]["schemas"].setdefault(name, schema)
    for operations in document["paths"].values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for code, description in COMMON_ERRORS.items():
                responses.setdefault(code, _error_response(description, ERROR))
            if "requestBody" in operation:  # (read_body: a compressed body is not decoded)
                responses.setdefault("415", _error_response(UNSUPPORTED_ENCODING, ERROR))
            if operation.get("security"):  # the route needs a credential: say what refusing it looks like
                for code, description in AUTH_ERRORS.items():
                    responses.setdefault(code, _error_response(description, ERROR))
            responses["422"] = _error_response(
                "Validation error", {"$ref": "#/components/schemas/HTTPValidationError"}
            )
    return document


def install_openapi(app: FastAPI) -> None:
    """Serve the corrected document at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
                tags=app.openapi_tags,
            )
            app.openapi_schema = fix_openapi(document)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


__all__ = ["fix_openapi", "install_openapi"]
