"""Stage `evaluation`: every method plays the same held-out target instances; the results table, the report.

Reads the trained adapters (artifacts/training/<capability_id>/adapter_record.json), the router's decisions (stage
routing: artifacts/routing/decisions.json), the equal-budget baselines (stage baselines:
artifacts/baselines/baselines.json and their adapters or prompts), the capability dictionary (names and
definitions for the report and the describe prompt) and the base agent. It trains and routes nothing itself: a
missing or stale decisions file or baselines record stops it with the stage to run. Writes into
`evaluation.out_dir`:

    trajectories/<method>/      one JSONL per group of episodes played together (resumable; a key file discards
                                episodes played under other settings)
    results.json                `EvaluationResults`: per method pass^k with CIs, per family, paired difference vs
                                base, budget; routing accuracy and confusion; transfer matrix; champions; curve
    table.md, report.html       the paper-style table; the self-contained report (plots inline); while baselines
                                are still to play, a provisional version of what has played so far
    curve.csv, confusion.csv, transfer.csv, metrics.json   DVC plots and metrics
    episodes.csv                one row per episode of each method (method, instance, family, trial, success,
                                reward): the per-instance record, DVC-cached (trajectories/ is not)
    routing.csv                 every router (label, channel, gate) against the ground truth of the base agent's
                                held-out trajectories, with TRACE routed by it beside oracle routing
                                (`evaluation.routers`; the header alone when there is nothing to score)
    ledger.json                 every episode played here, per method

Methods (params.yaml `evaluation.methods`): base, trace, single, oracle, merged_linear, merged_ties, mixture,
grpo_target, gepa, describe, and trace_label / trace_channel / trace_gate (TRACE routed by that scoring, from stage
routing's `routers`; the one that is evaluation.router.scoring reuses trace's episodes). `oracle` spends no
rollouts: per instance it takes the best of base and the single adapters (the ceiling of routing among them).
mixture, grpo_target and gepa spent TRACE's total training rollouts in stage baselines.

Routed methods play only the adapters the gate of stage training kept (`learned`): the router chooses among every
trained adapter, and a task it sends to a dropped one (or to none) plays the base agent. Those tasks take the `base`
row's own episodes rather than replaying them, so a routed method differs from base only where an adapter played.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trace_core.agents.device import free_memory, on_accelerator
from trace_core.baselines.stage import BASELINE_ORDER, TRAINED
from trace_core.config import Params
from trace_core.envs.settings import episode_limits
from trace_core.inputs import (
    StageInputError,
    TrainedAdapter,
    check_held_out,
    curve_marks,
    gate_warnings,
    held_out_instances,
    paid_prefix,
    routing_adapters,
    trace_budget,
)
from trace_core.runs import claim, read_json, run_key, write_csv_atomic, write_json_atomic
from trace_core.schemas import EvaluationResults, Instance, RouteDecision, RoutingDecisions, Trajectory
from trace_core.training.ledger import RolloutLedger

log = logging.getLogger(__name__)

RESULTS = "results.json"
ROUTING_CSV = "routing.csv"
EPISODES_CSV = "episodes.csv"
TRAINED_METHODS = TRAINED  # baselines that train an adapter of their own (in stage baselines)
ADAPTER_METHODS = ("trace", "single", "oracle", "merged_linear", "merged_ties", "describe",
                   "trace_label", "trace_channel", "trace_gate")  # need TRACE's adapters


class EvaluationError(StageInputError):
    pass


# ----------------------------------------------------------------------------------------- playing methods
def _slug(method: str) -> str:
    return method.replace(":", "-").replace("/", "-")


class Arena:
    """Plays methods on the held-out instances with one loaded base model, its adapter bank and one policy.

    A method is a list of groups (adapter weights, system prompt, instances); each group is played in one
    resumable run. Every episode played is counted in the ledger under the method's name."""

    def __init__(self, params: Params, env: Any, bank: Any, policy: Any, out: Path, base_key: dict, progress: bool,
                 tokenizer: Any = None):
        from trace_core.agents.policy import Sampling
        from trace_core.baseline import make_user

        cfg = params.evaluation
        self.env, self.bank, self.policy, self.out, self.progress = env, bank, policy, out, progress
        self.tokenizer = tokenizer
        self.trials = cfg.trials
        self.batch_size = params.policy.batch_size
        self.sampling = Sampling(
            temperature=cfg.temperature, top_p=params.policy.top_p, max_new_tokens=params.policy.max_new_tokens,
            seed=params.seed,
        )
        self.limits = episode_limits(params)
        self.make_user = make_user(params, policy)
        self.ledger = RolloutLedger(out / "ledger.json")
        self.base_key = base_key

    def close(self) -> None:
        """Drop the model, its adapters and the policy's caches (the arena cannot play afterwards)."""
        # make_user too: an LLM user simulator on the local model closes over the policy, and so over the model.
        self.bank = self.policy = self.make_user = self.tokenizer = None
        free_memory()

    def play(
        self, method: str, groups: Sequence[tuple[dict[str, float], str | None, Sequence[Instance]]],
        extra_key: dict | None = None,
    ) -> list[Trajectory]:
        """Episodes of `method`: for each group, `trials` per instance with the adapter weights active and the
        system prompt (None: the environment's own). Returned in the order the instances were given. `extra_key`:
        what else these episodes depend on (a trained baseline's run key and adapter); a change replays them."""
        from trace_core.agents.rollout import RolloutStats, run_episodes

        folder = self.out / "trajectories" / _slug(method)
        key = run_key({
            **self.base_key,
            **({"extra": extra_key} if extra_key else {}),
            "groups": [(sorted(w.items()), run_key(p) if p else None, [i.instance_id for i in insts])
                       for w, p, insts in groups],
        })
        claim(folder, key)  # played under other settings: start over; under these: resume
        played: list[Trajectory] = []
        for n, (weights, prompt, insts) in enumerate(groups):
            if not insts:
                continue
            stats = RolloutStats()
            with self.bank.use(weights):
                played += run_episodes(
                    self.env, insts, self.policy, self.make_user, self.sampling, self.limits, trials=self.trials,
                    batch_size=self.batch_size, out_path=folder / f"group{n}.jsonl", progress=self.progress,
                    system_prompt=prompt, stats=stats,
                )
            if stats.episodes:
                self.ledger.add("evaluation", method, rollouts=stats.episodes)
        order = {}
        for _, _, insts in groups:
            for inst in insts:
                order.setdefault(inst.instance_id, len(order))
        return sorted(played, key=lambda t: (order[t.instance_id], t.trial))


def oracle_choice(
    results: dict[str, list[Trajectory]], candidates: Sequence[str]
) -> tuple[list[Trajectory], dict[str, str]]:
    """Per instance, the candidate method with the most successes over its trials (then the higher mean reward,
    then the earlier candidate): the ceiling of routing once per task among them. No new episodes."""
    by_method = {m: defaultdict(list) for m in candidates}
    for m in candidates:
        for t in results[m]:
            by_method[m][t.instance_id].append(t)
    chosen: dict[str, str] = {}
    trajectories: list[Trajectory] = []
    for instance_id in dict.fromkeys(t.instance_id for t in results[candidates[0]]):
        def score(m: str, instance_id: str = instance_id) -> tuple:
            ts = by_method[m][instance_id]
            return (sum(t.success for t in ts), sum(t.reward for t in ts), -candidates.index(m))

        best = max(candidates, key=score)
        chosen[instance_id] = best
        trajectories += sorted(by_method[best][instance_id], key=lambda t: t.trial)
    return trajectories, chosen


def describe_prompt(system_prompt: str, adapters: Sequence[TrainedAdapter]) -> str:
    """The prompting baseline: the agent's system prompt plus the capability descriptions as guidance."""
    lines = [f"- {a.name}: {a.definition}".rstrip(": ") for a in adapters]
    return (
        system_prompt.rstrip()
        + "\n\nSkills that agents in this domain often lack; apply each of them when it is relevant:\n"
        + "\n".join(lines)
    )


def transfer_matrix(
    results: dict[str, list[Trajectory]], rows: Sequence[str], slice_of: Callable[[Trajectory], str | None]
) -> dict[str, Any]:
    """Success rate of each row method on each capability slice (the instances whose family maps to it)."""
    slices = sorted({s for m in rows for t in results[m] if (s := slice_of(t)) is not None})
    matrix = []
    counts = []
    for m in rows:
        row, n_row = [], []
        for s in slices:
            ts = [t for t in results[m] if slice_of(t) == s]
            row.append(sum(t.success for t in ts) / len(ts) if ts else None)
            n_row.append(len(ts))
        matrix.append(row)
        counts.append(n_row)
    return {"rows": list(rows), "slices": slices, "success": matrix, "episodes": counts}


def champions(transfer: dict[str, Any], adapters: Sequence[TrainedAdapter]) -> list[str]:
    """Adapters whose single-adapter run beat the base agent on their own capability's slice."""
    rows, slices, success = transfer["rows"], transfer["slices"], transfer["success"]
    if "base" not in rows:
        return []
    base = success[rows.index("base")]
    out = []
    for a in adapters:
        method = f"single:{a.capability_id}"
        if method in rows and a.capability_id in slices:
            j = slices.index(a.capability_id)
            mine, theirs = success[rows.index(method)][j], base[j]
            if mine is not None and theirs is not None and mine > theirs:
                out.append(a.capability_id)
    return out


# ------------------------------------------------------------------------------------------------ the stage
def _methods(params: Params, adapters: Sequence[TrainedAdapter], routable: Sequence[TrainedAdapter],
             warnings: list[str]) -> list[str]:
    """The methods to play: evaluation.methods less those that cannot run. `adapters`: the gate's (played);
    `routable`: every trained adapter. With none trained only base plays; with none learned, TRACE's routed rows
    (and oracle) are the base agent, describe and the equal-budget baselines (which spend the rollouts TRACE spent)
    play, and the rows made of adapters (single, merges) are left out."""
    wanted = list(dict.fromkeys(params.evaluation.methods))
    if "oracle" in wanted and "single" not in wanted:
        raise EvaluationError("evaluation.methods has oracle without single: the oracle picks among the single "
                              "adapters' episodes; add single (or drop oracle)")
    if "base" not in wanted:
        raise EvaluationError("evaluation.methods must include base: every method is compared with it")
    if not routable:
        dropped = [m for m in wanted if m in ADAPTER_METHODS + TRAINED_METHODS + ("gepa",)]
        if dropped:
            warnings.append(f"no adapters trained: {', '.join(dropped)} not evaluated; TRACE is the base agent")
        return [m for m in wanted if m not in dropped]
    if not adapters:
        dropped = [m for m in wanted if m == "single" or m.startswith("merged_")]
        if dropped:
            warnings.append(f"no adapter passed the gate: {', '.join(dropped)} not evaluated; the routed rows play "
                            "the base agent")
        return [m for m in wanted if m not in dropped]
    if len(adapters) < 2:
        merges = [m for m in wanted if m.startswith("merged_")]
        if merges:
            warnings.append(f"one trained adapter: {', '.join(merges)} not evaluated (merging needs two or more)")
        wanted = [m for m in wanted if m not in merges]
    return wanted


def run(params: Params, out_dir: Path | None = None, progress: bool = True, base: Any = None) -> dict:
    """Evaluate every configured method on the held-out instances; write the outputs; return flat metrics.

    Needs stage routing's decisions (always: they also hold the family -> capability map the transfer matrix is
    sliced by) and, when evaluation.methods has any of grpo_target, gepa, mixture and there are adapters, stage
    baselines' record. Order: first the methods that need only TRACE's adapters (base, single, trace, oracle,
    merges, describe); then the baselines one by one in BASELINE_ORDER (grpo_target, gepa, mixture). While
    baselines are still to play, the stage writes a provisional table of what has played (`results.json` has
    `provisional: true` and `pending`).

    `base` replaces the base agent of `params` (a `trace_core.training.stage.BaseAgent`; tests pass a tiny model)."""
    from trace_core.baselines.stage import read_record
    from trace_core.envs.targets import target_env
    from trace_core.routing.stage import read_decisions
    from trace_core.training.stage import base_agent

    cfg = params.evaluation
    if params.policy.backend != "local":
        raise EvaluationError(
            "stage evaluation activates LoRA adapters in the policy's weights, so it needs policy.backend=local "
            "(an OpenAI-compatible server would have to serve every adapter; not supported yet)"
        )
    out = Path(out_dir or cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    warnings: list[str] = []
    instances = held_out_instances(params)
    check_held_out(instances, params)
    # the router's options (every trained adapter), the adapters played (the gate's) and those it dropped
    routable, adapters, dropped = routing_adapters(params)
    for line in gate_warnings(adapters, dropped):
        log.warning(line)
        warnings.append(line)
    methods = _methods(params, adapters, routable, warnings)
    budget = trace_budget(adapters, dropped)
    marks = curve_marks(routable, cfg.curve_points)
    agent = base or base_agent(params)
    decisions = read_decisions(params, agent.fingerprint, routable, adapters, instances)
    family_map = decisions.family_capability
    late = [m for m in BASELINE_ORDER if m in methods]
    baselines = read_record(params, routable) if late else None
    env = target_env(params.env.domain, params.env.profile)
    budgets: dict[str, int] = {"base": 0, "describe": 0, "trace": budget, "oracle": budget,
                               "merged_linear": budget, "merged_ties": budget}
    budgets.update({m: budget for m in methods if m.startswith("trace_")})
    budgets.update({f"single:{a.capability_id}": a.rollouts for a in adapters})
    # What every held-out episode depends on. A trained baseline's own episodes also depend on its run key and adapter
    # (`play`'s `extra_key`), so retraining one replays only its episodes.
    base_key = {"base": agent.fingerprint, "adapters": {a.capability_id: a.sha256 for a in adapters},
                "trials": cfg.trials, "temperature": cfg.temperature,
                "env": params.env.model_dump(), "user": params.user.model_dump(),
                "max_new_tokens": params.policy.max_new_tokens, "max_context": params.policy.max_context,
                "top_p": params.policy.top_p, "seed": params.seed, "dtype": params.model.dtype}
    everyone = list(instances)
    results: dict[str, list[Trajectory]] = {}
    chosen: dict[str, str] = {}
    routing = None
    routers_report: dict[str, Any] | None = None
    trained: dict[str, dict] = {}
    gepa_result = None
    curve: list[dict] = []

    # Stage baselines' outcomes: a skipped baseline leaves the table with its warning; a trained one's adapter (and
    # its curve snapshots) joins TRACE's in the adapter bank.
    bank_adapters = {a.capability_id: a.path for a in adapters}
    for name in list(late):
        outcome = baselines.get(name)
        if outcome.status != "done":
            warnings.append(outcome.warning or f"{name} not run (stage baselines)")
            methods.remove(name)
            late.remove(name)
            continue
        budgets[name] = outcome.rollouts
        if name in TRAINED_METHODS:
            trained[name] = outcome.record
            bank_adapters[name] = Path(outcome.record["adapter"])
            for mark, folder in outcome.record.get("snapshots", {}).items():
                bank_adapters[f"{name}_at_{mark}"] = Path(folder)
        else:
            gepa_result = outcome.record

    def write(pending: Sequence[str] = ()) -> dict:
        """Every output from what has played so far (provisional while `pending` baselines are still to play)."""
        return _write_outputs(params, out, instances, adapters, results, budgets=budgets, routing=routing,
                              routers_report=routers_report, chosen=chosen, family_map=family_map, curve=curve,
                              trained=trained,
                              gepa_result=gepa_result, warnings=warnings, pending=pending)

    # A. The methods that need only TRACE's adapters, on one model and adapter bank (the baselines' adapters
    #    loaded beside them).
    arena = _open_arena(params, agent, env, bank_adapters, out, base_key, progress)
    results["base"] = arena.play("base", [({}, None, everyone)])
    if "single" in methods:
        for a in adapters:
            results[f"single:{a.capability_id}"] = arena.play(f"single:{a.capability_id}",
                                                              [({a.capability_id: 1.0}, None, everyone)])
    if "trace" in methods:
        routing = decisions.full.model_dump(mode="json")
        results["trace"] = _play_routed(arena, "trace", decisions, decisions.full.routes, instances, results)
        unplayed = sum(bool(r.weights) and not decisions.played_weights(r) for r in decisions.full.routes)
        if unplayed:
            warnings.append(f"TRACE routed {unplayed} of {len(instances)} tasks to adapters the gate dropped: they "
                            "play the base agent")
    for method in [m for m in methods if m.startswith("trace_")]:
        scoring = method.removeprefix("trace_")
        routed = decisions.routers.get(scoring)
        if routed is None:
            raise EvaluationError(f"stage routing's decisions have no routing by {scoring} for {method}: run stage "
                                  "routing again (`trace routing`, or `dvc repro routing`)")
        if scoring == cfg.router.scoring and "trace" in results:
            results[method] = results["trace"]  # the same routes as trace: its episodes
        else:
            results[method] = _play_routed(arena, method, decisions, routed.routes, instances, results)
    if "oracle" in methods:
        candidates = ["base"] + [f"single:{a.capability_id}" for a in adapters]
        results["oracle"], chosen = oracle_choice(results, candidates)
    if decisions.routers:
        routers_report = _routers_report(params, decisions, routable, instances, results)
    ids = [a.capability_id for a in adapters]
    for method, how in (("merged_linear", "linear"), ("merged_ties", "ties")):
        if method in methods:
            name = arena.bank.merged(ids, [1.0 / len(ids)] * len(ids), method=how, density=cfg.merge_density)
            results[method] = arena.play(method, [({name: 1.0}, None, everyone)])
    if "describe" in methods:
        results["describe"] = arena.play("describe", [({}, describe_prompt(env.system_prompt(), routable), everyone)])

    # TRACE's points on the rollouts-vs-score curve (routed over the adapters paid for at each mark), computed once.
    curve = _curve(arena, routable, instances, decisions, marks, results, {}, None)
    trace_points = [p for p in curve if p["method"] == "trace"]
    if late:
        write(pending=late)

    # B. The baselines one at a time, in BASELINE_ORDER; after each, its curve points and (while others follow) a
    #    provisional table.
    for n, name in enumerate(late):
        if name in TRAINED_METHODS:
            results[name] = arena.play(name, [({name: 1.0}, None, everyone)],
                                       extra_key=_baseline_key(trained[name]))
        else:  # gepa: its best prompt with the base model
            results["gepa"] = arena.play("gepa", [({}, gepa_result["best_prompt"], everyone)])
        curve = _curve(arena, routable, instances, decisions, marks, results, trained, gepa_result,
                       trace_points=trace_points)
        if late[n + 1:]:
            write(pending=late[n + 1:])
    arena.close()

    # C. Statistics, table, report.
    return write()


def _routers_report(params: Params, decisions: RoutingDecisions, adapters: Sequence[TrainedAdapter],
                    instances: Sequence[Instance], results: dict[str, list[Trajectory]]) -> dict[str, Any]:
    """Every router against the ground truth of the base agent's held-out trajectories (`evaluation.routers`)."""
    from trace_core.analysis.programmatic import ProgrammaticLabeller
    from trace_core.evaluation.routers import router_report
    from trace_core.evaluation.stats import paired_comparison
    from trace_core.routing.stage import routers
    from trace_core.routing.truth import ground_truth

    cfg = params.evaluation
    domains = sorted({t.domain for t in results["base"]})
    if len(domains) != 1:
        raise EvaluationError(f"the base row's episodes span domains {domains}; the routing ground truth needs one")
    truth = ground_truth(results["base"], instances, [a.capability_id for a in adapters],
                         ProgrammaticLabeller.for_domain(domains[0]))

    def comparison(method: str, reference: str) -> dict:
        return paired_comparison(results[method], results[reference], samples=cfg.bootstrap_samples, level=cfg.ci,
                                 seed=params.seed, names=(method, reference))

    report = router_report(decisions, truth, results, cfg.router.scoring, comparison, routers(params))
    report["truth"] = {i: truth.get(i) for i in decisions.instances}
    gate = Path(params.routing.out_dir) / "gate" / "gate.json"
    if gate.exists():  # the gate's chosen weighting and its cross-validation grid (routing.gate.select_settings)
        report["gate_selection"] = json.loads(gate.read_text()).get("selection") or None
    return report


def _baseline_key(record: dict, mark: int | None = None) -> dict:
    """What a trained baseline's held-out episodes depend on: its run key and the adapter played (the final one, or
    the snapshot at `mark`), so a retrained adapter replays them even under the same run key."""
    sha = record.get("adapter_sha256")
    if mark is not None:
        snapshot = Path(record.get("snapshots", {}).get(str(mark), "")) / "snapshot.json"
        data = read_json(snapshot) if snapshot.is_file() else None
        sha = data.get("adapter_sha256") if isinstance(data, dict) else None
    return {"run_key": record.get("run_key"), "adapter_sha256": sha}


def _open_arena(params: Params, agent: Any, env: Any, adapters: dict[str, Path], out: Path, base_key: dict,
                progress: bool) -> Arena:
    """The base model loaded once with `adapters` (name -> PEFT folder) in an adapter bank, and the arena that
    plays on it."""
    from trace_core.agents.local import LocalPolicy
    from trace_core.routing.compose import AdapterBank

    model, tokenizer = agent.load(params.model.dtype)
    model = on_accelerator(model)
    bank = AdapterBank(model, adapters) if adapters else _BaseOnly(model)
    policy = LocalPolicy.from_model(bank.model, tokenizer, batch_size=params.policy.batch_size,
                                    max_context=params.policy.max_context, name=f"evaluation:{agent.path}")
    bank.policy = policy  # switching adapters clears the policy's prefix cache
    return Arena(params, env, bank, policy, out, base_key, progress, tokenizer=tokenizer)


def _route_groups(decisions: RoutingDecisions, rows: Sequence[RouteDecision], instances: Sequence[Instance]):
    """Instances grouped by identical played adapter weights (`RoutingDecisions.played_weights`; one bank switch
    per group), in first-seen order."""
    groups: dict[tuple, list[Instance]] = {}
    weights_of: dict[tuple, dict[str, float]] = {}
    for row, inst in zip(rows, instances):
        k = tuple(sorted((c, round(w, 6)) for c, w in decisions.played_weights(row).items()))
        groups.setdefault(k, []).append(inst)
        weights_of[k] = dict(k)
    return [(weights_of[k], None, insts) for k, insts in groups.items()]


def _play_routed(arena: Arena, method: str, decisions: RoutingDecisions, rows: Sequence[RouteDecision],
                 instances: Sequence[Instance], results: dict[str, list[Trajectory]]) -> list[Trajectory]:
    """A routed method's episodes: the groups with adapters played, the instances routed to the base agent taken
    from the `base` row (the same weights, prompt and seeds; replaying them would only add the batched engine's
    run-to-run noise to the paired comparison). In the order of `instances`."""
    groups = _route_groups(decisions, rows, instances)
    to_base = {i.instance_id for w, _, insts in groups if not w for i in insts}
    played = arena.play(method, [g for g in groups if g[0]])
    reused = [t for t in results["base"] if t.instance_id in to_base]
    order = {inst.instance_id: n for n, inst in enumerate(instances)}
    return sorted([*played, *reused], key=lambda t: (order[t.instance_id], t.trial))


def _success(trajectories: Sequence[Trajectory]) -> float:
    return sum(t.success for t in trajectories) / len(trajectories) if trajectories else 0.0


def _curve(arena: Arena, adapters: Sequence[TrainedAdapter], instances: Sequence[Instance],
           decisions: RoutingDecisions, marks: Sequence[int], results: dict[str, list[Trajectory]],
           trained: dict[str, dict], gepa_result: dict | None, trace_points: list[dict] | None = None) -> list[dict]:
    """Points (method, rollouts, success rate, Wilson interval) for TRACE, GRPO on the target tasks and GEPA: the
    base agent at 0 rollouts, then each budget mark. Marks below the full budget play extra episodes: TRACE routed
    over the adapters paid for so far (stage routing's decisions for that mark), GRPO's snapshot at that mark, GEPA's
    best prompt found within it. `trace_points`: TRACE's points from an earlier call, taken as they are."""
    from trace_core.training.evaluation import wilson_interval

    def point(method: str, rollouts: int, trajectories: Sequence[Trajectory]) -> dict:
        n, k = len(trajectories), sum(t.success for t in trajectories)
        low, high = wilson_interval(k, n)
        return {"method": method, "rollouts": int(rollouts), "score": k / n if n else 0.0, "ci_low": low,
                "ci_high": high}

    shown = [m for m in ("trace", "grpo_target", "gepa") if m in results and (m != "trace" or trace_points is None)]
    points = [*(trace_points or []), *(point(m, 0, results["base"]) for m in shown)]
    full = marks[-1] if marks else None
    for mark in marks:
        if mark == full:
            for m in shown:
                budget = trained[m]["rollouts"] if m in trained else gepa_result["rollouts"] if m == "gepa" else mark
                points.append(point(m, budget, results[m]))
            continue
        if "trace" in shown:
            routed = decisions.marks.get(str(mark))
            if routed is None or routed.adapters != [a.capability_id for a in paid_prefix(adapters, mark)]:
                raise EvaluationError(f"stage routing's decisions have no routing for the curve mark {mark}: run "
                                      "stage routing again (`trace routing`, or `dvc repro routing`)")
            points.append(point("trace", routed.rollouts,
                                _play_routed(arena, f"trace@{mark}", decisions, routed.routes, instances, results)))
        if "grpo_target" in shown and str(mark) in {str(k) for k in trained["grpo_target"].get("snapshots", {})}:
            points.append(point("grpo_target", mark, arena.play(
                f"grpo_target@{mark}", [({f"grpo_target_at_{mark}": 1.0}, None, instances)],
                extra_key=_baseline_key(trained["grpo_target"], mark))))
        if "gepa" in shown:
            from trace_core.baselines.prompt_evolution import best_within

            prompt, spent = best_within(gepa_result, mark)
            points.append(point("gepa", spent, arena.play(f"gepa@{mark}", [({}, prompt, instances)])))
    return points


class _BaseOnly:
    """The adapter bank's interface when there are no adapters: only the base model ({} weights) can play."""

    def __init__(self, model: Any):
        self.model = model

    @contextlib.contextmanager
    def use(self, weights: dict[str, float]):
        if any(w for w in weights.values()):
            raise EvaluationError(f"no adapters are loaded, cannot activate {weights}")
        yield self.model


# -------------------------------------------------------------------------------------------------- outputs
LABELS = {"base": "base agent", "trace": "TRACE (routed)", "oracle": "oracle routing (ceiling)",
          "trace_label": "TRACE, label router", "trace_channel": "TRACE, channel router",
          "trace_gate": "TRACE, trained gate",
          "merged_linear": "merged adapters (linear)", "merged_ties": "merged adapters (TIES)",
          "mixture": "one LoRA on the mixture", "grpo_target": "GRPO on target tasks", "gepa": "GEPA (prompt)",
          "describe": "prompt with capability descriptions"}


def _label(method: str, adapters: Sequence[TrainedAdapter]) -> str:
    if method.startswith("single:"):
        cid = method.split(":", 1)[1]
        name = next((a.name for a in adapters if a.capability_id == cid), cid)
        return f"single adapter: {name}"
    return LABELS.get(method, method)


def _write_outputs(params, out, instances, adapters, results, *, budgets, routing, chosen, family_map, curve,
                   warnings, trained, gepa_result, pending: Sequence[str] = (), routers_report=None) -> dict:
    """results.json, table.md, report.html, the DVC plot files and metrics.json (every declared output, always).
    `pending`: the baselines still to run, which makes the outputs provisional."""
    from trace_core.envs.targets import graded_reward
    from trace_core.evaluation import report as rep
    from trace_core.evaluation.routers import markdown as routers_markdown
    from trace_core.evaluation.routers import notes as routers_notes
    from trace_core.evaluation.routers import write_csv as write_routing_csv
    from trace_core.evaluation.stats import evaluate, results_table

    cfg = params.evaluation
    provisional = bool(pending)
    if provisional:
        warnings = [*warnings, f"provisional: {', '.join(pending)} still to run (the stage goes on with them)"]
    # Rows in the paper's order whatever order the methods played in: TRACE and its parts, then the baselines.
    order = ["base", *(m for m in results if m.startswith("single:")), "trace", "trace_label", "trace_channel",
             "trace_gate", "oracle", "merged_linear",
             "merged_ties", "mixture", "grpo_target", "gepa", "describe"]
    results = {m: results[m] for m in [*order, *results] if m in results}
    graded = graded_reward(params.env.domain)
    summary = evaluate(
        results, budgets={m: budgets.get(m) for m in results}, labels={m: _label(m, adapters) for m in results},
        ks=range(1, cfg.trials + 1), samples=cfg.bootstrap_samples, level=cfg.ci, seed=params.seed, graded=graded,
    )
    family_of = {i.instance_id: i.family for i in instances}
    rows = ["base"] + [m for m in results if m != "base" and m != "oracle"]
    transfer = transfer_matrix(results, rows, lambda t: family_map.get(family_of.get(t.instance_id, "")))
    champs = champions(transfer, adapters)
    accuracy = routing["accuracy"] if routing else None

    confusion = None
    if accuracy:
        names = list(accuracy["confusion"])
        shown = ["base" if n == "none" else n for n in names]
        confusion = rep.Confusion(
            labels=shown, counts=[[accuracy["confusion"][o][p] for p in names] for o in names],
            chance=accuracy["chance_uniform"],
            chance_note=f"1 / {len(names)} labels; always guessing the most frequent oracle label would score "
                        f"{accuracy['chance_majority']:.0%}",
        )
    report_transfer = None
    if transfer["slices"]:
        report_transfer = rep.Transfer(
            rows=[r.removeprefix("single:") for r in transfer["rows"]], cols=transfer["slices"],
            values=transfer["success"], n=transfer["episodes"],
        )
    notes = []
    if accuracy:
        notes.append(f"Routing accuracy {accuracy['accuracy']:.0%} over {accuracy['n']} instances (oracle: per "
                     f"family, the capability whose lack most sets its failed baseline runs apart from other "
                     f"families'); chance {accuracy['chance_uniform']:.0%} uniform, "
                     f"{accuracy['chance_majority']:.0%} majority.")
        prevalent = routing.get("accuracy_prevalent")
        if prevalent:
            notes.append(f"Against the capability most often lacking per family instead: {prevalent['accuracy']:.0%} "
                         f"(majority {prevalent['chance_majority']:.0%}).")
    if routers_report:
        notes += routers_notes(routers_report)
    if chosen:
        counts = Counter(chosen.values())
        notes.append("Oracle routing picked: " + ", ".join(f"{m} {n}" for m, n in counts.most_common()) + ".")
    if champs:
        notes.append("Champions (single adapter above base on its own slice): " + ", ".join(champs) + ".")
    budget_rows = [rep.Budget(method=m, label=_label(m, adapters), rollouts=budgets.get(m), note=_budget_note(
        m, adapters, trained, gepa_result)) for m in results]
    data = rep.ReportData.from_evaluation(
        summary, curve=[rep.CurvePoint(**p) for p in curve], confusion=confusion, transfer=report_transfer,
        budgets=budget_rows, notes=notes, warnings=warnings,
        intro=(f"Provisional, written before {', '.join(pending)} ran. " if provisional else "")
        + f"{summary['instances']} held-out {params.env.domain} instances ({cfg.source}, "
              f"{'seed ' + str(cfg.seed) if cfg.source == 'procedural' else 'split ' + cfg.tau2_split}), "
              f"{cfg.trials} trial(s) each at temperature {cfg.temperature}; every method played the same "
              f"instances. Base model: {params.model.path}.",
    )
    rep.write_report(out / "report.html", data)
    rep.write_plot_files(out, data)
    table = results_table(summary)
    if provisional:
        table = (f"**Provisional**: the methods played so far; the stage is still running {', '.join(pending)} "
                 "(see the warnings below).\n\n" + table)
    if notes or warnings:
        table += "\n" + "\n".join(f"- {line}" for line in notes + [f"warning: {w}" for w in warnings]) + "\n"
    table += routers_markdown(routers_report or {})
    (out / "table.md").write_text(table, encoding="utf-8")
    write_routing_csv(out / ROUTING_CSV, routers_report or {})
    write_episodes_csv(out / EPISODES_CSV, results)
    (out / "trajectories").mkdir(parents=True, exist_ok=True)
    if not (out / "ledger.json").exists():
        RolloutLedger(out / "ledger.json").save()  # an empty ledger the next run's arena can load
    write_json_atomic(out / RESULTS, EvaluationResults(
        provisional=provisional, pending=list(pending),
        summary=summary, methods=list(results), budgets={m: budgets.get(m) for m in results},
        routing=routing, routers=routers_report, oracle_choice=chosen, family_capability=family_map, transfer=transfer,
        champions=champs, curve=curve, warnings=warnings,
        adapters=[{"capability_id": a.capability_id, "rollouts": a.rollouts, "adapter_sha256": a.sha256}
                  for a in adapters],
    ).model_dump(mode="json"))
    metrics: dict[str, Any] = {"instances": summary["instances"], "trials": summary["trials"],
                               "trace_budget": budgets["trace"]}
    for m, entry in summary["methods"].items():
        metrics[f"{_slug(m)}/pass_1"] = entry["pass_hat_k"]["1"]["value"]
        if entry["vs_reference"] is not None:
            metrics[f"{_slug(m)}/delta_vs_base"] = entry["vs_reference"]["difference"]
        if graded:  # ToolSandbox: the mean similarity and the count of perfect episodes
            metrics[f"{_slug(m)}/similarity"] = entry["similarity"]["value"]
            metrics[f"{_slug(m)}/perfect"] = entry["perfect"]["count"]
    if accuracy:
        metrics["routing/accuracy"] = round(accuracy["accuracy"], 4)
        metrics["routing/chance"] = round(accuracy["chance_uniform"], 4)
    for scoring, entry in (routers_report or {}).get("routers", {}).items():
        if entry["vs_ground_truth"]:
            metrics[f"routing/{scoring}/accuracy_vs_truth"] = round(entry["vs_ground_truth"]["accuracy"], 4)
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def write_episodes_csv(path: Path, results: dict[str, list[Trajectory]]) -> None:
    """One row per episode each method played (or took: oracle, routed rows' base episodes), in play order:
    method, instance_id, family, trial, success (0/1), reward. The per-instance record the results' CIs are computed
    from, small enough for the DVC cache (trajectories/ is not cached)."""
    rows = ({"method": m, "instance_id": t.instance_id, "family": t.family, "trial": t.trial,
             "success": int(bool(t.success)), "reward": float(t.reward)}
            for m, episodes in results.items() for t in episodes)
    write_csv_atomic(path, ("method", "instance_id", "family", "trial", "success", "reward"), rows)


def _budget_note(method: str, adapters, trained, gepa_result) -> str:
    if method in ("trace", "oracle", "merged_linear", "merged_ties") or method.startswith("trace_"):
        return f"{len(adapters)} adapters: " + " + ".join(str(a.rollouts) for a in adapters)
    if method in trained:
        return f"GRPO, {trained[method].get('steps', '?')} steps"
    if method == "gepa" and gepa_result:
        return f"{len(gepa_result.get('candidates', []))} candidates, stopped by {gepa_result.get('stopped_by')}"
    if method.startswith("single:"):
        return "its own synthetic environment"
    return "no training"
