"""Power of the TRACE study (issue #31): the minimum detectable paired difference (MDE) between a method and the base
agent on n held-out target instances, with the exact two-sided sign test (trace_core/evaluation/power.py explains the
model), and the smallest study size whose MDE is within the target.

Inputs are measured figures, never guesses:
  * the base agent's success per task family: a baseline metrics.json (`--baseline`, its per_family pass^1), or the
    figures of the last full baseline run (docs/results.md, 120 instances, 2026-12-05) when none is given;
  * how often an adapter loses a task the base agent solved (`regress`): the pooled `regressed / base successes` of
    training eval.json files (`--evals`), or the last measured own-environment evaluations (docs/results.md:
    tool_call_precision 4 of 28, identification 0 of 35: 4 / 63) when none are given.

    .venv/bin/python scripts/power.py
    .venv/bin/python scripts/power.py --baseline artifacts/baseline/metrics.json \\
        --evals 'artifacts/training/*/eval.json' --out docs/results/power.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Measured by the last full baseline run (docs/results.md): pass^1 per family over 24 instances each.
MEASURED_FAMILIES = {"single_write": 0.625, "identify_then_act": 0.333, "policy_refusal": 0.333, "compound": 0.0,
                     "variant_choice": 0.0}
MEASURED_REGRESSED, MEASURED_BASE_SUCCESSES = 4, 63  # tool_call_precision 4/28 + identification 0/35 (64 seeds each)


def _families(path: str | None) -> tuple[dict[str, float], str]:
    if path is None:
        return dict(MEASURED_FAMILIES), "docs/results.md: baseline of 2026-12-05 (120 instances)"
    metrics = json.loads(Path(path).read_text())
    per_family = metrics.get("families") or {}
    if not per_family:
        raise SystemExit(f"{path} has no per-family figures ('families'); pass the baseline stage's metrics.json")
    n = sum(int(v["n_tasks"]) for v in per_family.values())
    return {name: float(v["pass_hat_1"]) for name, v in per_family.items()}, f"{path} ({n} instances)"


def _regress(pattern: str | None) -> tuple[float, str]:
    if pattern is None:
        return MEASURED_REGRESSED / MEASURED_BASE_SUCCESSES, "docs/results.md: 4 of 63 base successes lost"
    lost = kept = 0
    files = sorted(glob.glob(pattern))
    for path in files:
        record = json.loads(Path(path).read_text())
        lost += int(record["difference"]["regressed"])
        kept += int(record["base"]["successes"])
    if not files or kept == 0:
        raise SystemExit(f"no eval.json with base successes matches {pattern!r}")
    return lost / kept, f"{len(files)} eval.json files: {lost} of {kept} base successes lost"


def main(argv: list[str] | None = None) -> int:
    from trace_core.evaluation.power import minimum_detectable_difference

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="a baseline stage's metrics.json (per-family base success)")
    ap.add_argument("--evals", help="glob of training eval.json files (adapters' measured regressions)")
    ap.add_argument("--per-family", default="8,16,24,40,48,64,80",
                    help="candidate instances per family, comma-separated (default 8,16,24,40,48,64,80)")
    ap.add_argument("--alpha", type=float, default=0.05, help="two-sided significance level (default 0.05)")
    ap.add_argument("--power", type=float, default=0.8, help="target power (default 0.8)")
    ap.add_argument("--target", type=float, default=0.08, help="largest acceptable overall MDE (default 0.08)")
    ap.add_argument("--min-instances", type=int, default=200, help="smallest study considered (default 200)")
    ap.add_argument("--out", help="write the chosen size and its MDE as JSON here (e.g. docs/results/power.json)")
    args = ap.parse_args(argv)

    families, family_source = _families(args.baseline)
    regress, regress_source = _regress(args.evals)
    sizes = sorted({int(s) for s in args.per_family.split(",")})
    print(f"base success per family ({family_source}): "
          + ", ".join(f"{k} {v:.3f}" for k, v in families.items()))
    print(f"adapter regressions ({regress_source}): regress = {regress:.3f}")
    print(f"exact two-sided sign test, alpha {args.alpha}, power {args.power}\n")
    header = f"{'per family':>10} {'instances':>9} {'overall MDE':>11}  " + "  ".join(f"{k[:12]:>12}" for k in families)
    print(header)
    rows = []
    for per in sizes:
        n = per * len(families)
        p0 = sum(families.values()) / len(families)  # equal instances per family
        overall = minimum_detectable_difference(n, p0, regress, args.alpha, args.power)
        by_family = {k: minimum_detectable_difference(per, v, regress, args.alpha, args.power).mde
                     for k, v in families.items()}
        rows.append({"per_family": per, "instances": n, "p0": p0, "mde": overall.mde, "gain": overall.gain,
                     "mde_per_family": by_family})
        cells = "  ".join(f"{'-' if math.isnan(m) else f'{m:+.3f}':>12}" for m in by_family.values())
        print(f"{per:>10} {n:>9} {overall.mde:>+11.3f}  {cells}")
    ok = [r for r in rows if r["instances"] >= args.min_instances and r["mde"] <= args.target]
    if not ok:
        print(f"\nno candidate size reaches MDE <= {args.target} with >= {args.min_instances} instances")
        return 1
    chosen = ok[0]
    print(f"\nchosen: {chosen['per_family']} per family, {chosen['instances']} instances: overall MDE "
          f"{chosen['mde']:+.3f} (an adapter that solves {chosen['gain']:.1%} of the base agent's failures and loses "
          f"{regress:.1%} of its successes)")
    if args.out:
        out = {"mde": chosen["mde"], "instances": chosen["instances"], "per_family": chosen["per_family"],
               "alpha": args.alpha, "power": args.power, "test": "exact two-sided sign test",
               "base_success": families, "base_source": family_source, "regress": regress,
               "regress_source": regress_source, "candidates": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
