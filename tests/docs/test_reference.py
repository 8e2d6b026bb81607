"""The generated reference pages say everything the code declares, and the docs build refuses
what would make them wrong: a broken link, a link to a file the repository lacks, a private
module named as the place to read behaviour."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs.hooks import build, reference
from mkdocs.exceptions import PluginError
from tests.docs.snippets import ROOT, doc_files

from kvshuttle.agent.v1 import agent_service_pb2
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.v1 import registry_service_pb2
from kvshuttle.router.v1 import router_service_pb2
from kvshuttle.vllm.v1 import kv_transfer_params_pb2

GENERATED_API = (registry_service_pb2, router_service_pb2, agent_service_pb2, kv_transfer_params_pb2)


@pytest.fixture(scope="module")
def api() -> str:
    return reference.api_reference()


def test_api_page_has_every_rpc_message_field_and_enum_value(api: str) -> None:
    for module in GENERATED_API:
        file = module.DESCRIPTOR
        for service in file.services_by_name.values():
            assert f"### service `{service.name}`" in api
            for method in service.methods:
                assert f"| `{method.name}` |" in api, method.full_name
        for message in file.message_types_by_name.values():
            assert f"#### `{message.name}`" in api, message.full_name
            for field in message.fields:
                assert f"| `{field.name}` | {field.number} |" in api, field.full_name
        for enum in file.enum_types_by_name.values():
            for value in enum.values:
                assert f"| `{value.name}` | {value.number} |" in api


def test_api_page_carries_the_protos_comments(api: str) -> None:
    text = (ROOT / "proto/kvshuttle/router/v1/router_service.proto").read_text()
    comment = re.search(r"// (Another turn claimed the retention first\.)", text)
    assert comment is not None
    assert f"| `DECISION_REASON_CLAIM_LOST` | 8 | {comment.group(1)} |" in api


def test_every_service_settings_class_is_documented() -> None:
    prefixes = {str(c.model_config.get("env_prefix")) for c in reference.settings_classes()}
    assert {"KVSHUTTLE_REGISTRY_", "KVSHUTTLE_ROUTER_", "KVSHUTTLE_AGENT_", "KVSHUTTLE_GATEWAY_"} <= prefixes


def test_every_variable_has_a_default_and_a_meaning() -> None:
    """A setting added without a comment (or a Field description) fails here: the reference
    would list it with nothing to say."""
    silent = [
        var.name
        for cls in reference.settings_classes()
        for var in reference.variables(cls, str(cls.model_config.get("env_prefix")))
        if not var.meaning
    ]
    assert not silent, silent


def test_variables_are_what_the_services_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Names and defaults as the service sees them: the router's own listen address, a nested
    dataclass's field, a variable set in the environment reaching the field it names."""
    from kvshuttle.registry.config import RegistrySettings  # noqa: PLC0415
    from kvshuttle.router.config import RouterSettings  # noqa: PLC0415

    router = {v.name: v for v in reference.variables(RouterSettings, "KVSHUTTLE_ROUTER_")}
    assert router["KVSHUTTLE_ROUTER_SERVER__LISTEN"].default == "`127.0.0.1:50061`"
    assert router["KVSHUTTLE_ROUTER_POLICY__PARKING__ENABLED"].default == "`true`"
    registry = {v.name: v for v in reference.variables(RegistrySettings, "KVSHUTTLE_REGISTRY_")}
    assert registry["KVSHUTTLE_REGISTRY_LIMITS__RETENTION_TTL__MAXIMUM"].default == "`3600.0`"
    assert registry["KVSHUTTLE_REGISTRY_STORE_LIMITS__MAX_RETENTIONS"].default == "`1000000`"
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_STORE_LIMITS__MAX_RETENTIONS", "7")
    monkeypatch.setenv("KVSHUTTLE_REGISTRY_SERVER__GRACE_SECONDS", "3")
    settings = RegistrySettings()
    assert settings.store_limits.max_retentions == 7
    assert settings.server.grace_seconds == 3


def test_errors_page_lists_every_reason_with_its_meaning() -> None:
    page = reference.errors_reference()
    for reason in ErrorReason:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{reason.value}` |"))
        assert row.split(" | ")[1].strip(), reason


def test_links_into_the_repository_are_checked() -> None:
    assert build.repo_target("operations/running.md", "../../bench/results/x.json") == "bench/results/x.json"
    assert build.repo_target("operations/running.md", "../reference/api.md#x") is None
    assert build.repo_target("index.md", "https://example.com/a") is None
    with pytest.raises(PluginError, match="not a file of the repository"):
        build.check_repo_path("index.md", "bench/results/no-such-result.json")
    with pytest.raises(PluginError, match="private module"):
        build.check_repo_path("index.md", "services/kvshuttle/router/verify.py")
    build.check_repo_path("index.md", "proto/kvshuttle/router/v1/router_service.proto")


PRIVATE_NAMES = re.compile(
    r"\b(services|clients)/kvshuttle/[\w/]+\.py\b"
    r"|\bkvshuttle\.(core|serving|registry|router|agent|gateway|vllm|cli)\.(?!v1\b)[a-z_]+"
)


def test_no_page_sends_the_reader_to_a_private_module() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {m.group(0)}"
        for path in doc_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for m in PRIVATE_NAMES.finditer(line)
    ]
    assert not found, found


@pytest.mark.slow
def test_strict_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The same build `make docs` runs, on a copy of the docs with one page linking a page that
    does not exist: mkdocs --strict refuses it."""
    site = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", site / "docs")
    shutil.copy(ROOT / "mkdocs.yml", site / "mkdocs.yml")
    (site / "docs" / "getting-started.md").write_text(
        "# Getting started\n\nSee [the missing page](missing.md).\n"
    )
    # The hook and the pages it links into (protos, results) are the repository's.
    for name in ("proto", "bench", "deploy", "services", "clients", "README.md"):
        (site / name).symlink_to(ROOT / name)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=site,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    assert "missing.md" in done.stderr
