"""What a conversation does next, learnt online: how long after each kind of answer end
(TurnEnd: a tool call, a stop, a cut) its next turn came, if it came. The committer tells it
each commit's end and time, the planner each plan's arrival; the shuttle asks it how long to keep
a retention on its decode engine before parking it, and which retentions to park first when an
engine's HBM runs short. Continuum's tool-call TTLs and KVFlow's steps-to-execution eviction,
across a P/D fleet.

The model:

* per tenant and end kind, a histogram of gaps over log-spaced buckets (1/8 s to 4,096 s,
  doubling, and one past) and how many commits there were. F(t) = gaps of at most t / commits is
  the probability that a next turn comes within t: a conversation that never comes back counts
  in the commits and in no gap. Older figures weigh half once `half_life` newer commits came.
* per conversation and end kind, the mean and variance of its log gaps (a lognormal), which
  speaks for the conversation once it has `min_conversation_gaps` of them: one agent's tools take
  0.2 s, another's 20 s.

Keep time, at a commit (`keep_s`): with F(keep_max_s) >= min_return_p for the tenant and this
end kind, the retention stays on decode for the keep_quantile of the gaps within keep_max_s (the
conversation's own once it has enough); with F below it, 0 (park at once: the next turn is not
coming soon, and the HBM goes back to the running answers); with fewer than min_samples commits
learnt, None (the shuttle's idle timer decides).

Value per byte, under HBM pressure (`value_per_byte`): P(next turn within keep_max_s | idle
so far) x the prefill it saves / the bytes held; the shuttle parks the lowest first.

Bounded: at most max_conversations conversations (up to ~950 bytes each) and max_tenants
tenants (up to ~1,100 bytes each), the least recently used first out. Only this replica's commits and plans
teach it; nothing here is needed for correctness.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Final

from kvshuttle.core.names import tenant_of
from kvshuttle.router.model import TurnEnd
from kvshuttle.router.policy import NextTurnPolicy

__all__ = ["NextTurnModel"]

# Upper edges of the gap buckets, in seconds; one more bucket holds what is past the last.
EDGES: Final = tuple(0.125 * 2**k for k in range(16))
_LEARNT: Final = (TurnEnd.TOOL_CALL, TurnEnd.STOP, TurnEnd.LENGTH)


@dataclass(slots=True)
class GapHistogram:
    """Gaps after one kind of end, for one tenant: counts by bucket and commits, decayed."""

    gaps: list[float] = field(default_factory=lambda: [0.0] * (len(EDGES) + 1))
    commits: float = 0.0
    since_halving: int = 0

    def commit(self, half_life: int) -> None:
        self.commits += 1.0
        self.since_halving += 1
        if self.since_halving >= half_life:
            self.gaps = [g / 2 for g in self.gaps]
            self.commits /= 2
            self.since_halving = 0

    def gap(self, seconds: float) -> None:
        self.gaps[bisect.bisect_left(EDGES, seconds)] += 1.0
        # A gap is a commit's outcome: never more gaps than commits (a commit this replica did
        # not see, its conversation's plan here).
        self.commits = max(self.commits, sum(self.gaps))

    def within(self, t: float) -> float:
        """How many gaps were at most t: whole buckets below t, the one holding it pro rata
        (log-linear within a bucket; linear in the first)."""
        b = bisect.bisect_left(EDGES, t)
        count = sum(self.gaps[:b])
        if b < len(EDGES):
            low = EDGES[b - 1] if b else 0.0
            share = (t - low) / (EDGES[b] - low) if b == 0 else math.log(t / low) / math.log(EDGES[b] / low)
            count += self.gaps[b] * min(max(share, 0.0), 1.0)
        return count

    def cdf(self, t: float) -> float:
        return min(self.within(t) / self.commits, 1.0) if self.commits > 0 else 0.0

    def quantile(self, q: float, limit: float) -> float:
        """The q-quantile of the gaps of at most `limit`."""
        target = q * self.within(limit)
        seen = 0.0
        for b, count in enumerate(self.gaps[: len(EDGES)]):
            low = EDGES[b - 1] if b else 0.0
            if seen + count >= target and count > 0:
                share = (target - seen) / count
                at = low + share * (EDGES[b] - low) if b == 0 else low * float((EDGES[b] / low) ** share)
                return min(at, limit)
            seen += count
        return limit


@dataclass(slots=True)
class _LogGaps:
    """A conversation's gaps after one kind of end: count, mean and M2 of their logs (Welford)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, seconds: float) -> None:
        x = math.log(max(seconds, 1e-3))
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    def quantile(self, q: float) -> float:
        sd = math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0
        return math.exp(self.mean + NormalDist().inv_cdf(q) * sd)


@dataclass(slots=True)
class _Conversation:
    tenant: str
    # The last commit's end and time, until the next plan consumes it.
    pending: TurnEnd | None = None
    committed_at: float = 0.0
    gaps: dict[TurnEnd, _LogGaps] = field(default_factory=dict)


class NextTurnModel:
    def __init__(self, policy: NextTurnPolicy) -> None:
        self._policy = policy
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()
        self._tenants: OrderedDict[str, dict[TurnEnd, GapHistogram]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    @property
    def tenants(self) -> int:
        return len(self._tenants)

    # ---- learning --------------------------------------------------------------------------

    def committed(self, conversation: str, end: TurnEnd, now: float) -> None:
        """A commit of `conversation` ended so at `now`; its next plan here says the gap."""
        tenant = tenant_of(conversation)
        if tenant is None:
            return
        conv = self._conversation(conversation, tenant)
        if end not in _LEARNT:
            conv.pending = None  # nothing to learn from the gap after an unsaid end
            return
        conv.pending, conv.committed_at = end, now
        self._histogram(tenant, end).commit(self._policy.half_life)

    def arrived(self, conversation: str, now: float) -> None:
        """A turn of `conversation` is planned at `now`: the gap since its last commit here."""
        conv = self._conversations.get(conversation)
        if conv is None or conv.pending is None:
            return
        end, conv.pending = conv.pending, None
        gap = max(now - conv.committed_at, 0.0)
        self._conversations.move_to_end(conversation)
        self._histogram(conv.tenant, end).gap(gap)
        conv.gaps.setdefault(end, _LogGaps()).add(gap)

    def _conversation(self, conversation: str, tenant: str) -> _Conversation:
        conv = self._conversations.get(conversation)
        if conv is None:
            conv = self._conversations[conversation] = _Conversation(tenant)
            while len(self._conversations) > self._policy.max_conversations:
                self._conversations.popitem(last=False)
        else:
            self._conversations.move_to_end(conversation)
        return conv

    def _histogram(self, tenant: str, end: TurnEnd) -> GapHistogram:
        by_end = self._tenants.get(tenant)
        if by_end is None:
            by_end = self._tenants[tenant] = {}
            while len(self._tenants) > self._policy.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(tenant)
        return by_end.setdefault(end, GapHistogram())

    # ---- deciding --------------------------------------------------------------------------

    def _learnt(self, conversation: str, end: TurnEnd) -> tuple[GapHistogram | None, _Conversation | None]:
        tenant = tenant_of(conversation)
        if tenant is None or end not in _LEARNT:
            return None, None
        hist = self._tenants.get(tenant, {}).get(end)
        if hist is None or hist.commits < self._policy.min_samples:
            return None, None
        return hist, self._conversations.get(conversation)

    def keep_s(self, conversation: str, end: TurnEnd) -> float | None:
        """How long the retention of a commit that ended so stays on decode before it parks;
        None: not learnt enough (the idle timer decides)."""
        p = self._policy
        hist, conv = self._learnt(conversation, end)
        if hist is None:
            return None
        if hist.cdf(p.keep_max_s) < p.min_return_p:
            return 0.0
        own = conv.gaps.get(end) if conv is not None else None
        if own is not None and own.n >= p.min_conversation_gaps:
            return min(own.quantile(p.keep_quantile), p.keep_max_s)
        return hist.quantile(p.keep_quantile, p.keep_max_s)

    def p_next_within(self, conversation: str, end: TurnEnd, idle_s: float, horizon_s: float) -> float | None:
        """P(the next turn comes within horizon_s | none came in idle_s); None: not learnt."""
        hist, _ = self._learnt(conversation, end)
        if hist is None:
            return None
        before = hist.cdf(idle_s)
        if before >= 1.0:
            return 0.0
        return max(hist.cdf(idle_s + horizon_s) - before, 0.0) / (1.0 - before)

    def value_per_byte(
        self, conversation: str, end: TurnEnd, *, idle_s: float, saved_ms: float, kv_bytes: int
    ) -> float:
        """What a retention on decode is worth per byte: P(its next turn within keep_max_s, given
        its idle time) x the prefill it saves (ms) / its bytes. Not learnt: P = 1/2."""
        p = self.p_next_within(conversation, end, idle_s, self._policy.keep_max_s)
        return (0.5 if p is None else p) * saved_ms / max(kv_bytes, 1)
