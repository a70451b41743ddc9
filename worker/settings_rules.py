"""The settings' rules: how each value is cleaned, and the rules across fields and over the environment."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol
from urllib.parse import urlsplit

from pydantic import AliasChoices
from pydantic.fields import FieldInfo


def no_empty_environment_name(environ: Mapping[str, str]) -> None:
    """An empty value reads as unset (env_ignore_empty): FACTMILL_ENVIRONMENT= (a Helm value or a
    `${VAR:-}` left empty) meant development, every production check off, over the image's production."""
    if environ.get("FACTMILL_ENVIRONMENT", "unset").strip() == "":
        raise ValueError(
            "FACTMILL_ENVIRONMENT is set but empty: name development, test or production (or unset it)"
        )


class JudgedSettings(Protocol):
    """The fields the rules judge, of worker.settings.Settings (described here: the two modules would
    import each other)."""

    @property
    def model_fields_set(self) -> set[str]: ...

    job_heartbeat_seconds: float
    job_stale_after_seconds: float
    idempotency_key_hours: int
    job_retention_days: int | None
    task_soft_time_limit_seconds: int
    task_time_limit_seconds: int
    webhook_tolerance_seconds: int
    large_body_seconds: float


ENV_PREFIX = "FACTMILL_"
# Variables a library reads before the setting that should decide: Celery's broker (-b writes the first
# from the last two); the SDKs' base URL (calls went there, priced and limited as the provider's own).
_CELERY = "CELERY_BROKER_URL CELERY_BROKER_READ_URL CELERY_BROKER_WRITE_URL BROKER_URL CELERY_BROKER"
_BROKER = "Celery would use it instead of FACTMILL_BROKER_URL; unset it and set FACTMILL_BROKER_URL"
_SDK_URL = "the SDK would send its calls there unseen; unset it (FACTMILL_LLM_BASE_URL sets the provider's)"
FOREIGN_VARIABLES = {
    **dict.fromkeys(_CELERY.split(), _BROKER),
    "OPENAI_BASE_URL": _SDK_URL,  # an Anthropic deployment's OpenAI embeddings too: no setting moves those
    "ANTHROPIC_BASE_URL": _SDK_URL,
}
# FACTMILL_ variables that are no setting: read by ./dev and by the test suite, not by the service.
SCRIPT_VARIABLES = frozenset({"FACTMILL_LINT_IMPORTS", "FACTMILL_TEST_EMBEDDED_REDIS"})


def no_foreign_variables(environ: Mapping[str, str]) -> None:
    """Celery reads CELERY_BROKER_URL (and its read and write twins) before any configuration: left
    in an image's environment, workers, beat and sends went to that broker while /readyz, the
    metrics and the rate limits watched FACTMILL_BROKER_URL's. The SDKs read their base URL alike."""
    for name, why in FOREIGN_VARIABLES.items():
        if environ.get(name):
            raise ValueError(f"{name} is set: {why}")


def stale_after_two_heartbeats(settings: JudgedSettings) -> None:
    if settings.job_stale_after_seconds < 2 * settings.job_heartbeat_seconds:
        raise ValueError(
            f"FACTMILL_JOB_STALE_AFTER_SECONDS ({settings.job_stale_after_seconds:g}) must be at least two "
            f"heartbeats (FACTMILL_JOB_HEARTBEAT_SECONDS={settings.job_heartbeat_seconds:g}): a live job "
            "whose beat came late would be taken for lost and run twice"
        )


def retention_covers_replays(settings: JudgedSettings) -> None:
    days, hours = settings.job_retention_days, settings.idempotency_key_hours
    if days is not None and days * 24 < hours:
        raise ValueError(
            f"FACTMILL_JOB_RETENTION_DAYS ({days}) is shorter than FACTMILL_IDEMPOTENCY_KEY_HOURS "
            f"({hours} h): a replayed delivery would name jobs already deleted"
        )


def soft_limit_first(settings: JudgedSettings) -> None:
    soft, hard = settings.task_soft_time_limit_seconds, settings.task_time_limit_seconds
    if "task_soft_time_limit_seconds" not in settings.model_fields_set and hard > 1:
        # The hard limit set alone (it is the stall detector too): the default soft limit follows it,
        # as 3300 does 3600, lowered or raised (raised to 7200, a soft 3300 stopped every task at 55
        # minutes, an unclassified error retried until its attempts were spent).
        settings.task_soft_time_limit_seconds = hard - max(1, hard // 12)
        return
    if soft >= hard:
        raise ValueError(
            f"FACTMILL_TASK_SOFT_TIME_LIMIT_SECONDS ({soft}) is not below FACTMILL_TASK_TIME_LIMIT_SECONDS "
            f"({hard}): the soft limit, which lets a task stop cleanly, would never come before the hard "
            "one kills it"
        )


# How long a delivery may wait between its arrival (where its signature is judged) and the look-up of
# its stored answer, beyond reading a large body: for a large-body place and for a request thread.
ANSWER_LOOKUP_ALLOWANCE_SECONDS = 300


def answers_outlive_signatures(settings: JudgedSettings) -> None:
    # Twice: a timestamp is taken that far either way, so a signature dated ahead by a sender's fast
    # clock holds for twice the tolerance after it first arrives; and a copy judged at its arrival looks
    # its answer up only once its body is read (up to FACTMILL_LARGE_BODY_SECONDS) and it has a thread.
    tolerance, hours = settings.webhook_tolerance_seconds, settings.idempotency_key_hours
    reading = settings.large_body_seconds
    if 2 * tolerance + reading + ANSWER_LOOKUP_ALLOWANCE_SECONDS > hours * 3600:
        raise ValueError(
            f"FACTMILL_IDEMPOTENCY_KEY_HOURS ({hours} h) must cover twice FACTMILL_WEBHOOK_TOLERANCE_SECONDS "
            f"({tolerance}) plus FACTMILL_LARGE_BODY_SECONDS ({reading:g}) and "
            f"{ANSWER_LOOKUP_ALLOWANCE_SECONDS} s of waiting: a signed delivery sent again after its stored "
            "answer was forgotten would be stored twice"
        )


CROSS_FIELD_RULES: tuple[Callable[[JudgedSettings], None], ...] = (
    stale_after_two_heartbeats,
    retention_covers_replays,
    soft_limit_first,
    answers_outlive_signatures,
)


def variable_names(fields: Mapping[str, FieldInfo]) -> frozenset[str]:
    """Every environment variable a Settings field reads (its aliases included), upper-cased; ``fields``
    is Settings.model_fields."""
    names: set[str] = set()
    for field_name, field in fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(str(choice).upper() for choice in alias.choices)
        elif isinstance(alias, str):
            names.add(alias.upper())
        else:
            names.add(f"{ENV_PREFIX}{field_name}".upper())
    return frozenset(names)


def unknown_variables(environ: Mapping[str, str], known: Iterable[str]) -> list[str]:
    """One line for each FACTMILL_ variable no setting reads (a typo kept its default unseen), with
    the nearest setting's name where one is close."""
    names = frozenset(known)
    settings_names = sorted(name for name in names if name.startswith(ENV_PREFIX))
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in names or upper in SCRIPT_VARIABLES:
            continue
        unprefixed = upper.removeprefix(ENV_PREFIX)  # a setting read by another library's name
        near = [unprefixed] if unprefixed in names else []
        near = near or difflib.get_close_matches(upper, settings_names, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]}?)" if near else ""
        lines.append(f"{name} is not a Factmill setting and is ignored{hint}")
    return lines


def checked_url(value: str | None, wanted: tuple[str, ...] | None) -> str | None:
    """A server URL that names its scheme (one of ``wanted``; None: any) and a port that is a number;
    None when blank. "localhost:6379" or "localhost:8000/v1" started cleanly and failed at first use
    (every search a 500, every LLM call a retried "connection error"). The value is never quoted in an
    error (it may carry credentials)."""
    if value is None or not value.strip():
        return None
    value = value.strip()
    scheme, sep, _ = value.partition("://")
    if not sep or (wanted is not None and scheme.lower() not in wanted):
        if wanted is None:
            raise ValueError("must be a URL naming its transport, e.g. redis://host:6379/0 or amqp://host//")
        raise ValueError(f"must be a URL beginning with {' or '.join(f'{s}://' for s in wanted)}")
    # A port that is no number ("host:6379:0", a "${PORT}" left unexpanded, 70000) passed here and
    # failed at first use: every search a 500 (the rate limiter's client), the workers at connect.
    # Kombu's failover form joins URLs with ';'.
    for part in value.split(";"):
        try:
            urlsplit(part.strip()).port  # noqa: B018 (read for its check)
        except ValueError:
            raise ValueError(
                "names a port that is not a number from 0 to 65535 (or holds an unescaped '/', '?', "
                "'#', '[' or ']' in its password: percent-encode it)"
            ) from None
    return value


def clean_api_key(value: str | None) -> str | None:
    """A key read from a secret file ends in a newline: sent in a header, every call failed as a
    retried "connection error" (the HTTP layer refuses the header, quoting the whole key)."""
    if value is None:
        return None
    key = value.strip()
    if any(char.isspace() or not char.isprintable() for char in key):
        raise ValueError("an API key holds no spaces, line breaks or control characters; check the secret")
    return key or None


def clean_model_name(value: str | None) -> str | None:
    """A model named in a secret file or a ConfigMap made --from-file ends in a newline: the services
    started, then every call named a model the provider does not have (blank: the default)."""
    if value is None:
        return None
    name = value.strip()
    if not name.isprintable():
        raise ValueError("a model name holds no line breaks or control characters")
    return name or None


def alias_choices(fields: Mapping[str, FieldInfo]) -> dict[str, list[str]]:
    """A setting read from several variables: the first of them (pydantic's name in an error) -> all."""
    return {
        str(field.validation_alias.choices[0]): [str(choice) for choice in field.validation_alias.choices]
        for field in fields.values()
        if isinstance(field.validation_alias, AliasChoices)
    }
