"""A test module never imports another test module (or a conftest): shared code lives in
tests/support/ or a directory's non-test helper modules, so each test module stands alone. And
nothing outside tests/ (bench/, deploy/) imports from tests/: what a benchmark shares with the
tests lives beside the code it exercises (bench/emulator/http/, for instance)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def is_test_module(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`; `from a import b` names both a and a.b (b may be
    a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            found += [(node.lineno, name) for name in names]
    return found


def imports_of_test_modules(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    return [f"{rel}:{line}: imports {name}" for line, name in imported(path) if is_test_module(name)]


def test_no_test_module_imports_another() -> None:
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py"))
    assert files
    found = [line for path in files for line in imports_of_test_modules(path)]
    assert not found, "\n".join(found)


def test_nothing_outside_tests_imports_from_tests() -> None:
    files = sorted((ROOT / "bench").rglob("*.py")) + sorted((ROOT / "deploy").rglob("*.py"))
    assert files
    found = [
        f"{path.relative_to(ROOT)}:{line}: imports {name}"
        for path in files
        for line, name in imported(path)
        if name == "tests" or name.startswith("tests.")
    ]
    assert not found, "\n".join(found)
