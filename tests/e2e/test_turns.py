"""Whole turns on real vLLM (CPU build, tiny model): gateway -> router -> registry, prefill and
decode with NixlConnector both ways, agents forwarding KV events. Every reuse turn's greedy output
is compared with a single-server reference computed from scratch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from deploy.local.launch import VllmPair
from deploy.local.processes import free_ports
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import running_stack
from tests.support.turns import post, reference, tokens, turn

from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as apb_grpc
from kvshuttle.core.hashing import ROOT_HASH, cache_salt_digest, chain_hashes, salted_root
from kvshuttle.gateway.config import DEFAULT_TENANT as TENANT
from kvshuttle.gateway.prompts.salts import CacheSalts
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.registry.v1 import registry_service_pb2_grpc as rpb_grpc

pytestmark = pytest.mark.vllm
BS = 32
LEASE_S = 20  # retentions lapse 20 s after commit here (decoder_kv_blocks_ttl 480 - margin 460)


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    margin = {"router": {"POLICY__RETENTION_MARGIN_S": str(480 - LEASE_S)}}
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle"), extra_env=margin) as s:
        yield s


def test_turn_one_goes_prefill_to_decode_and_turn_two_reuses_decodes_kv(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(600, 1)
    out1, h1 = turn(stack, conv, first)
    assert (h1["X-Kvshuttle-Decision"], h1["X-Kvshuttle-Reason"]) == ("recompute", "no_retention")
    assert out1 == reference(vllm_pair, first)

    prompt = first + out1 + tokens(100, 2)
    out2, h2 = turn(stack, conv, prompt)
    assert (h2["X-Kvshuttle-Decision"], h2["X-Kvshuttle-Reason"]) == ("reuse", "reuse_cheaper")
    retained = len(first) + len(out1) - 1  # decode holds KV up to the last sampled token
    # To the token: the partly filled last block too (tests/e2e/test_reuse_granularity.py).
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == retained
    assert int(h2["X-Kvshuttle-Prefill-Cached-Tokens"]) > 0  # prefill read them from decode
    assert out2 == reference(vllm_pair, prompt)


def test_an_edited_history_reuses_only_the_verified_prefix(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(700, 3)
    out1, _ = turn(stack, conv, first)
    edited = first.copy()
    edited[300] = (edited[300] + 1) % 2000 + 10  # e.g. a stripped or rewritten span mid-history
    prompt = edited + out1 + tokens(80, 4)
    out2, h2 = turn(stack, conv, prompt)
    assert h2["X-Kvshuttle-Decision"] == "reuse"
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == 300 // BS * BS
    # Reading decode's KV past the edit would change the answer: it must equal the reference.
    assert out2 == reference(vllm_pair, prompt)


def test_a_recompute_releases_the_retention_it_supersedes_on_decode(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    """An edit at the history's first token: nothing verifies, the turn recomputes, and its
    prefill gets the old retention's release params (remote_num_tokens 0): vLLM reads none of
    it and notifies decode, which frees the blocks now instead of at decoder_kv_blocks_ttl."""
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(600, 41)
    out1, _ = turn(stack, conv, first)
    held = vllm_pair.decode.kv_cache_usage()
    edited = first.copy()
    edited[0] = (edited[0] + 1) % 2000 + 10
    prompt = edited + out1 + tokens(80, 42)
    out2, h2 = turn(stack, conv, prompt)
    assert (h2["X-Kvshuttle-Decision"], h2["X-Kvshuttle-Reason"]) == ("recompute", "prefix_mismatch")
    assert int(h2["X-Kvshuttle-Reused-Tokens"]) == 0
    assert out2 == reference(vllm_pair, prompt)  # nothing of the old KV reached this turn
    # Decode now holds turn 2's retention in place of turn 1's (1,024 blocks of 32 tokens):
    # kept, turn 1's would add its blocks on top.
    old_blocks = (len(first) + len(out1) - 1 + BS - 1) // BS
    new_blocks = (len(prompt) + len(out2) - 1 + BS - 1) // BS
    deadline = time.monotonic() + 20
    while vllm_pair.decode.kv_cache_usage() > held + (new_blocks - 0.9 * old_blocks) / 1024:
        assert time.monotonic() < deadline, "decode did not free the superseded retention's blocks"
        time.sleep(0.2)


def test_an_expired_retention_is_recomputed(stack: KvshuttleStack, vllm_pair: VllmPair) -> None:
    conv = f"c-{uuid.uuid4().hex[:8]}"
    first = tokens(400, 5)
    out1, _ = turn(stack, conv, first)
    time.sleep(LEASE_S + 1)
    prompt = first + out1 + tokens(60, 6)
    out2, h2 = turn(stack, conv, prompt)
    assert h2["X-Kvshuttle-Decision"] == "recompute"
    assert h2["X-Kvshuttle-Reason"] in ("no_retention", "expired")  # swept by the timer, or about to be
    assert out2 == reference(vllm_pair, prompt)


def _registry(stack: KvshuttleStack) -> rpb_grpc.RegistryServiceStub:
    return rpb_grpc.RegistryServiceStub(grpc.insecure_channel(stack.registry_addr))


def _held_blocks(stack: KvshuttleStack, prompt: list[int], *, via_gateway: bool = False) -> int:
    """Leading blocks of `prompt` that the registry's index says decode holds (prefill runs
    without a prefix cache here, so it publishes no block events). A prompt sent through the
    gateway went with its tenant's cache salt: its blocks chain from that salt's root."""
    root = ROOT_HASH
    if via_gateway:
        root = salted_root(cache_salt_digest(CacheSalts(stack.cache_salt_key.encode()).salt(TENANT)))
    found = _registry(stack).LookupBlocks(
        rpb.LookupBlocksRequest(block_hashes=chain_hashes(prompt, BS, parent=root)),
        metadata=stack.admin_metadata,
    )
    return next((m.matched_blocks for m in found.matches if m.node == "nodes/decode"), 0)


def _until(condition: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def test_agents_forward_block_stored_and_removed(stack: KvshuttleStack, vllm_pair: VllmPair) -> None:
    first = tokens(2000, 7)
    post(f"{vllm_pair.decode.url}/v1/completions", {"model": "m", "prompt": first, "max_tokens": 1})
    _until(lambda: _held_blocks(stack, first) == len(first) // BS)  # BlockStored reached the index
    # Enough other prompts to overflow decode's 1024 blocks: the first prompt's are evicted. Each
    # small enough to be admitted beside the KV earlier tests' turns retained (vLLM pins a
    # retained turn's blocks on decode for decoder_kv_blocks_ttl, 480 s here: up to 80 % of this
    # engine's blocks were pinned when this ran after the other e2e modules).
    for seed in range(8, 28):
        post(
            f"{vllm_pair.decode.url}/v1/completions",
            {"model": "m", "prompt": tokens(2000, seed), "max_tokens": 1},
        )
    _until(lambda: _held_blocks(stack, first) == 0)  # BlockRemoved reached the index


def test_agents_see_an_engine_restart(stack: KvshuttleStack, vllm_pair: VllmPair) -> None:
    """Runs last: it restarts the shared pair (same HTTP and event ports, new engine ids)."""
    prompt = tokens(500, 20)
    turn(stack, f"c-{uuid.uuid4().hex[:8]}", prompt)
    _until(lambda: _held_blocks(stack, prompt, via_gateway=True) > 0)
    keep = [
        getattr(engine.spec, key)
        for engine in (vllm_pair.prefill, vllm_pair.decode)
        for key in ("http_port", "side_channel_port", "kv_events_port", "kv_replay_port")
    ]
    fresh = free_ports(2)
    keep[1], keep[5] = fresh  # new side-channel ports: the old ones linger in TIME_WAIT
    vllm_pair.restart(ports=keep)
    agent = apb_grpc.AgentServiceStub(grpc.insecure_channel(stack.agent_addrs[1]))

    def restarted() -> bool:
        status = agent.GetStatus(apb.GetStatusRequest(), timeout=2, metadata=stack.admin_metadata)
        return status.events.engine_restarts >= 1

    post(f"{vllm_pair.decode.url}/v1/completions", {"model": "m", "prompt": tokens(100, 21), "max_tokens": 1})
    _until(restarted, timeout=30)
    _until(
        lambda: _held_blocks(stack, prompt, via_gateway=True) == 0
    )  # the registry cleared the restarted engine's index
    stack.restart_agents()  # registrations carry the new engine ids from here on
    conv = f"c-{uuid.uuid4().hex[:8]}"
    out1, _ = turn(stack, conv, prompt)
    _, h2 = turn(stack, conv, prompt + out1 + tokens(50, 22))
    assert h2["X-Kvshuttle-Decision"] == "reuse"
