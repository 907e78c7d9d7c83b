"""Statistical power of the study's paired comparison (issue #31): how large a difference between two methods played
on the same n held-out instances the exact two-sided sign test detects with a given power.

Model of a paired binary outcome. The reference method (the base agent) succeeds with probability `p0`. The other
method turns each of the reference's failures into a success with probability `gain` and each of its successes into
a failure with probability `regress`, independently per instance. Then the discordant pairs are
p01 = (1 - p0) * gain (the method wins) and p10 = p0 * regress (it loses), and the difference in success rates is
delta = p01 - p10. The sign test looks only at the discordant pairs: given D of them, the wins are
Binomial(D, p01 / (p01 + p10)) and the test rejects when the two-sided exact binomial p-value is below alpha. Power is
exact: the sum over D ~ Binomial(n, p01 + p10) of P(D) * P(reject | D) — no normal approximation, which is poor for
the few discordant pairs of a small study.

The minimum detectable difference (MDE) at n is the smallest delta (found by bisection on `gain`, `regress` fixed)
whose power reaches the target. `regress` is measured: the share of the base agent's successes an adapter lost on its
own environment (the `regressed` counts of the training stage's eval.json)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from scipy import stats


@cache
def _rejecting_wins(discordant: int, alpha: float) -> np.ndarray:
    """For D = `discordant` pairs, a boolean array over wins w = 0..D: does the two-sided exact sign test reject?"""
    wins = np.arange(discordant + 1)
    lower = stats.binom.cdf(wins, discordant, 0.5)  # P(W <= w)
    upper = stats.binom.sf(wins - 1, discordant, 0.5)  # P(W >= w)
    p_values = np.minimum(1.0, 2.0 * np.minimum(lower, upper))
    return p_values < alpha


def sign_test_power(n: int, p0: float, gain: float, regress: float, alpha: float) -> float:
    """Exact power of the two-sided sign test on n paired instances under the model in the module docstring."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for name, value in (("p0", p0), ("gain", gain), ("regress", regress), ("alpha", alpha)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    p01 = (1.0 - p0) * gain
    p10 = p0 * regress
    psi = p01 + p10
    if psi <= 0.0:
        return 0.0
    share = p01 / psi
    total = 0.0
    counts = np.arange(n + 1)
    p_count = stats.binom.pmf(counts, n, psi)
    for d in counts[p_count > 1e-12]:
        d = int(d)
        if d == 0:
            continue
        reject = _rejecting_wins(d, alpha)
        p_wins = stats.binom.pmf(np.arange(d + 1), d, share)
        total += p_count[d] * float(p_wins[reject].sum())
    return total


@dataclass(frozen=True)
class Detectable:
    n: int
    p0: float
    regress: float
    gain: float  # the gain at which power reaches the target; nan when no gain does
    mde: float  # delta = (1 - p0) * gain - p0 * regress at that gain; nan when no gain does
    power: float


def minimum_detectable_difference(n: int, p0: float, regress: float, alpha: float, power: float,
                                  tolerance: float = 1e-4) -> Detectable:
    """The smallest improvement (delta > 0) the sign test detects with probability >= `power` on n pairs.
    Power increases with `gain` at fixed `regress`, so bisection on gain finds it; nan when even gain = 1 falls
    short (or p0 = 1: nothing left to gain). A mix of families with equal gain and regress pools exactly: p01 and p10
    are linear in p0, so pass the instance-weighted mean success."""
    if sign_test_power(n, p0, 1.0, regress, alpha) < power or p0 >= 1.0:
        return Detectable(n, p0, regress, float("nan"), float("nan"), sign_test_power(n, p0, 1.0, regress, alpha))
    low, high = 0.0, 1.0
    while high - low > tolerance:
        mid = (low + high) / 2
        if sign_test_power(n, p0, mid, regress, alpha) >= power:
            high = mid
        else:
            low = mid
    return Detectable(n, p0, regress, high, (1.0 - p0) * high - p0 * regress,
                      sign_test_power(n, p0, high, regress, alpha))


__all__ = ["Detectable", "minimum_detectable_difference", "sign_test_power"]
