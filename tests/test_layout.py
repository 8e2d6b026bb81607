"""A test module never imports another test module (or a conftest): shared code lives in
tests/support/ or a directory's non-test helper modules, so each test module stands alone."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imports_of_test_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            # `from tests.x import test_y` imports a test module as well.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        rel = path.relative_to(ROOT)
        found += [f"{rel}:{node.lineno}: imports {name}" for name in names if is_test_module(name)]
    return found


def test_no_test_module_imports_another() -> None:
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    assert files
    found = [line for path in files for line in imports_of_test_modules(path)]
    assert not found, "\n".join(found)
