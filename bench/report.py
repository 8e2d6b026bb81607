"""Where every benchmark (and the tests that keep figures) saves its result: one JSON file,
`<directory>/<name>-<utc>.json`, whose `header` says what ran where (bench, commit, whether the
tree had uncommitted changes, machine, args, UTC time), followed by the bench's own figures as
it wrote them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout


def _json_safe(value: Any) -> Any:
    # A round trip through JSON: Paths (and anything else JSON lacks) become their str.
    return json.loads(json.dumps(value, default=str))


def header(bench: str, args: argparse.Namespace | Mapping[str, Any] | None, utc: datetime) -> dict[str, Any]:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "bench": bench,
        "commit": commit.strip() if commit is not None else None,
        "dirty": bool(status.strip()) if status is not None else None,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor(),
        },
        "args": _json_safe(vars(args) if isinstance(args, argparse.Namespace) else args),
        "utc": utc.isoformat(timespec="seconds"),
    }


def save(
    bench: str,
    figures: Mapping[str, Any],
    *,
    args: argparse.Namespace | Mapping[str, Any] | None,
    name: str | None = None,
    directory: Path = RESULTS,
    utc: datetime | None = None,
) -> Path:
    """Write the header and `figures` to `<directory>/<name or bench>-<utc>.json`; its path.
    The same `utc` names the same file again (a bench that saves as it goes)."""
    utc = utc or datetime.now(UTC)
    out = directory / f"{name or bench}-{utc.strftime('%Y%m%dT%H%M%SZ')}.json"
    directory.mkdir(parents=True, exist_ok=True)
    document = {"header": header(bench, args, utc), **figures}
    out.write_text(json.dumps(document, indent=2) + "\n")
    return out


__all__ = ["RESULTS", "header", "save"]
