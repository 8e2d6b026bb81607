"""Which permission each RouterService RPC needs, and the tenant it acts for: PlanTurn's
conversation (or, without one, its tenant) names it, as FindTranscript's tenant does; CommitTurn
and AbortTurn carry a signed turn handle whose conversation does (a handle is verified here, so a
gateway cannot commit or abort another tenant's turn); ListReadyDecodes acts for no tenant (the
permission to plan turns, for any tenant)."""

from __future__ import annotations

from typing import Any

from kvshuttle.core.auth import Permission
from kvshuttle.core.names import tenant_of
from kvshuttle.router.turns import TurnCodec
from kvshuttle.serving.auth import MethodPolicy, Requirement, unknown_method

__all__ = ["turn_policy"]


def turn_policy(codec: TurnCodec) -> MethodPolicy:
    """The router's policy; `codec` verifies the handles of CommitTurn and AbortTurn."""

    def policy(method: str, request: Any) -> Requirement:
        if method == "PlanTurn":
            # Its conversation names the tenant; without one, its `tenant` does (checked to be
            # the conversation's own when both are set).
            return Requirement(Permission.TURNS, tenant=tenant_of(request.conversation or request.tenant))
        if method == "FindTranscript":
            return Requirement(Permission.TURNS, tenant=tenant_of(request.tenant))
        if method in ("CommitTurn", "AbortTurn"):
            # A handle that does not verify names no tenant: the servicer refuses it
            # (TURN_NOT_FOUND / INVALID_ARGUMENT) before anything is touched.
            try:
                conversation = codec.decode(request.turn).conversation
            except Exception:
                return Requirement(Permission.TURNS)
            return Requirement(Permission.TURNS, tenant=tenant_of(conversation))
        if method == "ListReadyDecodes":
            # Where a turn could be placed is no tenant's data: any caller that may plan turns
            # (for some tenant) may ask, as a gateway's plans name the nodes anyway.
            return Requirement(Permission.TURNS)
        raise unknown_method(method)

    return policy
