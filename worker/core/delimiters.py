"""Escaping a prompt's own delimiter tags inside untrusted text, so data cannot close its block (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache


@cache
def _tag_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    names = "|".join(re.escape(tag) for tag in tags)
    # `<`, optional spaces and `/`, then a tag name: what a model could read as opening or closing one.
    # Possessive runs: with `\s*/?\s*` a `<` before a million spaces tried each way of splitting them
    # between the two runs (quadratic: an hour of one thread, holding the GIL, for one message).
    return re.compile(rf"<(?=\s*+(?:/\s*+)?(?:{names})\b)", re.IGNORECASE)


def neutralize_tags(text: str, tags: Sequence[str]) -> str:
    """``text`` with the ``<`` of every ``<tag>``/``</tag>`` (any case, inner spaces) written as ``&lt;``.

    A page or transcript that writes the prompt's delimiter would otherwise close the data block early
    and speak as the prompt; escaped, it stays visible as text and the block has exactly one end.
    """
    return _tag_pattern(tuple(tags)).sub("&lt;", text)


def wrap_in_tag(tag: str, text: str, escape: Sequence[str] = ()) -> str:
    """``text`` between ``<tag>`` and ``</tag>`` lines, with ``tag`` (and ``escape``) neutralized inside."""
    return f"<{tag}>\n{neutralize_tags(text, (tag, *escape))}\n</{tag}>"


__all__ = ["neutralize_tags", "wrap_in_tag"]
