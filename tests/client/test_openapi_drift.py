"""The client's models and paths against the live app's OpenAPI document: every call the client makes
names a route the app serves, and the model it parses the answer with has the fields, types and
required-ness of the schema the app documents (walked through every nested schema). A server change
the client does not mirror fails here."""

from __future__ import annotations

import copy
import inspect
import re
from typing import Any

import pytest

from factmill_client import calls, models
from worker import db
from worker.api.app import create_app
from worker.config_store import ConfigReader
from worker.runtime import Runtime
from worker.settings import Settings

REF = "#/components/schemas/"

# Every call the client can make, with sample arguments (a test below checks none is missing).
MAKERS: list[tuple[Any, tuple[Any, ...]]] = [
    (calls.ingest, ({}, None)),
    (calls.ingest_pages, ([], None)),
    (calls.append_messages, ("t", [], None, None)),
    (calls.retry_job, (1, True)),
    (calls.set_config, ("k", 1)),
    (calls.unset_config, ("k",)),
    (calls.delete_page, ("s", "a/b")),
    (calls.delete_transcript, ("t",)),
    (calls.get_job, (1,)),
    (calls.list_jobs, ("queued", "extraction", 1, 2)),
    (calls.list_pages, ("s", "a/", 1, "s|a/b")),
    (calls.page_facts, ("s", "a/b", 1, 0)),
    (calls.entity_facts, ("people/a", "s", 1, 0)),
    (calls.search, ("q", {})),
    (calls.get_config, ("k",)),
    (calls.list_config, ()),
    (calls.get_transcript, ("t",)),
    (calls.list_transcripts, (5,)),
    (calls.start_backfill, ({"source_id": "s"},)),
    (calls.get_backfill, (1,)),
    (calls.list_backfills, ("done", 5, 2)),
    (calls.cancel_backfill, (1,)),
    (calls.get_context, ("t",)),
    (calls.list_messages, ("t", 1, 1)),
    (calls.set_transcript_settings, ("t", {"context_window": 9000}, None)),
    (calls.list_compactions, ("t", 5, 2)),
    (calls.record_feedback, (0.5, True, "eval", 3, None)),
    (calls.get_calibration, (5,)),
]
CALLS: list[calls.Call[Any]] = [maker(*args) for maker, args in MAKERS]


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    """The document the app serves at /openapi.json (building it opens no connection)."""
    settings = Settings(
        database_url="postgresql+psycopg://nobody@127.0.0.1:1/none",
        broker_url="redis://127.0.0.1:1/0",
        webhook_secret="s",
        admin_token="a",
    )
    factory = db.session_factory(settings.database_url)
    app = create_app(Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0)))
    return app.openapi()


def shape(node: dict[str, Any]) -> Any:
    """What a schema says a value is, without titles, descriptions and bounds."""
    if "$ref" in node:
        return ("ref", node["$ref"].removeprefix(REF).removeprefix("#/$defs/"))
    if "anyOf" in node:
        return ("anyOf", frozenset(shape(option) for option in node["anyOf"]))
    kind = node.get("type")
    if kind == "array":
        return ("array", shape(node.get("items", {})))
    if kind == "object":
        extra = node.get("additionalProperties")
        return ("object", shape(extra) if isinstance(extra, dict) else extra)
    if kind == "string":
        return ("string", node.get("format"))
    return (kind,)


def differences(name: str, client: dict[str, Any], server: dict[str, Any]) -> list[str]:
    """How the client's schema ``client`` of ``name`` differs from the server's: missing or extra fields,
    required-ness, types."""
    found: list[str] = []
    ours, theirs = client.get("properties", {}), server.get("properties", {})
    for field in sorted(set(ours) ^ set(theirs)):
        where = "only the client" if field in ours else "only the server"
        found.append(f"{name}.{field}: in {where}")
    for field in sorted(set(ours) & set(theirs)):
        if shape(ours[field]) != shape(theirs[field]):
            found.append(f"{name}.{field}: client {shape(ours[field])} != server {shape(theirs[field])}")
    for field in sorted(set(client.get("required", [])) ^ set(server.get("required", []))):
        side = "client" if field in client.get("required", []) else "server"
        found.append(f"{name}.{field}: required by the {side} only")
    return found


def refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].removeprefix(REF).removeprefix("#/$defs/")} if "$ref" in node else set()
        return found.union(*(refs(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(refs(item) for item in node))
    return set()


def model_drift(model: type[models.Model], components: dict[str, Any]) -> list[str]:
    """Every difference between ``model`` (and the models it nests) and the server's schemas."""
    schema = model.model_json_schema(ref_template=REF + "{model}")
    ours = {model.__name__: schema, **schema.get("$defs", {})}
    found: list[str] = []
    todo, done = [model.__name__], set()
    while todo:
        name = todo.pop()
        if name in done:
            continue
        done.add(name)
        if name not in components:
            found.append(f"{name}: the server documents no such schema")
            continue
        found += differences(name, ours[name], components[name])
        todo += sorted(refs(ours[name].get("properties", {})))
    return found


def operation_for(document: dict[str, Any], call: calls.Call[Any]) -> tuple[str, dict[str, Any]]:
    """The documented (path template, operation) that serves ``call``: the longest template matching."""
    matches = []
    for template, operations in document["paths"].items():
        pattern = re.sub(r"\{(slug|entity)\}", ".+", template)  # path parameters that hold "/"
        pattern = re.sub(r"\{[^}]+\}", "[^/]+", pattern)
        if re.fullmatch(pattern, call.path) and call.method.lower() in operations:
            matches.append((len(template), template, operations[call.method.lower()]))
    assert matches, f"{call.method} {call.path}: the app serves no such route"
    _, template, operation = max(matches, key=lambda m: m[0])
    return template, operation


def success_schema(operation: dict[str, Any]) -> str:
    for status in sorted(code for code in operation["responses"] if code.startswith("2")):
        content = operation["responses"][status].get("content", {})
        schema = content.get("application/json", {}).get("schema", {})
        if "$ref" in schema:
            return str(schema["$ref"].removeprefix(REF))
    raise AssertionError(f"{operation.get('operationId')}: no documented JSON answer")


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c.method} {c.path}")
def test_each_call_names_a_route_and_parses_its_documented_answer(document, call):
    template, operation = operation_for(document, call)
    assert success_schema(operation) == call.model.__name__, template
    assert model_drift(call.model, document["components"]["schemas"]) == []
    documented = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
    assert set(call.params or {}) <= documented, template
    if call.body is not None:
        assert "requestBody" in operation, template
    if call.idempotency_key is not None and call.signed:
        headers = {p["name"] for p in operation.get("parameters", []) if p["in"] == "header"}
        assert "Idempotency-Key" in headers, template


def test_the_error_model_matches(document):
    assert model_drift(models.ErrorOut, document["components"]["schemas"]) == []


def test_every_call_of_the_client_is_checked():
    makers = {
        function
        for _, function in inspect.getmembers(calls, inspect.isfunction)
        if function.__module__ == calls.__name__
        and str(inspect.signature(function).return_annotation).startswith("Call[")
    }
    assert len(makers) > 10  # the introspection found them
    assert makers == {maker for maker, _ in MAKERS}


def test_the_drift_check_sees_a_missing_field_a_changed_type_and_required_ness(document):
    components = copy.deepcopy(document["components"]["schemas"])
    del components["JobOut"]["properties"]["worker"]
    components["FactRecord"]["properties"]["row_num"] = {"type": "string"}
    components["ConfigOut"]["required"].append("enabled")
    assert model_drift(models.JobList, components) == ["JobOut.worker: in only the client"]
    assert model_drift(models.PageFactsPage, components) == [
        "FactRecord.row_num: client ('integer',) != server ('string', None)"
    ]
    assert model_drift(models.ConfigSetOut, components) == []  # ConfigSetOut is its own schema
    assert model_drift(models.ConfigOut, components) == ["ConfigOut.enabled: required by the server only"]
