"""A plan's claim on the conversation's retention (ClaimRetention): won, lost to another turn
(CLAIM_LOST, or FORK_UNSAFE for a fork), or gone (EXPIRED) - and never left behind by a plan its
caller will not receive.

A claim nobody commits or aborts keeps the retention claimed until the claim's TTL, and every
later turn of the conversation recomputes meanwhile (CLAIM_LOST; under overload, when the
gateway's PlanTurn deadline passes while the router still works on the plan, this is what made
reuse fall for tens of seconds after the overload itself had passed). So:

- a call whose deadline (PlanRequest.deadline_s) has passed when its claim is due claims
  nothing, and one whose deadline passed while the claim was in flight releases the claim
  unread (keep: the retention stays for the next turn); both are refused with Unavailable (the
  caller is gone; a retry with the same request id plans afresh, as no plan was remembered);
- a call cancelled while its claim is in flight gives the claim back once it lands.

Counted in kvshuttle_router_claims_given_back; a give-back that fails leaves the claim to lapse
on its TTL, as before.
"""

from __future__ import annotations

import asyncio
import hashlib

import structlog
from opentelemetry import trace

from kvshuttle.core.errors import Aborted, FailedPrecondition, NotFound, Unavailable
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router.model import ClaimInfo, Reason, RetentionInfo
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.plan_issue import PlanCall, PlanContext

__all__ = ["Claimer"]

log = structlog.get_logger("kvshuttle.router")


class Claimer:
    def __init__(self, parts: RouterParts) -> None:
        self._parts = parts
        # Claims of cancelled calls being given back (held so that they run to the end).
        self._giving_back: set[asyncio.Task[None]] = set()

    async def claim(
        self, ctx: PlanContext, retention: RetentionInfo, *, shared: bool = False
    ) -> tuple[ClaimInfo | None, Reason]:
        """The claim of `retention` (`shared`: as one of the forks reading it from a pool)."""
        req = ctx.call.req
        # The registry scopes claim ids by retention; a digest keeps the id within its bounds. The
        # request's fingerprint is in it: another prompt planned under the same request id makes
        # a claim of its own (and loses it), never shares the first plan's.
        request_id = (
            hashlib.sha256(f"claim|{req.request_id}|{ctx.call.fingerprint.hex()}".encode()).hexdigest()[:32]
            if req.request_id
            else ""
        )
        with self._parts.tracer.start_as_current_span("claim") as span:
            span.set_attribute("kvshuttle.retention.generation", retention.generation)
            self._check_caller_waits(ctx.call, span)
            claiming = asyncio.ensure_future(
                self._parts.port.claim(
                    retention.name,
                    holder=f"router:{req.request_id or 'plan'}",
                    claim_ttl=self._parts.policy.claim_ttl_s,
                    request_id=request_id,
                    shared=shared,
                )
            )
            try:
                claim = await ctx.call.timer.registry(asyncio.shield(claiming))
            except asyncio.CancelledError:
                self._give_back_when_won(claiming)
                raise
            except Aborted:
                span.set_attribute("kvshuttle.claim", "lost")
                return None, Reason.FORK_UNSAFE if ctx.fork else Reason.CLAIM_LOST
            except (FailedPrecondition, NotFound) as err:
                span.set_attribute("kvshuttle.claim", err.reason)
                if err.reason == ErrorReason.RETENTION_NOT_SHAREABLE:  # moved back to a decode node
                    return None, Reason.FORK_UNSAFE
                return None, Reason.EXPIRED
            if self._caller_gone(ctx.call):
                span.set_attribute("kvshuttle.claim", "given_back")
                await self._give_back(claim)
                raise _caller_gone_error()
            span.set_attribute("kvshuttle.claim", "won")
            return claim, Reason.REUSE_CHEAPER

    def _caller_gone(self, call: PlanCall) -> bool:
        return call.give_up_at is not None and self._parts.clock.now() >= call.give_up_at

    def _check_caller_waits(self, call: PlanCall, span: trace.Span) -> None:
        """Unavailable when the caller has stopped waiting: its plan would reach nobody."""
        if self._caller_gone(call):
            span.set_attribute("kvshuttle.claim", "caller_gone")
            raise _caller_gone_error()

    async def _give_back(self, claim: ClaimInfo) -> None:
        """Release a claim no plan will use, the retention kept for the next turn (best effort:
        a claim not released lapses on its TTL)."""
        self._parts.metrics.claims_given_back.inc()
        try:
            await self._parts.port.release(claim.retention.name, claim_id=claim.claim_id, keep=True)
        except (Unavailable, FailedPrecondition, NotFound) as err:
            log.warning("plan.give_back_failed", reason=err.reason)

    def _give_back_when_won(self, claiming: asyncio.Future[ClaimInfo]) -> None:
        """The call was cancelled with its claim in flight: give the claim back once it lands."""

        def landed(done: asyncio.Future[ClaimInfo]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            task = asyncio.ensure_future(self._give_back(done.result()))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

        claiming.add_done_callback(landed)


def _caller_gone_error() -> Unavailable:
    return Unavailable("the caller's deadline passed before its plan was ready: nothing claimed, plan again")
