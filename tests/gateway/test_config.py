"""GatewaySettings from the environment: models, API keys (secret), bounds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from kvshuttle.gateway.config import EngineSettings, GatewaySettings, ModelSettings


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSHUTTLE_GATEWAY_LISTEN", "0.0.0.0:9000")
    monkeypatch.setenv("KVSHUTTLE_GATEWAY_ROUTER__ADDRESS", "router:50061")
    monkeypatch.setenv("KVSHUTTLE_GATEWAY_ENGINES__PREFILL_TIMEOUT_S", "30")
    monkeypatch.setenv(
        "KVSHUTTLE_GATEWAY_MODELS",
        json.dumps({"a": str(tmp_path), "b": {"tokenizer": str(tmp_path), "served_name": "org/b"}}),
    )
    monkeypatch.setenv("KVSHUTTLE_GATEWAY_API_KEYS", json.dumps({"sk-0123456789": "acme"}))
    settings = GatewaySettings()
    assert settings.listen == "0.0.0.0:9000"
    assert settings.router.address == "router:50061" and settings.router.timeout == 2.0
    assert settings.engines.prefill_timeout_s == 30 and settings.engines.decode_idle_timeout_s == 600
    assert settings.engines.reuse_prefill_timeout_s == 20.0
    assert settings.models["a"].tokenizer == tmp_path
    assert (settings.served_name("a"), settings.served_name("b")) == ("a", "org/b")
    assert settings.tenant_keys() == {"sk-0123456789": "acme"}
    dumped = json.dumps(settings.model_dump(mode="json"))
    assert "sk-0123456789" not in dumped  # logged at startup: the keys stay out


def test_api_keys_merge_from_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-file-0123456789": "globex"}))
    settings = GatewaySettings(
        models={"m": ModelSettings(tokenizer=tmp_path)},
        api_keys=SecretStr(json.dumps({"sk-env-0123456789": "acme"})),
        api_keys_file=keys,
    )
    assert settings.tenant_keys() == {"sk-env-0123456789": "acme", "sk-file-0123456789": "globex"}


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ("not json sk-secret-0123", "not valid JSON"),
        ('["sk-0123456789"]', "JSON object"),
        ('{"short": "acme"}', "at least 8"),
        ('{"sk-0123456789": "bad/tenant"}', "tenant"),
    ],
)
def test_a_bad_key_map_fails_at_startup_without_echoing_keys(tmp_path: Path, keys: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as caught:
        GatewaySettings(models={"m": ModelSettings(tokenizer=tmp_path)}, api_keys=SecretStr(keys))
    assert "sk-secret-0123" not in str(caught.value)


def test_a_gateway_without_models_is_refused() -> None:
    with pytest.raises(ValidationError, match="models"):
        GatewaySettings()


def test_the_reuse_prefill_deadline_must_be_positive() -> None:
    with pytest.raises(ValidationError, match="reuse_prefill_timeout_s"):
        EngineSettings(reuse_prefill_timeout_s=0)
