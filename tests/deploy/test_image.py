"""The image's build files (deploy/kubernetes/image; the image itself cannot be built here): what
each Dockerfile copies exists and gets past its .dockerignore, every runtime dependency is pinned
to one version that satisfies pyproject.toml, the runtime user is not root."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
IMAGE = REPO / "deploy/kubernetes/image"


def copied(dockerfile: Path) -> list[str]:
    """Sources of the COPY lines that read the build context."""
    out = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            out += line.split()[1:-1]
    return out


def included(path: str, ignore: Path) -> bool:
    """Whether `path` reaches the build, by the ignore file's rules (last match wins)."""
    keep = True
    for raw in ignore.read_text().splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.removeprefix("!").rstrip("/")
        if pattern == "*" or fnmatch.fnmatch(path, pattern) or path.startswith(f"{pattern}/"):
            keep = negate
    return keep


@pytest.mark.parametrize("name", ["Dockerfile", "vllm.Dockerfile"])
def test_what_the_dockerfile_copies_exists_and_is_not_ignored(name: str) -> None:
    sources = copied(IMAGE / name)
    assert sources
    for source in sources:
        assert (REPO / source).exists(), source
        assert included(source, IMAGE / f"{name}.dockerignore"), f"{source} is ignored"
    assert not included("tests/conftest.py", IMAGE / f"{name}.dockerignore")


def test_every_runtime_dependency_is_pinned_within_pyproject() -> None:
    pins = {}
    for line in (IMAGE / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for spec in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"{name} is not pinned"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} outside {req.specifier}"
        )
    assert pins["nixl-cu12"] == pins["nixl"] == "1.5.1"


def test_the_image_runs_as_a_user_not_root() -> None:
    lines = (IMAGE / "Dockerfile").read_text().splitlines()
    assert lines.count("USER 10001:10001") == 1
    assert not any(line.startswith("FROM") and ":latest" in line for line in lines)
