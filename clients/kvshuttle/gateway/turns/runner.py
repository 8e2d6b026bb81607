"""The turn runner: one request's turn, PlanTurn -> prefill -> decode -> CommitTurn (or
AbortTurn), and the order of a conversation's turns. It knows no HTTP server and no gRPC: it
calls a RouterPort and an EnginePort (kvshuttle.gateway.turns.ports) and streams decode's chunks to
a DecodeSink, which kvshuttle.gateway.http.app implements over its HTTP response.

1. PlanTurn(model, prompt ids, `tenants/{tenant}/conversations/{id}`, request id, the SHA-256
   of the turn's cache salt): placement, and the `kv_transfer_params` prefill must get (with
   reuse: the retained KV, truncated to the verified prefix). A conversation's turn plans only
   once its previous turn's commit, in flight at this gateway, has landed, so it finds that
   turn's retention; a turn that reaches another gateway replica first recomputes.
2. Prefill: `/v1/completions` with the token-id prompt, `max_tokens: 1`, `stream: false`, the
   turn's `cache_salt` (the tenant's: kvshuttle.gateway.prompts.salts) and the plan's params. Its
   answer's `kv_transfer_params` go to decode unchanged, or none at all (never a hand-made
   dict: decode would hold such a request's blocks forever).
3. Decode: `/v1/completions` with the same prompt and `cache_salt`, P's params,
   `return_token_ids: true` and the client's sampling; streamed to the sink as it comes, or
   answered whole.
4. CommitTurn once decode has answered, in the background: the client's response does not
   wait for it. It carries decode's final `kv_transfer_params` (the non-streaming body, or the
   stream chunk that carries them: upstream 0.33, or 0.32 with the kvshuttle plugin; absent,
   nothing is retained), the sequence's token ids (prompt + output) and the timings the
   runner measured. It logs `turn.committed` (or `turn.commit_failed`, and aborts the turn).

Extend (DECISION_EXTEND): the router placed the whole turn on the decode node holding the
conversation's KV, whose prefix cache serves the history. Step 2 is skipped; decode gets the
plan's params (no remote blocks to read; it keeps the turn's KV for the next turn as usual).

A reuse turn's prefill (it reads retained KV from the node holding it) has a deadline of its
own, `reuse_prefill_timeout_s` (at most `prefill_timeout_s`): vLLM 0.32 never answers a prefill
whose KV holder died after prefill had connected to it (the READ fails, the request stays "KV
fetch in progress", kv_load_failure_policy notwithstanding). Past it, or when prefill answers
5xx or no valid answer, the runner closes that call (vLLM aborts the request) and runs prefill
once more on the same node as a plain recompute with turn 1's params; decode then reads that
prefill's KV as usual. The turn keeps the router's decision and reason, records `fallback`
("reuse_prefill_timeout" / "reuse_prefill_failed"), reuses 0 tokens, and is committed as usual
(the commit releases the plan's claim). A retry that fails too is the engine's error.

Whatever ends a planned turn before its commit (an engine error, the client leaving, shutdown)
aborts it, which releases a claimed retention, and goes on to the caller.

A router that cannot be reached (PlanTurn fails UNAVAILABLE or DEADLINE_EXCEEDED) does not fail
the turn: it runs plain P->D on the last prefill and decode endpoints a plan named for the model
(remembered per model from every successful PlanTurn), prefill getting turn 1's params
(`do_remote_decode: true, do_remote_prefill: false`, so decode still reads prefill's KV), with
decision `recompute` and reason `router_unavailable`, and nothing to commit or abort (no turn
handle). A router that answers but has no healthy node of a role for the model (UNAVAILABLE
with NO_PREFILL_NODE / NO_DECODE_NODE: an agent's lease lapsed, an engine restarting) does the
same with reason `no_prefill_node` / `no_decode_node`, so the two causes read apart. Only a model
no plan ever placed gets the router's error (503).

A turn planned elsewhere (the endpoint picker made the PlanTurn and the decode-side sidecar runs
the turn: kvshuttle.sidecar) is handed in with its plan: steps 2-4 as above, the same
aborts, and `committed()` lets the caller hold the answer's end until the commit has landed.

One module: a turn's steps, what each measures and when the turn must be aborted belong
together (the Turn record, the engines' request bodies and the CommitTurn timings with them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any, Protocol

import structlog
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvshuttle.core.digest import log_name
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import cache_salt_digest
from kvshuttle.gateway.errors import GatewayError, RouterFailure, engine_error, router_error
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.turns import record
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.ports import EnginePort, RouterPort
from kvshuttle.gateway.turns.record import Turn
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

__all__ = [
    "NO_NODE",
    "REUSE_PREFILL_FAILED",
    "REUSE_PREFILL_TIMEOUT",
    "ROUTER_UNAVAILABLE",
    "ClientGone",
    "DecodeSink",
    "Turn",
    "TurnRunner",
    "plain_plan",
]

log = structlog.get_logger("kvshuttle.gateway")

# The reason of a turn run without the router (X-Kvshuttle-Reason, the request.done line).
ROUTER_UNAVAILABLE = "router_unavailable"
# The reason of a turn run without a plan because the router found no node of a role (its
# ErrorInfo reason -> the turn's reason).
NO_NODE = {"NO_PREFILL_NODE": "no_prefill_node", "NO_DECODE_NODE": "no_decode_node"}
# PlanTurn failures that mean the router could not answer: the turn runs plain P->D instead.
_ROUTER_UNREACHABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
# Turn.fallback of a reuse turn whose prefill ran again as a plain recompute.
REUSE_PREFILL_TIMEOUT = "reuse_prefill_timeout"
REUSE_PREFILL_FAILED = "reuse_prefill_failed"
# Turn 1's prefill params: prefill computes the prompt and keeps its KV for decode to read.
_FIRST_TURN_PARAMS = KvTransferParams(do_remote_decode=True, do_remote_prefill=False)

_PROPAGATOR = TraceContextTextMapPropagator()


def _enum_name(value: str, prefix: str) -> str:
    return value.removeprefix(prefix).lower()


class ClientGone(Exception):
    """The client closed the connection while its response was being written."""


class DecodeSink(Protocol):
    """Where a streaming decode's chunks go: the client's response."""

    async def open(self) -> None:
        """Decode answered 200: start the client's response. Raises ClientGone."""
        ...

    async def send(self, chunk: dict[str, Any]) -> bool:
        """One decode chunk, as the client gets it; True when anything was written. Raises
        ClientGone."""
        ...


class TurnRunner:
    """Runs turns; holds the conversations' commits in flight so that a conversation's next
    turn plans after its previous one committed."""

    def __init__(
        self,
        router: RouterPort,
        engines: EnginePort,
        *,
        tracer: trace.Tracer,
        metrics: GatewayMetrics,
        background: BackgroundTasks,
        prefill_timeout_s: float,
        reuse_prefill_timeout_s: float,
        decode_timeout_s: float,
        commit_wait_s: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`clock`: what a turn's times are read from (seconds; the fleet simulator's virtual
        clock there)."""
        self._router = router
        self._clock = clock
        self._engines = engines
        self._tracer = tracer
        self._metrics = metrics
        self._background = background
        self._prefill_timeout_s = prefill_timeout_s
        # A reuse turn's prefill, before it is run again as a recompute.
        self._reuse_prefill_timeout_s = min(reuse_prefill_timeout_s, prefill_timeout_s)
        self._decode_timeout_s = decode_timeout_s
        # A commit taking longer than this no longer holds its conversation's next turn back.
        self._commit_wait_s = commit_wait_s
        # Conversation -> its latest turn's commit while in flight.
        self._commits: dict[str, asyncio.Task[None]] = {}
        # Model -> the prefill and decode a plan last placed it on: where its turns run while
        # the router cannot be reached (bounded by the gateway's configured models).
        self._last_placement: dict[str, tuple[pb.Placement, pb.Placement]] = {}

    async def complete(self, turn: Turn, planned: pb.PlanTurnResponse | None = None) -> dict[str, Any]:
        """Run `turn` with a non-streaming decode; decode's answer (its output is in
        `turn.output`, its commit on its way). `planned`: the turn's plan, made elsewhere (the
        endpoint picker, for the decode-side sidecar); None: PlanTurn here."""
        plan = await self._plan(turn) if planned is None else self._adopt(turn, _checked(turn, planned))
        async with self._aborting(turn, plan):
            prompt_json = record.prompt_json(turn.prompt_ids)
            decode_params = await self._prefill(turn, plan, prompt_json)
            answer = await self._decode(
                turn, plan, record.decode_body(turn, prompt_json, decode_params, stream=False)
            )
            self._commit(turn, plan)
        return answer

    async def stream(self, turn: Turn, sink: DecodeSink, planned: pb.PlanTurnResponse | None = None) -> None:
        """Run `turn` with decode's chunks streamed to `sink` as they come (`planned` as for
        complete)."""
        plan = await self._plan(turn) if planned is None else self._adopt(turn, _checked(turn, planned))
        async with self._aborting(turn, plan):
            prompt_json = record.prompt_json(turn.prompt_ids)
            decode_params = await self._prefill(turn, plan, prompt_json)
            body = record.decode_body(turn, prompt_json, decode_params, stream=True)
            await self._decode_stream(turn, plan, body, sink)
            self._commit(turn, plan)

    # ---- plan, prefill, decode -------------------------------------------------------------

    async def _plan(self, turn: Turn) -> pb.PlanTurnResponse:
        previous = self._commits.get(turn.conversation) if turn.conversation else None
        if previous is not None:
            # The previous turn's retention is what this turn may read: plan once it is stored.
            # (A commit never raises; a client leaving now does not cancel it.)
            started = self._clock()
            await asyncio.wait({previous}, timeout=self._commit_wait_s)
            turn.wait_s = self._clock() - started
        started = self._clock()
        try:
            plan = await self._router.plan_turn(
                turn.model,
                turn.prompt_ids,
                conversation=turn.conversation,
                request_id=turn.request_id,
                cache_salt_sha256=cache_salt_digest(turn.cache_salt) if turn.cache_salt else b"",
                expected_think_time_s=turn.expected_think_time_s,
                tenant=turn.tenant,
            )
        except RouterFailure as err:
            turn.plan_s = self._clock() - started
            placed = self._last_placement.get(turn.model)
            if err.code in _ROUTER_UNREACHABLE and placed is not None:
                return self._plain_pd(turn, err, placed)
            turn.outcome = "router_error"
            raise router_error(err) from None
        turn.plan_s = self._clock() - started
        if plan.prefill.http_endpoint and plan.decode.http_endpoint and plan.decision != pb.DECISION_EXTEND:
            # The P->D pair to fall back on (an extend plan names the decode holder twice).
            self._last_placement[turn.model] = (plan.prefill, plan.decode)
        return self._adopt(turn, plan)

    def _adopt(self, turn: Turn, plan: pb.PlanTurnResponse) -> pb.PlanTurnResponse:
        """Record the plan's decision on the turn; from here on an ending turn is aborted."""
        turn.decision = _enum_name(pb.Decision.Name(plan.decision), "DECISION_")
        turn.reason = _enum_name(pb.DecisionReason.Name(plan.reason), "DECISION_REASON_")
        turn.generation, turn.reused_tokens = plan.generation, plan.reusable_tokens
        if not turn.conversation and plan.conversation:
            turn.conversation = plan.conversation  # found by the prompt, or started by the router
        self._metrics.turns.labels(turn.decision, turn.reason).inc()
        self._metrics.reused_tokens.inc(plan.reusable_tokens)
        return plan

    def _plain_pd(
        self, turn: Turn, err: RouterFailure, placed: tuple[pb.Placement, pb.Placement]
    ) -> pb.PlanTurnResponse:
        """The turn's plan without the router: plain P->D on the model's last placement, with
        no turn handle (nothing to commit or abort)."""
        prefill, decode = placed
        turn.decision, turn.reason = "recompute", NO_NODE.get(err.reason or "", ROUTER_UNAVAILABLE)
        self._metrics.turns.labels(turn.decision, turn.reason).inc()
        log.warning(
            "turn.no_node" if err.reason in NO_NODE else "turn.router_unavailable",
            code=err.code,
            reason=err.reason,
            prefill=prefill.node,
            decode=decode.node,
            request_id=turn.request_id,
        )
        return plain_plan(prefill, decode, len(turn.prompt_ids))

    @asynccontextmanager
    async def _aborting(self, turn: Turn, plan: pb.PlanTurnResponse) -> AsyncIterator[None]:
        """Abort the turn when anything ends it before its commit; the exception goes on."""
        try:
            yield
        except BaseException as exc:
            if not turn.settled:
                turn.settled = True
                why = exc.message if isinstance(exc, GatewayError) else type(exc).__name__
                if isinstance(exc, asyncio.CancelledError | ClientGone):
                    why = "client disconnected"
                if plan.turn:  # a turn run without the router holds nothing
                    await self._abort(plan.turn, turn.conversation, why)
                if isinstance(exc, GatewayError):
                    engine = exc.status in (502, 504) or exc.code == "engine_rejected"
                    turn.outcome = "engine_error" if engine else "error"
            raise

    def _engine_span(self, role: str, placed: pb.Placement) -> AbstractContextManager[trace.Span]:
        """The current span of a request to the engine the plan placed on `role`."""
        return self._tracer.start_as_current_span(
            role,
            kind=SpanKind.CLIENT,
            attributes={"kvshuttle.node": placed.node, "server.address": placed.http_endpoint},
        )

    @staticmethod
    def _headers(request_id: str) -> dict[str, str]:
        headers = {"X-Request-Id": request_id}
        _PROPAGATOR.inject(headers)  # the current span: prefill's or decode's
        return headers

    async def _prefill(
        self, turn: Turn, plan: pb.PlanTurnResponse, prompt_json: bytes
    ) -> dict[str, Any] | None:
        """Run prefill; the params decode must get (P's, unchanged), or None for none. A reuse
        turn's prefill that does not answer by its deadline, or fails, runs once more as a
        plain recompute (the module's docstring)."""
        if not plan.prefill.http_endpoint or not plan.decode.http_endpoint:
            raise engine_error(
                "prefill", None, "the router placed the turn on a node without an HTTP endpoint"
            )
        if plan.decision == pb.DECISION_EXTEND:
            # The holder runs the whole turn: no prefill request, the plan's params to decode.
            return to_vllm(plan.prefill_kv_transfer_params)
        fields: dict[str, Any] = {
            "model": turn.model,
            **turn.prefill_params,
            "max_tokens": 1,
            "stream": False,
        }
        if turn.cache_salt:
            fields["cache_salt"] = turn.cache_salt
        if plan.HasField("prefill_kv_transfer_params"):
            fields["kv_transfer_params"] = to_vllm(plan.prefill_kv_transfer_params)
        started = self._clock()
        try:
            if plan.decision != pb.DECISION_REUSE:
                return await self._prefill_call(turn, plan, prompt_json, fields, "-p")
            try:
                return await self._prefill_call(
                    turn, plan, prompt_json, fields, "-p", deadline_s=self._reuse_prefill_timeout_s
                )
            except TimeoutError:  # the deadline (the engine client raises GatewayError only)
                why = REUSE_PREFILL_TIMEOUT
            except GatewayError as exc:
                if exc.status == 504:  # the engine client's own timeout
                    why = REUSE_PREFILL_TIMEOUT
                elif exc.status == 502:  # 5xx, connection error, malformed answer
                    why = REUSE_PREFILL_FAILED
                else:  # the request itself (400) or an overloaded engine (429): not retried
                    raise
            waited_s = self._clock() - started
            turn.fallback, turn.reused_tokens = why, 0
            self._metrics.reuse_fallbacks.labels(why).inc()
            log.warning(
                "prefill.reuse_fallback",
                node=plan.prefill.node,
                why=why,
                waited_ms=_ms(waited_s),
                request_id=turn.request_id,
            )
            fields["kv_transfer_params"] = to_vllm(_FIRST_TURN_PARAMS)
            # A request id of its own: vLLM may still be aborting the first one.
            return await self._prefill_call(turn, plan, prompt_json, fields, "-pr")
        finally:
            turn.prefill_s = self._clock() - started

    async def _prefill_call(
        self,
        turn: Turn,
        plan: pb.PlanTurnResponse,
        prompt_json: bytes,
        fields: dict[str, Any],
        id_suffix: str,
        *,
        deadline_s: float | None = None,
    ) -> dict[str, Any] | None:
        """One prefill request; its params for decode, or None. Past `deadline_s` the call is
        cancelled (its connection closed: vLLM aborts the request) and TimeoutError raised."""
        with self._engine_span("prefill", plan.prefill) as span:
            if turn.fallback:
                span.set_attribute("kvshuttle.fallback", turn.fallback)
            call = self._engines.complete(
                "prefill",
                plan.prefill.http_endpoint,
                record.request_body(prompt_json, fields),
                self._headers(f"{turn.request_id}{id_suffix}"),
                timeout_s=self._prefill_timeout_s,
            )
            if deadline_s is None:
                body = await call
            else:
                async with asyncio.timeout(deadline_s):
                    body = await call
            params = body.get("kv_transfer_params")
            if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
                # No params (P runs without the NIXL connector), or not P's kind: decode computes
                # the prompt itself. A made-up dict instead would make decode hold its blocks.
                log.warning(
                    "prefill.no_kv_transfer_params", node=plan.prefill.node, got=type(params).__name__
                )
                return None
            cached = params.get("remote_prefill_cached_tokens")
            if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
                turn.remote_cached_tokens = cached
                span.set_attribute("kvshuttle.remote_cached_tokens", cached)
            return params

    async def _decode(self, turn: Turn, plan: pb.PlanTurnResponse, body: bytes) -> dict[str, Any]:
        with self._engine_span("decode", plan.decode):
            started = self._clock()
            try:
                answer = await self._engines.complete(
                    "decode",
                    plan.decode.http_endpoint,
                    body,
                    self._headers(f"{turn.request_id}-d"),
                    timeout_s=self._decode_timeout_s,
                )
            finally:
                turn.decode_s = turn.decode_ttfb_s = self._clock() - started
        choices = answer.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise engine_error("decode", None, "the answer has no choices")
        turn.ttft_s = self._clock() - turn.arrived
        turn.output.take_chunk(answer)
        return answer

    async def _decode_stream(
        self, turn: Turn, plan: pb.PlanTurnResponse, body: bytes, sink: DecodeSink
    ) -> None:
        out = turn.output
        started = self._clock()
        try:
            with self._engine_span("decode", plan.decode):
                headers = self._headers(f"{turn.request_id}-d")
                async with self._engines.stream("decode", plan.decode.http_endpoint, body, headers) as chunks:
                    await sink.open()  # decode answered 200: the client gets 200 too
                    async for chunk in chunks:
                        if not out.chunks:
                            turn.decode_ttfb_s = self._clock() - started
                        out.take_chunk(chunk)  # before the sink drops what the client must not see
                        if await sink.send(chunk) and turn.ttft_s is None:
                            turn.ttft_s = self._clock() - turn.arrived
                turn.decode_s = self._clock() - started
                if out.finish_reason is None:
                    raise engine_error("decode", None, "the stream ended without a finish_reason")
        except (ClientGone, GatewayError):
            if turn.decode_s is None:
                turn.decode_s = self._clock() - started
            raise

    # ---- commit and abort ------------------------------------------------------------------

    async def committed(self, conversation: str) -> None:
        """Wait (at most commit_wait_s) until the conversation's commit in flight, if any, has
        landed. For a runner whose turns are planned elsewhere (the sidecar behind an endpoint
        picker): the next turn's plan cannot wait here for this one's retention, so the answer's
        end does."""
        task = self._commits.get(conversation) if conversation else None
        if task is not None:
            await asyncio.wait({task}, timeout=self._commit_wait_s)

    def _commit(self, turn: Turn, plan: pb.PlanTurnResponse) -> None:
        """CommitTurn in the background: the client's answer is complete without it, and a
        client leaving now must not lose the retention decode holds. The conversation's next
        turn waits for it (in _plan)."""
        turn.settled = True
        turn.output_tokens = len(turn.output.token_ids)
        if not plan.turn:  # run without the router: nothing to commit, decode's KV lapses
            log.debug("turn.not_committed", reason=turn.reason, request_id=turn.request_id)
            return
        call = self._commit_call(plan.turn, turn, record.timings(turn))
        task = self._background.spawn(call, "commit")
        if conversation := turn.conversation:
            self._commits[conversation] = task

            def forget(t: asyncio.Task[None]) -> None:
                if self._commits.get(conversation) is t:
                    del self._commits[conversation]

            task.add_done_callback(forget)

    async def _commit_call(self, handle: str, turn: Turn, timings: pb.TurnTimings) -> None:
        """The CommitTurn call (decode's params converted here, off the response's path) and its
        log line; a failed commit aborts the turn, which releases a claimed retention the
        commit did not."""
        started = self._clock()
        out = turn.output
        params: KvTransferParams | None = None
        if out.kv_transfer_params is not None:
            try:
                params = from_vllm(out.kv_transfer_params, "decode.kv_transfer_params")
            except InvalidArgument as exc:
                log.warning("decode.bad_kv_transfer_params", error=exc.message)
        elif out.finish_reason is not None:
            log.debug("decode.no_kv_transfer_params", stop_strings=turn.stop_strings)
        try:
            result = await self._router.commit_turn(
                handle,
                conversation=turn.conversation,
                prompt_token_ids=turn.prompt_ids,
                output_token_ids=out.token_ids if out.ids_complete else [],
                decode_kv_transfer_params=params,
                timings=timings,
                turn_end=record.turn_end(turn),
                transcript=turn.transcript(out) if turn.transcript is not None else None,
            )
        except RouterFailure as err:
            self._metrics.commits.labels("failed").inc()
            log.warning(
                "turn.commit_failed",
                code=err.code,
                reason=err.reason,
                message=err.message[:300],
                commit_ms=_ms(self._clock() - started),
                request_id=turn.request_id,
            )
            await self._abort_call(handle, turn.conversation, "commit failed")
            return
        self._metrics.commits.labels("stored" if result.retention else "nothing_retained").inc()
        log.info(
            "turn.committed",
            retention=log_name(result.retention),
            commit_ms=_ms(self._clock() - started),
            request_id=turn.request_id,
        )

    async def _abort(self, handle: str, conversation: str, reason: str) -> None:
        """AbortTurn, shielded from the request's cancellation; failures are logged, not raised."""
        call = self._abort_call(handle, conversation, reason[:300])
        await asyncio.shield(self._background.spawn(call, "abort"))

    async def _abort_call(self, handle: str, conversation: str, reason: str) -> None:
        try:
            await self._router.abort_turn(handle, conversation=conversation, reason=reason)
        except RouterFailure as err:
            # FAILED_PRECONDITION: the turn is settled already (committed, aborted or lapsed).
            level = log.debug if err.code == "FAILED_PRECONDITION" else log.warning
            level("turn.abort_failed", code=err.code, reason=err.reason)


def plain_plan(prefill: pb.Placement, decode: pb.Placement, prompt_tokens: int) -> pb.PlanTurnResponse:
    """A turn's plan made without the router: plain P->D on `prefill` and `decode`, with no turn
    handle (nothing to commit or abort), prefill getting turn 1's params so that it computes the
    prompt and keeps its KV for decode to read."""
    return pb.PlanTurnResponse(
        prefill=prefill,
        decode=decode,
        prefill_kv_transfer_params=_FIRST_TURN_PARAMS,
        decision=pb.DECISION_RECOMPUTE,
        tokens_to_compute=prompt_tokens,
    )


def _checked(turn: Turn, plan: pb.PlanTurnResponse) -> pb.PlanTurnResponse:
    """A plan made elsewhere, if it can be this prompt's: it computes `tokens_to_compute` of the
    prompt past at least `reusable_tokens`, so a shorter prompt is another one (the planner
    tokenized differently: other models or templates), and reading its KV would be wrong."""
    if len(turn.prompt_ids) < plan.tokens_to_compute + plan.reusable_tokens:
        raise GatewayError(
            502,
            f"the plan is for a prompt of at least {plan.tokens_to_compute + plan.reusable_tokens} "
            f"tokens; this one has {len(turn.prompt_ids)}",
            type_="server_error",
            code="plan_mismatch",
        )
    return plan


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
