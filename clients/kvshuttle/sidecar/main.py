"""`kvshuttle-sidecar`: the process. Builds its settings, logs them (secrets redacted), loads
the models' tokenizers, and serves until SIGTERM or SIGINT; then /health answers 503
(drain_delay_s), the listener closes and in-flight requests get grace_seconds (their turns are
aborted when cancelled)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import wait_for_signal
from kvshuttle.serving.telemetry import Telemetry
from kvshuttle.sidecar.app import Sidecar
from kvshuttle.sidecar.config import SidecarSettings
from kvshuttle.sidecar.metrics import SidecarMetrics

__all__ = ["SidecarServer", "main"]

SERVICE_NAME = "kvshuttle-sidecar"

log = structlog.get_logger("kvshuttle.sidecar")


def _listen_address(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen must be host:port, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class SidecarServer:
    """The HTTP server around a Sidecar; `start()` binds (port 0 picks one), `stop()` drains.
    A `tracer_provider` passed in (tests) is only flushed; `tokenizers` replaces loading them."""

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics_registry: CollectorRegistry | None = None,
        tokenizers: Mapping[str, ChatTokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self._telemetry = Telemetry(
            settings.telemetry, SERVICE_NAME, registry=metrics_registry, tracer_provider=tracer_provider
        )
        self.sidecar = Sidecar(
            settings,
            tracer_provider=self._telemetry.provider,
            gateway_metrics=GatewayMetrics(self._telemetry.registry),
            metrics=SidecarMetrics(self._telemetry.registry),
            tokenizers=tokenizers,
        )
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> int:
        host, port = _listen_address(self.settings.listen)
        runner = web.AppRunner(
            self.sidecar.app(),
            handler_cancellation=True,  # a client leaving closes the engines' requests
            shutdown_timeout=self.settings.grace_seconds,
            access_log=None,
        )
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._telemetry.start_metrics()
        log.info(
            "sidecar.started",
            listen=self.settings.listen,
            port=self.port,
            node=self.settings.node,
            decode=self.settings.decode_endpoint,
            router=self.settings.router.address,
            registry=self.settings.registry.address,
            models=sorted(self.settings.models),
        )
        return self.port

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self.sidecar.draining = True
        if self.settings.drain_delay_s:
            await asyncio.sleep(self.settings.drain_delay_s)
        await runner.cleanup()
        await self._telemetry.close()
        log.info("sidecar.stopped")

    async def serve_until_signal(self) -> None:
        await self.start()
        try:
            log.info("sidecar.signal", signal=(await wait_for_signal()).name)
        finally:
            await self.stop()


def main() -> None:
    settings = SidecarSettings()  # type: ignore[call-arg]  # node comes from the environment
    configure_logging(settings.telemetry)
    log.info("sidecar.config", **settings.model_dump(mode="json"))  # SecretStr dumps as "**********"
    asyncio.run(SidecarServer(settings).serve_until_signal())


if __name__ == "__main__":
    main()
