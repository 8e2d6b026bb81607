"""Run the `kvshuttle` CLI in-process and capture what it prints.

    result = run_cli(["registry", "nodes"], registry=address)
    exit_code, stdout, stderr = result

`run_cli` runs the CLI's own event loop, so from an async test (whose loop serves the registry)
use `await arun_cli(...)`, which runs it on a worker thread. The process environment is not
read: pass `env` to set KVSHUTTLE_REGISTRY_ADDR and friends.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvshuttle.cli.main import run


class CliResult(NamedTuple):
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout parsed as one JSON document."""
        return json.loads(self.stdout)

    def json_lines(self) -> list[Any]:
        """stdout parsed as one JSON document per line."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]


def run_cli(
    argv: Sequence[str], *, registry: str | None = None, env: Mapping[str, str] | None = None
) -> CliResult:
    """`kvshuttle [--registry ADDR] ARGV...` in this process; never raises SystemExit."""
    out, err = io.StringIO(), io.StringIO()
    args = (["--registry", registry] if registry else []) + list(argv)
    code = run(args, stdout=out, stderr=err, environ=dict(env or {}))
    return CliResult(code, out.getvalue(), err.getvalue())


async def arun_cli(
    argv: Sequence[str], *, registry: str | None = None, env: Mapping[str, str] | None = None
) -> CliResult:
    """run_cli on a worker thread, for tests whose event loop serves the registry."""
    return await asyncio.to_thread(run_cli, argv, registry=registry, env=env)
