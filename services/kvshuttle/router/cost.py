"""The reuse-vs-recompute cost model, per served model, calibrated online.

Prefill time of a request that computes `c` tokens on top of `k` tokens whose KV is already
there (read from a remote holder or hit in the local prefix cache):

    prefill_ms = fixed_ms + per_token_ms * c + per_cached_token_ms * k
                 + per_pair_ns * 1e-6 * (c * k + c * (c + 1) / 2)

the linear terms for the MLP and for reading the cached KV, the last one for attention (each
computed token attends to every earlier position). Moving `n` bytes of KV costs
`link.fixed_ms + n / link.bandwidth`. Reuse wins when transfer + suffix prefill is expected to
be faster than prefilling what the prefill node does not already hold, and the tokens read
remotely clear the floor (vLLM's `kv_recompute_threshold`: below it vLLM recomputes anyway).
Extending on the holder (the decode node whose prefix cache holds the history computes the
new tokens itself) costs its prefill plus its running decodes' delay meanwhile, weighted; the
prefill path it is weighed against also waits for its prefill node's queue (the placement
ledger's), which extending skips.

Measured turns (CommitTurn timings) scale the prefill estimate, per prefill node and across
them, and replace the link bandwidth with the median of recent observations, each clipped, so
one outlier moves nothing. A turn that went prefill -> decode also measures the hand-off: from
prefill's answer to decode's first token (decode's request, its read of the prompt's KV, its
first step), the one hop extending on the holder does not make; its fixed part, past the link
model's time for the KV decode read, is learnt as the prefill scale is (a low quantile: a busy
decode only adds). A measured prefill is the gateway's wall time of the call, the time
the request queued on a busy engine included; the prefill scale is therefore the low quantile
(`PREFILL_QUANTILE`) of recent measured/predicted ratios, not their median: queueing only ever
adds, and the turns that found the engine free measure its compute. Queueing is a load signal,
which placement counts apart (kvshuttle.router.ledger); learnt into the cost, it would inflate
every estimate under load and shift reuse against recompute for the wrong reason.
"""

from __future__ import annotations

import statistics
import tomllib
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshuttle.router.model import Estimate
from kvshuttle.router.policy import ExtendPolicy

_WINDOW = 64
_MIN_SAMPLES = 4
_MAX_SCALE = 8.0
# The quantile of measured/predicted prefill ratios taken as the engine's speed (see above).
PREFILL_QUANTILE = 0.2
# Prefill nodes with a scale of their own, per model; the least recently measured go first.
_MAX_NODES = 1024
# A measured hand-off's fixed part is clipped to this (ms).
_MAX_HANDOFF_MS = 60_000.0


@dataclass(frozen=True, slots=True)
class PrefillModel:
    fixed_ms: float
    per_token_ms: float
    per_cached_token_ms: float = 0.0
    per_pair_ns: float = 0.0

    def ms(self, computed: int, cached: int) -> float:
        pairs = computed * cached + computed * (computed + 1) / 2
        return (
            self.fixed_ms
            + self.per_token_ms * computed
            + self.per_cached_token_ms * cached
            + self.per_pair_ns * 1e-6 * pairs
        )


@dataclass(frozen=True, slots=True)
class LinkModel:
    bandwidth_gb_s: float
    fixed_ms: float

    def ms(self, nbytes: int, bandwidth_gb_s: float | None = None) -> float:
        if nbytes <= 0:
            return 0.0
        return self.fixed_ms + nbytes / ((bandwidth_gb_s or self.bandwidth_gb_s) * 1e6)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """Cost facts of one served model on one kind of hardware."""

    model: str
    kv_bytes_per_token: int
    prefill: PrefillModel
    link: LinkModel
    # Fewest tokens worth reading remotely (vLLM's kv_recompute_threshold, default 64).
    min_reuse_tokens: int = 64

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0 or self.link.bandwidth_gb_s <= 0 or self.min_reuse_tokens < 0:
            raise ValueError(
                f"profile {self.model}: kv_bytes_per_token and bandwidth must be positive, "
                "min_reuse_tokens not negative"
            )
        values = (
            self.prefill.fixed_ms,
            self.prefill.per_token_ms,
            self.prefill.per_cached_token_ms,
            self.prefill.per_pair_ns,
            self.link.fixed_ms,
        )
        if min(values) < 0:
            raise ValueError(f"profile {self.model}: times must not be negative")


# What a profile file holds for the router, and the sections of an engine profile
# (deploy/profiles/schema.py) that only the fleet emulator reads: accepted and ignored here.
_ROUTER_KEYS = frozenset({"model", "kv_bytes_per_token", "min_reuse_tokens", "prefill", "link"})
EMULATOR_SECTIONS = frozenset({"decode", "engine", "hardware"})


def profile_from_dict(data: dict[str, Any]) -> ModelProfile:
    unknown = sorted(set(data) - _ROUTER_KEYS - EMULATOR_SECTIONS)
    if unknown:
        # A misspelt key would otherwise fall back to its default without a word.
        raise ValueError(f"malformed profile {data.get('model', '?')}: unknown key(s) {', '.join(unknown)}")
    try:
        return ModelProfile(
            model=str(data["model"]),
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            prefill=PrefillModel(**data["prefill"]),
            link=LinkModel(**data["link"]),
            min_reuse_tokens=int(data.get("min_reuse_tokens", 64)),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed profile {data.get('model', '?')}: {exc}") from exc


def load_profiles(path: Path) -> list[ModelProfile]:
    """Profiles from a TOML file with one `[[profile]]` table per model."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    return [profile_from_dict(p) for p in data.get("profile", [])]


class _Window:
    """A quantile (the median by default) of the last observations, each clipped to
    [low, high]."""

    def __init__(self, low: float, high: float, quantile: float = 0.5) -> None:
        self._low, self._high = low, high
        self._quantile = quantile
        self._values: deque[float] = deque(maxlen=_WINDOW)
        # Read for every candidate node of every plan, changed once per commit: kept until then.
        self._value: float | None = None

    def add(self, value: float) -> None:
        self._values.append(min(max(value, self._low), self._high))
        self._value = None

    def value(self) -> float | None:
        if len(self._values) < _MIN_SAMPLES:
            return None
        if self._value is None:
            if self._quantile == 0.5:
                self._value = statistics.median(self._values)
            else:
                ordered = sorted(self._values)
                self._value = ordered[min(int(self._quantile * len(ordered)), len(ordered) - 1)]
        return self._value


class CostModel:
    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        self._prefill_scale = self._scale_window()
        self._node_scales: OrderedDict[str, _Window] = OrderedDict()
        bw = profile.link.bandwidth_gb_s
        self._bandwidth = _Window(bw / _MAX_SCALE**2, bw * _MAX_SCALE**2)
        self._handoff_fixed = _Window(0.0, _MAX_HANDOFF_MS, PREFILL_QUANTILE)

    @staticmethod
    def _scale_window() -> _Window:
        return _Window(1 / _MAX_SCALE, _MAX_SCALE, PREFILL_QUANTILE)

    @property
    def prefill_scale(self) -> float:
        """Measured over predicted prefill time across nodes (1.0 until measured)."""
        return self._prefill_scale.value() or 1.0

    def node_prefill_scale(self, node: str) -> float:
        """`node`'s own, once measured enough; the scale across nodes until then."""
        window = self._node_scales.get(node) if node else None
        value = window.value() if window is not None else None
        return value if value is not None else self.prefill_scale

    @property
    def bandwidth_gb_s(self) -> float:
        return self._bandwidth.value() or self.profile.link.bandwidth_gb_s

    def prefill_ms(self, computed: int, cached: int, node: str = "") -> float:
        return self.profile.prefill.ms(computed, cached) * self.node_prefill_scale(node)

    def transfer_ms(self, tokens: int) -> float:
        return self.profile.link.ms(tokens * self.profile.kv_bytes_per_token, self.bandwidth_gb_s)

    def handoff_ms(self, read_tokens: int) -> float:
        """Prefill's answer to decode's first token when decode reads `read_tokens` of the
        prompt's KV: the link's time for them, plus the hop's fixed part once measured."""
        return self.transfer_ms(read_tokens) + (self._handoff_fixed.value() or 0.0)

    def recompute(self, prompt_tokens: int, local_hits: int, node: str = "") -> Estimate:
        """Compute what prefill node `node` ("": any) does not hit in its prefix cache."""
        cached = min(local_hits, prompt_tokens)
        return Estimate(0.0, self.prefill_ms(prompt_tokens - cached, cached, node))

    def reuse(self, prompt_tokens: int, reusable: int, local_hits: int, node: str = "") -> Estimate:
        """Read what the prefill node lacks of the reusable prefix, compute the rest."""
        cached = min(max(reusable, local_hits), prompt_tokens)
        read = max(reusable - local_hits, 0)
        return Estimate(self.transfer_ms(read), self.prefill_ms(prompt_tokens - cached, cached, node))

    def extend(
        self,
        prompt_tokens: int,
        held_tokens: int,
        *,
        running: int,
        interference_weight: float,
        node: str = "",
    ) -> Estimate:
        """Run the turn on the decode node holding `held_tokens` of the prompt in its prefix
        cache: it computes the rest (at least the last token, as vLLM does) while each of its
        `running` decodes waits about as long, weighted by `interference_weight`."""
        cached = min(held_tokens, prompt_tokens - 1)
        prefill = self.prefill_ms(prompt_tokens - cached, cached, node)
        return Estimate(0.0, prefill, prefill * running * interference_weight)

    def observe_prefill(self, *, computed: int, cached: int, measured_ms: float, node: str = "") -> None:
        """A measured prefill (without its KV read) of `computed` tokens on top of `cached` ones,
        on prefill node `node` ("": not known)."""
        predicted = self.profile.prefill.ms(computed, cached)
        if predicted <= 0 or measured_ms <= 0:
            return
        ratio = measured_ms / predicted
        self._prefill_scale.add(ratio)
        if node:
            window = self._node_scales.pop(node, None) or self._scale_window()
            self._node_scales[node] = window  # most recently measured last
            window.add(ratio)
            if len(self._node_scales) > _MAX_NODES:
                self._node_scales.popitem(last=False)

    def observe_handoff(self, *, read_tokens: int, measured_ms: float) -> None:
        """A measured hand-off (prefill's answer to decode's first token) of a turn whose decode
        read at most `read_tokens` of the prompt's KV."""
        if measured_ms > 0:
            self._handoff_fixed.add(max(measured_ms - self.transfer_ms(read_tokens), 0.0))

    def observe_transfer(self, *, nbytes: int, measured_ms: float) -> None:
        wire_ms = measured_ms - self.profile.link.fixed_ms
        if nbytes > 0 and wire_ms > 0:
            self._bandwidth.add(nbytes / (wire_ms * 1e6))


def price_extend(
    cost: CostModel,
    policy: ExtendPolicy,
    *,
    prompt_tokens: int,
    held_tokens: int,
    running: int,
    waiting: int,
    other: Estimate,
    decode_is_holder: bool,
    holder: str = "",
    kv_usage: float = 0.0,
    queued_ms: float = 0.0,
) -> tuple[Estimate | None, bool]:
    """Extending on a decode holder with `held_tokens` of the prompt in full blocks,
    `running`/`waiting` requests and its KV cache `kv_usage` full, against `other` (the prefill
    path: reuse or recompute) on a prefill node whose queue holds a turn `queued_ms` before it
    starts: its estimate (None: not a candidate, nothing held, no room in the batch or the
    cache) and whether it wins; `holder`: the node's name, for its own prefill speed ("": across
    nodes). The prefill path also has its decode read the prompt's KV from prefill: all of it,
    or past the held blocks when that decode is the holder (its prefix cache has them);
    extending moves nothing and joins no prefill queue."""
    if (
        not policy.enabled
        or held_tokens <= 0
        or running + waiting >= policy.max_batch
        or kv_usage > policy.max_kv_usage
    ):
        return None, False
    extend = cost.extend(
        prompt_tokens,
        held_tokens,
        running=running,
        interference_weight=policy.interference_weight,
        node=holder,
    )
    handoff_ms = cost.handoff_ms(prompt_tokens - (held_tokens if decode_is_holder else 0))
    wins = (
        extend.prefill_ms <= policy.max_prefill_ms
        and extend.total_ms < other.total_ms + queued_ms + handoff_ms
    )
    return extend, wins
