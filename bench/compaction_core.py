"""Benchmark the pure compaction core: cut and serialize a ~1M-token transcript against naive baselines.

Run: .venv/bin/python bench/compaction_core.py [--tokens N] [--cap SECONDS]

Everything is measured in the same run on the same deterministic transcript. The
baselines live here, not in worker/: they are what a straightforward port would do.

- naive cut: walk back from the newest message and, for every candidate cut,
  recompute the kept tail's tokens from scratch (sum over messages[i:]). Correct,
  but quadratic in the number of messages walked; it is stopped at a time cap and
  its full time is extrapolated from the share of the walk it finished.
- naive serialize: the same rendering, built by `text += piece` in a loop instead
  of one join.
- copy floor: "\\n\\n".join of every message's raw text, the least work any
  serializer must do (touch every character once); it bounds what is achievable.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.core.compaction import (
    DEFAULT_KEEP_RECENT_TOKENS,
    DEFAULT_TOOL_RESULT_LIMIT,
    MessageHistory,
    ToolCall,
    TranscriptMessage,
    clip_tool_result,
    cut_at_crossing,
    cut_index,
    estimate_tokens,
    serialize_transcript,
    wrap_untrusted_data,
)

T = TypeVar("T")

VOCABULARY = (
    "disk root volume log error warning retry latency cache index shard replica backup restore "
    "deploy rollback config secret token request response timeout kernel memory cpu thread queue "
    "worker broker postgres redis celery migration schema table column constraint the a of to in "
    "and for with on at is was it this that from by be are not or as"
)
WORDS = VOCABULARY.split()


def build_transcript(target_tokens: int, seed: int = 4) -> list[TranscriptMessage]:
    """A deterministic agent session: user asks, assistant calls 1-3 tools, results (some huge), reply."""
    rng = random.Random(seed)
    corpus = " ".join(rng.choice(WORDS) for _ in range(400_000))  # ~2.4 MB of ASCII to slice from

    def text(length: int) -> str:
        start = rng.randrange(0, len(corpus) - length)
        return corpus[start : start + length]

    messages: list[TranscriptMessage] = []
    tokens = 0
    call_number = 0
    while tokens < target_tokens:
        turn: list[TranscriptMessage] = [TranscriptMessage(role="user", text=text(rng.randint(20, 180)))]
        for _ in range(rng.randint(1, 4)):  # tool rounds in this turn
            calls = []
            for _ in range(rng.randint(1, 3)):
                call_number += 1
                arguments = '{"cmd":"' + text(rng.randint(10, 60)) + '"}'
                calls.append(
                    ToolCall(f"call_{call_number}", rng.choice(["ssh_exec", "read_file", "grep"]), arguments)
                )
            turn.append(
                TranscriptMessage(role="assistant", text=text(rng.randint(0, 120)), tool_calls=tuple(calls))
            )
            for c in calls:
                # Most results are short; one in fifty is a log read of 3-12k characters.
                size = rng.randint(3_000, 12_000) if rng.random() < 0.02 else rng.randint(20, 180)
                turn.append(
                    TranscriptMessage(role="tool", text=text(size), tool_call_id=c.id, tool_name=c.name)
                )
        turn.append(TranscriptMessage(role="assistant", text=text(rng.randint(20, 180))))
        messages.extend(turn)
        tokens += sum(estimate_tokens(m) for m in turn)
    return messages


class TimeCapReached(Exception):
    def __init__(self, done: int) -> None:
        super().__init__(f"stopped after {done} steps")
        self.done = done


def naive_cut_index(messages: Sequence[TranscriptMessage], keep: int, cap_s: float) -> int | None:
    """Same rule as cut_index, but each candidate's tail is re-summed from scratch."""
    deadline = time.perf_counter() + cap_s
    n = len(messages)
    if n == 0 or messages[-1].role == "tool":
        return None
    crossing = -1
    for i in range(n - 1, -1, -1):
        if time.perf_counter() > deadline:
            raise TimeCapReached(n - i)
        if sum(estimate_tokens(m) for m in messages[i:]) >= keep:
            crossing = i
            break
    if crossing < 0:
        return None
    return cut_at_crossing(
        MessageHistory(messages), crossing, keep
    )  # the tool-unit rule is linear: shared, not copied


def naive_serialize(messages: Sequence[TranscriptMessage], limit: int) -> str:
    """Same output as serialize_transcript, built by repeated concatenation."""
    out = ""
    for m in messages:
        pieces = []
        if m.is_compaction:
            pieces.append(f"[Previous summary] {m.text}")
        elif m.role == "user":
            pieces.append(f"[User] {m.text}")
        elif m.role == "assistant":
            if m.text or not m.tool_calls:
                pieces.append(f"[Assistant] {m.text}")
            if m.tool_calls:
                pieces.append(
                    "[Assistant tool calls] " + "; ".join(f"{c.name}({c.arguments})" for c in m.tool_calls)
                )
        else:
            label = f"[Tool result: {m.tool_name}]" if m.tool_name else "[Tool result]"
            pieces.append(f"{label} {clip_tool_result(m.text, limit)}")
        for piece in pieces:
            if out:
                out += "\n\n"
            out += piece
    # The delimiter escape is the same single pass in both; reuse it via the wrapper.
    return wrap_untrusted_data(out)[len("<untrusted-data>\n") : -len("\n</untrusted-data>")]


def copy_floor(messages: Sequence[TranscriptMessage]) -> str:
    return "\n\n".join([m.text for m in messages])


def best_of(runs: int, fn: Callable[[], T]) -> tuple[float, T]:
    best = float("inf")
    result: T
    for _ in range(runs):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def timed_capped(fn: Callable[[], T], steps_needed: int) -> tuple[float, T | None, float | None]:
    """(seconds, result or None if capped, extrapolated seconds if capped) - run once, it is slow.

    `steps_needed` is how far back the walk must go (known from the fast cut), so a
    capped run is extrapolated from the share of the quadratic work it finished.
    """
    started = time.perf_counter()
    try:
        result = fn()
    except TimeCapReached as cap:
        elapsed = time.perf_counter() - started
        # Step k costs ~k messages summed, so the work done is ~done^2 of total^2.
        return elapsed, None, elapsed * (steps_needed / max(cap.done, 1)) ** 2
    return time.perf_counter() - started, result, None


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.3f} ms" if seconds < 0.01 else f"{seconds * 1000:,.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=1_000_000, help="transcript size in estimated tokens")
    parser.add_argument("--cap", type=float, default=10.0, help="seconds before a naive baseline is stopped")
    args = parser.parse_args()

    started = time.perf_counter()
    messages = build_transcript(args.tokens)
    build_s = time.perf_counter() - started
    total_tokens = sum(estimate_tokens(m) for m in messages)
    characters = sum(
        len(m.text) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls) for m in messages
    )
    mb = characters / 1e6  # ASCII corpus: one byte a character
    print(f"factmill compaction core benchmark - Python {platform.python_version()} on {platform.machine()}")
    print(
        f"transcript: {len(messages):,} messages, {total_tokens:,} estimated tokens, "
        f"{mb:.1f} MB of text (built in {build_s:.1f} s)"
    )
    print()

    scenarios = [
        ("default budget", DEFAULT_KEEP_RECENT_TOKENS),
        ("keep half", total_tokens // 2),
    ]
    for title, keep in scenarios:
        cut_s, cut = best_of(3, partial(cut_index, messages, keep))
        assert cut is not None
        head = messages[:cut]
        head_chars = sum(
            len(m.text) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls) for m in head
        )
        ser_s, text = best_of(3, partial(serialize_transcript, head, DEFAULT_TOOL_RESULT_LIMIT))
        fast_total = cut_s + ser_s

        naive_cut_s, naive_cut, extrapolated = timed_capped(
            partial(naive_cut_index, messages, keep, args.cap), len(messages) - cut
        )
        if naive_cut is not None:
            assert naive_cut == cut, (naive_cut, cut)
        naive_ser_s, naive_text = best_of(3, partial(naive_serialize, head, DEFAULT_TOOL_RESULT_LIMIT))
        assert naive_text == text
        floor_s, _ = best_of(3, partial(copy_floor, head))

        kept_tokens = sum(estimate_tokens(m) for m in messages[cut:])
        print(
            f"## {title}: keep_recent_tokens={keep:,} -> cut {cut:,} ({len(messages) - cut:,} messages, "
            f"{kept_tokens:,} tokens kept; head {head_chars / 1e6:.1f} MB "
            f"-> {len(text) / 1e6:.2f} MB serialized)"
        )
        print(f"  cut_index            {ms(cut_s):>14}")
        if naive_cut is None:
            assert extrapolated is not None
            print(
                f"  naive cut            {'> ' + ms(naive_cut_s):>14}  (stopped at the {args.cap:.0f} s cap; "
                f"~{extrapolated:,.0f} s extrapolated)  ratio > {naive_cut_s / cut_s:,.0f}x "
                f"(~{extrapolated / cut_s:,.0f}x extrapolated)"
            )
        else:
            print(f"  naive cut            {ms(naive_cut_s):>14}  ratio {naive_cut_s / cut_s:,.1f}x")
        print(
            f"  serialize_transcript {ms(ser_s):>14}  {head_chars / 1e6 / ser_s:,.0f} MB/s of transcript read"
        )
        print(f"  naive serialize (+=) {ms(naive_ser_s):>14}  ratio {naive_ser_s / ser_s:,.2f}x")
        print(f"  copy floor (join)    {ms(floor_s):>14}  serialize costs {ser_s / floor_s:,.1f}x the floor")
        naive_total = naive_cut_s + naive_ser_s
        bound = ">" if naive_cut is None else ""
        print(
            f"  cut + serialize      {ms(fast_total):>14}  vs naive {bound}{ms(naive_total)}: "
            f"{bound}{naive_total / fast_total:,.1f}x; {head_chars / 1e6 / fast_total:,.0f} MB/s of head"
        )
        print()
    print(f"total benchmark time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
