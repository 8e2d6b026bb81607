"""How KvshuttleStack wires replicas (no process started): names, addresses, who calls whom.
The chaos suite (tests/chaos) runs these stacks and kills their replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import PROFILE

pytestmark = pytest.mark.slow


def _env(stack: KvshuttleStack, name: str, key: str) -> str:
    service = stack.service(name)
    prefix = {"registry": "KVSHUTTLE_REGISTRY_", "router": "KVSHUTTLE_ROUTER_", "agent": "KVSHUTTLE_AGENT_"}
    return service.env[prefix[name.split("-", maxsplit=1)[0]] + key]


def test_replicas_are_named_and_called_as_one_list_each(vllm_model: Path, tmp_path: Path) -> None:
    pair = VllmPair(vllm_model, log_dir=tmp_path)
    stack = KvshuttleStack(pair, work_dir=tmp_path, profile=PROFILE, registry_store="redis",
                           registry_replicas=2, router_replicas=3)  # fmt: skip
    assert [s.name for s in stack.services] == [
        "registry-0", "registry-1", "router-0", "router-1", "router-2",
        "agent-prefill", "agent-decode", "gateway",
    ]  # fmt: skip
    addresses = [*stack.registry_addrs, *stack.router_addrs, *stack.agent_addrs, stack.gateway_url]
    assert len(set(addresses)) == len(addresses)
    assert [_env(stack, f"registry-{i}", "SERVER__LISTEN") for i in range(2)] == list(stack.registry_addrs)
    redis = {_env(stack, f"registry-{i}", "REDIS__URL") for i in range(2)}
    assert stack.redis is not None and redis == {stack.redis.url}
    for i in range(3):
        assert _env(stack, f"router-{i}", "REGISTRY__ADDRESS") == ",".join(stack.registry_addrs)
    assert len({_env(stack, f"router-{i}", "TURN_SIGNING_KEY") for i in range(3)}) == 1
    assert stack.gateway.env["KVSHUTTLE_GATEWAY_ROUTER__ADDRESS"] == ",".join(stack.router_addrs)
    # The agents call every replica too: the block index is shared through Redis.
    agents = [_env(stack, a, "REGISTRY__ADDRESS") for a in ("agent-prefill", "agent-decode")]
    assert agents == [",".join(stack.registry_addrs)] * 2  # any replica takes their events
    # The first replica stands for the service, as with one replica.
    assert (stack.registry, stack.router) == (stack.service("registry-0"), stack.service("router-0"))
    assert (stack.registry_addr, stack.router_addr) == (stack.registry_addrs[0], stack.router_addrs[0])


def test_one_replica_keeps_the_plain_names(vllm_model: Path, tmp_path: Path) -> None:
    stack = KvshuttleStack(VllmPair(vllm_model, log_dir=tmp_path), work_dir=tmp_path, profile=PROFILE)
    assert [s.name for s in stack.services] == [
        "registry",
        "router",
        "agent-prefill",
        "agent-decode",
        "gateway",
    ]
    assert stack.gateway.env["KVSHUTTLE_GATEWAY_ROUTER__ADDRESS"] == stack.router_addr


def test_registry_replicas_need_the_redis_store(vllm_model: Path, tmp_path: Path) -> None:
    pair = VllmPair(vllm_model, log_dir=tmp_path)
    with pytest.raises(ValueError, match="registry_store='redis'"):
        KvshuttleStack(pair, work_dir=tmp_path, profile=PROFILE, registry_replicas=2)
    with pytest.raises(ValueError, match="at least 1"):
        KvshuttleStack(pair, work_dir=tmp_path, profile=PROFILE, router_replicas=0)
