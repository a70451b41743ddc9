"""Search over a seeded corpus with known answers: lexical, vector, hyde, expansion, fusion, snippets,
filters, audit rows, bad query documents; through the Python API, HTTP and the CLI."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import struct
import time
import typing
import unicodedata
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import example, given, settings
from hypothesis import strategies as st
from sqlalchemy import event, func, insert, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from models import Fact, LLMCall
from tests.auth import send_key
from tests.conftest import fresh_database, has_vector_store, rolled_back
from worker import db
from worker.config_store import ConfigReader
from worker.core.folding import fold_accents
from worker.core.intent import QueryParseError
from worker.llm.errors import LLMError
from worker.llm.openai_compat import OpenAIChatClient
from worker.runtime import Runtime
from worker.search import (
    EXPANSION_PURPOSE,
    MAX_SEARCH_LINES,
    EmbeddingFailedError,
    SearchError,
    SearchFilters,
    VectorSearchUnavailableError,
    embed_facts,
    embed_new_facts,
    embed_pages_facts,
    normalise_score,
    parse_expansion,
    parse_lex_query,
    search,
    vector_search_status,
)
from worker.search.values import HNSW_EF_SEARCH, MIN_CANDIDATES, Deadline
from worker.settings import Settings, get_settings
from worker.simulator import Simulator, SimulatorConfig

pytestmark = pytest.mark.integration

SEGMENT = {
    "alice-chat": "conversation segment 2024-03-01T09:00:00Z to 2024-03-01T09:40:00Z",
    "bob-chat": "conversation segment 2024-04-02T18:00:00Z to 2024-04-02T18:25:00Z",
    "team-sync": "conversation segment 2024-05-10T14:00:00Z to 2024-05-10T14:50:00Z",
    "travel": "conversation segment 2023-11-20T08:00:00Z to 2023-11-20T08:15:00Z",
}
VALID_FROM = {
    "alice-chat": datetime(2024, 3, 1, 9, tzinfo=UTC),
    "bob-chat": datetime(2024, 4, 2, 18, tzinfo=UTC),
    "team-sync": datetime(2024, 5, 10, 14, tzinfo=UTC),
    "travel": datetime(2023, 11, 20, 8, tzinfo=UTC),
}
# (page, fact, kind, entity); row numbers follow the order within a page.
CORPUS: list[tuple[str, str, str, str]] = [
    ("alice-chat", "Alice moved to Lisbon in March 2024", "event", "alice"),
    ("alice-chat", "Alice prefers oat milk in her coffee", "preference", "alice"),
    ("alice-chat", "Alice promised to send the quarterly budget deck by Friday", "commitment", "alice"),
    ("alice-chat", "Alice believes the launch should slip by one week", "belief", "alice"),
    ("alice-chat", "Alice signed the offer letter from Acme Corp", "event", "alice"),
    ("bob-chat", "Bob adopted a greyhound named Pixel", "event", "bob"),
    ("bob-chat", "Bob is allergic to peanuts", "fact", "bob"),
    ("bob-chat", "Bob committed to running the Berlin marathon in September", "commitment", "bob"),
    ("bob-chat", "Bob prefers aisle seats on long flights", "preference", "bob"),
    ("team-sync", "The performance review cycle starts in June", "fact", "hr"),
    (
        "team-sync",
        "Web page load performance regressed to three seconds after the redesign",
        "event",
        "web-team",
    ),
    ("team-sync", "Carol owns the database migration to Postgres 16", "commitment", "carol"),
    ("team-sync", "The staging cluster runs out of disk every Tuesday", "fact", "infra"),
    ("travel", "Dmitri booked a cabin in Norway for the winter holidays", "event", "dmitri"),
    ("travel", "Priya's passport expires in January 2025", "fact", "priya"),
]
FILLER_WORDS = ("groceries", "laundry", "standup", "lunch", "errands", "emails", "calendar", "gym")


def seed(factory: sessionmaker[Session], *, filler: int = 60) -> dict[str, int]:
    """Write the corpus (plus filler facts and audit rows) straight into facts; fact text → id."""
    rows: list[dict[str, Any]] = []
    per_page: dict[str, int] = {}
    for page, fact, kind, entity in CORPUS:
        row_num = per_page.get(page, 0)
        per_page[page] = row_num + 1
        rows.append(_row("default", page, row_num, fact, kind, entity, SEGMENT[page], VALID_FROM[page]))
    for i in range(filler):
        word = FILLER_WORDS[i % len(FILLER_WORDS)]
        context = (
            f"conversation segment 2024-02-{1 + i // 10:02d}T10:00:00Z to 2024-02-{1 + i // 10:02d}T10:30:00Z"
        )
        rows.append(
            _row(
                "default",
                f"eve-diary-{i // 10}",
                i % 10,
                f"Eve mentioned the team {word} plan for week {i}",
                "fact",
                "eve",
                context,
                datetime(2024, 2, 1 + i // 10, 10, tzinfo=UTC),
            )
        )
    # Another source with a Lisbon fact, for the source_id filter.
    rows.append(
        _row("work", "work-notes", 0, "Frank opened the Lisbon office", "event", "frank", "notes", None)
    )
    # Audit rows: the terminal markers. Their text matches queries on purpose; they must never show.
    for page in SEGMENT:
        audit = _row(
            "default", page, -1, "EXTRACTION_COMPLETE Lisbon greyhound marathon", "fact", "", "", None
        )
        audit |= {"is_audit": True, "entity_slug": None, "source": "cli:extract-conversation-facts:terminal"}
        rows.append(audit)
    with factory.begin() as session:
        session.execute(insert(Fact), rows)
        ids = {
            r.fact: r.id for r in session.execute(select(Fact.fact, Fact.id).where(Fact.is_audit.is_(False)))
        }
    return ids


def _row(
    source_id: str,
    page: str,
    row_num: int,
    fact: str,
    kind: str,
    entity: str,
    context: str,
    valid_from: datetime | None,
) -> dict[str, Any]:
    return {
        "source_id": source_id,
        "fact": fact,
        "kind": kind,
        "entity_slug": entity,
        "confidence": 0.9,
        "notability": "high" if row_num == 0 else "medium",
        "context": context,
        "valid_from": valid_from,
        "source": "cli:extract-conversation-facts",
        "source_session": f"cli:extract-conversation-facts:{page}",
        "source_markdown_slug": page,
        "row_num": row_num,
        "is_audit": False,
    }


def sim_client(simulator: Any) -> OpenAIChatClient:
    return OpenAIChatClient(
        model="simulator-1",
        base_url=simulator.base_url,
        provider="simulator",
        embedding_model="simulator-embedding-1",
    )


def chat_calls(simulator: Any) -> int:
    return int(simulator.stats()["by_route"].get("chat.completions", 0))


def facts_of(outcome: Any) -> list[str]:
    return [r.fact for r in outcome.results]


# ------------------------------------------------------------------ databases with and without pgvector


def _empty(url: str) -> sessionmaker[Session]:
    engine = db.get_engine(url)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE facts, llm_calls RESTART IDENTITY CASCADE"))
    return sessionmaker(engine, expire_on_commit=False)


@pytest.fixture(scope="session")
def plain_database_url(server_url: str, database_url: str) -> Iterator[str]:
    """A database without the pgvector store: the test database when its server lacks pgvector,
    else a fresh one whose store and extension were dropped (what a server without pgvector has)."""
    if not has_vector_store(database_url):
        yield database_url
        return
    with fresh_database(server_url, "novec") as url:
        db.upgrade(url)
        with db.get_engine(url).begin() as conn:
            conn.execute(text("DROP SCHEMA search CASCADE"))
            conn.execute(text("DROP EXTENSION IF EXISTS vector"))
        yield url


# Truncation: the vector database may be the embedded pgserver (its own engine); the CLI opens its own.
@pytest.fixture
def vector_factory(vector_database_url: str, factory: sessionmaker[Session]) -> sessionmaker[Session]:
    return _empty(vector_database_url)


@pytest.fixture
def plain_factory(plain_database_url: str) -> Iterator[sessionmaker[Session]]:
    """The database without pgvector, in a transaction rolled back after the test (conftest.rolled_back)."""
    with rolled_back(plain_database_url) as factory:
        yield factory


@pytest.fixture
def llm(simulator: Any) -> OpenAIChatClient:
    return sim_client(simulator)


# --------------------------------------------------------------------------- lexical: known answers


@pytest.mark.parametrize(
    ("query", "answer"),
    [
        ("lex: greyhound", "Bob adopted a greyhound named Pixel"),
        ("lex: lisbon", "Alice moved to Lisbon in March 2024"),
        ('lex: "oat milk"', "Alice prefers oat milk in her coffee"),
        ("lex: berlin marathon", "Bob committed to running the Berlin marathon in September"),
        ("lex: passport", "Priya's passport expires in January 2025"),
        ("lex: postgres", "Carol owns the database migration to Postgres 16"),
        ("lex: norway cabin", "Dmitri booked a cabin in Norway for the winter holidays"),
    ],
)
def test_lexical_top_1(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, query: str, answer: str
) -> None:
    seed(plain_factory)
    outcome = search(plain_factory, llm, query, filters=SearchFilters(source_id="default"))
    assert outcome.results[0].fact == answer
    assert 0 < outcome.results[0].lex_score < 1  # type: ignore[operator]


def test_a_word_only_hidden_facts_hold_is_dropped_like_a_word_no_fact_holds(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """Presence was counted over the whole table: a word found only in superseded facts, or only in
    another source, stayed in every try of the fallback and the answer was empty, while a word found
    nowhere was dropped: a key limited to one source learnt whether a word was in another's facts."""
    seed(plain_factory)
    with plain_factory.begin() as session:
        session.execute(
            insert(Fact),
            [
                _row("default", "old-job", 0, "Alice worked at Zebracorp", "fact", "alice", "c", None)
                | {"status": "superseded"},
                _row(
                    "work", "work-secret", 0, "Quokkafund is the acquisition target", "fact", "x", "c", None
                ),
            ],
        )
    mine = SearchFilters(source_id="default")

    def found(query: str) -> list[str]:
        return facts_of(search(plain_factory, llm, query, filters=mine))

    nowhere = found("lex: lisbon qqqqzzzz")
    assert nowhere  # a word no fact holds is dropped
    assert found("lex: lisbon quokkafund") == nowhere  # nor does another source's word change the answer
    assert found("lex: lisbon zebracorp") == nowhere  # nor a word only a superseded fact holds


def test_a_snippet_quotes_only_facts_the_search_itself_would_return(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """The neighbour lines of a snippet were any of the segment's rows: a current fact's snippet quoted
    the superseded claim beside it, and could centre on it."""
    context = "conversation segment 2024-05-01T10:00:00Z to 2024-05-01T10:30:00Z"
    with plain_factory.begin() as session:
        session.execute(
            insert(Fact),
            [
                _row(
                    "default",
                    "moves",
                    0,
                    "Alice moved to Lisbon with Porto friends",
                    "fact",
                    "alice",
                    context,
                    None,
                )
                | {"status": "superseded"},
                _row("default", "moves", 1, "Alice moved to Porto", "fact", "alice", context, None),
                _row("default", "moves", 2, "Alice likes the Porto tram", "fact", "alice", context, None),
            ],
        )
    [result, *_] = search(
        plain_factory, llm, "lex: alice porto", filters=SearchFilters(source_id="default")
    ).results
    assert "Lisbon" not in result.snippet, result.snippet
    history = search(
        plain_factory,
        llm,
        "lex: alice moved porto",
        filters=SearchFilters(source_id="default", include_history=True),
    )
    assert any("Lisbon" in r.snippet for r in history.results)  # with the history, it is quoted


ACCENTED = [
    ("zoe-chat", "Zoë Ångström is moving to Lisbon in July", "people/zoë-ångström"),
    ("sofia-chat", "Sofía Castillo booked the venue in Núñez", "people/sofía-castillo"),
    ("soren-chat", "Søren Østergaard flew to Łódź for the conference", "people/søren-østergaard"),
    ("minji-chat", "김민지 moved to 서울 last spring", "people/김민지"),
    ("plain-chat", "Zoe from accounting likes the new coffee machine", "people/zoe-park"),
]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("lex: zoe angstrom", {"Zoë Ångström is moving to Lisbon in July"}),
        (
            "lex: Zoë",
            {"Zoë Ångström is moving to Lisbon in July", "Zoe from accounting likes the new coffee machine"},
        ),
        ("lex: sofia castillo", {"Sofía Castillo booked the venue in Núñez"}),
        ('lex: "in nunez"', {"Sofía Castillo booked the venue in Núñez"}),  # a phrase folds too
        ("lex: lodz", {"Søren Østergaard flew to Łódź for the conference"}),
        ("lex: zoe -angstrom", {"Zoe from accounting likes the new coffee machine"}),  # and an exclusion
        ("lex: 서울", {"김민지 moved to 서울 last spring"}),  # Hangul is decomposed, then recomposed
        ("lex: ostergaa", {"Søren Østergaard flew to Łódź for the conference"}),  # a prefix
    ],
)
def test_lexical_search_folds_accents_on_both_sides(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, query: str, expected: set[str]
) -> None:
    """Words were matched as written: "zoe" or "sofia castillo" found nothing where facts say Zoë
    Ångström and Sofía Castillo (migration 0021's search_fold)."""
    rows = [_row("default", page, 0, fact, "fact", entity, "", None) for page, fact, entity in ACCENTED]
    with plain_factory.begin() as session:
        session.execute(insert(Fact), rows)
    assert set(facts_of(search(plain_factory, llm, query))) == expected


# Assigned, storable characters (no NUL, no surrogates): Python's and Postgres's Unicode tables may
# differ on characters assigned later.
FOLDABLE = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cn"), blacklist_characters="\x00"), max_size=40
)


def test_python_folds_accents_as_sql_does(plain_factory: sessionmaker[Session]) -> None:
    """Snippets fold in Python (worker.core.folding), the index and queries in SQL (search_fold): the
    two must agree, or a snippet would miss the line the search matched."""
    fixed = ["Zoë Ångström", "Søren Østergaard Łódź Đà Nẵng", "Ἀθῆναι", "한국어 が", "हिन्दी", "ﬁ ½ Ⅻ"]
    with plain_factory() as session:

        @settings(max_examples=300, deadline=None, database=None)
        @given(FOLDABLE)
        def agree(value: str) -> None:
            assert session.scalar(text("SELECT search_fold(:v)"), {"v": value}) == fold_accents(value)

        for value in fixed:
            assert session.scalar(text("SELECT search_fold(:v)"), {"v": value}) == fold_accents(value), value
        agree()


UNSPACED = [
    ("zh", "Li Lei said he lives in Tokyo now: 李雷住在东京。", "people/李雷"),
    ("ja", "田中さんは大阪の会社で働いています", "people/田中"),
    ("ko", "민수는 서울에 살아요", "people/민수"),
    ("zh2", "王芳在北京工作", "people/王芳"),
    ("zh3", "韩梅梅买了苹果手机 (iPhone)", "people/韩梅梅"),
    ("zh4", "这块屏幕是3.5寸的", "people/屏幕"),
    ("ko2", unicodedata.normalize("NFD", "영희는 부산에 살아요"), "people/영희"),  # decomposed Hangul
]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("lex: 东京", {"Li Lei said he lives in Tokyo now: 李雷住在东京。"}),
        ("东京", {"Li Lei said he lives in Tokyo now: 李雷住在东京。"}),  # a plain query
        ("lex: 李雷", {"Li Lei said he lives in Tokyo now: 李雷住在东京。"}),
        ("lex: 大阪", {"田中さんは大阪の会社で働いています"}),
        ("lex: 서울", {"민수는 서울에 살아요"}),  # the particle 에 attached
        ("lex: 北京 -王芳", set()),
        ("lex: 京东", set()),  # the same characters in another order are another word
        # A word mixing scripts and punctuation: its pieces, in any order (one phrase of all of it found
        # nothing); punctuation alone is nothing (「」 became required words).
        ("lex: iPhone,苹果", {"韩梅梅买了苹果手机 (iPhone)"}),
        ("lex: 「大阪」", {"田中さんは大阪の会社で働いています"}),
        ("lex: 3.5寸", {"这块屏幕是3.5寸的"}),  # a decimal is one token to Postgres: kept whole
        # A question typed without spaces: the facts holding most of its pairs of characters.
        ("李雷住在哪里", {"Li Lei said he lives in Tokyo now: 李雷住在东京。"}),
        # Decomposed Hangul (as macOS writes file names) meets composed, either way round.
        ("lex: 부산", {unicodedata.normalize("NFD", "영희는 부산에 살아요")}),
        ("lex: " + unicodedata.normalize("NFD", "서울"), {"민수는 서울에 살아요"}),
    ],
)
def test_a_word_of_chinese_japanese_or_korean_is_found_inside_its_sentence(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, query: str, expected: set[str]
) -> None:
    """Postgres reads a run of ideographs, kana or Hangul as one word: 李雷住在东京 was one lexeme, and
    "东京" found nothing (migration 0049's search_words spaces each character; a query word holding one
    is searched by the overlapping pairs of its characters)."""
    rows = [_row("default", page, 0, fact, "fact", entity, "", None) for page, fact, entity in UNSPACED]
    with plain_factory.begin() as session:
        session.execute(insert(Fact), rows)
    assert set(facts_of(search(plain_factory, llm, query))) == expected


def test_python_and_sql_space_the_same_scripts(plain_factory: sessionmaker[Session]) -> None:
    """The query's phrase rule (Python) and the index's spacing (SQL search_words) name the same
    characters: the first and last of each range, and those just outside it."""
    from worker.core.folding import UNSPACED_SCRIPT_RANGES, has_unspaced_script

    SPACED_CHAR = re.compile("([" + "".join(f"{low}-{high}" for low, high in UNSPACED_SCRIPT_RANGES) + "])")

    with plain_factory() as session:
        for low, high in UNSPACED_SCRIPT_RANGES:
            for char in (chr(ord(low) - 1), low, high, chr(ord(high) + 1)):
                spaced = session.scalar(text("SELECT search_words(:v)"), {"v": f"a{char}b"}) != f"a{char}b"
                assert spaced == has_unspaced_script(char), hex(ord(char))

        # search_words writes search_fold's expression out (inlined, it costs no second call): the same
        # folding, and a space around each CJK character besides.
        @settings(max_examples=200, deadline=None, database=None)
        @given(FOLDABLE)
        # A compatibility-supplement ideograph folds into the unified block: spaced once folded (asked of
        # the raw text, this rule failed when hypothesis drew one).
        @example("\U0002f81a")
        def folds_as_search_fold(value: str) -> None:
            words, folded = session.execute(
                text("SELECT search_words(:v), search_fold(:v)"), {"v": value}
            ).one()
            # Each such character of the folded text, and nothing else, gets a space either side (an
            # expectation built from the folded text alone: a character the SQL missed stays unspaced).
            assert words == SPACED_CHAR.sub(r" \1 ", folded)

        folds_as_search_fold()


def test_a_time_naming_no_zone_is_utc_whatever_the_sessions_zone(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """A naive since/as_of went to Postgres as a timestamp without zone and was read in the session's
    TimeZone: on a server 14 hours east of UTC, since=2024-03-15T12:00 meant 2024-03-14T22:00Z."""
    morning, evening = datetime(2024, 3, 15, 10, tzinfo=UTC), datetime(2024, 3, 15, 20, tzinfo=UTC)
    rows = [
        _row("default", "tz-chat", 0, "Ines booked the ferry in the morning", "event", "ines", "", morning),
        _row("default", "tz-chat", 1, "Ines took the ferry home at night", "event", "ines", "", evening),
    ]
    with plain_factory.begin() as session:
        session.execute(insert(Fact), rows)
        # The test's one connection, in the outer transaction that rolls the setting back too.
        session.execute(text("SET TimeZone = 'Pacific/Kiritimati'"))
    with plain_factory() as session:
        assert session.scalar(text("SELECT current_setting('TimeZone')")) == "Pacific/Kiritimati"
    noon = datetime(2024, 3, 15, 12)  # naive: UTC noon, between the two
    since = search(plain_factory, llm, "lex: ferry", filters=SearchFilters(since=noon))
    assert facts_of(since) == ["Ines took the ferry home at night"]
    then = search(plain_factory, llm, "lex: ferry", filters=SearchFilters(as_of=noon))
    assert facts_of(then) == ["Ines booked the ferry in the morning"]


def test_lexical_top_5_are_the_entitys_facts(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    seed(plain_factory)
    outcome = search(plain_factory, llm, "lex: alice", limit=5)
    alice = {fact for page, fact, _, _ in CORPUS if page == "alice-chat"}
    assert set(facts_of(outcome)) == alice


def test_lexical_prefix_phrase_and_exclusion(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    seed(plain_factory)
    # Prefix: "perform" finds both performance facts.
    found = facts_of(search(plain_factory, llm, "lex: perform"))
    assert sum("performance" in f for f in found) == 2
    # Exclusion removes one of them.
    found = facts_of(search(plain_factory, llm, "lex: performance -review"))
    assert found == ["Web page load performance regressed to three seconds after the redesign"]
    # A phrase keeps its word order: "milk oat" is not "oat milk".
    assert search(plain_factory, llm, 'lex: "milk oat"').results == ()


def test_a_possessive_and_stop_words_beside_a_phrase_find_the_person(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    # "priya's" was priya AND s (only possessives matched), and `where is "Priya"` required "where"
    # and "is": the rarest-first fallback kept those words and dropped Priya.
    with plain_factory.begin() as session:
        session.execute(
            insert(Fact),
            [
                _row("default", "p1", 0, "Priya moved to Lisbon in May", "event", "priya", "c", None),
                _row("default", "p2", 0, "Priya's passport expires in June", "fact", "priya", "c", None),
                _row("default", "p3", 0, "Where the team meets is the cafe", "fact", "team", "c", None),
            ],
        )
    assert facts_of(search(plain_factory, llm, "lex: priya's move"))[0] == "Priya moved to Lisbon in May"
    assert "Where the team meets is the cafe" not in facts_of(
        search(plain_factory, llm, 'lex: where is "Priya"')
    )


def test_lexical_exact_words_fill_the_list_before_prefixes(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    def write(facts: list[str]) -> None:
        rows = [
            _row("default", "standup", i, fact, "event", "team", "notes", None)
            for i, fact in enumerate(facts)
        ]
        with plain_factory.begin() as session:
            session.execute(insert(Fact), rows)

    # Longer words only prefix-match ("meet" finds "meetings"); these short facts would rank first.
    longer = [f"Meetings {i}" for i in range(5)]
    write(longer + [f"Grace will meet the auditors about invoice batch {i}" for i in range(3)])
    # Too few exact matches to fill the list (10 results, 30 candidates): the search widens to prefixes.
    found = facts_of(search(plain_factory, llm, "lex: meet", limit=10))
    assert len(found) == 8 and set(longer) <= set(found)

    # Enough exact matches to fill the candidate list: the prefix-only facts are never ranked.
    with plain_factory.begin() as session:
        session.execute(text("DELETE FROM facts"))
    write(longer + [f"Grace will meet the auditors about invoice batch {i}" for i in range(MIN_CANDIDATES)])
    found = facts_of(search(plain_factory, llm, "lex: meet", limit=10))
    assert len(found) == 10 and not set(longer) & set(found)
    # "meetings" itself still finds them.
    assert set(facts_of(search(plain_factory, llm, "lex: meetings", limit=10))) == set(longer)


def test_a_line_past_its_unit_cap_is_no_complete_answer(plain_factory: sessionmaker[Session]) -> None:
    """The words past MAX_LEX_UNITS are never searched: a fact holding the first 32 made a "complete"
    answer (a strong signal, and a plain query skipped its expansion) though the rest went unread."""
    from worker.core.lexing import MAX_LEX_UNITS
    from worker.search.lexical import lexical_search

    words = [f"word{chr(97 + i // 26)}{chr(97 + i % 26)}" for i in range(MAX_LEX_UNITS + 1)]
    with plain_factory.begin() as session:
        session.execute(
            insert(Fact), [_row("default", "notes", 0, " ".join(words), "fact", "team", "", None)]
        )
    with plain_factory() as session:
        hits, complete = lexical_search(session, " ".join(words[:MAX_LEX_UNITS]), SearchFilters(), 10)
        assert hits and complete
        hits, complete = lexical_search(session, " ".join(words), SearchFilters(), 10)
        assert hits and not complete


def test_a_number_written_alone_is_searched_for(plain_factory: sessionmaker[Session]) -> None:
    """ "room 7" searched for "room" alone (one-character words were dropped): room 3 came back first,
    and as a complete answer, strong enough to skip a plain query's expansion."""
    from worker.search.lexical import lexical_search

    facts = ["Alice booked room 3 for the review", "Bob booked room 7 for the offsite"]
    with plain_factory.begin() as session:
        session.execute(
            insert(Fact),
            [_row("default", "rooms", i, fact, "event", "team", "", None) for i, fact in enumerate(facts)],
        )
    with plain_factory() as session:
        hits, complete = lexical_search(session, "room 7", SearchFilters(), 10)
        assert complete and [session.get(Fact, hit.fact_id).fact for hit in hits] == [facts[1]]  # type: ignore[union-attr]


def test_a_longer_list_keeps_the_exact_words_ahead_of_longer_ones(
    plain_factory: sessionmaker[Session],
) -> None:
    """Exact matches between the two lists' candidate counts: at limit 10 they filled the list, at 20
    the prefix ranking replaced them, and its length term put the short "Meetings N" first: the top ten
    of the longer list shared nothing with the shorter one."""
    from worker.search.lexical import lexical_search

    exact = [f"Grace will meet the auditors about invoice batch {i}" for i in range(40)]
    rows = [
        _row("default", "standup", i, fact, "event", "team", "notes", None)
        for i, fact in enumerate([*exact, *(f"Meetings {i}" for i in range(40))])
    ]
    with plain_factory.begin() as session:
        session.execute(insert(Fact), rows)
    with plain_factory() as session:
        ten, _ = lexical_search(session, "meet", SearchFilters(), 30)  # a limit of 10's candidates
        sixty, _ = lexical_search(session, "meet", SearchFilters(), 60)  # a limit of 20's
        texts = dict(session.execute(select(Fact.id, Fact.fact)).all())
    assert len(ten) == 30 and all(texts[hit.fact_id] in exact for hit in ten)  # (an empty list held it)
    assert [hit.fact_id for hit in sixty[:40]] == [
        hit.fact_id for hit in sixty if texts[hit.fact_id] in exact
    ]
    assert {hit.fact_id for hit in ten} <= {hit.fact_id for hit in sixty[:40]}
    assert len(sixty) == 60 and all(texts[hit.fact_id].startswith("Meetings") for hit in sixty[40:])


def test_lexical_search_runs_without_jit_and_leaves_the_settings_as_it_found_them(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    # The search turns sequential scans off, which makes a statement that must scan anyway look costly
    # enough to JIT-compile (tens of ms on a small table): JIT goes off with it, both only for the search.
    seed(plain_factory)
    connection = plain_factory.kw["bind"]
    connection.exec_driver_sql("SET LOCAL jit = on")
    connection.exec_driver_sql("SET LOCAL statement_timeout = '1min'")
    during: list[tuple[str, str, str]] = []
    settings = (
        "SELECT current_setting('jit'), current_setting('enable_seqscan'), "
        "current_setting('statement_timeout')"
    )

    def settings_after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "search_vector @@" in statement:
            during.append(tuple(cursor.connection.execute(settings).fetchone()))

    event.listen(connection, "after_cursor_execute", settings_after)
    try:
        assert facts_of(search(plain_factory, llm, "lex: alice lisbon"))
    finally:
        event.remove(connection, "after_cursor_execute", settings_after)
    # Each statement is cut at the search's own time limit too.
    assert during and set(during) == {("off", "off", "5s")}
    assert tuple(connection.exec_driver_sql(settings).one()) == ("on", "on", "1min")


def test_a_lexical_search_past_its_time_limit_is_refused_with_a_reason(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No statement_timeout: a query that scores the whole table many times over held a connection and
    a core for as long as it took (a reader may send 60 a minute)."""
    from worker.search import lexical as search_store

    seed(plain_factory)
    monkeypatch.setattr(search_store, "LEX_STATEMENT_TIMEOUT", "50ms")
    # A ranked query slower than the limit (Postgres's own sleep stands for a scan of a big table).
    monkeypatch.setattr(
        search_store, "_ranked_matches", lambda session, *_: session.execute(text("SELECT pg_sleep(2)"))
    )
    with pytest.raises(SearchError, match="ran past its 50ms limit; search for fewer or rarer words"):
        search(plain_factory, llm, "lex: alice lisbon")


def test_a_search_s_lines_all_end_within_its_deadline(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each statement had its own 5 s: a document of 20 broad lex: lines ran ~10 statements each and
    held a connection and a thread for minutes. The whole search now ends by SEARCH_SECONDS: a line
    started after it is refused, and a statement running into it is cut there."""
    from worker.search import lexical as search_lexical
    from worker.search import values

    seed(plain_factory)
    monkeypatch.setattr(values, "SEARCH_SECONDS", 0.3)
    ran: list[str] = []
    ranked = search_lexical._ranked_matches

    def slow_ranked(session, *args):  # type: ignore[no-untyped-def]
        ran.append("line")
        session.execute(text("SELECT pg_sleep(0.2)"))  # a broad line: 0.2 s of ranking
        return ranked(session, *args)

    monkeypatch.setattr(search_lexical, "_ranked_matches", slow_ranked)
    document = "\n".join(f"lex: alice word{i}" for i in range(5))
    with pytest.raises(SearchError, match=r"ran past its 0\.3 s limit"):
        search(plain_factory, llm, document)
    assert len(ran) < 5, "the lines after the deadline are not run"


def test_a_plain_query_whose_added_lines_run_out_of_time_answers_from_its_probe(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The added lines are a bonus: past the read's time (a slow vector scan here, cut by the
    statement timeout the deadline set), the probe's answer stands, with a note."""
    from worker.search import store as search_store
    from worker.search import values

    seed(vector_factory)
    embed_facts(vector_factory, llm)
    monkeypatch.setattr(values, "SEARCH_SECONDS", 2.0)  # the probe's read finishes well within it
    nearest = search_store._nearest

    def slow_nearest(session, *args):  # type: ignore[no-untyped-def]
        hits = nearest(session, *args)  # sets the statement timeout to the time left
        session.execute(text("SELECT pg_sleep(30)"))  # a scan of a big store: cut at the time left
        return hits

    monkeypatch.setattr(search_store, "_nearest", slow_nearest)
    outcome = search(vector_factory, llm, "where does alice live")
    assert "the lines added to the query were skipped: the search ran out of time" in outcome.notes
    assert "Alice moved to Lisbon in March 2024" in facts_of(outcome)


def test_a_plain_query_whose_expansion_line_is_too_slow_answers_from_its_probe(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expansion's lex: line past the statement limit (a common word on a large table), with time
    left before the search's deadline, was a 400 telling the user to search for rarer words: their own
    results were thrown away for a line the model wrote. The probe's answer stands, with a note."""
    from worker.search import lexical as search_lexical

    seed(plain_factory)
    monkeypatch.setattr(search_lexical, "LEX_STATEMENT_TIMEOUT", "50ms")
    ranked = search_lexical._ranked_matches
    lines: list[str] = []

    def slow_after_the_probe(session, *args):  # type: ignore[no-untyped-def]
        lines.append("line")
        if len(lines) > 1:  # the lines the expansion added
            session.execute(text("SELECT pg_sleep(2)"))
        return ranked(session, *args)

    monkeypatch.setattr(search_lexical, "_ranked_matches", slow_after_the_probe)
    outcome = search(plain_factory, llm, "alice lisbon", intent="where she lives")
    assert outcome.expanded and len(lines) > 1
    assert any(
        note.startswith("the lines added to the query were skipped: the lexical search ran past")
        for note in outcome.notes
    ), outcome.notes
    assert "Alice moved to Lisbon in March 2024" in facts_of(outcome)


def test_a_fact_superseded_while_the_search_ran_is_not_a_current_result(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The results were read again by id alone: a fact superseded after the lists were built (while the
    search waited on the LLM) came back, marked superseded, in a search of current facts."""
    from worker.search.store import SearchStore

    ids = seed(plain_factory)
    lisbon = ids["Alice moved to Lisbon in March 2024"]
    read = SearchStore.result_rows

    def superseded_meanwhile(self: SearchStore, *args: Any) -> Any:
        with plain_factory.begin() as session:
            session.execute(
                text("UPDATE facts SET status = 'superseded', valid_to = now() WHERE id = :id"),
                {"id": lisbon},
            )
        return read(self, *args)

    monkeypatch.setattr(SearchStore, "result_rows", superseded_meanwhile)
    assert "Alice moved to Lisbon in March 2024" not in facts_of(
        search(plain_factory, llm, "lex: alice lisbon")
    )
    history = search(plain_factory, llm, "lex: alice lisbon", filters=SearchFilters(include_history=True))
    assert [r.status for r in history.results if r.fact_id == lisbon] == ["superseded"]


def test_a_word_only_another_source_holds_is_dropped_and_the_rest_still_match_together(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """ "frank" is only in source work's facts: under a filter to source default the search dropped it,
    then never tried the two words left together, and answered every fact holding the rarer one."""
    seed(plain_factory)
    outcome = search(plain_factory, llm, "lex: bob prefers frank", filters=SearchFilters(source_id="default"))
    assert facts_of(outcome) == ["Bob prefers aisle seats on long flights"]


def test_on_a_small_table_every_words_count_is_exact(plain_factory: sessionmaker[Session]) -> None:
    """Counts stopped at 1,000 on every table: on a small one (the usual single-user store) a word in
    3,000 facts weighed as one in 1,000, and words past 1,000 tied, ranked by their place in the line."""
    from worker.core.lexing import lex_items, lex_units
    from worker.search.lexical import _document_frequencies, _parse_items

    rows = [_row("default", "common", i, f"alpha note {i}", "fact", "", "notes", None) for i in range(1_500)]
    rows += [_row("default", "rare", i, f"beta note {i}", "fact", "", "notes", None) for i in range(20)]
    with plain_factory.begin() as session:
        session.execute(insert(Fact), rows)
    with plain_factory() as session:
        items = lex_items(parse_lex_query("alpha beta"))
        units, _ = lex_units(items, _parse_items(session, items))
        dfs, total = _document_frequencies(session, units)
    assert dfs == [1_500.0, 20.0] and total == 1_520.0


def test_a_readers_scores_count_only_the_sources_it_reads(plain_factory: sessionmaker[Session], llm) -> None:
    """Word counts were table-wide: a key limited to one source read from its results' scores how many
    of another source's facts held a word (exactly, up to a thousand), and when one more did."""
    seed(plain_factory)
    scoped = SearchFilters(source_ids=("work",))

    def score() -> float:
        [result] = search(plain_factory, llm, "lex: lisbon office", filters=scoped).results
        return float(result.lex_score or 0)

    before = score()
    rows = [
        _row("default", "more", i, f"Lisbon office note {i}", "fact", "", "notes", None) for i in range(40)
    ]
    with plain_factory.begin() as session:
        session.execute(insert(Fact), rows)
    assert score() == before
    everything = search(plain_factory, llm, "lex: lisbon office").results
    assert len(everything) > 1  # the other source's facts are there for a reader of every source


def test_a_line_of_many_words_drops_the_absent_ones_at_once_and_halves_the_rest(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """The fallback dropped one word a pass, two ranked queries each: one lex: line of 150 words no
    fact holds was some 300 statements (a 2,000-character line, 500). Words no fact holds now go at
    once, and the most words that still match are found by halving; the answer is the same."""
    seed(plain_factory)
    connection = plain_factory.kw["bind"]
    ranked: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "search_vector @@" in statement and "ORDER BY raw DESC" in statement:
            ranked.append(statement)

    absent = " ".join(f"zq{i:03d}x" for i in range(150))
    event.listen(connection, "after_cursor_execute", count)
    try:
        apart = search(plain_factory, llm, f"lex: greyhound marathon peanuts {absent}")
        ranked_apart = len(ranked)
        ranked.clear()
        nothing = search(plain_factory, llm, f"lex: {absent}")
        ranked_nothing = len(ranked)
        ranked.clear()
        together = search(plain_factory, llm, f"lex: bob greyhound {absent}")
    finally:
        event.remove(connection, "after_cursor_execute", count)
    # Three words no fact holds together: the rarest-first prefix that matches is one word.
    assert facts_of(apart)[:1] == ["Bob adopted a greyhound named Pixel"] and ranked_apart <= 8
    assert nothing.results == () and ranked_nothing == 0
    assert facts_of(together) == ["Bob adopted a greyhound named Pixel"] and len(ranked) <= 2


def test_searches_keep_the_statements_psycopg_prepared(plain_database_url: str) -> None:
    # A search's reads end in a commit or in autocommit, never a ROLLBACK, which would make psycopg
    # forget every statement it prepared on the connection (it prepares one on its sixth run).
    engine = db.create_pooled_engine(plain_database_url, settings=Settings(db_pool_size=1, db_max_overflow=0))
    try:
        factory = sessionmaker(engine)
        for _ in range(8):
            search(factory, None, "lex: alice lisbon")
        with factory() as session:
            prepared = session.scalar(text("SELECT count(*) FROM pg_prepared_statements"))
        assert prepared and prepared > 0
    finally:
        engine.dispose()


def test_lexical_scores_are_normalised_and_ordered(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    seed(plain_factory)
    outcome = search(plain_factory, llm, "lex: team")
    scores = [r.lex_score for r in outcome.results]
    assert all(s is not None and 0 < s < 1 for s in scores)
    assert scores == sorted(scores, reverse=True)  # type: ignore[type-var]
    assert normalise_score(-3.0) == normalise_score(3.0) == 0.75
    assert normalise_score(0.0) == 0.0


def test_parse_lex_query() -> None:
    parsed = parse_lex_query('where does "oat milk" -coffee alice live')
    assert parsed.terms == ("alice", "live")  # stop words drop out of plain words
    assert parsed.phrases == ("oat milk",)
    assert parsed.excluded == ("coffee",)
    assert parse_lex_query("where is it").terms == ("where", "is", "it")  # nothing but stop words


# --------------------------------------------------------------------------- strong signal and expansion


def test_strong_signal_skips_expansion(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    seed(plain_factory)
    before = chat_calls(simulator)
    outcome = search(plain_factory, llm, "greyhound pixel")
    assert outcome.strong_signal is True
    assert outcome.expanded is False
    assert chat_calls(simulator) == before  # no LLM call at all
    assert outcome.results[0].fact == "Bob adopted a greyhound named Pixel"
    assert outcome.results[0].lex_score >= 0.85  # type: ignore[operator]


def test_a_word_found_only_as_the_start_of_longer_words_is_no_strong_signal(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    # The prefix pass scores as the exact one: "greyh" found only in "greyhound" was a clear top hit
    # and skipped the expansion, for a word no fact holds.
    seed(plain_factory)
    before = chat_calls(simulator)
    outcome = search(plain_factory, llm, "greyh pixel")
    assert outcome.results[0].fact == "Bob adopted a greyhound named Pixel"
    assert outcome.strong_signal is False and chat_calls(simulator) == before + 1


def test_weak_signal_expands_once(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    seed(plain_factory)
    before = chat_calls(simulator)
    outcome = search(plain_factory, llm, "what does alice drink with coffee")
    assert outcome.strong_signal is False
    assert chat_calls(simulator) == before + 1
    assert outcome.expanded is True
    # No pgvector here: the vec/hyde expansions are dropped; the simulator's lex line repeats the
    # query's own words, so the probe's search is not run twice.
    assert [(line.type, line.origin) for line in outcome.lines] == [("lex", "query")]
    assert outcome.vector_search == "unavailable"
    assert "Alice prefers oat milk in her coffee" in facts_of(outcome)[:5]
    # The expansion call is accounted for in llm_calls.
    with plain_factory() as session:
        purposes = session.scalars(text("SELECT purpose FROM llm_calls")).all()
    assert "search_expansion" in purposes


def test_each_try_the_gateway_retried_for_an_expansion_is_a_call_of_its_own(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """Through ``chat`` the retry layer's tries were hidden: one llm_calls row an expansion."""
    from tests.llm_wrappers import FailsFirst
    from worker.llm.retry import RetryingClient, RetryPolicy

    seed(plain_factory)
    retried = RetryingClient(FailsFirst(llm), RetryPolicy(max_attempts=3), sleep=lambda seconds: None)
    assert search(plain_factory, retried, "what does alice drink with coffee").expanded is True
    with plain_factory() as session:
        outcomes = session.scalars(
            text("SELECT outcome FROM llm_calls WHERE purpose = 'search_expansion' ORDER BY id")
        ).all()
    assert outcomes == ["provider_error", "ok"]


def test_a_searchs_llm_calls_end_with_its_deadline(
    plain_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded by the gateway alone (five tries of up to a minute, two minutes of backoff), a slow
    model's expansion ran on for minutes after the client (30 s) had given up and sent the search
    again. Each try is cut to the time left, and no retry starts after it."""
    from worker.llm.retry import RetryingClient, RetryPolicy
    from worker.search import service

    seed(plain_factory)
    monkeypatch.setattr(service, "SEARCH_LLM_SECONDS", 1.0)
    with Simulator(SimulatorConfig(latency_ms=4000)) as slow:
        retried = RetryingClient(sim_client(slow), RetryPolicy(max_attempts=5, backoff_base_seconds=0.01))
        outcome = search(plain_factory, retried, "what does alice drink with coffee")
        assert len(slow.recent_requests()) == 1  # one try, cut at the deadline; none after it
    assert outcome.expanded is False
    assert "query expansion ran out of time (the LLM was slow); searched the query alone" in outcome.notes
    assert "Alice prefers oat milk in her coffee" in facts_of(outcome)[:5]  # the probe's answer stands
    with plain_factory() as session:
        outcomes = session.scalars(
            text("SELECT outcome FROM llm_calls WHERE purpose = 'search_expansion' ORDER BY id")
        ).all()
    assert outcomes == ["provider_error"]  # the try that timed out, recorded


def test_each_try_the_gateway_retried_for_an_embedding_is_a_call_named_by_its_model(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    """Through ``embed`` the retry layer's tries were hidden (one row a call, the 429 before it not
    counted), and a failed embedding call was named by the chat model."""
    from worker.llm.retry import RetryingClient, RetryPolicy

    seed(vector_factory)
    simulator.configure(raw_replies={"embeddings": {"error": {"message": "slow down"}}}, raw_status=429)
    try:
        retried = RetryingClient(
            llm, RetryPolicy(max_attempts=3), sleep=lambda seconds: simulator.configure(raw_replies={})
        )
        assert embed_facts(vector_factory, retried).embedded > 0
    finally:
        simulator.configure(raw_replies={}, raw_status=200)
    with vector_factory() as session:
        rows = session.execute(
            text("SELECT outcome, model FROM llm_calls WHERE purpose = 'embedding' ORDER BY id")
        ).all()
    assert rows[0] == ("provider_error", llm.embedding_model)  # the 429 the gateway retried
    assert {tuple(row) for row in rows[1:]} == {("ok", llm.embedding_model)}  # a call a batch of facts


def test_a_failed_fact_embedding_keeps_the_error_s_status_not_the_provider_s_words(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    """A gateway's 400 may quote its input, the facts' text; the call is under no job an erasure of their
    page could find it by, so its row keeps the status and code, never the words (a chat call's do)."""
    seed(vector_factory)
    quoted = {"error": {"message": "cannot embed: Bob adopted a greyhound named Pixel", "code": "bad_input"}}
    simulator.configure(raw_replies={"embeddings": quoted}, raw_status=400)
    try:
        with pytest.raises(LLMError, match="HTTP 400"):
            embed_facts(vector_factory, llm)
    finally:
        simulator.configure(raw_replies={}, raw_status=200)
    with vector_factory() as session:
        errors = session.scalars(
            text("SELECT error FROM llm_calls WHERE purpose = 'embedding' AND outcome <> 'ok'")
        ).all()
    assert errors == ["HTTP 400 (bad_input)"], errors


def test_an_intent_always_expands(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    seed(plain_factory)
    before = chat_calls(simulator)
    outcome = search(plain_factory, llm, "greyhound pixel", intent="pets and animals")
    assert outcome.strong_signal is False
    assert chat_calls(simulator) == before + 1
    assert outcome.results[0].fact == "Bob adopted a greyhound named Pixel"


def test_expansion_off_and_no_llm(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    seed(plain_factory)
    before = chat_calls(simulator)
    assert search(plain_factory, llm, "team lunch", expand=False).expanded is False
    assert search(plain_factory, None, "team lunch").expanded is False
    assert chat_calls(simulator) == before


def test_parse_expansion_keeps_typed_lines_only() -> None:
    reply = (
        "Here you go:\nlex: oat milk\n- vec: what alice drinks\nhyde: Alice drinks oat milk.\nlex: oat milk\n"
    )
    reply += "LEX: coffee\nlex: tea\nlex: third lex line\nbanana: no"
    assert parse_expansion(reply, "alice drink") == [
        ("lex", "oat milk"),
        ("vec", "what alice drinks"),
        ("hyde", "Alice drinks oat milk."),
        ("lex", "coffee"),
    ]


def test_user_lines_outweigh_expansions(plain_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    seed(plain_factory)
    outcome = search(plain_factory, llm, "what does alice drink with coffee", intent="oat milk")
    lines = {(line.type, line.query, line.origin, line.weight) for line in outcome.lines}
    assert lines == {
        ("lex", "what does alice drink with coffee", "query", 2.0),
        ("lex", "alice drink coffee oat milk", "expansion", 1.0),  # the simulator adds the intent's words
    }
    # The query's own words match nothing together; the expansion finds the answer.
    assert outcome.results[0].fact == "Alice prefers oat milk in her coffee"
    assert outcome.results[0].matched_by == ("lex:1", "lex:2")


# --------------------------------------------------------------------------- intent and snippets


@pytest.mark.parametrize(
    ("query", "intent"),
    [
        ('lex: "performance review"\nintent: web page load times', None),
        ('"performance review"', "web page load times"),
    ],
    ids=["lex line", "plain query"],
)
def test_a_quoted_phrase_steers_the_snippet_by_its_words(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, query: str, intent: str | None
) -> None:
    """Split on spaces as written, '"performance' and 'review"' matched no line (their quote marks):
    the intent alone chose the snippet, the line the user had not asked for; in a lex: line, and in a
    plain query (the default), which still did after the lex: line's fix."""
    seed(plain_factory)
    review = "The performance review cycle starts in June"
    outcome = search(plain_factory, llm, query, intent=intent, expand=False)
    result = next(r for r in outcome.results if r.fact == review)
    shown = result.snippet.splitlines()[1 + (result.snippet_line - 1 - _start(result.snippet))]
    assert "review cycle" in shown, result.snippet


def test_a_snippets_lines_count_from_the_start_of_its_segment(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """qmd's rule: line numbers count from the start of the body (here the segment's facts). They
    counted from the window of neighbours read around each result, so one fact had two numbers in two
    results of one segment, and the header said "2 before" of a fact with nine before it."""
    context = "conversation segment 2024-05-01T09:00:00Z to 2024-05-01T09:30:00Z"
    facts = [f"Item {n} of the long chat is about topic{n}" for n in range(12)]
    with plain_factory.begin() as session:
        session.execute(
            insert(Fact),
            [_row("default", "long", n, fact, "fact", "x", context, None) for n, fact in enumerate(facts)],
        )
    # A superseded fact before them is not a line (the search's lifecycle: current facts).
    with plain_factory.begin() as session:
        session.execute(
            update(Fact)
            .where(Fact.row_num == 0, Fact.source_markdown_slug == "long")
            .values(status="superseded")
        )
    lines = {}
    for query in ("lex: topic10", "lex: topic11 item"):
        for result in search(plain_factory, llm, query, expand=False).results:
            if result.row_num in (10, 11):
                lines[(query, result.row_num)] = (result.snippet_line, result.snippet.splitlines()[0])
    assert lines[("lex: topic10", 10)] == (10, "@@ -9,3 @@ (8 before, 0 after)")
    assert lines[("lex: topic11 item", 11)] == (11, "@@ -10,2 @@ (9 before, 0 after)")


def test_intent_changes_which_snippet_is_shown(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    seed(plain_factory)
    review = "The performance review cycle starts in June"
    plain = search(plain_factory, llm, "lex: performance")
    result = next(r for r in plain.results if r.fact == review)
    assert (
        "review cycle" in result.snippet.splitlines()[1 + (result.snippet_line - 1 - _start(result.snippet))]
    )
    steered = search(plain_factory, llm, "lex: performance\nintent: web page load times")
    result_with_intent = next(r for r in steered.results if r.fact == review)
    assert steered.intent == "web page load times"
    assert result_with_intent.snippet_line != result.snippet_line
    best = result_with_intent.snippet.splitlines()[
        1 + (result_with_intent.snippet_line - 1 - _start(result_with_intent.snippet))
    ]
    assert "Web page load" in best
    # Provenance stays the result's own.
    assert (result_with_intent.page_slug, result_with_intent.row_num) == ("team-sync", 0)


def _start(snippet: str) -> int:
    header = snippet.splitlines()[0]  # "@@ -<start>,<count> @@ (...)"
    return int(header.split()[1].split(",")[0].lstrip("-")) - 1


def test_results_carry_provenance(plain_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    seed(plain_factory)
    top = search(plain_factory, llm, "lex: greyhound").results[0]
    assert top.page_slug == "bob-chat"
    assert top.source_id == "default"
    assert top.row_num == 0
    assert top.segment == SEGMENT["bob-chat"]
    assert (top.segment_start, top.segment_end) == ("2024-04-02T18:00:00Z", "2024-04-02T18:25:00Z")
    assert top.confidence == 0.9 and top.notability == "high"
    assert top.snippet.startswith("@@ -1,")
    assert top.matched_by == ("lex:1",)
    as_dict = top.as_dict()
    assert as_dict["valid_from"] == "2024-04-02T18:00:00+00:00"


# --------------------------------------------------------------------------- filters and audit rows


def test_filters(plain_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    seed(plain_factory)
    assert set(facts_of(search(plain_factory, llm, "lex: lisbon"))) == {
        "Alice moved to Lisbon in March 2024",
        "Frank opened the Lisbon office",
    }
    only_work = search(plain_factory, llm, "lex: lisbon", filters=SearchFilters(source_id="work"))
    assert facts_of(only_work) == ["Frank opened the Lisbon office"]
    bob = search(plain_factory, llm, "lex: prefers", filters=SearchFilters(entity="bob"))
    assert facts_of(bob) == ["Bob prefers aisle seats on long flights"]
    commitments = search(plain_factory, llm, "lex: the", filters=SearchFilters(kind="commitment"))
    assert {r.kind for r in commitments.results} == {"commitment"} and len(commitments.results) >= 2
    recent = search(
        plain_factory, llm, "lex: in", filters=SearchFilters(since=datetime(2024, 4, 1, tzinfo=UTC))
    )
    assert recent.results and all(r.page_slug in {"bob-chat", "team-sync"} for r in recent.results)
    with pytest.raises(SearchError, match="kind must be one of"):
        SearchFilters(kind="rumour")


def test_audit_rows_never_appear(plain_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    from worker.search.lexical import lexical_search

    seed(plain_factory)
    for query in ("lex: extraction_complete", "lex: greyhound", "EXTRACTION_COMPLETE", "lex: marathon"):
        assert all("EXTRACTION_COMPLETE" not in r.fact for r in search(plain_factory, llm, query).results)
    assert search(plain_factory, llm, "lex: extraction_complete").results == ()
    # Nor in the lexical list itself (the results drop audit rows again: a list that held them passed,
    # its candidates' places and its hits count taken by them).
    with plain_factory() as session:
        audits = set(session.scalars(select(Fact.id).where(Fact.is_audit)))
        hits, _ = lexical_search(session, "greyhound", SearchFilters(), 50)
    assert audits and not audits & {hit.fact_id for hit in hits}


# --------------------------------------------------------------------------- bad documents


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("lex: a\nexpand: b", "Line 2 starts with expand:"),
        ("lex: a\nintent: x\nintent: y", "Line 3: only one intent: line is allowed per query document."),
        ("intent: x", "intent: cannot appear alone. Add at least one lex:, vec:, or hyde: line."),
        ("lex: a\nsomething else", "Line 2 is missing a lex:/vec:/hyde:/intent: prefix."),
        ("lex: a\n\nvec:", "Line 3 (vec:) must include text."),
    ],
)
def test_bad_documents_raise_the_parsers_error(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient, document: str, message: str
) -> None:
    with pytest.raises(QueryParseError) as caught:
        search(plain_factory, llm, document)
    assert message in str(caught.value)


def test_other_bad_requests(plain_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    with pytest.raises(SearchError, match="empty"):
        search(plain_factory, llm, "   ")
    with pytest.raises(SearchError, match="limit"):
        search(plain_factory, llm, "x", limit=0)
    with pytest.raises(SearchError, match="give it once"):
        search(plain_factory, llm, "lex: a\nintent: one", intent="two")


# --------------------------------------------------------------------------- vector search


def test_vec_and_hyde_without_pgvector_give_a_clear_error(
    plain_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    seed(plain_factory)
    for document in ("vec: a dog as a pet", "hyde: Bob has a greyhound.", "lex: greyhound\nvec: dog"):
        with pytest.raises(VectorSearchUnavailableError, match="vector search unavailable"):
            search(plain_factory, llm, document)
    # Lexical search still works on the same database.
    assert (
        search(plain_factory, llm, "lex: greyhound").results[0].fact == "Bob adopted a greyhound named Pixel"
    )
    # Embedding still fills facts.embedding (the store arrives with pgvector).
    report = embed_facts(plain_factory, llm, batch_size=16, set_up_vector_store=False)
    assert report.vector_search == "unavailable"
    assert report.embedded == len(CORPUS) + 61


def test_embed_facts_fills_the_vector_store(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    ids = seed(vector_factory)
    report = embed_facts(vector_factory, llm, batch_size=25)
    assert report.vector_search == "available"
    assert report.embedded == len(ids) and report.batches == 4
    with vector_factory() as session:
        assert vector_search_status(session).available
        stored = session.scalar(text("SELECT count(*) FROM search.fact_embeddings"))
        audit_embedded = session.scalar(
            text("SELECT count(*) FROM facts WHERE is_audit AND embedding IS NOT NULL")
        )
    assert stored == len(ids) and audit_embedded == 0
    assert embed_facts(vector_factory, llm).embedded == 0  # nothing left to do


def test_new_facts_hook_embeds_one_page(vector_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    seed(vector_factory)
    assert embed_new_facts(vector_factory, llm, "default", "bob-chat") == 4
    with vector_factory() as session:
        assert session.scalar(text("SELECT count(*) FROM search.fact_embeddings")) == 4
    # A failing gateway is logged, not raised: the facts are already stored.
    broken = OpenAIChatClient(model="m", base_url="http://127.0.0.1:9/v1", timeout=1)
    assert embed_new_facts(vector_factory, broken, "default", "alice-chat") == 0


def test_a_provider_without_embeddings_or_settings_leaves_plain_search_lexical(
    vector_factory: sessionmaker[Session], simulator: Any
) -> None:
    # Anthropic alone (no embeddings API) wrote a provider_error row on every plain search; incomplete
    # LLM settings (FACTMILL_LLM=anthropic without its key) made every plain query a 500.
    from worker.core.errors import LLMConfigurationError
    from worker.llm.anthropic_provider import AnthropicChatClient
    from worker.search.errors import UNCONFIGURED

    seed(vector_factory)
    embed_facts(vector_factory, sim_client(simulator))
    anthropic = AnthropicChatClient(
        model="simulator-1", base_url=simulator.anthropic_base_url, provider="simulator"
    )

    def unconfigured() -> Any:
        raise LLMConfigurationError("set ANTHROPIC_API_KEY")

    with vector_factory() as session:
        before = session.scalar(select(func.count()).select_from(LLMCall))
    for source in (anthropic, unconfigured):
        outcome = search(vector_factory, source, "where does alice live")
        assert outcome.results and outcome.results[0].fact.startswith("Alice"), source
        assert any("skipped" in note for note in outcome.notes), outcome.notes
        # Refused as unavailable (the API's 501), not failed (a 503 to retry, for good).
        with pytest.raises(VectorSearchUnavailableError) as refused:
            search(vector_factory, source, "vec: where does alice live")
        assert "unavailable" in str(refused.value) or str(refused.value) == UNCONFIGURED
    with vector_factory() as session:
        failures = session.scalar(select(func.count()).select_from(LLMCall).where(LLMCall.outcome != "ok"))
        after = session.scalar(select(func.count()).select_from(LLMCall))
    assert failures == 0 and after - before == 1, "one expansion call (Anthropic's chat), no failure rows"


class DuringTheFirstEmbedding:
    """The simulator's client, whose first embedding call runs ``meanwhile(answer)`` before it returns
    (what another process does while it is under way); each call's texts are kept in ``sent``."""

    def __init__(self, inner: Any, meanwhile: Any) -> None:
        self.inner, self.meanwhile = inner, meanwhile
        self.provider, self.model = inner.provider, inner.model
        self.sent: list[list[str]] = []

    def chat(self, request: Any) -> Any:
        return self.inner.chat(request)

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> Any:
        answer = self.inner.embed(texts, purpose=purpose)
        if not self.sent:
            self.meanwhile(answer)
        self.sent.append(list(texts))
        return answer


def test_facts_erased_under_their_embedding_go_to_no_provider(
    vector_factory: sessionmaker[Session], simulator: Any
) -> None:
    """A large page's backlog is read once and sent batch after batch: its page erased meanwhile, the
    rest of its facts' text still went to the embedding provider after the erasure returned."""
    seed(vector_factory)  # eve-diary-0 holds ten facts

    def erased(_: Any) -> None:
        with vector_factory.begin() as session:  # the page's erasure, as far as its facts go
            session.execute(text("DELETE FROM facts WHERE source_markdown_slug = 'eve-diary-0'"))

    llm = DuringTheFirstEmbedding(sim_client(simulator), erased)
    assert embed_pages_facts(vector_factory, llm, [("default", "eve-diary-0")], 2) == 0
    assert len(llm.sent) == 1, llm.sent  # the first call was under way; no batch after it


def test_facts_another_embedder_filled_meanwhile_are_not_paid_for_again(
    vector_factory: sessionmaker[Session], simulator: Any
) -> None:
    """Two embedders on one page (the sweep's hand-off beside a slow follow-up in another process):
    each batch was checked only for facts still there, and a batch the other had filled was paid for
    again, its vectors dropped."""
    seed(vector_factory)  # eve-diary-0 holds ten facts

    def filled_by_another(answer: Any) -> None:
        with vector_factory.begin() as session:  # the other embedder stores all but the first two
            ids = session.scalars(
                select(Fact.id)
                .where(Fact.source_markdown_slug == "eve-diary-0", ~Fact.is_audit)
                .order_by(Fact.id)
            ).all()
            vector = list(answer.vectors[0])
            session.execute(
                update(Fact).where(Fact.id.in_(ids[2:])).values(embedding=vector, embedding_model="other")
            )

    llm = DuringTheFirstEmbedding(sim_client(simulator), filled_by_another)
    assert embed_pages_facts(vector_factory, llm, [("default", "eve-diary-0")], 2) == 2
    assert len(llm.sent) == 1, llm.sent  # the rest were filled meanwhile: no call for them


def test_a_page_whose_facts_fill_several_calls_embeds_them_several_at_a_time(
    vector_factory: sessionmaker[Session],
) -> None:
    seed(vector_factory)  # eve-diary-0 and eve-diary-1 hold ten facts each
    slow = SimulatorConfig(latency_ms=300)  # calls long enough to overlap when sent together
    with Simulator(slow) as one_at_a_time, Simulator(slow) as together:
        assert (
            embed_pages_facts(vector_factory, sim_client(one_at_a_time), [("default", "eve-diary-0")], 2)
            == 10
        )
        assert one_at_a_time.stats()["max_in_flight"] == 1
        assert (
            embed_pages_facts(
                vector_factory, sim_client(together), [("default", "eve-diary-1")], 2, concurrency=3
            )
            == 10
        )
        assert together.stats()["max_in_flight"] == 3  # five calls, three at a time
        assert together.stats()["requests_total"] == 5
    with vector_factory() as session:
        stored = session.scalar(
            text(
                "SELECT count(*) FROM search.fact_embeddings e JOIN facts f ON f.id = e.fact_id "
                "WHERE f.source_markdown_slug IN ('eve-diary-0', 'eve-diary-1')"
            )
        )
    assert stored == 20


def test_a_failed_batch_stops_the_batches_not_yet_started(vector_factory: sessionmaker[Session]) -> None:
    """...and what the batches log carries the caller's log fields (the job's id): the pool's tasks ran
    in a copy of their own thread's empty context."""
    import logging

    from worker.runtime.logs import ContextFilter, log_context

    seed(vector_factory)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    handler.addFilter(ContextFilter())
    service_log = logging.getLogger("worker.search.embedding")
    service_log.addHandler(handler)
    try:
        with Simulator(SimulatorConfig(latency_ms=100)) as sim, log_context(job_id=77):
            sim.configure(rate_500=1.0)  # every call fails (no retrying client here)
            pages = [("default", "eve-diary-2")]
            assert embed_pages_facts(vector_factory, sim_client(sim), pages, 1, concurrency=2) == 0
            assert sim.stats()["requests_total"] == 2  # the first two; the other eight never started
    finally:
        service_log.removeHandler(handler)
    failures = [r for r in records if r.getMessage().startswith("could not embed")]
    assert failures and all(getattr(r, "job_id", None) == 77 for r in failures)


@pytest.mark.parametrize(
    ("document", "answer"),
    [
        ("vec: greyhound pet", "Bob adopted a greyhound named Pixel"),
        ("vec: peanuts allergy", "Bob is allergic to peanuts"),
        ("hyde: Alice lives in Lisbon now.", "Alice moved to Lisbon in March 2024"),
        (
            "hyde: Dmitri has booked a cabin in Norway.",
            "Dmitri booked a cabin in Norway for the winter holidays",
        ),
    ],
)
def test_vec_and_hyde_top_1(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient, document: str, answer: str
) -> None:
    seed(vector_factory)
    embed_facts(vector_factory, llm)
    outcome = search(vector_factory, llm, document)
    assert outcome.vector_search == "available"
    assert outcome.results[0].fact == answer
    assert 0 < outcome.results[0].vec_score <= 1  # type: ignore[operator]


def test_plain_query_fuses_lex_vec_and_expansions(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient, simulator: Any
) -> None:
    seed(vector_factory)
    embed_facts(vector_factory, llm)
    before = chat_calls(simulator)
    outcome = search(vector_factory, llm, "where does alice live")
    assert chat_calls(simulator) == before + 1
    kinds = {(line.type, line.origin) for line in outcome.lines}
    assert {("lex", "query"), ("vec", "query"), ("hyde", "expansion")} <= kinds
    assert "Alice moved to Lisbon in March 2024" in facts_of(outcome)[:5]
    top = outcome.results[0]
    assert top.vec_score is not None


def test_a_query_is_compared_only_with_vectors_of_its_own_model(
    vector_factory: sessionmaker[Session], simulator: Any
) -> None:
    # Only the dimension was checked: after a change of embedding model of the same size, queries of
    # the new model were compared with facts of the old one (near-random neighbours at full weight).
    seed(vector_factory)
    old = sim_client(simulator)
    new = OpenAIChatClient(
        model="simulator-1",
        base_url=simulator.base_url,
        provider="simulator",
        embedding_model="other-embed-2",
    )
    embed_facts(vector_factory, old)
    assert [h for h in search(vector_factory, old, "vec: greyhound pixel").results]
    assert search(vector_factory, new, "vec: greyhound pixel").results == ()
    # Vectors made before models were kept are compared with any query, as before.
    with vector_factory.begin() as session:
        session.execute(text("UPDATE facts SET embedding_model = NULL"))
    assert search(vector_factory, new, "vec: greyhound pixel").results
    report = embed_facts(vector_factory, new, every=True)  # `factmill embed --reembed`
    assert report.embedded == len(CORPUS) + 61
    with vector_factory() as session:
        models = set(session.scalars(text("SELECT DISTINCT embedding_model FROM facts WHERE NOT is_audit")))
    assert models == {"simulator/other-embed-2"}  # the provider and the model it answered with
    assert (
        search(vector_factory, new, "vec: greyhound pixel").results[0].fact
        == "Bob adopted a greyhound named Pixel"
    )
    assert search(vector_factory, old, "vec: greyhound pixel").results == ()
    # Run again (as after a stop part way), it starts over but skips what the model already made: one
    # batch, not every fact paid for again.
    assert embed_facts(vector_factory, new, batch_size=10, every=True).embedded == 10


def test_vector_filters_and_audit(vector_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    from worker.search.store import _vector_search

    seed(vector_factory)
    with vector_factory.begin() as session:
        session.execute(text("UPDATE facts SET embedding = NULL"))
    embed_facts(vector_factory, llm)
    with vector_factory.begin() as session:
        # An audit row with a vector in the store (written past the trigger, which keeps them out):
        # the vector list itself never holds it, nor takes a candidate's place with it. Set on the facts
        # row, the trigger dropped it, so the case was never built and the check could not fail.
        session.execute(
            text(
                "INSERT INTO search.fact_embeddings (fact_id, embedding) SELECT id, (SELECT embedding FROM "
                "facts WHERE fact LIKE 'Bob adopted%') FROM facts WHERE is_audit"
            )
        )
        audits = set(
            session.scalars(
                text("SELECT fact_id FROM search.fact_embeddings JOIN facts ON id = fact_id WHERE is_audit")
            )
        )
    assert audits
    vector = llm.embed(["Bob adopted a greyhound named Pixel"]).vectors[0]
    with vector_factory() as session:
        version = vector_search_status(session).extension_version or "0"
        hits = _vector_search(session, vector, SearchFilters(), MIN_CANDIDATES, version)
    assert hits and not audits & {hit.fact_id for hit in hits}
    outcome = search(vector_factory, llm, "vec: greyhound pet alice", filters=SearchFilters(entity="alice"))
    assert outcome.results and all(r.entity == "alice" for r in outcome.results)


def test_vector_lists_walk_enough_of_the_hnsw_graph(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    # hnsw.ef_search bounds recall: pgvector's default (40) kept too few candidates (bench/search.py).
    from worker.search.store import _vector_search

    seed(vector_factory)
    embed_facts(vector_factory, llm)
    vector = llm.embed(["greyhound pet"]).vectors[0]
    with vector_factory() as session:
        version = vector_search_status(session).extension_version or "0"
        assert _vector_search(session, vector, SearchFilters(), MIN_CANDIDATES, version)
        assert session.scalar(text("SELECT current_setting('hnsw.ef_search')")) == str(HNSW_EF_SEARCH)
        _vector_search(session, vector, SearchFilters(), 400, version)  # four per result, at most 1,000
        assert session.scalar(text("SELECT current_setting('hnsw.ef_search')")) == "1000"


@pytest.mark.parametrize("version", ["0.7.4", "0.8.0"])
def test_a_filtered_vector_list_fills_up_on_every_pgvector(
    vector_factory: sessionmaker[Session], version: str
) -> None:
    """Before pgvector 0.8 (the embedded pgserver ships 0.6.2) the index yields its ef_search nearest and
    no more: a source holding a few percent of the facts, all farther than the others, got none."""
    from worker.search.store import _vector_search

    def unit(*weights: float) -> list[float]:
        vector = [*weights, *[0.0] * (256 - len(weights))]
        norm = sum(w * w for w in vector) ** 0.5
        return [w / norm for w in vector]

    near = [_row("crowd", "crowd", i, f"Crowd fact {i}", "fact", "crowd", "", None) for i in range(1200)]
    far = [_row("crowd", "few", i, f"Few fact {i}", "belief", "few", "", None) for i in range(12)]
    for i, row in enumerate(near):
        row["embedding"] = unit(1.0, 0.001 * i)
    for i, row in enumerate(far):
        row["embedding"] = unit(1.0, 0.0, 5.0 + i)
    with vector_factory.begin() as session:
        session.execute(insert(Fact), near + far)
    with vector_factory() as session:
        # The plan a large store gets where the planner takes the filter for a loose one: walk the HNSW
        # index and filter what it yields (here, a thousand rows are sooner read whole and sorted, which
        # is exact: no sort leaves it the index alone).
        session.execute(text("SET LOCAL enable_sort = off"))
        timeout = session.scalar(text("SELECT current_setting('statement_timeout')"))
        # Released, never rolled back: a rollback, even to a savepoint, makes psycopg forget every
        # statement it prepared on the connection.
        rolled_back: list[object] = []

        def heard(*args: object) -> None:
            rolled_back.append(args)

        engine = vector_factory.kw["bind"]
        event.listen(engine, "rollback_savepoint", heard)
        try:
            hits = _vector_search(session, unit(1.0), SearchFilters(kind="belief"), 10, version)
        finally:
            event.remove(engine, "rollback_savepoint", heard)
        assert len(hits) == 10 and rolled_back == [], (hits, rolled_back)
        assert session.scalar(text("SELECT current_setting('enable_indexscan')")) == "on"
        assert session.scalar(text("SELECT current_setting('statement_timeout')")) == timeout


def test_an_exact_vector_read_past_its_time_gives_up_and_leaves_the_search_as_it_was(
    plain_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a large store the exact read scans every vector its filters keep: it has half the search's
    time left (or its own limit), and one that runs out keeps the index's rows; the transaction, and the
    lines after it, go on (a timeout aborted the search's transaction, and every line failed)."""
    from worker.search import store

    monkeypatch.setattr(store, "EXACT_STATEMENT_TIMEOUT_MS", 50)
    with plain_factory() as session:
        assert store._exactly(session, text("SELECT pg_sleep(1)"), {}, None) == []
        assert session.scalar(text("SELECT current_setting('enable_indexscan')")) == "on"
        assert session.scalar(text("SELECT 1")) == 1  # the transaction still serves


def test_an_exact_vector_read_has_half_the_searchs_remaining_time(
    plain_factory: sessionmaker[Session],
) -> None:
    """With a deadline, the exact read's statement limit is half the time the search has left: the rest
    is the lines and the fusion after it (its whole time left, a slow scan ran the search out of time;
    its own 5 s limit outlasted a search with less)."""
    from worker.search import store

    limits: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if "set_config('statement_timeout'" in statement:
            limits.append(parameters["t"])

    with plain_factory() as session:
        bind = session.connection().engine
        event.listen(bind, "before_cursor_execute", seen)
        try:
            deadline = Deadline(time.monotonic() + 20)
            assert [tuple(row) for row in store._exactly(session, text("SELECT 1"), {}, deadline)] == [(1,)]
        finally:
            event.remove(bind, "before_cursor_execute", seen)
    set_ms = int(limits[0].removesuffix("ms"))
    assert 9_000 < set_ms <= 10_000, limits


def test_fusion_rewards_agreement(vector_factory: sessionmaker[Session], llm: OpenAIChatClient) -> None:
    seed(vector_factory)
    embed_facts(vector_factory, llm)
    outcome = search(vector_factory, llm, "lex: marathon\nvec: running the Berlin marathon")
    top = outcome.results[0]
    assert top.fact == "Bob committed to running the Berlin marathon in September"
    assert top.matched_by == ("lex:1", "vec:2")
    # Two first places, weight 2 each: 2 * 2/61 plus the first-place bonus.
    assert top.score == pytest.approx(4 / 61 + 0.05)


def test_a_plain_query_that_excludes_a_word_is_searched_lexically_only(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """The probe honoured -budget, but the query's vector line embedded it (its nearest fact was the one
    excluded) and an expansion's lines dropped it: the excluded fact could come out first."""
    seed(vector_factory)
    embed_facts(vector_factory, llm)
    outcome = search(vector_factory, llm, "quarterly budget deck -budget")
    assert all("budget" not in result.fact for result in outcome.results), [r.fact for r in outcome.results]
    assert "searched lexically only: vector and expanded lines cannot exclude words" in outcome.notes
    kept = search(vector_factory, llm, "quarterly budget deck")  # without the exclusion, the vector line runs
    assert kept.results[0].fact == "Alice promised to send the quarterly budget deck by Friday"
    assert not any("lexically only" in note for note in kept.notes)


# --------------------------------------------------------------------------- HTTP API


def _runtime(url: str, factory: sessionmaker[Session], simulator: Any) -> Runtime:
    settings = Settings(database_url=url, llm="simulator", simulator_url=simulator.base_url)
    return Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))


@pytest.fixture
def api(
    plain_database_url: str, plain_factory: sessionmaker[Session], simulator: Any
) -> Iterator[TestClient]:
    from worker.api.app import create_app

    runtime = _runtime(plain_database_url, plain_factory, simulator)
    with TestClient(create_app(runtime, sender=lambda *_: None)) as client:
        send_key(client, plain_factory)
        yield client
    runtime.close()


def test_api_get_and_post(api: TestClient, plain_factory: sessionmaker[Session]) -> None:
    seed(plain_factory)
    got = api.get("/v1/search", params={"q": "lex: greyhound", "limit": 3})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["results"][0]["fact"] == "Bob adopted a greyhound named Pixel"
    assert body["results"][0]["page_slug"] == "bob-chat" and body["results"][0]["row_num"] == 0
    assert body["searches"] == [
        {"type": "lex", "query": "greyhound", "origin": "user", "weight": 2.0, "line": 1, "hits": 1}
    ]
    posted = api.post(
        "/v1/search",
        json={
            "q": "lex: performance review\nintent: web page load times",
            "source_id": "default",
            "limit": 5,
        },
    )
    assert posted.status_code == 200, posted.text
    assert posted.json()["intent"] == "web page load times"
    filtered = api.get("/v1/search", params={"q": "lex: lisbon", "source_id": "work"}).json()
    assert [r["fact"] for r in filtered["results"]] == ["Frank opened the Lisbon office"]
    kinds = api.get("/v1/search", params={"q": "lex: the", "kind": "commitment"}).json()["results"]
    assert {r["kind"] for r in kinds} == {"commitment"}
    since = api.get("/v1/search", params={"q": "lex: in", "since": "2024-04-01T00:00:00Z"}).json()["results"]
    assert since and all(r["page_slug"] in {"bob-chat", "team-sync"} for r in since)


def test_api_bad_document_is_400_with_the_parsers_message(api: TestClient) -> None:
    response = api.get("/v1/search", params={"q": "lex: a\nintent: x\nintent: y"})
    assert response.status_code == 400
    assert response.json() == {"detail": "Line 3: only one intent: line is allowed per query document."}
    response = api.post("/v1/search", json={"q": "lex: a\nnope"})
    assert response.status_code == 400
    assert response.json()["detail"].startswith("Line 2 is missing a lex:/vec:/hyde:/intent: prefix.")
    assert api.get("/v1/search", params={"q": "x", "kind": "rumour"}).status_code == 422
    assert api.post("/v1/search", json={"q": "x", "unknown": 1}).status_code == 422


def test_a_document_of_more_search_lines_than_one_request_runs_is_400(api: TestClient) -> None:
    """Each line is one query on the facts: 2,000 characters of "lex: a" lines were some 280 queries."""
    within = "\n".join(f"lex: w{i}" for i in range(MAX_SEARCH_LINES)) + "\nintent: anything"
    assert api.post("/v1/search", json={"q": within}).status_code == 200
    flood = "\n".join("lex: a" for _ in range(280))
    response = api.post("/v1/search", json={"q": flood})
    assert response.status_code == 400
    assert response.json() == {
        "detail": f"the query document has 280 search lines; at most {MAX_SEARCH_LINES} are searched in one "
        "request"
    }
    assert api.get("/v1/search", params={"q": within + "\nlex: one more"}).status_code == 400


def test_an_intent_past_its_limit_is_refused_by_every_door(
    api: TestClient, plain_factory: sessionmaker[Session], llm: Any
) -> None:
    """Only the API's and the MCP tool's input schemas held the intent to its limit: the CLI's --intent
    sent any length into the expansion prompt (paid from the readers' budget), and a document's
    intent: line passed the API's own limit."""
    from worker.search import MAX_INTENT_CHARS

    long = "x" * (MAX_INTENT_CHARS + 1)
    with pytest.raises(SearchError, match=f"the intent is {MAX_INTENT_CHARS + 1} characters"):
        search(plain_factory, llm, "alice", intent=long)  # the service, as the CLI calls it
    response = api.post("/v1/search", json={"q": f"intent: {long}\nlex: alice"})
    assert response.status_code == 400 and "the intent is" in response.json()["detail"]
    assert api.post("/v1/search", json={"q": f"intent: {long[1:]}\nlex: alice"}).status_code == 200


def test_api_vec_without_pgvector_is_501(api: TestClient) -> None:
    response = api.get("/v1/search", params={"q": "vec: dogs"})
    assert response.status_code == 501
    assert response.json()["detail"].startswith("vector search unavailable")


SIXTY_FOUR = base64.b64encode(struct.pack("<64f", *([0.125] * 64))).decode()


def _plain_and_vec(url: str, factory: sessionmaker[Session], sim: Simulator) -> tuple[Any, Any]:
    """A plain query and a vec: line through the API, with ``sim`` as the deployment's provider."""
    from worker.api.app import create_app

    settings = Settings(database_url=url, llm="simulator", simulator_url=sim.base_url, llm_max_attempts=1)
    runtime = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    try:
        with TestClient(create_app(runtime, sender=lambda *_: None)) as client:
            send_key(client, factory)
            plain = client.get("/v1/search", params={"q": "greyhound"})
            return plain, client.get("/v1/search", params={"q": "vec: greyhound pet"})
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ({"rate_500": 1.0}, "the embedding call did not succeed (provider_error, HTTP 500)"),
        (  # a model of another size (every answer one 64-dimension vector)
            {"raw_replies": {"embeddings": {"data": [{"index": 0, "embedding": SIXTY_FOUR}], "usage": {}}}},
            "the embedding model returned 64 dimensions",
        ),
        (  # no vector for the texts sent (the gateway's ReplyShapeError)
            {"raw_replies": {"embeddings": {"data": [], "usage": {}}}},
            "the embedding call did not succeed (provider_error)",
        ),
    ],
)
def test_an_embedding_fault_skips_a_plain_querys_vectors_and_refuses_a_vec_line_with_503(
    vector_database_url: str,
    vector_factory: sessionmaker[Session],
    llm: OpenAIChatClient,
    fault: Any,
    why: str,
) -> None:
    """A failed embedding call was a 500 for every plain query, and a model of another size a 400 that
    blamed the query, though a plain query's vector line is a bonus and its lexical probe had already
    run: the lexical results come back with a note. A document's own vec: line cannot run: a 503 that
    says why, with the search API's other refusals."""
    seed(vector_factory)
    embed_facts(vector_factory, llm)
    with Simulator(SimulatorConfig()) as faulty:
        faulty.configure(**fault)
        plain, vec = _plain_and_vec(vector_database_url, vector_factory, faulty)
        assert plain.status_code == 200, plain.text
        assert plain.json()["results"][0]["fact"] == "Bob adopted a greyhound named Pixel"
        assert "vector search skipped: the embedding call failed" in plain.json()["notes"]
        assert vec.status_code == 503, vec.text
        assert vec.json()["detail"].startswith(f"vector search failed: {why}")
        assert vec.headers["Retry-After"] == "30"
        with pytest.raises(EmbeddingFailedError):  # the service's own word (the CLI and MCP map it)
            search(vector_factory, sim_client(faulty), "vec: greyhound pet")


def test_an_embedding_the_provider_refuses_for_the_deployment_is_unavailable_not_retried(
    vector_factory: sessionmaker[Session], llm: OpenAIChatClient
) -> None:
    """A wrong key or embedding model (the provider's 401 or 404, deployment_fault) was answered "try
    again shortly" with Retry-After: 30, and clients retried it for good. It is the deployment's: vector
    search is unavailable (the API's 501, no retry hint), saying so without the provider's words."""
    import httpx2
    import openai

    from worker.llm.errors import to_llm_error

    seed(vector_factory)
    embed_facts(vector_factory, llm)
    refusal = openai.AuthenticationError(
        "Incorrect API key provided: sk-abc***",
        response=httpx2.Response(
            401, request=httpx2.Request("POST", "https://api.openai.example/v1/embeddings")
        ),
        body={
            "message": "Incorrect API key provided: sk-abc***",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        },
    )

    class WrongKey:  # the simulator's chat, an embedding call the provider refuses as real ones do
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            return llm.chat(request)

        def embed(self, texts: list[str], *, purpose: str = "embedding") -> Any:
            raise to_llm_error(refusal)

    with pytest.raises(VectorSearchUnavailableError) as refused:
        search(vector_factory, WrongKey(), "vec: greyhound pet")
    said = str(refused.value)
    assert "HTTP 401 (invalid_api_key)" in said and "sk-abc" not in said and "try again" not in said
    plain = search(vector_factory, WrongKey(), "greyhound")  # a plain query's vectors: a skipped bonus
    assert plain.results and plain.results[0].fact == "Bob adopted a greyhound named Pixel"


def test_api_is_in_the_openapi_document(api: TestClient) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert {"get", "post"} <= set(paths["/v1/search"])
    # The kinds it takes are the facts' kinds (the API and the MCP tool each wrote the list out again:
    # a kind added to the facts was refused by both while the CLI took it).
    from worker.core.facts import FACT_KINDS
    from worker.mcp.inputs import KindName

    [kind] = [p for p in paths["/v1/search"]["get"]["parameters"] if p["name"] == "kind"]
    assert [s.get("enum") for s in kind["schema"]["anyOf"] if "enum" in s] == [list(FACT_KINDS)]
    assert typing.get_args(KindName) == FACT_KINDS


# --------------------------------------------------------------------------- CLI


@contextlib.contextmanager
def cli_env(monkeypatch: pytest.MonkeyPatch, url: str, simulator: Any) -> Iterator[None]:
    monkeypatch.setenv("FACTMILL_DATABASE_URL", url)
    monkeypatch.setenv("FACTMILL_LLM", "simulator")
    monkeypatch.setenv("FACTMILL_SIMULATOR_URL", simulator.base_url)
    get_settings.cache_clear()
    try:
        yield
    finally:
        get_settings.cache_clear()


def test_cli_search_and_embed(
    monkeypatch: pytest.MonkeyPatch,
    vector_database_url: str,
    vector_factory: sessionmaker[Session],
    simulator: Any,
) -> None:
    from worker.cli import app
    from worker.search import count_facts_to_embed

    seed(vector_factory)
    runner = CliRunner()
    # The progress bar's total (stderr a terminal; it printed a line a batch, with no total).
    assert count_facts_to_embed(vector_factory) == count_facts_to_embed(vector_factory, every=True)
    assert count_facts_to_embed(vector_factory) == len(CORPUS) + 61
    with cli_env(monkeypatch, vector_database_url, simulator):
        embedded = runner.invoke(app, ["embed", "--batch-size", "50"])
        assert embedded.exit_code == 0, embedded.output
        assert f"embedded {len(CORPUS) + 61} fact(s); vector search available" in embedded.output
        assert "batch(es)" not in embedded.output
        assert count_facts_to_embed(vector_factory) == 0
        result = runner.invoke(app, ["search", "lex: greyhound\\nvec: pet dog", "--json"])
        assert result.exit_code == 0, result.output
        body = json.loads(result.stdout)
        assert body["results"][0]["fact"] == "Bob adopted a greyhound named Pixel"
        table = runner.invoke(app, ["search", "greyhound pixel", "--entity", "bob", "--limit", "3"])
        assert table.exit_code == 0, table.output
        assert "greyhound" in table.output
        intent = runner.invoke(app, ["search", "performance", "--intent", "web page load", "--json"])
        assert json.loads(intent.stdout)["intent"] == "web page load"


def test_cli_search_is_held_to_the_readers_budget_not_extractions(
    monkeypatch: pytest.MonkeyPatch,
    vector_database_url: str,
    vector_factory: sessionmaker[Session],
    simulator: Any,
) -> None:
    """`factmill search` checked the work budget while its calls were booked to the readers' one: a
    spent extraction day skipped its expansion, and the readers' budget never stopped it."""
    from tests.integration.test_access_budget import configure, ledger_rows, spend
    from worker.accounting import SEARCH_DAILY_BUDGET_KEY
    from worker.cli import app

    seed(vector_factory)
    skipped = "query expansion skipped: budget; searched the query alone"
    runner = CliRunner()

    def notes() -> list[str]:
        result = runner.invoke(app, ["search", "where does bob live", "--json"])
        assert result.exit_code == 0, result.output
        return list(json.loads(result.stdout)["notes"])

    with cli_env(monkeypatch, vector_database_url, simulator):
        configure(vector_factory, "llm.budget_daily_usd", "1")
        spend(vector_factory, "extraction", "2")  # the work day is spent
        assert skipped not in notes()
        configure(vector_factory, SEARCH_DAILY_BUDGET_KEY, "1")
        spend(vector_factory, EXPANSION_PURPOSE, "2")  # the readers' day is spent
        rows = ledger_rows(vector_factory)
        said = notes()
        assert skipped in said and "vector search skipped: budget" in said
        # Refused before any request (expansion and the query's embedding): nothing is recorded.
        assert ledger_rows(vector_factory) == rows


def test_cli_embed_ends_on_one_line_when_the_llm_refuses(
    monkeypatch: pytest.MonkeyPatch,
    vector_database_url: str,
    vector_factory: sessionmaker[Session],
    simulator: Any,
) -> None:
    """`factmill embed` caught only SearchError: a spent budget, a provider error or a provider with no
    embeddings API (Anthropic without an OpenAI key) ended it on a traceback."""
    from tests.integration.test_access_budget import configure, spend
    from worker.cli import app

    seed(vector_factory, filler=0)
    with cli_env(monkeypatch, vector_database_url, simulator):
        configure(vector_factory, "llm.budget_daily_usd", "1")
        spend(vector_factory, "extraction", "2")
        result = CliRunner().invoke(app, ["embed"])
    assert result.exit_code == 1 and "budget is exhausted" in result.output, result.output
    assert isinstance(result.exception, SystemExit)


def test_cli_errors(monkeypatch: pytest.MonkeyPatch, plain_database_url: str, simulator: Any) -> None:
    from worker.cli import app

    runner = CliRunner()
    with cli_env(monkeypatch, plain_database_url, simulator):
        bad = runner.invoke(app, ["search", "lex: a\\nintent: x\\nintent: y"])
        assert bad.exit_code == 2
        assert "only one intent: line is allowed" in bad.output
        unavailable = runner.invoke(app, ["search", "vec: dogs"])
        assert unavailable.exit_code == 3
        assert "vector search unavailable" in unavailable.output
        # A document on standard input that no query can carry: one line and exit 2, not a traceback
        # (after the embedding of its vec: line was paid for).
        for given, said in ((b"lex: foo\x00bar", "must not contain NUL"), (b"lex: caf\xe9", "is not UTF-8")):
            refused = runner.invoke(app, ["search", "-"], input=given)
            assert refused.exit_code == 2 and said in refused.output, refused.output
            assert refused.exception is None or isinstance(refused.exception, SystemExit)
        read = runner.invoke(app, ["search", "-", "--json"], input=b"lex: greyhound")
        assert read.exit_code == 0, read.output
        # ISO times with a zone, as the API takes them (click's own type knew three formats, no zone).
        for moment in ("2024-03-01T12:00:00Z", "2024-03-01T12:00+02:00", "2024-03-01"):
            dated = runner.invoke(app, ["search", "lex: lisbon", "--as-of", moment, "--since", moment])
            assert dated.exit_code == 0, (moment, dated.output)
        bad = runner.invoke(app, ["search", "lex: lisbon", "--as-of", "next tuesday"])
        assert bad.exit_code == 2 and "expected an ISO date or time" in bad.output
        costs = runner.invoke(app, ["costs", "--since", "2026-11-01T00:00Z", "--json"])
        assert costs.exit_code == 0, costs.output


def test_a_database_without_the_store_asks_what_is_installable_once_a_minute(server_url: str) -> None:
    """On a lexical-only deployment every search read every extension's control file from the server's
    disk (pg_available_extensions) to say why vector search was unavailable."""
    from sqlalchemy import event

    with fresh_database(server_url, "nostore") as url:
        db.upgrade(url)
        engine = db.get_engine(url)
        with engine.begin() as conn:
            conn.execute(text("DROP SCHEMA IF EXISTS search CASCADE"))
        asked: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda *a: asked.append(a[2]))
        factory = sessionmaker(engine)
        reasons = set()
        for _ in range(3):
            with factory() as session:
                reasons.add(vector_search_status(session).reason)
        assert len(reasons) == 1 and None not in reasons
        assert sum("pg_available_extensions" in statement for statement in asked) == 1


def test_embed_sets_up_a_missing_store(vector_database_url: str, llm: OpenAIChatClient) -> None:
    """pgvector installed after migration 0003 ran: `factmill embed` creates the store and fills it. On
    the server with pgvector (the test server's, else the embedded one): it skipped itself, CI too."""
    server = make_url(vector_database_url).set(database="postgres").render_as_string(hide_password=False)
    with fresh_database(server, "late") as url:
        db.upgrade(url)
        engine = db.get_engine(url)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")).first()
            conn.execute(text("DROP SCHEMA IF EXISTS search CASCADE"))
            conn.execute(text("DROP EXTENSION IF EXISTS vector"))
        factory = sessionmaker(engine, expire_on_commit=False)
        seed(factory, filler=0)
        with factory() as session:
            assert "has pgvector but this database" in (vector_search_status(session).reason or "")
        report = embed_facts(factory, llm)
        assert report.vector_search == "available" and report.embedded == len(CORPUS) + 1
        assert (
            search(factory, llm, "vec: greyhound pet").results[0].fact
            == "Bob adopted a greyhound named Pixel"
        )


def test_simulator_answers_the_expansion_prompt() -> None:
    from worker.search import expansion_request
    from worker.simulator import PromptMessage, text_reply

    request = expansion_request("where does Alice live", "moving house")
    messages = [PromptMessage("system", request.system)] + [PromptMessage(r, t) for r, t in request.messages]
    reply = text_reply(messages)
    assert (
        reply == "lex: alice live moving house\nvec: where does Alice live (moving house)\nhyde: Alice live."
    )
    assert parse_expansion(reply, "where does Alice live") == [
        ("lex", "alice live moving house"),
        ("vec", "where does Alice live (moving house)"),
        ("hyde", "Alice live."),
    ]
