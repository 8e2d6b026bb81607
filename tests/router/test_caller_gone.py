"""Turns whose caller stopped waiting. A plan its caller will never receive claims nothing
(kvshuttle.router.claiming): a call whose deadline passed before its claim, or while the claim
was in flight, or that was cancelled with its claim in flight, leaves the retention unclaimed for
the conversation's next turn. A commit whose caller left runs to its end (Router._to_the_end):
the consumed claim is released and decode's KV stored; so does a registry call a commit stopped
waiting for (commit_registry_timeout_s). A real registry over gRPC; the router's
registry port holds calls back or lets the fake clock pass during them, as a saturated machine
does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from tests.router.helpers import CONV, MODEL, Tokens, add_node, settings
from tests.support.clock import FakeClock
from tests.support.registry_env import RegistryEnv, start_registry

from kvshuttle.client import RegistryClient
from kvshuttle.core.errors import Unavailable
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.grpc import convert
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.main import build_router
from kvshuttle.router.model import ClaimInfo, Decision, NewRetention, Plan, PlanRequest, Reason, RetentionInfo
from kvshuttle.router.router import Router
from kvshuttle.router.v1 import router_service_pb2 as pb

PROMPT = 4000  # long enough that reading the KV beats recomputing it
OUTPUT = 70


class SlowClaims(GrpcRegistryPort):
    """The real port; a claim or a put waits for `go` when told to, and the clock passes
    `takes_s` while the registry answers a claim."""

    def __init__(self, client: RegistryClient, clock: FakeClock) -> None:
        super().__init__(client)
        self.clock = clock
        self.takes_s = 0.0
        self.hold = False
        self.started = asyncio.Event()
        self.go = asyncio.Event()

    async def claim(
        self, name: str, *, holder: str, claim_ttl: float, request_id: str, shared: bool = False
    ) -> ClaimInfo:
        self.started.set()
        if self.hold:
            await self.go.wait()
        got = await super().claim(name, holder=holder, claim_ttl=claim_ttl, request_id=request_id)
        self.clock.advance(self.takes_s)
        return got

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        self.started.set()
        if self.hold:
            await self.go.wait()
        return await super().put_retention(new)


@dataclass
class Env:
    registry: RegistryEnv
    router: Router
    port: SlowClaims
    metrics: CollectorRegistry
    tokens: Tokens
    client: RegistryClient

    async def close(self) -> None:
        await self.client.close()
        await self.registry.channel.close()
        self.registry.registry.close()
        await self.registry.server.stop()

    async def plan(self, prompt: list[int], *, deadline_s: float | None = None) -> Plan:
        req = PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV, deadline_s=deadline_s)
        return await self.router.plan_turn(req)

    async def commit(self, plan: Plan, prompt: list[int]) -> list[int]:
        """The turn committed as a gateway does once decode answered; its whole sequence."""
        sequence = prompt + self.tokens(OUTPUT)
        params = self.tokens.decode_params(convert.plan_to_pb(plan), len(sequence))
        commit = pb.CommitTurnRequest(turn=plan.turn, token_ids=sequence, decode_kv_transfer_params=params)
        await self.router.commit_turn(convert.commit_request_from_pb(commit))
        return sequence

    async def first_turn(self) -> list[int]:
        """Turn 1 planned and committed: the conversation's retention 1 is stored, unclaimed."""
        prompt = self.tokens(PROMPT)
        return await self.commit(await self.plan(prompt), prompt)

    async def state(self, generation: int = 1) -> int:
        """The retention's state; 0 (unspecified) once it is gone."""
        name = f"{CONV}/retentions/{generation}"
        try:
            got = await self.registry.stub.GetRetention(reg_pb.GetRetentionRequest(name=name))
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            return reg_pb.RETENTION_STATE_UNSPECIFIED
        return got.retention.state

    def given_back(self) -> float:
        return self.metrics.get_sample_value("kvshuttle_router_claims_given_back_total") or 0.0


async def open_env(**policy: Any) -> Env:
    registry = await start_registry()
    config = settings(registry.address, **policy)
    client = RegistryClient.connect(config.registry.channel_options())
    port = SlowClaims(client, registry.clock)
    metrics = CollectorRegistry()
    router = build_router(config, port, registry.clock, metrics)
    await add_node(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL)
    await add_node(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE)
    return Env(registry, router, port, metrics, Tokens(), client)


@pytest.fixture(name="env")
async def environment() -> AsyncIterator[Env]:
    env = await open_env()
    yield env
    await env.close()


async def test_a_caller_that_waits_gets_its_claim(env: Env) -> None:
    sequence = await env.first_turn()
    plan = await env.plan(sequence + env.tokens(100), deadline_s=2.0)
    assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    assert await env.state() == reg_pb.RETENTION_STATE_CLAIMED
    assert env.given_back() == 0


async def test_a_deadline_passed_before_the_claim_claims_nothing(env: Env) -> None:
    sequence = await env.first_turn()
    env.port.started.clear()
    with pytest.raises(Unavailable, match="deadline passed"):
        await env.plan(sequence + env.tokens(100), deadline_s=0.0)
    assert not env.port.started.is_set()
    assert await env.state() == reg_pb.RETENTION_STATE_ACTIVE
    # The conversation's next turn reuses what the abandoned plan left alone.
    again = await env.plan(sequence + env.tokens(100))
    assert (again.decision, again.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)


async def test_a_deadline_passed_during_the_claim_gives_it_back(env: Env) -> None:
    sequence = await env.first_turn()
    env.port.takes_s = 3.0
    with pytest.raises(Unavailable, match="deadline passed"):
        await env.plan(sequence + env.tokens(100), deadline_s=2.0)
    assert env.given_back() == 1
    assert await env.state() == reg_pb.RETENTION_STATE_ACTIVE
    env.port.takes_s = 0.0
    again = await env.plan(sequence + env.tokens(100), deadline_s=2.0)
    assert (again.decision, again.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)


async def test_a_call_cancelled_with_its_claim_in_flight_gives_it_back_once_it_lands(env: Env) -> None:
    sequence = await env.first_turn()
    env.port.hold = True
    env.port.started.clear()
    planning = asyncio.ensure_future(env.plan(sequence + env.tokens(100), deadline_s=2.0))
    await env.port.started.wait()
    planning.cancel()
    with pytest.raises(asyncio.CancelledError):
        await planning
    env.port.hold = False
    env.port.go.set()  # the claim lands after its caller left
    for _ in range(500):
        if env.given_back() and await env.state() == reg_pb.RETENTION_STATE_ACTIVE:
            break
        await asyncio.sleep(0.01)
    assert env.given_back() == 1
    assert await env.state() == reg_pb.RETENTION_STATE_ACTIVE


async def test_a_commit_whose_caller_left_still_stores_and_releases(env: Env) -> None:
    sequence = await env.first_turn()
    prompt = sequence + env.tokens(100)
    plan = await env.plan(prompt)
    assert plan.decision == Decision.REUSE
    env.port.hold = True
    env.port.started.clear()
    committing = asyncio.ensure_future(env.commit(plan, prompt))
    await env.port.started.wait()
    committing.cancel()  # the gateway's CommitTurn deadline passed
    with pytest.raises(asyncio.CancelledError):
        await committing
    env.port.hold = False
    env.port.go.set()
    for _ in range(500):
        if await env.state(2) == reg_pb.RETENTION_STATE_ACTIVE:
            break
        await asyncio.sleep(0.01)
    # Turn 2's KV is the conversation's retention, turn 1's consumed claim released.
    assert await env.state(2) == reg_pb.RETENTION_STATE_ACTIVE
    assert await env.state(1) == reg_pb.RETENTION_STATE_UNSPECIFIED
    nxt = await env.plan(prompt + env.tokens(OUTPUT + 100))
    assert (nxt.decision, nxt.reason, nxt.generation) == (Decision.REUSE, Reason.REUSE_CHEAPER, 3)


async def test_a_put_past_the_commits_wait_still_lands_and_the_next_turn_reuses_it() -> None:
    env = await open_env(commit_registry_timeout_s=0.05)
    try:
        sequence = await env.first_turn()
        prompt = sequence + env.tokens(100)
        plan = await env.plan(prompt)
        env.port.hold = True
        env.port.started.clear()
        committing = asyncio.ensure_future(env.commit(plan, prompt))
        await env.port.started.wait()
        # The commit answers without waiting longer (nothing stored, as far as it knows) ...
        await committing
        assert await env.state(2) == reg_pb.RETENTION_STATE_UNSPECIFIED
        # ... and its put, slow but not lost, lands.
        env.port.hold = False
        env.port.go.set()
        for _ in range(500):
            if await env.state(2) == reg_pb.RETENTION_STATE_ACTIVE:
                break
            await asyncio.sleep(0.01)
        assert await env.state(2) == reg_pb.RETENTION_STATE_ACTIVE
        nxt = await env.plan(prompt + env.tokens(OUTPUT + 100))
        assert (nxt.decision, nxt.reason, nxt.generation) == (Decision.REUSE, Reason.REUSE_CHEAPER, 3)
    finally:
        await env.close()
