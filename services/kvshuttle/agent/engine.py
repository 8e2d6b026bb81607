"""The engine poller: vLLM's /health and /metrics, every poll interval, into the load the
lease's heartbeats carry.

* healthy: `GET {engine}/health` answered 200 (vLLM answers 503 once its engine died, and
  nothing at all until the engine is built).
* load, from the Prometheus text of `GET {engine}/metrics`: `vllm:num_requests_running`,
  `vllm:num_requests_waiting` (summed over the `engine` and `model_name` label sets: a data
  parallel server reports one set per engine) and `vllm:kv_cache_usage_perc` (a fraction 0..1
  despite its name; averaged over the sets; `vllm:gpu_cache_usage_perc` of older vLLM when the
  new name is missing). A metric the text lacks keeps its last value and is counted.

Timeouts are short: a poll that hangs must not delay the next heartbeat's view of health. A
change of health is told to the listeners (the lease heartbeats at once) as the poll sees it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from kvshuttle.agent.model import EngineState
from kvshuttle.core.nodes import NodeLoad

__all__ = ["EngineMetrics", "EnginePoller", "parse_vllm_metrics"]

log = structlog.get_logger("kvshuttle.agent")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM before the V1 rename
_WANTED = frozenset({RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD})
# The lines of those families: their samples (a name then labels or the value) and their HELP
# and TYPE comments. The parser's time is per line, and the rest of a vLLM /metrics is hundreds
# of lines of histograms (36 kB: 13 ms to parse whole, every poll).
_WANTED_LINES = tuple(
    f"{prefix}{name}{end}"
    for name in _WANTED
    for prefix, end in (("", "{"), ("", " "), ("# HELP ", " "), ("# TYPE ", " "))
)
_U32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """The load metrics found in one /metrics text; None for one it lacked."""

    running_requests: int | None
    waiting_requests: int | None
    kv_cache_usage: float | None


def _count(values: list[float]) -> int | None:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    return min(max(round(sum(finite)), 0), _U32)


def _fraction(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    return min(max(sum(finite) / len(finite), 0.0), 1.0)


def parse_vllm_metrics(text: str) -> EngineMetrics:
    """The load metrics of a vLLM /metrics text. Raises ValueError for text that is not the
    Prometheus exposition format; with lines of the families read here, only those are parsed
    (a malformed line of another family goes unseen)."""
    samples: dict[str, list[float]] = {name: [] for name in _WANTED}
    lines = [line for line in text.splitlines() if line.startswith(_WANTED_LINES)]
    for family in text_string_to_metric_families("\n".join(lines) + "\n" if lines else text):
        if family.name not in _WANTED:
            continue
        for sample in family.samples:
            if sample.name == family.name:  # not a _created or _total companion
                samples[family.name].append(float(sample.value))
    usage = _fraction(samples[KV_USAGE])
    if usage is None:
        usage = _fraction(samples[KV_USAGE_OLD])
    return EngineMetrics(
        running_requests=_count(samples[RUNNING]),
        waiting_requests=_count(samples[WAITING]),
        kv_cache_usage=usage,
    )


class EnginePoller:
    """Polls one vLLM server (`base_url`, e.g. "http://127.0.0.1:8000") into `state`."""

    def __init__(
        self,
        base_url: str,
        *,
        interval: float,
        timeout: float,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if interval <= 0 or timeout <= 0:
            raise ValueError("interval and timeout must be positive")
        self._base = base_url.rstrip("/")
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._now = wall_clock
        self.state = EngineState()
        self._listeners: list[Callable[[bool], None]] = []

    def add_listener(self, on_health_change: Callable[[bool], None]) -> None:
        """Call `on_health_change(healthy)` whenever a poll finds the engine's health changed
        (the first healthy poll included); it must not block."""
        self._listeners.append(on_health_change)

    def load(self) -> NodeLoad:
        """What the next heartbeat reports."""
        s = self.state
        return NodeLoad(
            running_requests=s.running_requests,
            waiting_requests=s.waiting_requests,
            kv_cache_usage=s.kv_cache_usage,
            engine_healthy=s.healthy,
        )

    async def run(self) -> None:
        """Poll every interval until cancelled."""
        async with aiohttp.ClientSession(timeout=self._timeout) as session:
            while True:
                await self.poll_once(session)
                await asyncio.sleep(self._interval)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        """One poll of /health and /metrics; never raises for the engine's failures."""
        state = self.state
        errors: list[str] = []
        healthy = False
        try:
            async with session.get(f"{self._base}/health") as response:
                healthy = response.status == 200
                if not healthy:
                    errors.append(f"/health answered {response.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors.append(f"/health: {type(exc).__name__}: {exc}")
        metrics: EngineMetrics | None = None
        try:
            async with session.get(f"{self._base}/metrics") as response:
                if response.status == 200:
                    text = await response.text()
                    # A vLLM /metrics is tens of kB of histograms: parse off the event loop.
                    metrics = await asyncio.to_thread(parse_vllm_metrics, text)
                else:
                    errors.append(f"/metrics answered {response.status}")
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            errors.append(f"/metrics: {type(exc).__name__}: {exc}")
        if errors and state.healthy != healthy:
            log.warning("engine.poll_failed", engine=self._base, errors=errors)
        elif healthy and not state.healthy:
            log.info("engine.healthy", engine=self._base)
        changed = state.healthy != healthy
        state.healthy = healthy
        if metrics is not None:
            if metrics.running_requests is not None:
                state.running_requests = metrics.running_requests
            if metrics.waiting_requests is not None:
                state.waiting_requests = metrics.waiting_requests
            if metrics.kv_cache_usage is not None:
                state.kv_cache_usage = metrics.kv_cache_usage
            if None in (metrics.running_requests, metrics.waiting_requests, metrics.kv_cache_usage):
                state.missing_metrics += 1
        state.polls += 1
        state.failed_polls += bool(errors)
        state.last_error = "; ".join(errors)
        state.last_poll_time = self._now()
        if changed:
            for listener in self._listeners:
                listener(healthy)
