"""The compaction quality gate: intent query terms, coverage against the threshold, what a retry names."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from worker.core.compaction import SUMMARY_CHAR_LIMIT, SUMMARY_HEADINGS
from worker.core.intent import extract_intent_terms, is_query_word
from worker.core.quality import coverage_from_tokens, density_from_tokens, lex_words

# The instructions contribute the intent terms of at most this many characters.
INTENT_TEXT_LIMIT: Final = 4_000
# A user message this long or longer is context (a pasted log, a document, a monolithic prompt), not a
# question, and gives no query terms (seed 002's rule, its 600-character floor): its words made a
# faithful summary of the head look like it had dropped the answer, and the gate rejected it.
QUESTION_CHAR_LIMIT: Final = 600
MAX_MISSED_TERMS: Final = 40
MAX_TERM_LENGTH: Final = 64  # a longer "word" (a hash, a base64 run) is not worth naming
# A first summary below the threshold gets one retry that names what it missed (seed 002's revert rule,
# with a second chance): two attempts in all.
MAX_ATTEMPTS: Final = 2
# A reply that is not a summary is asked for once more, outside those two: two such replies end the run.
MAX_NOT_SUMMARIES: Final = 2

ResponseOutcome = Literal["refusal", "empty_output", "malformed_output", "truncated_output", "ok"]
# A summary has the first of SUMMARY_HEADINGS, as the prompt asks, among its first lines (any heading
# level, any case, a colon and the goal itself allowed on the line; a line of preamble or a title before
# it, the whole in a code fence, are a model's habits). A reply without it is not a summary: a refusal in
# prose the provider did not flag, an instruction inside the transcript obeyed ("reply only with OK"),
# chat. Its query words could all be missing from the head (coverage 1.0) or absent (not judged), and it
# replaced the history.
_GOAL_HEADING: Final = re.compile(
    r"#{1,6}[ \t]*" + re.escape(SUMMARY_HEADINGS[0].lstrip("# ")) + r"\b[ \t]*(?::.*)?", re.IGNORECASE
)
SUMMARY_LEAD_LINES: Final = 3
_FENCE_OPEN: Final = re.compile(r"```[\w.+-]*[ \t]*")
# A reasoning model's thoughts some OpenAI-compatible servers (vLLM, Ollama, llama.cpp with DeepSeek-R1
# or Qwen3) put in the reply's text ahead of the answer: never the summary. Left in, no real one let the
# heading fall among the first lines, so every compaction on such a server failed as "not a summary".
_THOUGHTS: Final = re.compile(r"\A\s*<(think|thinking)>.*?</\1>", re.DOTALL | re.IGNORECASE)


def intent_terms(instructions: str | None, user_texts: Iterable[str]) -> list[str]:
    """Query words of a transcript's intent: extract_intent_terms over the instructions (capped at
    INTENT_TEXT_LIMIT characters) and those of the latest user messages that are questions (under
    QUESTION_CHAR_LIMIT characters), lexed as the gate lexes (lex_words), first occurrence order, no
    repeats. A term's words pass the intent rule again: "up-to-date" or "and/or" gave the gate "to",
    "and", "or" (and "e-mail" an "e"), which no good summary keeps in every pair, so it failed them. One
    character is a word only outside ASCII letters: a CJK ideograph is one (lex_words splits them), and
    a version's digit ("gpt-4")."""
    questions = [text for text in user_texts if len(text) < QUESTION_CHAR_LIMIT]
    words: list[str] = []
    for text in ((instructions or "")[:INTENT_TEXT_LIMIT], *questions):
        for term in extract_intent_terms(text):
            words.extend(w for w in lex_words(term) if is_query_word(w))
    return list(dict.fromkeys(words))


@dataclass(frozen=True)
class GateResult:
    """How a summary fared at the gate: coverage and density against the head, the query words it lost."""

    coverage: float
    density: float
    passed: bool
    missed_terms: list[str]
    judged: bool  # False: no lexable query words, or the gate is off, so the summary stood
    on_terms: bool  # coverage is of the intent's query words (False: the share of the head's bigrams kept)

    @property
    def gate_coverage(self) -> float | None:
        """The coverage as the gate measures it, what a compaction stores and a label carries: None when
        the intent had no query words (the bigram share is another measure; τ never judges it)."""
        return self.coverage if self.on_terms else None


def missed_query_terms(
    source_tokens: Sequence[str], summary_tokens: Sequence[str], query_words: Sequence[str]
) -> list[str]:
    """Query words whose coverage units (the word, and source bigrams holding it) mostly did not survive.

    In query order; only words that occur in the source. These are what a retry is told to keep.
    """
    query = set(query_words)
    summary_unigrams = set(summary_tokens)
    summary_bigrams = set(itertools.pairwise(summary_tokens))
    total: dict[str, int] = {}
    kept: dict[str, int] = {}
    for word in set(source_tokens) & query:
        total[word] = 1
        kept[word] = int(word in summary_unigrams)
    for bigram in set(itertools.pairwise(source_tokens)):
        survived = bigram in summary_bigrams
        for word in {bigram[0], bigram[1]} & query:
            total[word] += 1
            kept[word] += survived
    missed = [
        w
        for w in dict.fromkeys(query_words)
        if w in total and kept[w] * 2 < total[w] and len(w) <= MAX_TERM_LENGTH
    ]
    return missed[:MAX_MISSED_TERMS]


def judge_summary(
    source_tokens: Sequence[str],
    summary: str,
    query_terms: Sequence[str],
    tau: float,
    *,
    enforced: bool = True,
) -> GateResult:
    """Coverage of ``summary`` against the lexed head on the intent's query terms, gated on ``tau``
    (inclusive: a summary at τ stands).

    With no lexable query words the gate does not judge (seed 002: it gates only on a known question;
    the query-agnostic fallback would penalise exactly the pruning a compaction is for): the summary
    stands, and coverage falls back to the share of source bigrams kept (kept in the attempt log; not
    what the compaction stores, see ``gate_coverage``). Not ``enforced`` (the config's
    ``compaction.quality_gate`` off), it stands too, its coverage still measured.
    """
    summary_tokens = lex_words(summary)
    query_words = [w for term in query_terms for w in lex_words(term)]
    score = coverage_from_tokens(source_tokens, summary_tokens, query_terms)
    dens = density_from_tokens(source_tokens, summary_tokens)
    on_terms = bool(query_words)
    if not on_terms or not enforced:
        return GateResult(score, dens, True, [], judged=False, on_terms=on_terms)
    passed = score >= tau
    missed = [] if passed else missed_query_terms(source_tokens, summary_tokens, query_words)
    return GateResult(score, dens, passed, missed, judged=True, on_terms=True)


def retry_terms(gate: GateResult, query_terms: Sequence[str]) -> list[str]:
    """The words a retry is told to keep: the missed ones, or every query word when none was missed.

    Coverage can fall short on bigrams while every word survives: then every query word is named.
    """
    if gate.missed_terms:
        return gate.missed_terms
    words = dict.fromkeys(w for term in query_terms for w in lex_words(term))
    return [w for w in words if len(w) <= MAX_TERM_LENGTH][:MAX_MISSED_TERMS]


def _unfenced(reply: str) -> str:
    """The reply without a byte-order mark, a reasoning model's thoughts ahead of it, and a code fence
    around the whole of it."""
    text = _THOUGHTS.sub("", reply.lstrip("\ufeff"), count=1).strip()
    first, _, rest = text.partition("\n")
    if _FENCE_OPEN.fullmatch(first.strip()):
        text = rest.rstrip()
        if text.endswith("```"):
            text = text[:-3]
    return text.strip()


def _from_goal(text: str) -> str | None:
    """``text`` from the summary's first heading on, when that heading is among its first
    SUMMARY_LEAD_LINES non-blank lines; None otherwise."""
    lines = text.splitlines()
    seen = 0
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        if _GOAL_HEADING.fullmatch(line.strip()):
            return "\n".join(lines[index:]).strip()
        seen += 1
        if seen == SUMMARY_LEAD_LINES:
            return None
    return None


def _is_content(line: str) -> bool:
    """A line of the summary's own (a heading, a list item), not a preamble's."""
    return line.lstrip().startswith(("#", "-", "*", "+"))


def summary_of(reply: str) -> str:
    """The summary a summarizer's reply gives: trimmed, a fence around it taken off, and a line or two
    of preamble before its first heading (a title line that is not a heading, "Here is the summary:"),
    capped at SUMMARY_CHAR_LIMIT characters (empty: no summary, a failed compaction). Lines before the
    heading that are the summary's own (a section put first) keep the reply whole."""
    text = _unfenced(reply)
    from_goal = _from_goal(text)
    if from_goal is not None:
        before = text[: len(text) - len(from_goal)].rstrip()
        if not any(_is_content(line) for line in before.splitlines()):
            text = from_goal
            if "```" in before and text.endswith("```"):  # a fence opened after the preamble
                text = text[:-3]
    return text[:SUMMARY_CHAR_LIMIT].strip()


def opens_as_summary(text: str) -> bool:
    """Whether a reply has the summary's first heading (``## Goal``) among its first SUMMARY_LEAD_LINES
    non-blank lines (a fence around it not counted)."""
    return _from_goal(_unfenced(text)) is not None


def response_outcome(finish: str, text: str) -> ResponseOutcome:
    """How a summarizer reply ended, as its llm_calls row records it."""
    if finish == "refusal":
        return "refusal"
    if finish == "truncated" and not opens_as_summary(text):
        # Cut off before any summary (a reasoning model thinking past the cap, a long preamble): the cap
        # is at fault, not the model, so the row says so (it read "empty" or "not a summary", asked again
        # at the same cap, and nothing named the setting to raise).
        return "truncated_output"
    if not text.strip():
        return "empty_output"
    if not opens_as_summary(text):
        return "malformed_output"
    if finish == "truncated":
        return "truncated_output"  # still usable: the summary is capped at SUMMARY_CHAR_LIMIT anyway
    return "ok"
