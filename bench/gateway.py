"""Benchmark the LLM gateway through the openai and anthropic SDKs against the simulator in another process.

Run: .venv/bin/python bench/gateway.py [--calls N] [--rounds N] [--in-flight N] [--latency-ms MS]

1. Zero latency, one call at a time: calls per second and client CPU milliseconds per call
   (time.process_time of this process, which only runs the client) through the full gateway
   (RetryingClient around the provider, as open_llm_client builds it), next to the bare SDK
   call doing the same request (the baseline) and the 2 ms goal.
2. 100 ms latency, 64 calls in flight on 64 threads sharing one client: achieved calls per second
   against the ideal 64 / 0.1 s, and against 64 / the single-call latency measured in the same run.
   Goal: at least 0.9 of ideal.
3. The worker's pipe mechanism (issue 13): the OpenAI SDK's own post() as the provider makes it, on
   64 threads sharing one sync client (what the LLM pipe does) against 64 asyncio tasks sharing one
   AsyncOpenAI client on one event loop, same latency and body: client CPU per call, in alternating
   rounds. An asyncio pipe would pay off only if its per-call CPU were clearly lower.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service import at_least, free_port
from worker.core.facts import extraction_system_prompt, facts_json_schema, segment_user_message
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.retry import RetryingClient, RetryPolicy
from worker.llm.types import ChatRequest, LLMClient

CPU_GOAL_MS = 2.0
CONCURRENCY_GOAL = 0.9
SEGMENT = (
    "Page: imessage: Alice Example\n"
    "Conversation between Alice Example and Bob Demo from 2024-03-15T09:00:00Z to 2024-03-15T09:03:00Z\n"
    "---\n"
    "Alice Example (2024-03-15T09:00:00Z): Hi, I just signed the offer letter for Acme Corp.\n"
    "Bob Demo (2024-03-15T09:01:00Z): Congrats! What's the title?\n"
    "Alice Example (2024-03-15T09:02:00Z): Staff engineer on the platform team. I start on April 1st.\n"
    "Bob Demo (2024-03-15T09:03:00Z): Nice. I ran 12 km yesterday."
)
REQUEST = ChatRequest(
    purpose="extraction",
    system=extraction_system_prompt(10),
    messages=(("user", segment_user_message(SEGMENT)),),
    max_tokens=1024,
    json_schema=facts_json_schema(10),
    schema_name="facts",
    cache_key="factmill-extraction-v1-10",
)


class SimulatorProcess:
    """`python -m worker.simulator` in its own process, so its CPU is not counted as the client's."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "worker.simulator", "--port", str(self.port)],
            cwd=Path(__file__).resolve().parents[1],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.control = httpx.Client(base_url=self.url, timeout=10)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.control.get("/_simulator/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError("the simulator process did not start")
            time.sleep(0.05)

    def configure(self, **changes: Any) -> None:
        self.control.post("/_simulator/config", json=changes).raise_for_status()

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.control.get("/_simulator/stats").json()
        return stats

    def stop(self) -> None:
        self.control.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def provider(api: str, sim: SimulatorProcess) -> LLMClient:
    if api == "openai":
        return OpenAIChatClient(model="simulator-1", base_url=f"{sim.url}/v1", provider="simulator")
    return AnthropicChatClient(model="simulator-1", base_url=sim.url, provider="simulator")


def bare_sdk_call(api: str, sim: SimulatorProcess) -> Callable[[], object]:
    """The same request straight through the SDK's typed method: the baseline for the gateway's cost."""
    if api == "openai":
        import openai

        oai = openai.OpenAI(base_url=f"{sim.url}/v1", api_key="sim", max_retries=0)
        chat: dict[str, Any] = {
            "model": "simulator-1",
            "messages": [
                {"role": "system", "content": REQUEST.system},
                {"role": "user", "content": REQUEST.messages[0][1]},
            ],
            "max_tokens": REQUEST.max_tokens,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "facts", "schema": REQUEST.json_schema, "strict": True},
            },
        }
        return lambda: oai.chat.completions.create(**chat)
    import anthropic

    claude = anthropic.Anthropic(base_url=sim.url, api_key="sim", max_retries=0)
    message: dict[str, Any] = {
        "model": "simulator-1",
        "max_tokens": REQUEST.max_tokens,
        "system": [{"type": "text", "text": REQUEST.system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": REQUEST.messages[0][1]}],
        "tools": [{"name": "facts", "description": "Record the facts.", "input_schema": REQUEST.json_schema}],
        "tool_choice": {"type": "tool", "name": "facts"},
    }
    return lambda: claude.messages.create(**message)


def raw_http_call(sim: SimulatorProcess) -> Callable[[], object]:
    """The same request as bare httpx POSTs of pre-encoded JSON: the ceiling this machine allows."""
    body = json.dumps(
        {
            "model": "simulator-1",
            "messages": [
                {"role": "system", "content": REQUEST.system},
                {"role": "user", "content": REQUEST.messages[0][1]},
            ],
            "max_tokens": REQUEST.max_tokens,
        }
    ).encode()
    client = httpx.Client(base_url=sim.url, timeout=30, limits=httpx.Limits(max_connections=256))
    headers = {"content-type": "application/json"}
    return lambda: client.post("/v1/chat/completions", content=body, headers=headers).json()


def sequential(call: Callable[[], object], calls: int) -> tuple[float, float]:
    """(calls per second, client CPU ms per call), best of three runs of ``calls`` calls."""
    for _ in range(max(20, calls // 10)):
        call()
    best_rate, best_cpu = 0.0, float("inf")
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            call()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        best_rate, best_cpu = max(best_rate, calls / wall), min(best_cpu, cpu / calls * 1000)
    return best_rate, best_cpu


def single_call_latency(call: Callable[[], object], calls: int = 20) -> float:
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def in_flight(call: Callable[[], object], threads: int, rounds: int) -> tuple[float, float]:
    """(calls per second, seconds) with ``threads`` threads each making ``rounds`` calls back to back."""
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            for _ in range(rounds):
                call()
        except BaseException as exc:  # reported after the run
            errors.append(exc)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    # Warm connections are part of steady state: one call per thread first would skew nothing,
    # but the pool's first connects are; the barrier starts everyone together.
    barrier.wait()
    started = time.perf_counter()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} calls failed: {errors[0]!r}")
    return threads * rounds / elapsed, elapsed


def openai_body() -> dict[str, Any]:
    """The provider's /chat/completions body for REQUEST (what OpenAIChatClient.chat_body builds)."""
    return OpenAIChatClient(model="simulator-1", base_url="http://127.0.0.1:9/v1").chat_body(REQUEST)


def sdk_options(sim: SimulatorProcess, in_flight_calls: int, *, asynchronous: bool = False) -> dict[str, Any]:
    """An OpenAI SDK client's options for part 3: no retries, a connection for each call in flight."""
    import openai

    limits = openai.DEFAULT_CONNECTION_LIMITS
    sized = type(limits)(max_connections=in_flight_calls, max_keepalive_connections=in_flight_calls)
    client_class = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
    http_client = client_class(limits=sized)
    return {"base_url": f"{sim.url}/v1", "api_key": "sim", "max_retries": 0, "http_client": http_client}


def threads_sdk_post(sim: SimulatorProcess, in_flight_calls: int, rounds: int) -> float:
    """Client CPU ms a call: ``in_flight_calls`` threads posting through one sync SDK client."""
    import openai

    sdk = openai.OpenAI(**sdk_options(sim, in_flight_calls))
    body = openai_body()

    def call() -> object:
        return sdk.post("/chat/completions", body=body, cast_to=object)

    in_flight(call, in_flight_calls, 1)  # open the connections
    cpu = time.process_time()
    in_flight(call, in_flight_calls, rounds)
    return (time.process_time() - cpu) / (in_flight_calls * rounds) * 1000


def async_sdk_post(sim: SimulatorProcess, in_flight_calls: int, rounds: int) -> float:
    """Client CPU ms a call: ``in_flight_calls`` asyncio tasks posting through one AsyncOpenAI client."""
    import openai

    async def run() -> float:
        sdk = openai.AsyncOpenAI(**sdk_options(sim, in_flight_calls, asynchronous=True))
        body = openai_body()

        async def task(calls: int) -> None:
            for _ in range(calls):
                await sdk.post("/chat/completions", body=body, cast_to=object)

        await asyncio.gather(*(task(1) for _ in range(in_flight_calls)))  # open the connections
        cpu = time.process_time()
        await asyncio.gather(*(task(rounds) for _ in range(in_flight_calls)))
        spent = (time.process_time() - cpu) / (in_flight_calls * rounds) * 1000
        await sdk.close()
        return spent

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000, help="sequential calls per measurement")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10, help="calls per thread in the concurrency run")
    parser.add_argument("--latency-ms", type=at_least(1, "the ideal rate divides by it"), default=100)
    parser.add_argument("--mechanism-rounds", type=int, default=3, help="alternating rounds in part 3")
    args = parser.parse_args()

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"bench/gateway.py: python {sys.version.split()[0]}, {os.cpu_count()} CPUs (load average {load}), "
        "simulator in its own process"
    )
    sim = SimulatorProcess()
    try:
        print("\n1. zero latency, one call at a time")
        print(f"   {'path':<22} {'calls/s':>9} {'CPU ms/call':>12}   ratios")
        for api in ("openai", "anthropic"):
            gateway = RetryingClient(provider(api, sim), RetryPolicy())
            bare_rate, bare_cpu = sequential(bare_sdk_call(api, sim), args.calls)
            rate, cpu = sequential(lambda g=gateway: g.chat(REQUEST), args.calls)  # type: ignore[misc]
            print(f"   {api + ' SDK, bare':<22} {bare_rate:>9.0f} {bare_cpu:>12.3f}   (baseline)")
            print(
                f"   {api + ' via gateway':<22} {rate:>9.0f} {cpu:>12.3f}   "
                f"calls/s {rate / bare_rate:.2f}x bare; CPU {cpu / bare_cpu:.2f}x bare, "
                f"{cpu / CPU_GOAL_MS:.2f} of the {CPU_GOAL_MS:g} ms goal "
                f"({'met' if cpu <= CPU_GOAL_MS else 'MISSED'})"
            )

        sim.configure(latency_ms=args.latency_ms)
        nominal = args.in_flight / (args.latency_ms / 1000)
        print(
            f"\n2. {args.latency_ms:g} ms latency, {args.in_flight} calls in flight "
            f"(threads, one shared client); ideal {args.in_flight}/{args.latency_ms / 1000:g} s "
            f"= {nominal:.0f}/s"
        )
        per_latency = f"vs {args.in_flight}/latency"
        print(
            f"   {'path':<22} {'calls/s':>8} {'vs ideal':>9} {'latency':>9} {per_latency:>14} "
            f"{'CPU ms/call':>12}  goal"
        )
        raw = raw_http_call(sim)
        paths: list[tuple[str, Callable[[], object]]] = [("raw HTTP (control)", raw)]
        for api in ("openai", "anthropic"):
            gateway = RetryingClient(provider(api, sim), RetryPolicy())
            paths.append((f"{api} via gateway", lambda g=gateway: g.chat(REQUEST)))  # type: ignore[misc]
        for name, call in paths:
            latency = single_call_latency(call)
            in_flight(call, args.in_flight, 1)  # open the connections
            cpu = time.process_time()
            rate, _ = in_flight(call, args.in_flight, args.rounds)
            cpu_per_call = (time.process_time() - cpu) / (args.in_flight * args.rounds) * 1000
            measured_ideal = args.in_flight / latency
            verdict = (
                "" if name.startswith("raw") else ("met" if rate / nominal >= CONCURRENCY_GOAL else "MISSED")
            )
            print(
                f"   {name:<22} {rate:>8.0f} {rate / nominal:>9.3f} {latency * 1000:>7.1f}ms "
                f"{rate / measured_ideal:>14.3f} {cpu_per_call:>12.3f}  {verdict}"
            )
        print(f"   the simulator saw up to {sim.stats()['max_in_flight']} requests in flight")

        print(
            f"\n3. the pipe's mechanism: the openai SDK's post(), {args.in_flight} calls in flight, "
            f"{args.latency_ms:g} ms latency, alternating rounds (client CPU ms a call)"
        )
        threads, tasks = [], []
        for _ in range(args.mechanism_rounds):
            threads.append(threads_sdk_post(sim, args.in_flight, args.rounds))
            tasks.append(async_sdk_post(sim, args.in_flight, args.rounds))
        print(
            f"   {args.in_flight} threads, one sync client (shipped): "
            + ", ".join(f"{c:.3f}" for c in threads)
        )
        print(
            f"   {args.in_flight} asyncio tasks, one async client:   " + ", ".join(f"{c:.3f}" for c in tasks)
        )
        ratio = statistics.median(tasks) / statistics.median(threads)
        print(f"   asyncio / threads, medians: {ratio:.2f}x ({'cheaper' if ratio < 1 else 'no cheaper'})")
    finally:
        sim.stop()


if __name__ == "__main__":
    main()
