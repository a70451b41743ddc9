"""GET /v1/config and GET, PUT and DELETE /v1/config/{key}: kill switches and tunables (admin)."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, Field, field_validator
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from models import ConfigEntry
from models.reads import read_only
from worker.api.auth import Admin, require
from worker.api.deps import ApiContext, Context, json_request_body, parse_json_model, read_body
from worker.api.errors import ApiError, error_responses
from worker.api.inputs import StorableStr
from worker.config_store import (
    CONFIG_KEYS,
    SWITCHES,
    UnknownConfigKeyError,
    check_key,
    config_table,
    is_enabled,
    set_config,
    unset_config,
)
from worker.core.jsonvalues import json_integer
from worker.jobs import outbox

logger = logging.getLogger(__name__)

config_router = APIRouter(tags=["config"], dependencies=[Depends(require("admin"))])
# Unsigned JSON bodies are a few fields: a small cap, read before anything else.
MAX_CONFIG_BODY_BYTES = 64 * 1024
# The schema lists the keys; the handlers check them (check_key), so a typo is answered with the key it
# is close to rather than FastAPI's enum error.
ConfigKey = Annotated[
    StorableStr,
    Path(
        min_length=1,
        max_length=200,
        description="A kill switch or tunable, e.g. facts.extraction_enabled",
        json_schema_extra={"enum": list(CONFIG_KEYS)},
    ),
]
# DELETE also takes a key nothing reads (GET /v1/config lists such rows under "unread"): no enum, or a
# client generated from the document could not remove them.
StoredConfigKey = Annotated[
    StorableStr,
    Path(
        min_length=1,
        max_length=200,
        description="A key to unset: any of PUT's, or one GET /v1/config lists under unread",
    ),
]


class ConfigOut(BaseModel):
    key: str
    value: str | None  # None: never set (a kill switch then means enabled)
    enabled: bool | None = None  # kill switches only: what workers act on
    updated_at: datetime | None = None
    updated_by: str | None = None


class ConfigSet(BaseModel):
    value: str = Field(
        description="text, a number, true/false, or a JSON object (llm.prices); stored as its text",
        json_schema_extra={"type": ["string", "number", "boolean", "object"]},
    )

    @field_validator("value", mode="before")
    @classmethod
    def _as_text(cls, raw: object) -> str:
        """The value as stored: JSON true/false as `true`/`false`, a number as written in Python (the
        body loader has refused non-finite ones), an object as compact JSON."""
        if isinstance(raw, bool):
            return str(raw).lower()
        if isinstance(raw, str | int | float):
            return str(json_integer(raw))  # 5.0 is 5, as everywhere in the API (it was "5.0": not a count)
        if isinstance(raw, dict):
            return json.dumps(raw, ensure_ascii=False, separators=(",", ":"))
        raise ValueError(
            "a config value is text, a number, true/false or a JSON object (llm.prices); "
            "to unset a key, DELETE /v1/config/{key}"
        )


class ConfigSetOut(ConfigOut):
    # paused jobs queued again at once because their kill switch was turned on (at most a sweep batch,
    # 5,000; the sweeper resumes the rest, a batch a sweep)
    resumed: int = 0


class ConfigList(BaseModel):
    config: list[ConfigOut]  # every key something reads, set or not, then any set key nothing reads
    unread: list[str]  # set keys nothing reads (set before keys were checked): DELETE removes them


def _entry_out(key: str, entry: ConfigEntry | None) -> ConfigOut | None:
    if entry is None:
        if key in SWITCHES:
            return ConfigOut(key=key, value=None, enabled=True)
        return None
    return ConfigOut(
        key=key,
        value=entry.value,
        enabled=is_enabled(entry.value) if key in SWITCHES else None,
        updated_at=entry.updated_at,
        updated_by=entry.updated_by,
    )


def _config_out(session: Session, key: str) -> ConfigOut | None:
    return _entry_out(key, session.get(ConfigEntry, key))


@config_router.get("/v1/config", response_model=ConfigList, responses=error_responses(401))
def list_config_values(ctx: Context) -> ConfigList:
    """Every key workers read, with its value and who set it when (a key never set has none: its
    default; a kill switch then means on), and any set key nothing reads."""
    with read_only(ctx.factory) as session:
        rows, unread = config_table(session)
    listed = [_entry_out(key, entry) or ConfigOut(key=key, value=None) for key, entry in rows]
    return ConfigList(config=listed, unread=unread)


@config_router.get("/v1/config/{key}", response_model=ConfigOut, responses=error_responses(401, 404))
def get_config_value(ctx: Context, key: ConfigKey) -> ConfigOut:
    try:
        check_key(key)
    except UnknownConfigKeyError as exc:
        raise ApiError(404, str(exc)) from None
    with read_only(ctx.factory) as session:
        out = _config_out(session, key)
    if out is None:
        raise ApiError(404, f"config key {key!r} is not set")
    return out


def set_config_value(ctx: ApiContext, key: str, body: ConfigSet, actor: str) -> ConfigSetOut:
    value = body.value
    with ctx.factory() as session, session.begin():
        try:
            cleaned = set_config(session, key, value, updated_by=actor)
        except UnknownConfigKeyError as exc:
            raise ApiError(422, str(exc)) from None
        except ValueError as exc:
            raise ApiError(422, f"value: {exc}") from None
        resumed = outbox.resume_for_config_change(session, key, cleaned)
        session.flush()
        out = _config_out(session, key)
        assert out is not None
    ctx.enqueue(resumed)
    logger.info("config %s set to %r by the API; %s paused job(s) resumed", key, cleaned, len(resumed))
    return ConfigSetOut(**out.model_dump(), resumed=len(resumed))


@config_router.put(
    "/v1/config/{key}",
    response_model=ConfigSetOut,
    responses=error_responses(401, 413, 422),
    openapi_extra=json_request_body(ConfigSet.model_json_schema()),
)
async def put_config_value(request: Request, ctx: Context, admin: Admin, key: ConfigKey) -> ConfigSetOut:
    """Set a key. Turning a kill switch on resumes the paused jobs of its kinds (a batch of up to 5,000 at
    once, counted in ``resumed``; the sweeper resumes the rest, a batch a sweep).

    Turning one off needs nothing more: workers read the switch before every LLM call (through
    a cache refreshed every FACTMILL_CONFIG_CACHE_SECONDS, twice that at most while a refresh runs) and
    pause their jobs themselves.
    """
    body = parse_json_model(await read_body(request, MAX_CONFIG_BODY_BYTES), ConfigSet)
    return await run_in_threadpool(set_config_value, ctx, key, body, admin.actor)


def unset_config_value(ctx: ApiContext, key: str, actor: str) -> ConfigSetOut:
    with ctx.factory() as session, session.begin():
        try:
            removed = unset_config(session, key)
        except UnknownConfigKeyError as exc:
            raise ApiError(404, str(exc)) from None
        resumed = outbox.resume_for_config_change(session, key, None) if removed else []
    ctx.enqueue(resumed)
    if removed:
        # The row is gone, so the log is the record of who unset it (a kill switch turned back on).
        logger.info("config %s unset by %s; %s paused job(s) resumed", key, actor, len(resumed))
    enabled = True if key in SWITCHES else None
    return ConfigSetOut(key=key, value=None, enabled=enabled, resumed=len(resumed))


@config_router.delete("/v1/config/{key}", response_model=ConfigSetOut, responses=error_responses(401, 404))
def delete_config_value(ctx: Context, admin: Admin, key: StoredConfigKey) -> ConfigSetOut:
    """Unset a key, so it means its default again (a kill switch: on, resuming its paused jobs).

    Unsetting a key that is not set changes nothing. A key nothing reads is 404 unless it is set
    (a row kept from before keys were checked), so such rows can be removed.
    """
    return unset_config_value(ctx, key, admin.actor)


__all__ = ["MAX_CONFIG_BODY_BYTES", "config_router"]
