"""The `factmill` command line as a user runs it, as subprocesses, against the test database."""

from __future__ import annotations

import json
import os
import pty
import select
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from models import ConfigEntry
from tests.cli import Ran, invoke_cli, run_main
from tests.service import REPO
from worker.core.conversation import MAX_PAGE_BODY_BYTES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

EXAMPLES = REPO / "examples"


def factmill(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``factmill ARGS`` in a fresh interpreter with exactly ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def bare_env(**values: str) -> dict[str, str]:
    """This process's environment without any FACTMILL_ or FLOWER_ variable, plus ``values``."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("FACTMILL_", "FLOWER_"))} | values


def cli_env(database_url: str, simulator: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    env.update(
        {
            "FACTMILL_DATABASE_URL": database_url,
            "FACTMILL_LLM": "simulator",
            "FACTMILL_SIMULATOR_URL": simulator.base_url,
            "FACTMILL_BROKER_URL": "redis://127.0.0.1:1/0",  # unreachable on purpose: ingest must not need it
        }
    )
    return env


@pytest.fixture
def cli_process(factory, database_url, simulator):  # type: ignore[no-untyped-def]
    """``factmill ARGS`` as a user runs it: a process of its own."""
    env = cli_env(database_url, simulator)

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = factmill(list(args), env, timeout=240)
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    run.env = env  # type: ignore[attr-defined]  # for a test that runs the command its own way
    yield run
    simulator.restore()  # the knobs a test turned (latency, faults) never reach the next one


@pytest.fixture
def cli(factory, database_url, simulator):  # type: ignore[no-untyped-def]
    """``factmill ARGS`` through its entry point in this process (``run_main``): the tests that check
    what a command says and stores; ``cli_process`` for those about the process itself."""
    env = cli_env(database_url, simulator)

    def run(*args: str, check: bool = True) -> Ran:
        result = run_main(list(args), env)
        if check:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    run.env = env  # type: ignore[attr-defined]  # for a test that runs the command its own way
    yield run
    simulator.restore()


def as_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(result.stdout)


def test_run_main_gives_the_command_its_own_logging_and_puts_pytests_back(database_url):
    """In this process the command's log lines went to pytest's handlers (not its stderr, where a
    process prints them), and the filter main() adds stayed on them, rewriting every later test's
    records (a test that a secret is not logged then passed whatever was logged)."""
    import logging

    root = logging.getLogger()
    before = (root.handlers[:], [handler.filters[:] for handler in root.handlers], root.level)
    ran = run_main(["jobs", "list"], {"FACTMILL_DATABASE_URL": database_url, "FACTMILL_NO_SUCH_SETTING": "1"})
    assert ran.returncode == 0 and "FACTMILL_NO_SUCH_SETTING is not a Factmill setting" in ran.stderr
    assert (root.handlers, [handler.filters for handler in root.handlers], root.level) == before


def test_ingest_extract_rerun_and_force_on_the_examples(cli_process, simulator):
    cli = cli_process  # the flagship run, as a user makes it: each command a process of its own
    ingested = as_json(cli("ingest", str(EXAMPLES), "--no-enqueue", "--json"))
    assert len(ingested["ingested"]) == 23 and ingested["errors"] == []
    dry = as_json(cli("extract", "--dry-run", "--json"))
    assert (dry["pages_considered"], dry["pages_processed"], dry["llm_calls"]) == (22, 22, 0)
    simulator.configure(latency_ms=100)  # each call lasts long enough for the next ones to start beside it
    simulator.reset()
    first = as_json(cli("extract", "--segment-concurrency", "1", "--json"))
    assert simulator.stats()["max_in_flight"] == 1
    simulator.restore()
    assert (first["pages_processed"], first["pages_failed"]) == (22, 0)
    assert first["facts_inserted"] > 0 and first["segments_processed"] == dry["segments_processed"]
    slug = "conversations/imessage/alice-and-bob-new-job"
    facts = as_json(cli("facts", "list", "--slug", slug, "--json"))
    assert facts and [f["row_num"] for f in facts] == list(range(len(facts)))
    # Cut to --limit: the JSON list is the first ones, stderr says so (it said nothing past 10,000).
    first_two = cli("facts", "list", "--slug", slug, "--json", "--limit", "2")
    assert as_json(first_two) == facts[:2]
    assert f"the first 2 of {len(facts)} facts; --limit shows more" in first_two.stderr
    rerun = as_json(cli("extract", "--json"))
    assert (rerun["pages_skipped"], rerun["facts_inserted"], rerun["llm_calls"]) == (22, 0, 0)
    simulator.configure(latency_ms=100)
    simulator.reset()
    forced = as_json(cli("extract", "--force", "--json"))  # 4 calls in flight a page by default
    assert forced["facts_inserted"] == first["facts_inserted"]
    assert simulator.stats()["max_in_flight"] > 1
    simulator.restore()
    assert as_json(cli("facts", "list", "--slug", slug, "--json")) == facts
    # The API's query (GET /v1/pages/.../facts): current facts, --history adds the rest with a status.
    history = as_json(cli("facts", "list", "--slug", slug, "--history", "--json"))
    lifecycle = ("status", "id", "superseded_by", "duplicate_of")  # the ids `facts unmerge` takes
    assert [{k: v for k, v in f.items() if k not in lifecycle} for f in history] == facts
    assert {f["status"] for f in history} == {"current"} and all(isinstance(f["id"], int) for f in history)
    assert len({f["id"] for f in history}) == len(history)
    assert {(f["superseded_by"], f["duplicate_of"]) for f in history} == {(None, None)}
    missing = cli("facts", "list", "--slug", "conversations/nope", check=False)
    assert missing.returncode == 1 and "no page 'conversations/nope' in source 'default'" in missing.stderr
    unchanged = as_json(cli("ingest", str(EXAMPLES), "--no-enqueue", "--json"))
    assert len(unchanged["unchanged"]) == 23 and unchanged["ingested"] == []
    # What is stored: every page, by slug, with its current facts and the job ingest queued for it.
    listed = as_json(cli("pages", "list", "--limit", "20", "--json"))
    assert len(listed["pages"]) == 20 and listed["next_after"] == f"default|{listed['pages'][-1]['slug']}"
    rest = as_json(cli("pages", "list", "--after", listed["next_after"], "--json"))
    slugs = [p["slug"] for p in listed["pages"] + rest["pages"]]
    assert len(slugs) == 23 and slugs == sorted(slugs) and rest["next_after"] is None
    [alice] = [p for p in listed["pages"] + rest["pages"] if p["slug"] == slug]
    assert alice["facts"] == len(facts) and alice["last_job_status"] == "queued"  # --no-enqueue
    # The hint to go on is quoted for a shell: a source id may hold a quote or a space.
    cli("ingest", str(EXAMPLES), "--source-id", "o'reilly docs", "--no-enqueue")
    table = cli("pages", "list", "--source-id", "o'reilly docs", "--limit", "1").stdout
    [hint] = [line for line in table.splitlines() if line.startswith("more: --after ")]
    assert shlex.split(hint)[2].startswith("o'reilly docs|"), hint


def test_ingest_reports_each_bad_file_and_keeps_the_rest(cli, tmp_path: Path):
    good = "---\nslug: conversations/ok\ntype: conversation\n---\n**A** (2024-01-01 9:00 AM): hi\n"
    (tmp_path / "ok.md").write_text(good)
    (tmp_path / "latin1.md").write_bytes("---\ntype: conversation\n---\ncaf\xe9".encode("latin-1"))
    (tmp_path / "binary.md").write_bytes(b"\x00\x01\x02 junk")
    (tmp_path / "no-type.md").write_text("---\nslug: x\n---\nbody")
    (tmp_path / "bad-yaml.md").write_text("---\ntype: [unclosed\n---\nbody")
    (tmp_path / "bad-slug.md").write_text("---\nslug: /../etc\ntype: conversation\n---\nbody")
    # 554 bytes standing for 387 million values; and 900 levels of nesting (a RecursionError ended the run).
    laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"] + [
        f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]" for n in range(1, 9)
    ]
    (tmp_path / "laughs.md").write_text("---\ntype: conversation\n" + "\n".join(laughs) + "\n---\nbody")
    (tmp_path / "deep.md").write_text("---\ntype: conversation\nx: " + "[" * 900 + "]" * 900 + "\n---\nbody")
    # Values PyYAML parses and Python cannot hold, and escapes to text Postgres cannot store: each was a
    # traceback that ended the run (the rest of the folder never ingested).
    bad_values = {
        "feb30": "date: 2024-02-30",
        "year0": "date: 0000-01-01",
        "digits": "n: " + "9" * 5000,
        "nul": 'note: "a\\0b"',
        "surrogate": 'title: "\\ud800"',
        "nul-type": 'type: "conversation\\0"',
    }
    for name, line in bad_values.items():
        typed = "" if name == "nul-type" else "type: conversation\n"
        (tmp_path / f"{name}.md").write_text(f"---\n{typed}{line}\n---\nbody")
    with (tmp_path / "huge.md").open("wb") as huge:  # sparse: 1 GiB that takes no disk
        huge.truncate(1 << 30)
    # Under the file cap, over the body cap: stored, it was never extracted, and ingest said all was well.
    with (tmp_path / "long-body.md").open("w") as long_body:
        long_body.write("---\ntype: conversation\n---\n")
        long_body.write("x" * (MAX_PAGE_BODY_BYTES + 10))
    # A Latin-1 file name: --json ended in a traceback (its lone surrogates), the report never written.
    latin1_name = os.path.join(os.fsencode(tmp_path), b"caf\xe9.md")
    with open(latin1_name, "wb") as named:
        named.write(b"---\ntype: conversation\n---\nbody")
    result = cli("ingest", str(tmp_path), "--no-enqueue", "--json", check=False)
    assert result.returncode == 1  # the good page is stored, and a script sees that files were skipped
    report = as_json(result)
    assert report["ingested"] == ["conversations/ok"]
    reasons = {Path(e["path"]).name: e["reason"] for e in report["errors"]}
    assert "not valid UTF-8" in reasons["latin1.md"]
    assert "binary" in reasons["binary.md"]
    assert "no 'type'" in reasons["no-type.md"]
    assert "not valid YAML" in reasons["bad-yaml.md"]
    assert "slug" in reasons["bad-slug.md"]
    assert reasons["laughs.md"] == "front matter uses a YAML alias (line 4); write the value out instead"
    assert reasons["deep.md"] == "front matter nests deeper than 32 levels (line 3)"
    assert "past the page cap" in reasons["huge.md"]  # refused after reading no more than the cap
    assert "over the 26214400-byte cap extraction takes" in reasons["long-body.md"]
    assert "the file name is not UTF-8" in reasons["caf\\xe9.md"], reasons
    for name in ("feb30", "year0", "digits"):
        assert "front matter holds a value that cannot be read" in reasons[f"{name}.md"], reasons
    assert "must not contain NUL" in reasons["nul.md"] and "must not contain NUL" in reasons["nul-type.md"]
    assert "lone surrogates" in reasons["surrogate.md"]
    # With colour forced (as CI runners often do), --json is still plain JSON: Rich coloured it.
    coloured = factmill(
        ["ingest", str(tmp_path / "ok.md"), "--no-enqueue", "--json"], cli.env | {"FORCE_COLOR": "1"}
    )
    assert coloured.returncode == 0 and as_json(coloured)["unchanged"] == ["conversations/ok"], (
        coloured.stdout
    )
    endless = cli("ingest", "/dev/zero", "--no-enqueue", "--json", check=False)
    assert endless.returncode == 1 and "not a regular file" in as_json(endless)["errors"][0]["reason"]
    missing = cli("ingest", str(tmp_path / "nope.md"), check=False)
    assert missing.returncode == 1 and "no such file" in missing.stderr
    # One file reached by two paths of one run (a folder and a file in it): its slugs differ, and it was
    # stored as two pages, each extracted.
    nested = tmp_path / "nest" / "2024"
    nested.mkdir(parents=True)
    (nested / "a.md").write_text("---\ntype: conversation\n---\n**A** (2024-01-01 9:00 AM): hi\n")
    overlap = cli(
        "ingest", str(tmp_path / "nest"), str(nested / "a.md"), "--no-enqueue", "--json", check=False
    )
    assert overlap.returncode == 1 and as_json(overlap)["ingested"] == ["2024/a"]
    [twice] = as_json(overlap)["errors"]
    assert twice["path"] == str(nested / "a.md") and "the same file as" in twice["reason"]


def run_bytes(cli: Any, args: list[bytes]) -> subprocess.CompletedProcess[bytes]:
    """`factmill` with arguments given as bytes (a terminal in another encoding), in a UTF-8 locale."""
    return subprocess.run(
        [sys.executable.encode(), b"-m", b"worker.cli", *args],
        cwd=REPO,
        env=cli.env | {"LC_ALL": "C.UTF-8"},
        capture_output=True,
        timeout=120,
    )


def test_an_argument_of_bytes_that_are_not_utf8_is_refused_naming_it(cli):
    """A Latin-1 terminal's "café" reaches Python as a lone surrogate, which no query can send: a
    UnicodeEncodeError traceback from `pages erase`, `extract --slug`, `--source-id`."""
    for args in ([b"pages", b"erase", b"default", b"caf\xe9"], [b"extract", b"--source-id", b"\xff"]):
        result = run_bytes(cli, args)
        stderr = result.stderr.decode()
        assert result.returncode == 2 and "Traceback" not in stderr, stderr
        assert "holds bytes that are not UTF-8 text" in stderr and "\\x" in stderr


def test_a_file_named_in_another_encoding_is_ingested_by_its_name_beside_the_others(cli, tmp_path: Path):
    """Named on the command line, a Latin-1 file name refused the whole run (nothing stored, not even
    the good file) with advice that could not work: retyped as UTF-8, it names no file."""
    good = tmp_path / "good.md"
    good.write_text("---\ntype: conversation\n---\n**A** (2024-01-01 9:00 AM): hi\n")
    latin1 = os.path.join(os.fsencode(tmp_path), b"caf\xe9.md")
    with open(latin1, "wb") as named:
        named.write(
            b"---\ntype: conversation\nslug: conversations/cafe\n---\n**A** (2024-01-01 9:00 AM): hi\n"
        )
    args = [
        b"ingest",
        os.fsencode(good),
        latin1,
        os.path.join(os.fsencode(tmp_path), b"gon\xe9.md"),
        b"--json",
        b"--no-enqueue",
    ]
    result = run_bytes(cli, args)
    stderr = result.stderr.decode()
    assert result.returncode == 2 and "Traceback" not in stderr, stderr  # the file that is not there
    assert "argument 4" in stderr and "rename it, or pass its folder" in stderr
    result = run_bytes(cli, [*args[:3], *args[4:]])
    assert result.returncode == 0, result.stderr.decode()
    assert sorted(json.loads(result.stdout)["ingested"]) == ["conversations/cafe", "good"]


def test_messages_are_never_broken_across_lines(cli, tmp_path: Path):
    """The consoles soft-wrap: a long path and its reason stay on one line for people and tests."""
    missing = tmp_path / ("a-long-folder-name-" * 8) / "nope.md"
    result = cli("ingest", str(missing), check=False)
    assert result.returncode == 1 and f"{missing}: no such file or directory" in result.stderr


def test_config_commands_and_the_kill_switch(cli):
    cli("ingest", str(EXAMPLES / "conversations" / "imessage"), "--no-enqueue")
    assert "(not set)" in cli("config", "get", "facts.extraction_enabled").stdout
    cli("config", "set", "facts.extraction_enabled", "off")
    listed = cli("config", "list").stdout
    assert "facts.extraction_enabled" in listed and "off" in listed
    # Every key workers read is listed, a key never set with its default (as GET /v1/config).
    assert [line for line in listed.splitlines() if "llm.prices" in line and "(default)" in line]
    refused = cli("extract", check=False)
    assert refused.returncode == 3 and "facts.extraction_enabled=false" in refused.stderr
    assert "--override-disabled" in refused.stderr
    overridden = as_json(cli("extract", "--override-disabled", "--json"))
    assert overridden["pages_processed"] > 0
    bad = cli("config", "set", "facts.extraction_enabled", "maybe", check=False)
    assert bad.returncode == 2 and "must be one of" in bad.stderr
    # A mistyped key is refused with the one it is close to, not stored while extraction carries on.
    typo = cli("config", "set", "facts.extraction_enable", "on", check=False)
    assert typo.returncode == 2 and "did you mean 'facts.extraction_enabled'?" in typo.stderr
    assert "facts.extraction_enable " not in cli("config", "list").stdout
    unknown = cli("config", "get", "no.such.key", check=False)
    assert unknown.returncode == 2 and "unknown config key 'no.such.key'" in unknown.stderr


def test_config_unset_restores_the_default_and_removes_keys_nothing_reads(cli, factory):
    cli("config", "set", "facts.extraction_enabled", "off")
    with factory.begin() as session:  # a typo stored before keys were checked
        session.add(ConfigEntry(key="facts.extraction_enable", value="false", updated_by="cli"))
    listed = cli("config", "list").stdout
    assert "Nothing reads facts.extraction_enable " in listed and "factmill config unset KEY" in listed

    assert (
        cli("config", "unset", "facts.extraction_enabled").stdout.strip() == "facts.extraction_enabled unset"
    )
    assert "(not set)" in cli("config", "get", "facts.extraction_enabled").stdout
    assert "facts.extraction_enabled was not set" in cli("config", "unset", "facts.extraction_enabled").stdout
    assert "facts.extraction_enable unset" in cli("config", "unset", "facts.extraction_enable").stdout
    assert "Nothing reads" not in cli("config", "list").stdout
    unknown = cli("config", "unset", "facts.extraction_enable", check=False)  # gone, and unknown: refused
    assert unknown.returncode == 2 and "did you mean 'facts.extraction_enabled'?" in unknown.stderr


def usage_error(database_url: str, *args: str) -> str:
    """``factmill ARGS`` in this process, for a usage error (a process of its own costs a second and a
    half of start-up, for what click decides before any command runs): exit 2, no traceback; its output,
    one line per message (Rich wraps to the runner's width)."""
    result = invoke_cli(database_url, *args)
    assert result.exit_code == 2, (args, result.output)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output, args
    return " ".join(result.output.split())


def test_clear_errors_for_bad_options_and_a_missing_schema(cli, server_url, factory, tmp_path: Path):
    url = cli.env["FACTMILL_DATABASE_URL"]
    bad_since = cli("extract", "--since", "yesterday", check=False)  # one through the entry point (main)
    assert bad_since.returncode == 2 and "ISO-8601" in bad_since.stderr
    # A port out of range is a usage error for every server command (flower's was a socket traceback).
    for command in (["serve", "--port", "70000"], ["flower", "--port", "-1"], ["simulator", "--port", "0"]):
        assert "Invalid value for '--port'" in usage_error(url, *command), command
    # Bounds a mistake would pass: `--processes 100000` forked until the machine gave out.
    for command in (
        ["worker", "--processes", "65"],
        ["worker", "--concurrency", "4097"],
        ["demo", "--show", "-1"],
        ["demo", "--concurrency", "257"],
        ["extract", "--batch", "--poll-seconds", "inf"],  # time.sleep(inf): a traceback after paying
        ["extract", "--batch", "--poll-seconds", "0"],  # a tight loop on the provider's status endpoint
    ):
        assert "Invalid value for" in usage_error(url, *command), command
    # A folder with no page was found out after the servers and the API had started, and was said to
    # be "unchanged since the last demo".
    (tmp_path / "no-pages").mkdir()
    empty = cli("demo", "--examples", str(tmp_path / "no-pages"), check=False)
    assert empty.returncode == 1 and "no page files to post in" in empty.stderr, empty.stderr
    assert "API on" not in empty.stderr  # nothing was started
    folder = cli("calibration", "import", str(tmp_path), check=False)
    assert folder.returncode == 2 and "is a directory; give a CSV file" in folder.stderr, folder.stderr
    piped = cli("calibration", "import", "/dev/null", check=False)  # there, but no file: was "no such file"
    assert piped.returncode == 2 and "is not a regular file" in piped.stderr, piped.stderr
    # An id past Postgres's bigint was the database's "bigint out of range" traceback.
    too_big = str(2**63)
    for command in (
        ["jobs", "show", too_big],
        ["jobs", "retry", too_big],
        ["keys", "revoke", too_big],
        ["facts", "unmerge", too_big],
        ["facts", "restore", too_big],
        ["backfill", "show", too_big],
        ["backfill", "cancel", too_big],
        ["calibration", "add", "--coverage", "0.5", "--kept", "--compaction-id", too_big],
        ["transcripts", "show", "t1", "--before-id", too_big],
    ):
        said = usage_error(url, *command)
        assert "Invalid value for" in said and "9223372036854775807" in said, command
    # The API's bound, one rule (the CLI took any bigint).
    over = usage_error(url, "backfill", "--max-segments", "10000001")
    assert "Invalid value for" in over and "10000000" in over
    # An unknown job kind listed nothing, as if there were no such jobs; --status already said so.
    assert "--kind must be one of extraction," in usage_error(url, "jobs", "list", "--kind", "extracton")
    # A source no page can have was a run, a search or a backfill of nothing; now a usage error.
    for command in (
        ["search", "alice", "--source-id", "a|b"],
        ["ingest", "--source-id", " padded", "examples"],
        ["backfill", "--source", "a|b"],
        ["facts", "list", "--slug", "x", "--source-id", ""],
    ):
        assert "is not a source id" in usage_error(url, *command), command
    # An extraction of a source with no page ran as a run of nothing; it still runs, and says why.
    nothing = cli("extract", "--source-id", "no-such-source", check=False)
    assert nothing.returncode == 0 and "no page in source 'no-such-source' to extract" in nothing.stderr
    # Typed to see the subcommands, a bare `backfill` queued a paid backfill of the default source.
    bare = cli("backfill")
    assert "Start one by naming a selection" in " ".join(bare.stdout.split()), bare.stdout
    scripted = cli("backfill", "--json", check=False)
    assert scripted.returncode == 2 and "name a selection to start a backfill" in scripted.stderr
    # The group's options before a command were dropped: the table for `--json list`, every source's
    # backfills for `--source a list`.
    for misplaced, named in (
        (["--json"], "--json"),
        (["--source", "a", "--since", "2026-01-01"], "--source, --since"),
    ):
        refused = cli("backfill", *misplaced, "list", check=False)
        assert refused.returncode == 2 and f"{named} start a backfill; put a command's own" in refused.stderr
    with factory() as session:
        assert session.scalar(text("SELECT count(*) FROM backfills")) == 0
    # A backfill that matches no stored page plans nothing: said so, nothing queued.
    empty = cli("backfill", "--source", "no-such-source", check=False)
    assert empty.returncode == 1 and "in source 'no-such-source': nothing to backfill" in empty.stderr
    # A page that is not there is said so, not answered with a run of nothing.
    missing = cli("extract", "--slug", "no/such/page", check=False)
    assert missing.returncode == 1 and "no page 'no/such/page' in source 'default'" in missing.stderr
    from tests.conftest import fresh_database

    with fresh_database(server_url, "noschema") as empty:
        result = factmill(["extract"], bare_env(FACTMILL_DATABASE_URL=empty))
    assert result.returncode == 1 and "factmill db upgrade" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_setting_out_of_its_range_is_one_line_naming_the_variable_not_its_value():
    """A FACTMILL_ variable a setting refuses was pydantic's traceback, on every command."""
    env = bare_env(FACTMILL_JOB_MAX_ATTEMPTS="0", FACTMILL_DB_POOL_SIZE="hunter2")
    result = factmill(["jobs", "list"], env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "error: invalid setting: " in result.stderr
    assert "FACTMILL_JOB_MAX_ATTEMPTS: Input should be greater than or equal to 1" in result.stderr
    assert "FACTMILL_DB_POOL_SIZE: Input should be a valid integer" in result.stderr
    assert "hunter2" not in result.stderr


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://u:hunter2@db:${PORT}/x", "is not a database URL: expected postgresql://"),
        ("postgresq://u:hunter2@db/x", "must be a Postgres URL"),
        ("postgresql://u:p@hunter2@db/x", "holds an '@' after its credentials: percent-encode"),
        ("postgresql://u:p@hunter2/w@db/x", "holds an '@' after its credentials: percent-encode"),
        ("postgresql://u:hunter2@db:99999/x", "names port 99999: a port is 1 to 65535"),
        ("postgresql+asyncpg://u:hunter2@db/x", "names the asyncpg driver; Factmill connects with psycopg"),
    ],
)
def test_a_database_url_that_does_not_parse_is_one_line_that_never_quotes_it(url: str, says: str):
    """A port left as a template, a misspelt scheme: a traceback from the first command. An unescaped
    '@' in the password made the host "hunter2@db", which the connection error printed."""
    result = factmill(["jobs", "list"], bare_env(FACTMILL_DATABASE_URL=url))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"FACTMILL_DATABASE_URL: {says}" in result.stderr and result.stderr.count("\n") == 1
    assert "hunter2" not in result.stderr


def test_database_urls_sqlalchemy_reads_are_not_refused():
    """The check reads a URL as SQLAlchemy does: a password with '/' or '?' (base64 secrets have them),
    a user with '@', a socket folder, an IPv6 host all pass."""
    from worker.db import url_problem

    for url in (
        "postgresql+psycopg://fm:Zx9/Qw+r?x#y@db:5432/factmill",
        "postgresql://admin@srv:pw@db/app",
        "postgresql+psycopg://fm@/factmill?host=/var/run/postgresql",
        "postgresql+psycopg://fm:pw@[::1]:5432/factmill",
        "postgresql+psycopg://fm:p%40ss@db/factmill",
        "postgresql+psycopg://fm:pw@db/x%40y",
    ):
        assert url_problem(url) is None, url


def test_a_database_that_cannot_be_reached_is_one_line_for_every_command():
    """A refused connection was SQLAlchemy's traceback on most commands (search alone said so, on
    three lines with a link)."""
    env = bare_env(FACTMILL_DATABASE_URL="postgresql+psycopg://factmill:pw-not-shown@127.0.0.1:1/factmill")
    # A command through the shared schema check, and one that connects on its own: the exit is one place.
    for command in (["jobs", "list"], ["db", "upgrade"]):
        result = factmill(command, env)
        assert result.returncode == 1 and "Traceback" not in result.stderr, (command, result.stderr)
        assert result.stderr.startswith("error: cannot reach the database: connection to server at"), command
        assert "Connection refused" in result.stderr and result.stderr.count("\n") == 1, command
        assert "pw-not-shown" not in result.stderr


def test_an_unknown_loglevel_is_one_line_and_exit_2_before_any_wait():
    """`worker --loglevel verbose` was a traceback from the logging setup (one per child process), after
    a wait for the database."""
    env = bare_env(FACTMILL_DATABASE_URL="postgresql+psycopg://127.0.0.1:1/none")
    for command in (["worker", "--processes", "2"], ["beat"]):
        result = factmill([*command, "--loglevel", "verbose"], env, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr)
        assert (
            "--loglevel must be one of debug, info, warning, error, critical, not 'verbose'" in result.stderr
        )


def test_flower_beyond_this_host_needs_a_login_in_production():
    """Flower shows every task, worker and queue; it listened on every address with no login."""
    env = bare_env(FACTMILL_ENVIRONMENT="production", FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
    for host in ("0.0.0.0",):  # which hosts are this one: tests/unit/test_flower_login.py
        result = factmill(["flower", "--host", host, "--port", "1"], env)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (host, result.stderr)
        assert f"Flower on {host} would show every task, worker and queue" in result.stderr
        assert "set FLOWER_BASIC_AUTH=user:password (or FLOWER_AUTH), or listen on 127.0.0.1" in result.stderr


def test_a_migrate_or_flower_with_no_server_set_is_refused_in_production(tmp_path: Path):
    """A migrate Job whose Secret missed FACTMILL_DATABASE_URL migrated a throwaway embedded Postgres
    and succeeded; Flower without FACTMILL_BROKER_URL watched an empty Redis of its own."""
    env = bare_env(FACTMILL_ENVIRONMENT="production", FACTMILL_DATA_DIR=str(tmp_path / "var"))
    refused = (
        (["db", "upgrade"], "DATABASE_URL"),
        (["flower"], "BROKER_URL"),
        (["jobs", "list"], "DATABASE_URL"),
    )
    for command, unset in refused:
        result = factmill(command, env)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr)
        assert f"FACTMILL_{unset} is not set: production runs on real servers" in result.stderr
    assert not (tmp_path / "var").exists()  # no embedded server was started


def test_the_demo_refuses_to_run_in_production(tmp_path: Path):
    """`factmill demo` with a production .env upgraded that database, posted its 23 example pages into
    its default source and started a worker on its queues (taking real jobs, with real LLM spend)."""
    env = bare_env(
        FACTMILL_ENVIRONMENT="production",
        FACTMILL_DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:1/prod",
        FACTMILL_BROKER_URL="redis://127.0.0.1:1/0",
        FACTMILL_DATA_DIR=str(tmp_path / "var"),
    )
    result = run_main(["demo"], env)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "the demo does not run with FACTMILL_ENVIRONMENT=production" in result.stderr
    assert not (tmp_path / "var").exists()  # nothing started


def test_costs_on_the_embedded_default_prints_no_library_warning(tmp_path: Path):
    """No library warning reaches the terminal: importing pgserver made platformdirs warn that
    XDG_RUNTIME_DIR is unset (as in containers and CI) on every command using the embedded Postgres."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_") and k != "XDG_RUNTIME_DIR"}
    env["FACTMILL_DATA_DIR"] = str(tmp_path / "var")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return factmill(list(args), env, timeout=240)

    try:
        upgraded = run("db", "upgrade")
        assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
        result = run("costs")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "LLM spend since" in result.stdout
        assert "Warning" not in result.stderr, result.stderr
    finally:
        run("db", "stop")


def test_keys_create_list_revoke_and_the_key_works_until_revoked(cli, factory, database_url):
    from fastapi.testclient import TestClient

    from tests.integration.test_api import Recorder, make_runtime
    from worker.api.app import create_app

    created = cli("keys", "create", "tenant-a", "--scope", "read", "--source", "a")
    key = created.stdout.strip()
    assert key.startswith("fm_") and len(key) > 40 and "not shown again" in created.stderr
    listed = cli("keys", "list", "--json").stdout
    [row] = [r for r in json.loads(listed) if r["name"] == "tenant-a"]
    assert key not in listed and key not in cli("keys", "list").stdout  # only prefixes, never the key
    assert key.startswith(row["prefix"]) and row["scopes"] == ["read"] and row["source_ids"] == ["a"]
    with TestClient(create_app(make_runtime(database_url, factory), sender=Recorder(factory))) as api:
        assert api.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert "revoked" in cli("keys", "revoke", str(row["id"])).stdout
        assert json.loads(cli("keys", "list", "--json").stdout)[-1]["revoked_at"] is not None
        assert api.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    bad = cli("keys", "create", "x", "--scope", "write", check=False)
    assert bad.returncode == 2 and "unknown scope" in bad.stderr
    assert cli("keys", "revoke", "999999", check=False).returncode == 2


def test_jobs_show_and_list_print_both_budgets(cli, factory):
    from sqlalchemy import update

    from models import Job
    from worker.jobs.outbox import EXTRACTION, request_job

    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, "default|conversations/budgets").job_id
        session.execute(
            update(Job).where(Job.id == job_id).values(status="failed", attempts=2, worker_losses=20)
        )
    shown = as_json(cli("jobs", "show", str(job_id)))
    assert (shown["status"], shown["attempts"], shown["worker_losses"]) == ("failed", 2, 20)
    listed = as_json(cli("jobs", "list", "--json"))
    assert [(j["id"], j["attempts"], j["worker_losses"]) for j in listed] == [(job_id, 2, 20)]
    table = cli("jobs", "list").stdout
    assert "worker" in table and "losses" in table  # the header (the table wraps it)


def test_a_model_that_cannot_be_used_is_one_line_on_every_command_that_calls_one(database_url):
    """`FACTMILL_LLM=openai` without its key, or production with no key (where the simulator must be
    named to stand in), ended `search`, `compact --now` and `embed` in a traceback. A plain search
    needs no model: it answers lexically, says why in its notes, and the log names the setting once."""
    production = {
        "FACTMILL_ENVIRONMENT": "production",
        "FACTMILL_WEBHOOK_SECRET": "w" * 40,
        "FACTMILL_ADMIN_TOKEN": "a" * 40,
    }
    cases = [
        ({"FACTMILL_LLM": "openai"}, "FACTMILL_LLM=openai needs OPENAI_API_KEY"),
        (production, "no LLM API key: set OPENAI_API_KEY or ANTHROPIC_API_KEY (or FACTMILL_LLM=simulator"),
    ]
    for values, says in cases:
        env = bare_env(FACTMILL_DATABASE_URL=database_url, **values)
        env = {k: v for k, v in env.items() if k not in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")}
        searched = factmill(["search", "alice"], env)
        assert searched.returncode == 0 and "Traceback" not in searched.stderr, searched.stderr
        assert searched.stderr.count(says) == 1, searched.stderr
        assert "note: query expansion skipped: the LLM settings are incomplete" in searched.stderr
        vector = factmill(["search", "vec: alice"], env)  # a line that needs the model: unavailable
        assert vector.returncode == 3 and "Traceback" not in vector.stderr, vector.stderr
        assert says in vector.stderr and "vector search unavailable" in vector.stderr, vector.stderr
        for command in (["compact", "t1", "--now"], ["embed"]):
            result = factmill(command, env)
            assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr)
            assert result.stderr.startswith(f"error: {says}"), (command, result.stderr)
            assert result.stderr.count("\n") == 1, (command, result.stderr)


def test_a_calibration_import_shows_its_progress_on_a_terminal(cli, tmp_path: Path):
    """It printed nothing until every row was stored; the bar is on stderr, and only on a terminal."""
    path = tmp_path / "many.csv"
    path.write_text("".join(f"0.{n % 10},{'true' if n % 3 else 'false'},eval\n" for n in range(3000)))
    env = dict(cli.env)
    leader, follower = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "worker.cli", "calibration", "import", str(path), "--no-enqueue"],
            cwd=REPO,
            env=env | {"COLUMNS": "100"},
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=120,
        )
        os.close(follower)
        screen = b""
        while chunk := _read_available(leader):
            screen += chunk
    finally:
        os.close(leader)
    assert result.returncode == 0 and "3000 row(s): 3000 added" in result.stdout, result.stdout
    assert b"observations stored" in screen
    piped = cli("calibration", "import", str(path), "--no-enqueue")
    assert "observations stored" not in piped.stderr  # a script's log stays clean


def _read_available(fd: int) -> bytes:
    ready, _, _ = select.select([fd], [], [], 0.5)
    try:
        return os.read(fd, 65536) if ready else b""
    except OSError:  # EIO: the other side is closed and drained
        return b""


def test_a_database_that_fails_during_a_command_is_one_line_not_a_traceback(cli, factory):
    """Connected, then the server shut down or ran out of disk mid-command (57P01, 53100): only a
    connection that never opened was told in one line; this was a full traceback with the SQL."""
    with factory.begin() as session:
        session.execute(
            text(
                "CREATE FUNCTION pg_temp_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
                " RAISE EXCEPTION 'could not extend file: No space left on device' USING ERRCODE = '53100';"
                " END $$"
            )
        )
    try:
        with factory.begin() as session:
            session.execute(
                text(
                    "CREATE TRIGGER disk_full BEFORE INSERT OR UPDATE ON config"
                    " FOR EACH ROW EXECUTE FUNCTION pg_temp_disk_full()"
                )
            )
        ran = cli("config", "set", "facts.extraction_enabled", "false", check=False)
    finally:
        with factory.begin() as session:
            session.execute(text("DROP TRIGGER IF EXISTS disk_full ON config"))
            session.execute(text("DROP FUNCTION IF EXISTS pg_temp_disk_full()"))
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "the database failed during the command" in ran.stderr and "SQLSTATE 53100" in ran.stderr
    assert "Traceback" not in ran.stderr and "INSERT" not in ran.stderr


def test_a_terminal_that_is_not_utf8_gets_escapes_not_a_traceback_after_the_commit(cli, cli_process):
    """`keys revoke` in a Latin-1 terminal revoked the key, then died printing "…" (a traceback, exit
    1: a script read that the revoke failed); JSON holding a name Latin-1 cannot write died too."""
    cli("keys", "create", "事实-reader", "--scope", "read")
    latin1 = {**cli_process.env, "PYTHONIOENCODING": "latin-1"}
    listed = factmill(["keys", "list", "--json"], latin1, timeout=120)
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert row["name"] == "事实-reader"
    revoked = factmill(["keys", "revoke", str(row["id"])], latin1, timeout=120)
    assert revoked.returncode == 0 and "Traceback" not in revoked.stderr, revoked.stderr
    assert "revoked" in revoked.stdout and "\\u2026" in revoked.stdout


def test_services_on_a_database_server_with_the_embedded_broker_say_where_their_jobs_go(
    cli, database_url, monkeypatch, tmp_path
):
    """Each folder a service (or `ingest`) ran from started an embedded Redis of its own, unsaid: jobs
    queued there waited for the sweeper to take them for lost, or for good where beat ran elsewhere."""
    from tests.cli import run_main
    from worker.cli import services

    monkeypatch.setattr(services, "celery_exit_code", lambda argv: 0)
    said = cli("beat").stderr
    assert "FACTMILL_BROKER_URL is not" not in said  # both set: nothing to say
    unbrokered = {k: v for k, v in cli.env.items() if k != "FACTMILL_BROKER_URL"}
    for command in (["beat"], ["worker", "--processes", "1"]):
        said = run_main(command, unbrokered).stderr
        assert "FACTMILL_BROKER_URL is not: jobs go through the embedded Redis under" in " ".join(
            said.split()
        )
    # Said by a worker's parent only (each of its processes said it again), and not where the data folder
    # is absolute: shared on purpose, as README says to.
    assert (
        "FACTMILL_BROKER_URL is not"
        not in run_main(["worker", "--processes", "1", "--child"], unbrokered).stderr
    )
    shared = unbrokered | {"FACTMILL_DATA_DIR": str(tmp_path)}
    assert "FACTMILL_BROKER_URL is not" not in run_main(["beat"], shared).stderr
    children: list[list[str]] = []
    monkeypatch.setattr(services, "run_children", lambda argvs, grace: children.extend(argvs) or 0)
    for pool in ("threads", "prefork"):
        said = run_main(["worker", "--processes", "2", "--pool", pool], unbrokered).stderr
        assert said.count("FACTMILL_BROKER_URL is not") == 1, said  # by the parent
    assert len(children) == 4 and all("--child" in argv for argv in children), children


def test_a_worker_on_the_embedded_postgres_runs_one_process_unless_told(cli, monkeypatch):
    """One per core, each at 64 job threads (about 40 connections apiece), passed the embedded server's
    100 connections on a laptop of four cores: "too many clients", taken for an outage, stalled every job."""
    from tests.cli import run_main
    from worker.cli import processes, services

    monkeypatch.setattr(processes, "default_processes", lambda: 4)
    # The command itself: no database URL is the embedded server (not started here: the schema check is
    # the next test's), one process; with a server's URL, one per core.
    monkeypatch.setattr(services, "checked_factory", lambda settings, wait: None)
    ran: list[list[str]] = []
    children: list[list[str]] = []
    monkeypatch.setattr(services, "celery_exit_code", lambda argv: ran.append(argv) or 0)
    monkeypatch.setattr(services, "run_children", lambda argvs, grace: children.extend(argvs) or 0)
    embedded = {key: value for key, value in cli.env.items() if key != "FACTMILL_DATABASE_URL"}
    assert run_main(["worker"], embedded).returncode == 0
    assert (len(ran), children) == (1, [])
    assert run_main(["worker"], cli.env).returncode == 0
    assert (len(ran), len(children)) == (1, 4)
    assert processes.worker_processes(None, "threads", embedded_database=True) == 1
    assert processes.worker_processes(None, "threads", embedded_database=False) == 4
    assert processes.worker_processes(3, "threads", embedded_database=True) == 3
    assert processes.worker_processes(None, "prefork", embedded_database=False) == 1  # it forks its own


def test_a_prefork_worker_forks_one_child_per_core_by_default_not_one_per_llm_call(cli, monkeypatch):
    """-c is child processes under prefork; its default was FACTMILL_LLM_CONCURRENCY (64 processes, each
    with its own pools and LLM pipe), and --concurrency let 4,096 be forked past --processes' cap."""
    from worker.cli import services

    asked: list[list[str]] = []
    monkeypatch.setattr(services, "celery_exit_code", lambda argv: asked.append(argv) or 0)
    cli("worker", "--pool", "prefork", "--processes", "1")
    cli("worker", "--pool", "threads", "--processes", "1")
    prefork, threads = (argv[argv.index("-c") + 1] for argv in asked)
    assert (prefork, threads) == (str(services.default_processes()), "64")
    many = cli("worker", "--pool", "prefork", "--processes", "1", "--concurrency", "1000", check=False)
    assert many.returncode == 2 and "at most 64 processes" in many.stderr and len(asked) == 2


def test_serve_in_production_says_the_older_signatures_are_on_unless_chosen(capsys):
    """v2 and v3 are on by default (senders that predate v4), and nothing said so in production: a
    captured v3 delivery verifies for another transcript id, an unkeyed v2 one may be stored twice."""
    from worker.cli.services import warn_of_unchosen_legacy_signatures
    from worker.settings import Settings

    warn_of_unchosen_legacy_signatures(Settings(environment="production"))
    said = " ".join(capsys.readouterr().err.split())
    assert "FACTMILL_ACCEPT_V2_SIGNATURES and FACTMILL_ACCEPT_V3_SIGNATURES accept the older" in said, said
    warn_of_unchosen_legacy_signatures(Settings(environment="production", accept_v2_signatures=False))
    said = " ".join(capsys.readouterr().err.split())
    assert "FACTMILL_ACCEPT_V3_SIGNATURES accepts the older" in said and "V2" not in said, said
    for chosen in (
        Settings(environment="production", accept_v2_signatures=True, accept_v3_signatures=False),
        Settings(environment="test"),
    ):
        warn_of_unchosen_legacy_signatures(chosen)
        assert capsys.readouterr().err == ""
