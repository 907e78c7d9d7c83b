"""The statistics of docs/method.md §1 and the selection rule, plus bootstrap CIs and agreement across runs.

Per labelling run r and capability c (LF = LACKING on a failed trajectory, PF = PRESENT on a failed one, LP/PP on
successful ones; NA counts nowhere):
    ER−  = LF / (LF + PF)        ER+ = LP / (LP + PP)        (0 when the denominator is 0)
    Δ    = ER− − ER+             coverage = LF / |failed trajectories|
c passes run r when coverage ≥ rho and Δ ≥ delta; c is selected when it passes in ≥ K of N runs. A labeller with
R runs (e.g. a deterministic one with R = 1) must pass in ceil(K·R/N) of them.
CIs: percentile bootstrap over trajectories (the same resample for every run), of the run-averaged Δ and coverage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trace_core.schemas import CapabilityStats

CODES = {"NA": 0, "PRESENT": 1, "LACKING": 2}


@dataclass(frozen=True)
class Thresholds:
    rho: float
    delta: float
    k: int
    n: int
    ci: float
    bootstrap_samples: int

    def runs_required(self, runs: int) -> int:
        return max(1, math.ceil(self.k * runs / self.n))


def _per_run(labels: np.ndarray, success: np.ndarray) -> dict[str, np.ndarray]:
    """labels: int codes [..., R, T]; success: bool [..., T] (broadcast over runs). Arrays over [..., R]."""
    failed = ~success[..., None, :]
    passed = success[..., None, :]
    lacking, present = labels == 2, labels == 1
    lf = (lacking & failed).sum(-1).astype(float)
    pf = (present & failed).sum(-1).astype(float)
    lp = (lacking & passed).sum(-1).astype(float)
    pp = (present & passed).sum(-1).astype(float)
    n_failed = failed.sum(-1).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        er_minus = np.where(lf + pf > 0, lf / np.maximum(lf + pf, 1), 0.0)
        er_plus = np.where(lp + pp > 0, lp / np.maximum(lp + pp, 1), 0.0)
        coverage = np.where(n_failed > 0, lf / np.maximum(n_failed, 1), 0.0)
    return {"lf": lf, "pf": pf, "lp": lp, "pp": pp, "er_minus": er_minus, "er_plus": er_plus,
            "delta": er_minus - er_plus, "coverage": coverage}


def agreement(labels: np.ndarray) -> tuple[float | None, float | None]:
    """(mean pairwise agreement, Fleiss' kappa) of R runs' labels [R, T]; (None, None) with fewer than 2 runs.
    Kappa is None when every label is the same category (chance agreement is then 1)."""
    runs, n = labels.shape
    if runs < 2 or n == 0:
        return None, None
    pairs = [(a, b) for a in range(runs) for b in range(a + 1, runs)]
    pairwise = float(np.mean([np.mean(labels[a] == labels[b]) for a, b in pairs]))
    counts = np.stack([(labels == c).sum(0) for c in range(3)], axis=1).astype(float)  # [T, 3]
    p_i = (np.square(counts).sum(1) - runs) / (runs * (runs - 1))
    p_j = counts.sum(0) / (n * runs)
    p_e = float(np.square(p_j).sum())
    kappa = None if p_e >= 1.0 - 1e-12 else float((p_i.mean() - p_e) / (1 - p_e))
    return pairwise, kappa


def within_strata_delta(labels: np.ndarray, success: np.ndarray, strata: np.ndarray) -> np.ndarray:
    """Δ per run [R] within strata (e.g. task families): in each stratum with judged failed and judged successful
    trajectories, ER− − ER+, averaged with Cochran-Mantel-Haenszel weights n−·n+ / (n− + n+) (n−, n+: judged failed /
    successful trajectories there); 0 when no stratum has both. A capability whose LACKING labels only follow which
    stratum failed more (every trajectory of one family LACKING, say) has no contrast inside any stratum."""
    num = np.zeros(labels.shape[0])
    den = np.zeros(labels.shape[0])
    for stratum in np.unique(strata):
        inside = strata == stratum
        per = _per_run(labels[:, inside], success[inside])
        n_minus, n_plus = per["lf"] + per["pf"], per["lp"] + per["pp"]
        weight = np.where((n_minus > 0) & (n_plus > 0), n_minus * n_plus / np.maximum(n_minus + n_plus, 1), 0.0)
        num += weight * per["delta"]
        den += weight
    return np.where(den > 0, num / np.maximum(den, 1e-12), 0.0)


def capability_stats(
    labels: np.ndarray, success: np.ndarray, th: Thresholds, seed: int, strata: np.ndarray | None = None
) -> CapabilityStats:
    """Statistics of one capability from its labels [R, T] (codes) and the trajectories' success flags [T]. With
    `strata` [T] (task families), a run passes only if Δ within strata (`within_strata_delta`) also reaches delta."""
    runs, n = labels.shape
    per = _per_run(labels, success)
    passed = (per["coverage"] >= th.rho - 1e-12) & (per["delta"] >= th.delta - 1e-12)
    within = within_strata_delta(labels, success, strata) if strata is not None else None
    if within is not None:
        passed &= within >= th.delta - 1e-12

    rng = np.random.default_rng(seed)
    if n:
        idx = rng.integers(0, n, size=(th.bootstrap_samples, n))
        boot = _per_run(labels[:, idx].transpose(1, 0, 2), success[idx])  # [B, R]
        alpha = (1 - th.ci) / 2
        def ci(values: np.ndarray) -> tuple[float, float]:
            m = values.mean(-1)
            return (_r(np.quantile(m, alpha)), _r(np.quantile(m, 1 - alpha)))
        delta_ci, coverage_ci = ci(boot["delta"]), ci(boot["coverage"])
    else:
        delta_ci = coverage_ci = (0.0, 0.0)
    pairwise, kappa = agreement(labels)
    return CapabilityStats(
        runs=runs,
        runs_passed=int(passed.sum()),
        runs_required=th.runs_required(runs),
        coverage_mean=_r(per["coverage"].mean()),
        coverage_std=_r(per["coverage"].std()),
        delta_mean=_r(per["delta"].mean()),
        delta_std=_r(per["delta"].std()),
        er_minus_mean=_r(per["er_minus"].mean()),
        er_plus_mean=_r(per["er_plus"].mean()),
        coverage_ci=coverage_ci,
        delta_ci=delta_ci,
        lacking_failed=_r(per["lf"].mean()),
        present_failed=_r(per["pf"].mean()),
        lacking_passed=_r(per["lp"].mean()),
        present_passed=_r(per["pp"].mean()),
        agreement=None if pairwise is None else _r(pairwise),
        kappa=None if kappa is None else _r(kappa),
        delta_within_family_mean=None if within is None else _r(within.mean()),
    )


def _r(x: float) -> float:
    # Rounded so that the dictionary is byte-identical across platforms' last-bit float differences.
    return round(float(x), 6)
