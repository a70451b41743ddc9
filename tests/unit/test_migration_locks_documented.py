"""README names every migration that holds a table's writes while it works (an index built on a table
an earlier migration made, an explicit LOCK TABLE), so an operator plans a quiet moment for it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSIONS = REPO / "alembic" / "versions"


def holding_migrations() -> dict[str, list[str]]:
    """Revision → the tables its upgrade holds ("?" where the table is not a literal)."""
    found: dict[str, list[str]] = {}
    for path in sorted(VERSIONS.glob("0*.py")):
        source = path.read_text()
        upgrade = next(
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name == "upgrade"
        )
        created, indexed = set(), set()
        for node in ast.walk(upgrade):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "create_table" and isinstance(node.args[0], ast.Constant):
                    created.add(node.args[0].value)
                if node.func.attr == "create_index":
                    table = node.args[1] if len(node.args) > 1 else None
                    indexed.add(table.value if isinstance(table, ast.Constant) else "?")
        locked = re.findall(r"LOCK TABLE ([\w, ]+?) IN", ast.get_source_segment(source, upgrade) or "")
        held = sorted(indexed - created) + locked
        if held:
            found[path.name[:4]] = held
    return found


def test_readme_names_every_migration_that_holds_a_table() -> None:
    readme = (REPO / "README.md").read_text()
    start = readme.index("migrations hold a table for as long as they work on it")
    paragraph = readme[start : readme.index("Plan a quiet moment", start)]
    named = set(re.findall(r"\b0\d{3}\b", paragraph))
    held = holding_migrations()
    assert "0010" in held and "0024" in held  # the walk finds an index and a lock
    missing = {revision: tables for revision, tables in held.items() if revision not in named}
    assert not missing, f"README's migration paragraph does not name {missing}"
