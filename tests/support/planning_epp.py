"""The endpoint picker's half of a turn, for the sidecar's tests: PlanTurn on a real router for
an OpenAI request, with the prompt tokenized, the conversation named and the cache salted as
the gateway's code does (what kvshuttle-epp does per request), and the plan written into the
request headers of the contract (kvshuttle.gateway.pd_headers). No ext_proc: the tests call it
as a client would call Envoy."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from kvshuttle.client import RouterClient
from kvshuttle.client.errors import KvshuttleRpcError
from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.core.hashing import cache_salt_digest
from kvshuttle.gateway.config import DEFAULT_TENANT
from kvshuttle.gateway.openai.prompt import Transcripts, prompt_ids
from kvshuttle.gateway.openai.protocol import Kind, parse_request
from kvshuttle.gateway.pd_headers import (
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
from kvshuttle.router.v1 import router_service_pb2 as pb


@dataclass
class _Transcripts:
    """FindTranscript over the typed client, as the gateway's router port answers it."""

    router: RouterClient

    async def find_transcript(
        self, tenant: str, model: str, lookup_key: bytes, *, conversation: str = ""
    ) -> pb.FindTranscriptResponse | None:
        try:
            return await self.router.find_transcript(tenant, model, lookup_key)
        except KvshuttleRpcError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise


@dataclass
class PlanningEpp:
    router: RouterClient
    model: str
    served_name: str
    tokenizer: ChatTokenizer
    salt_key: bytes | None
    tool_call_parser: str | None = None

    async def plan(
        self, kind: Kind, body: dict[str, Any], *, session: str | None = None
    ) -> tuple[pb.PlanTurnResponse, list[int]]:
        """The turn's plan and the prompt ids it was made for."""
        treq = parse_request(
            kind,
            body,
            models=[self.model],
            default_max_tokens=None,
            content_format={self.model: "string"},
            conversation_header=session,
            tool_parsers={self.model: self.tool_call_parser},
        )
        salt = CacheSalts.from_key(self.salt_key).salt(DEFAULT_TENANT, treq.cache_salt)
        tenant = f"tenants/{DEFAULT_TENANT}"
        transcripts = Transcripts(_Transcripts(self.router), tenant, self.served_name, salt)
        prompt = await prompt_ids(
            self.tokenizer, treq, max_tokens=2**20, background=BackgroundTasks(), transcripts=transcripts
        )
        conversation = (
            f"tenants/{DEFAULT_TENANT}/conversations/{treq.conversation_id}" if treq.conversation_id else ""
        )
        plan = await self.router.plan_turn(
            self.served_name,
            prompt.ids,
            conversation=conversation,
            request_id=uuid.uuid4().hex,
            cache_salt_sha256=cache_salt_digest(salt),
            tenant="" if conversation else tenant,
        )
        return plan, prompt.ids


def plan_headers(plan: pb.PlanTurnResponse, ids: list[int]) -> dict[str, str]:
    """The headers the EPP writes for `plan`, made for the prompt `ids` (no
    x-prefiller-host-port on extend)."""
    headers = {TURN_HEADER: plan.turn, PLAN_HEADER: encode_plan(plan), PROMPT_HEADER: prompt_digest(ids)}
    if plan.decision != pb.DECISION_EXTEND:
        target = endpoint_host_port(plan.prefill.http_endpoint)
        assert target is not None, plan.prefill
        headers[PREFILLER_HOST_PORT_HEADER] = target
    return headers
