"""Names as logs show them: a conversation id never reaches a log, its digest joins the lines."""

from __future__ import annotations

import pytest

from kvshuttle.core.digest import log_digest, log_name


def test_a_conversation_id_is_replaced_by_the_digest_the_gateway_logs() -> None:
    digest = log_digest("tenants/acme/conversations/secret-c1")
    assert log_name("tenants/acme/conversations/secret-c1") == f"tenants/acme/conversations/{digest}"
    assert (
        log_name("tenants/acme/conversations/secret-c1/retentions/4")
        == f"tenants/acme/conversations/{digest}/retentions/4"
    )


@pytest.mark.parametrize("name", ["", "tenants/acme"])
def test_names_without_a_conversation_stay(name: str) -> None:
    assert log_name(name) == name


@pytest.mark.parametrize("name", ["secret-c1", "tenants/acme/conversation/secret-c1", "a/b/secret-c1"])
def test_a_name_of_another_shape_is_logged_only_by_its_digest(name: str) -> None:
    assert log_name(name) == log_digest(name)
    assert "secret" not in log_name(name)
