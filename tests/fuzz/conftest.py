"""The fuzz run's figures at the end of the session: requests sent and their status codes."""

from __future__ import annotations

from typing import Any

from tests.fuzz.harness import CALLS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if CALLS:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(CALLS.items()))
        terminalreporter.write_line(
            f"fuzz: {sum(CALLS.values())} requests ({codes}); INTERNAL and UNKNOWN fail the run"
        )
