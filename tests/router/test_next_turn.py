"""What a conversation does next, learnt online (kvshuttle.router.next_turn): how long a
retention stays on decode after each kind of answer end, and what one is worth per byte."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvshuttle.router.model import TurnEnd
from kvshuttle.router.next_turn import EDGES, GapHistogram, NextTurnModel
from kvshuttle.router.policy import NextTurnPolicy

TOOL, STOP = TurnEnd.TOOL_CALL, TurnEnd.STOP


def conv(i: int, tenant: str = "acme") -> str:
    return f"tenants/{tenant}/conversations/c{i}"


def teach(model: NextTurnModel, end: TurnEnd, gaps: list[float | None], *, tenant: str = "acme",
          first: int = 0, now: float = 0.0) -> float:  # fmt: skip
    """One commit per gap, each of its own conversation; None: that one never comes back."""
    for i, gap in enumerate(gaps, start=first):
        model.committed(conv(i, tenant), end, now)
        if gap is not None:
            model.arrived(conv(i, tenant), now + gap)
        now += 100.0
    return now


def test_nothing_learnt_leaves_the_idle_timer_to_decide() -> None:
    model = NextTurnModel(NextTurnPolicy(min_samples=8))
    assert model.keep_s(conv(0), TOOL) is None
    teach(model, TOOL, [1.0] * 7)
    assert model.keep_s(conv(99), TOOL) is None  # 7 < min_samples
    teach(model, TOOL, [1.0], first=7)
    assert model.keep_s(conv(99), TOOL) is not None
    assert model.keep_s(conv(99), TurnEnd.UNSPECIFIED) is None


def test_a_tool_call_keeps_the_kv_on_decode_through_most_of_its_tenants_tool_gaps() -> None:
    model = NextTurnModel(NextTurnPolicy(keep_max_s=10.0, keep_quantile=0.9))
    teach(model, TOOL, [0.5, 0.7, 0.9, 1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 6.0])
    keep = model.keep_s(conv(99), TOOL)
    assert keep is not None and 3.0 <= keep <= 6.0  # the 0.9 quantile, within the 3-6 s bucket span
    assert model.keep_s(conv(99), STOP) is None  # another end kind: its own figures


def test_an_answer_a_person_reads_is_parked_at_once() -> None:
    model = NextTurnModel(NextTurnPolicy(keep_max_s=10.0, min_return_p=0.5))
    teach(model, STOP, [30.0, 45.0, 60.0, 90.0, 120.0, 3.0, 200.0, 40.0])
    assert model.keep_s(conv(99), STOP) == 0.0


def test_conversations_that_never_come_back_count_against_keeping() -> None:
    model = NextTurnModel(NextTurnPolicy(keep_max_s=10.0, min_return_p=0.5))
    # Every one that came back came within a second, but most never came back.
    teach(model, TOOL, [1.0, 1.0, 1.0, None, None, None, None, None, None, None])
    assert model.keep_s(conv(99), TOOL) == 0.0


def test_a_conversations_own_gaps_speak_for_it_once_it_has_enough() -> None:
    policy = NextTurnPolicy(keep_max_s=30.0, keep_quantile=0.9, min_conversation_gaps=3)
    model = NextTurnModel(policy)
    teach(model, TOOL, [1.0] * 100)  # the tenant's tools answer in a second
    slow = conv(500)
    now = 10_000.0
    for gap in (12.0, 15.0):
        model.committed(slow, TOOL, now)
        model.arrived(slow, now + gap)
        now += 100
    tenant_keep = model.keep_s(slow, TOOL)
    assert tenant_keep is not None and tenant_keep < 2.0  # two gaps: still the tenant's figure
    model.committed(slow, TOOL, now)
    model.arrived(slow, now + 14.0)
    own = model.keep_s(slow, TOOL)
    assert own is not None and 14.0 < own <= 30.0
    other = model.keep_s(conv(501), TOOL)  # others keep the tenant's
    assert other is not None and other < 2.0


def test_tenants_learn_apart() -> None:
    model = NextTurnModel(NextTurnPolicy())
    teach(model, TOOL, [1.0] * 10, tenant="acme")
    assert model.keep_s(conv(1, "acme"), TOOL) is not None
    assert model.keep_s(conv(1, "globex"), TOOL) is None
    assert model.p_next_within(conv(1, "globex"), TOOL, 0.0, 10.0) is None


def test_a_plan_without_a_commit_before_it_or_twice_teaches_once() -> None:
    model = NextTurnModel(NextTurnPolicy(min_samples=1))
    model.arrived(conv(0), 5.0)  # no commit seen here: nothing learnt
    assert model.tenants == 0
    model.committed(conv(0), TOOL, 0.0)
    model.arrived(conv(0), 1.0)
    model.arrived(conv(0), 50.0)  # a retry's plan: the gap was learnt already
    hist = model._tenants["acme"][TOOL]
    assert sum(hist.gaps) == 1.0 and hist.commits == 1.0
    model.committed(conv(0), TurnEnd.UNSPECIFIED, 60.0)  # unsaid: its gap teaches nothing
    model.arrived(conv(0), 61.0)
    assert sum(hist.gaps) == 1.0


def test_names_of_no_tenant_are_ignored() -> None:
    model = NextTurnModel(NextTurnPolicy(min_samples=1))
    model.committed("conversations/x", TOOL, 0.0)
    model.arrived("conversations/x", 1.0)
    assert len(model) == 0 and model.tenants == 0
    assert model.keep_s("conversations/x", TOOL) is None


def test_older_gaps_weigh_half_after_half_life_commits() -> None:
    model = NextTurnModel(NextTurnPolicy(half_life=10, keep_max_s=10.0, min_samples=4))
    teach(model, TOOL, [60.0] * 10)  # slow tools...
    assert model.keep_s(conv(99), TOOL) == 0.0
    teach(model, TOOL, [1.0] * 40, first=10)  # ...then fast ones: the old figures fade
    keep = model.keep_s(conv(99), TOOL)
    assert keep is not None and 0.5 < keep < 2.0


def test_conversations_and_tenants_are_bounded() -> None:
    model = NextTurnModel(NextTurnPolicy(max_conversations=5, max_tenants=2, min_samples=1))
    for t in range(4):
        teach(model, TOOL, [1.0] * 10, tenant=f"t{t}")
    assert len(model) == 5 and model.tenants == 2
    assert model.keep_s(conv(0, "t0"), TOOL) is None  # the least recently used went first
    assert model.keep_s(conv(0, "t3"), TOOL) is not None


def test_a_retention_idle_past_its_likely_gap_is_worth_less_per_byte() -> None:
    model = NextTurnModel(NextTurnPolicy(keep_max_s=10.0))
    teach(model, TOOL, [0.5, 0.8, 1.0, 1.0, 1.2, 1.5, 2.0, 3.0, 400.0, None])
    fresh = model.value_per_byte(conv(99), TOOL, idle_s=0.0, saved_ms=1000.0, kv_bytes=2**20)
    stale = model.value_per_byte(conv(99), TOOL, idle_s=8.0, saved_ms=1000.0, kv_bytes=2**20)
    assert fresh > 10 * stale
    big = model.value_per_byte(conv(99), TOOL, idle_s=0.0, saved_ms=1000.0, kv_bytes=2**22)
    assert big == pytest.approx(fresh / 4)  # per byte
    unknown = model.value_per_byte(conv(1, "globex"), TOOL, idle_s=0.0, saved_ms=1000.0, kv_bytes=2**20)
    assert unknown == pytest.approx(0.5 * 1000.0 / 2**20)


@given(st.lists(st.floats(min_value=0.0, max_value=10_000.0), min_size=1, max_size=60),
       st.floats(min_value=0.01, max_value=0.99), st.floats(min_value=0.1, max_value=5_000.0))  # fmt: skip
def test_the_histogram_reads_monotone_and_within_bounds(gaps: list[float], q: float, limit: float) -> None:
    hist = GapHistogram()
    for g in gaps:
        hist.commit(1000)
        hist.gap(g)
    points = [0.01, *EDGES, 10_000.0]
    cdfs = [hist.cdf(t) for t in points]
    assert all(0.0 <= c <= 1.0 for c in cdfs)
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(cdfs))
    at = hist.quantile(q, limit)
    assert 0.0 <= at <= limit and math.isfinite(at)
    assert hist.cdf(EDGES[-1]) * hist.commits == pytest.approx(
        sum(1 for g in gaps if g <= EDGES[-1]), abs=1e-6
    )
