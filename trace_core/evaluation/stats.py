"""The statistics of stage `evaluation` (docs/method.md §5): pass^k per method with bootstrap intervals, per-family
pass^1, paired comparisons against a reference method, and the paper-style results table.

Every method must have played the same held-out instances the same number of times (`check_coverage`). Then:

- pass^k of a method is τ²'s definition (`trace_core.metrics`): the mean over instances of C(c, k) / C(n, k),
  with n trials and c successes per instance; success is a reward within 1e-6 of 1.0, as in `metrics.summarize`.
- Intervals are percentile bootstraps over instances (the instance is the unit the score averages over; its trials
  are resampled together). Every bootstrap uses the same seed, so two methods on the same instances see the same
  resamples and a run is reproducible byte for byte. With one trial per instance pass^1 is a binomial proportion,
  and its Wilson interval is reported as well: a bootstrap interval collapses to a point when every instance agrees
  (e.g. 0 of 12 solved), Wilson's does not.
- The paired comparison of a method with the reference (default "base") takes, per instance, the difference of the
  two success rates (c/n): their mean (= the difference in pass^1), a paired bootstrap interval, how many instances
  improved or regressed, and an exact two-sided sign test over the instances that changed.

All results are plain JSON-ready dicts; rates are fractions in [0, 1] rounded to 4 decimals, p-values to 4
significant digits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from statistics import NormalDist
from typing import Any

from trace_core.metrics import SUCCESS_TOLERANCE, is_success, pass_hat_k, pass_k
from trace_core.schemas import Trajectory
from trace_core.training.evaluation import paired_bootstrap_interval, wilson_interval

SHOWN_MISSING = 5  # (instance, trial) pairs named in a coverage error; the rest are counted


class CoverageError(ValueError):
    """The methods did not all play the same instances and trials: their scores would not be comparable."""


def _rate(x: float) -> float:
    return round(float(x), 4)


def _interval(ci: Sequence[float]) -> list[float]:
    return [_rate(ci[0]), _rate(ci[1])]


def _z(level: float) -> float:
    """The standard normal quantile for a two-sided interval at `level` (Wilson's z)."""
    return NormalDist().inv_cdf(0.5 + level / 2)


def _check_level(samples: int, level: float) -> None:
    if samples < 1:
        raise ValueError(f"bootstrap samples must be at least 1, got {samples}")
    if not 0 < level < 1:
        raise ValueError(f"the interval level must be within (0, 1), e.g. 0.95; got {level}")


# -- coverage -----------------------------------------------------------------------------------------------------


def check_coverage(results: Mapping[str, Sequence[Trajectory]]) -> dict[str, Any]:
    """Check that every method played every instance id x trial number seen in any method, once each, and that an
    instance has one family everywhere. Returns {"instances", "trials", "families": {family: instances}};
    raises `CoverageError` naming what is missing, duplicated or inconsistent."""
    if not results:
        raise CoverageError("no methods to evaluate: pass a dict of method name -> trajectories")
    family_of: dict[str, str] = {}
    seen: dict[str, set[tuple[str, int]]] = {}
    problems: list[str] = []
    for method, trajectories in results.items():
        if not trajectories:
            problems.append(f"method {method!r} has no trajectories")
        keys: set[tuple[str, int]] = set()
        duplicates: list[str] = []
        for t in trajectories:
            key = (t.instance_id, t.trial)
            if key in keys:
                duplicates.append(f"{t.instance_id}#{t.trial}")
            keys.add(key)
            known = family_of.setdefault(t.instance_id, t.family)
            if known != t.family:
                problems.append(f"instance {t.instance_id!r} is family {known!r} in one trajectory and {t.family!r} "
                                f"in another (method {method!r}); fix the instance ids or families upstream")
        if duplicates:
            problems.append(f"method {method!r} has {len(duplicates)} duplicate (instance, trial) trajectories: "
                            f"{', '.join(sorted(duplicates)[:SHOWN_MISSING])}; keep one trajectory per trial")
        seen[method] = keys
    instances = sorted({i for keys in seen.values() for i, _ in keys})
    trials = sorted({k for keys in seen.values() for _, k in keys})
    expected = {(i, k) for i in instances for k in trials}
    for method, keys in seen.items():
        missing = sorted(expected - keys)
        if missing and keys:
            shown = ", ".join(f"{i}#{k}" for i, k in missing[:SHOWN_MISSING])
            more = f" and {len(missing) - SHOWN_MISSING} more" if len(missing) > SHOWN_MISSING else ""
            problems.append(f"method {method!r} is missing {len(missing)} of {len(expected)} (instance, trial) "
                            f"pairs: {shown}{more}")
    if problems:
        raise CoverageError(
            f"methods must all play the same instances x trials ({len(instances)} instance ids x trials {trials}):"
            "\n  - "
            + "\n  - ".join(problems)
            + "\nPlay the missing episodes (a resumed stage run does), or leave the incomplete method out of results."
        )
    families: dict[str, int] = {}
    for i in instances:
        families[family_of[i]] = families.get(family_of[i], 0) + 1
    return {"instances": len(instances), "trials": len(trials), "families": dict(sorted(families.items()))}


def _outcomes(trajectories: Iterable[Trajectory]) -> dict[str, tuple[str, int, int]]:
    """instance_id -> (family, trials, successes), in sorted id order (the order every bootstrap resamples)."""
    table: dict[str, list] = {}
    for t in trajectories:
        entry = table.setdefault(t.instance_id, [t.family, 0, 0])
        entry[1] += 1
        entry[2] += int(is_success(t.reward))
    return {i: (e[0], e[1], e[2]) for i, e in sorted(table.items())}


# -- one method ---------------------------------------------------------------------------------------------------


def score(
    counts: Sequence[tuple[int, int]], k: int, *, samples: int, level: float, seed: int,
) -> dict[str, Any]:
    """pass^k of (trials, successes) per instance with a percentile bootstrap interval over instances:
    {"value", "ci": [low, high], "instances"} (+ "wilson_ci" when every instance has one trial and k is 1)."""
    _check_level(samples, level)
    counts = list(counts)
    value = pass_k(counts, k)
    per_instance = [pass_hat_k(n, c, k) for n, c in counts]
    out: dict[str, Any] = {
        "value": _rate(value),
        "ci": _interval(paired_bootstrap_interval(per_instance, samples=samples, level=level, seed=seed)),
        "instances": len(counts),
    }
    if k == 1 and all(n == 1 for n, _ in counts):
        out["wilson_ci"] = _interval(wilson_interval(sum(c for _, c in counts), len(counts), z=_z(level)))
    return out


def method_scores(
    trajectories: Sequence[Trajectory], ks: Iterable[int] | None = None, *, samples: int, level: float, seed: int,
) -> dict[str, Any]:
    """One method's scores: {"pass_hat_k": {"1": score, ...}, "families": {family: pass^1 score}, "mean_reward"}.
    `ks` defaults to every k from 1 to the number of trials (τ² reports no k above the fewest trials of a task)."""
    outcomes = _outcomes(trajectories)
    if not outcomes:
        raise ValueError("a method needs at least one trajectory to be scored")
    counts = [(n, c) for _, n, c in outcomes.values()]
    min_trials = min(n for n, _ in counts)
    wanted = sorted(set(ks)) if ks is not None else list(range(1, min_trials + 1))
    too_big = [k for k in wanted if k < 1 or k > min_trials]
    if too_big:
        raise ValueError(f"pass^k needs 1 <= k <= trials per instance ({min_trials}); drop k = {too_big} or play more "
                         "trials (params.yaml evaluation.trials)")
    families: dict[str, Any] = {}
    for family in sorted({f for f, _, _ in outcomes.values()}):
        family_counts = [(n, c) for f, n, c in outcomes.values() if f == family]
        families[family] = score(family_counts, 1, samples=samples, level=level, seed=seed)
    rewards = [t.reward for t in trajectories]
    return {
        "pass_hat_k": {str(k): score(counts, k, samples=samples, level=level, seed=seed) for k in wanted},
        "families": families,
        "mean_reward": _rate(sum(rewards) / len(rewards)),
    }


def graded_scores(
    trajectories: Sequence[Trajectory], *, samples: int, level: float, seed: int,
) -> dict[str, Any]:
    """A graded reward's scores (ToolSandbox's similarity): {"similarity": {"value", "ci", "instances"} (the mean
    reward, each instance's trials averaged, with a percentile bootstrap interval over instances), "perfect":
    {"count", "episodes", "ci"} (episodes with reward 1.0, i.e. successes; the interval is pass^1's bootstrap
    interval times the episodes)}."""
    _check_level(samples, level)
    per_instance: dict[str, list[float]] = {}
    for t in trajectories:
        per_instance.setdefault(t.instance_id, []).append(float(t.reward))
    if not per_instance:
        raise ValueError("a method needs at least one trajectory to be scored")
    means = [sum(r) / len(r) for _, r in sorted(per_instance.items())]
    outcomes = _outcomes(trajectories)
    episodes = sum(n for _, n, _ in outcomes.values())
    count = sum(c for _, _, c in outcomes.values())
    rates = [c / n for _, n, c in outcomes.values()]
    low, high = paired_bootstrap_interval(rates, samples=samples, level=level, seed=seed)
    scale = episodes / len(rates)  # pass^1 x instances x trials = the count
    return {
        "similarity": {"value": _rate(sum(means) / len(means)),
                       "ci": _interval(paired_bootstrap_interval(means, samples=samples, level=level, seed=seed)),
                       "instances": len(means)},
        "perfect": {"count": count, "episodes": episodes,
                    "ci": [round(low * len(rates) * scale, 2), round(high * len(rates) * scale, 2)]},
    }


def graded_comparison(
    method: Sequence[Trajectory], reference: Sequence[Trajectory], *, samples: int, level: float, seed: int,
) -> dict[str, Any]:
    """The paired difference in mean reward (similarity) of `method` and `reference` on the same instances:
    {"difference", "ci"} (paired bootstrap over instances)."""
    def means(trajectories: Sequence[Trajectory]) -> dict[str, float]:
        table: dict[str, list[float]] = {}
        for t in trajectories:
            table.setdefault(t.instance_id, []).append(float(t.reward))
        return {i: sum(r) / len(r) for i, r in table.items()}

    ours, theirs = means(method), means(reference)
    differences = [ours[i] - theirs[i] for i in sorted(ours)]
    return {"difference": _rate(sum(differences) / len(differences)),
            "ci": _interval(paired_bootstrap_interval(differences, samples=samples, level=level, seed=seed))}


# -- two methods --------------------------------------------------------------------------------------------------


def sign_test_p(improved: int, regressed: int) -> float:
    """Exact two-sided sign test: the chance, under "improving and regressing are equally likely", of a split at
    least as uneven as the one observed among the instances that changed (1.0 when none changed)."""
    if improved < 0 or regressed < 0:
        raise ValueError(f"counts must be non-negative, got improved={improved}, regressed={regressed}")
    n = improved + regressed
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(improved, regressed) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(
    method: Sequence[Trajectory], reference: Sequence[Trajectory], *, samples: int, level: float, seed: int,
    names: tuple[str, str] = ("method", "reference"),
) -> dict[str, Any]:
    """`method` vs `reference` on the same instances x trials (`names` label them in a coverage error):
    {"difference" (mean per-instance success-rate difference, = the pass^1 difference), "ci" (paired bootstrap over
    instances), "instances", "improved", "regressed", "ties", "sign_test_p"}."""
    _check_level(samples, level)
    check_coverage({names[0]: method, names[1]: reference})
    ours, theirs = _outcomes(method), _outcomes(reference)
    differences = [ours[i][2] / ours[i][1] - theirs[i][2] / theirs[i][1] for i in ours]
    improved = sum(d > 0 for d in differences)
    regressed = sum(d < 0 for d in differences)
    p = sign_test_p(improved, regressed)
    return {
        "difference": _rate(sum(differences) / len(differences)),
        "ci": _interval(paired_bootstrap_interval(differences, samples=samples, level=level, seed=seed)),
        "instances": len(differences),
        "improved": improved,
        "regressed": regressed,
        "ties": len(differences) - improved - regressed,
        "sign_test_p": float(f"{p:.4g}"),
    }


# -- all methods --------------------------------------------------------------------------------------------------


def evaluate(
    results: Mapping[str, Sequence[Trajectory]],
    *,
    budgets: Mapping[str, int | None] | None = None,
    labels: Mapping[str, str] | None = None,
    reference: str | None = "base",
    ks: Iterable[int] | None = None,
    samples: int,
    level: float,
    seed: int,
    graded: bool = False,
) -> dict[str, Any]:
    """Every method's scores and its paired comparison with `reference` (None: no comparisons), in the order of
    `results`. `budgets`: training rollouts spent per method (None or absent: not applicable / unknown); `labels`:
    display names (default: the method name). `graded`: the reward is a graded score (ToolSandbox's similarity):
    each method also gets `graded_scores` ("similarity", "perfect") and "similarity_vs_reference", the summary
    "graded": true, and the table their columns.

    Returns {"reference", "instances", "trials", "ks", "families": {family: instances}, "bootstrap": {...},
    "warnings": [...], "methods": {name: {"label", "budget", "pass_hat_k", "families", "mean_reward",
    "vs_reference"}}} — "vs_reference" is None for the reference itself."""
    _check_level(samples, level)
    coverage = check_coverage(results)
    if reference is not None and reference not in results:
        raise ValueError(f"reference method {reference!r} is not among the results ({', '.join(results)}); play it, "
                         "or pass reference=None to skip the paired comparisons")
    budgets, labels = dict(budgets or {}), dict(labels or {})
    unknown = sorted((set(budgets) | set(labels)) - set(results))
    warnings = [f"budgets/labels given for methods without results, ignored: {', '.join(unknown)}"] if unknown else []
    for method, trajectories in results.items():
        disagree = sum(bool(t.success) != is_success(t.reward) for t in trajectories)
        if disagree:
            warnings.append(f"{method}: {disagree} trajectories have a success flag that disagrees with their reward; "
                            f"scores count a reward within {SUCCESS_TOLERANCE:g} of 1.0 as success (τ²'s rule)")
    wanted = sorted(set(ks)) if ks is not None else list(range(1, coverage["trials"] + 1))
    methods: dict[str, Any] = {}
    for method, trajectories in results.items():
        entry: dict[str, Any] = {"label": labels.get(method, method), "budget": budgets.get(method)}
        entry.update(method_scores(trajectories, wanted, samples=samples, level=level, seed=seed))
        entry["vs_reference"] = (
            None if reference is None or method == reference
            else paired_comparison(trajectories, results[reference], samples=samples, level=level, seed=seed,
                                 names=(method, reference))
        )
        if graded:
            entry.update(graded_scores(trajectories, samples=samples, level=level, seed=seed))
            entry["similarity_vs_reference"] = (
                None if reference is None or method == reference
                else graded_comparison(trajectories, results[reference], samples=samples, level=level, seed=seed)
            )
        methods[method] = entry
    graded_key = {"graded": True} if graded else {}
    return {
        **graded_key,
        "reference": reference,
        "instances": coverage["instances"],
        "trials": coverage["trials"],
        "ks": wanted,
        "families": coverage["families"],
        "bootstrap": {"samples": samples, "level": level, "seed": seed,
                      "method": "percentile bootstrap over instances (paired for differences)"},
        "warnings": warnings,
        "methods": methods,
    }


# -- the table ----------------------------------------------------------------------------------------------------


def _cell(s: Mapping[str, Any]) -> dict[str, Any]:
    return {"value": s["value"], "ci": list(s["ci"])}


def table_rows(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per method of an `evaluate` summary, in its order, in the shape `report.TableRow` validates:
    {"method", "label", "budget", "reference", "families": {family: {"value", "ci"}}, "overall": {...},
    "pass_k": {"2": {...}, ...} (k > 1), "delta": {"value", "ci"} | None, "p_value", "improved", "regressed"}."""
    rows = []
    for method, m in summary["methods"].items():
        vs = m.get("vs_reference")
        rows.append({
            "method": method,
            "label": m["label"],
            "budget": m["budget"],
            "reference": method == summary.get("reference"),
            "families": {f: _cell(s) for f, s in m["families"].items()},
            "overall": _cell(m["pass_hat_k"]["1"]),
            "pass_k": {k: _cell(s) for k, s in m["pass_hat_k"].items() if k != "1"},
            "delta": None if vs is None else {"value": vs["difference"], "ci": list(vs["ci"])},
            "p_value": None if vs is None else vs["sign_test_p"],
            "improved": None if vs is None else vs["improved"],
            "regressed": None if vs is None else vs["regressed"],
        })
    return rows


def _pct(cell: Mapping[str, Any] | None, signed: bool = False) -> str:
    if cell is None:
        return "—"
    sign = "+" if signed else ""
    low, high = cell["ci"]
    return f"{100 * cell['value']:{sign}.1f} [{100 * low:{sign}.1f}, {100 * high:{sign}.1f}]"


def _similarity(cell: Mapping[str, Any] | None, signed: bool = False) -> str:
    if cell is None:
        return "—"
    sign = "+" if signed else ""
    low, high = cell["ci"]
    value = cell["value"] if "value" in cell else cell["difference"]
    return f"{value:{sign}.3f} [{low:{sign}.3f}, {high:{sign}.3f}]"


def _perfect(cell: Mapping[str, Any]) -> str:
    low, high = cell["ci"]
    return f"{cell['count']} / {cell['episodes']} [{low:g}, {high:g}]"


def format_budget(budget: int | None) -> str:
    """Training rollouts as shown in tables: thousands separators, "—" when not applicable."""
    return "—" if budget is None else f"{budget:,}"


def format_p(p: float | None) -> str:
    """A p-value as shown in tables: 3 decimals, "<0.001" below that, "—" when absent."""
    if p is None:
        return "—"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def results_table(summary: Mapping[str, Any]) -> str:
    """The paper-style markdown table of an `evaluate` summary: one row per method with its training rollouts,
    pass^1 per family and overall, pass^k for k > 1, and the paired difference with the reference; scores in %,
    [low, high] = the bootstrap interval. A legend line follows the table."""
    rows = table_rows(summary)
    families = list(summary["families"])
    ks = [k for k in summary["ks"] if k != 1]
    reference = summary.get("reference")
    level = summary["bootstrap"]["level"]
    graded = bool(summary.get("graded"))
    header = ["method", "training rollouts"]
    if graded:
        header += ["mean similarity", "perfect"] + ([f"Δ similarity vs {reference}"] if reference is not None else [])
    header += [*families, "overall pass^1", *[f"pass^{k}" for k in ks]]
    if reference is not None:
        header += [f"Δ vs {reference} (pts)", "sign test p"]
    align = ["---", "---:"] + ["---:"] * (len(header) - 2)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    for r in rows:
        cells = [r["label"].replace("|", "\\|"), format_budget(r["budget"])]
        if graded:
            m = summary["methods"][r["method"]]
            cells += [_similarity(m["similarity"]), _perfect(m["perfect"])]
            if reference is not None:
                cells.append(_similarity(m["similarity_vs_reference"], signed=True))
        cells += [_pct(r["families"].get(f)) for f in families]
        cells.append(_pct(r["overall"]))
        cells += [_pct(r["pass_k"].get(str(k))) for k in ks]
        if reference is not None:
            cells += [_pct(r["delta"], signed=True), format_p(r["p_value"])]
        lines.append("| " + " | ".join(cells) + " |")
    b = summary["bootstrap"]
    legend = (f"\npass^k in % over {summary['instances']} held-out instances x {summary['trials']} trial(s); "
              f"[low, high] = {level:.0%} percentile bootstrap interval over instances ({b['samples']} resamples, "
              f"seed {b['seed']}).")
    if reference is not None:
        legend += (f" Δ = mean per-instance difference in success rate vs {reference} (percentage points, paired "
                   "bootstrap); p = exact two-sided sign test over the instances that changed.")
    if graded:
        legend += (" mean similarity = the mean graded reward (ToolSandbox's evaluator similarity, in [0, 1]) with its "
                   "bootstrap interval; perfect = episodes with similarity 1.0 (= successes, the count behind pass^1) "
                   "of all episodes, [low, high] = pass^1's interval in episodes"
                   + (f"; Δ similarity = paired difference vs {reference}." if reference is not None else "."))
    return "\n".join(lines) + "\n" + legend + "\n"


__all__ = [
    "CoverageError",
    "check_coverage",
    "evaluate",
    "format_budget",
    "format_p",
    "graded_comparison",
    "graded_scores",
    "method_scores",
    "paired_comparison",
    "results_table",
    "score",
    "sign_test_p",
    "table_rows",
]
