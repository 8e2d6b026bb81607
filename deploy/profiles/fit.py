"""Non-negative least squares of a profile's linear terms, on relative error.

Every term of the prefill and decode models is a cost, so a negative coefficient is refused
(it would make long prompts or big batches cheaper); with at most five terms the exact
non-negative solution is the best unconstrained solution over the subsets of terms whose
coefficients all come out non-negative. Each point is weighted by 1/measured, so a 100 ms
point counts as much as a 2 s one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvshuttle.router.cost import PrefillModel

MAX_TERMS = 6


@dataclass(frozen=True, slots=True)
class Fit:
    coefficients: tuple[float, ...]
    # Over the fitted points: the largest absolute error (ms) and relative error (fraction).
    max_abs_error_ms: float
    max_rel_error: float
    # The point of the largest relative error.
    worst: int

    def describe(self) -> str:
        return f"max error {self.max_abs_error_ms:.3g} ms, {100 * self.max_rel_error:.1f} %"


def fit_nonnegative(rows: Sequence[Sequence[float]], measured_ms: Sequence[float]) -> Fit:
    """Coefficients c >= 0 minimising sum(((rows @ c) - measured) / measured)^2."""
    a = np.asarray(rows, dtype=np.float64)
    y = np.asarray(measured_ms, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != y.shape[0] or a.shape[0] < a.shape[1]:
        raise ValueError(f"need at least as many points as terms: {a.shape} rows, {y.shape} measured")
    if a.shape[1] > MAX_TERMS or np.any(y <= 0):
        raise ValueError(f"at most {MAX_TERMS} terms and positive measurements")
    weighted = a / y[:, None]
    ones = np.ones_like(y)
    best: tuple[float, np.ndarray] | None = None
    terms = range(a.shape[1])
    for size in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(terms, size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(weighted[:, cols], ones, rcond=None)
            if np.any(solution < 0):
                continue
            full = np.zeros(a.shape[1])
            full[cols] = solution
            residual = float(np.sum((weighted @ full - ones) ** 2))
            if best is None or residual < best[0]:
                best = (residual, full)
    if best is None:
        raise ValueError("no non-negative fit")
    coefficients = best[1]
    errors = a @ coefficients - y
    return Fit(
        coefficients=tuple(float(c) for c in coefficients),
        max_abs_error_ms=float(np.max(np.abs(errors))),
        max_rel_error=float(np.max(np.abs(errors) / y)),
        worst=int(np.argmax(np.abs(errors) / y)),
    )


def prefill_row(computed: int, cached: int) -> list[float]:
    """The prefill model's terms (kvshuttle.router.cost.PrefillModel): 1, computed tokens,
    cached tokens, attention pairs in millions (so the coefficient is ns per pair)."""
    pairs = computed * cached + computed * (computed + 1) / 2
    return [1.0, float(computed), float(cached), pairs * 1e-6]


def prefill_model(fit: Fit) -> PrefillModel:
    fixed, per_token, per_cached, per_pair = fit.coefficients
    return PrefillModel(
        fixed_ms=fixed, per_token_ms=per_token, per_cached_token_ms=per_cached, per_pair_ns=per_pair
    )


def decode_row(batch: int, ctx_tokens: int) -> list[float]:
    """The decode model's terms (schema.DecodeModel): 1, sequences, context tokens in millions."""
    return [1.0, float(batch), ctx_tokens * 1e-6]
