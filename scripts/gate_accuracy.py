"""Measure every router (label, channel, gate) against the routing ground truth of issue #30, before or without a
full pipeline run: from a warm-started base agent and a baseline run only.

    python scripts/gate_accuracy.py --work /tmp/gate-run \
        --bootstrap /work/run/artifacts/bootstrap --baseline /work/run/artifacts/baseline [-S key=value ...]

Into --work (everything written there; the bootstrap and baseline folders are only read):
1. analysis (programmatic labeller only, no controls) of the baseline -> analysis/{capabilities.json,labels.parquet}
   (the gate's target-domain labels and the family -> capability map);
2. a synthetic environment per capability of --capabilities (default synthesis.capabilities), selected or not
   (-> synthesis/<id>/), for the gate's synthetic openings and the channel cards;
3. the base agent's episodes on the held-out instances, played as stage evaluation plays its base row
   (evaluation/trajectories/base/, resumable) -> the ground truth (analysis' programmatic labeller);
4. each router's decisions over those capabilities (as stage routing makes them; the gate trained and timed) and
   its accuracy, majority baseline, per-class recall, confusion matrix and distractors sent to no adapter.
Prints a table and writes gate_accuracy.json. Adapters are not needed: routing only names them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--bootstrap", type=Path, required=True, help="bootstrap.out_dir of a run (its model/)")
    ap.add_argument("--baseline", type=Path, required=True, help="baseline.out_dir of a run")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--capabilities", nargs="*", default=None)
    ap.add_argument("--routers", nargs="*", default=["gate", "channel", "label"])
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="params override key=value (YAML)")
    args = ap.parse_args(argv)

    import yaml

    from trace_core.config import load_params

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)}
    overrides.update({
        "bootstrap.out_dir": str(args.bootstrap.resolve()), "baseline.out_dir": str(args.baseline.resolve()),
        "analysis.out_dir": str(work / "analysis"), "analysis.labellers": ["programmatic"],
        "analysis.controls": False, "synthesis.out_dir": str(work / "synthesis"),
        "routing.out_dir": str(work / "routing"), "evaluation.out_dir": str(work / "evaluation"),
    })
    if args.capabilities:
        overrides["synthesis.capabilities"] = args.capabilities
    params = load_params(args.params, overrides)
    report: dict = {"overrides": {k: v for k, v in overrides.items()}}

    # 1. analysis of the baseline (programmatic labels)
    from trace_core import analysis

    if not (work / "analysis" / "labels.parquet").exists():
        t = time.time()
        analysis.run(params)
        print(f"analysis: {time.time() - t:.0f} s", flush=True)
    from trace_core.schemas import CapabilityDictionary

    dictionary = CapabilityDictionary.model_validate_json((work / "analysis" / "capabilities.json").read_text())
    by_id = {c.capability_id: c for c in dictionary.capabilities}
    report["selected_by_analysis"] = list(dictionary.selected)

    # 2. synthetic environments, selected or not
    from trace_core.inputs import TrainedAdapter
    from trace_core.synthesis.stage import synthesize

    adapters = []
    for cid in params.synthesis.capabilities:
        cap = by_id.get(cid)
        if cap is None:
            print(f"skip {cid}: not in the analysis' dictionary", flush=True)
            continue
        folder = work / "synthesis" / cid
        if not (folder / "spec.json").exists() or json.loads((folder / "spec.json").read_text())["status"] != "ready":
            spec = synthesize(cap.model_copy(update={"selected": True}), params, work / "synthesis")
            if spec.status != "ready":
                print(f"skip {cid}: synthesis {spec.status} ({spec.reason})", flush=True)
                continue
        adapters.append(TrainedAdapter(cid, folder, 0, "-", cap.name, cap.definition))
    ids = [a.capability_id for a in adapters]
    report["capabilities"] = ids

    # 3. the base agent's held-out episodes and the ground truth
    from trace_core.analysis.programmatic import ProgrammaticLabeller
    from trace_core.envs.targets import target_env
    from trace_core.evaluation.stage import _open_arena
    from trace_core.inputs import check_held_out, held_out_instances
    from trace_core.routing.truth import AMBIGUOUS, ground_truth
    from trace_core.training.stage import base_agent

    instances = held_out_instances(params)
    check_held_out(instances, params)
    agent = base_agent(params)
    (work / "evaluation").mkdir(exist_ok=True)
    env = target_env(params.env.domain, params.env.profile)
    t = time.time()
    arena = _open_arena(params, agent, env, {}, work / "evaluation", {"base": agent.fingerprint, "script": 1}, True)
    try:
        base = arena.play("base", [({}, None, instances)])
    finally:
        arena.close()
    print(f"base episodes: {len(base)} in {time.time() - t:.0f} s, success {sum(x.success for x in base)}",
          flush=True)
    truth = ground_truth(base, instances, ids, ProgrammaticLabeller.for_domain(base[0].domain))
    scored = [i for i in instances if truth[i.instance_id] != AMBIGUOUS]
    gold = [truth[i.instance_id] for i in scored]
    report["ground_truth"] = {"instances": len(instances), "scored": len(scored),
                              "classes": {str(c): gold.count(c) for c in dict.fromkeys(gold)}}

    # 4. every router
    from trace_core.routing.router import routing_accuracy
    from trace_core.routing.stage import _Scorers, family_capabilities, route_set

    family_map = family_capabilities(params, ids)
    labels = [*ids, None]
    fmap = [family_map.get(i.family) for i in scored]
    report["family_map"] = routing_accuracy([c if c in ids else None for c in fmap], gold, labels)
    scorers = _Scorers(params, agent, adapters, instances, work / "routing")
    rows = []
    try:
        for scoring in args.routers:
            t = time.time()
            routed = route_set(params, scorers, adapters, instances, family_map, None, scoring)
            seconds = time.time() - t
            chosen = {r.instance_id: (r.chosen[0] if r.chosen else None) for r in routed.routes}
            acc = routing_accuracy([chosen[i.instance_id] for i in scored], gold, labels)
            rows.append({"router": scoring, "instances": acc["n"], "accuracy": round(acc["accuracy"], 4),
                         "majority_baseline": round(acc["chance_majority"], 4),
                         "distractors_to_base": routed.distractors_to_base, "seconds": round(seconds, 1)})
            report[scoring] = {"vs_ground_truth": acc, "vs_family_map": routed.accuracy, "seconds": seconds,
                               "distractors": routed.distractors}
    finally:
        scorers.close()
    if "gate" in args.routers:
        record = json.loads((work / "routing" / "gate" / "gate.json").read_text())
        report["gate_record"] = {k: record[k] for k in ("counts", "temperature", "train_accuracy", "settings", "selection")}
    report["rows"] = rows
    (work / "gate_accuracy.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report["ground_truth"]))
    print(f"family map vs ground truth: {report['family_map']['accuracy']:.2%}")
    for r in rows:
        print(r)
        print("  confusion (rows truth, cols routed):", json.dumps(report[r["router"]]["vs_ground_truth"]["confusion"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
