"""The pick for one request: the request becomes a PlanTurn, exactly as the gateway would plan
it, and the plan's decode node is the endpoint Envoy routes to.

The body is parsed by the gateway's own code (kvshuttle.gateway.openai.protocol), the prompt
rendered and tokenized by it (kvshuttle.gateway.openai.prompt, with transcripts: a retained turn's
exact ids, found in the registry through the router, start the prompt where the history repeats
that turn exactly; the decode-side sidecar finds the same, and runs the plan only on the prompt
ids whose digest the picker sends it),
the turn's cache salt is the tenant's (kvshuttle.gateway.prompts.salts), and PlanTurn goes over the
gateway's router port (conversation affinity over replicas included). The conversation is the
gateway's (kvshuttle.gateway.openai.protocol.conversation_id): the body's `conversation_id` or the
`X-Conversation-ID` header, else the body's `session_id` or the `x-session-id` header (vLLM's
session id, llm-d's session affinity), else the one the router finds the prompt continues (or
starts) for the tenant (`find_conversations`).

The subset hint (`x-gateway-destination-endpoint-subset`) goes to the router as
`hints.decode_endpoints`: the router places decode only on a registered, live, healthy decode
node of the model whose endpoint the subset holds (and extends a conversation only on a holder
inside it), so any eligible member of the subset can be picked, wherever earlier requests went.
An empty subset (or one of nothing that parses) is 503 `no_eligible_endpoint` before anything
is planned.

What the sidecar gets (kvshuttle.gateway.pd_headers): `x-prefiller-host-port` (the plan's
prefill, absent on an extend plan: the decode node runs the whole turn), `x-kvshuttle-turn`
(the turn handle; absent on a plan made without the router: nothing to commit) and
`x-kvshuttle-plan` (the PlanTurnResponse). The picker commits nothing: the sidecar does, once
decode has answered. A plan the picker does not send on (a plan too large for a header, a
decode outside the subset from a router that ignores hints.decode_endpoints) is aborted here,
which releases what it claimed.

Without a plan (`outcome` on the request's line):
- the router answers that no healthy decode node (of the subset) serves the model
  (NO_DECODE_NODE): 503, `no_eligible_endpoint` with a subset, else `no_ready_endpoint`; never
  a remembered endpoint, and the decode nodes remembered for the fallback below are forgotten.
- the router answers that no healthy prefill node serves the model (NO_PREFILL_NODE): `plain`,
  the least loaded ready decode node of the subset (ListReadyDecodes) with no sidecar headers:
  the decode pod runs the whole request; none: 503.
- `fallback`: the router does not answer (UNAVAILABLE, DEADLINE_EXCEEDED, or its registry's
  REGISTRY_UNAVAILABLE): plain P->D on the model's last planned prefill and the most recently
  planned decode node the subset allows (as the gateway's degrade path), a plan with no turn
  handle; none allowed: 503. Never planned: the router's error (503 / 504).
- `plain`: a request that is no completion (GET /v1/models, a bodyless request, another path)
  needs no plan: the least loaded decode node the router says is ready now (ListReadyDecodes,
  cached for `ready_cache_s`) that the subset allows; none: 503. With the router unreachable,
  the most recently planned decode node the subset allows; none: 503.

Load shedding (429): more than `max_concurrent_picks` requests being planned at once, or the
router's RESOURCE_EXHAUSTED (its own admission). Other refusals are the gateway's (400 naming the
field, 404 unknown model, 413 body too large) as OpenAI-style error bodies.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvshuttle.core.digest import log_digest
from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.core.hashing import cache_salt_digest
from kvshuttle.epp.config import EppSettings
from kvshuttle.epp.metrics import EppMetrics
from kvshuttle.epp.protocol import Subset
from kvshuttle.epp.ready import ReadyDecodes
from kvshuttle.gateway.errors import GatewayError, RouterFailure, router_error
from kvshuttle.gateway.openai.prompt import Transcripts, prompt_ids
from kvshuttle.gateway.openai.protocol import (
    CONVERSATION_HEADER,
    SESSION_HEADER,
    THINK_TIME_HEADER,
    Kind,
    TurnRequest,
    expected_think_time,
    parse_request,
)
from kvshuttle.gateway.pd_headers import (
    MAX_PLAN_HEADER_BYTES,
    PLAN_HEADER,
    PREFILLER_HOST_PORT_HEADER,
    PROMPT_HEADER,
    TURN_HEADER,
    encode_plan,
    prompt_digest,
)
from kvshuttle.gateway.prompts.salts import CacheSalts
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.ports import RouterPort, TranscriptPort
from kvshuttle.gateway.turns.runner import NO_NODE, ROUTER_UNAVAILABLE, plain_plan
from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = ["SIDECAR_HEADERS", "Pick", "PickRequest", "Picker", "PickerRouter"]

log = structlog.get_logger("kvshuttle.epp")

# llm-d's session affinity: the conversation when neither the body nor X-Conversation-ID names one.
# What the picker sets for the sidecar; a client's copies are always overwritten or removed.
SIDECAR_HEADERS = (PREFILLER_HOST_PORT_HEADER, TURN_HEADER, PLAN_HEADER, PROMPT_HEADER)
# PlanTurn failures that mean the router could not answer (as the gateway's turn runner), unless
# their reason is the router's answer that no node serves (NO_NODE).
_ROUTER_UNREACHABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
# Decode nodes remembered per model for picks without a plan (least recently planned out).
_KNOWN_DECODES = 256
_PROPAGATOR = TraceContextTextMapPropagator()


class PickerRouter(RouterPort, TranscriptPort, Protocol):
    """What the picker asks the router: RouterPort's calls, FindTranscript and ListReadyDecodes
    (kvshuttle.gateway.turns.router_port has them)."""

    async def list_ready_decodes(self, model: str) -> list[pb.Placement]: ...


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What the data plane told the picker of one HTTP request."""

    method: str
    path: str
    # Lower-cased names, first values.
    headers: Mapping[str, str]
    body: bytes | None
    subset: Subset | None


@dataclass(slots=True)
class Pick:
    """Where the request goes: `endpoint` (host:port) and the headers to set on it."""

    endpoint: str
    headers: dict[str, str] = field(default_factory=dict)
    # planned, fallback or plain.
    outcome: str = "planned"
    decision: str = ""
    reason: str = ""


def _kind(method: str, path: str) -> Kind | None:
    path = path.split("?", 1)[0].rstrip("/")
    if method.upper() != "POST":
        return None
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    return None


def _name(value: int, enum: type[pb.Decision] | type[pb.DecisionReason], prefix: str) -> str:
    return enum.Name(value).removeprefix(prefix).lower()  # type: ignore[arg-type]


def _decision(plan: pb.PlanTurnResponse) -> str:
    return _name(plan.decision, pb.Decision, "DECISION_")


class Picker:
    """Picks for requests; remembers, per model, the placements plans made (for picks without
    one). `router` must be connected by the caller."""

    def __init__(
        self,
        settings: EppSettings,
        *,
        tokenizers: Mapping[str, ChatTokenizer],
        router: PickerRouter,
        metrics: EppMetrics,
        tracer: trace.Tracer,
        background: BackgroundTasks,
        max_plan_header_bytes: int = MAX_PLAN_HEADER_BYTES,
    ) -> None:
        self._settings = settings
        self._tokenizers = dict(tokenizers)
        self._router = router
        self._metrics = metrics
        self._tracer = tracer
        self._background = background
        self._max_plan_header_bytes = max_plan_header_bytes
        key = None if settings.cache_salt_key is None else settings.cache_salt_key.get_secret_value().encode()
        self._salts = CacheSalts.from_key(key)
        self._content_format = {name: m.content_format for name, m in settings.models.items()}
        self._tool_parsers = {name: m.tool_call_parser for name, m in settings.models.items()}
        self._in_flight = 0
        # Model -> the last P->D pair a plan placed it on (bounded by the configured models).
        self._last_pair: dict[str, tuple[pb.Placement, pb.Placement]] = {}
        # Model -> decode endpoint -> its placement, most recently planned last (the fallback
        # while the router does not answer; what the router says is not ready is dropped).
        self._decodes: dict[str, OrderedDict[str, pb.Placement]] = {m: OrderedDict() for m in settings.models}
        # The router's word on which decode engines are ready, by served model name.
        self._ready = ReadyDecodes(router.list_ready_decodes, ttl_s=settings.ready_cache_s)

    async def pick(self, request: PickRequest) -> Pick:
        """The pick for `request`; GatewayError is the client's answer instead (an
        ImmediateResponse)."""
        if request.subset is not None and not len(request.subset):
            # The protocol: "If none of the endpoints in the list is eligible or the list is
            # empty, then the EPP MUST return a ImmediateResponse with 503".
            raise _no_endpoint(request.subset, "the subset hint names no endpoint")
        kind = _kind(request.method, request.path)
        if kind is None or request.body is None:
            return await self._plain(request.subset)
        if self._in_flight >= self._settings.max_concurrent_picks:
            raise GatewayError(
                429,
                f"the endpoint picker is planning {self._in_flight} requests, its limit: try again",
                type_="rate_limit_error",
                code="too_many_picks",
            )
        self._in_flight += 1
        self._metrics.in_flight.inc()
        try:
            return await self._planned(kind, request)
        finally:
            self._in_flight -= 1
            self._metrics.in_flight.dec()

    # ---- a completion: plan the turn ------------------------------------------------------

    def _parse(self, kind: Kind, request: PickRequest) -> TurnRequest:
        try:
            body = json.loads(request.body or b"")
        except ValueError:
            raise GatewayError.invalid("the request body is not valid JSON", "body") from None
        headers = request.headers
        return parse_request(
            kind,
            body,
            models=self._settings.models.keys(),
            default_max_tokens=None,
            content_format=self._content_format,
            conversation_header=headers.get(CONVERSATION_HEADER.lower()),
            session_header=headers.get(SESSION_HEADER.lower()),
            tool_parsers=self._tool_parsers,
        )

    async def _planned(self, kind: Kind, request: PickRequest) -> Pick:
        treq = self._parse(kind, request)
        think = expected_think_time(request.headers.get(THINK_TIME_HEADER.lower()))
        if think is None and treq.tools is not None:
            think = self._settings.agent_think_time_s
        tenant = self._settings.tenant
        conversation = (
            f"tenants/{tenant}/conversations/{treq.conversation_id}" if treq.conversation_id else ""
        )
        salt = self._salts.salt(tenant, treq.cache_salt)
        # As the gateway: a retained turn's transcript, found by the history's text, starts the
        # prompt (the sidecar finds the same, and runs the plan only on the same ids), and
        # without a conversation id the router finds the conversation by the prompt.
        finding = self._settings.find_conversations and not conversation
        exact = self._settings.models[treq.model].history == "exact_tokens"
        transcripts = (
            Transcripts(
                self._router, f"tenants/{tenant}", self._settings.served_name(treq.model), salt, conversation
            )
            if exact and (conversation or finding)
            else None
        )
        prompt = await prompt_ids(
            self._tokenizers[treq.model],
            treq,
            max_tokens=self._settings.max_prompt_tokens,
            background=self._background,
            transcripts=transcripts,
        )
        # As the gateway: a transcript found without an id is not named in the plan (the router
        # finds its conversation again by the prompt, forking siblings that find the same one).
        structlog.contextvars.bind_contextvars(
            model=treq.model, conversation=log_digest(conversation) if conversation else ""
        )
        request_id = uuid.uuid4().hex
        structlog.contextvars.bind_contextvars(prompt_tokens=len(prompt.ids), request_id=request_id)
        with self._tracer.start_as_current_span(
            "pick", attributes={"kvshuttle.model": treq.model, "kvshuttle.prompt_tokens": len(prompt.ids)}
        ) as span:
            pick = await self._plan(
                treq.model,
                prompt.ids,
                conversation,
                request_id,
                salt,
                think,
                request,
                tenant=f"tenants/{tenant}" if finding else "",
            )
            span.set_attribute("kvshuttle.decision", pick.decision)
            span.set_attribute("kvshuttle.decision.reason", pick.reason)
            span.set_attribute("kvshuttle.pick.outcome", pick.outcome)
            span.set_attribute("server.address", pick.endpoint)
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier)  # the sidecar's spans join this trace
            pick.headers.update(carrier)
        return pick

    async def _plan(
        self,
        model: str,
        ids: list[int],
        conversation: str,
        request_id: str,
        salt: str,
        think: float | None,
        request: PickRequest,
        *,
        tenant: str = "",
    ) -> Pick:
        started = time.perf_counter()
        subset = request.subset
        try:
            plan = await self._router.plan_turn(
                self._settings.served_name(model),
                ids,
                conversation=conversation,
                request_id=request_id,
                cache_salt_sha256=cache_salt_digest(salt),
                expected_think_time_s=think,
                decode_endpoints=() if subset is None else subset.entries(),
                tenant=tenant,
            )
        except RouterFailure as err:
            structlog.contextvars.bind_contextvars(plan_ms=_ms(time.perf_counter() - started))
            if err.reason in NO_NODE:
                return await self._no_node(model, err, subset)
            pair = self._last_pair.get(model)
            if err.code not in _ROUTER_UNREACHABLE or pair is None:
                raise router_error(err) from None
            log.warning("pick.without_router", code=err.code, reason=err.reason, decode=pair[1].node)
            return self._plain_pd(pair[0], model, len(ids), ROUTER_UNAVAILABLE, subset)
        structlog.contextvars.bind_contextvars(
            plan_ms=_ms(time.perf_counter() - started), generation=plan.generation
        )
        extend = plan.decision == pb.DECISION_EXTEND
        decode = endpoint_host_port(plan.decode.http_endpoint)
        prefill = None if extend else endpoint_host_port(plan.prefill.http_endpoint)
        if decode is None or (prefill is None and not extend):
            self._abort(plan, conversation, "the plan names a node without a host:port endpoint")
            raise _unavailable("the planned nodes have no host:port HTTP endpoint", "no_endpoint")
        if subset is not None and not subset.allows(decode):
            # The router places decode inside hints.decode_endpoints: one that ignored them (an
            # older release) planned around a node Envoy must not be sent to.
            self._abort(plan, conversation, "the planned decode node is outside the subset hint")
            log.error("pick.router_ignored_subset", decode=plan.decode.node, subset=len(subset))
            raise _no_endpoint(subset, "the router placed decode outside the subset hint")
        self._remember(model, plan)
        encoded = encode_plan(plan)
        if len(encoded) > self._max_plan_header_bytes:
            self._abort(plan, conversation, "the plan is too large for a header")
            log.warning("pick.plan_too_large", bytes=len(encoded), limit=self._max_plan_header_bytes)
            if extend:
                raise _unavailable("the plan is too large to send", "plan_too_large")
            return self._pd_pick(
                plain_plan(plan.prefill, plan.decode, len(ids)), "fallback", "plan_too_large"
            )
        pick = Pick(decode, outcome="planned", decision=_decision(plan))
        pick.reason = _name(plan.reason, pb.DecisionReason, "DECISION_REASON_")
        if prefill is not None:
            pick.headers[PREFILLER_HOST_PORT_HEADER] = prefill
        if plan.turn:
            pick.headers[TURN_HEADER] = plan.turn
        pick.headers[PLAN_HEADER] = encoded
        pick.headers[PROMPT_HEADER] = prompt_digest(ids)
        return pick

    async def _no_node(self, model: str, err: RouterFailure, subset: Subset | None) -> Pick:
        """The router answered that no healthy node of a role serves `model` (among the subset,
        for decode): what it says is dead is forgotten, never picked. No decode node: 503. No
        prefill node: the decode pod runs the whole request (no sidecar headers), on a ready
        decode node of the subset; none: 503."""
        reason = NO_NODE[err.reason or ""]
        log.warning(
            "pick.no_node", code=err.code, reason=err.reason, subset=None if subset is None else len(subset)
        )
        pair = self._last_pair.get(model)
        if err.reason == "NO_DECODE_NODE":
            decodes = self._decodes[model]
            for endpoint in [e for e in decodes if subset is None or subset.allows(e)]:
                del decodes[endpoint]
            decode = None if pair is None else endpoint_host_port(pair[1].http_endpoint)
            if decode is not None and (subset is None or subset.allows(decode)):
                del self._last_pair[model]
            self._ready.forget(self._settings.served_name(model))
            raise _no_endpoint(subset, "no healthy decode node serves the model")
        self._last_pair.pop(model, None)  # its prefill is not healthy
        try:
            ready = await self._ready.get(self._settings.served_name(model))
        except RouterFailure as failed:
            log.warning("pick.ready_unknown", code=failed.code, reason=failed.reason)
            raise _no_endpoint(subset, "no healthy prefill node, and no decode node known ready") from None
        for endpoint, _ in ready:
            if subset is None or subset.allows(endpoint):
                return Pick(endpoint, outcome="plain", reason=reason)
        raise _no_endpoint(subset, "no healthy prefill node, and no decode node ready")

    def _plain_pd(
        self, prefill: pb.Placement, model: str, tokens: int, reason: str, subset: Subset | None
    ) -> Pick:
        """Plain P->D on `prefill` and the most recently planned decode node of `model` that the
        subset allows; 503 when none does."""
        for endpoint, decode in reversed(self._decodes[model].items()):
            if subset is None or subset.allows(endpoint):
                return self._pd_pick(plain_plan(prefill, decode, tokens), "fallback", reason)
        raise _no_endpoint(subset, "the router does not answer and no decode node is known")

    @staticmethod
    def _pd_pick(plan: pb.PlanTurnResponse, outcome: str, reason: str) -> Pick:
        decode = endpoint_host_port(plan.decode.http_endpoint)
        prefill = endpoint_host_port(plan.prefill.http_endpoint)
        if decode is None or prefill is None:
            raise _unavailable("the known nodes have no host:port HTTP endpoint", "no_endpoint")
        headers = {PREFILLER_HOST_PORT_HEADER: prefill, PLAN_HEADER: encode_plan(plan)}
        return Pick(decode, headers, outcome=outcome, decision=_decision(plan), reason=reason)

    def _remember(self, model: str, plan: pb.PlanTurnResponse) -> None:
        if plan.prefill.http_endpoint and plan.decode.http_endpoint and plan.decision != pb.DECISION_EXTEND:
            # The P->D pair to fall back on (an extend plan names the decode holder twice).
            self._last_pair[model] = (plan.prefill, plan.decode)
        endpoint = endpoint_host_port(plan.decode.http_endpoint)
        if endpoint is not None:
            decodes = self._decodes[model]
            decodes[endpoint] = plan.decode
            decodes.move_to_end(endpoint)
            if len(decodes) > _KNOWN_DECODES:
                decodes.popitem(last=False)

    def _abort(self, plan: pb.PlanTurnResponse, conversation: str, reason: str) -> None:
        """AbortTurn of a plan not sent on, in the background (it releases a claimed retention)."""
        if not plan.turn:
            return

        async def abort() -> None:
            try:
                await self._router.abort_turn(plan.turn, conversation=conversation, reason=reason)
            except RouterFailure as err:
                log.warning("pick.abort_failed", code=err.code, reason=err.reason)

        self._background.spawn(abort(), "abort")

    # ---- no completion: any ready decode node ------------------------------------------

    async def _plain(self, subset: Subset | None) -> Pick:
        """A decode endpoint for a request that needs no plan: the least loaded one the router
        says is ready now that the subset allows (the configured models in order); with the
        router unreachable, the most recently planned one the subset allows; neither: 503."""
        for model in self._settings.models:
            try:
                ready = await self._ready.get(self._settings.served_name(model))
            except RouterFailure as err:
                if err.code not in _ROUTER_UNREACHABLE:
                    log.warning("pick.ready_unknown", code=err.code, reason=err.reason)
                    raise _unavailable(
                        f"the router did not say which decode nodes are ready ({err.code})", "router_error"
                    ) from None
                return self._remembered(subset, err)
            for endpoint, _ in ready:
                if subset is None or subset.allows(endpoint):
                    return Pick(endpoint, outcome="plain")
        raise _no_endpoint(subset, "no decode node is ready")

    def _remembered(self, subset: Subset | None, err: RouterFailure) -> Pick:
        """The router does not answer: the most recently planned decode node the subset allows."""
        known = [e for decodes in self._decodes.values() for e in reversed(decodes)]
        for endpoint in known:
            if subset is None or subset.allows(endpoint):
                log.warning("pick.without_router", code=err.code, reason=err.reason, decode=endpoint)
                return Pick(endpoint, outcome="plain", reason=ROUTER_UNAVAILABLE)
        raise _no_endpoint(subset, "the router does not answer and no decode node is known")


def _no_endpoint(subset: Subset | None, message: str) -> GatewayError:
    """503: no endpoint of the subset is eligible (`no_eligible_endpoint`), or none is ready."""
    if subset is None:
        return _unavailable(f"no ready endpoint: {message}", "no_ready_endpoint")
    return _unavailable(f"no endpoint of the subset hint is eligible: {message}", "no_eligible_endpoint")


def _unavailable(message: str, code: str) -> GatewayError:
    return GatewayError(503, f"service unavailable: {message}", type_="server_error", code=code)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
