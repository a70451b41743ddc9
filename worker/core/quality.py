"""Summary quality signals: Unicode lexing, query coverage, Grusky density and split-conformal thresholds."""

from __future__ import annotations

import functools
import itertools
import math
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

from uniseg.wordbreak import WordBreak, word_break, words

__all__ = [
    "COVERAGE_THRESHOLD",
    "CoverageScore",
    "SuffixAutomaton",
    "calibrate_threshold",
    "conformal_rank",
    "coverage",
    "coverage_from_tokens",
    "density",
    "density_from_tokens",
    "lex_words",
]

# Provenance: split-conformal calibration (calibrate_threshold(cases, target_recall=0.9, alpha=0.1)) on the
# seed's synthetic fixture yields 0.5 + ε; the shipped value must never be above the calibrated one
# (tests/unit/test_quality.py::test_shipped_threshold_matches_calibration). The calibration queue replaces
# it with a versioned threshold computed from real observations; this is the fallback until one exists.
COVERAGE_THRESHOLD = 0.5

# ---------------------------------------------------------------------------------------------------------
# Lexing
# ---------------------------------------------------------------------------------------------------------

# ASCII whitespace only. Each of these characters has Word_Break Other, WSegSpace, CR, LF or Newline, so
# UAX #29 always breaks before it and after it, except where a following character is glued on: by WB4
# (X (Extend | Format | ZWJ)* → X) or, after a space, by WB3d (WSegSpace × WSegSpace, e.g. U+3000). No rule
# looks across such a character either: WB6/7/11/12 need letters, digits or mid-punctuation on both sides
# and WB15/16 count regional indicators back to the first non-RI. So segmenting each whitespace-free chunk
# on its own gives exactly the segments of the whole text, unless a chunk starts with one of those glued
# characters; that chunk is then segmented with the whitespace before it (tests check the equality on
# random text).
# Non-ASCII spaces are deliberately not split on: U+202F, for one, is ExtendNumLet and joins words.
_CHUNK = re.compile(r"[^ \t\n\r\f\v]+")
# str.split() (twice as fast) also cuts at these, which _CHUNK does not. In ASCII text that is harmless:
# U+001C-U+001F are Other, so UAX #29 breaks around them, and no ASCII character glues onto them.
_SPLIT_DIFFERS = re.compile("[\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")
_GLUES_TO_PREVIOUS = frozenset({WordBreak.EXTEND, WordBreak.FORMAT, WordBreak.ZWJ, WordBreak.WSEGSPACE})

# UAX #29 restricted to ASCII, where every character's Word_Break value is one of: ALetter [A-Za-z],
# Numeric [0-9], ExtendNumLet _, MidLetter :, MidNumLet ., Single_Quote ', MidNum , ;, Double_Quote ",
# CR/LF/Newline/WSegSpace (whitespace, which always breaks) and Other (the rest, which always breaks).
# No Extend, Format, ZWJ, Hebrew letter, Katakana or regional indicator is ASCII, so only WB5-WB13b can
# join: letters, digits and _ never break among themselves (WB5, WB8-WB10, WB13a/b); a : . or ' joins
# when a letter is on both sides (WB6/7, MidLetter and MidNumLetQ) and a , ; . or ' joins when a digit is
# on both sides (WB11/12, MidNum and MidNumLetQ). Each match is one word segment holding a letter, digit
# or _; every other character is a segment of its own with none (tests/unit/test_quality.py checks this
# against uniseg on arbitrary text).
_ASCII_WORD = re.compile(
    r"[A-Za-z0-9_]+(?:(?:(?<=[A-Za-z])[:.'](?=[A-Za-z])|(?<=[0-9])[,;.'](?=[0-9]))[A-Za-z0-9_]+)*"
)

# Characters UAX #29 makes a word segment of their own: Word_Break Other, not Extended_Pictographic, and
# lower() leaves them as they are. Text without spaces (Japanese, Chinese) was one chunk through the
# pure-Python segmenter: 370k characters of Japanese took 10 s. Runs of these characters are peeled off
# and only the text between them is segmented. That gives the same segments as the whole text: UAX #29
# breaks before an Other character (no rule joins one to what precedes it: WB3c needs an
# Extended_Pictographic, WB4 an Extend/Format/ZWJ, the others letters, digits, katakana, spaces or
# regional indicators) and after it, unless WB4 glues an Extend, Format or ZWJ character on (か + U+3099,
# 漢 + U+FE00); so a run's last character followed by one of those stays with the text after it. No rule
# looks across an Other character either (WB6/7/7b/7c/11/12 need letters, digits or mid-punctuation on
# both sides, WB15/16 count regional indicators back to the first that is not one). tests/unit/
# test_quality.py checks that every character here is such a one, and the equality on random text.
_SOLO_RUN = re.compile(
    "["
    "\u3001-\u3004\u3006-\u3029"  # CJK symbols and punctuation: 、。〆〇〈〉《》「」『』【】〜 ... (not 々)
    "\u3041-\u3096\u309d-\u309f"  # hiragana and its iteration marks (not ゛゜: they are Katakana)
    "\u30fb"  # ・ (ー is Katakana)
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # CJK ideographs: extension A, unified, compatibility
    "\U00020000-\U0003ffff"  # planes 2 and 3: ideograph extensions B to H
    "\u201c\u201d"  # “ ”
    # full-width punctuation that is Other (！（）？ ...; not ，：；． which are mid-punctuation)
    "\uff01-\uff06\uff08-\uff0b\uff0d\uff0f\uff1c-\uff20\uff3b-\uff3e\uff40\uff5b-\uff65"
    "]+"
)
_WB4_GLUE = frozenset({WordBreak.EXTEND, WordBreak.FORMAT, WordBreak.ZWJ})


def lex_words(text: str) -> list[str]:
    """Lower-cased words of ``text`` by Unicode word segmentation (UAX #29), punctuation dropped.

    A word is a UAX #29 word segment holding at least one letter or digit (so punctuation, spaces and
    emoji are dropped), lower-cased: the seed's ``s.unicode_words().map(str::to_lowercase)``. ``4.2``,
    ``can't`` and ``run_sql`` stay one word; ``well-known`` is two. UAX #29 gives every CJK ideograph
    and every hiragana its own word, keeps a katakana run one word (``コーヒー``, WB13) and joins it to
    letters and digits through ``_`` (``abc_カタ``, WB13a/b).
    """
    cache: dict[str, list[str]] = {}  # text repeats words heavily; each distinct chunk is segmented once
    pieces: dict[str, list[str]] = {}  # the same for the text between runs of _SOLO_RUN within chunks
    tokens: list[str] = []
    for chunk in _chunks(text):
        found = cache.get(chunk)
        if found is None:
            if not chunk.isascii() and word_break(chunk[0]) in _GLUES_TO_PREVIOUS:
                return _glued_lex_words(text)
            found = cache[chunk] = _chunk_words(chunk, pieces)
        tokens.extend(found)
    return tokens


def _chunk_words(chunk: str, pieces: dict[str, list[str]]) -> list[str]:
    """lex_words of one whitespace-free chunk that starts with no glued character; ``pieces`` caches the
    words of the text between solo runs (kept apart from the chunk cache: a piece may start with U+3000,
    which a chunk of the same text after a space would join by WB3d)."""
    if chunk.isascii():
        # ASCII letters are ALetter and digits Numeric, which never break (WB5, WB8, WB9, WB10).
        return [chunk.lower()] if chunk.isalnum() else _ascii_words(chunk.lower())
    tokens: list[str] = []
    for between, solo in _solo_split(chunk):
        if between:
            found = pieces.get(between)
            if found is None:
                found = pieces[between] = _words_from_segments(words(between))
            tokens.extend(found)
        tokens.extend(filter(str.isalnum, solo))  # one word each, lower() a no-op (see _SOLO_RUN)
    return tokens


def _segments(text: str) -> list[str]:
    """The UAX #29 word segments of ``text``, as ``uniseg.wordbreak.words`` gives them."""
    segments: list[str] = []
    for between, solo in _solo_split(text):
        segments.extend(words(between))
        segments.extend(solo)
    return segments


def _solo_split(text: str) -> Iterator[tuple[str, str]]:
    """``text`` as (between, solo) pairs in order: text to segment, then a run of characters that are
    each a word segment of their own (see _SOLO_RUN); the last pair's run is empty."""
    start = 0
    for match in _SOLO_RUN.finditer(text):
        begin, end = match.span()
        if end < len(text) and _glues_on(text[end]):
            end -= 1  # WB4 glues that character onto the run's last one: they are segmented together
        if begin < end:
            yield text[start:begin], text[begin:end]
            start = end
    yield text[start:], ""


@functools.cache
def _glues_on(char: str) -> bool:
    """Whether WB4 glues ``char`` onto the character before it (cached: called once a solo run)."""
    return word_break(char) in _WB4_GLUE


# A chunk with the ASCII whitespace before it. UAX #29 breaks before that whitespace (see _CHUNK) unless
# WB3d joins it to a WSegSpace ending the chunk before, so a chunk glued to it is segmented with that run
# (and, for WB3d, the text before), as it is in the whole text.
_SPACED_CHUNK = re.compile(r"([ \t\n\r\f\v]*)([^ \t\n\r\f\v]+)")


def _glued_lex_words(text: str) -> list[str]:
    """lex_words of text with a chunk glued to the whitespace before it (a combining mark or U+3000 after
    a space): that chunk is segmented with its whitespace, the others as ever. Segmenting the whole text
    instead took 12 s on a 384k-character compaction head (750 times the fast path), holding the GIL.

    WB3d joins a space to the run of WSegSpace characters (U+3000) ending the text before it, across
    chunks: such a run is one segment with no letter or digit (it gave no token), and acts as one
    WSegSpace for what follows. So the chunk is segmented after that run's last character alone, and
    the run put back at the head of the first segment: segmenting the run again for every chunk made
    "\u3000 " repeated quadratic (1,600 characters took 27 s)."""
    cache: dict[str, list[str]] = {}
    pieces: dict[str, list[str]] = {}
    tokens: list[str] = []
    run: list[str] = []  # the WSegSpace characters ending the text so far, in pieces (joined when needed)
    for space, chunk in _SPACED_CHUNK.findall(text):
        piece = space + chunk
        if not chunk.isascii() and word_break(chunk[0]) in _GLUES_TO_PREVIOUS:
            joined = bool(run) and space.startswith(" ")
            segments = _segments(run[-1][-1] + piece if joined else piece)
            if joined and _has_alphanumeric(segments[0]):  # the run holds none: built only for a token
                segments[0] = "".join(run) + segments[0][1:]
            tokens.extend(_words_from_segments(segments))
        else:
            found = cache.get(chunk)
            if found is None:  # a chunk of no words is cached as [] and must not be segmented again
                found = cache[chunk] = _chunk_words(chunk, pieces)
            tokens.extend(found)
        tail = _wsegspace_tail(piece)
        if len(tail) == len(piece):
            run.append(piece)
        else:
            run = [tail] if tail else []
    return tokens


def _wsegspace_tail(text: str) -> str:
    """The WSegSpace characters that end ``text``."""
    end = len(text)
    while end and word_break(text[end - 1]) is WordBreak.WSEGSPACE:
        end -= 1
    return text[end:]


def _chunks(text: str) -> list[str]:
    """The whitespace-free chunks of ``text`` (see _CHUNK), by ``str.split`` where that cuts the same."""
    if text.isascii() or _SPLIT_DIFFERS.search(text) is None:
        return text.split()
    return _CHUNK.findall(text)


def _ascii_words(text: str) -> list[str]:
    """lex_words of lower-cased ASCII text: the word segments of _ASCII_WORD, less those of only ``_``."""
    found = _ASCII_WORD.findall(text)
    if "_" in text:
        return [word for word in found if word.strip("_")]
    return found


def _words_from_segments(segments: Iterable[str]) -> list[str]:
    """Turn UAX #29 word segments into lex_words tokens (the rule lex_words documents)."""
    return [segment.lower() for segment in segments if _has_alphanumeric(segment)]


def _has_alphanumeric(segment: str) -> bool:
    return any(ch.isalnum() for ch in segment)


# ---------------------------------------------------------------------------------------------------------
# Coverage
# ---------------------------------------------------------------------------------------------------------


def coverage(source: str, compressed: str, query_terms: Iterable[str] | str) -> float:
    """Share of the query-relevant distinct source units that survive into ``compressed``, in [0, 1].

    A unit is a distinct source unigram that is a query term, or a distinct source bigram with a query
    term on either side; it survives when it occurs anywhere in ``compressed``. Distinct types, not
    occurrences, so deduplicating ten copies of the answer keeps coverage at 1.0, while dropping the
    only chunk that holds the answer does not. Query terms are lexed with ``lex_words`` (a term may be
    a phrase; a bare string counts as one phrase).

    With no query terms: the share of distinct source bigrams kept (distinct unigrams when the source
    has a single word). Degenerate cases: empty source → 1.0 (nothing to lose); a query that never
    occurs in the source → 1.0 (no relevant content to drop); empty ``compressed`` → 0.0 otherwise.
    """
    return coverage_from_tokens(lex_words(source), lex_words(compressed), query_terms)


def coverage_from_tokens(
    source_tokens: Sequence[str], compressed_tokens: Sequence[str], query_terms: Iterable[str] | str
) -> float:
    """``coverage`` on texts already lexed with ``lex_words`` (query terms are still raw text)."""
    src, comp = source_tokens, compressed_tokens
    if not src:
        return 1.0
    terms = [query_terms] if isinstance(query_terms, str) else query_terms
    query = {word for term in terms for word in lex_words(term)}
    if not query:
        return _bigram_coverage(src, comp)

    relevant_unigrams = {w for w in src if w in query}
    relevant_bigrams = {(a, b) for a, b in itertools.pairwise(src) if a in query or b in query}
    total = len(relevant_unigrams) + len(relevant_bigrams)
    if total == 0:
        return 1.0
    comp_unigrams = set(comp)
    comp_bigrams = set(itertools.pairwise(comp))
    kept = len(relevant_unigrams & comp_unigrams) + len(relevant_bigrams & comp_bigrams)
    return kept / total


def _bigram_coverage(src: Sequence[str], comp: Sequence[str]) -> float:
    if len(src) < 2:
        src_unigrams = set(src)
        return len(src_unigrams & set(comp)) / len(src_unigrams)
    src_bigrams = set(itertools.pairwise(src))
    comp_bigrams = set(itertools.pairwise(comp))
    return len(src_bigrams & comp_bigrams) / len(src_bigrams)


# ---------------------------------------------------------------------------------------------------------
# Density
# ---------------------------------------------------------------------------------------------------------


def density(source: str, compressed: str) -> float:
    """Grusky density: mean length, in words, of the greedy extractive fragments of ``compressed``.

    Walk ``compressed``; at each position take the longest run of words that also occurs contiguously in
    ``source``, record its length and skip past it; a word found nowhere in ``source`` is a fragment of
    length 0 and advances by one. Diagnostic only (its scale depends on text length and genre); never a
    gate. Either text empty → 0.0. Runs in time linear in the number of words of both texts.
    """
    return density_from_tokens(lex_words(source), lex_words(compressed))


def density_from_tokens(source_tokens: Sequence[str], compressed_tokens: Sequence[str]) -> float:
    """``density`` on texts already lexed with ``lex_words``."""
    if not source_tokens or not compressed_tokens:
        return 0.0
    vocabulary: dict[str, int] = {}
    compressed_ids = [vocabulary.setdefault(w, len(vocabulary)) for w in compressed_tokens]
    automaton = SuffixAutomaton(compressed_ids)
    occurs = automaton.occurring_lengths(vocabulary.get(w, -1) for w in source_tokens)
    transitions = automaton.transitions

    # Why this equals the greedy definition: every path from the initial state of the suffix automaton
    # of `compressed` spells a substring of it, every substring is spelled by exactly one path, and the
    # strings of a state are suffixes of one another, so those of a state that occur in `source` are the
    # ones up to a length (``occurs``). Following compressed[i], compressed[i+1], ... from the initial
    # state while the string read so far occurs in `source` reads off the longest prefix of
    # compressed[i:] that occurs contiguously in `source`, the longest match the greedy definition looks
    # for at i. Greedy then jumps past it (or by one when it is empty), so the walks never overlap: at
    # most 2·len(compressed) transition look-ups. The automaton is built on the compressed text, usually
    # the shorter one, and the source only streams through it: O(len(source) + len(compressed)).
    matched = fragments = 0
    i, n = 0, len(compressed_ids)
    while i < n:
        state, j = 0, i
        while j < n:
            following = transitions[state][compressed_ids[j]]  # every substring of compressed has a path
            if occurs[following] <= j - i:
                break
            state = following
            j += 1
        matched += j - i
        fragments += 1
        i = j if j > i else i + 1
    return matched / fragments


class SuffixAutomaton:
    """The suffix automaton (Blumer et al.) of ``sequence``: state 0 is initial; at most 2n states."""

    def __init__(self, sequence: Sequence[int]) -> None:
        transitions: list[dict[int, int]] = [{}]
        link = [-1]
        length = [0]
        last = 0
        for symbol in sequence:
            current = len(length)
            transitions.append({})
            length.append(length[last] + 1)
            link.append(0)
            p = last
            while p != -1 and symbol not in transitions[p]:
                transitions[p][symbol] = current
                p = link[p]
            if p != -1:
                q = transitions[p][symbol]
                if length[p] + 1 == length[q]:
                    link[current] = q
                else:
                    clone = len(length)
                    transitions.append(dict(transitions[q]))
                    length.append(length[p] + 1)
                    link.append(link[q])
                    while p != -1 and transitions[p].get(symbol) == q:
                        transitions[p][symbol] = clone
                        p = link[p]
                    link[q] = link[current] = clone
            last = current
        self.transitions, self.link, self.length = transitions, link, length

    def occurring_lengths(self, text: Iterable[int]) -> list[int]:
        """For each state, the length of its longest string that occurs contiguously in ``text`` (0 if
        none does; a symbol the automaton has never seen is -1). A state's shorter strings are suffixes
        of its longer ones, so they occur too."""
        transitions, link, length = self.transitions, self.link, self.length
        occurs = [0] * len(length)
        state = matched = 0
        for symbol in text:
            if symbol < 0:  # not in the sequence at all: nothing ending here is a substring
                state = matched = 0
                continue
            # The longest suffix of the text read so far that is a substring: the matching statistics.
            while state and symbol not in transitions[state]:
                state = link[state]
                matched = length[state]
            following = transitions[state].get(symbol)
            if following is None:
                state = matched = 0
                continue
            state, matched = following, matched + 1
            if matched > occurs[state]:
                occurs[state] = matched
        # A string that occurs makes every suffix of it occur: all of its suffix link's strings.
        for state in sorted(range(1, len(length)), key=length.__getitem__, reverse=True):
            if occurs[state] and link[state] > 0:
                occurs[link[state]] = length[link[state]]
        return occurs


# ---------------------------------------------------------------------------------------------------------
# Split-conformal calibration
# ---------------------------------------------------------------------------------------------------------


def _check_coverage(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where} must be a number in [0, 1], got {value!r} ({type(value).__name__})")
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where} must be a number in [0, 1], got {value!r}; coverage is a share of units")
    return float(value)


@dataclass(frozen=True, slots=True)
class CoverageScore:
    """One calibration observation: the coverage a compression scored on a case, and the ground truth.

    ``answer_kept`` is True when that compression genuinely preserved the answer (its recall of the
    answer-bearing content met the target) — the label the threshold has to separate on. Construction
    rejects a coverage that is NaN or outside [0, 1], and a label that is not a bool.
    """

    coverage: float
    answer_kept: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "coverage", _check_coverage(self.coverage, "coverage"))
        if not isinstance(self.answer_kept, bool):
            raise TypeError(
                f"answer_kept must be True or False, got {self.answer_kept!r} "
                f"({type(self.answer_kept).__name__})"
            )


def conformal_rank(n: int, alpha: float) -> int:
    """ceil((n+1)(1-alpha)), the conformal rule's rank, with alpha read as the decimal it was written as:
    in floating point (n+1)(1-alpha) lands just above a whole number for some (0.44 and n 24: 25 x 0.56
    = 14.000000000000002), and the rank came out one too high. ``float()`` first: the repr of a float
    subclass is not a decimal (numpy's float64 is ``np.float64(0.1)``, which Fraction refuses)."""
    return math.ceil((n + 1) * (1 - Fraction(repr(float(alpha)))))


def calibrate_threshold(scores: Iterable[CoverageScore], target_recall: float, alpha: float) -> float:
    """Split-conformal coverage threshold τ: accept a compression when its coverage ≥ τ.

    Among the cases that lost the answer (n of them), take the ceil((n+1)(1−alpha))-th smallest
    coverage (Vovk's finite-sample rank, clamped to [1, n]) and set τ just above it (+ machine epsilon,
    capped at 1.0), so all but an ``alpha`` share of bad cases are rejected; on exchangeable traffic an
    accepted compression then lost the answer with probability ≤ alpha. No observations, or no case
    that lost the answer → 0.0 (no evidence that any cut is dangerous; accept everything).

    If the cases accepted at τ keep the answer less often than ``target_recall``, τ moves just above the
    highest bad coverage seen, so it never claims more than the data. (The seed returned that highest
    coverage itself, which still accepts the bad case sitting at it, contrary to its own comment.) A
    bad case at coverage 1.0 cannot be rejected by any τ in [0, 1].

    Raises ValueError when ``target_recall`` or ``alpha`` is not strictly between 0 and 1, or when a
    coverage is NaN or outside [0, 1].
    """
    for name, value in (("target_recall", target_recall), ("alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < 1.0:
            raise ValueError(f"{name} must be strictly between 0 and 1, got {value!r}")
    observations = list(scores)
    for index, score in enumerate(observations):
        _check_coverage(score.coverage, f"scores[{index}].coverage")
    if not observations:
        return 0.0
    bad = sorted(score.coverage for score in observations if not score.answer_kept)
    if not bad:
        return 0.0

    n = len(bad)
    rank = conformal_rank(n, alpha)
    tau = min(bad[min(max(rank, 1), n) - 1] + sys.float_info.epsilon, 1.0)

    accepted = [score for score in observations if score.coverage >= tau]
    achieved = sum(score.answer_kept for score in accepted) / len(accepted) if accepted else 1.0
    if achieved + 1e-9 < target_recall:
        return min(bad[-1] + sys.float_info.epsilon, 1.0)
    return tau
