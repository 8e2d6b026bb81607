"""Degrade, never fail, with real processes: one conversation of 30+ turns through the gateway
while the registry is SIGKILLed and started again, and then the router is.

Every turn must answer 200 with the greedy output of a from-scratch run (reused or recomputed,
wrong KV is never served). The test counts the turns served and reused and the seconds from each
restart until a turn reused KV again, prints them and keeps them in
.run/results/failover-<utc>.json, or under $KVSHUTTLE_RESULTS_DIR (bench/results to keep a
run's figures with the benchmarks'), so that a test run leaves the work tree clean.

The registry keeps its state in memory: after its restart the agents register again (lease
retry: heartbeat every second here), the retentions it held are gone, so turns recompute until
one commits; the next turn reuses. The router keeps none that matters: after its restart the
next turn reads the retention the last committed turn left.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import running_stack
from tests.support.turns import reference, tokens, turn

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(os.environ.get("KVSHUTTLE_RESULTS_DIR") or ROOT / ".run" / "results")
FIRST = 128  # tokens of the first prompt
ADDED = 16  # tokens each later turn adds after the previous answer
OUTPUT = 8  # tokens per answer
MIN_TURNS = 30
# A component stays down this long: longer than the router's node_max_age_s (5 s), so plans
# also run on a node list too old for a healthy registry.
DOWN_S = 6.0
# Between turns while something is down or coming back. Every turn that is not read from
# later (not stored, or not committed at all) leaves its blocks pinned on decode for
# decoder_kv_blocks_ttl (480 s): pacing keeps those within decode's 1024 blocks.
PAUSE_S = 0.5
RESUME_WITHIN_S = 45.0


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle-failover")) as s:
        yield s


@dataclass
class Turn:
    index: int
    phase: str
    prompt_tokens: int
    decision: str
    reason: str
    reused_tokens: int
    ms: float
    # The from-scratch reference run's time (decode alone).
    reference_ms: float
    # Seconds since the phase's restart (None before any restart).
    since_restart_s: float | None = None


@dataclass
class Session:
    stack: KvshuttleStack
    pair: VllmPair
    conversation: str = field(default_factory=lambda: f"failover-{uuid.uuid4().hex[:8]}")
    prompt: list[int] = field(default_factory=lambda: tokens(FIRST, 101))
    turns: list[Turn] = field(default_factory=list)
    restarted_at: float | None = None

    def next(self, phase: str) -> Turn:
        """One turn of the conversation; asserts 200 and the from-scratch output."""
        started = time.monotonic()
        out, headers = turn(self.stack, self.conversation, self.prompt, max_tokens=OUTPUT)
        ms = (time.monotonic() - started) * 1e3
        checked = time.monotonic()
        expected = reference(self.pair, self.prompt, max_tokens=OUTPUT)
        reference_ms = (time.monotonic() - checked) * 1e3
        index = len(self.turns) + 1
        assert out == expected, (index, phase, headers["X-Kvshuttle-Decision"], headers["X-Kvshuttle-Reason"])
        done = Turn(
            index=index,
            phase=phase,
            prompt_tokens=len(self.prompt),
            decision=headers["X-Kvshuttle-Decision"],
            reason=headers["X-Kvshuttle-Reason"],
            reused_tokens=int(headers["X-Kvshuttle-Reused-Tokens"]),
            ms=round(ms, 1),
            reference_ms=round(reference_ms, 1),
            since_restart_s=None
            if self.restarted_at is None
            else round(time.monotonic() - self.restarted_at, 2),
        )
        self.turns.append(done)
        self.prompt = self.prompt + out + tokens(ADDED, 1000 + index)
        return done

    def outage(self, name: str) -> tuple[float, list[Turn]]:
        """SIGKILL `name`; turns for DOWN_S while it is down. Seconds it was down, the turns."""
        self.stack.kill(name)
        killed = time.monotonic()
        down: list[Turn] = []
        while time.monotonic() - killed < DOWN_S:
            down.append(self.next(f"{name}_down"))
            time.sleep(PAUSE_S)
        return time.monotonic() - killed, down

    def restart_until_reuse(self, name: str) -> tuple[float, list[Turn]]:
        """Start `name` again; turns until one reuses. Seconds from the restart to that turn's
        answer, and the turns until then (that one included)."""
        self.stack.restart(name)
        self.restarted_at = time.monotonic()
        after: list[Turn] = []
        while True:
            t = self.next(f"{name}_back")
            after.append(t)
            if t.decision == "reuse":
                return time.monotonic() - self.restarted_at, after
            assert time.monotonic() - self.restarted_at < RESUME_WITHIN_S, [asdict(x) for x in after]
            time.sleep(PAUSE_S)


def test_turns_are_served_while_the_registry_and_then_the_router_restart(
    stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    started = time.monotonic()
    s = Session(stack, vllm_pair)

    warmup = [s.next("warmup") for _ in range(4)]
    assert (warmup[0].decision, warmup[0].reason) == ("recompute", "no_retention")
    assert all(t.decision == "reuse" for t in warmup[1:]), [asdict(t) for t in warmup]

    # The registry: the router plans plain P->D on the nodes it last listed, commits store nothing.
    registry_down_s, down = s.outage("registry")
    assert all((t.decision, t.reason) == ("recompute", "registry_unavailable") for t in down), [
        asdict(t) for t in down
    ]
    registry_resume_s, registry_back = s.restart_until_reuse("registry")
    steady = [s.next("steady") for _ in range(3)]
    assert all(t.decision == "reuse" for t in steady), [asdict(t) for t in steady]

    # The router: the gateway serves plain P->D on the endpoints of its last plan, commits nothing.
    s.restarted_at = None
    router_down_s, down_r = s.outage("router")
    assert all((t.decision, t.reason) == ("recompute", "router_unavailable") for t in down_r), [
        asdict(t) for t in down_r
    ]
    router_resume_s, router_back = s.restart_until_reuse("router")
    s.restarted_at = None
    tail = 0
    while len(s.turns) < MIN_TURNS or tail < 3:
        t = s.next("steady")
        tail += 1
        assert t.decision == "reuse", asdict(t)

    figures: dict[str, Any] = {
        "test": "failover",
        "time": datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "turns_served": len(s.turns),
        "turns_reused": sum(t.decision == "reuse" for t in s.turns),
        "every_output_matched_reference": True,
        "pause_between_degraded_turns_s": PAUSE_S,
        "registry": {
            "down_s": round(registry_down_s, 2),
            "down_turns": len(down),
            "turns_until_reuse": len(registry_back),
            "restart_to_reuse_s": round(registry_resume_s, 2),
            "reasons_until_reuse": [t.reason for t in registry_back],
        },
        "router": {
            "down_s": round(router_down_s, 2),
            "down_turns": len(down_r),
            "turns_until_reuse": len(router_back),
            "restart_to_reuse_s": round(router_resume_s, 2),
            "reasons_until_reuse": [t.reason for t in router_back],
        },
        "test_s": round(time.monotonic() - started, 1),
        "turns": [asdict(t) for t in s.turns],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"failover-{figures['time']}.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(
        f"\nfailover: {figures['turns_served']} turns served (all 200, all equal to a from-scratch run), "
        f"{figures['turns_reused']} reused; reuse resumed {figures['registry']['restart_to_reuse_s']} s "
        f"({len(registry_back)} turns) after the registry restart, "
        f"{figures['router']['restart_to_reuse_s']} s ({len(router_back)} turns) after the router restart; "
        f"{out}"
    )
    for t in s.turns:
        print(f"  {t.index:3d} {t.phase:14s} {t.prompt_tokens:5d} {t.decision:9s} {t.reason:22s} "
              f"{t.reused_tokens:5d} {t.ms:7.1f} ms (reference {t.reference_ms:.1f} ms)")  # fmt: skip
