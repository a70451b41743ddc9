"""README names every migration that holds a table's writes while it works (an index built on a table
an earlier migration made, an explicit LOCK TABLE), so an operator plans a quiet moment for it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSIONS = REPO / "alembic" / "versions"


def _revision(source: str, path: Path) -> str:
    """The migration's ``revision`` (not its file name: alembic.ini's template may name a file otherwise)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "revision" for t in targets):
                assert isinstance(node.value, ast.Constant), path
                return str(node.value.value)
    raise AssertionError(f"{path} names no revision")


def _table(node: ast.Call, position: int) -> str:
    table = node.args[position] if len(node.args) > position else None
    return table.value if isinstance(table, ast.Constant) else "?"


def holding_migrations() -> dict[str, list[str]]:
    """Revision → the tables its upgrade holds ("?" where the table is not a literal): an index built, a
    CHECK constraint added (every row checked under the lock), a stored generated column added (the
    table rewritten), the word index rebuilt (``rebuild_search_vector``), an explicit LOCK TABLE."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in VERSIONS.glob("*.py") if p.name != "__init__.py"):
        source = path.read_text()
        # The upgrade and the helpers it may call (all but the downgrade: 0009's check was a helper's).
        upgrade = [
            node
            for node in ast.parse(source).body
            if not (isinstance(node, ast.FunctionDef) and node.name == "downgrade")
        ]
        created, held = set(), set()
        for node in (inner for top in upgrade for inner in ast.walk(top)):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "create_table" and isinstance(node.args[0], ast.Constant):
                created.add(node.args[0].value)
            elif name in ("create_index", "create_check_constraint"):
                held.add(_table(node, 1))
            elif name == "add_column" and "Computed(" in (ast.get_source_segment(source, node) or ""):
                held.add(_table(node, 0))
            elif name == "rebuild_search_vector":
                held.add("facts")
        text = "\n".join(ast.get_source_segment(source, top) or "" for top in upgrade)
        locked = re.findall(r"LOCK TABLE ([\w, ]+?) IN", text)
        if "LOCK TABLE" in text and not locked:
            locked = ["?"]  # a statement built at run time
        tables = sorted(held - created) + locked
        if tables:
            found[_revision(source, path)] = tables
    return found


def test_readme_names_every_migration_that_holds_a_table() -> None:
    readme = (REPO / "README.md").read_text()
    start = readme.index("migrations hold a table for as long as they work on it")
    paragraph = readme[start : readme.index("Plan a quiet moment", start)]
    named = set(re.findall(r"\b0\d{3}\b", paragraph))
    held = holding_migrations()
    # The walk finds an index (0010), a lock (0024), a helper's CHECK constraint (0009), a stored
    # generated column (0034) and the word index rebuilt (0049): the last three it missed before.
    assert {"0010", "0024", "0009", "0034", "0049"} <= set(held)
    missing = {revision: tables for revision, tables in held.items() if revision not in named}
    assert not missing, f"README's migration paragraph does not name {missing}"
