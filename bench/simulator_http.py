"""The simulator's own CPU a request under uvicorn's two HTTP stacks: asyncio + h11 (pure Python, the
baseline) against what `python -m worker.simulator` and `factmill serve` now get (uvloop + httptools,
picked up by uvicorn's loop="auto" / http="auto").

    .venv/bin/python bench/simulator_http.py [--pairs 1000] [--threads 16] [--rounds 3]

Each round starts the simulator app once under each stack (`uvicorn --factory`, zero latency), sends
``--pairs`` pairs of requests from ``--threads`` threads through the gateway's OpenAI client (one
extraction call with the worker's prompt and schema, one embedding call of two texts: what a segment
costs the simulator), and reads the server process's CPU time around them. The simulator is not part
of Factmill in production, but in every benchmark it shares the machine's two cores with the worker and
Postgres, so its CPU is taken from theirs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gateway import REQUEST  # noqa: E402
from tests.service import free_port  # noqa: E402
from worker.llm.openai_compat import OpenAIChatClient  # noqa: E402

STACKS = {"asyncio + h11 (baseline)": ["--loop", "asyncio", "--http", "h11"], "uvloop + httptools": []}
WARM_UP_PAIRS = 100


def simulator_ms_per_pair(stack: list[str], pairs: int, threads: int) -> float:
    """Start the simulator under ``stack``, send the pairs, return its CPU milliseconds a pair."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "worker.simulator.server:create_app", "--port",
         str(port), "--log-level", "warning", "--no-access-log", *stack],
        cwd=REPO,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(f"{url}/_simulator/health").raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        llm = OpenAIChatClient(model="simulator-1", base_url=f"{url}/v1", provider="simulator")

        def pair(i: int) -> None:
            llm.chat(REQUEST)
            llm.embed([f"Alice signed the offer letter {i}.", f"Bob ran {i} km yesterday."])

        process = psutil.Process(server.pid)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(pair, range(WARM_UP_PAIRS)))
            before = process.cpu_times()
            list(pool.map(pair, range(pairs)))
            after = process.cpu_times()
        return (after.user + after.system - before.user - before.system) / pairs * 1000
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {name: [] for name in STACKS}
    for round_number in range(1, args.rounds + 1):
        for name, stack in STACKS.items():  # alternating: these machines drift within minutes
            ms = simulator_ms_per_pair(stack, args.pairs, args.threads)
            figures[name].append(ms)
            print(f"round {round_number}: {name}: {ms:.3f} ms of simulator CPU a request pair")
    medians = {name: statistics.median(values) for name, values in figures.items()}
    baseline, shipped = medians.values()
    for name, median in medians.items():
        print(f"median {name}: {median:.3f} ms a pair")
    print(f"uvloop + httptools against the baseline: {shipped / baseline:.2f}x the simulator's CPU")


if __name__ == "__main__":
    main()
