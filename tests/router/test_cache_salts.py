"""Cache salts and the router: a prompt's chain starts from its cache salt's root, so KV retained
under one salt (one tenant's, or one client salt's) never verifies for a prompt under another,
and prefill's local hits count only blocks cached under the prompt's own salt."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from tests.router.domain_cluster import BS, CONV, MODEL, Cluster

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import ROOT_HASH, cache_salt_digest, chain_hashes, salted_root
from kvshuttle.core.kv_events import BlockStored, EventBatch
from kvshuttle.router.grpc import convert
from kvshuttle.router.model import CommitRequest, Decision, Plan, PlanRequest, Reason
from kvshuttle.router.router import Router
from kvshuttle.router.turns import TurnCodec
from kvshuttle.router.v1 import router_service_pb2 as pb

SALT_A = cache_salt_digest("salt-of-tenant-a")
SALT_B = cache_salt_digest("salt-of-tenant-b")


def decode_params(cluster: Cluster, plan: Plan, total: int) -> dict[str, Any]:
    # As the decode node is registered (the registry refuses params naming another side channel).
    return {**cluster.decode_params(plan, total), "remote_port": 5600}


async def turn(
    router: Router, cluster: Cluster, prompt: list[int], salt: bytes, conversation: str = CONV
) -> tuple[Plan, list[int]]:
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=conversation, cache_salt_sha256=salt)
    )
    sequence = prompt + cluster.tokens(64)
    await router.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=decode_params(cluster, plan, len(sequence)),
        )
    )
    return plan, sequence


async def test_a_retention_is_chained_from_its_salts_root(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await turn(router, cluster, cluster.tokens(600), SALT_A)
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/1")
    assert list(stored.block_hashes) == chain_hashes(seq, BS, parent=salted_root(SALT_A))
    assert list(stored.block_hashes[:1]) != chain_hashes(seq[:BS], BS)  # not the unsalted chain


@pytest.mark.parametrize("replica", ["same", "other"])
@pytest.mark.parametrize(("stored_under", "asked_under"), [(SALT_A, SALT_B), (SALT_A, b""), (b"", SALT_B)])
async def test_the_same_tokens_under_another_salt_never_reuse(
    cluster: Cluster, replica: str, stored_under: bytes, asked_under: bytes
) -> None:
    """The plan comes from the committing replica's hint or from the registry: no reuse either way."""
    a = cluster.router()
    b = a if replica == "same" else cluster.router()
    _, seq = await turn(a, cluster, cluster.tokens(600), stored_under)
    prompt = seq + cluster.tokens(100)
    plan = await b.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=prompt, conversation=CONV, cache_salt_sha256=asked_under)
    )
    assert (plan.decision, plan.reason, plan.reusable_tokens) == (
        Decision.RECOMPUTE,
        Reason.PREFIX_MISMATCH,
        0,
    )
    # Superseded, the retention is released: prefill is told to read none of it (and so frees
    # its blocks on the holder); no token of it is reused.
    assert plan.claimed == f"{CONV}/retentions/1"
    assert plan.prefill_kv_transfer_params["remote_num_tokens"] == 0
    # The commit of that turn chains from the turn's own salt, whatever replica commits it.
    sequence = prompt + cluster.tokens(10)
    await a.commit_turn(
        CommitRequest(
            turn=plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=decode_params(cluster, plan, len(sequence)),
        )
    )
    stored = await cluster.registry.get_retention(f"{CONV}/retentions/2")
    assert list(stored.block_hashes) == chain_hashes(sequence, BS, parent=salted_root(asked_under))


async def test_the_same_salt_reuses_turn_after_turn(cluster: Cluster) -> None:
    router = cluster.router()
    _, seq = await turn(router, cluster, cluster.tokens(600), SALT_A)
    for _ in range(2):
        prompt = seq + cluster.tokens(100)
        plan, seq = await turn(router, cluster, prompt, SALT_A)
        assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
        assert plan.reusable_tokens == len(prompt) - 100  # all the retention holds, to the token
    other = cluster.router()  # from the registry, on another replica: the same
    plan, _ = await turn(other, cluster, seq + cluster.tokens(100), SALT_A)
    assert plan.decision == Decision.REUSE


async def test_local_hits_count_only_blocks_under_the_prompts_salt(cluster: Cluster) -> None:
    """Another tenant's cached copy of the same tokens is no hit: placement and the decision
    (and the X-Kvshuttle-* headers made of them) reveal nothing of what others have cached."""
    router = cluster.router(node_max_age_s=0.0)
    _, seq = await turn(router, cluster, cluster.tokens(600), SALT_A)
    blocks = len(seq) // BS
    p0 = await cluster.registry.get_node("nodes/p0")
    events = (
        BlockStored(tuple(range(1, blocks + 1)), None, tuple(seq[: blocks * BS]), BS, None, "GPU", SALT_B),
    )
    await cluster.registry.report_block_events("nodes/p0", p0.incarnation, [EventBatch(0, 0.0, events)])
    plan = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=seq + [1] * 50, conversation=CONV, cache_salt_sha256=SALT_A)
    )
    assert (plan.decision, plan.reason) == (Decision.REUSE, Reason.REUSE_CHEAPER)
    assert plan.tokens_to_compute == len(seq) + 50 - plan.reusable_tokens
    await router.abort_turn(plan.turn, "test")
    # Under salt B the same blocks are prefill's own: reading them remotely buys nothing (and
    # salt B's prompt could not read salt A's retention anyway).
    plan = await router.plan_turn(
        PlanRequest(
            model=MODEL,
            prompt_token_ids=seq + [1] * 50,
            conversation="tenants/acme/conversations/other",
            cache_salt_sha256=SALT_B,
        )
    )
    assert plan.tokens_to_compute == len(seq) + 50 - blocks * BS


@pytest.mark.parametrize("digest", [b"salt-of-tenant-a", b"\x00" * 16, b"\x00" * 33])
async def test_a_salt_digest_must_be_a_sha256(cluster: Cluster, digest: bytes) -> None:
    router = cluster.router()
    with pytest.raises(InvalidArgument) as err:
        await router.plan_turn(
            PlanRequest(model=MODEL, prompt_token_ids=[1] * 40, conversation=CONV, cache_salt_sha256=digest)
        )
    assert err.value.field == "cache_salt_sha256"


def test_the_digest_travels_in_plan_turn_request() -> None:
    request = pb.PlanTurnRequest(model=MODEL, prompt_token_ids=[1, 2], cache_salt_sha256=SALT_A)
    assert convert.plan_request_from_pb(request).cache_salt_sha256 == SALT_A
    assert convert.plan_request_from_pb(pb.PlanTurnRequest(model=MODEL)).cache_salt_sha256 == b""


async def test_turn_handles_without_a_root_still_decode_as_unsalted(cluster: Cluster) -> None:
    """Handles issued before salts existed carry no chain_root: they were all unsalted."""
    router = cluster.router()
    plan = await router.plan_turn(PlanRequest(model=MODEL, prompt_token_ids=[1] * 40, conversation=CONV))
    codec = TurnCodec(b"k" * 32)
    state = codec.decode(plan.turn)
    assert state.chain_root == ROOT_HASH
    payload = {k: v for k, v in json.loads(_payload(plan.turn)).items() if k != "chain_root"}
    assert codec.decode(_sign(codec, payload)).chain_root == ROOT_HASH
    salted = await router.plan_turn(
        PlanRequest(model=MODEL, prompt_token_ids=[1] * 40, conversation=CONV, cache_salt_sha256=SALT_A)
    )
    assert codec.decode(salted.turn).chain_root == salted_root(SALT_A)
    np.testing.assert_array_equal(
        router.chains.chain(CONV, np.array([1] * 40, dtype=np.uint32), BS, root=salted_root(SALT_A)),
        chain_hashes([1] * 40, BS, parent=salted_root(SALT_A)),
    )


def _payload(handle: str) -> bytes:
    body = handle.removeprefix("turns/").partition(".")[0]
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def _sign(codec: TurnCodec, payload: dict[str, Any]) -> str:
    data = json.dumps(payload, separators=(",", ":")).encode()
    body = base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    sig = base64.urlsafe_b64encode(codec._sign(data)).rstrip(b"=").decode()
    return f"turns/{body}.{sig}"
