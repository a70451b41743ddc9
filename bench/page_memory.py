"""Peak memory of a worker process whose jobs hold parsed pages, with the page budget and without it.

    .venv/bin/python bench/page_memory.py [--jobs 64] [--page-mib 4] [--hold-seconds 20]

Each of ``--jobs`` threads does what an extraction job does with its page: reads its body (a copy of
its own), parses it (worker.core.conversation), lets the body go and holds the messages while its
segments would be sent (``--hold-seconds``: a page of thousands of segments is held for minutes at real
latencies; parsing is serial under the GIL, so with holds shorter than the parses few pages are held
at once whatever the budget). Both runs are child processes of this one, so each peak
(ru_maxrss) is its own: the baseline with no budget (FACTMILL_EXTRACTION_PAGE_BYTES_HELD=0, every job's
page held at once), then the default budget (128 MiB of bodies), on the same generated page.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from parse_segment import generate_page  # noqa: E402

from tests.service import stop_cleanly_on_termination  # noqa: E402
from worker.core.conversation import parse_conversation_messages  # noqa: E402
from worker.runtime.page_memory import PageMemory  # noqa: E402
from worker.settings import Settings  # noqa: E402

MIB = 1024 * 1024


def child(capacity: int, jobs: int, page_mib: float, hold_seconds: float) -> dict[str, float]:
    # Cut to the size asked (the generator ends past it on a whole line): 4.0 MiB and 26 bytes let 31
    # pages into 128 MiB, not 32, and ran the budgeted jobs in three waves.
    page = generate_page(page_mib).encode()[: int(page_mib * MIB)].decode(errors="ignore")
    size = len(page.encode())
    memory = PageMemory(capacity)
    parsed: list[int] = []

    def job() -> None:
        with memory.holding(size):
            body = page + " "  # its own copy, as each job reads its page from the database
            messages = parse_conversation_messages(body)
            del body
            parsed.append(len(messages))
            time.sleep(hold_seconds)  # its segments in flight
            del messages

    started = time.perf_counter()
    threads = [threading.Thread(target=job) for _ in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    assert len(parsed) == jobs and len(set(parsed)) == 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"peak_mib": peak / MIB, "wall_s": wall, "page_mib": size / MIB, "messages": parsed[0]}


def run_child(capacity: int, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", str(capacity)]
    command += [
        "--jobs",
        str(args.jobs),
        "--page-mib",
        str(args.page_mib),
        "--hold-seconds",
        str(args.hold_seconds),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--jobs", type=int, default=64, help="pages worked on at once (the worker's --concurrency)"
    )
    parser.add_argument("--page-mib", type=float, default=4.0)
    parser.add_argument(
        "--hold-seconds", type=float, default=20.0, help="how long a job holds its parsed page (its calls)"
    )
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.jobs < 1 or args.page_mib <= 0 or args.hold_seconds < 0:
        parser.error("--jobs must be at least 1, --page-mib above 0 and --hold-seconds 0 or more")
    if args.child is not None:
        print(json.dumps(child(args.child, args.jobs, args.page_mib, args.hold_seconds)))
        return
    budget = Settings().extraction_page_bytes_held
    baseline = run_child(0, args)
    held = run_child(budget, args)
    print(
        f"{args.jobs} jobs on a {baseline['page_mib']:.1f} MiB page ({int(baseline['messages']):,} "
        f"messages), each held {args.hold_seconds:g} s after its parse"
    )
    print(f"{'run':32} {'peak RSS':>10} {'wall':>8}")
    print(f"{'no budget (baseline)':32} {baseline['peak_mib']:>6.0f} MiB {baseline['wall_s']:>6.1f} s")
    at_once = budget // int(baseline["page_mib"] * MIB)
    print(f"the budget holds {at_once} of these pages at once: {-(-args.jobs // at_once)} wave(s) of holds")
    label = f"budget {budget / MIB:.0f} MiB of bodies"
    print(f"{label:32} {held['peak_mib']:>6.0f} MiB {held['wall_s']:>6.1f} s")
    print(
        f"peak {held['peak_mib'] / baseline['peak_mib']:.2f}x the baseline's, "
        f"wall {held['wall_s'] / baseline['wall_s']:.2f}x"
    )


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
