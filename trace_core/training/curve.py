"""Learning curves: one capability's adapter trained with GRPO on its synthetic environment and evaluated against
the base agent on held-out seeds at several rollout counts (`bench/learning_curve.py` is the command line).

Training continues across the points: the run trains to the first point's rollouts (the trainer's rollout budget,
`max_rollouts`), evaluates the adapter, continues to the next point from the same weights, and so on. Point 0 is
the base agent itself (a fresh LoRA adapter changes nothing). The base agent plays the held-out seeds once; its
outcomes are kept and paired with every point's adapter. Greedy play, the deployed inference path, as stage
training's eval.json.

Output folder (resumable: a killed run continues from the trainer's last checkpoint and ledger, and a point whose
file exists is not evaluated again; a later run may add points after the last one):

    run_key.txt                      what the curve depends on (settings, spec, base weights, held-out seeds)
    base.json                        the base agent's per-seed outcomes on the held-out seeds, under the key of
                                     what they depend on (`base_key`): another curve of the same environment, base
                                     model and play settings may start from a copy (`base_from`) instead of
                                     replaying them
    base.partial.json, points/<rollouts>.partial.json   per-seed outcomes saved chunk by chunk while playing
    points/<rollouts>.json           one point: success and mean reward of both, paired differences with 95% CIs
    curve.json, curve.csv            every point done so far (rewritten after each point)
    steps.json                       GRPO diagnostics per optimiser step (also in train/training_metrics.json)
    train/                           the trainer's folder: checkpoints/, ledger.json, adapter/, lora_start...

Rollouts are the ledger's count (every episode spent, refills and redone steps included); a point's training stops
at the first step after which its budget cannot pay for another step, so a point's `rollouts` may be a little below
its target.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trace_core import runs
from trace_core.agents.device import free_memory, on_accelerator
from trace_core.config import Params
from trace_core.envs.settings import episode_limits, scripted_user_factory
from trace_core.runs import write_json_atomic
from trace_core.training import stage
from trace_core.training.settings import GRPOSettings

BASE = "base.json"
STEPS = "steps.json"
CURVE_JSON = "curve.json"
CURVE_CSV = "curve.csv"
TRAIN = "train"
POINTS = "points"
CSV_COLUMNS = (
    "rollouts_target", "rollouts", "steps", "seeds", "base_success", "adapter_success", "success_diff",
    "success_ci_low", "success_ci_high", "base_reward", "adapter_reward", "reward_diff", "reward_ci_low",
    "reward_ci_high", "improved", "regressed", "train_seconds", "eval_seconds", "cpu_seconds",
)
STEP_COLUMNS = ("step", "rollouts", "informative_fraction", "reward_mean", "reward_std", "entropy",
                "lora_abs_change", "loss", "step_seconds")


class CurveError(RuntimeError):
    pass


def parse_points(text: str) -> list[int]:
    """"0,64,128" -> [0, 64, 128] (sorted, without repeats); every point a rollout count >= 0."""
    try:
        points = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise CurveError(f"--points {text!r}: give rollout counts separated by commas, e.g. 0,64,128,256") from None
    if not points or points[0] < 0:
        raise CurveError(f"--points {text!r}: give one or more rollout counts >= 0, e.g. 0,64,128,256")
    return points


def check_points(points: Sequence[int], settings: GRPOSettings) -> None:
    """Each point above 0 must pay for at least one GRPO step."""
    step = settings.rollouts_per_step
    small = [p for p in points if 0 < p < step]
    if small:
        raise CurveError(
            f"points {small} are below one GRPO step of {step} rollouts (training.groups_per_step x "
            "training.num_generations): raise them or make the groups smaller"
        )


def curve_settings(settings: GRPOSettings, points: Sequence[int]) -> GRPOSettings:
    """The trainer's settings for a curve: as many optimiser steps as the largest point could pay for (the rollout
    budget of each point ends training earlier)."""
    return replace(settings, max_steps=max(1, max(points) // settings.rollouts_per_step))


def curve_key(params: Params, spec: Any, settings: GRPOSettings, fingerprint: str, seeds: Sequence[int]) -> str:
    """What the curve's points depend on. The points and the step count are left out: a later run may extend the
    curve with more points, continuing the same training."""
    return runs.run_key({
        "training": {k: v for k, v in settings.to_dict().items() if k not in {"max_steps", "group_scoring"}},
        "spec_hash": spec.spec_hash,
        "base": fingerprint,
        "seeds": list(seeds),
        "max_steps": params.env.max_steps,
        "max_errors": params.env.max_errors,
        "user_max_turns": params.user.max_turns,
        "max_context": params.policy.max_context,
        "dtype": params.model.dtype,
        "max_new_tokens": params.policy.max_new_tokens,
    })


def base_key(params: Params, spec: Any, fingerprint: str, seeds: Sequence[int]) -> str:
    """What the base agent's greedy held-out outcomes depend on: the environment, the base weights, the seeds and
    every setting of the play (model, policy, environment limits, user, the sampling seed) -- not the training
    settings, so curves that differ only in how they train share one base run."""
    return runs.run_key({
        "spec_hash": spec.spec_hash,
        "base": fingerprint,
        "seeds": list(seeds),
        "play": {name: getattr(params, name).model_dump() for name in ("model", "policy", "env", "user")},
        "seed": params.training.seed,
    })


def reuse_base(out: Path, key: str, seeds: Sequence[int], base_from: Path | None,
               echo: Callable[[str], None]) -> dict[str, Any] | None:
    """The base agent's outcomes for this curve if they are already played: out/base.json (one written before the
    key was recorded is this curve's own, as the folder's run key matched: it is stamped now), else a copy of
    base_from/base.json when its key is this curve's; None when the base must play."""
    own = runs.read_json(out / BASE)
    if isinstance(own, dict) and own.get("seeds") == list(seeds) and own.get("key", key) == key:
        if "key" not in own:
            write_json_atomic(out / BASE, {**own, "key": key})
        return own
    if base_from is None:
        return None
    other = runs.read_json(base_from / BASE)
    if not isinstance(other, dict):
        raise CurveError(f"--base-from {base_from}: no readable {BASE} there; give a learning curve's --out folder "
                         "whose base agent has played")
    if other.get("key") != key:
        why = ("was written before base keys were recorded: resume that curve once (its own command) to stamp it"
               if "key" not in other else "was played on another environment, base model, seeds or play settings")
        raise CurveError(f"--base-from {base_from}: its {BASE} {why}; drop --base-from to play the base here")
    write_json_atomic(out / BASE, other)
    echo(f"base agent's held-out outcomes copied from {base_from / BASE}")
    return other


def claim_output(out: Path, key: str, restart: bool) -> None:
    """Take `out` for a curve of `key`: a new or empty folder, or one holding this key's curve (resumed). A folder
    with other contents is refused unless `restart` (which empties a folder holding another curve)."""
    stamp = out / runs.RUN_KEY
    if out.is_dir() and any(out.iterdir()):
        if not stamp.exists():
            raise CurveError(f"{out} holds files that are not a learning curve's; choose a new or empty --out folder")
        old = stamp.read_text().strip()
        if old != key and not restart:
            raise CurveError(
                f"{out} holds a curve made with other settings, spec, base model or held-out seeds (run key {old}, "
                f"now {key}); pass --restart to discard it, or choose another --out folder"
            )
    runs.claim(out, key)


def _outcomes(trajectories: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"success": bool(t.success), "reward": float(t.reward)} for t in trajectories]


def play_cached(path: Path, key: str, params: Params, env: Any, model: Any, tokenizer: Any, seeds: Sequence[int],
                name: str, progress: bool) -> list[dict[str, Any]]:
    """Per-seed outcomes of greedy episodes, played in chunks of `policy.batch_size` seeds, each chunk's outcomes
    saved to `path` (under `key`) as soon as it is done: a killed evaluation loses one chunk, not all of it."""
    saved = runs.read_json(path) or {}
    outcomes = saved.get("outcomes", {}) if saved.get("key") == key else {}
    todo = [s for s in seeds if str(s) not in outcomes]
    chunk = params.policy.batch_size
    for i in range(0, len(todo), chunk):
        part = todo[i:i + chunk]
        played = stage.play_greedy(params, env, model, tokenizer, part, name, progress)
        outcomes.update(zip(map(str, part), _outcomes(played)))
        write_json_atomic(path, {"key": key, "outcomes": outcomes})
    return [outcomes[str(s)] for s in seeds]


def point_report(target: int, seeds: Sequence[int], base: Sequence[dict], adapter: Sequence[dict], *, samples: int,
                 level: float, seed: int, rollouts: int, steps: int) -> dict[str, Any]:
    """One point of the curve from per-seed outcomes ({"success", "reward"}) of the base and of the adapter:
    success and mean reward of each, the paired success difference (stage training's eval.json fields) and the
    paired mean-reward difference, each with a paired bootstrap interval (`samples` resamples, `level`)."""
    from trace_core.training.evaluation import compare, paired_bootstrap_interval

    as_trajectory = [SimpleNamespace(**o) for o in base], [SimpleNamespace(**o) for o in adapter]
    report = compare(seeds, *as_trajectory, samples=samples, level=level, seed=seed)
    rewards = [a["reward"] - b["reward"] for b, a in zip(base, adapter)]
    low, high = paired_bootstrap_interval(rewards, samples=samples, level=level, seed=seed)
    report["reward_difference"] = {"mean": sum(rewards) / len(rewards), "ci": [low, high]}
    report.update(rollouts_target=target, rollouts=rollouts, steps=steps, learned=report["difference"]["ci"][0] > 0)
    return report


def csv_row(report: dict[str, Any]) -> dict[str, Any]:
    diff, reward = report["difference"], report["reward_difference"]
    timing = report.get("timing", {})
    return {
        "rollouts_target": report["rollouts_target"], "rollouts": report["rollouts"], "steps": report["steps"],
        "seeds": report["base"]["episodes"],
        "base_success": report["base"]["success_rate"], "adapter_success": report["adapter"]["success_rate"],
        "success_diff": diff["success_rate"], "success_ci_low": diff["ci"][0], "success_ci_high": diff["ci"][1],
        "base_reward": report["base"]["mean_reward"], "adapter_reward": report["adapter"]["mean_reward"],
        "reward_diff": reward["mean"], "reward_ci_low": reward["ci"][0], "reward_ci_high": reward["ci"][1],
        "improved": diff["improved"], "regressed": diff["regressed"],
        "train_seconds": timing.get("train_seconds", 0.0), "eval_seconds": timing.get("eval_seconds", 0.0),
        "cpu_seconds": timing.get("cpu_seconds", 0.0),
    }


def read_points(out: Path) -> dict[int, dict[str, Any]]:
    """The points already done in `out` (torn or unreadable files are left out, so they are redone)."""
    done = {}
    for path in (out / POINTS).glob("*.json"):
        data = runs.read_json(path)
        if isinstance(data, dict) and "rollouts_target" in data:
            done[int(data["rollouts_target"])] = data
    return done


def write_summary(out: Path, capability_id: str) -> list[dict[str, Any]]:
    """curve.json and curve.csv from every point file in `out`; return the CSV rows."""
    points = [read_points(out)[k] for k in sorted(read_points(out))]
    rows = [csv_row(p) for p in points]
    write_json_atomic(out / CURVE_JSON, {"capability_id": capability_id, "points": rows})
    runs.write_csv_atomic(out / CURVE_CSV, CSV_COLUMNS, rows)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The points as a text table (success and mean reward with paired 95% CIs)."""
    head = (f"{'rollouts':>9} {'steps':>5} {'seeds':>5}  {'base':>6} {'adapter':>7}  {'diff [95% CI]':>24}  "
            f"{'R base':>6} {'R adapt':>7}  {'R diff [95% CI]':>24}  {'train s':>7} {'eval s':>6} {'cpu s':>6}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['rollouts']:>9} {r['steps']:>5} {r['seeds']:>5}"
            f"  {r['base_success']:>6.3f} {r['adapter_success']:>7.3f}"
            f"  {r['success_diff']:>+7.3f} [{r['success_ci_low']:+.3f}, {r['success_ci_high']:+.3f}]"
            f"  {r['base_reward']:>6.3f} {r['adapter_reward']:>7.3f}"
            f"  {r['reward_diff']:>+7.3f} [{r['reward_ci_low']:+.3f}, {r['reward_ci_high']:+.3f}]"
            f"  {r['train_seconds']:>7.0f} {r['eval_seconds']:>6.0f} {r['cpu_seconds']:>6.0f}"
        )
    return "\n".join(lines)


def format_steps(steps: Sequence[dict[str, Any]]) -> str:
    """The GRPO diagnostics per optimiser step as a text table ('-' where a step did not log a value)."""
    lines = ["  ".join(f"{c:>20}" if c == "informative_fraction" else f"{c:>15}" for c in STEP_COLUMNS)]
    for s in steps:
        cells = []
        for c in STEP_COLUMNS:
            width = 20 if c == "informative_fraction" else 15
            v = s.get(c)
            cells.append(f"{'-':>{width}}" if v is None else f"{v:>{width}.4g}" if isinstance(v, float)
                         else f"{v:>{width}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def learning_curve(
    params: Params,
    spec_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    points: Sequence[int],
    eval_seeds: int,
    agent: Any,
    *,
    restart: bool = False,
    progress: bool = False,
    base_from: str | os.PathLike | None = None,
    echo: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train and evaluate the capability of the spec in `spec_dir` at each of `points` (training rollouts); return
    the curve's rows (also in out_dir/curve.csv). `agent` is a `stage.BaseAgent`; `eval_seeds` held-out seeds (the
    first of the spec's eval seeds) are played by the base and by each point's adapter, the base's taken from
    `base_from` (another curve's folder) when that curve's base played the same episodes."""
    from peft import PeftModel

    from trace_core.training.stage import STEP_METRICS, _keep_log_history, build_env, load_spec, step_rows
    from trace_core.training.trainer import train_adapter

    spec_dir, out = Path(spec_dir), Path(out_dir)
    spec = load_spec(spec_dir, spec_dir.name)
    if spec.status != "ready":
        raise CurveError(f"{spec_dir}/spec.json has status {spec.status} ({spec.reason}); synthesize a ready one")
    cid = spec.capability_id
    first, count = spec.eval_seeds
    if not 1 <= eval_seeds <= count:
        raise CurveError(
            f"--eval-seeds {eval_seeds}: the spec holds {count} held-out seeds; use 1..{count} or synthesize more "
            "(synthesis.eval_instances)"
        )
    seeds = list(range(first, first + eval_seeds))
    try:
        settings = curve_settings(GRPOSettings.from_params(params), points)
    except ValueError as exc:
        raise CurveError(str(exc)) from None
    check_points(points, settings)
    env = build_env(spec, spec_dir)
    claim_output(out, curve_key(params, spec, settings, agent.fingerprint, seeds), restart)
    (out / POINTS).mkdir(exist_ok=True)
    done = read_points(out)
    if done and max(done) > max(points):
        echo(f"note: {out} already holds points up to {max(done)} rollouts; those beyond the schedule are kept")

    played_key = base_key(params, spec, agent.fingerprint, seeds)
    base = reuse_base(out, played_key, seeds, Path(base_from) if base_from is not None else None, echo)
    if base is None:
        echo(f"{cid}: base agent on {len(seeds)} held-out seeds")
        started, cpu = time.perf_counter(), time.process_time()
        model, tokenizer = agent.load(params.model.dtype)
        outcomes = play_cached(out / "base.partial.json", played_key, params, env, on_accelerator(model),
                               tokenizer, seeds, f"base:{cid}", progress)
        del model
        free_memory()
        base = {"key": played_key, "seeds": seeds, "outcomes": outcomes,
                "seconds": round(time.perf_counter() - started, 3), "cpu_seconds": round(time.process_time() - cpu, 3)}
        echo(f"{cid}: base agent done in {base['seconds']:.0f} s ({base['cpu_seconds']:.0f} CPU s)")
        write_json_atomic(out / BASE, base)

    train_dir = out / TRAIN
    train_first, train_count = spec.train_seeds
    history: list[dict] = []
    intervals = {"samples": params.evaluation.bootstrap_samples, "level": params.evaluation.ci,
                 "seed": params.training.seed}
    for target in points:
        if target in done:
            continue
        wall, cpu = time.perf_counter(), time.process_time()
        if target == 0:
            report = point_report(0, seeds, base["outcomes"], base["outcomes"], **intervals, rollouts=0, steps=0)
            report["timing"] = {"train_seconds": 0.0, "eval_seconds": 0.0, "cpu_seconds": 0.0}
        else:
            echo(f"{cid}: training to {target} rollouts")
            model, tokenizer = agent.load("float32")  # fp32 master weights, a fresh copy (PEFT wraps it in place)
            record = train_adapter(
                env, model, tokenizer, settings, train_dir, cid,
                train_seeds=range(train_first, train_first + train_count),
                limits=episode_limits(params), make_user=scripted_user_factory(params),
                max_context=params.policy.max_context, hint=env.hint if settings.hint_fraction > 0 else None,
                resume=True, callbacks=[_keep_log_history(history)], progress=progress, max_rollouts=target,
            )
            del model
            free_memory()
            if history:  # the whole run's steps (a resumed trainer restores the earlier ones); none: no step ran
                rows = step_rows(history, settings.num_generations)
                write_json_atomic(train_dir / STEP_METRICS, {"capability_id": cid, "steps": rows})
                write_json_atomic(out / STEPS, {"capability_id": cid, "steps": rows})
            trained = time.perf_counter()
            echo(f"{cid}: adapter at {record['rollouts']} rollouts ({record['steps']} steps) on {len(seeds)} "
                 "held-out seeds")
            model, tokenizer = agent.load(params.model.dtype)
            adapted = PeftModel.from_pretrained(on_accelerator(model), str(train_dir / "adapter"))
            adapted.eval()
            outcomes = play_cached(out / POINTS / f"{target}.partial.json", record["adapter_sha256"], params, env,
                                   adapted, tokenizer, seeds, f"adapter:{cid}", progress)
            del model, adapted
            free_memory()
            report = point_report(target, seeds, base["outcomes"], outcomes, **intervals,
                                  rollouts=record["rollouts"], steps=record["steps"])
            report["adapter_sha256"] = record["adapter_sha256"]
            report["timing"] = {"train_seconds": round(trained - wall, 3),
                                "eval_seconds": round(time.perf_counter() - trained, 3),
                                "cpu_seconds": round(time.process_time() - cpu, 3)}
        report["capability_id"] = cid
        write_json_atomic(out / POINTS / f"{target}.json", report)
        done[target] = report
        rows = write_summary(out, cid)
        echo(format_table(rows))
    return write_summary(out, cid)
