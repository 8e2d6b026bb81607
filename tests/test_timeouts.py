"""The per-test timeout fails a hung async test even while its event loop is busy: the timeout's
exception lands in whatever frame runs when the signal comes, and in a callback or another
task's step the loop would swallow it (the test then hung on past its timeout, as a bench test
did under load). tests/support/task_dump.py dumps the tasks and stops the loop."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HANGING = """
import asyncio


async def test_hangs_while_the_loop_is_busy() -> None:
    loop = asyncio.get_running_loop()

    def busy() -> None:
        sum(range(20_000))  # the timeout's signal lands here, in a callback, nearly always
        loop.call_soon(busy)

    loop.call_soon(busy)
    await asyncio.Event().wait()
"""


def test_a_timeout_fails_an_async_test_whose_loop_is_busy(tmp_path: Path) -> None:
    (tmp_path / "test_hang.py").write_text(HANGING)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.support.task_dump",
         "-o", "timeout=1", "-o", "timeout_method=signal", "-o", "asyncio_mode=auto",
         "-o", "asyncio_default_fixture_loop_scope=function", str(tmp_path / "test_hang.py")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]
    assert "asyncio tasks at the timeout" in done.stdout
    assert "test_hangs_while_the_loop_is_busy" in done.stdout
