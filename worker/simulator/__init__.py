"""The bundled LLM simulator (not a real model): OpenAI and Anthropic over HTTP, seeded faults, latency.

Production code never imports it, except to start one when FACTMILL_LLM=simulator. Modules:
`server` (the app and `Simulator`), `config` (knobs, faults, seeded draws), `state`, `wire` (what both
wire formats share), `openai_wire` / `anthropic_wire`, `batches` with `openai_batches` /
`anthropic_batches`, and the pure answering side: `prompt`, `heuristics`, `extractor`, `replies`,
`embeddings`.
"""

from __future__ import annotations

from worker.simulator.config import (
    DEFAULT_FAULT_HEADER,
    SIMULATOR_EMBEDDING_MODEL,
    SIMULATOR_HEADER,
    SIMULATOR_MODEL,
    Fault,
    SimulatorConfig,
    config_from_cli,
)
from worker.simulator.embeddings import DEFAULT_EMBEDDING_DIMENSIONS, embed_text
from worker.simulator.extractor import FACT_KINDS, NOTABILITIES, ExtractedFact, extract_facts
from worker.simulator.prompt import (
    MAX_FACTS_CEILING,
    PromptMessage,
    estimate_tokens,
    find_segment,
    parse_segment_lines,
    requested_max_facts,
)
from worker.simulator.replies import SimReply, fill_json_schema, reply_to, text_reply
from worker.simulator.server import Simulator, create_app, main, serve
from worker.simulator.state import SimulatorState
from worker.simulator.wire import LOSSY_SUMMARY

__all__ = [
    "DEFAULT_EMBEDDING_DIMENSIONS",
    "DEFAULT_FAULT_HEADER",
    "FACT_KINDS",
    "LOSSY_SUMMARY",
    "MAX_FACTS_CEILING",
    "NOTABILITIES",
    "SIMULATOR_EMBEDDING_MODEL",
    "SIMULATOR_HEADER",
    "SIMULATOR_MODEL",
    "ExtractedFact",
    "Fault",
    "PromptMessage",
    "SimReply",
    "Simulator",
    "SimulatorConfig",
    "SimulatorState",
    "config_from_cli",
    "create_app",
    "embed_text",
    "estimate_tokens",
    "extract_facts",
    "fill_json_schema",
    "find_segment",
    "main",
    "parse_segment_lines",
    "reply_to",
    "requested_max_facts",
    "serve",
    "text_reply",
]
