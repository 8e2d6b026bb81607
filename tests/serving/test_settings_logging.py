"""Settings validation and what configure_logging writes."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings


class ServiceSettings(BaseSettings):
    """How a service nests the shared settings."""

    model_config = SettingsConfigDict(env_prefix="KVSHUTTLE_TEST_", env_nested_delimiter="__")
    server: ServerSettings = ServerSettings()
    telemetry: TelemetrySettings = TelemetrySettings()


def test_nested_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSHUTTLE_TEST_TELEMETRY__LOG_FORMAT", "json")
    monkeypatch.setenv("KVSHUTTLE_TEST_TELEMETRY__LOG_LEVEL", "WARNING")
    monkeypatch.setenv("KVSHUTTLE_TEST_SERVER__GRACE_SECONDS", "0.5")

    settings = ServiceSettings()

    assert settings.telemetry.log_format == "json"
    assert settings.telemetry.log_level == "warning"
    assert settings.server.grace_seconds == 0.5
    assert settings.server.listen == "127.0.0.1:50051"
    assert settings.server.max_receive_message_bytes == 4 * 1024 * 1024
    assert not settings.server.tls


@pytest.mark.parametrize(
    "tls",
    [
        {"tls_cert_file": Path("c.pem")},
        {"tls_key_file": Path("k.pem")},
        {"tls_client_ca_file": Path("ca.pem")},
    ],
)
def test_half_configured_tls_is_refused(tls: dict[str, Path]) -> None:
    with pytest.raises(ValidationError):
        ServerSettings.model_validate(tls)


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValidationError):
        TelemetrySettings.model_validate({"log_format": "xml"})
    with pytest.raises(ValidationError):
        TelemetrySettings.model_validate({"log_level": "loud"})
    with pytest.raises(ValidationError):
        ServerSettings(grace_seconds=-1)


@pytest.fixture
def restore_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "kvshuttle"]:
        root.removeHandler(handler)


@pytest.mark.usefixtures("restore_logging")
def test_json_lines_carry_context_for_structlog_and_stdlib_alike() -> None:
    out = io.StringIO()
    configure_logging(TelemetrySettings(log_format="json"), stream=out)
    configure_logging(TelemetrySettings(log_format="json"), stream=out)  # a second call replaces the first

    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(trace_id="abc")
    structlog.get_logger().info("hello", n=1)
    logging.getLogger("grpc._cython.cygrpc").warning("from %s", "grpc")
    structlog.get_logger().debug("dropped")  # below the default level
    try:
        raise ValueError("bad")
    except ValueError:
        structlog.get_logger().exception("failed")
    structlog.contextvars.clear_contextvars()

    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["hello", "from grpc", "failed"]
    assert all(line["trace_id"] == "abc" and "timestamp" in line for line in lines)
    assert (lines[0]["level"], lines[0]["n"]) == ("info", 1)
    assert (lines[1]["level"], lines[1]["logger"]) == ("warning", "grpc._cython.cygrpc")
    assert "ValueError: bad" in lines[2]["exception"]


@pytest.mark.usefixtures("restore_logging")
def test_json_lines_are_ascii_whatever_they_carry() -> None:
    out = io.StringIO()
    configure_logging(TelemetrySettings(log_format="json"), stream=out)
    structlog.get_logger().info("plain", n=1)
    structlog.get_logger().info("accented", tenant="café", big=2**70)

    text = out.getvalue()
    assert text.isascii()  # a stream of any encoding takes it
    plain, accented = [json.loads(line) for line in text.splitlines()]
    assert (plain["event"], plain["n"]) == ("plain", 1)
    assert (accented["tenant"], accented["big"]) == ("café", 2**70)


@pytest.mark.usefixtures("restore_logging")
def test_auto_is_json_off_a_terminal_and_console_renders_text() -> None:
    auto, console = io.StringIO(), io.StringIO()

    configure_logging(TelemetrySettings(log_format="auto"), stream=auto)
    structlog.get_logger().info("auto")
    configure_logging(TelemetrySettings(log_format="console"), stream=console)
    structlog.get_logger().info("console", k="v")

    assert json.loads(auto.getvalue())["event"] == "auto"
    text = console.getvalue()
    assert "console" in text and "k=v" in text
    assert not text.startswith("{")
