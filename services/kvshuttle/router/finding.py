"""Which conversation a turn that names none belongs to: the tenant's retention the prompt
continues, found in the registry by the prompt's chain (FindRetention), or a new conversation.

Found only among the tenant's own retentions, under the prompt's cache salt (the chain starts
from its root): never another tenant's, never KV computed under another salt. What is found is
only a conversation: the plan then reads and verifies its retention as a named conversation's.
"""

from __future__ import annotations

import os

from kvshuttle.core.errors import Unavailable
from kvshuttle.core.limits import MAX_BLOCK_HASHES
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router.chains import Chain, Tokens
from kvshuttle.router.model import PlanRequest, RetentionInfo
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.placement import candidates
from kvshuttle.router.timing import CallTimer

__all__ = ["NEW_CONVERSATION_PREFIX", "ConversationFinder", "new_conversation", "router_started"]

# The ids of conversations the router starts for requests that name none.
NEW_CONVERSATION_PREFIX = "anon-"


def router_started(conversation: str) -> bool:
    """Whether the router started `conversation` (new_conversation's), not a client."""
    return conversation.rsplit("/", 1)[-1].startswith(NEW_CONVERSATION_PREFIX)


def new_conversation(tenant: str) -> str:
    """A new conversation, named by the router (96 random bits), in the caller's tenant."""
    return f"tenants/{tenant}/conversations/{NEW_CONVERSATION_PREFIX}{os.urandom(12).hex()}"


class ConversationFinder:
    def __init__(self, parts: RouterParts) -> None:
        self._parts = parts

    async def conversation_of(
        self, req: PlanRequest, tenant: str, tokens: Tokens, root: int, timer: CallTimer, *, reuse: bool
    ) -> tuple[str, str, str]:
        """The conversation of a request that names only its tenant, the one it forks from and
        the one it continues ("" for none). The conversation whose retention shares the longest
        prefix with the prompt (ending at the retention's chain end or its prompt's last full
        block) is found. With forks sharing (policy share_forks) a new conversation forks from
        it. Without, it is continued, unless another turn has claimed that retention (a sibling
        of a fork reads it; not this replica's own move of it): then a new conversation forks
        from it. None matches (or reuse is off): a new one."""
        found: RetentionInfo | None = None
        chain: Chain | None = None
        block_size = 0
        if reuse:
            try:
                nodes = await timer.registry(self._parts.nodes.nodes(req.model))
                pool = candidates(nodes, NodeRole.PREFILL, req.model)
                if pool:  # none: the plan answers NO_PREFILL_NODE
                    block_size = pool[0].block_size
                    chain = self._parts.chains.chain("", tokens, block_size, root=root, remember=False)
                if chain is not None and len(chain):  # a prompt shorter than a block finds nothing
                    # The registry looks up at most MAX_BLOCK_HASHES (a prompt of tiny blocks has more).
                    found = await timer.registry(
                        self._parts.port.find_by_chain(
                            tenant, req.model, block_size, chain[:MAX_BLOCK_HASHES]
                        )
                    )
            except Unavailable as err:
                if err.reason != ErrorReason.REGISTRY_UNAVAILABLE:
                    raise
                # The plan degrades on its own; this turn starts a conversation of its own.
        conversation, parent, continued = self._settle(tenant, found)
        if chain is not None:
            # Hashed once: the plan's chain of the conversation starts from this one.
            self._parts.chains.adopt(conversation, tokens, chain, block_size, root=root)
        return conversation, parent, continued

    def _settle(self, tenant: str, found: RetentionInfo | None) -> tuple[str, str, str]:
        if found is None:
            return new_conversation(tenant), "", ""
        conversation = found.name.rsplit("/", 2)[0]
        if self._parts.policy.share_forks:
            # Every turn found so forks from it: the retention stays for the other turns that
            # continue the same history (kvshuttle.router.fork_reads), and no turn's commit
            # replaces what a sibling reads.
            return new_conversation(tenant), conversation, ""
        shuttle = self._parts.shuttle
        if found.claimed and (shuttle is None or shuttle.move_in_flight(conversation) is None):
            return new_conversation(tenant), conversation, ""
        # Unclaimed, or claimed by this replica's own move (a park or a prefetch), which the plan
        # waits for and then reads where it landed.
        return conversation, "", conversation
