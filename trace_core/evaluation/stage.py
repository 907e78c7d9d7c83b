"""Stage `evaluation`: every method plays the same held-out target instances; the results table, the report.

Reads the trained adapters (artifacts/training/<capability_id>/adapter_record.json), the capability dictionary
(names and definitions for the routing prompt; labels for the family -> capability map) and the base agent. Writes
into `evaluation.out_dir`:

    trajectories/<method>/      one JSONL per group of episodes played together (resumable; a key file discards
                                episodes played under other settings)
    baselines/<name>/           the trained or optimised baselines (mixture, grpo_target, gepa), resumable
    routes.json                 the router's probabilities and choice per instance
    routing/                    the router's probabilities per set of options and tasks (reused by a resumed run)
    results.json                per method: pass^k with CIs, per family, paired difference vs base, budget;
                                routing accuracy and confusion; transfer matrix; champions; curve
    table.md, report.html       the paper-style table; the self-contained report (plots inline); while baselines
                                are still to run, a provisional version of what has played so far
    curve.csv, confusion.csv, transfer.csv, metrics.json   DVC plots and metrics
    ledger.json                 every episode played here, per method

Methods (params.yaml `evaluation.methods`): base, trace, single, oracle, merged_linear, merged_ties, mixture,
grpo_target, gepa, describe. `oracle` spends no rollouts: per instance it takes the best of base and the single
adapters (the ceiling of routing among them). mixture, grpo_target and gepa spend TRACE's total training rollouts.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_core.agents.device import free_memory, on_accelerator
from trace_core.config import Params
from trace_core.envs.settings import episode_limits, scripted_user_factory
from trace_core.jsonl import iter_jsonl
from trace_core.runs import claim, read_json, run_key, write_json_atomic
from trace_core.schemas import Instance, Trajectory
from trace_core.training.ledger import RolloutLedger

log = logging.getLogger(__name__)

RESULTS = "results.json"
TRAINED_METHODS = ("mixture", "grpo_target")  # baselines that train an adapter of their own
# The order the baselines run in: the two the comparison rests on (GRPO on the target tasks, GEPA) before the
# mixture, so on a CPU, where each takes hours, their rows reach the provisional table first.
BASELINE_ORDER = ("grpo_target", "gepa", "mixture")
ADAPTER_METHODS = ("trace", "single", "oracle", "merged_linear", "merged_ties", "describe")  # need TRACE's adapters


class EvaluationError(RuntimeError):
    pass


@dataclass(frozen=True)
class TrainedAdapter:
    """One capability's adapter from stage training, with what the router and the report show about it."""

    capability_id: str
    path: Path  # the PEFT adapter folder
    rollouts: int  # training rollouts spent (the rollout ledger of its run)
    sha256: str
    name: str
    definition: str


# ------------------------------------------------------------------------------------------------- the inputs
def held_out_instances(params: Params) -> list[Instance]:
    """The evaluation instances: procedural families at `evaluation.seed`, or an official τ² split."""
    from trace_core.baseline import target_instances

    try:
        return list(target_instances(params, "evaluation"))
    except ValueError as exc:
        raise EvaluationError(str(exc)) from None


def check_held_out(instances: Sequence[Instance], params: Params) -> None:
    """Fail when an evaluation instance was also rolled out by the baseline (and so seen by analysis)."""
    seen = Path(params.baseline.out_dir) / "instances.jsonl"
    if not seen.exists():
        return
    from trace_core.evaluation.target import task_key

    rows = [Instance.model_validate_json(line) for line in iter_jsonl(seen)]
    analysed = {i.instance_id for i in rows}
    analysed_content = {task_key(i) for i in rows}
    clash = [i.instance_id for i in instances if i.instance_id in analysed or task_key(i) in analysed_content]
    if clash:
        raise EvaluationError(
            f"{len(clash)} evaluation instances (e.g. {clash[:3]}) were rolled out by the baseline and analysed; "
            "choose an evaluation.seed (procedural) or evaluation.tau2_split (tau2) the baseline did not use"
        )


def trained_adapters(params: Params) -> list[TrainedAdapter]:
    """The adapters stage training finished (intact files), in `synthesis.capabilities` order."""
    from trace_core.training.stage import RECORD, capabilities
    from trace_core.training.trainer import ADAPTER_FILE, sha256_file

    described = _capability_texts(params)
    out: list[TrainedAdapter] = []
    for cid in capabilities(params, params.synthesis.out_dir):
        folder = Path(params.training.out_dir) / cid
        record_path = folder / RECORD
        if not record_path.exists():
            continue
        record = json.loads(record_path.read_text())
        if record.get("status") != "trained":
            continue
        adapter = folder / record.get("adapter_dir", "adapter")
        if not (adapter / ADAPTER_FILE).exists() or sha256_file(adapter / ADAPTER_FILE) != record.get("adapter_sha256"):
            raise EvaluationError(
                f"{adapter} does not match its record (missing or changed file); re-run `dvc repro training@{cid}`"
            )
        name, definition = described.get(cid, (cid.replace("_", " "), ""))
        out.append(TrainedAdapter(cid, adapter, int(record["rollouts"]), record["adapter_sha256"], name, definition))
    return out


def _capability_texts(params: Params) -> dict[str, tuple[str, str]]:
    path = Path(params.analysis.out_dir) / "capabilities.json"
    if not path.exists():
        return {}
    from trace_core.schemas import CapabilityDictionary

    dictionary = CapabilityDictionary.model_validate_json(path.read_text())
    return {c.capability_id: (c.name, c.definition) for c in dictionary.capabilities}


FAMILY_RULES = ("specific", "prevalent")


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


# ----------------------------------------------------------------------------------------- playing methods
def _slug(method: str) -> str:
    return method.replace(":", "-").replace("/", "-")


class Arena:
    """Plays methods on the held-out instances with one loaded base model, its adapter bank and one policy.

    A method is a list of groups (adapter weights, system prompt, instances); each group is played in one
    resumable run. Every episode played is counted in the ledger under the method's name."""

    def __init__(self, params: Params, env: Any, bank: Any, policy: Any, out: Path, base_key: dict, progress: bool,
                 tokenizer: Any = None):
        from trace_core.agents.backends import Sampling
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


def curve_marks(adapters: Sequence[TrainedAdapter], points: int) -> list[int]:
    """Rollout budgets on the curve: `points` marks up to TRACE's total, each at the cumulative training cost of a
    prefix of the adapters (so TRACE has a model at every mark: the routed prefix)."""
    cumulative = []
    total = 0
    for a in adapters:
        total += a.rollouts
        cumulative.append(total)
    if not cumulative or points < 1:
        return []
    if points >= len(cumulative):
        return cumulative
    # Evenly spaced prefixes, always ending with the full set.
    picks = sorted({round((j + 1) * len(cumulative) / points) - 1 for j in range(points)})
    return [cumulative[i] for i in picks]


# ------------------------------------------------------------------------------------------------ the stage
def _methods(params: Params, adapters: Sequence[TrainedAdapter], warnings: list[str]) -> list[str]:
    wanted = list(dict.fromkeys(params.evaluation.methods))
    if "oracle" in wanted and "single" not in wanted:
        raise EvaluationError("evaluation.methods has oracle without single: the oracle picks among the single "
                              "adapters' episodes; add single (or drop oracle)")
    if "base" not in wanted:
        raise EvaluationError("evaluation.methods must include base: every method is compared with it")
    if not adapters:
        dropped = [m for m in wanted if m in ADAPTER_METHODS + TRAINED_METHODS + ("gepa",)]
        if dropped:
            warnings.append(f"no trained adapters: {', '.join(dropped)} not evaluated (their budget would be 0)")
        wanted = [m for m in wanted if m not in dropped]
    elif len(adapters) < 2:
        merges = [m for m in wanted if m.startswith("merged_")]
        if merges:
            warnings.append(f"one trained adapter: {', '.join(merges)} not evaluated (merging needs two or more)")
        wanted = [m for m in wanted if m not in merges]
    return wanted


def run(params: Params, out_dir: Path | None = None, progress: bool = True, base: Any = None) -> dict:
    """Evaluate every configured method on the held-out instances; write the outputs; return flat metrics.

    Order: first the methods that need only TRACE's adapters (base, single, trace, oracle, merges, describe); then
    the baselines one by one in BASELINE_ORDER (grpo_target, gepa, mixture), each trained or evolved and played.
    While baselines are still to run, the stage writes a provisional table of what has played (`results.json` has
    `provisional: true` and `pending`): on a CPU the baselines take about a day, and TRACE's comparison with the
    base agent, then with GRPO and GEPA, should not wait for all of them.

    `base` replaces the base agent of `params` (a `trace_core.training.stage.BaseAgent`; tests pass a tiny model)."""
    from trace_core.envs.targets import target_env
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
    adapters = trained_adapters(params)
    methods = _methods(params, adapters, warnings)
    budget = sum(a.rollouts for a in adapters)
    marks = curve_marks(adapters, cfg.curve_points)
    family_map = family_capabilities(params, [a.capability_id for a in adapters])
    prevalent_map = family_capabilities(params, [a.capability_id for a in adapters], rule="prevalent")
    agent = base or base_agent(params)
    env = target_env(params.env.domain, params.env.profile)
    budgets: dict[str, int] = {"base": 0, "describe": 0, "trace": budget, "oracle": budget,
                               "merged_linear": budget, "merged_ties": budget}
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
    late = [m for m in BASELINE_ORDER if m in methods]
    trained: dict[str, dict] = {}
    gepa_result = None
    curve: list[dict] = []

    def write(pending: Sequence[str] = ()) -> dict:
        """Every output from what has played so far (provisional while `pending` baselines are still to run)."""
        return _write_outputs(params, out, instances, adapters, results, budgets=budgets, routing=routing,
                              chosen=chosen, family_map=family_map, curve=curve, trained=trained,
                              gepa_result=gepa_result, warnings=warnings, pending=pending)

    # A. The methods that need only TRACE's adapters, on one model and adapter bank.
    arena = _open_arena(params, agent, env, {a.capability_id: a.path for a in adapters}, out, base_key, progress)
    results["base"] = arena.play("base", [({}, None, everyone)])
    if "single" in methods:
        for a in adapters:
            results[f"single:{a.capability_id}"] = arena.play(f"single:{a.capability_id}",
                                                              [({a.capability_id: 1.0}, None, everyone)])
    if "trace" in methods:
        routing = _route(params, arena, adapters, instances, family_map, prevalent_map)
        write_json_atomic(out / "routes.json", routing)
        results["trace"] = arena.play("trace", _route_groups(routing["routes"], instances))
    if "oracle" in methods:
        candidates = ["base"] + [f"single:{a.capability_id}" for a in adapters]
        results["oracle"], chosen = oracle_choice(results, candidates)
    ids = [a.capability_id for a in adapters]
    for method, how in (("merged_linear", "linear"), ("merged_ties", "ties")):
        if method in methods:
            name = arena.bank.merged(ids, [1.0 / len(ids)] * len(ids), method=how, density=cfg.merge_density)
            results[method] = arena.play(method, [({name: 1.0}, None, everyone)])
    if "describe" in methods:
        results["describe"] = arena.play("describe", [({}, describe_prompt(env.system_prompt(), adapters), everyone)])

    # TRACE's points on the rollouts-vs-score curve (routed over the adapters paid for at each mark), computed once.
    curve = _curve(params, arena, adapters, instances, family_map, marks, results, {}, None)
    trace_points = [p for p in curve if p["method"] == "trace"]
    if late:
        write(pending=late)

    # B. The baselines one at a time, in BASELINE_ORDER, each within TRACE's budget; after each, its held-out
    #    episodes, its curve points and (while others follow) a provisional table. A baseline that trains does so on
    #    a fresh copy of the base weights with the shared model dropped, so one copy is in memory at a time (a 30B
    #    model on one GPU has room for one); the arena then reopens with its adapter beside TRACE's.
    bank_adapters = {a.capability_id: a.path for a in adapters}
    for n, name in enumerate(late):
        if name in TRAINED_METHODS:
            arena.close()
            record = _train_baseline(name, params, agent, out / "baselines" / name, budget, marks, instances,
                                     warnings, progress)
            free_memory()
            if record is not None:
                trained[name] = record
                budgets[name] = record["rollouts"]
                bank_adapters[name] = Path(record["adapter"])
                for mark, folder in record.get("snapshots", {}).items():
                    bank_adapters[f"{name}_at_{mark}"] = Path(folder)
            arena = _open_arena(params, agent, env, bank_adapters, out, base_key, progress)
            if record is None:
                methods.remove(name)
            else:
                results[name] = arena.play(name, [({name: 1.0}, None, everyone)], extra_key=_baseline_key(record))
        else:  # gepa: prompt evolution with the base model on the open arena
            gepa_result = _evolve_prompt(params, arena, agent, out / "baselines" / "gepa", budget, instances,
                                         warnings, progress)
            if gepa_result is None:
                methods.remove("gepa")
            else:
                budgets["gepa"] = gepa_result["rollouts"]
                results["gepa"] = arena.play("gepa", [({}, gepa_result["best_prompt"], everyone)])
        curve = _curve(params, arena, adapters, instances, family_map, marks, results, trained, gepa_result,
                       trace_points=trace_points)
        if late[n + 1:]:
            write(pending=late[n + 1:])
    arena.close()

    # C. Statistics, table, report.
    return write()


def _baseline_key(record: dict, mark: int | None = None) -> dict:
    """What a trained baseline's held-out episodes depend on: its run key and the adapter played (the final one, or
    the snapshot at `mark`), so a retrained adapter replays them even under the same run key."""
    sha = record.get("adapter_sha256")
    if mark is not None:
        snapshot = Path(record.get("snapshots", {}).get(str(mark), "")) / "snapshot.json"
        sha = json.loads(snapshot.read_text()).get("adapter_sha256") if snapshot.is_file() else None
    return {"run_key": record.get("run_key"), "adapter_sha256": sha}


def _open_arena(params: Params, agent: Any, env: Any, adapters: dict[str, Path], out: Path, base_key: dict,
                progress: bool) -> Arena:
    """The base model loaded once with `adapters` (name -> PEFT folder) in an adapter bank, and the arena that
    plays on it."""
    from trace_core.agents.backends import LocalPolicy
    from trace_core.routing.compose import AdapterBank

    model, tokenizer = agent.load(params.model.dtype)
    model = on_accelerator(model)
    bank = AdapterBank(model, adapters) if adapters else _BaseOnly(model)
    policy = LocalPolicy.from_model(bank.model, tokenizer, batch_size=params.policy.batch_size,
                                    max_context=params.policy.max_context, name=f"evaluation:{agent.path}")
    bank.policy = policy  # switching adapters clears the policy's prefix cache
    return Arena(params, env, bank, policy, out, base_key, progress, tokenizer=tokenizer)


def router_examples(params: Params, adapters: Sequence[TrainedAdapter], k: int) -> dict[str, list[str]]:
    """Up to `k` task openings per capability for the router's channel cards: the first training instances of its
    synthetic environment — what its adapter trained on, never a held-out target task."""
    if k <= 0:
        return {}
    from trace_core.routing.router import task_text
    from trace_core.training.stage import TrainingError, build_env, load_spec

    out: dict[str, list[str]] = {}
    for a in adapters:
        folder = Path(params.synthesis.out_dir) / a.capability_id
        try:
            spec = load_spec(folder, a.capability_id)
            env = build_env(spec, folder)
        except TrainingError as exc:
            raise EvaluationError(f"router examples for {a.capability_id}: {exc} (or set "
                                  "evaluation.router.examples=0)") from None
        first, count = spec.train_seeds
        out[a.capability_id] = [task_text(env.reset(first + i)) for i in range(min(k, count))]
    return out


def _route(params, arena: Arena, adapters, instances, family_map, prevalent_map=None) -> dict[str, Any]:
    """The router's choice per instance and its accuracy against the family -> capability map of analysis
    (`family_capabilities`, specific rule; with `prevalent_map`, also against the prevalent rule's map).

    The router's probabilities are kept in `routing/<key>.json` under the arena's folder, keyed by everything they
    depend on (base weights, dtype, router settings but top_p, batch size, the options' cards, the task texts): the
    stage routes twice per start (the full set and the curve's mark), a resumed run many times on a CPU."""
    from trace_core.routing.router import Router, build_options, routing_accuracy, select, task_text

    cfg = params.evaluation.router
    k = cfg.examples if cfg.scoring == "channel" else 0
    options = build_options([{"capability_id": a.capability_id, "name": a.name, "definition": a.definition}
                             for a in adapters], router_examples(params, adapters, k), k)
    texts = [task_text(i) for i in instances]
    cache = arena.out / "routing" / (run_key({
        "base": arena.base_key["base"], "dtype": arena.base_key["dtype"], "batch_size": params.policy.batch_size,
        "router": {n: v for n, v in cfg.model_dump().items() if n != "top_p"},  # top_p only selects among them
        "options": [o.__dict__ for o in options], "texts": texts,
    }) + ".json")
    probabilities = _cached_probabilities(cache, len(texts))
    if probabilities is None:
        router = Router(arena.bank.model, arena.tokenizer, options, calibrate=cfg.calibrate,
                        max_task_chars=cfg.max_task_chars, answer_prefix=cfg.answer_prefix, scoring=cfg.scoring,
                        batch_size=params.policy.batch_size)
        probabilities = router.probabilities(texts)
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache, probabilities)
    routes = [select(p, options, cfg.top_p) for p in probabilities]
    ids = {a.capability_id for a in adapters}
    rows = []
    for inst, r in zip(instances, routes):
        oracle = family_map.get(inst.family)
        rows.append({"instance_id": inst.instance_id, "family": inst.family, "weights": r.weights,
                     "chosen": r.chosen, "probabilities": r.probabilities,
                     "oracle": oracle if oracle in ids else None})  # a capability without adapter: base is right
    labels = [a.capability_id for a in adapters] + [None]
    predicted = [r["chosen"][0] if r["chosen"] else None for r in rows]
    accuracy = routing_accuracy(predicted, [r["oracle"] for r in rows], labels) if family_map else None
    prevalent = None
    if prevalent_map:
        oracles = [prevalent_map.get(i.family) for i in instances]
        prevalent = routing_accuracy(predicted, [o if o in ids else None for o in oracles], labels)
    return {"options": [o.__dict__ for o in options], "scoring": cfg.scoring, "routes": rows, "accuracy": accuracy,
            "accuracy_prevalent": prevalent,
            "oracle_source": "analysis LACKING labels per family (specific rule)" if family_map else None}


def _cached_probabilities(path: Path, n: int) -> list[dict[str, float]] | None:
    """The router's probabilities saved at `path` for `n` tasks, or None (missing, torn or of another shape)."""

    data = read_json(path)
    if not isinstance(data, list) or len(data) != n or not all(isinstance(p, dict) for p in data):
        return None
    return [{str(label): float(v) for label, v in p.items()} for p in data]


def _route_groups(rows: Sequence[dict], instances: Sequence[Instance]):
    """Instances grouped by identical adapter weights (one bank switch per group), in first-seen order."""
    groups: dict[tuple, list[Instance]] = {}
    weights_of: dict[tuple, dict[str, float]] = {}
    for row, inst in zip(rows, instances):
        k = tuple(sorted((c, round(w, 6)) for c, w in row["weights"].items()))
        groups.setdefault(k, []).append(inst)
        weights_of[k] = dict(k)
    return [(weights_of[k], None, insts) for k, insts in groups.items()]


def _success(trajectories: Sequence[Trajectory]) -> float:
    return sum(t.success for t in trajectories) / len(trajectories) if trajectories else 0.0


def _curve(params, arena, adapters, instances, family_map, marks, results, trained, gepa_result, trace_points=None):
    """Points (method, rollouts, success rate, Wilson interval) for TRACE, GRPO on the target tasks and GEPA: the
    base agent at 0 rollouts, then each budget mark. Marks below the full budget play extra episodes: TRACE routed
    over the adapters paid for so far, GRPO's snapshot at that mark, GEPA's best prompt found within it.
    `trace_points`: TRACE's points from an earlier call, taken as they are (no second routing pass)."""
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
            paid, total = [], 0
            for a in adapters:
                if total + a.rollouts > mark:
                    break
                total += a.rollouts
                paid.append(a)
            routing = _route(params, arena, paid, instances, family_map)
            points.append(point("trace", total, arena.play(f"trace@{mark}", _route_groups(routing["routes"], instances))))
        if "grpo_target" in shown and str(mark) in {str(k) for k in trained["grpo_target"].get("snapshots", {})}:
            points.append(point("grpo_target", mark, arena.play(
                f"grpo_target@{mark}", [({f"grpo_target_at_{mark}": 1.0}, None, instances)],
                extra_key=_baseline_key(trained["grpo_target"], mark))))
        if "gepa" in shown:
            from trace_core.evaluation.prompt_evolution import best_within

            prompt, spent = best_within(gepa_result, mark)
            points.append(point("gepa", spent, arena.play(f"gepa@{mark}", [({}, prompt, instances)])))
    return points


# --------------------------------------------------------------------------------------- the trained baselines
def _train_baseline(name: str, params: Params, agent: Any, folder: Path, budget: int, marks: Sequence[int],
                    instances: Sequence[Instance], warnings: list[str], progress: bool) -> dict | None:
    """Train baseline `name` (mixture | grpo_target) within TRACE's `budget` of rollouts, on a fresh copy of the
    base weights; resumable in `folder`. None (with a warning) when the budget cannot pay for one GRPO step."""
    from trace_core.evaluation.mixture import MixtureEnv, train_on_mixture
    from trace_core.evaluation.target import TargetEnv, train_on_target
    from trace_core.training.settings import GRPOSettings
    from trace_core.training.stage import build_env, load_spec

    settings = GRPOSettings.from_params(params)
    if budget < settings.rollouts_per_step:
        warnings.append(f"{name} not trained: TRACE's budget of {budget} rollouts cannot pay for one GRPO step of "
                        f"{settings.rollouts_per_step}")
        return None
    common = {"limits": episode_limits(params), "make_user": scripted_user_factory(params),
              "max_context": params.policy.max_context, "progress": progress}
    depends_on: dict[str, Any] = {"base": agent.fingerprint, "user": params.user.model_dump()}

    def load() -> tuple[Any, Any]:
        return agent.load("float32")  # fp32 master weights, a fresh copy (PEFT wraps it in place)

    if name == "mixture":
        synthesis_dir = Path(params.synthesis.out_dir)
        envs, seeds = {}, {}
        for a in trained_adapters(params):
            spec = load_spec(synthesis_dir / a.capability_id, a.capability_id)
            envs[a.capability_id] = build_env(spec, synthesis_dir / a.capability_id)
            first, count = spec.train_seeds
            seeds[a.capability_id] = range(first, first + count)
            depends_on[a.capability_id] = spec.spec_hash
        env = MixtureEnv(envs, seeds)
        record = train_on_mixture(env, load, None, settings, folder, budget, depends_on=depends_on, **common)
    else:
        if params.env.domain != "retail":
            warnings.append("grpo_target not trained: its target training tasks are procedural, which exist for "
                            "env.domain=retail only")
            return None
        env = TargetEnv(params.tasks.families, params.tasks.difficulty, params.evaluation.target_seed,
                        domain=params.env.domain, profile=params.env.profile, held_out=instances)
        record = train_on_target(env, load, None, settings, folder, budget,
                                 snapshots=[m for m in marks if m < budget], depends_on=depends_on, **common)
    return record


def _evolve_prompt(params: Params, arena: Arena, agent: Any, folder: Path, budget: int,
                   instances: Sequence[Instance], warnings: list[str], progress: bool) -> dict | None:
    """GEPA on target training tasks with the base model (no adapter) within `budget` episodes; None (with a
    warning) when the budget cannot score the seed prompt and one minibatch."""
    import os

    from trace_core.agents.backends import OpenAIPolicy
    from trace_core.evaluation.prompt_evolution import evolve_prompt, reflection_lm_from_backend
    from trace_core.evaluation.target import TargetEnv

    g = params.evaluation.gepa
    if params.env.domain != "retail":
        warnings.append("gepa not run: its target training tasks are procedural, which exist for env.domain=retail only")
        return None
    if budget < g.val_instances + g.minibatch:
        warnings.append(f"gepa not run: TRACE's budget of {budget} rollouts cannot score the seed prompt on "
                        f"{g.val_instances} validation tasks plus one minibatch of {g.minibatch}")
        return None
    target = TargetEnv(params.tasks.families, params.tasks.difficulty, params.evaluation.target_seed,
                       domain=params.env.domain, profile=params.env.profile, held_out=instances)
    # Seeds past any the GRPO baseline would draw first, so the two baselines start from different tasks.
    first = 1 << 20
    trainset = [target.reset(first + s) for s in range(g.train_instances)]
    valset = [target.reset(first + g.train_instances + s) for s in range(g.val_instances)]
    if g.reflection == "endpoint":
        base_url = os.environ.get("TRACE_GEPA_BASE_URL") or g.base_url
        if not base_url or not g.model:
            raise EvaluationError("evaluation.gepa.reflection=endpoint needs gepa.base_url (or TRACE_GEPA_BASE_URL) "
                                  "and gepa.model; or set reflection: local")
        backend = OpenAIPolicy(base_url, g.model, api_key=os.environ.get(g.api_key_env) if g.api_key_env else None)
        reflector = {"endpoint": base_url, "model": g.model}
    else:
        backend = arena.policy
        reflector = {"local": agent.fingerprint}
    reflect = reflection_lm_from_backend(backend, temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                                         seed=params.seed)
    depends_on = {"base": agent.fingerprint, "reflection": reflector, "temperature": g.temperature,
                  "reflection_tokens": g.max_new_tokens, "user": params.user.model_dump(),
                  "max_new_tokens": params.policy.max_new_tokens, "max_context": params.policy.max_context}
    with arena.bank.use({}):  # the base model plays and (locally) reflects
        return evolve_prompt(
            target, arena.policy, reflect, trainset, valset, folder, budget, limits=arena.limits,
            make_user=arena.make_user, sampling=arena.sampling, minibatch_size=g.minibatch,
            batch_size=params.policy.batch_size, held_out=instances, seed=params.seed, depends_on=depends_on,
            progress=progress,
        )


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
                   warnings, trained, gepa_result, pending: Sequence[str] = ()) -> dict:
    """results.json, table.md, report.html, the DVC plot files and metrics.json (every declared output, always).
    `pending`: the baselines still to run, which makes the outputs provisional."""
    from trace_core.evaluation import report as rep
    from trace_core.evaluation.stats import evaluate, results_table

    cfg = params.evaluation
    provisional = bool(pending)
    if provisional:
        warnings = [*warnings, f"provisional: {', '.join(pending)} still to run (the stage goes on with them)"]
    # Rows in the paper's order whatever order the methods played in: TRACE and its parts, then the baselines.
    order = ["base", *(m for m in results if m.startswith("single:")), "trace", "oracle", "merged_linear",
             "merged_ties", "mixture", "grpo_target", "gepa", "describe"]
    results = {m: results[m] for m in [*order, *results] if m in results}
    summary = evaluate(
        results, budgets={m: budgets.get(m) for m in results}, labels={m: _label(m, adapters) for m in results},
        ks=range(1, cfg.trials + 1), samples=cfg.bootstrap_samples, level=cfg.ci, seed=params.seed,
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
    (out / "table.md").write_text(table, encoding="utf-8")
    for folder in ("trajectories", "baselines"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    if not (out / "ledger.json").exists():
        RolloutLedger(out / "ledger.json").save()  # an empty ledger the next run's arena can load
    write_json_atomic(out / RESULTS, {
        "provisional": provisional,  # true: written while baselines are still to run; the final write replaces it
        "pending": list(pending),  # those baselines
        "summary": summary, "methods": list(results), "budgets": {m: budgets.get(m) for m in results},
        "routing": routing, "oracle_choice": chosen, "family_capability": family_map, "transfer": transfer,
        "champions": champs, "curve": curve, "warnings": warnings,
        "adapters": [{"capability_id": a.capability_id, "rollouts": a.rollouts, "adapter_sha256": a.sha256}
                     for a in adapters],
    })
    metrics: dict[str, Any] = {"instances": summary["instances"], "trials": summary["trials"],
                               "trace_budget": sum(a.rollouts for a in adapters)}
    for m, entry in summary["methods"].items():
        metrics[f"{_slug(m)}/pass_1"] = entry["pass_hat_k"]["1"]["value"]
        if entry["vs_reference"] is not None:
            metrics[f"{_slug(m)}/delta_vs_base"] = entry["vs_reference"]["difference"]
    if accuracy:
        metrics["routing/accuracy"] = round(accuracy["accuracy"], 4)
        metrics["routing/chance"] = round(accuracy["chance_uniform"], 4)
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def _budget_note(method: str, adapters, trained, gepa_result) -> str:
    if method in ("trace", "oracle", "merged_linear", "merged_ties"):
        return f"{len(adapters)} adapters: " + " + ".join(str(a.rollouts) for a in adapters)
    if method in trained:
        return f"GRPO, {trained[method].get('steps', '?')} steps"
    if method == "gepa" and gepa_result:
        return f"{len(gepa_result.get('candidates', []))} candidates, stopped by {gepa_result.get('stopped_by')}"
    if method.startswith("single:"):
        return "its own synthetic environment"
    return "no training"
