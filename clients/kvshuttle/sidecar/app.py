"""The sidecar's HTTP server: POST /v1/chat/completions and /v1/completions as the gateway
(Envoy, behind an endpoint picker) forwards them to this decode pod, GET /health.

Each request is served one of three ways (`kvshuttle_sidecar_requests_total{mode}`):

- kvshuttle: with `x-kvshuttle-turn` and `x-kvshuttle-plan` (kvshuttle.gateway.pd_headers) the
  request is a turn the EPP planned. The plan is checked (below); then the gateway's own code
  runs it, as kvshuttle.gateway.http.app runs any turn: the prompt tokenized and the cache salted as
  the EPP did for its PlanTurn, prefill with the plan's `kv_transfer_params` (D->P reuse or
  plain; none on extend), this pod's decode streamed back as the gateway answers, CommitTurn
  with decode's final params. The answer ends once the commit has landed, so the
  conversation's next turn, planned by the EPP as soon as it arrives, finds the retention.
- llmd: with `x-prefiller-host-port` only (a plain llm-d EPP in front), llm-d's P->D
  (kvshuttle.sidecar.proxy).
- local: with neither, this pod's decode alone.

Any other path (GET /v1/models, /tokenize, vLLM's /metrics, /health) goes to this pod's decode
unchanged; /health answers 503 while the sidecar drains.

A plan is served plain (llm-d's P->D on `x-prefiller-host-port` when allowed, else local; its
turn aborted) and counted in `kvshuttle_sidecar_plain_total{why}` when: it has no turn handle
(`unplanned`: the EPP planned without the router, its own degrade path); it does not parse
(`bad_plan`); its handle is not the `x-kvshuttle-turn` header's (`turn_mismatch`); it places
decode on another node than this pod's (`stale_plan`); a non-extend plan's prefill is not the
`x-prefiller-host-port` header's (`prefiller_mismatch`); the SSRF guard refuses its prefill
(`prefill_refused`) or the KV source its params name (`kv_source_refused`); its prompt ids are not
the ones the plan was made for (`prompt_mismatch`: `x-kvshuttle-prompt` differs from the digest of
the sidecar's own, say the two found different transcripts; then local); or the turn fails before
the client got a byte (`turn_failed`: the control plane or an engine; then local). The
user's turn never fails for kvshuttle's sake: a router out of reach only costs the commit.

SSRF guard (kvshuttle.sidecar.allowlist): no request goes to a prefill, and no engine is
handed a KV source, that is not a live registered node; refused targets are logged
(`sidecar.ssrf_refused`) and counted, and the request served locally.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import structlog
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider

from kvshuttle.client import RegistryClient
from kvshuttle.core.digest import log_name
from kvshuttle.core.endpoints import endpoint_host_port, parse_host_port
from kvshuttle.gateway.errors import GatewayError, RouterFailure
from kvshuttle.gateway.http.app import Gateway
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.openai.protocol import Kind
from kvshuttle.gateway.pd_headers import PLAN_HEADER, PREFILLER_HOST_PORT_HEADER, TURN_HEADER, decode_plan
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.sidecar.allowlist import RegisteredEndpoints
from kvshuttle.sidecar.config import SidecarSettings
from kvshuttle.sidecar.metrics import SidecarMetrics
from kvshuttle.sidecar.proxy import PlainProxy

__all__ = ["Sidecar"]

log = structlog.get_logger("kvshuttle.sidecar")

PlainWhy = Literal[
    "unplanned",
    "bad_plan",
    "turn_mismatch",
    "stale_plan",
    "prefiller_mismatch",
    "prefill_refused",
    "kv_source_refused",
    "prompt_mismatch",
    "turn_failed",
]


class _Refused(Exception):
    def __init__(self, why: PlainWhy, detail: str) -> None:
        super().__init__(detail)
        self.why = why
        self.detail = detail


class Sidecar:
    """The request handlers and what they share: the gateway code that runs planned turns, the
    plain proxy, the SSRF guard's allow list."""

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        tracer_provider: TracerProvider,
        gateway_metrics: GatewayMetrics,
        metrics: SidecarMetrics,
        tokenizers: Mapping[str, ChatTokenizer] | None = None,
    ) -> None:
        self.settings = settings
        self._provider = tracer_provider
        self._metrics = metrics
        self.gateway = Gateway(
            settings.gateway_settings(),
            tracer_provider=tracer_provider,
            metrics=gateway_metrics,
            tokenizers=tokenizers,
            hold_for_commit=True,
            tenant=settings.tenant,
        )
        self._proxy = PlainProxy(
            settings.decode_endpoint,
            settings.engines,
            metrics,
            tracer_provider.get_tracer("kvshuttle.sidecar"),
        )
        self._registry: RegistryClient | None = None
        self.allowlist = RegisteredEndpoints(
            self._read_nodes,
            ttl_s=settings.allowlist_ttl_s,
            miss_refresh_s=settings.allowlist_miss_refresh_s,
            max_stale_s=settings.allowlist_max_stale_s,
            max_nodes=settings.allowlist_max_nodes,
        )
        self._background = BackgroundTasks()
        self.draining = False

    # ---- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.max_request_bytes, middlewares=[self.gateway.errors]
        )
        self.gateway.attach(app)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{path:.*}", self.other)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app: web.Application) -> None:
        self._registry = RegistryClient.connect(
            self.settings.registry.channel_options(), tracer_provider=self._provider
        )
        await self._proxy.start()

    async def _cleanup(self, app: web.Application) -> None:
        await self._background.settle()
        await self._proxy.close()
        if self._registry is not None:
            await self._registry.close()
            self._registry = None

    async def settle(self) -> None:
        """Wait until no commit or abort is in flight."""
        await self.gateway.settle()
        await self._background.settle()

    async def _read_nodes(self, limit: int) -> list[reg_pb.Node]:
        if self._registry is None:
            raise RuntimeError("the sidecar app has not started")
        nodes: list[reg_pb.Node] = []
        async for node in self._registry.iter_nodes(timeout=self.settings.registry.timeout):
            nodes.append(node)
            if len(nodes) >= limit:
                break
        return nodes

    async def health(self, request: web.Request) -> web.StreamResponse:
        """503 while draining, else decode's own /health: the pod serves only while both do (the
        agent polls it here when its node's endpoint is the sidecar's)."""
        if self.draining:
            return web.json_response({"status": "draining"}, status=503)
        return await self._proxy.other(request)

    # ---- requests --------------------------------------------------------------------------

    async def other(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy.other(request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions")

    async def _handle(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        if TURN_HEADER in request.headers or PLAN_HEADER in request.headers:
            self._metrics.requests.labels("kvshuttle").inc()
            return await self._planned(request, kind)
        raw = await self._body(request)
        if PREFILLER_HOST_PORT_HEADER in request.headers:
            self._metrics.requests.labels("llmd").inc()
            return await self._plain(request, raw)
        self._metrics.requests.labels("local").inc()
        return await self._proxy.local(request, raw)

    async def _body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(
                413,
                f"the request body exceeds {self.settings.max_request_bytes} bytes",
                code="request_too_large",
            ) from None

    async def _planned(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        handle = request.headers.get(TURN_HEADER, "")
        try:
            plan = await self._checked(request, handle)
        except _Refused as refused:
            self._metrics.plain.labels(refused.why).inc()
            log.warning("sidecar.plan_refused", why=refused.why, detail=refused.detail, turn=log_name(handle))
            if refused.why not in ("unplanned", "bad_plan", "turn_mismatch"):  # else which turn: it lapses
                self._abort(handle, f"sidecar: {refused.why}")
            return await self._plain(request, await self._body(request))

        async def fallback(err: GatewayError) -> web.StreamResponse:
            # Before the first byte: the turn (aborted by the runner, or here when it never
            # started) is served by this pod's decode alone.
            self._metrics.plain.labels(
                "prompt_mismatch" if err.code == "prompt_mismatch" else "turn_failed"
            ).inc()
            log.warning("sidecar.turn_failed", status=err.status, code=err.code, message=err.message[:300])
            self._abort(plan.turn, "sidecar: turn failed before its answer")
            return await self._proxy.local(request, await self._body(request))

        return await self.gateway.handle(request, kind, plan=plan, fallback=fallback)

    async def _checked(self, request: web.Request, handle: str) -> pb.PlanTurnResponse:
        """The plan of the request's headers, ready for the turn runner (decode: this pod's
        engine). Raises _Refused saying why it cannot be run."""
        try:
            plan = decode_plan(request.headers.get(PLAN_HEADER, ""))
        except ValueError as exc:
            raise _Refused("bad_plan", str(exc)) from None
        if not handle and not plan.turn:
            # The EPP planned without the router (its degrade path): plain P->D, nothing to commit.
            raise _Refused("unplanned", "the plan has no turn handle")
        if not handle or plan.turn != handle:
            raise _Refused("turn_mismatch", "x-kvshuttle-turn is not the plan's turn")
        if plan.decode.node != self.settings.node:
            raise _Refused("stale_plan", f"the plan places decode on {plan.decode.node[:100]!r}")
        if plan.decision != pb.DECISION_EXTEND:
            header = request.headers.get(PREFILLER_HOST_PORT_HEADER, "")
            target = endpoint_host_port(plan.prefill.http_endpoint)
            try:
                if target is None or parse_host_port(header) != target:
                    raise ValueError
            except ValueError:
                why = "x-prefiller-host-port is not the plan's prefill"
                raise _Refused("prefiller_mismatch", why) from None
            if not await self._allowed_prefill(target):
                raise _Refused("prefill_refused", target)
        params = plan.prefill_kv_transfer_params
        names_source = params.HasField("remote_host") or params.HasField("remote_port")
        if names_source and not await self.allowlist.allows_kv_source(params.remote_host, params.remote_port):
            self._metrics.ssrf_refused.labels("kv_source").inc()
            log.warning("sidecar.ssrf_refused", target="kv_source", host=params.remote_host[:100])
            raise _Refused("kv_source_refused", "the plan's KV source is not a registered node")
        plan.decode.http_endpoint = self.settings.decode_endpoint
        return plan

    async def _allowed_prefill(self, target: str) -> bool:
        if await self.allowlist.allows_prefill(target):
            return True
        self._metrics.ssrf_refused.labels("prefill").inc()
        log.warning("sidecar.ssrf_refused", target="prefill", prefill=target)
        return False

    async def _plain(self, request: web.Request, raw: bytes) -> web.StreamResponse:
        """llm-d's P->D when x-prefiller-host-port names an allowed prefill, else local."""
        header = request.headers.get(PREFILLER_HOST_PORT_HEADER)
        if header is None:
            return await self._proxy.local(request, raw)
        try:
            target = parse_host_port(header)
        except ValueError as exc:
            log.warning("sidecar.bad_prefiller", error=str(exc))
            return await self._proxy.local(request, raw)
        if not await self._allowed_prefill(target):
            return await self._proxy.local(request, raw)
        return await self._proxy.disaggregated(request, raw, target)

    def _abort(self, handle: str, reason: str) -> None:
        """AbortTurn in the background (the answer does not wait); an abort of a turn already
        settled (the runner aborted it) is refused as such, and logged at debug."""

        async def abort() -> None:
            try:
                await self.gateway.router.abort_turn(handle, conversation="", reason=reason)
            except RouterFailure as err:
                level = log.debug if err.code == "FAILED_PRECONDITION" else log.warning
                level("sidecar.abort_failed", code=err.code, reason=err.reason)

        self._background.spawn(abort(), "abort")
