"""Stage `routing`: the router's decision per held-out instance, from the base model, without training.

Reads the trained adapters (artifacts/training/<capability_id>/adapter_record.json), the capability dictionary
(names and definitions for the routing options), the synthetic environments (channel cards' example openings and
the gate's training openings), the baseline's instances and analysis' LACKING labels (the family -> capability map
the decisions are scored against, and the gate's target-domain training labels). Writes into `routing.out_dir`:

    decisions.json      `RoutingDecisions`: per instance the label probabilities, the adapter(s) chosen and their
                        weights, for all adapters and for each curve mark's prefix of them; the same over all
                        adapters for every scoring in evaluation.router.compare (`routers`); the router settings.
                        "All adapters" are every trained one, learned or not (`inputs.routable_adapters`):
                        `learned` lists those evaluation plays; a route to another one plays the base agent
    gate/gate.json      the trained gate (`GateRecord`) when any scoring is gate; gate-<n>.json for a curve mark's
                        prefix of n adapters
    probabilities/      the base model's probabilities per scoring, set of options and tasks (reused by a resumed
                        run; the gate is retrained each run: it takes seconds)
    metrics.json        routing accuracy and chance levels (DVC metrics)

Stage evaluation plays `trace` (and TRACE's curve points) from decisions.json; it refuses a file whose run key does
not match its own adapters and instances.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trace_core.config import Params
from trace_core.inputs import (
    StageInputError,
    TrainedAdapter,
    check_held_out,
    curve_marks,
    gate_warnings,
    held_out_instances,
    paid_prefix,
    routing_adapters,
)
from trace_core.jsonl import iter_jsonl
from trace_core.runs import read_json, read_typed, run_key, write_json_atomic
from trace_core.schemas import Instance, RouteDecision, RoutingDecisions, RoutingSet

log = logging.getLogger(__name__)

DECISIONS = "decisions.json"
PROBABILITIES = "probabilities"
FAMILY_RULES = ("specific", "prevalent")


class RoutingStageError(StageInputError):
    pass


def family_capabilities(params: Params, capability_ids: Sequence[str],
                        rule: str = "specific") -> dict[str, str | None]:
    """Oracle routing labels from stage analysis: one capability (among `capability_ids`) per task family, from the
    LACKING labels of the family's failed baseline runs; None when none of them is lacking there.

    rule="prevalent": the capability most often lacking in the family's failed runs. rule="specific" (the default):
    the one whose lacking rate there most exceeds its rate in the other families' failed runs (rate = LACKING
    labels / all labels of failed runs, as analysis' coverage), the prevalence breaking ties. The prevalent rule
    hands the globally most common deficit to nearly every family — on the embedded default all 5 families got
    tool_call_precision (4 of 5 in the smoke run), so always guessing it scored 100% — and then says nothing about
    which adapter a task needs;
    the specific rule applies analysis' contrast (failed vs successful runs) across families instead. With one
    family the other families' rate is 0, so the specific rule is the prevalent one."""
    if rule not in FAMILY_RULES:
        raise ValueError(f"rule must be one of {FAMILY_RULES}, got {rule!r}")
    labels_path = Path(params.analysis.out_dir) / "labels.parquet"
    instances_path = Path(params.baseline.out_dir) / "instances.jsonl"
    if not labels_path.exists() or not instances_path.exists():
        return {}
    import pandas as pd

    family = {}
    for line in iter_jsonl(instances_path):
        if line.strip():
            row = json.loads(line)
            family[row["instance_id"]] = row["family"]
    labels = pd.read_parquet(labels_path)
    labels = labels[(~labels["success"]) & labels["capability_id"].isin(capability_ids)
                    & labels["instance_id"].isin(family)]
    lacking: dict[str, Counter] = defaultdict(Counter)
    rows: dict[str, Counter] = defaultdict(Counter)
    for instance_id, cid, label in zip(labels["instance_id"], labels["capability_id"], labels["label"]):
        rows[family[instance_id]][cid] += 1
        lacking[family[instance_id]][cid] += label == "LACKING"

    def rate(counts: Counter, totals: Counter, cid: str) -> float:
        return counts[cid] / totals[cid] if totals[cid] else 0.0

    out: dict[str, str | None] = {f: None for f in set(family.values())}
    order = list(capability_ids)
    for fam in out:
        others_lacking = sum((lacking[f] for f in lacking if f != fam), Counter())
        others_rows = sum((rows[f] for f in rows if f != fam), Counter())
        ranked = []
        for c in order:
            if lacking[fam][c] == 0:
                continue
            contrast = rate(lacking[fam], rows[fam], c) - rate(others_lacking, others_rows, c)
            # Ties (and the prevalent rule) fall back to the count, then to the order of capability_ids.
            ranked.append(((contrast if rule == "specific" else 0.0, lacking[fam][c], -order.index(c)), c))
        if ranked:
            out[fam] = max(ranked)[1]
    return out


def _training_instances(params: Params, adapter: TrainedAdapter, k: int, fix: str) -> list[Instance]:
    """The first `k` train seeds of `adapter`'s synthetic environment — what it trained on, never a held-out target
    task; a missing or broken environment fails naming the capability and `fix`."""
    from trace_core.training.stage import TrainingError, build_env, load_spec

    folder = Path(params.synthesis.out_dir) / adapter.capability_id
    try:
        spec = load_spec(folder, adapter.capability_id)
        env = build_env(spec, folder)
    except TrainingError as exc:
        raise RoutingStageError(f"{adapter.capability_id}'s synthetic openings: {exc} ({fix})") from None
    first, count = spec.train_seeds
    return [env.reset(first + i) for i in range(min(k, count))]


def router_examples(params: Params, adapters: Sequence[TrainedAdapter], k: int) -> dict[str, list[str]]:
    """Up to `k` task openings per capability for the router's channel cards (`_training_instances`)."""
    if k <= 0:
        return {}
    from trace_core.routing.router import task_text

    return {a.capability_id: [task_text(i) for i in _training_instances(
        params, a, k, "or set evaluation.router.examples=0")] for a in adapters}


def decisions_key(params: Params, fingerprint: str, adapters: Sequence[TrainedAdapter],
                  learned: Sequence[TrainedAdapter], instances: Sequence[Instance]) -> str:
    """What the decisions depend on besides the router's inputs read from files: the base weights, the adapters
    routed among and those of them the gate kept, the held-out instances, the router settings and the curve's
    marks. Stage evaluation recomputes it."""
    return run_key({
        "base": fingerprint, "dtype": params.model.dtype, "batch_size": params.policy.batch_size,
        "adapters": {a.capability_id: a.sha256 for a in adapters}, "learned": [a.capability_id for a in learned],
        "instances": [i.instance_id for i in instances],
        "router": params.evaluation.router.model_dump(), "curve_points": params.evaluation.curve_points,
    })


def routers(params: Params) -> list[str]:
    """The scorings stage routing routes with: evaluation.router.scoring (the `trace` method, and the curve's marks),
    then those of evaluation.router.compare and of the trace_<scoring> methods (full adapter set only)."""
    cfg = params.evaluation.router
    extra = [m.removeprefix("trace_") for m in params.evaluation.methods if m.startswith("trace_")]
    return list(dict.fromkeys([cfg.scoring, *cfg.compare, *extra]))


def synthetic_examples(params: Params, adapters: Sequence[TrainedAdapter], k: int) -> list[Any]:
    """The gate's openings of each capability: its synthetic environment's first `k` train seeds
    (`_training_instances`), as `gate.Example`s labelled with the capability."""
    from trace_core.routing.gate import example_of
    from trace_core.routing.router import task_text

    fix = "or route with another evaluation.router.scoring and drop gate from evaluation.router.compare"
    return [example_of(inst, task_text(inst), a.capability_id, "synthetic") for a in adapters
            for inst in _training_instances(params, a, k, fix)]


def baseline_examples(params: Params, capability_ids: Sequence[str]) -> list[Any]:
    """The gate's target-domain openings: each baseline trajectory's opening with analysis' labels, by
    `truth.routing_label` (success -> no adapter; failed, lacking exactly one of `capability_ids` -> it; others left
    out). [] before analysis ran."""
    import pandas as pd

    from trace_core.routing.gate import example_of
    from trace_core.routing.router import task_text
    from trace_core.routing.truth import AMBIGUOUS, labels_lacking, routing_label

    labels_path = Path(params.analysis.out_dir) / "labels.parquet"
    instances_path = Path(params.baseline.out_dir) / "instances.jsonl"
    if not labels_path.exists() or not instances_path.exists():
        return []
    instances = {i.instance_id: i for i in (Instance.model_validate_json(line) for line in iter_jsonl(instances_path)
                                            if line.strip())}
    out = []
    for _, (instance_id, success, lacking) in sorted(labels_lacking(pd.read_parquet(labels_path),
                                                                    capability_ids).items()):
        label = routing_label(lacking, success, capability_ids)
        if label != AMBIGUOUS and instance_id in instances:
            inst = instances[instance_id]
            out.append(example_of(inst, task_text(inst), label, "baseline"))
    return out


class _GateScorer:
    """The gate's probabilities: a gate per set of routed capabilities, trained on first need (synthetic, baseline
    and distractor openings, checked against the held-out `instances`) and saved under `<out>/gate/`."""

    def __init__(self, params: Params, adapters: Sequence[TrainedAdapter], instances: Sequence[Instance], out: Path):
        self.params, self.adapters, self.instances, self.out = params, list(adapters), list(instances), out
        self.gates: dict[tuple[str, ...], Any] = {}
        self.files: dict[str, str] = {}
        self._vectors: dict[str, Any] = {}

    def embed(self, texts: list[str]):
        import numpy as np

        from trace_core.analysis.embedding import embed_texts
        from trace_core.routing.router import _truncate

        todo = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if todo:
            cut = self.params.evaluation.router.max_task_chars
            for t, v in zip(todo, embed_texts([_truncate(t, cut) for t in todo])):
                self._vectors[t] = v
        return np.stack([self._vectors[t] for t in texts]) if texts else np.zeros((0, 384))

    def gate(self, capability_ids: Sequence[str]):
        from trace_core.routing.gate import Gate, distractor_examples, embedding_id, fit_gate

        key = tuple(capability_ids)
        if key not in self.gates:
            params, cfg = self.params, self.params.evaluation.router.gate
            chosen = [a for a in self.adapters if a.capability_id in key]
            examples = [*synthetic_examples(params, chosen, cfg.per_capability),
                        *baseline_examples(params, key), *distractor_examples(params.seed, cfg.distractors)]
            record = fit_gate(examples, self.embed, key, cfg, params.seed, self.instances, embedding_id())
            name = "gate.json" if len(key) == len(self.adapters) else f"gate-{len(key)}.json"
            path = self.out / "gate" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, record.model_dump(mode="json"))
            self.files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
            self.gates[key] = Gate(record, self.embed)
        return self.gates[key]

    def probabilities(self, options: Sequence[Any], texts: Sequence[str], scoring: str) -> list[dict[str, float]]:
        return self.gate([o.capability_id for o in options if o.capability_id is not None]).probabilities(
            options, texts)

    def close(self) -> None:
        self._vectors.clear()


class _Scorers:
    """The probabilities of each scoring: the base model's (`_Scorer`) or the gate's (`_GateScorer`)."""

    def __init__(self, params: Params, agent: Any, adapters: Sequence[TrainedAdapter], instances: Sequence[Instance],
                 out: Path):
        self.model = _Scorer(params, agent, out)
        self.gate = _GateScorer(params, adapters, instances, out)

    def probabilities(self, options: Sequence[Any], texts: Sequence[str], scoring: str) -> list[dict[str, float]]:
        return (self.gate if scoring == "gate" else self.model).probabilities(options, texts, scoring)

    def close(self) -> None:
        self.model.close()
        self.gate.close()


class _Scorer:
    """The base model's probabilities for a set of options and tasks: from `<out>/probabilities/<key>.json` when an
    earlier (or killed) run computed them, else from the base model, loaded on first need."""

    def __init__(self, params: Params, agent: Any, out: Path):
        self.params, self.agent, self.out = params, agent, out
        self.model = self.tokenizer = None

    def probabilities(self, options: Sequence[Any], texts: Sequence[str], scoring: str) -> list[dict[str, float]]:
        from trace_core.routing.router import Router

        params, cfg = self.params, self.params.evaluation.router
        # top_p only selects among them; compare and gate do not change this scoring's probabilities.
        settings = {n: v for n, v in cfg.model_dump().items() if n not in ("top_p", "compare", "gate", "scoring")}
        cache = self.out / PROBABILITIES / (run_key({
            "base": self.agent.fingerprint, "dtype": params.model.dtype, "batch_size": params.policy.batch_size,
            "router": {**settings, "scoring": scoring}, "options": [o.__dict__ for o in options], "texts": list(texts),
        }) + ".json")
        probabilities = _cached_probabilities(cache, len(texts))
        if probabilities is None:
            if self.model is None:
                from trace_core.agents.device import on_accelerator

                model, self.tokenizer = self.agent.load(params.model.dtype)
                self.model = on_accelerator(model)
            router = Router(self.model, self.tokenizer, options, calibrate=cfg.calibrate and scoring == "label",
                            max_task_chars=cfg.max_task_chars, answer_prefix=cfg.answer_prefix, scoring=scoring,
                            batch_size=params.policy.batch_size)
            probabilities = router.probabilities(list(texts))
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(cache, probabilities)
        return probabilities

    def close(self) -> None:
        if self.model is not None:
            from trace_core.agents.device import free_memory

            self.model = self.tokenizer = None
            free_memory()


def route_set(params: Params, scorer: Any, adapters: Sequence[TrainedAdapter], instances: Sequence[Instance],
              family_map: dict[str, str | None], prevalent_map: dict[str, str | None] | None, scoring: str
              ) -> RoutingSet:
    """The choice of router `scoring` per instance among `adapters` (and no adapter), and per held-out distractor
    (`gate.EVAL_DISTRACTORS`); its accuracy against the family -> capability map of analysis
    (`family_capabilities`, specific rule; with `prevalent_map`, also against the prevalent rule's map)."""
    from trace_core.routing.gate import EVAL_DISTRACTORS
    from trace_core.routing.router import build_options, routing_accuracy, select, task_text

    cfg = params.evaluation.router
    k = cfg.examples if scoring == "channel" else 0
    options = build_options([{"capability_id": a.capability_id, "name": a.name, "definition": a.definition}
                             for a in adapters], router_examples(params, adapters, k), k)
    probabilities = scorer.probabilities(options, [task_text(i) for i in instances], scoring)
    routes = [select(p, options, cfg.top_p) for p in probabilities]
    off_topic = [select(p, options, cfg.top_p).top
                 for p in scorer.probabilities(options, list(EVAL_DISTRACTORS), scoring)]
    ids = {a.capability_id for a in adapters}
    rows = []
    for inst, r in zip(instances, routes):
        oracle = family_map.get(inst.family)
        rows.append(RouteDecision(instance_id=inst.instance_id, family=inst.family, weights=r.weights,
                                  chosen=r.chosen, probabilities=r.probabilities,
                                  oracle=oracle if oracle in ids else None))  # a capability without adapter: base
    labels = [a.capability_id for a in adapters] + [None]
    predicted = [r.chosen[0] if r.chosen else None for r in rows]
    accuracy = routing_accuracy(predicted, [r.oracle for r in rows], labels) if family_map else None
    prevalent = None
    if prevalent_map:
        oracles = [prevalent_map.get(i.family) for i in instances]
        prevalent = routing_accuracy(predicted, [o if o in ids else None for o in oracles], labels)
    return RoutingSet(
        adapters=[a.capability_id for a in adapters], rollouts=sum(a.rollouts for a in adapters),
        options=[dict(o.__dict__) for o in options], scoring=scoring, routes=rows, accuracy=accuracy,
        accuracy_prevalent=prevalent,
        oracle_source="analysis LACKING labels per family (specific rule)" if family_map else None,
        distractors=off_topic, distractors_to_base=sum(t is None for t in off_topic) / len(off_topic))


def _cached_probabilities(path: Path, n: int) -> list[dict[str, float]] | None:
    """The router's probabilities saved at `path` for `n` tasks, or None (missing, torn or of another shape)."""
    data = read_json(path)
    if not isinstance(data, list) or len(data) != n or not all(isinstance(p, dict) for p in data):
        return None
    return [{str(label): float(v) for label, v in p.items()} for p in data]


def run(params: Params, out_dir: Path | None = None, progress: bool = True, base: Any = None) -> dict:
    """Route every held-out instance over all trained adapters and over each curve mark's prefix of them; write
    decisions.json and metrics.json; return flat metrics. `base` replaces the base agent of `params` (a
    `trace_core.training.stage.BaseAgent`; tests pass a tiny model). `progress` is accepted for symmetry with the
    other stages (the router shows none)."""
    from trace_core.training.stage import base_agent

    out = Path(out_dir or params.routing.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    instances = held_out_instances(params)
    check_held_out(instances, params)
    # The router chooses among every trained adapter, learned or not (`adapters`); evaluation plays the learned
    # ones, and the base agent for a task routed to a dropped one.
    adapters, learned, dropped = routing_adapters(params)
    for line in gate_warnings(learned, dropped):
        log.warning(line)
    ids = [a.capability_id for a in adapters]
    family_map = family_capabilities(params, ids)
    agent = base or base_agent(params)
    (out / "gate").mkdir(exist_ok=True)
    (out / PROBABILITIES).mkdir(exist_ok=True)  # a declared DVC output, even when no model scoring ran
    for stale in (out / "gate").glob("*.json"):  # the gates are retrained each run: none of an earlier one stays
        stale.unlink()
    full, marks, by_scoring, gates = None, {}, {}, {}
    if adapters:
        scorers = _Scorers(params, agent, adapters, instances, out)
        main = params.evaluation.router.scoring
        prevalent = family_capabilities(params, ids, rule="prevalent")
        try:
            for scoring in routers(params):
                by_scoring[scoring] = route_set(params, scorers, adapters, instances, family_map, prevalent, scoring)
            full = by_scoring[main]
            points = curve_marks(adapters, params.evaluation.curve_points)
            for mark in points[:-1]:  # the last mark is the full set
                marks[str(mark)] = route_set(params, scorers, paid_prefix(adapters, mark), instances, family_map,
                                             None, main)
            gates = dict(sorted(scorers.gate.files.items()))
        finally:
            scorers.close()
    decisions = RoutingDecisions(
        run_key=decisions_key(params, agent.fingerprint, adapters, learned, instances),
        router=params.evaluation.router.model_dump(), adapters={a.capability_id: a.sha256 for a in adapters},
        learned=[a.capability_id for a in learned], instances=[i.instance_id for i in instances],
        family_capability=family_map, full=full, marks=marks, routers=by_scoring, gates=gates)
    write_json_atomic(out / DECISIONS, decisions.model_dump(mode="json"))
    metrics: dict[str, Any] = {"instances": len(instances), "adapters": len(adapters), "learned": len(learned),
                               "dropped": len(dropped)}
    if full is not None:
        metrics["routed_to_adapter"] = sum(bool(r.chosen) for r in full.routes)
        if full.accuracy:
            metrics["accuracy"] = round(full.accuracy["accuracy"], 4)
            metrics["chance"] = round(full.accuracy["chance_uniform"], 4)
        for scoring, routed in by_scoring.items():
            metrics[f"{scoring}/distractors_to_base"] = round(routed.distractors_to_base, 4)
            if routed.accuracy:
                metrics[f"{scoring}/accuracy_family_map"] = round(routed.accuracy["accuracy"], 4)
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def read_decisions(params: Params, fingerprint: str, adapters: Sequence[TrainedAdapter],
                   learned: Sequence[TrainedAdapter], instances: Sequence[Instance],
                   out_dir: Path | None = None) -> RoutingDecisions:
    """The decisions stage routing wrote for these adapters (routed among; `learned`: those played) and instances
    under these settings; fails naming the stage to run when they are missing, unreadable or were made from other
    inputs."""
    path = Path(out_dir or params.routing.out_dir) / DECISIONS
    fix = "run stage routing first (`trace routing`, or `dvc repro routing`)"
    decisions = read_typed(path, RoutingDecisions, "a routing decisions file", fix, RoutingStageError)
    if decisions.run_key != decisions_key(params, fingerprint, adapters, learned, instances):
        raise RoutingStageError(f"{path} was routed for other adapters, instances or router settings: {fix}")
    return decisions
