"""Build the configured LLM client; start the bundled simulator when no real provider is configured."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.types import LLMClient
from worker.settings import Settings

logger = logging.getLogger(__name__)

SIMULATOR_MODEL = "simulator-1"
DEFAULT_MODELS = {
    "openai": "gpt-4o-mini",
    "anthropic": "claude-3-5-haiku-latest",
    "openai-compatible": "default",
    "simulator": SIMULATOR_MODEL,
}


class LLMConfigurationError(RuntimeError):
    """The provider settings are incomplete; the message names the variable to set."""


def describe(settings: Settings) -> str:
    """One line for humans: which provider and model a run uses (the simulator says so)."""
    provider = settings.resolved_llm()
    model = settings.llm_model or DEFAULT_MODELS[provider]
    if provider == "simulator":
        return f"LLM: bundled simulator ({model}) — not a real model; set OPENAI_API_KEY to use OpenAI"
    return f"LLM: {provider} ({model})"


@contextmanager
def open_llm_client(settings: Settings) -> Iterator[LLMClient]:
    """Yield a ready client for the configured provider, and stop anything started for it."""
    provider = settings.resolved_llm()
    model = settings.llm_model or DEFAULT_MODELS[provider]
    timeout = settings.llm_timeout_seconds
    if provider == "simulator":
        if settings.simulator_url:
            yield OpenAIChatClient(
                model=model,
                base_url=settings.simulator_url,
                timeout=timeout,
                provider="simulator",
                embedding_model="simulator-embedding-1",
            )
            return
        from worker.llm.simulator import Simulator, SimulatorConfig

        simulator = Simulator(SimulatorConfig(latency_ms=settings.simulator_latency_ms))
        simulator.start()
        try:
            yield OpenAIChatClient(
                model=model,
                base_url=simulator.base_url,
                timeout=timeout,
                provider="simulator",
                embedding_model="simulator-embedding-1",
            )
        finally:
            simulator.stop()
        return
    if provider == "openai":
        if not settings.openai_api_key:
            raise LLMConfigurationError("FACTMILL_LLM=openai needs OPENAI_API_KEY")
        yield OpenAIChatClient(
            model=model, base_url=settings.llm_base_url, api_key=settings.openai_api_key, timeout=timeout
        )
        return
    if provider == "openai-compatible":
        if not settings.llm_base_url:
            raise LLMConfigurationError("FACTMILL_LLM=openai-compatible needs FACTMILL_LLM_BASE_URL")
        yield OpenAIChatClient(
            model=model,
            base_url=settings.llm_base_url,
            api_key=settings.openai_api_key,
            timeout=timeout,
            json_mode="json_object",
            provider="openai-compatible",
        )
        return
    raise LLMConfigurationError(
        f"FACTMILL_LLM={provider} is not available yet in this build; use openai, openai-compatible or simulator"
    )
