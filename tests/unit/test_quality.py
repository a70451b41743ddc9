"""Twins of the seed 002 quality-gate cases, multilingual lexing, and density against a naive reference."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uniseg.emoji import extended_pictographic
from uniseg.wordbreak import WordBreak, word_break
from uniseg.wordbreak import words as uax29_segments

from worker.core.compaction_gate import intent_terms, judge_summary
from worker.core.quality import (
    _SOLO_RUN,
    COVERAGE_THRESHOLD,
    CoverageScore,
    _segments,
    _words_from_segments,
    calibrate_threshold,
    conformal_rank,
    coverage,
    density,
    density_from_tokens,
    lex_words,
)

EPS = sys.float_info.epsilon


def naive_density_tokens(src: Sequence[str], comp: Sequence[str]) -> float:
    """The seed's greedy fragment matching, literally: O(|comp|·|src|·fragment) per call.

    The reference the linear-time ``density`` is checked against (here and in bench/quality.py).
    """
    if not src or not comp:
        return 0.0
    fragments: list[int] = []
    i = 0
    while i < len(comp):
        best = 0
        for s in range(len(src)):
            if src[s] != comp[i]:
                continue
            length = 0
            while s + length < len(src) and i + length < len(comp) and src[s + length] == comp[i + length]:
                length += 1
            best = max(best, length)
        if best == 0:
            fragments.append(0)
            i += 1
        else:
            fragments.append(best)
            i += best
    return sum(fragments) / len(fragments)


# ---------------------------------------------------------------------------------------------------------
# Seed cases: coverage
# ---------------------------------------------------------------------------------------------------------

VAULT = "The vault access code is 7741 and the door is on the left."


def test_coverage_high_when_query_content_survives() -> None:
    c = coverage(VAULT, "vault access code is 7741", ["vault", "code", "7741"])
    # The boundary bigrams the→vault and 7741→and are trimmed at the cut: 7 of 9 units kept.
    assert c == pytest.approx(7 / 9)
    assert c >= 0.75
    assert c > COVERAGE_THRESHOLD


def test_coverage_drops_when_answer_removed() -> None:
    c = coverage(VAULT, "the door is on the left", ["vault", "code", "7741"])
    assert c < COVERAGE_THRESHOLD
    assert c == 0.0


def test_coverage_empty_source_is_one() -> None:
    assert coverage("", "anything", ["x"]) == 1.0
    assert coverage("", "", []) == 1.0
    assert coverage(" ¡!… ", "anything", ["x"]) == 1.0  # punctuation only: no words, nothing to lose


def test_coverage_empty_compressed_is_zero_when_relevant() -> None:
    assert coverage("the code is 7741", "", ["code", "7741"]) == 0.0


def test_coverage_no_query_falls_back_to_bigram_coverage() -> None:
    source = "alpha beta gamma delta epsilon"
    half = coverage(source, "alpha beta gamma", [])
    assert 0.0 < half < 1.0
    assert half == pytest.approx(2 / 4)  # alpha→beta, beta→gamma of four distinct bigrams
    assert coverage(source, source, []) == 1.0
    assert coverage(source, "totally unrelated words here", []) == 0.0


def test_coverage_offtopic_query_is_full() -> None:
    assert coverage("a calm bright morning by the sea", "morning", ["zebra", "xyzzy"]) == 1.0


def test_coverage_is_unicode_aware_cjk() -> None:
    source = "金库的访问密码是 七七四一 然后门在左边"
    q = ["密码", "七七四一"]
    keep = coverage(source, "访问密码是 七七四一", q)
    drop = coverage(source, "然后门在左边", q)
    assert keep > drop
    assert keep >= 0.5


# ---------------------------------------------------------------------------------------------------------
# Seed cases: density
# ---------------------------------------------------------------------------------------------------------


def test_density_matches_hand_computed_fragments() -> None:
    # Fragments over "a b c x e f": "a b c" (3), "x" (0, unmatched), "e f" (2) → 5/3.
    assert density("a b c d e f", "a b c x e f") == pytest.approx(5 / 3)


def test_density_full_copy_equals_length() -> None:
    assert density("one two three four", "one two three four") == pytest.approx(4.0)


def test_density_empty_is_zero() -> None:
    assert density("", "abc") == 0.0
    assert density("abc", "") == 0.0


# ---------------------------------------------------------------------------------------------------------
# Seed cases: calibration
# ---------------------------------------------------------------------------------------------------------


def synthetic_cases() -> list[CoverageScore]:
    """The seed fixture: good ≥ 0.58, bad ≤ 0.50 with the top of the bad cluster repeated at 0.50."""
    good = [0.95, 0.90, 0.86, 0.82, 0.78, 0.74, 0.72, 0.70, 0.66, 0.62, 0.60, 0.58]
    bad = [0.10, 0.15, 0.20, 0.25, 0.30, 0.36, 0.42, 0.46, 0.50, 0.50, 0.50, 0.50]
    return [CoverageScore(c, True) for c in good] + [CoverageScore(c, False) for c in bad]


def test_calibrate_returns_threshold_in_the_gap() -> None:
    tau = calibrate_threshold(synthetic_cases(), 0.9, 0.1)
    assert 0.49 < tau < 0.58
    assert tau == 0.5 + EPS  # rank ceil(13·0.9) = 12 of 12 bad → 0.50, bumped by ε


def test_calibrate_holds_on_held_out() -> None:
    cases = synthetic_cases()
    calibration, held_out = cases[0::2], cases[1::2]
    target = 0.9
    tau = calibrate_threshold(calibration, target, 0.1)
    accepted = [s for s in held_out if s.coverage >= tau]
    assert accepted, "the threshold must admit some held-out cases"
    rate = sum(s.answer_kept for s in accepted) / len(accepted)
    assert rate >= target - 1e-9, f"held-out acceptance keeps the answer ≥ {target}: got {rate} at τ={tau}"


def test_calibrate_all_good_accepts_everything() -> None:
    assert calibrate_threshold([CoverageScore(0.9, True), CoverageScore(0.3, True)], 0.9, 0.1) == 0.0


def test_shipped_threshold_matches_calibration() -> None:
    tau = calibrate_threshold(synthetic_cases(), 0.9, 0.1)
    assert tau + 1e-9 >= COVERAGE_THRESHOLD, "the shipped threshold must not be stronger than calibrated"


# ---------------------------------------------------------------------------------------------------------
# Seed pipeline cases, through the gate a compaction worker calls (judge_summary)
# ---------------------------------------------------------------------------------------------------------


def gate_summary(
    source: str,
    summary: str,
    terms: list[str],
    threshold: float = COVERAGE_THRESHOLD,
    *,
    enforced: bool = True,
) -> bool:
    """Whether the compaction service's gate lets ``summary`` of ``source`` stand."""
    return judge_summary(lex_words(source), summary, terms, threshold, enforced=enforced).passed


ANSWER = "The logistics division reported quarterly revenue of 4.2 million dollars this period."
QUESTION = "what was the quarterly revenue for the logistics division?"
DROPPED_ANSWER = "Weather was pleasant. The cafeteria served pasta today."


def long_context_with_answer() -> str:
    note = "the cafeteria menu rotates weekly and parking is available out back."
    notes = [f"Note {i}: {note}" for i in range(10)]
    context = "\n\n".join([ANSWER, *notes])
    assert len(context) >= 600  # the seed's floor for bulk context, as opposed to a question
    return context


def test_quality_gate_reverts_a_cut_that_deletes_the_answer() -> None:
    context = long_context_with_answer()
    assert len(lex_words(DROPPED_ANSWER)) < len(lex_words(context)), "the cut saves tokens"
    assert coverage(context, DROPPED_ANSWER, [QUESTION]) == pytest.approx(2 / 22)
    assert gate_summary(context, DROPPED_ANSWER, [QUESTION]) is False


def test_quality_gate_reverts_only_the_offending_stage_in_a_chain() -> None:
    # Each stage is judged against the state before it, as the seed's pipeline does.
    state = long_context_with_answer()
    drop_filler = f"{ANSWER}\n\n[filler omitted]"
    outcome = []
    for candidate in (drop_filler, DROPPED_ANSWER):
        applied = gate_summary(state, candidate, [QUESTION])
        outcome.append(applied)
        if applied:
            state = candidate
    assert outcome == [True, False]
    assert "4.2 million" in state
    assert "omitted" in state
    # The filler drop sits exactly on the threshold (11 of 22 units): a cut at τ stands.
    assert coverage(long_context_with_answer(), drop_filler, [QUESTION]) == COVERAGE_THRESHOLD


def test_quality_gate_keeps_a_prune_that_retains_the_answer() -> None:
    answer = "The logistics division quarterly revenue was 4.2 million dollars this period."
    filler = [f"Paragraph {i}: the cat sat quietly on the warm windowsill at dawn." for i in range(8)]
    context = "\n\n".join([answer, *filler])
    # Stand-in for the seed's retrieve stage at keep_ratio 0.3: the answer and two paragraphs stay.
    pruned = "\n\n".join([answer, *filler[:2], "[… 6 paragraphs omitted …]"])
    assert len(lex_words(pruned)) < len(lex_words(context))
    assert gate_summary(context, pruned, [QUESTION]) is True


def test_quality_gate_skipped_without_a_distinct_question() -> None:
    context = long_context_with_answer()
    assert coverage(context, DROPPED_ANSWER, []) < COVERAGE_THRESHOLD  # the fallback would revert...
    assert gate_summary(context, DROPPED_ANSWER, []) is True  # ...but with no question the gate abstains
    assert gate_summary(context, DROPPED_ANSWER, ["?!", " "]) is True  # terms with no words: no question


def test_gate_summary_threshold_is_inclusive_and_tunable() -> None:
    drop_filler = f"{ANSWER}\n\n[filler omitted]"
    assert gate_summary(long_context_with_answer(), drop_filler, [QUESTION], threshold=0.5) is True
    assert gate_summary(long_context_with_answer(), drop_filler, [QUESTION], threshold=0.5 + EPS) is False


def test_quality_gate_off_lets_the_cut_through() -> None:
    """The config's compaction.quality_gate off: the gate never reverts, even an answer-deleting cut
    (the service passes it as ``enforced``; tests/integration/test_compaction_service.py drives it)."""
    context = long_context_with_answer()
    assert gate_summary(context, DROPPED_ANSWER, [QUESTION]) is False
    assert gate_summary(context, DROPPED_ANSWER, [QUESTION], enforced=False) is True
    gate = judge_summary(lex_words(context), DROPPED_ANSWER, [QUESTION], COVERAGE_THRESHOLD, enforced=False)
    assert gate.coverage == pytest.approx(2 / 22) and not gate.judged  # measured, not judged


def test_quality_gate_default_is_on() -> None:
    """On unless the config turns it off: an unset switch, and every spelling of "on", is on."""
    from worker.config_store import COMPACTION_QUALITY_GATE, SWITCHES, is_enabled, validate_value

    assert COMPACTION_QUALITY_GATE in SWITCHES and is_enabled(None)
    assert all(is_enabled(validate_value(COMPACTION_QUALITY_GATE, v)) for v in ("true", "1", "yes", "on"))
    assert not is_enabled(validate_value(COMPACTION_QUALITY_GATE, "off"))
    with pytest.raises(ValueError, match="must be one of true/false"):
        validate_value(COMPACTION_QUALITY_GATE, "maybe")
    assert judge_summary.__kwdefaults__ == {"enforced": True}


# ---------------------------------------------------------------------------------------------------------
# lex_words across scripts
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello, World! The QUICK brown fox.", ["hello", "world", "the", "quick", "brown", "fox"]),
        ("Revenue was 4.2 million, up 3,5 %.", ["revenue", "was", "4.2", "million", "up", "3,5"]),
        ("I can't; you can’t.", ["i", "can't", "you", "can’t"]),
        ("call run_sql now", ["call", "run_sql", "now"]),
        ("a well-known state-of-the-art fix", ["a", "well", "known", "state", "of", "the", "art", "fix"]),
        ("e-mail: bob@example.com", ["e", "mail", "bob", "example.com"]),
        ("Café naïve ÉCOLE", ["café", "naïve", "école"]),
    ],
)
def test_lex_words_latin(text: str, expected: list[str]) -> None:
    assert lex_words(text) == expected


def test_lex_words_cyrillic() -> None:
    assert lex_words("Привет, МИР! Это — тест №5.") == ["привет", "мир", "это", "тест", "5"]


def test_lex_words_greek_lowercases_final_sigma() -> None:
    assert lex_words("ΣΊΣΥΦΟΣ ΟΔΟΣ") == ["σίσυφος", "οδος"]


def test_lex_words_arabic() -> None:
    assert lex_words("مرحبا بالعالم، هذا اختبار؟") == ["مرحبا", "بالعالم", "هذا", "اختبار"]
    # Harakat are combining marks and stay inside their word.
    assert lex_words("كَتَبَ الوَلَدُ") == ["كَتَبَ", "الوَلَدُ"]


def test_lex_words_hebrew() -> None:
    assert lex_words("שלום, עולם") == ["שלום", "עולם"]


def test_lex_words_chinese_one_token_per_ideograph() -> None:
    assert lex_words("金库的密码，是七七四一。") == list("金库的密码是七七四一")


def test_lex_words_katakana_run_is_one_word() -> None:
    # As the seed's unicode_words: WB13 keeps a katakana run (ー included) together; hiragana and
    # ideographs are Word_Break Other, so UAX #29 gives each its own segment.
    assert lex_words("東京でコーヒーを飲みます。") == [*"東京で", "コーヒー", *"を飲みます"]
    assert lex_words("パスワードを教えて") == ["パスワード", "を", "教", "え", "て"]


def test_lex_words_half_width_katakana_keeps_voiced_marks_in_the_word() -> None:
    # ﾞ (U+FF9E) is Extend, so WB4 glues it to its kana, and the run is one word.
    assert lex_words("ｶﾞｰﾃﾞﾝ") == ["ｶﾞｰﾃﾞﾝ"]
    assert lex_words("ｶﾞｰﾃﾞﾝの") == ["ｶﾞｰﾃﾞﾝ", "の"]


def test_lex_words_katakana_joined_to_latin_by_underscore() -> None:
    # WB13a/b join letters, digits and katakana through ExtendNumLet: one word, as in the seed.
    assert lex_words("abc_カタ") == ["abc_カタ"]
    assert lex_words("ABC_カタ_9 x") == ["abc_カタ_9", "x"]


def test_lex_words_hiragana_and_ideographs_one_word_per_character() -> None:
    assert lex_words("ひらがなと漢字") == ["ひ", "ら", "が", "な", "と", "漢", "字"]
    assert lex_words("か\u3099") == ["か\u3099"]  # a combining dakuten stays on its kana (WB4)


def test_japanese_summary_that_drops_the_answer_fails_the_gate() -> None:
    """Kana once came out one token each, so single kana of the query (パ ス ワ ー ド) occurred all over
    a summary that had dropped the answer: coverage 0.69, and the gate let it stand."""
    source = (
        "サーバーのパスワードは「ブルースカイ」です。バックアップはドライブにあります。"
        "ワードプレスのサーバーはスウェーデンです。"
    )
    summary = "バックアップはドライブにあります。ワードプレスのサーバーはスウェーデンです。"
    terms = intent_terms(None, ["パスワードを教えて"])
    assert coverage(source, summary, terms) < 0.5
    assert coverage(source, summary, terms) == 0.0  # no unit holding パスワード survives
    assert gate_summary(source, summary, terms) is False
    assert gate_summary(source, source, terms) is True


def test_lex_words_korean_keeps_words() -> None:
    assert lex_words("한국어 텍스트입니다.") == ["한국어", "텍스트입니다"]


def test_lex_words_mixed_scripts() -> None:
    assert lex_words("Order #42 für 東京 — доставка") == ["order", "42", "für", "東", "京", "доставка"]


def test_lex_words_drops_emoji_keeps_words_around_them() -> None:
    text = "I ❤️ pizza 🍕! Family: 👩‍👩‍👧‍👦, flags 🇫🇷🇩🇪, thumbs 👍🏽"
    assert lex_words(text) == ["i", "pizza", "family", "flags", "thumbs"]


def test_lex_words_keycap_emoji_is_its_digit_word() -> None:
    # A keycap is a digit with combining marks: it holds a digit, so it is a word (as in the seed).
    assert lex_words("press 1️⃣ now") == ["press", "1️⃣", "now"]


def test_lex_words_punctuation_and_whitespace_only() -> None:
    assert lex_words("") == []
    assert lex_words(" \t\n ... !!! — ¿? ") == []


def test_lex_words_leading_combining_mark_matches_whole_text_segmentation() -> None:
    # A chunk starting with a combining mark makes lex_words segment the whole text (see _CHUNK).
    text = "x \u0301a b"
    assert lex_words(text) == _words_from_segments(uax29_segments(text)) == ["x", "a", "b"]
    # WB3d joins an ASCII space to a following ideographic space, and WB4 glues a letter-like mark on.
    text = "a \u3000\uff9e"
    assert lex_words(text) == _words_from_segments(uax29_segments(text)) == ["a", " \u3000\uff9e"]
    # WB3d across chunks: an ideographic space ending the chunk before joins the space, and the mark.
    for text in ("x\u3000 \uff9e", "x\u3000 \u3000 \uff9e a", "x\u3000\t\uff9e"):
        assert lex_words(text) == _words_from_segments(uax29_segments(text)), text
    assert lex_words("x\u3000 \uff9e") == ["x", "\u3000 \uff9e"]


def test_lex_words_segments_only_the_glued_chunk_slowly(monkeypatch: pytest.MonkeyPatch) -> None:
    """One combining mark after a space made lex_words run the pure-Python segmenter over the whole text:
    12 s for a 384k-character compaction head (750 times the fast path), holding the GIL. Only that
    chunk, with the whitespace before it, is segmented so now."""
    from worker.core import quality

    segmented: list[int] = []

    def counted(text: str) -> object:
        segmented.append(len(text))
        return uax29_segments(text)

    monkeypatch.setattr(quality, "words", counted)
    text = "x \u0301a " + "plain words éé here " * 5000 + "  \u3000\uff9e end"
    assert lex_words(text) == _words_from_segments(uax29_segments(text))
    assert segmented and max(segmented) <= 8, max(segmented)
    # WB3d chains (ideographic and ASCII spaces alternating): each chunk once, not the run before it
    # again (that was quadratic: 1,600 characters took 27 s).
    segmented.clear()
    text = "x" + "\u3000 " * 5000 + "\uff9e"
    assert lex_words(text) == _words_from_segments(uax29_segments(text))
    assert sum(segmented) <= 3 * len(text), sum(segmented)


LEX_ALPHABET = [
    *"aZ7.',_-:\"",
    " ", "\t", "\n", "\r", "\u00a0", "\u3000", "\u202f", "\u0301", "\u200d", "\u00ad", "\u2019",
    "カ", "ー", "の", "金", "ｶ", "ﾞ", "\u05d0", "😀", "🇫", "🇷", "\u20e3", "\ufe0f", "я", "ع",
]  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(LEX_ALPHABET), max_size=24).map("".join))
def test_lex_words_chunking_equals_whole_text_segmentation(text: str) -> None:
    assert lex_words(text) == _words_from_segments(uax29_segments(text))


# The ASCII fast path (_ASCII_WORD) against uniseg's segmentation of the whole text: every ASCII character,
# the word-joining ones weighted up, URL- and code-like pieces, and non-ASCII characters mixed in (so both
# the all-ASCII path and the per-chunk path of mixed text are exercised).
ASCII_JOINERS = st.sampled_from([*"aZ9_.:',;\"-", "0", "x"])
URL_PIECES = st.sampled_from(
    ["https://", "example.com", "/a/b?q=1&x=2", "#frag", "v1.2.3", "can't", "'tis", "rock'n'roll", "3,141.59",
     "1;2", "a:b", "e.g.", "user@host.io", "__init__", "_x_", "x__", "C++", "run_sql()", "(4.2)", "--", "..."]
)  # fmt: skip
MIXED_PIECES = st.sampled_from(["é", "\u2019", "ß", "ﬁ", "İ", "K", "\u0301", "金", "カ", "\u00a0", "😀", "я"])


@settings(max_examples=3000, deadline=None)
@given(
    st.lists(
        st.one_of(st.characters(max_codepoint=127), ASCII_JOINERS, URL_PIECES, MIXED_PIECES), max_size=40
    ).map("".join)
)
def test_lex_words_ascii_fast_path_equals_uax29(text: str) -> None:
    assert lex_words(text) == _words_from_segments(uax29_segments(text))


@settings(max_examples=3000, deadline=None)
@given(st.lists(ASCII_JOINERS, max_size=12).map("".join))
def test_lex_words_ascii_word_classes_equal_uax29(text: str) -> None:
    # Only letters, digits, _ and the mid-punctuation classes: every join and break rule among them.
    assert lex_words(text) == _words_from_segments(uax29_segments(text))


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=60))
def test_lex_words_equals_uax29_on_arbitrary_text(text: str) -> None:
    assert lex_words(text) == _words_from_segments(uax29_segments(text))


# CJK text, where runs of ideographs, hiragana and CJK punctuation are peeled off and only the text between
# them goes through uniseg (_SOLO_RUN): what can glue onto a run's last character (WB4: combining dakuten,
# variation selectors, ZWJ, soft hyphen), what joins across characters (katakana, _, letters, digits,
# mid-punctuation, regional indicators), and spaces (the chunking, and WB3d with U+3000).
# Each class is drawn about as often as any other (one_of picks a branch, then a member), so the rare
# characters that glue (U+3099, ZWJ, a variation selector) follow a run's last character often.
CJK_ALPHABET = st.one_of(
    st.sampled_from([*"漢字東京の金", "\U00020b9f", "\u9fff", "\u3400"]),  # Han
    st.sampled_from([*"ひらがなを", "\u309d"]),  # hiragana
    st.sampled_from([*"カタナー", "ｶ", "ｱ", "\u309b", "\uff9e"]),  # katakana (full and half width)
    st.sampled_from(["\u3099", "\u309a"]),  # combining dakuten, handakuten
    st.sampled_from([chr(c) for c in range(0xFE00, 0xFE10)] + ["\U000e0100"]),  # variation selectors
    st.sampled_from(["\u200d", "\u00ad", "\u0301"]),  # ZWJ, Format, Extend
    st.sampled_from([*"aZ7_.':, \"", "\t", "\n"]),  # ASCII: letters, digits, joiners, spaces
    st.sampled_from([*"、。「」・（）！“”，：；．", "\u3005", "\u3000", "１", "Ａ"]),  # CJK punctuation, 々
    st.sampled_from(["😀", "\u2764", "🇯", "🇵", "\u05d0"]),  # pictographs, regional indicators, Hebrew
    st.sampled_from(["7，7", "a：a", "7．7", "１；１", "ｶ_ｶ", '\u05d0"\u05d0']),  # joins across punctuation
)


@settings(max_examples=300, deadline=None)
@given(st.lists(CJK_ALPHABET, max_size=40).map("".join))
def test_lex_words_peeling_cjk_runs_equals_uax29(text: str) -> None:
    assert _segments(text) == list(uax29_segments(text))
    assert lex_words(text) == _words_from_segments(uax29_segments(text))


@pytest.mark.parametrize(
    "text",
    ["漢\ufe00字", "か\u3099き", "漢\u200d😀", "字\u00ad字", "。\u0301x", "漢\U000e0100", "ひ\u3099",
     "東京\u3099カ", "x \u3099漢字", "漢字 \u3000\uff9e日本", "金_カ", "漢'a", "a'漢", "1,漢", "🇯漢🇵",
     "カー漢ー"],
)  # fmt: skip
def test_lex_words_glue_after_a_cjk_run_matches_uax29(text: str) -> None:
    assert _segments(text) == list(uax29_segments(text))
    assert lex_words(text) == _words_from_segments(uax29_segments(text))


def test_solo_run_characters_are_each_a_segment_of_their_own() -> None:
    """Every character _SOLO_RUN matches is Word_Break Other, not Extended_Pictographic, and its own
    lower case: what the peeling relies on (checked against uniseg's data, over all code points)."""
    matched = [chr(c) for c in range(sys.maxunicode + 1) if _SOLO_RUN.fullmatch(chr(c))]
    assert len(matched) > 150_000  # the planes 2-3 ideographs are in
    assert {word_break(c) for c in matched} == {WordBreak.OTHER}
    assert not [c for c in matched if extended_pictographic(c) or c.lower() != c]
    assert {"漢", "の", "、", "。", "「", "！", "“"} <= set(matched)
    assert not {"々", "カ", "ー", "゛", "，", "：", "\u3000", "\u3099"} & set(matched)


def test_lex_words_segments_only_the_text_between_cjk_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Text without spaces was one chunk through the pure-Python segmenter: 370k characters of Japanese
    took 10 s of CPU. Only the text between runs of ideographs, hiragana and CJK punctuation is
    segmented now, each distinct piece once."""
    from worker.core import quality

    segmented: list[str] = []

    def counted(text: str) -> object:
        segmented.append(text)
        return uax29_segments(text)

    monkeypatch.setattr(quality, "words", counted)
    text = "東京でコーヒーを飲みます。サーバーのパスワードは「ブルースカイ」です。" * 200
    expected = _words_from_segments(uax29_segments(text))
    assert lex_words(text) == expected
    assert sorted(segmented) == ["コーヒー", "サーバー", "パスワード", "ブルースカイ"]
    # The same through a chunk glued to the space before it (a combining mark after a space).
    segmented.clear()
    assert lex_words("x \u3099" + text) == _words_from_segments(uax29_segments("x \u3099" + text))
    assert max(map(len, segmented)) <= 8, max(map(len, segmented))


def test_lex_words_ascii_punctuation_joins_only_between_letters_or_digits() -> None:
    text = "Visit https://example.com/a_b?q=1.5 — it's v1.2.3, 3,141.59; a:b a.1 1.a 1'2 x__ __ _y e.g."
    expected = ["visit", "https", "example.com", "a_b", "q", "1.5", "it's", "v1.2.3", "3,141.59", "a:b",
                "a", "1", "1", "a", "1'2", "x__", "_y", "e.g"]  # fmt: skip
    assert lex_words(text) == expected == _words_from_segments(uax29_segments(text))


# ---------------------------------------------------------------------------------------------------------
# coverage details
# ---------------------------------------------------------------------------------------------------------


def test_coverage_query_terms_are_lexed_like_the_text() -> None:
    # Case and punctuation do not matter; a phrase contributes each of its words; a bare string is a phrase.
    assert coverage(VAULT, "vault access code is 7741", ["VAULT!", "Code 7741"]) == pytest.approx(7 / 9)
    assert coverage(VAULT, "vault access code is 7741", "vault code 7741") == pytest.approx(7 / 9)


def test_coverage_counts_distinct_units_not_occurrences() -> None:
    source = " ".join(["the code is 7741."] * 10)
    assert coverage(source, "the code is 7741", ["code"]) == 1.0  # deduplication loses nothing


def test_coverage_single_word_source_without_query_uses_unigrams() -> None:
    assert coverage("hello", "well hello there", []) == 1.0
    assert coverage("hello", "goodbye", []) == 0.0


def test_coverage_bigram_with_query_word_on_either_side_counts() -> None:
    # Units: {code} ∪ {(the, code), (code, is)}; only (code, is) and code survive.
    assert coverage("the code is", "code is", ["code"]) == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------------------
# density: the linear algorithm equals the greedy definition
# ---------------------------------------------------------------------------------------------------------


def test_naive_reference_matches_the_seed_hand_computation() -> None:
    assert naive_density_tokens(list("abcdef"), list("abcxef")) == pytest.approx(5 / 3)


def test_density_prefers_the_longest_match_not_the_first() -> None:
    # At "a" the first source match is "a b" (2) but "a b c d" (4) exists later.
    assert density("a b x a b c d", "a b c d") == 4.0


def test_density_greedy_is_not_optimal_segmentation() -> None:
    # Greedy takes "a b" then "c d"; the definition is greedy by fragment start, not a best cover.
    assert density("a b z b c d", "a b c d") == density_from_tokens(list("abzbcd"), list("abcd")) == 2.0


def test_density_on_long_repetitive_input() -> None:
    # The naive walk is quadratic here; the automaton does one pass.
    n = 20_000
    assert density_from_tokens(["a"] * n, ["a"] * n) == n
    # "b a b a …" matches the source from its second token for n − 1 tokens; the last "a" is a fragment of 1.
    assert density_from_tokens(["a", "b"] * (n // 2), ["b", "a"] * (n // 2)) == n / 2


@pytest.mark.parametrize(("alphabet", "max_len"), [("ab", 7), ("abc", 4)])
def test_density_exhaustive_over_small_universe(alphabet: str, max_len: int) -> None:
    strings = [s for k in range(max_len + 1) for s in itertools.product(alphabet, repeat=k)]
    for src, comp in itertools.product(strings, repeat=2):
        assert density_from_tokens(src, comp) == naive_density_tokens(src, comp), (src, comp)


token_lists = st.integers(min_value=1, max_value=4).flatmap(
    lambda k: st.tuples(
        st.lists(st.sampled_from("abcd"[:k]), max_size=40),
        st.lists(st.sampled_from("abcde"[: k + 1]), max_size=40),
    )
)


@settings(max_examples=3000, deadline=None)
@given(token_lists)
def test_density_equals_naive_reference(pair: tuple[list[str], list[str]]) -> None:
    src, comp = pair
    assert density_from_tokens(src, comp) == naive_density_tokens(src, comp)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(["yes", "no", "4.2", "can't", "東", "Да"]), max_size=30), st.data())
def test_density_on_text_equals_naive_on_lexed_text(src: list[str], data: st.DataObject) -> None:
    comp = data.draw(st.lists(st.sampled_from(["yes", "no", "4.2", "can't", "東", "Да", "new"]), max_size=30))
    source, compressed = " ".join(src), ", ".join(comp)
    assert density(source, compressed) == naive_density_tokens(lex_words(source), lex_words(compressed))


# ---------------------------------------------------------------------------------------------------------
# calibrate_threshold details and bad input
# ---------------------------------------------------------------------------------------------------------


def test_calibrate_uses_the_finite_sample_rank() -> None:
    # n = 19 bad cases, alpha 0.1: rank ceil(20·0.9) = 18, so τ sits just above the 18th smallest.
    bad = [CoverageScore(i / 100, False) for i in range(1, 20)]
    good = [CoverageScore(0.9, True)] * 200
    assert calibrate_threshold(bad + good, 0.5, 0.1) == 0.18 + EPS
    # n = 9: rank ceil(10·0.9) = 9 = n, the largest.
    assert calibrate_threshold(bad[:9] + good, 0.5, 0.1) == 0.09 + EPS
    # A large alpha gives a low rank: n = 4, alpha 0.6 → ceil(5·0.4) = 2.
    assert calibrate_threshold(bad[:4] + good, 0.5, 0.6) == 0.02 + EPS


def test_the_rank_reads_alpha_as_the_decimal_it_was_written_as() -> None:
    """In floating point 25 x (1 - 0.44) is 14.000000000000002, and the rank came out 15, not 14."""
    assert (25 * (1.0 - 0.44), conformal_rank(24, 0.44)) == (14.000000000000002, 14)
    assert (conformal_rank(9, 0.7), conformal_rank(99, 0.45), conformal_rank(19, 0.1)) == (3, 55, 18)
    bad = [CoverageScore(i / 100, False) for i in range(1, 25)]
    assert calibrate_threshold(bad + [CoverageScore(0.9, True)] * 200, 0.5, 0.44) == 0.14 + EPS


def test_calibrate_takes_numpy_floats() -> None:
    """np.float64 is a float, so it passed the checks, but its repr is 'np.float64(0.1)' (numpy 2),
    which the rank's Fraction refused: ValueError instead of a threshold."""
    bad = [CoverageScore(i / 100, False) for i in range(1, 20)]
    cases = bad + [CoverageScore(0.9, True)] * 200
    assert calibrate_threshold(cases, 0.9, np.float64(0.1)) == 0.18 + EPS  # as with alpha 0.1
    assert calibrate_threshold(cases, np.float64(0.9), np.float64(0.1)) == 0.18 + EPS
    assert calibrate_threshold(cases, 0.5, np.float64(0.44)) == calibrate_threshold(cases, 0.5, 0.44)
    assert conformal_rank(24, np.float64(0.44)) == conformal_rank(24, 0.44) == 14


def test_calibrate_rejects_a_bad_case_exactly_at_the_quantile() -> None:
    cases = [CoverageScore(0.4, False), CoverageScore(0.4, True), CoverageScore(0.8, True)]
    tau = calibrate_threshold(cases, 0.9, 0.1)
    assert tau > 0.4
    assert [s.coverage >= tau for s in cases] == [False, False, True]


def test_calibrate_caps_the_threshold_at_one() -> None:
    assert calibrate_threshold([CoverageScore(1.0, False), CoverageScore(0.2, True)], 0.5, 0.1) == 1.0


def test_calibrate_falls_back_above_every_bad_case_when_target_is_missed() -> None:
    # 10 bad cases, alpha 0.5: rank ceil(11·0.5) = 6 → τ above 0.6 still accepts 0.7…1.0-ish bad cases,
    # so only 1 of 5 accepted cases keeps the answer: the target is missed and τ moves above the worst bad.
    bad = [CoverageScore(c / 10, False) for c in range(1, 11) if c != 10] + [CoverageScore(0.95, False)]
    cases = [*bad, CoverageScore(0.99, True)]
    tau = calibrate_threshold(cases, 0.9, 0.5)
    assert tau == 0.95 + EPS
    accepted = [s for s in cases if s.coverage >= tau]
    assert accepted == [CoverageScore(0.99, True)]


def test_calibrate_only_bad_cases_rejects_them_all() -> None:
    cases = [CoverageScore(c, False) for c in (0.1, 0.2, 0.3)]
    tau = calibrate_threshold(cases, 0.9, 0.1)
    assert tau == 0.3 + EPS
    assert not [s for s in cases if s.coverage >= tau]


def test_calibrate_empty_is_zero() -> None:
    assert calibrate_threshold([], 0.9, 0.1) == 0.0


def test_calibrate_accepts_any_iterable() -> None:
    assert calibrate_threshold(iter(synthetic_cases()), 0.9, 0.1) == 0.5 + EPS


@pytest.mark.parametrize("value", [math.nan, -0.01, 1.01, math.inf, -math.inf])
def test_coverage_score_rejects_values_outside_unit_interval(value: float) -> None:
    with pytest.raises(ValueError, match=r"coverage must be a number in \[0, 1\]"):
        CoverageScore(value, True)


@pytest.mark.parametrize("value", ["0.5", None, True])
def test_coverage_score_rejects_non_numbers(value: object) -> None:
    with pytest.raises(TypeError, match="coverage must be a number"):
        CoverageScore(value, True)  # type: ignore[arg-type]


@pytest.mark.parametrize("label", ["false", 0, None])
def test_coverage_score_rejects_non_bool_labels(label: object) -> None:
    with pytest.raises(TypeError, match="answer_kept must be True or False"):
        CoverageScore(0.5, label)  # type: ignore[arg-type]


def test_coverage_score_is_frozen_and_normalises_ints() -> None:
    score = CoverageScore(1, True)  # type: ignore[arg-type]
    assert score.coverage == 1.0
    assert isinstance(score.coverage, float)
    with pytest.raises(AttributeError):
        score.coverage = 0.2  # type: ignore[misc]


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, math.nan])
def test_calibrate_rejects_alpha_outside_open_unit_interval(alpha: float) -> None:
    with pytest.raises(ValueError, match="alpha must be strictly between 0 and 1"):
        calibrate_threshold(synthetic_cases(), 0.9, alpha)


@pytest.mark.parametrize("target", [0.0, 1.0, -0.1, 2.0, math.nan])
def test_calibrate_rejects_target_outside_open_unit_interval(target: float) -> None:
    with pytest.raises(ValueError, match="target_recall must be strictly between 0 and 1"):
        calibrate_threshold(synthetic_cases(), target, 0.1)


def test_calibrate_rejects_an_invalid_observation_that_bypassed_construction() -> None:
    broken = CoverageScore(0.5, False)
    object.__setattr__(broken, "coverage", math.nan)
    with pytest.raises(ValueError, match=r"scores\[1\]\.coverage must be a number in \[0, 1\], got nan"):
        calibrate_threshold([CoverageScore(0.2, True), broken], 0.9, 0.1)
