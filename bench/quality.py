"""Benchmark coverage and linear-time density against the naive greedy density, 1k to 200k tokens, and
lex_words on Japanese and Chinese text against uniseg over each whole chunk."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import multiprocessing as mp
import random
import re
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from uniseg.wordbreak import word_break  # noqa: E402
from uniseg.wordbreak import words as uax29_segments  # noqa: E402

from worker.core.quality import (  # noqa: E402  (after the path set-up, so the bench runs from a checkout)
    _GLUES_TO_PREVIOUS,
    SuffixAutomaton,
    _words_from_segments,
    coverage,
    coverage_from_tokens,
    density,
    density_from_tokens,
    lex_words,
)

SIZES = (1_000, 5_000, 20_000, 50_000, 100_000, 200_000)
SEED = 20240605
MIN_MEASURE_SECONDS = 0.3  # repeat small cases until each timing covers at least this long


def load_naive_density() -> Callable[[Sequence[str], Sequence[str]], float]:
    """The naive reference lives in the unit tests; load that very function so both check the same thing."""
    path = ROOT / "tests" / "unit" / "test_quality.py"
    spec = importlib.util.spec_from_file_location("factmill_test_quality", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the naive density reference from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    naive: Callable[[Sequence[str], Sequence[str]], float] = module.naive_density_tokens
    return naive


# ---------------------------------------------------------------------------------------------------------
# Synthetic corpus: Zipf-distributed words in sentences; the "summary" keeps ~30% of the source as spans.
# ---------------------------------------------------------------------------------------------------------


def make_vocabulary(rng: random.Random, size: int = 8_000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocabulary: set[str] = set()
    while len(vocabulary) < size:
        vocabulary.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
    return sorted(vocabulary)


def make_source(rng: random.Random, vocabulary: list[str], n_tokens: int) -> list[str]:
    weights = [1.0 / (rank + 1) for rank in range(len(vocabulary))]
    cumulative = list(_accumulate(weights))
    return rng.choices(vocabulary, cum_weights=cumulative, k=n_tokens)


def _accumulate(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for v in values:
        total += v
        out.append(total)
    return out


def make_summary(rng: random.Random, source: list[str], keep: float = 0.3) -> list[str]:
    """Extractive-ish summary: copied spans of 3-20 words, with some novel connective words between."""
    out: list[str] = []
    i = 0
    while i < len(source):
        span = rng.randint(3, 20)
        if rng.random() < keep:
            out.extend(source[i : i + span])
            if rng.random() < 0.3:
                out.append(f"novel{rng.randint(0, 999)}")
        i += span
    return out


def to_text(tokens: list[str], rng: random.Random) -> str:
    parts: list[str] = []
    for k, token in enumerate(tokens):
        parts.append(token.capitalize() if k % 12 == 0 else token)
        parts.append(". " if k % 12 == 11 else (", " if rng.random() < 0.05 else " "))
    return "".join(parts)


@dataclass
class Case:
    n: int
    source_text: str
    summary_text: str
    source_tokens: list[str]
    summary_tokens: list[str]
    query: list[str]


def make_case(n: int, vocabulary: list[str]) -> Case:
    rng = random.Random(SEED + n)
    source = make_source(rng, vocabulary, n)
    summary = make_summary(rng, source)
    source_text, summary_text = to_text(source, rng), to_text(summary, rng)
    source_tokens, summary_tokens = lex_words(source_text), lex_words(summary_text)
    assert source_tokens == source and summary_tokens == summary, "lexing the corpus must round-trip"
    query = rng.sample(sorted(set(source)), k=min(5, len(set(source))))
    return Case(n, source_text, summary_text, source_tokens, summary_tokens, query)


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


def best_ms(fn: Callable[[], Any]) -> float:
    """Best per-call CPU time in ms over repeats covering MIN_MEASURE_SECONDS (at least 2 runs).

    CPU time of this (single-threaded) process rather than wall time: on a shared 2-core machine it is
    far less disturbed by other processes, and on an idle one the two are the same.
    """
    best = math.inf
    spent, runs = 0.0, 0
    while runs < 2 or spent < MIN_MEASURE_SECONDS:
        start = time.process_time()
        fn()
        elapsed = time.process_time() - start
        best = min(best, elapsed)
        spent += elapsed
        runs += 1
    return best * 1000.0


def _naive_child(
    naive: Callable[[Sequence[str], Sequence[str]], float], src: list[str], comp: list[str], conn: Connection
) -> None:
    start = time.process_time()
    value = naive(src, comp)
    conn.send((value, (time.process_time() - start) * 1000.0))
    conn.close()


def run_naive_capped(
    naive: Callable[[Sequence[str], Sequence[str]], float], case: Case, cap_seconds: float
) -> tuple[float | None, float]:
    """(density, CPU ms) of the naive reference in a child process; (None, the CPU ms it had used) when
    it passed the wall-clock cap and was stopped: on a loaded machine it had less CPU than the cap's
    seconds, and the "at least" ratio is worked out from what it used."""
    context = mp.get_context("fork")  # the child inherits the token lists instead of unpickling them
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_naive_child, args=(naive, case.source_tokens, case.summary_tokens, send))
    child.start()
    send.close()
    finished = receive.poll(cap_seconds)
    result: tuple[float | None, float] = (None, 0.0)
    if finished:
        result = receive.recv()
    elif child.pid is not None:
        with contextlib.suppress(psutil.Error):  # it may end just now
            used = psutil.Process(child.pid).cpu_times()
            result = (None, (used.user + used.system) * 1000.0)
    if child.is_alive():
        child.terminate()
    child.join()
    return result


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


@dataclass
class Row:
    n: int
    summary_tokens: int
    lex_ms: float
    coverage_ms: float
    density_ms: float
    density_text_ms: float
    coverage_text_ms: float
    naive_ms: float | None
    naive_capped_cpu_ms: float  # the CPU a capped naive run had used when it was stopped (0 if not capped)
    density_value: float
    naive_matches: bool | None
    states_per_token: float
    automaton_mb: float


def measure(case: Case, naive: Callable[[Sequence[str], Sequence[str]], float], cap: float) -> Row:
    lex_ms = best_ms(lambda: (lex_words(case.source_text), lex_words(case.summary_text)))
    coverage_ms = best_ms(lambda: coverage_from_tokens(case.source_tokens, case.summary_tokens, case.query))
    density_ms = best_ms(lambda: density_from_tokens(case.source_tokens, case.summary_tokens))
    density_text_ms = best_ms(lambda: density(case.source_text, case.summary_text))
    coverage_text_ms = best_ms(lambda: coverage(case.source_text, case.summary_text, case.query))
    value = density_from_tokens(case.source_tokens, case.summary_tokens)
    naive_result = run_naive_capped(naive, case, cap)
    vocabulary: dict[str, int] = {}
    ids = [vocabulary.setdefault(w, len(vocabulary)) for w in case.summary_tokens]  # what density builds on
    tracemalloc.start()
    automaton = SuffixAutomaton(ids).transitions
    automaton_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return Row(
        n=case.n,
        summary_tokens=len(case.summary_tokens),
        lex_ms=lex_ms,
        coverage_ms=coverage_ms,
        density_ms=density_ms,
        density_text_ms=density_text_ms,
        coverage_text_ms=coverage_text_ms,
        naive_ms=None if naive_result[0] is None else naive_result[1],
        naive_capped_cpu_ms=naive_result[1] if naive_result[0] is None else 0.0,
        density_value=value,
        naive_matches=None if naive_result[0] is None else naive_result[0] == value,
        states_per_token=len(automaton) / max(len(case.summary_tokens), 1),
        automaton_mb=automaton_bytes / 1e6,
    )


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def print_table(rows: list[Row], cap: float) -> None:
    header = (
        f"{'tokens':>8} {'summary':>8} {'lex ms':>9} {'cov ms':>8} {'dens ms':>9} {'dens+lex':>9} "
        f"{'naive ms':>10} {'ratio':>9} {'dens ms/1k':>10} {'equal':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if r.naive_ms is None:
            naive, ratio = "capped", f">{r.naive_capped_cpu_ms / r.density_ms:,.0f}×"
        else:
            naive, ratio = f"{r.naive_ms:,.1f}", f"{r.naive_ms / r.density_ms:,.0f}×"
        equal = "-" if r.naive_matches is None else ("yes" if r.naive_matches else "NO")
        print(
            f"{r.n:>8,} {r.summary_tokens:>8,} {r.lex_ms:>9.1f} {r.coverage_ms:>8.1f} {r.density_ms:>9.1f} "
            f"{r.density_text_ms:>9.1f} {naive:>10} {ratio:>9} {r.density_ms * 1000 / r.n:>10.3f} {equal:>6}"
        )
    print()
    print("times are best-of-repeats CPU milliseconds per call (single thread).")
    print("tokens: source words; summary: words of the compressed text (~30% of the source, copied spans).")
    print("dens ms / cov ms: density_from_tokens / coverage_from_tokens on lexed words (the algorithms);")
    print("dens+lex: density(source_text, summary_text), lexing included; lex ms: lex_words on both texts.")
    print(f"naive: the seed's greedy density (tests/unit/test_quality.py), stopped at {cap:g} s ('capped');")
    print("ratio = naive / dens (CPU time; where capped, a lower bound from the CPU it had used by then);")
    print("equal: both densities identical.")


def print_linearity(rows: list[Row]) -> None:
    ns = [r.n for r in rows]
    print()
    print("growth (log-log least-squares slope of time vs tokens; 1.0 = linear, 2.0 = quadratic):")
    for label, ys in (
        ("density (tokens)", [r.density_ms for r in rows]),
        ("density (text, incl. lexing)", [r.density_text_ms for r in rows]),
        ("coverage (tokens)", [r.coverage_ms for r in rows]),
        ("coverage (text, incl. lexing)", [r.coverage_text_ms for r in rows]),
        ("lex_words", [r.lex_ms for r in rows]),
    ):
        print(f"  {label:<30} slope {loglog_slope(ns, ys):.2f}")
    finished = [r for r in rows if r.naive_ms is not None]
    if len(finished) >= 2:
        slope = loglog_slope([r.n for r in finished], [r.naive_ms or 0.0 for r in finished])
        print(f"  {'naive density':<30} slope {slope:.2f} (sizes that finished)")
    print()
    print("work per token (machine-independent): suffix-automaton states per summary token (the automaton is")
    print("built on the summary; the source streams through it), and its memory:")
    for r in rows:
        print(
            f"  {r.n:>8,} source tokens, {r.summary_tokens:>7,} summary tokens: {r.states_per_token:.3f} "
            f"states/token, {r.automaton_mb:6.1f} MB"
        )
    print(
        "States per token stay flat, the source takes amortised O(1) steps a word through the automaton and"
    )
    print("the walk over the summary at most 2 look-ups a word, so the work is linear; what rises in 'dens")
    print(
        "ms/1k' is the cost of each memory access once the automaton (~330 B per token in CPython) outgrows"
    )
    print("the CPU caches (see lscpu for the L2/L3 sizes).")


def plot(rows: list[Row], cap: float, path: Path) -> None:
    import matplotlib  # imported here: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r.n for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = (
        ("density (lexed words)", [r.density_ms for r in rows], "o-"),
        ("density incl. lexing", [r.density_text_ms for r in rows], "s-"),
        ("coverage (lexed words)", [r.coverage_ms for r in rows], "^-"),
        ("lex_words (both texts)", [r.lex_ms for r in rows], "d--"),
    )
    for label, ys, style in series:
        left.loglog(ns, ys, style, label=label)
    finished = [r for r in rows if r.naive_ms is not None]
    if finished:
        left.loglog([r.n for r in finished], [r.naive_ms for r in finished], "x-", color="crimson",
                    label="naive greedy density")  # fmt: skip
    capped = [r for r in rows if r.naive_ms is None]
    if capped:
        left.loglog([r.n for r in capped], [cap * 1000.0] * len(capped), "x", color="crimson", alpha=0.4,
                    label=f"naive stopped at {cap:g} s cap")  # fmt: skip
    reference = rows[-1].density_ms
    left.loglog(ns, [reference * n / ns[-1] for n in ns], ":", color="grey", label="slope 1 (linear)")
    left.set_xlabel("source tokens")
    left.set_ylabel("time per call (ms)")
    left.set_title("Time vs input size (log-log)")
    left.legend(fontsize=8)
    left.grid(True, which="both", alpha=0.3)

    per_1k = [(label, ys, style) for label, ys, style in series if not label.startswith("lex")]
    for label, ys, style in per_1k:
        right.loglog(ns, [y * 1000 / n for y, n in zip(ys, ns, strict=True)], style, label=label)
    if finished:
        right.loglog([r.n for r in finished], [(r.naive_ms or 0.0) * 1000 / r.n for r in finished], "x-",
                     color="crimson", label="naive greedy density")  # fmt: skip
    right.set_xlabel("source tokens")
    right.set_ylabel("ms per 1k source tokens (log)")
    right.set_title("Cost per 1k tokens (naive grows with n)")
    right.legend(fontsize=8)
    right.grid(True, which="both", alpha=0.3)

    fig.suptitle("Factmill quality gate: coverage and linear-time density vs the naive greedy density")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


# ---------------------------------------------------------------------------------------------------------
# CJK lexing: text without spaces is one chunk; lex_words peels off the runs of ideographs, hiragana and
# CJK punctuation (each its own UAX #29 segment) and segments only the text between them with uniseg.
# ---------------------------------------------------------------------------------------------------------

CJK_CASES = (("Japanese", 370_000), ("Chinese", 100_000))
KATAKANA_WORDS = ["コーヒー", "サーバー", "パスワード", "データベース", "バックアップ", "ドライブ", "ｶﾞｰﾃﾞﾝ"]
PARTICLES = ["の", "は", "を", "に", "が", "で", "と", "です", "ます", "した", "して", "ている", "から"]


def make_japanese(rng: random.Random, n: int) -> str:
    """Sentences of kanji compounds, katakana words, hiragana particles, digits and 、。「」, no spaces."""
    kanji = [chr(rng.randint(0x4E00, 0x9FA0)) for _ in range(1_500)]
    katakana = KATAKANA_WORDS + [
        "".join(chr(rng.randint(0x30A1, 0x30F6)) for _ in range(rng.randint(2, 6))) for _ in range(300)
    ]
    out: list[str] = []
    size = 0
    while size < n:
        words: list[str] = []
        for _ in range(rng.randint(3, 9)):
            r = rng.random()
            if r < 0.5:
                word = "".join(rng.choices(kanji, k=rng.randint(1, 3)))
            elif r < 0.75:
                word = rng.choice(katakana)
            elif r < 0.8:
                word = str(rng.randint(1, 2024))
            elif r < 0.83:
                word = "「" + "".join(rng.choices(kanji, k=2)) + "」"
            else:
                word = rng.choice(kanji) + rng.choice("くしいっ")
            words.append(word + rng.choice(PARTICLES) + ("、" if rng.random() < 0.15 else ""))
        sentence = "".join(words) + rng.choice("。。。！？") + ("\n" if rng.random() < 0.1 else "")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n]


def make_chinese(rng: random.Random, n: int) -> str:
    """Clauses of ideographs with digits and quotes, joined by ，and ended by 。：；！？、, no spaces."""
    han = [chr(rng.randint(0x4E00, 0x9FA0)) for _ in range(3_000)]
    out: list[str] = []
    size = 0
    while size < n:
        clauses = []
        for _ in range(rng.randint(2, 5)):
            clause = "".join(rng.choices(han, k=rng.randint(4, 14)))
            clause += str(rng.randint(1, 999)) if rng.random() < 0.1 else ""
            clauses.append(f"“{clause}”" if rng.random() < 0.05 else clause)
        sentence = "，".join(clauses) + rng.choice("。。。：；！？、") + ("\n" if rng.random() < 0.08 else "")
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n]


def uniseg_chunk_lex_words(text: str) -> list[str]:
    """lex_words before the CJK runs were peeled off: each whitespace-free chunk with non-ASCII characters
    through uniseg whole (ASCII chunks as lex_words lexes them)."""
    cache: dict[str, list[str]] = {}
    tokens: list[str] = []
    for chunk in re.findall(r"[^ \t\n\r\f\v]+", text):
        found = cache.get(chunk)
        if found is None:
            if chunk.isascii():
                found = cache[chunk] = lex_words(chunk)
            elif word_break(chunk[0]) in _GLUES_TO_PREVIOUS:
                return _words_from_segments(uax29_segments(text))
            else:
                found = cache[chunk] = _words_from_segments(uax29_segments(chunk))
        tokens.extend(found)
    return tokens


def measure_cjk() -> bool:
    """Print lex_words CPU on Japanese and Chinese next to the baseline run once in the same process;
    False when the two lexers' words differ."""
    print("CJK lexing: lex_words against uniseg over each whole chunk (the baseline), same run, CPU ms")
    print(f"{'text':<9} {'chars':>8} {'words':>8} {'lex_words ms':>13} {'baseline ms':>12} {'ratio':>7}")
    same = True
    for name, n in CJK_CASES:
        rng = random.Random(SEED + n)
        text = make_japanese(rng, n) if name == "Japanese" else make_chinese(rng, n)
        tokens = lex_words(text)
        fast_ms = best_ms(partial(lex_words, text))
        start = time.process_time()
        baseline = uniseg_chunk_lex_words(text)  # once: seconds, not milliseconds
        base_ms = (time.process_time() - start) * 1000.0
        same = same and baseline == tokens
        print(
            f"{name:<9} {len(text):>8,} {len(tokens):>8,} {fast_ms:>13.1f} {base_ms:>12,.0f} "
            f"{base_ms / fast_ms:>6.0f}x"
        )
    print("words: lex_words' tokens (the baseline's are the same, checked); lex_words best of repeats.")
    return same


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=SIZES[-1], help="largest source size (200000)")
    parser.add_argument(
        "--naive-cap-seconds", type=float, default=25.0, help="stop the naive density after this long (25)"
    )
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument(
        "--cjk-only", action="store_true", help="only the CJK lexing case (Japanese and Chinese text)"
    )
    args = parser.parse_args(argv)
    if args.cjk_only:
        if measure_cjk():
            return 0
        print("\nERROR: lex_words and the uniseg baseline give different words", file=sys.stderr)
        return 1
    sizes = [n for n in SIZES if n <= args.max_tokens]
    if len(sizes) < 2:
        parser.error(f"--max-tokens must be at least {SIZES[1]}: the growth slope needs two sizes")
    if args.naive_cap_seconds <= 0:
        parser.error("--naive-cap-seconds must be positive")

    naive = load_naive_density()
    vocabulary = make_vocabulary(random.Random(SEED))
    started = time.perf_counter()
    rows: list[Row] = []
    for n in sizes:
        case = make_case(n, vocabulary)
        rows.append(measure(case, naive, args.naive_cap_seconds))
        print(f"  measured {n:,} tokens ({time.perf_counter() - started:.0f} s so far)", file=sys.stderr)
    print(f"python {sys.version.split()[0]}, synthetic Zipf text over {len(vocabulary):,} words, seed {SEED}")
    print()
    print_table(rows, args.naive_cap_seconds)
    print_linearity(rows)
    print()
    cjk_same = measure_cjk()
    if any(r.naive_matches is False for r in rows):
        print("\nERROR: the fast and naive densities differ", file=sys.stderr)
        return 1
    if not cjk_same:
        print("\nERROR: lex_words and the uniseg baseline give different words", file=sys.stderr)
        return 1
    if args.plot is not None:
        plot(rows, args.naive_cap_seconds, args.plot)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
