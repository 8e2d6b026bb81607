"""The flake hunt: the suite on a loaded machine, again and again, and a tally of what failed.

    python -m tests.flake_hunt [--suite-runs 3] [--demo-run 2] [--repeat 10] [--burn-core 1]
    make flake-hunt HUNT_ARGS="..."

Users' and CI's machines are not quiet, so a test that passes only on a quiet one is a defect.
For the whole hunt a CPU burner holds one core (`--burn-core`; pinned there, so the suite and
the burner share it and the other core); then:

1. `--suite-runs` runs of the whole suite, as `make unit` runs it (pytest -q); during run number
   `--demo-run`, `make demo` (real vLLM P and D, pinned to both cores) runs beside it, again and
   again, until the suite is done;
2. `--repeat` runs of each module whose tests wait on processes, signals, timers or Redis
   failovers (found by what its source does: starts or kills processes, sends signals, fails a
   Redis over; `--module` to name them instead). Their tests that need real vLLM are left to
   the suite runs unless `--repeat-vllm`.

Every run keeps its output and JUnit XML; `summary.json` holds the tally: runs, load, and every
failure with its test id and log. Exit status 1 when anything failed. A run takes about 20 min
on two cores; the defaults take a few hours: narrow them with the flags.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ROOT / ".venv" / "bin" / "pytest"
# What makes a module's tests wait on the world rather than on their own code.
WAITS = re.compile(
    r"create_subprocess_exec|subprocess\.(?:run|Popen)|send_signal|os\.kill|tgkill|\.kill\(\)"
    r"|signal\.SIG|failover"
)


@dataclass
class Run:
    name: str
    command: list[str]
    returncode: int = 0
    seconds: float = 0.0
    log: str = ""
    tests: int = 0
    failures: list[str] = field(default_factory=list)
    demo_runs: int = 0


def waiting_modules() -> list[str]:
    return [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if WAITS.search(path.read_text())
    ]


@contextlib.contextmanager
def burner(core: int) -> Iterator[None]:
    """A process spinning on `core` for as long as the block runs."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"],
    )
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def demo_beside(log: Path) -> Iterator[list[int]]:
    """`make demo` again and again until the block ends; yields [demo runs finished]."""
    count = [0]
    stop = False
    procs: list[subprocess.Popen[bytes]] = []

    def loop() -> None:
        with log.open("ab") as out:
            while not stop:
                proc = subprocess.Popen(
                    ["make", "-s", "demo"],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                procs.append(proc)
                proc.wait()
                count[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop = True
        for proc in procs:
            if proc.poll() is None:  # the demo stops its engines on SIGTERM; what is left, KILL
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=120)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        thread.join(timeout=130)


def failures_of(junit: Path) -> tuple[int, list[str]]:
    """(tests run, ids of those that failed or errored) from a JUnit XML report."""
    if not junit.exists():
        return 0, []
    tests, failed = 0, []
    for case in ET.parse(junit).iter("testcase"):
        tests += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return tests, failed


def run_pytest(out: Path, name: str, args: list[str]) -> Run:
    junit = out / f"{name}.xml"
    log = out / f"{name}.log"
    command = [str(PYTEST), "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    started = time.monotonic()
    with log.open("wb") as sink:
        returncode = subprocess.call(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    run = Run(name, command, returncode, round(time.monotonic() - started, 1), str(log))
    run.tests, run.failures = failures_of(junit)
    if returncode not in (0, 5) and not run.failures:  # a crash or a collection error
        run.failures = [f"(pytest exited {returncode}: see {log})"]
    return run


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="flake_hunt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite-runs", type=int, default=3)
    ap.add_argument(
        "--demo-run", type=int, default=2, help="the suite run with make demo beside it (0: none)"
    )
    ap.add_argument("--repeat", type=int, default=10, help="runs of each waiting module")
    ap.add_argument(
        "--module", action="append", default=[], help="repeat these instead of the waiting modules"
    )
    ap.add_argument(
        "--repeat-vllm", action="store_true", help="repeat the waiting modules that need vLLM too"
    )
    ap.add_argument("--burn-core", type=int, default=1, help="the core the burner holds (-1: no burner)")
    ap.add_argument("--out", type=Path, default=ROOT / ".run" / "flake-hunt" / time.strftime("%Y%m%dT%H%M%S"))
    ap.add_argument("pytest_args", nargs="*", help="passed to every pytest run (after --)")
    args = ap.parse_args(argv)
    # Started in the background by a shell, this process ignores SIGINT and its children would
    # too: the suite's tests that send SIGINT must meet what a terminal gives them.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A hunt stopped with SIGTERM stops what it started too (make demo's engines and the burner
    # by their process groups, in the blocks' `finally`), rather than leaving them running.
    signal.signal(signal.SIGTERM, _stopped)

    args.out.mkdir(parents=True, exist_ok=True)
    modules = args.module or waiting_modules()
    # The tests that need real vLLM (marked from their fixtures) take minutes: the suite runs have them.
    only = [] if args.repeat_vllm else ["-m", "not vllm"]
    summary: dict[str, object] = {
        "load": f"a CPU burner pinned to core {args.burn_core}" if args.burn_core >= 0 else "none",
        "cores": os.cpu_count(),
        "demo_beside_suite_run": args.demo_run or None,
        "repeated_modules": modules,
        "runs": [],
    }
    runs: list[Run] = []

    def record(run: Run) -> None:
        runs.append(run)
        summary["runs"] = [asdict(r) for r in runs]
        summary["failures"] = [f"{r.name}: {f}" for r in runs for f in r.failures]
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        verdict = "ok" if not run.failures else f"{len(run.failures)} FAILED"
        print(f"[flake-hunt] {run.name}: {run.tests} tests, {verdict}, {run.seconds} s", flush=True)
        for failure in run.failures:
            print(f"[flake-hunt]   {failure}", flush=True)

    load = burner(args.burn_core) if args.burn_core >= 0 else contextlib.nullcontext()
    with load:
        for i in range(1, args.suite_runs + 1):
            name = f"suite-{i}"
            if i == args.demo_run:
                with demo_beside(args.out / f"{name}-demo.log") as demos:
                    run = run_pytest(args.out, name, args.pytest_args)
                run.demo_runs = demos[0]
            else:
                run = run_pytest(args.out, name, args.pytest_args)
            record(run)
        for i in range(1, args.repeat + 1):
            if modules:
                record(run_pytest(args.out, f"waiting-{i}", [*only, *modules, *args.pytest_args]))

    failures = [f for r in runs for f in r.failures]
    print(
        f"[flake-hunt] {len(runs)} runs, {sum(r.tests for r in runs)} tests, "
        f"{len(failures)} failures; {args.out / 'summary.json'}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
