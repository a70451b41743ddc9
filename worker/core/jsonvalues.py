"""JSON values as JSON Schema means them, where Python's types differ."""

from __future__ import annotations


def json_integer(value: object) -> object:
    """1.0 is an integer in JSON Schema: give it as 1. Anything else is returned as it is, so 1.5, "1"
    and true stay what they are (and are refused by whoever wants an int)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


__all__ = ["json_integer"]
