"""The chaos suite's report, collected across its scenarios: `chaos_report` (a list each scenario
appends its ScenarioResult to), saved as JSON when the session ends and printed as a table in
pytest's terminal summary."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from tests.chaos.report import ScenarioResult, save, table

_RESULTS = pytest.StashKey[list[ScenarioResult]]()
_SAVED = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def chaos_report(pytestconfig: pytest.Config) -> Iterator[list[ScenarioResult]]:
    results: list[ScenarioResult] = []
    pytestconfig.stash[_RESULTS] = results
    started = time.monotonic()
    yield results
    if results:
        pytestconfig.stash[_SAVED] = str(save(results, time.monotonic() - started))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.section("chaos")
    terminalreporter.write_line(table(results))
    terminalreporter.write_line(f"saved: {config.stash.get(_SAVED, '(not saved)')}")
