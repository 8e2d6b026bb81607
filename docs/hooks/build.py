"""mkdocs hooks (mkdocs.yml `hooks:`): the generated reference pages, and links into the repository.

- The reference pages (reference/api.md, configuration.md, errors.md) are generated from the
  protos and the settings classes at every build, never checked in, so they cannot drift.
- A page may link a repository file by its relative path (`../../proto/...proto`,
  `../../bench/results/x.json`). The file must exist (else the build fails, as a broken page
  link does under --strict); the site gets a copy of it under `_source/` and the link points
  there. Links to the services' and clients' Python modules are refused: the docs point at the
  protos, the settings reference and the docs, never at a private module.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the generator, docs.hooks.reference, whatever mkdocs' cwd
    sys.path.insert(0, str(ROOT))

from docs.hooks import reference  # noqa: E402

GENERATED = {
    "reference/api.md": reference.api_reference,
    "reference/configuration.md": reference.configuration_reference,
    "reference/errors.md": reference.errors_reference,
}
SOURCE_DIR = "_source"
# `[text](target)` or `[text](target "title")`; images too.
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
PRIVATE = re.compile(r"^(services|clients)/.*\.py$")


def markdown_links(markdown: str) -> list[str]:
    """Targets of the inline links outside fenced code blocks."""
    found = []
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            found += [m.group(2) for m in LINK.finditer(line)]
    return found


def repo_target(page_uri: str, target: str) -> str | None:
    """The repository path a link from docs/`page_uri` points at, when it leaves docs/; None for
    a link within the docs, an absolute URL, a mail address or an anchor."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    parts: list[str] = ["docs", *PurePosixPath(page_uri).parent.parts]
    for part in PurePosixPath(path).parts:
        if part == "..":
            if not parts:
                raise PluginError(f"{page_uri}: link {target!r} leaves the repository")
            parts.pop()
        elif part != ".":
            parts.append(part)
    if parts and parts[0] == "docs":
        return None
    return "/".join(parts)


def _source_uri(repo_path: str) -> str:
    # A copied .md is served as text: rendered, its own links would be the site's to resolve.
    return f"{SOURCE_DIR}/{repo_path}" + (".txt" if repo_path.endswith(".md") else "")


def check_repo_path(page_uri: str, repo_path: str) -> None:
    if PRIVATE.match(repo_path):
        raise PluginError(
            f"{page_uri}: links {repo_path}, a private module; link the proto, the settings "
            "reference or a docs page instead"
        )
    if not (ROOT / repo_path).is_file():
        raise PluginError(f"{page_uri}: links {repo_path}, which is not a file of the repository")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for uri, generate in GENERATED.items():
        files.append(File.generated(config, uri, content=generate()))
    wanted: set[str] = set()
    for file in files.documentation_pages():
        markdown = file.content_string
        for target in markdown_links(markdown):
            repo_path = repo_target(file.src_uri, target)
            if repo_path is not None:
                check_repo_path(file.src_uri, repo_path)
                wanted.add(repo_path)
    for repo_path in sorted(wanted):
        files.append(File.generated(config, _source_uri(repo_path), abs_src_path=str(ROOT / repo_path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files, **_: Any) -> str:
    """Points each repository link at the site's copy of the file, relative to the page."""
    page_dir = PurePosixPath(page.file.src_uri).parent
    out = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append(line)
        elif fenced:
            out.append(line)
        else:
            out.append(LINK.sub(lambda m: _rewrite(m, page.file.src_uri, page_dir), line))
    return "".join(out)


def _rewrite(match: re.Match[str], page_uri: str, page_dir: PurePosixPath) -> str:
    target = match.group(2)
    repo_path = repo_target(page_uri, target)
    if repo_path is None:
        return match.group(0)
    fragment = target[len(target.split("#", 1)[0]) :]
    depth = len(page_dir.parts)
    relative = "../" * depth + _source_uri(repo_path)
    return f"{match.group(1)}{relative}{fragment}{match.group(3)}"
