"""Conversation affinity over router replicas (kvshuttle.gateway.affinity), and its settings:
rendezvous choice stable, balanced and moving only a lost replica's conversations; a replica
that failed passed over for a bounded, doubling backoff and back once it answers. No sockets."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError
from tests.support.clock import FakeClock

from kvshuttle.gateway.affinity import Replicas, affinity_key
from kvshuttle.gateway.config import RouterConnection

ADDRS = ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"]
CONVS = [f"tenants/t/conversations/c{i}" for i in range(3000)]


def replicas(addresses: list[str] = ADDRS, clock: FakeClock | None = None, key: bytes = b"k") -> Replicas:
    clock = clock or FakeClock()
    return Replicas(addresses, key=key, backoff_s=1.0, max_backoff_s=8.0, clock=clock.now)


def test_the_choice_is_stable_and_independent_of_the_address_order() -> None:
    a, b = replicas(), replicas(list(reversed(ADDRS)))
    for conversation in CONVS[:200]:
        assert a.ranked(conversation) == a.ranked(conversation) == b.ranked(conversation)
        assert sorted(a.ranked(conversation)) == sorted(ADDRS)


def test_the_key_changes_the_choice() -> None:
    a, b = replicas(key=b"one"), replicas(key=b"two")
    assert [a.ranked(c)[0] for c in CONVS[:200]] != [b.ranked(c)[0] for c in CONVS[:200]]
    assert a.digest(CONVS[0]) != b.digest(CONVS[0]) and len(a.digest(CONVS[0])) == 16
    assert affinity_key(None) == affinity_key(None) != affinity_key(b"x" * 16)


def test_conversations_spread_evenly() -> None:
    picks = Counter(replicas().ranked(c)[0] for c in CONVS)
    assert set(picks) == set(ADDRS)
    # 3000 over 3: 1000 each; a binomial spread of ~26, so 850 is far outside chance.
    assert all(850 < n < 1150 for n in picks.values()), picks


def test_losing_a_replica_moves_only_its_conversations() -> None:
    whole = replicas()
    lost = ADDRS[1]
    without = replicas([a for a in ADDRS if a != lost])
    moved = 0
    for conversation in CONVS:
        before, after = whole.ranked(conversation)[0], without.ranked(conversation)[0]
        if before != lost:
            assert after == before  # minimal movement
        else:
            moved += 1
            assert after == whole.ranked(conversation)[1]  # to its next-ranked replica
    assert 850 < moved < 1150
    # Adding a replica back moves to it only the conversations it wins.
    regained = sum(whole.ranked(c)[0] != without.ranked(c)[0] for c in CONVS)
    assert regained == moved


def test_a_failed_replica_is_passed_over_for_a_doubling_bounded_backoff() -> None:
    clock = FakeClock()
    r = replicas(clock=clock)
    conversation = CONVS[0]
    first, second, third = r.ranked(conversation)
    assert r.order(conversation) == [first, second, third]
    assert r.failed(first) == 1.0
    assert not r.up(first) and r.order(conversation) == [second, third, first]  # a last resort
    clock.advance(1.0)
    assert r.up(first) and r.order(conversation) == [first, second, third]  # tried again
    assert [r.failed(first) for _ in range(5)] == [2.0, 4.0, 8.0, 8.0, 8.0]
    clock.advance(7.9)
    assert not r.up(first)
    r.succeeded(first)  # it answered: back at once, its backoff reset
    assert r.up(first) and r.order(conversation)[0] == first
    assert r.failed(first) == 1.0


def test_replicas_need_distinct_addresses_and_a_sane_backoff() -> None:
    with pytest.raises(ValueError, match="each once"):
        Replicas([ADDRS[0], ADDRS[0]], key=b"k", backoff_s=1, max_backoff_s=2)
    with pytest.raises(ValueError, match="backoff"):
        Replicas(ADDRS, key=b"k", backoff_s=3, max_backoff_s=2)


def test_a_list_of_addresses_gets_conversation_affinity_by_default() -> None:
    assert RouterConnection(address="127.0.0.1:1").replicas() is None
    assert RouterConnection(address="dns:///router:50061").replicas() is None
    listed = RouterConnection(address="10.0.0.1:1, 10.0.0.2:1")
    assert listed.replicas() == ["10.0.0.1:1", "10.0.0.2:1"]
    # Each replica is its own channel, sent once per call (the next replica is the retry).
    options = listed.replica_options("10.0.0.2:1")
    assert (options.target, options.max_attempts) == ("10.0.0.2:1", 1)
    # Host names are fine with affinity (a StatefulSet's pods), each resolved on its own.
    named = RouterConnection(address="router-0.router:50061,router-1.router:50061")
    assert named.replicas() == ["router-0.router:50061", "router-1.router:50061"]
    assert RouterConnection(address="10.0.0.1:1,10.0.0.2:1", affinity="round_robin").replicas() is None


@pytest.mark.parametrize(
    ("address", "affinity", "message"),
    [
        ("router-0:1,router-1:1", "round_robin", "one DNS name"),  # one channel: IPs or a name
        ("dns:///router:50061", "conversation", "list the replicas"),  # a set the gateway can't see
        ("10.0.0.1:1,10.0.0.1:1", None, "twice"),
        ("10.0.0.1:1,", None, "an empty one"),
    ],
)
def test_router_addresses_that_cannot_work_are_refused_at_startup(
    address: str, affinity: str | None, message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        RouterConnection.model_validate({"address": address, "affinity": affinity})


def test_the_failover_backoff_bound_is_checked() -> None:
    with pytest.raises(ValidationError, match="failover_max_backoff_s"):
        RouterConnection(address="127.0.0.1:1", failover_backoff_s=5, failover_max_backoff_s=1)
