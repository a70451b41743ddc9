"""The simulator's consolidation answers: deterministic, from word overlap and dates, labelled."""

from __future__ import annotations

from datetime import UTC, datetime

from worker.core.consolidation import FactView
from worker.core.consolidation_prompt import AskedPair, parse_decisions, render_pairs
from worker.simulator.consolidation import consolidation_reply

JAN = datetime(2026, 1, 10, tzinfo=UTC)
MAR = datetime(2026, 3, 5, tzinfo=UTC)


def answer(new: str, old: str, kind: str = "fact", new_at: datetime = MAR, old_at: datetime = JAN) -> str:
    pair = AskedPair(1, FactView(2, new, kind, new_at), FactView(1, old, kind, old_at))
    reply = consolidation_reply(render_pairs("people/alice", [pair]))
    decided = parse_decisions(__import__("json").dumps(reply), [1])[1]
    assert decided.reason.startswith("simulator (not a model)")
    return decided.verdict


def test_changed_name_later_is_an_update_and_same_day_a_contradiction() -> None:
    assert answer("Alice lives in Porto now.", "Alice lives in Lisbon now.") == "updates"
    assert answer("Alice lives in Porto.", "Alice lives in Lisbon.", new_at=JAN) == "contradicts"
    assert answer("Alice is on the Pro plan.", "Alice is on the Basic plan.") == "updates"


def test_paraphrase_is_a_duplicate_and_different_things_are_unrelated() -> None:
    assert answer("Alice lives in Lisbon now.", "Alice lives in Lisbon.") == "duplicate"
    assert answer("Alice likes green tea.", "Alice drives a red car to work.") == "unrelated"


def test_events_never_replace_each_other() -> None:
    assert answer("Alice visited Rome.", "Alice visited Paris.", kind="event") == "unrelated"


def test_pairs_are_answered_by_number() -> None:
    pairs = [
        AskedPair(
            1,
            FactView(3, "Alice lives in Porto", "fact", MAR),
            FactView(1, "Alice lives in Lisbon", "fact", JAN),
        ),
        AskedPair(
            2, FactView(3, "Alice lives in Porto", "fact", MAR), FactView(2, "Bob owns a boat", "fact", JAN)
        ),
    ]
    reply = consolidation_reply(render_pairs("people/alice", pairs))
    assert [(d["pair"], d["decision"]) for d in reply["decisions"]] == [(1, "updates"), (2, "unrelated")]


def test_a_possessive_is_about_someone_else_and_the_same_names_restated_are_a_duplicate() -> None:
    assert answer("Alice's sister lives in Porto.", "Alice lives in Lisbon.") == "unrelated"
    assert answer("Alice is based in Lisbon these days.", "Alice lives in Lisbon.") == "duplicate"
