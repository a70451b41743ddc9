"""Every setting an operator can give is in README's configuration table: a variable only the code
knows about is one nobody sets."""

from __future__ import annotations

import re

from pydantic import AliasChoices

from tests.service import REPO
from worker.settings import Settings

HEADER = "| variable | default | meaning |"


def table_rows() -> list[str]:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def variable_names(name: str) -> list[str]:
    """The environment variables that set the field ``name`` (its aliases, else FACTMILL_<NAME>)."""
    alias = Settings.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    if isinstance(alias, str):
        return [alias]
    return [f"FACTMILL_{name.upper()}"]


def test_every_setting_is_in_the_configuration_table() -> None:
    documented = {
        variable
        for row in table_rows()
        for variable in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split(" | ")[0])
    }
    missing = [
        variable_names(name)
        for name in Settings.model_fields
        if not documented.intersection(variable_names(name))
    ]
    assert missing == []


def test_the_table_names_no_setting_that_does_not_exist() -> None:
    known = {variable for name in Settings.model_fields for variable in variable_names(name)}
    named = {
        v
        for row in table_rows()
        for v in re.findall(r"`((?:FACTMILL|FLOWER)_[A-Z0-9_]+)`", row.split(" | ")[0])
    }
    assert named - known == set()
