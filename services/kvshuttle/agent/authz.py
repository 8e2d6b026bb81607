"""Which permission each AgentService RPC needs: status for those who watch the agent, the
NIXL moves for the router that orders them."""

from __future__ import annotations

from typing import Any

from kvshuttle.core.auth import Permission
from kvshuttle.serving.auth import Requirement, unknown_method

__all__ = ["policy"]

_NEEDS = {
    "GetStatus": Permission.AGENT_STATUS,
    "PullBlocks": Permission.AGENT_TRANSFER,
    "ParkRetention": Permission.AGENT_TRANSFER,
    "Prefetch": Permission.AGENT_TRANSFER,
}


def policy(method: str, request: Any) -> Requirement:
    if method in _NEEDS:
        return Requirement(_NEEDS[method])
    raise unknown_method(method)
