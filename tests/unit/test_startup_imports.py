"""What a `factmill` process loads at start: the provider SDKs and the MCP server take seconds to import
(about 4.5 s of the CLI's 6.5 s on a 2-core CI machine), so only the code that uses one loads it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("openai", "anthropic", "mcp", "worker.simulator", "httpx2")  # httpx2: the SDKs' own httpx


def _python(code: str, **env: str) -> str:
    """What ``code`` prints, run by a fresh interpreter in the repository (it must exit 0)."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def _loaded_after(code: str) -> list[str]:
    """The HEAVY modules in sys.modules after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    return list(json.loads(_python(probe).strip().splitlines()[-1]))


def test_the_cli_the_api_and_the_task_modules_load_no_sdk_and_no_mcp_server() -> None:
    assert _loaded_after("import worker.cli, worker.api.app, tasks, worker.runtime") == []


def test_importing_the_task_modules_leaves_the_celery_app_unconfigured() -> None:
    """Configuring it reads the settings and may start the embedded broker: the tasks beat sends made
    every import of their modules (the API's, with tracing on) do that."""
    code = (
        "import tasks.maintenance, tasks.backfill, tasks.calibration, tasks.extraction\n"
        "from worker.jobs.celery_app import app\n"
        "print(app.configured)"
    )
    assert _python(code).strip().splitlines()[-1] == "False"


def test_a_client_loads_only_its_own_sdk() -> None:
    code = (
        "from worker.llm.openai_compat import OpenAIChatClient\n"
        "OpenAIChatClient(model='m', base_url='http://127.0.0.1:9/v1', keep_alive=500)"
    )
    assert _loaded_after(code) == ["openai", "httpx2"]
    code = (
        "from worker.llm.anthropic_provider import AnthropicChatClient\n"
        "AnthropicChatClient(model='m', base_url='http://127.0.0.1:9', keep_alive=500)"
    )
    assert _loaded_after(code) == ["anthropic", "httpx2"]


def test_errors_of_the_loaded_sdk_are_classified_without_loading_the_other() -> None:
    code = (
        "import httpx, openai\n"
        "from worker.llm.errors import classify\n"
        "request = httpx.Request('POST', 'http://127.0.0.1:9/v1/chat/completions')\n"
        "response = httpx.Response(503, request=request, headers={'retry-after': '2'})\n"
        "c = classify(openai.InternalServerError('down', response=response, body=None))\n"
        "assert (c.retryable, c.status, c.retry_after) == (True, 503, 2.0), c\n"
        "assert classify(openai.APITimeoutError(request=request)).retryable\n"
        "bad = httpx.Response(400, request=request)\n"
        "c = classify(openai.BadRequestError('no', response=bad, body=None))\n"
        "assert (c.retryable, c.status) == (False, 400), c\n"
        "assert not classify(ValueError('x')).retryable\n"
        "import httpx2\n"  # a raw transport error of the SDKs' httpx, escaped from its wrapper
        "assert classify(httpx2.ReadTimeout('slow')).retryable\n"
        "assert classify(httpx2.ConnectError('refused')).retryable"
    )
    assert _loaded_after(code) == ["openai", "httpx2"]


def _modules_after_cli(*args: str) -> set[str]:
    """The modules loaded by a fresh interpreter after ``factmill ARGS`` (it exits 0)."""
    code = (
        f"import sys\nsys.argv = ['factmill', *{list(args)!r}]\nfrom worker.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "import json\nprint(json.dumps(sorted(sys.modules)))"
    )
    return set(json.loads(_python(code).strip().splitlines()[-1]))


def test_a_command_loads_its_own_module_and_not_the_others() -> None:
    from worker.cli.app import COMMANDS

    loaded = _modules_after_cli("simulator", "--help")
    assert "worker.cli.simulator" in loaded
    others = {entry.module for entry in COMMANDS} - {"worker.cli.simulator"}
    assert not others & loaded
    # What the other commands' services bring: none of it is needed to run the simulator.
    assert not {"sqlalchemy", "celery", "worker.extraction", "worker.jobs"} & loaded


def test_every_listed_command_loads_under_its_name_with_its_help() -> None:
    from worker.cli.app import COMMANDS, load_command

    for entry in COMMANDS:
        command = load_command(entry)
        assert command.name == entry.name
        assert command.help, f"`factmill {entry.name}` has no help"
        # `factmill --help` lists the summary beside the entry: it must say what the command's help says.
        assert inspect.cleandoc(command.help).split("\n\n")[0] == entry.summary, entry.name
    assert len({entry.name for entry in COMMANDS}) == len(COMMANDS)


def test_the_help_lists_every_command_by_its_summary_without_loading_one() -> None:
    """Loading every command module to list them took `factmill --help` 2.3 s on this machine."""
    from worker.cli.app import COMMANDS

    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom worker.cli import app\n"
        "result = CliRunner().invoke(app, ['--help'])\n"
        "print(result.exit_code, sorted(m for m in sys.modules if m.startswith('worker.cli.')))\n"
        "print(result.output)"
    )
    first, output = _python(code, COLUMNS="300").split("\n", 1)
    assert first == "0 ['worker.cli.app']"
    for entry in COMMANDS:
        assert f"{entry.name} " in output and entry.summary in output, entry.name


def _commands_under(command: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands_under(sub, f"{path} {name}")


def test_every_command_s_summary_is_one_line_so_help_never_breaks_it() -> None:
    """Rich help keeps a docstring's line breaks: a summary wrapped in the source showed up broken
    mid-sentence in `factmill --help` (costs, worker, demo) and in its group's list."""
    from worker.cli.app import COMMANDS, load_command

    wrapped = []
    for entry in COMMANDS:
        for path, command in _commands_under(load_command(entry), f"factmill {entry.name}"):
            summary = inspect.cleandoc(command.help or "").split("\n\n")[0]
            if "\n" in summary:
                wrapped.append(path)
    assert wrapped == [], f"first paragraph of the docstring spans lines: {wrapped}"


def test_a_mistyped_command_is_answered_with_the_name_it_is_close_to() -> None:
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom worker.cli import app\n"
        "result = CliRunner().invoke(app, ['jbos', 'list'])\n"
        "print(result.exit_code, 'worker.cli.jobs' in sys.modules)\nprint(result.output)"
    )
    # Wide, so the error box never breaks the message.
    first, output = _python(code, COLUMNS="200").split("\n", 1)
    assert first == "2 False"  # a usage error, and no command module was loaded to say so
    assert "No such command 'jbos'" in output and "Did you mean 'jobs'?" in output
