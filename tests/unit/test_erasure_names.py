"""The one rule for what an erased name becomes: stable, so digests stored before stay comparable."""

from __future__ import annotations

import hashlib

from worker.compaction.erase import erased_transcript_digest, erased_transcript_name
from worker.consolidation.erasure import erased_entity_key
from worker.core.erasure import erased_digest, erased_label
from worker.extraction.erase import erased_name, erased_slug_digest


def test_a_digest_is_the_sha256_of_the_parts_joined_by_a_bar() -> None:
    assert erased_digest("default", "therapy/alice") == hashlib.sha256(b"default|therapy/alice").hexdigest()
    assert erased_digest("support-chat-alice") == hashlib.sha256(b"support-chat-alice").hexdigest()
    assert erased_label("x") == "erased:" + hashlib.sha256(b"x").hexdigest()


def test_every_erasure_names_by_the_same_rule() -> None:
    # The erasures table has kept sha256("source|slug") since migration 0007: unchanged.
    assert erased_slug_digest("default", "a/b") == hashlib.sha256(b"default|a/b").hexdigest()
    assert erased_name("default", "a/b") == erased_label("default", "a/b")
    assert erased_transcript_digest("t-1") == erased_digest("t-1")
    assert erased_transcript_name("t-1") == erased_label("t-1")
    assert erased_entity_key("default", "people/alice") == erased_label("default", "people/alice")
