"""Memory per LLM call in flight: the worker's LLM pipe holding N extraction calls open at a slow simulator.

    .venv/bin/python bench/pipe_memory.py [--calls 256] [--latency-ms 3000]

Starts the simulator in its own process, warms the pipe with one round of N calls (threads, connections,
SDK caches), then measures this process's resident memory (RSS, /proc) before the second round and at
its peak while the N calls are open; prints the difference per call, and the same for the idle pipe
per slot: per pipe thread the warm round left running (the pipe starts them as calls need them, so it
is counted, not taken from --calls), beside the connections to the simulator it keeps alive.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.pipeline import page_body, wait_http  # noqa: E402
from tests.service import free_port  # noqa: E402
from worker.core.conversation import (  # noqa: E402
    parse_conversation_messages,
    render_segment_for_extraction,
    split_into_segments,
)
from worker.extraction import extract_segment  # noqa: E402
from worker.llm.openai_compat import OpenAIChatClient  # noqa: E402
from worker.llm.pipe import LLMPipe  # noqa: E402


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


def pipe_threads(pipe: LLMPipe) -> int:
    """The pipe's threads running now (named after it: ``llm-pipe-N``)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(f"{pipe.name}-") and t.is_alive())


def open_connections(port: int) -> int:
    """This process's established TCP connections to the simulator on ``port``."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def round_of(pipe: LLMPipe, llm: OpenAIChatClient, texts: list[str], calls: int) -> tuple[int, int]:
    """N calls through the pipe: (the peak RSS while they ran, the most calls seen in flight at once)."""
    feed = pipe.open(calls, lambda i: extract_segment(llm, texts[i % len(texts)], 10, 1024))
    peak, most = rss(), 0
    while pipe.in_flight() or not most:
        most = max(most, pipe.in_flight())
        peak = max(peak, rss())
        time.sleep(0.02)
    while not feed.finished():
        feed.take()
    feed.close()
    return peak, most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--latency-ms", type=int, default=3000)
    args = parser.parse_args()
    port = free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "worker.simulator", "--port", str(port), "--latency-ms", str(args.latency_ms)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/_simulator/health")
        llm = OpenAIChatClient(
            model="simulator-1",
            base_url=f"http://127.0.0.1:{port}/v1",
            provider="simulator",
            keep_alive=args.calls + 8,
        )
        segments = split_into_segments(parse_conversation_messages(page_body(0, 64)))
        texts = [render_segment_for_extraction("bench", s) for s in segments]
        before_pipe = rss()
        pipe = LLMPipe(args.calls)
        round_of(pipe, llm, texts, args.calls)  # warm: threads, connections, SDK caches
        idle = rss()
        threads, connections = pipe_threads(pipe), open_connections(port)
        peak, most = round_of(pipe, llm, texts, args.calls)
        pipe.close()
    finally:
        sim.terminate()
        sim.wait(timeout=15)
    mib = 1024 * 1024
    print(f"{args.calls} calls ({most} at once) at {args.latency_ms} ms through the LLM pipe")
    per_slot = (idle - before_pipe) / max(1, threads) / 1024
    print(
        f"  idle pipe (threads + kept-alive connections): {per_slot:.1f} KiB per slot ({threads} pipe "
        f"threads and {connections} connections to the simulator open after the warm round, counted)"
    )
    print(f"  in flight over idle: {(peak - idle) / max(1, most) / 1024:.1f} KiB per call")
    print(
        f"  process RSS: {before_pipe / mib:.1f} MiB before the pipe (the baseline, this run), "
        f"{peak / mib:.1f} MiB at the peak ({peak / before_pipe:.2f}x)"
    )


if __name__ == "__main__":
    main()
