"""Stage `analysis`: label the baseline trajectories, compute the statistics, select capabilities, write the
dictionary, the label table and the report.

    artifacts/analysis/capabilities.json   CapabilityDictionary (mints capability_id; byte-identical on re-run)
    artifacts/analysis/labels.parquet      one row per (labeller run, trajectory, capability)
    artifacts/analysis/report.html         self-contained report with plots and failure excerpts
    artifacts/analysis/metrics.json        a few headline numbers for DVC/MLflow
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from trace_core.analysis.base import AnalysisError, Item, LabelSet, unique_id
from trace_core.analysis.stats import CODES, Thresholds, capability_stats
from trace_core.config import Params
from trace_core.jsonl import iter_jsonl
from trace_core.schemas import Capability, CapabilityDictionary, Instance, LabelRow, Trajectory


def read_baseline(baseline_dir: str | Path) -> tuple[list[Trajectory], list[Instance]]:
    """The baseline's trajectories (trajectories.parquet) and instances (instances.jsonl), as written."""
    import pandas as pd

    base = Path(baseline_dir)
    table, inst_file = base / "trajectories.parquet", base / "instances.jsonl"
    for f in (table, inst_file):
        if not f.exists():
            raise AnalysisError(f"{f} not found: run the baseline stage first (`dvc repro baseline`)")
    instances = [Instance.model_validate_json(line) for line in iter_jsonl(inst_file) if line.strip()]
    trajectories = [Trajectory.from_row(row) for row in pd.read_parquet(table).to_dict("records")]
    return trajectories, instances


def join_items(trajectories: list[Trajectory], instances: list[Instance], source: str = "the instances") -> list[Item]:
    """Each trajectory with its instance. Raises AnalysisError when there is no trajectory, or when a trajectory's
    instance is not among `instances` (they would come from another run, and every reference-based label would
    silently turn NA, reading as "no deficit"); the message names the first missing id."""
    if not trajectories:
        raise AnalysisError("no trajectories to analyse: the baseline wrote none (re-run `dvc repro baseline`)")
    by_id = {inst.instance_id: inst for inst in instances}
    missing = [t for t in trajectories if t.instance_id not in by_id]
    if missing:
        first = missing[0]
        raise AnalysisError(
            f"{source} hold no instance {first.instance_id!r} (trajectory {first.trajectory_id!r}); "
            f"{len(missing)} of {len(trajectories)} trajectories have no instance among the {len(by_id)} given. "
            "Trajectories and instances must come from the same baseline run: re-run `dvc repro baseline`"
        )
    return [Item(t, by_id[t.instance_id]) for t in trajectories]


def trajectories_hash(items: list[Item]) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(item.trajectory.model_dump_json().encode())
    return h.hexdigest()[:16]


def vacuous_successes(items: list[Item]) -> set[str]:
    """Instance ids of the successful items whose instance the do-nothing control (no tool call, polite text until
    the scripted user stops: `trace_core.envs.oracle.do_nothing`) solves as well. Such a success shows nothing the
    agent can do: ToolSandbox passes an insufficient-information scenario without milestones to an agent that does
    nothing (26 of its 101 offline base scenarios), so every capability would look as absent in successes as in
    failures there. The control makes no tool call, so the tool profile does not matter (τ²'s compact one is used)."""
    from trace_core.envs.oracle import CONTROL_USER_TURNS, do_nothing
    from trace_core.envs.targets import scripted_user, target_env

    wins = [item for item in items if item.trajectory.success and item.instance is not None]
    if not wins:
        return set()
    domain = wins[0].trajectory.domain
    env, user = target_env(domain, "compact"), scripted_user(domain, CONTROL_USER_TURNS)
    out: set[str] = set()
    for instance in {item.instance.instance_id: item.instance for item in wins}.values():
        if do_nothing(env, instance, user()).score().reward >= 1.0 - 1e-6:
            out.add(instance.instance_id)
    return out


def _label_matrix(label_set: LabelSet, capability_id: str, items: list[Item]) -> np.ndarray:
    """Codes [runs, trajectories]; a trajectory a run did not label counts as NA."""
    pos = {item.trajectory.trajectory_id: j for j, item in enumerate(items)}
    m = np.zeros((label_set.runs, len(items)), dtype=np.int8)
    for row in label_set.rows:
        if row.capability_id == capability_id and row.trajectory_id in pos and row.run < label_set.runs:
            m[row.run, pos[row.trajectory_id]] = CODES[row.label]
    return m


def build_dictionary(
    items: list[Item],
    label_sets: list[LabelSet],
    th: Thresholds,
    max_examples: int,
    target: dict | None = None,
    labellers: list[str] | None = None,
    min_delta_ci_low: float | None = None,
    *,
    within_family: bool,
) -> tuple[CapabilityDictionary, list[LabelRow]]:
    """Statistics and selection over every labeller's capabilities; capability ids made unique across labellers.
    A capability is selected when it passes in K of N runs and, unless a programmatic detector names it, the lower
    bound of its Δ interval is above `min_delta_ci_low` (None: no such check) and, with `within_family`, its runs
    reach delta within task families too (`stats.within_strata_delta`). Returns the dictionary and the full label
    table (with the final ids)."""
    success = np.array([item.trajectory.success for item in items], dtype=bool)
    families = np.array([item.trajectory.family for item in items], dtype=object)
    n_failed = int((~success).sum())
    warnings: list[str] = []
    if n_failed == 0:
        warnings.append("no failed trajectories: nothing to contrast, no capability can be selected")
    if n_failed == len(items):
        warnings.append("no successful trajectories: ER+ is 0 for every capability, so Δ = ER− (contrast is lost)")

    taken: set[str] = set()
    capabilities: list[Capability] = []
    table: list[LabelRow] = []
    for label_set in label_sets:
        for spec in label_set.capabilities:
            cid = unique_id(spec.capability_id, taken)
            labels = _label_matrix(label_set, spec.capability_id, items)
            # The bootstrap stream is derived from the labels themselves (not from the seed, an id or a position):
            # the same labels always get the same intervals, so a verdict near a bound cannot flip with the seed.
            cap_seed = int(hashlib.sha256(labels.tobytes() + success.tobytes()).hexdigest()[:8], 16)
            # No programmatic detector vouches for an LLM or embedding candidate: it must also show its contrast within
            # task families and with an interval above min_delta_ci_low (controls stay as they are: they must fail).
            ungrounded = spec.labeller not in ("programmatic", "control")
            strata = families if ungrounded and within_family else None
            stats = capability_stats(labels, success, th, cap_seed, strata)
            selected = (
                not spec.control
                and stats.runs_passed >= stats.runs_required
                and not (ungrounded and min_delta_ci_low is not None and stats.delta_ci[0] <= min_delta_ci_low)
            )
            if spec.control and stats.runs_passed >= stats.runs_required:
                warnings.append(
                    f"control capability {cid} passed the thresholds in {stats.runs_passed}/{stats.runs} runs: the "
                    "labels or thresholds are not trustworthy (too few trajectories?)"
                )
            lacking_share = (labels == 2).mean(0) if labels.size else np.zeros(len(items))
            failed_examples = [
                items[j].task_id for j in range(len(items)) if not success[j] and lacking_share[j] >= 0.5
            ]
            examples = list(dict.fromkeys(spec.example_task_ids or failed_examples))[:max_examples]
            capabilities.append(
                Capability(
                    **{**spec.model_dump(), "capability_id": cid, "example_task_ids": examples},
                    selected=selected,
                    stats=stats,
                    example_failed_task_ids=list(dict.fromkeys(failed_examples))[:max_examples],
                )
            )
            table.extend(
                row.model_copy(update={"capability_id": cid})
                for row in label_set.rows
                if row.capability_id == spec.capability_id
            )
    capabilities.sort(key=lambda c: (not c.selected, c.control, -c.stats.delta_mean, c.capability_id))
    dictionary = CapabilityDictionary(
        target={
            **(target or {}),
            "trajectories": len(items),
            "failed": n_failed,
            "succeeded": len(items) - n_failed,
            "trajectories_hash": trajectories_hash(items),
        },
        thresholds={
            "rho": th.rho, "delta": th.delta, "k": th.k, "n": th.n, "ci": th.ci,
            "bootstrap_samples": th.bootstrap_samples,
            **({} if min_delta_ci_low is None else {"min_delta_ci_low": min_delta_ci_low}),
        },
        labellers=sorted(labellers if labellers is not None else {c.labeller for c in capabilities}),
        selected=[c.capability_id for c in capabilities if c.selected],
        capabilities=capabilities,
        warnings=warnings,
    )
    return dictionary, table


def make_labellers(params: Params, items: list[Item]) -> list:
    """The labellers params.analysis asks for (plus the controls)."""
    cfg = params.analysis
    labellers: list = []
    for name in cfg.labellers:
        if name == "programmatic":
            from trace_core.analysis.programmatic import ProgrammaticLabeller

            domains = sorted({item.trajectory.domain for item in items})
            if len(domains) != 1:
                raise AnalysisError(f"the programmatic labeller needs one domain per analysis, got {domains}")
            labellers.append(ProgrammaticLabeller.for_domain(domains[0]))
        elif name == "llm":
            from trace_core.analysis.llm import LLMAnalyst

            key = os.environ.get(cfg.llm.api_key_env) if cfg.llm.api_key_env else None
            labellers.append(LLMAnalyst(cfg.llm, n_runs=cfg.n, seed=params.seed, api_key=key))
        elif name == "embedding":
            from trace_core.analysis.embedding import EmbeddingContrast

            labellers.append(EmbeddingContrast(cfg.embedding, seed=params.seed, max_examples=cfg.max_examples))
    if cfg.controls:
        from trace_core.analysis.controls import ControlLabeller

        labellers.append(ControlLabeller(n_runs=cfg.n, seed=params.seed))
    return labellers


def write_outputs(out: Path, dictionary: CapabilityDictionary, table: list[LabelRow], items: list[Item],
                  excerpts: int) -> dict:
    import pandas as pd

    from trace_core.analysis.report import render_report

    out.mkdir(parents=True, exist_ok=True)
    (out / "capabilities.json").write_text(dictionary.model_dump_json(indent=2) + "\n")
    frame = pd.DataFrame([r.model_dump() for r in table], columns=list(LabelRow.model_fields))
    frame.to_parquet(out / "labels.parquet", index=False)
    (out / "report.html").write_text(render_report(dictionary, table, items, excerpts))
    metrics = {
        "trajectories": dictionary.target["trajectories"],
        "failed": dictionary.target["failed"],
        "candidates": sum(not c.control for c in dictionary.capabilities),
        "selected": len(dictionary.selected),
        "controls_rejected": all(not c.selected for c in dictionary.capabilities if c.control)
        and not any("control capability" in w for w in dictionary.warnings),
        "per_capability": {
            c.capability_id: {"coverage": c.stats.coverage_mean, "delta": c.stats.delta_mean, "selected": c.selected}
            for c in dictionary.capabilities
        },
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def analyse(
    params: Params, trajectories: list[Trajectory], instances: list[Instance], source: str = "the instances"
) -> tuple[CapabilityDictionary, list[LabelRow], list[Item]]:
    """The analysis in memory: label `trajectories` (joined with their `instances`, see `join_items`; `source`
    names the instances in its error), compute the statistics and select. Returns the capability dictionary, the
    label table and the analysed items."""
    cfg = params.analysis
    items = join_items(trajectories, instances, source)
    dropped: list[str] = []
    if cfg.drop_vacuous_successes:
        vacuous = vacuous_successes(items)
        dropped = [item.task_id for item in items if item.trajectory.success and item.instance.instance_id in vacuous]
        items = [item for item in items if not (item.trajectory.success and item.instance.instance_id in vacuous)]
        if not items:
            raise AnalysisError(
                f"every one of the {len(dropped)} trajectories is a success the do-nothing control matches: nothing "
                "to analyse (set analysis.drop_vacuous_successes: false, or run the baseline on harder instances)"
            )
    th = Thresholds(rho=cfg.rho, delta=cfg.delta, k=cfg.k, n=cfg.n, ci=cfg.ci, bootstrap_samples=cfg.bootstrap_samples)
    labellers = make_labellers(params, items)
    label_sets = [labeller.label(items) for labeller in labellers]
    target = {
        "domain": items[0].trajectory.domain,
        "source": items[0].trajectory.source,
        "families": sorted({item.trajectory.family for item in items}),
        **({"vacuous_successes_dropped": len(dropped)} if cfg.drop_vacuous_successes else {}),
    }
    names = [labeller.name for labeller in labellers]
    dictionary, table = build_dictionary(
        items, label_sets, th, cfg.max_examples, target, names, cfg.min_delta_ci_low, within_family=cfg.within_family
    )
    return dictionary, table, items


def run(params: Params, out_dir: Path | None = None, baseline_dir: Path | None = None) -> dict:
    """Analyse `baseline_dir` (default params.baseline.out_dir) into `out_dir` (default params.analysis.out_dir)."""
    base = Path(baseline_dir or params.baseline.out_dir)
    trajectories, instances = read_baseline(base)
    dictionary, table, items = analyse(params, trajectories, instances, str(base / "instances.jsonl"))
    return write_outputs(Path(out_dir or params.analysis.out_dir), dictionary, table, items,
                         params.analysis.report_excerpts)
