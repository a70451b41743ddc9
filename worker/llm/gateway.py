"""Build the configured LLM client; start the bundled simulator when no real provider is configured.

Every client comes wrapped the same way: ``BudgetedClient(RetryingClient(RateLimitedClient(provider)))``:
the budget check outside (when a budget is given), then the one retry layer, and inside it the shared
rate limiter (only when a limit is configured), so each retry waits its turn like any other call. The
SDKs' own retries are off in every provider.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import date

from worker.core.errors import LLMConfigurationError
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.budgeted import BudgetCheck, BudgetedClient
from worker.llm.openai_compat import DEFAULT_EMBEDDING_MODEL, OpenAIChatClient
from worker.llm.ratelimit import RateLimitedClient, build_rate_limiter
from worker.llm.retirements import retirement_note
from worker.llm.retry import AttemptListener, RetryingClient, RetryPolicy
from worker.llm.types import LLMClient
from worker.settings import Settings

logger = logging.getLogger(__name__)

SIMULATOR_MODEL = "simulator-1"
SIMULATOR_EMBEDDING_MODEL = "simulator-embedding-1"
DEFAULT_MODELS = {
    "openai": "gpt-4o-mini",
    "anthropic": "claude-haiku-4-5",  # claude-3-5-haiku was retired on 2026-02-19 (retirements.py)
    "openai-compatible": "default",
    "simulator": SIMULATOR_MODEL,
}


def describe(settings: Settings) -> str:
    """One line for humans: which provider and model a run uses (the simulator says so)."""
    provider = settings.resolved_llm()
    model = settings.llm_model or DEFAULT_MODELS[provider]
    limits = []
    if settings.llm_rpm:
        limits.append(f"{settings.llm_rpm} requests/min")
    if settings.llm_tpm:
        limits.append(f"{settings.llm_tpm} tokens/min")
    suffix = f"; limited to {', '.join(limits)}" if limits else ""
    if provider == "simulator":
        return (
            f"LLM: bundled simulator ({model}, {settings.simulator_api} wire format) — not a real model; "
            f"set OPENAI_API_KEY or ANTHROPIC_API_KEY to use a real one{suffix}"
        )
    return f"LLM: {provider} ({model}){suffix}"


def wrap(
    provider: LLMClient, settings: Settings, *, on_attempt: AttemptListener | None = None
) -> RetryingClient:
    """The gateway's layers around a provider: retries outside, the rate limiter (if any) inside."""
    limiter = build_rate_limiter(settings)
    inner: LLMClient = provider if limiter is None else RateLimitedClient(provider, limiter)
    return RetryingClient(inner, RetryPolicy.from_settings(settings), on_attempt=on_attempt)


def keep_alive(settings: Settings) -> int:
    """Connections a client keeps open: one per call the process's LLM pipe may have in flight, and
    a few for the calls beside it (embeddings, searches)."""
    return settings.llm_concurrency + 8


def _simulator_client(settings: Settings, model: str, root_url: str) -> LLMClient:
    """A provider speaking to the simulator at ``root_url`` through the SDK FACTMILL_SIMULATOR_API names."""
    root_url = root_url.rstrip("/").removesuffix("/v1")
    openai_client = OpenAIChatClient(
        model=model,
        base_url=f"{root_url}/v1",
        timeout=settings.llm_timeout_seconds,
        provider="simulator",
        embedding_model=SIMULATOR_EMBEDDING_MODEL,
        keep_alive=keep_alive(settings),
    )
    if settings.simulator_api == "openai":
        return openai_client
    return AnthropicChatClient(
        model=model,
        base_url=root_url,
        timeout=settings.llm_timeout_seconds,
        provider="simulator",
        embeddings=openai_client,  # the simulator embeds on its OpenAI route, like a real deployment would
        keep_alive=keep_alive(settings),
    )


def provider_client(settings: Settings, stack: ExitStack) -> LLMClient:
    provider = settings.resolved_llm()
    model = settings.llm_model or DEFAULT_MODELS[provider]
    timeout = settings.llm_timeout_seconds
    refused = settings.llm_unconfigured()
    if refused:
        raise LLMConfigurationError(refused)
    if provider in ("openai", "anthropic") and (note := retirement_note(model, date.today())):
        logger.warning("%s", note)
    if provider == "simulator":
        if settings.simulator_url:
            return _simulator_client(settings, model, settings.simulator_url)
        # Here, not at the top: production never loads the simulator (nor the web server under it).
        from worker.simulator import Simulator, SimulatorConfig

        simulator = Simulator(SimulatorConfig(latency_ms=settings.simulator_latency_ms))
        simulator.start()
        stack.callback(simulator.stop)
        return _simulator_client(settings, model, simulator.url)
    embedding_model = settings.embedding_model or DEFAULT_EMBEDDING_MODEL
    if provider == "openai":
        return OpenAIChatClient(
            model=model,
            base_url=settings.llm_base_url,
            api_key=settings.openai_api_key,
            timeout=timeout,
            embedding_model=embedding_model,
            keep_alive=keep_alive(settings),
        )
    if provider == "anthropic":
        embeddings = None
        if settings.openai_api_key:
            embeddings = OpenAIChatClient(
                model=model, api_key=settings.openai_api_key, timeout=timeout, embedding_model=embedding_model
            )
        return AnthropicChatClient(
            model=model,
            base_url=settings.llm_base_url,
            api_key=settings.anthropic_api_key,
            timeout=timeout,
            embeddings=embeddings,
            keep_alive=keep_alive(settings),
        )
    if provider == "openai-compatible":
        return OpenAIChatClient(
            model=model,
            base_url=settings.llm_base_url,
            api_key=settings.openai_api_key,
            timeout=timeout,
            json_mode="json_object",
            provider="openai-compatible",
            send_prompt_cache_key=False,
            embedding_model=settings.embedding_model,  # its own models: none unless named
            keep_alive=keep_alive(settings),
        )
    raise LLMConfigurationError(
        f"FACTMILL_LLM={provider} is not a provider; use openai, anthropic, openai-compatible or simulator"
    )


def can_embed(settings: Settings) -> bool:
    """Whether the configured provider has an embeddings API (Anthropic's has none: it embeds through
    OpenAI when an OpenAI key is set too; an OpenAI-compatible server, when FACTMILL_EMBEDDING_MODEL names
    one of its models)."""
    provider = settings.resolved_llm()
    if provider == "anthropic":
        return bool(settings.openai_api_key)
    if provider == "openai-compatible":
        return settings.embedding_model is not None
    return True


def embeds_new_facts(settings: Settings) -> bool:
    """Whether new facts go to the embedding follow-up: asked (FACTMILL_EMBED_AFTER_EXTRACTION) and a
    model to embed with. Without one (Anthropic with no OpenAI key, an OpenAI-compatible server with no
    FACTMILL_EMBEDDING_MODEL), every commit sent its pages there: each run re-read their facts to fail,
    logged a retry no sweep would make, and charged the chat model's rate limit for the refused call;
    their consolidation is then requested as without embedding."""
    return settings.embed_after_extraction and can_embed(settings)


@contextmanager
def open_llm_client(
    settings: Settings, *, budget: BudgetCheck | None = None, on_attempt: AttemptListener | None = None
) -> Iterator[LLMClient]:
    """Yield a ready client for the configured provider, and stop anything started for it: the one
    assembly of the gateway, used by workers, the API and the CLI alike.

    ``budget`` is checked before every call; ``on_attempt`` hears about every try of every call (see
    ``RetryingClient``), e.g. to record it.
    """
    with ExitStack() as stack:
        client: LLMClient = wrap(provider_client(settings, stack), settings, on_attempt=on_attempt)
        yield client if budget is None else BudgetedClient(client, budget)
