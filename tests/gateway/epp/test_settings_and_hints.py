"""The picker's settings from its environment, and how it reads what the data plane tells it: the
subset hint (a list, a comma-separated string, bare addresses, IPv6, garbage) and the endpoint
that served (metadata first, else the response header)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from tests.gateway.epp.envoy import request_headers, response_headers

from kvshuttle.epp.config import EppSettings
from kvshuttle.epp.protocol import header_values, served_endpoint, subset_hint


def test_settings_load_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "KVSHUTTLE_EPP_SERVER__LISTEN": "0.0.0.0:9002",
        "KVSHUTTLE_EPP_SERVER__HEALTH_LISTEN": "0.0.0.0:9003",
        "KVSHUTTLE_EPP_AUTH__INSECURE": "true",
        "KVSHUTTLE_EPP_ROUTER__ADDRESS": "router-0.router:50061,router-1.router:50061",
        "KVSHUTTLE_EPP_MODELS": f'{{"m": "{tmp_path}"}}',
        "KVSHUTTLE_EPP_CACHE_SALT_KEY": "k" * 16,
        "KVSHUTTLE_EPP_TENANT": "acme",
        "KVSHUTTLE_EPP_MAX_CONCURRENT_PICKS": "8",
    }.items():
        monkeypatch.setenv(name, value)
    settings = EppSettings()
    assert settings.server.listen == "0.0.0.0:9002" and settings.server.health_listen == "0.0.0.0:9003"
    assert settings.server.grace_seconds == 5.0  # the defaults of the nested model stay
    assert settings.auth.insecure
    assert settings.router.replicas() == ["router-0.router:50061", "router-1.router:50061"]
    assert settings.models["m"].tokenizer == tmp_path
    assert (settings.tenant, settings.max_concurrent_picks) == ("acme", 8)
    assert "k" * 16 not in repr(settings.model_dump(mode="json"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "set models"),
        ({"tenant": "a/b"}, "tenant"),
        ({"cache_salt_key": "short"}, "16 bytes"),
        ({"max_concurrent_picks": 0}, "max_concurrent_picks"),
        ({"listen": "0.0.0.0:1"}, "listen"),
    ],
)
def test_bad_settings_are_refused_naming_what(fields: dict[str, Any], message: str, tmp_path: Path) -> None:
    base: dict[str, Any] = {"models": {"m": str(tmp_path)}} if fields else {}
    with pytest.raises(ValidationError, match=message):
        EppSettings(**{**base, **fields})


@pytest.mark.parametrize(
    ("hint", "allowed", "refused"),
    [
        (["10.0.0.2:8000", "10.0.0.3:8000"], ["10.0.0.2:8000", "10.0.0.3:8000"], ["10.0.0.2:8001"]),
        ("10.0.0.2:8000, 10.0.0.3:8000", ["10.0.0.3:8000"], ["10.0.0.4:8000"]),
        (["10.0.0.2:8000,10.0.0.3:8000"], ["10.0.0.3:8000"], ["10.0.0.4:8000"]),
        (["10.0.0.2"], ["10.0.0.2:8000", "10.0.0.2:9"], ["10.0.0.20:8000"]),
        (["[FD00:0::2]:8000", "fd00::3"], ["[fd00::2]:8000", "[fd00::3]:1234"], ["[fd00::2]:8001"]),
        ([], [], ["10.0.0.2:8000"]),
        ("", [], ["10.0.0.2:8000"]),
        (["http://10.0.0.2:8000/", "10.0.0.2:99999", 7], [], ["10.0.0.2:8000"]),
    ],
)
def test_the_subset_hint_in_each_shape(hint: Any, allowed: list[str], refused: list[str]) -> None:
    subset = subset_hint(request_headers(subset=hint))
    assert subset is not None
    assert [e for e in allowed if not subset.allows(e)] == []
    assert [e for e in refused if subset.allows(e)] == []


def test_no_subset_hint_is_the_whole_pool() -> None:
    assert subset_hint(request_headers()) is None


def test_the_served_endpoint_from_metadata_before_the_header() -> None:
    message = response_headers("10.0.0.2:8000")
    assert (
        served_endpoint(message, {"x-gateway-destination-endpoint-served": "10.0.0.9:1"}) == "10.0.0.2:8000"
    )
    by_header = response_headers("[FD00::2]:8000, 10.0.0.3:8000", as_header=True)
    assert served_endpoint(by_header, header_values(by_header.response_headers)) == "[fd00::2]:8000"
    assert served_endpoint(response_headers(None), {}) is None


def test_header_values_take_raw_value_and_lower_case_names() -> None:
    message = request_headers(extra={"X-Session-ID": "s1"})
    message.request_headers.headers.headers.add(key="x-legacy", value="plain")
    values = header_values(message.request_headers)
    assert (values["x-session-id"], values["x-legacy"], values[":path"]) == (
        "s1",
        "plain",
        "/v1/chat/completions",
    )
