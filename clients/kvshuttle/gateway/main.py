"""`kvshuttle-gateway`: the reference OpenAI-compatible HTTP gateway process.

Builds its settings, logs them (API keys redacted), loads every model's tokenizer (a bad
directory fails here, before anything is bound), and serves until SIGTERM or SIGINT. Then
/health answers 503 (drain_delay_s), the listener closes, in-flight requests get grace_seconds
to finish and are then cancelled (their turns aborted), and buffered spans are exported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvshuttle.gateway.config import GatewaySettings
from kvshuttle.gateway.http.app import Gateway
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.serving.logging import configure_logging
from kvshuttle.serving.server import wait_for_signal
from kvshuttle.serving.telemetry import Telemetry

__all__ = ["GatewayServer", "main"]

SERVICE_NAME = "kvshuttle-gateway"

log = structlog.get_logger("kvshuttle.gateway")


def _host_port(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"listen must be host:port, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class GatewayServer:
    """The HTTP server around a Gateway. `start()` binds (listen port 0 picks one), `stop()`
    drains; `serve_until_signal()` is both around SIGTERM/SIGINT.

    Without `tracer_provider` it configures tracing from the settings and shuts it down on
    stop; a provider passed in (tests) is only flushed. `tokenizers` replaces loading them."""

    def __init__(
        self,
        settings: GatewaySettings,
        *,
        tracer_provider: TracerProvider | None = None,
        metrics_registry: CollectorRegistry | None = None,
        tokenizers: Mapping[str, ChatTokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self._telemetry = Telemetry(
            settings.telemetry, SERVICE_NAME, registry=metrics_registry, tracer_provider=tracer_provider
        )
        self.gateway = Gateway(
            settings,
            tracer_provider=self._telemetry.provider,
            metrics=GatewayMetrics(self._telemetry.registry),
            tokenizers=tokenizers,
        )
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> int:
        host, port = _host_port(self.settings.listen)
        runner = web.AppRunner(
            self.gateway.app(),
            # A client that disconnects cancels its handler at once: its engine requests are
            # closed (vLLM aborts them) and its turn is aborted, instead of running to the end.
            handler_cancellation=True,
            shutdown_timeout=self.settings.grace_seconds,
            access_log=None,  # request.done is the access log
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._telemetry.start_metrics()
        log.info(
            "gateway.started",
            listen=self.settings.listen,
            port=self.port,
            router=self.settings.router.address,
            router_affinity="round_robin" if self.gateway.router.replicas is None else "conversation",
            models=sorted(self.settings.models),
            tenants=len(set(self.gateway._keys.values())),
            tokenizer_cache={name: t.cached for name, t in self.gateway.tokenizers.items()},
        )
        return self.port

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self.gateway.draining = True
        log.info("gateway.stopping", grace_seconds=self.settings.grace_seconds)
        if self.settings.drain_delay_s:
            await asyncio.sleep(self.settings.drain_delay_s)
        await runner.cleanup()
        await self._telemetry.close()
        log.info("gateway.stopped")

    async def serve_until_signal(self) -> None:
        await self.start()
        try:
            log.info("gateway.signal", signal=(await wait_for_signal()).name)
        finally:
            await self.stop()


def main() -> None:
    settings = GatewaySettings()
    configure_logging(settings.telemetry)
    log.info("gateway.config", **settings.model_dump(mode="json"))  # SecretStr dumps as "**********"
    asyncio.run(GatewayServer(settings).serve_until_signal())


if __name__ == "__main__":
    main()
