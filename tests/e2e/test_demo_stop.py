"""`factmill demo` stops what it started however it is stopped: a signal, or killed outright."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.service import free_port

REPO = Path(__file__).resolve().parents[2]

# What the demo does with each of its API, worker and beat processes, with one quick child instead.
DEMO_CHILD = """
import os, sys, time
from pathlib import Path
from worker.cli.demo import child
from worker.cli.processes import stopped_by_signals
args = ["simulator", "--port", sys.argv[1]]
with stopped_by_signals(), child("simulator", args, dict(os.environ), Path(sys.argv[2])) as c:
    os.write(1, f"{c.proc.pid}\\n".encode())
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's"
)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name)
def test_the_demos_processes_stop_with_it(tmp_path: Path, stop: signal.Signals) -> None:
    """A `kill`, a CI cancel or a closed terminal ended the demo with no clean-up (no handler), and its
    API, worker and beat (each in a session of its own, so no hangup reached them) ran on."""
    demo = subprocess.Popen(
        [sys.executable, "-c", DEMO_CHILD, str(free_port()), str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    pid = None
    try:
        assert demo.stdout is not None
        pid = int(demo.stdout.readline())
        time.sleep(0.5)  # the child is past its start
        demo.send_signal(stop)
        demo.wait(timeout=30)
        deadline = time.monotonic() + 20
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid), f"the demo's child {pid} outlived it ({stop.name})"
    finally:
        for target in (demo.pid, pid):
            if target is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(target, signal.SIGKILL)


def test_the_demos_worker_is_one_process_its_stop_reaches() -> None:
    """Without --processes the worker started one child per core, each in a process group of its own:
    the demo's stop (killpg on the worker's group, SIGKILL after 15 s) left them running on the
    embedded servers after the demo had returned."""
    from worker.cli.demo import _worker_args

    args = _worker_args(16)
    assert args[args.index("--processes") + 1] == "1"
