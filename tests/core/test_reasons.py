"""One table of error reasons (kvshuttle.core.reasons), and the protos that document it: every
reason a service raises is in its proto's list, and each list is exactly the table's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvshuttle.core.reasons import INTERNAL_REASONS, SERVICE_REASONS, ErrorReason

ROOT = Path(__file__).resolve().parents[2]
# Each class's default reason (kvshuttle.core.errors) may reach a caller from any service.
# A service may name the reasons of the services it calls too (to branch on them).
CALLS = {"registry": (), "router": ("registry",), "agent": ("registry",)}
GENERIC = {
    ErrorReason.INVALID_ARGUMENT,
    ErrorReason.NOT_FOUND,
    ErrorReason.FAILED_PRECONDITION,
    ErrorReason.ABORTED,
    ErrorReason.RESOURCE_EXHAUSTED,
    ErrorReason.UNAVAILABLE,
}


def proto_reasons(service: str) -> set[str]:
    """The reasons listed in the service's proto, under 'whose reason is one of'."""
    text = (ROOT / "proto" / "kvshuttle" / service / "v1" / f"{service}_service.proto").read_text()
    header = text[: text.index("\nservice ")]
    listed = header[header.index("whose reason is one of") :]
    out: set[str] = set()
    for line in listed.splitlines()[1:]:
        m = re.match(r"//   ([A-Z0-9_, ]+):", line)
        if m:
            out.update(r.strip() for r in m.group(1).split(","))
    return out


@pytest.mark.parametrize("service", sorted(SERVICE_REASONS))
def test_proto_lists_exactly_the_service_reasons(service: str) -> None:
    assert proto_reasons(service) == {str(r) for r in SERVICE_REASONS[service]}


@pytest.mark.parametrize("service", sorted(SERVICE_REASONS))
def test_every_reason_a_service_names_is_its_own_or_a_callee_s(service: str) -> None:
    used: set[str] = set()
    for path in (ROOT / "services" / "kvshuttle" / service).rglob("*.py"):
        used.update(re.findall(r"ErrorReason\.([A-Z0-9_]+)", path.read_text()))
    allowed = set(SERVICE_REASONS[service]) | GENERIC | INTERNAL_REASONS
    for callee in CALLS[service]:
        allowed |= SERVICE_REASONS[callee]
    assert used <= {str(r) for r in allowed}, f"{service} names reasons no proto it speaks lists"


def test_no_reason_is_a_string_literal() -> None:
    literal = re.compile(r"""reason\s*=\s*["'][A-Z][A-Z0-9_]+["']""")
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for tree in ("services", "clients")
        for path in (ROOT / tree).rglob("*.py")
        if "_pb2" not in path.name
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert offenders == []
