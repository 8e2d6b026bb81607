"""The SSRF guard's allow list (kvshuttle.sidecar.allowlist) with a fake clock and an
in-memory node reader, and the header contract's host:port parsing (kvshuttle.gateway.pd_headers)."""

from __future__ import annotations

import pytest

from kvshuttle.core.endpoints import endpoint_host_port, parse_host_port
from kvshuttle.gateway.pd_headers import decode_plan, encode_plan
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.sidecar.allowlist import RegisteredEndpoints


class Nodes:
    def __init__(self) -> None:
        self.nodes: list[reg_pb.Node] = []
        self.reads = 0
        self.down = False

    async def read(self, limit: int) -> list[reg_pb.Node]:
        self.reads += 1
        if self.down:
            raise ConnectionError("registry unreachable")
        return self.nodes[:limit]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def node(http: str, host: str = "", port: int = 0) -> reg_pb.Node:
    return reg_pb.Node(http_endpoint=http, side_channel_host=host, side_channel_port=port)


def allowlist(nodes: Nodes, clock: Clock, max_nodes: int = 100) -> RegisteredEndpoints:
    return RegisteredEndpoints(
        nodes.read, ttl_s=5, miss_refresh_s=1, max_stale_s=60, max_nodes=max_nodes, clock=clock
    )


@pytest.mark.parametrize(
    ("registered", "asked", "allowed"),
    [
        ("http://10.0.0.5:8000", "10.0.0.5:8000", True),
        ("http://10.0.0.5:8000/v1", "10.0.0.5:8000", True),
        ("http://10.0.0.5:8000", "10.0.0.5:8001", False),  # the host, not any port on it
        ("http://10.0.0.5:8000", "10.0.0.6:8000", False),
        ("http://[fd00::5]:8000", "[fd00::5]:8000", True),
        ("http://[fd00::5]:8000", "[fd00:0:0::5]:8000", True),  # another spelling of one address
        ("http://[FD00::5]:8000", "[fd00::5]:8000", True),
        ("http://[fd00::5]:8000", "[fd00::6]:8000", False),
        ("http://prefill-0.pool:8000", "prefill-0.pool:8000", True),
        ("http://prefill-0.pool:8000", "PREFILL-0.pool:8000", True),
        ("http://prefill-0.pool:8000", "10.0.0.5:8000", False),  # a name is not an address
    ],
)
async def test_a_prefill_is_allowed_only_as_a_registered_endpoint(
    registered: str, asked: str, allowed: bool
) -> None:
    nodes = Nodes()
    nodes.nodes = [node(registered)]
    assert await allowlist(nodes, Clock()).allows_prefill(parse_host_port(asked)) is allowed


async def test_kv_sources_are_the_registered_side_channels_v4_and_v6() -> None:
    nodes = Nodes()
    nodes.nodes = [
        node("http://10.0.0.5:8000", "10.0.0.5", 5600),
        node("http://[fd00::7]:8000", "fd00::7", 5601),
    ]
    guard = allowlist(nodes, Clock())
    assert await guard.allows_kv_source("10.0.0.5", 5600)
    assert await guard.allows_kv_source("fd00:0::7", 5601)
    assert await guard.allows_kv_source("[fd00::7]", 5601)
    assert not await guard.allows_kv_source("10.0.0.5", 8000)  # the HTTP port is no side channel
    assert not await guard.allows_kv_source("169.254.169.254", 5600)
    assert not await guard.allows_kv_source("", 5600)
    assert not await guard.allows_kv_source("10.0.0.5", 0)


async def test_the_list_is_read_once_per_ttl_and_a_miss_rereads_at_most_once_a_second() -> None:
    nodes, clock = Nodes(), Clock()
    nodes.nodes = [node("http://10.0.0.5:8000")]
    guard = allowlist(nodes, clock)
    for _ in range(3):
        assert await guard.allows_prefill("10.0.0.5:8000")
    assert nodes.reads == 1
    assert not await guard.allows_prefill("10.0.0.9:8000")
    assert not await guard.allows_prefill("10.0.0.9:8000")
    assert nodes.reads == 1  # a miss within miss_refresh_s of the last read reads nothing
    nodes.nodes.append(node("http://10.0.0.9:8000"))  # a node registers
    clock.now += 1
    assert await guard.allows_prefill("10.0.0.9:8000")
    assert nodes.reads == 2
    clock.now += 5
    nodes.nodes = []  # its lease lapses
    assert not await guard.allows_prefill("10.0.0.5:8000")
    assert nodes.reads == 3


async def test_with_the_registry_down_the_last_list_serves_until_it_is_too_old_then_nothing_is_allowed() -> (
    None
):
    nodes, clock = Nodes(), Clock()
    nodes.nodes = [node("http://10.0.0.5:8000")]
    guard = allowlist(nodes, clock)
    assert await guard.allows_prefill("10.0.0.5:8000")
    nodes.down = True
    clock.now += 30
    assert await guard.allows_prefill("10.0.0.5:8000")
    clock.now += 30
    assert not await guard.allows_prefill("10.0.0.5:8000")


async def test_never_read_allows_nothing() -> None:
    nodes = Nodes()
    nodes.down = True
    assert not await allowlist(nodes, Clock()).allows_prefill("10.0.0.5:8000")


async def test_the_list_holds_at_most_max_nodes() -> None:
    nodes = Nodes()
    nodes.nodes = [node(f"http://10.0.0.{i}:8000") for i in range(1, 10)]
    guard = allowlist(nodes, Clock(), max_nodes=3)
    assert await guard.allows_prefill("10.0.0.3:8000")
    assert not await guard.allows_prefill("10.0.0.4:8000")


@pytest.mark.parametrize(
    ("value", "canonical"),
    [
        ("10.0.0.5:8000", "10.0.0.5:8000"),
        ("[::1]:8000", "[::1]:8000"),
        ("[0:0::1]:8000", "[::1]:8000"),
        ("[::ffff:127.0.0.1]:80", "[::ffff:7f00:1]:80"),
        ("Prefill-0.Pool.:8000", "prefill-0.pool:8000"),
    ],
)
def test_host_port_values_parse_to_one_canonical_form(value: str, canonical: str) -> None:
    assert parse_host_port(value) == canonical


@pytest.mark.parametrize(
    "value",
    ["", "10.0.0.5", "::1:8000", "[::1]", "[10.0.0.5]:80", "[nothost]:80", "h:0", "h:65536", "h:8o",
     "http://h:80", "h:80/x", "u@h:80", "h :80", "[::1]:80x", ":80"],
)  # fmt: skip
def test_malformed_host_port_values_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_host_port(value)


def test_endpoints_and_plans_round_trip() -> None:
    assert endpoint_host_port("http://[fd00::5]:8000/v1") == "[fd00::5]:8000"
    assert endpoint_host_port("http://10.0.0.5") == "10.0.0.5:80"
    assert endpoint_host_port("not a url") is None
    plan = pb.PlanTurnResponse(turn="turns/x", generation=3, decision=pb.DECISION_REUSE)
    plan.prefill_kv_transfer_params.remote_host = "fd00::5"
    value = encode_plan(plan)
    assert "=" not in value and decode_plan(value) == plan
    for bad in ("", value + "=", "!!!!", "A" * 70_000):
        with pytest.raises(ValueError):
            decode_plan(bad)
