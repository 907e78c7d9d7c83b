"""The routing section of stage evaluation: every router (label, channel, gate scoring) against a ground truth that
no router made, and TRACE routed by each of them beside oracle routing.

Ground truth (`routing.truth.ground_truth`): analysis' programmatic labeller on the base agent's own held-out
trajectories (the `base` row's episodes): a solved task needs no adapter, a failed one the capability it lacked
when it lacked exactly one of the adapters' capabilities; other failed tasks are ambiguous and not scored. Each
router is scored against it (accuracy, per-class recall, confusion matrix, `routing_accuracy`) and against the
family -> capability map of analysis (stage routing's `accuracy`); the map itself is scored against the ground
truth too. `routing.csv` has one row per router: router, instances (the ground truth's scored tasks), accuracy,
majority_baseline (always guessing the ground truth's most frequent class), distractors_to_base (held-out
off-topic openings routed to no adapter), trace_success (TRACE routed by it, pass^1) and oracle_success (oracle
routing on the same instances); empty cells where a row was not played.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trace_core.routing.router import routing_accuracy
from trace_core.routing.truth import AMBIGUOUS
from trace_core.schemas import RoutingDecisions, Trajectory

CSV_COLUMNS = ("router", "instances", "accuracy", "majority_baseline", "distractors_to_base", "trace_success",
               "oracle_success")


def _rate(trajectories: Sequence[Trajectory] | None) -> float | None:
    if not trajectories:
        return None
    return round(sum(t.success for t in trajectories) / len(trajectories), 4)


def trace_method(scoring: str, main: str, results: Mapping[str, Any]) -> str | None:
    """The method whose episodes are TRACE routed by `scoring`: trace_<scoring>, or trace for the main scoring."""
    if f"trace_{scoring}" in results:
        return f"trace_{scoring}"
    return "trace" if scoring == main and "trace" in results else None


def router_report(decisions: RoutingDecisions, truth: Mapping[str, str | None], results: Mapping[str, list],
                  main: str, comparison: Any, order: Sequence[str] = ()) -> dict[str, Any]:
    """{"ground_truth": counts, "family_map": the family map against the truth, "routers": {scoring: {...}}}.

    `truth`: instance id -> capability / None / AMBIGUOUS. `comparison(method, reference)`: the paired comparison
    of two methods' episodes (stats.paired_comparison with the stage's settings). `order`: the scorings' order
    (`routing.stage.routers`; decisions.json keeps its keys sorted), the others after it."""
    ids = list(decisions.adapters)
    labels = [*ids, None]
    scored = [i for i in decisions.instances if i in truth and truth[i] != AMBIGUOUS and truth[i] in labels]
    gold = [truth[i] for i in scored]
    counts = {"instances": len(decisions.instances), "scored": len(scored),
              "ambiguous": sum(truth.get(i) == AMBIGUOUS for i in decisions.instances),
              "classes": {("none" if c is None else c): gold.count(c) for c in labels if gold.count(c)}}
    out: dict[str, Any] = {"ground_truth": counts, "routers": {}, "family_map": None}
    family = {r.instance_id: r.family for r in (decisions.full.routes if decisions.full else [])}
    fmap = [decisions.family_capability.get(family.get(i, "")) for i in scored]
    if decisions.family_capability and scored:
        out["family_map"] = routing_accuracy([c if c in ids else None for c in fmap], gold, labels)
    oracle = results.get("oracle")
    for scoring in [*(s for s in order if s in decisions.routers), *(s for s in decisions.routers if s not in order)]:
        routed = decisions.routers[scoring]
        chosen = {r.instance_id: (r.chosen[0] if r.chosen else None) for r in routed.routes}
        entry: dict[str, Any] = {
            # None when no held-out task has a ground truth (all ambiguous): nothing to score.
            "vs_ground_truth": routing_accuracy([chosen[i] for i in scored], gold, labels) if scored else None,
            "vs_family_map": routed.accuracy,
            "distractors_to_base": routed.distractors_to_base,
            "method": trace_method(scoring, main, results),
        }
        method = entry["method"]
        entry["trace_success"] = _rate(results.get(method)) if method else None
        entry["oracle_success"] = _rate(oracle)
        entry["vs_oracle"] = comparison(method, "oracle") if method and oracle else None
        out["routers"][scoring] = entry
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def csv_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for scoring, entry in report.get("routers", {}).items():
        acc = entry["vs_ground_truth"] or {"n": 0, "accuracy": None, "chance_majority": None}
        rows.append({"router": scoring, "instances": acc["n"], "accuracy": _round(acc["accuracy"]),
                     "majority_baseline": _round(acc["chance_majority"]),
                     "distractors_to_base": entry["distractors_to_base"], "trace_success": entry["trace_success"],
                     "oracle_success": entry["oracle_success"]})
    return rows


def write_csv(path: Path, report: Mapping[str, Any]) -> None:
    """routing.csv (the header alone without routers; empty accuracy cells when no task has a ground truth)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in csv_rows(report):
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def _confusion_lines(acc: Mapping[str, Any]) -> list[str]:
    names = list(acc["confusion"])
    head = "| truth \\ routed | " + " | ".join(names) + " | recall |"
    lines = [head, "|" + "---|" * (len(names) + 2)]
    for o in names:
        recall = acc["per_label_recall"][o]
        lines.append(f"| {o} | " + " | ".join(str(acc["confusion"][o][p]) for p in names)
                     + f" | {'-' if recall is None else f'{recall:.0%}'} |")
    return lines


def markdown(report: Mapping[str, Any]) -> str:
    """The routing section of table.md: the ground truth, one line per router, each router's confusion matrix."""
    gt = report.get("ground_truth")
    if not gt or not report.get("routers"):
        return ""
    classes = ", ".join(f"{c} {n}" for c, n in gt["classes"].items())
    intro = (f"Ground truth: {gt['scored']} of {gt['instances']} held-out tasks labelled by analysis' programmatic "
             f"labeller on the base row's episodes ({gt['ambiguous']} ambiguous: none or several capabilities "
             f"lacking); classes {classes}.")
    lines = ["", "## Routing against the base agent's held-out trajectories", "", intro, ""]
    if report.get("family_map"):
        fm = report["family_map"]
        lines += [(f"The family -> capability map of analysis scores {fm['accuracy']:.0%} against it "
                   f"(majority {fm['chance_majority']:.0%})."), ""]
    lines += [("| router | accuracy | majority | vs family map | distractors -> base | TRACE | oracle | "
               "TRACE - oracle [CI] |"), "|---|---|---|---|---|---|---|---|"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    for scoring, e in report["routers"].items():
        acc = e["vs_ground_truth"] or {"n": 0, "accuracy": None, "chance_majority": None}
        fam, vs = e["vs_family_map"], e["vs_oracle"]
        diff = "-" if not vs else f"{vs['difference']:+.2f} [{vs['ci'][0]:+.2f}, {vs['ci'][1]:+.2f}]"
        lines.append(f"| {scoring} | {pct(acc['accuracy'])} (n={acc['n']}) | {pct(acc['chance_majority'])} | "
                     f"{pct(fam['accuracy'] if fam else None)} | {pct(e['distractors_to_base'])} | "
                     f"{pct(e['trace_success'])} | {pct(e['oracle_success'])} | {diff} |")
    for scoring, e in report["routers"].items():
        if e["vs_ground_truth"]:
            lines += ["", f"Confusion of {scoring} (rows: ground truth, columns: routed):", "",
                      *_confusion_lines(e["vs_ground_truth"])]
    if report.get("gate_selection"):
        lines += ["", gate_selection_line(report["gate_selection"])]
    return "\n".join(lines) + "\n"


def gate_selection_line(selection: Mapping[str, Any]) -> str:
    """The gate's chosen synthetic weight and C, with each grid point's cross-validated accuracy (gate.json's
    `selection`, routing.gate.select_settings)."""
    chosen = f"synthetic weight {selection['synthetic_weight']:g}, C {selection['inverse_regularization']:g}"
    cv = selection.get("cv")
    if not cv:
        return f"Gate: {chosen} ({selection.get('reason', 'no cross-validation')})."
    grid = "; ".join(f"{g['synthetic_weight']:g}/{g['inverse_regularization']:g}: {g['accuracy']:.0%}"
                     for g in cv["grid"])
    return (f"Gate: {chosen}, chosen by {cv['folds']}-fold cross-validation on {cv['openings']} baseline openings "
            f"({cv['instances']} instances; grouped by {cv['grouped_by']}, {cv['metric']}): synthetic weight / C: "
            f"{grid}.")


def notes(report: Mapping[str, Any]) -> list[str]:
    """One line per router for the HTML report's notes."""
    out = []
    for scoring, e in report.get("routers", {}).items():
        acc = e["vs_ground_truth"]
        if not acc:
            continue
        recall = ", ".join(f"{c} {'-' if r is None else f'{r:.0%}'}" for c, r in acc["per_label_recall"].items())
        vs = e["vs_oracle"]
        tail = f"; TRACE - oracle {vs['difference']:+.2f} [{vs['ci'][0]:+.2f}, {vs['ci'][1]:+.2f}]" if vs else ""
        dist = e["distractors_to_base"]
        out.append(f"Router {scoring}: {acc['accuracy']:.0%} of {acc['n']} held-out tasks against the base agent's "
                   f"ground truth (majority {acc['chance_majority']:.0%}; recall {recall}); distractors to base "
                   f"{'-' if dist is None else f'{dist:.0%}'}{tail}.")
    if report.get("gate_selection"):
        out.append(gate_selection_line(report["gate_selection"]))
    return out
