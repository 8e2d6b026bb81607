"""The code blocks of README.md and docs/ that a reader would copy, as the docs mark them: a fenced
block right after a line `<!-- test: KIND -->` (an HTML comment, invisible on the page)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("sdk", "curl", "cli", "kustomize")
MARK = re.compile(r"^<!-- test: ([a-z]+) -->$")


@dataclass(frozen=True, slots=True)
class Snippet:
    kind: str
    source: str  # "docs/getting-started.md:97"
    code: str

    def commands(self) -> list[list[str]]:
        """A shell block's commands, each split as the shell would (lines continued with `\\`
        joined)."""
        return [shlex.split(line) for line in self.code.replace("\\\n", " ").splitlines() if line.strip()]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def snippets(kind: str | None = None) -> list[Snippet]:
    found = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            match = MARK.match(line.strip())
            if match is None:
                continue
            fence = lines[i + 1] if i + 1 < len(lines) else ""
            if not fence.startswith("```"):
                raise ValueError(
                    f"{path.relative_to(ROOT)}:{i + 1}: a test mark not followed by a fenced block"
                )
            end = lines.index("```", i + 2)
            code = "\n".join(lines[i + 2 : end]) + "\n"
            found.append(Snippet(match.group(1), f"{path.relative_to(ROOT)}:{i + 3}", code))
    return [s for s in found if kind is None or s.kind == kind]
