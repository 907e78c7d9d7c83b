"""Stage `baseline`: roll out the base agent on held-out target instances and score it.

The instances are either procedural retail families (`baseline.seed`, disjoint from the warm-start seed) or an
official τ² split. Trajectories go to `trajectories.jsonl` as episodes finish, so a killed run resumes where it
stopped; the summary goes to `metrics.json` and a pass-rate table to `table.md`.
"""

from __future__ import annotations

import json
from pathlib import Path

from trace_core.config import Params
from trace_core.jsonl import jsonl_text


def target_instances(params: Params, section: str = "baseline"):
    """The target instances a stage scores the agent on, as params `section` (baseline | evaluation) says:
    procedural `tasks.families` at its `seed`, or the official τ² split `tau2_split`."""
    cfg = getattr(params, section)
    if cfg.source == "toolsandbox":
        from trace_core.envs.toolsandbox import split_instances

        return split_instances(cfg.tau2_split, cfg.instances_per_family, cfg.seed)
    if cfg.source == "tau2":
        from trace_core.envs.tau2_env import official_instances

        return official_instances(params.env.domain, cfg.tau2_split)
    from trace_core.envs.procedural import generate_set

    if params.env.domain != "retail":
        raise ValueError(f"procedural families exist for env.domain=retail only; use {section}.source=tau2")
    return generate_set(params.tasks.families, cfg.seed, cfg.instances_per_family, params.tasks.difficulty)


def make_user(params: Params, policy=None):
    """A factory of user simulators as params.user says."""
    from trace_core.envs.users import LLMUser, ScriptedUser

    cfg = params.user
    if params.env.domain == "toolsandbox":
        from trace_core.envs.toolsandbox import ToolSandboxUser, llm_user

        if cfg.kind == "scripted":
            return lambda: ToolSandboxUser(max_turns=cfg.max_turns)
    if cfg.kind == "scripted":
        return lambda: ScriptedUser(max_turns=cfg.max_turns)
    from trace_core.agents.factories import make_user_completer

    complete = make_user_completer(params, policy=policy)
    if params.env.domain == "toolsandbox":
        return lambda: llm_user(complete)
    return lambda: LLMUser(complete)


def run(params: Params, out_dir: Path | None = None, progress: bool = True) -> dict:
    """Write `out_dir/instances.jsonl` (what was rolled out), `out_dir/trajectories.jsonl` (resumable) and its
    flat copy `trajectories.parquet` (via `datasets`),
    `out_dir/metrics.json` and `out_dir/table.md`;
    return the metrics dict (keys include "pass^1", "mean_reward", "per_family")."""
    from trace_core.agents.factories import make_policy
    from trace_core.agents.policy import Sampling
    from trace_core.agents.rollout import RolloutStats, run_episodes, write_parquet
    from trace_core.bootstrap import agent_model_path
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.targets import target_env
    from trace_core.metrics import format_table, summarize

    cfg = params.baseline
    out = Path(out_dir or cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _reset_if_params_changed(params, out)
    model_path = None
    if params.policy.backend == "local":
        model_path = agent_model_path(params)
        params = params.model_copy(deep=True)
        params.model.path = model_path  # the base agent, not the raw model
    policy = make_policy(params)
    env = target_env(params.env.domain, params.env.profile)
    instances = target_instances(params)
    # The instances travel with their trajectories: analysis needs the reference actions to label them.
    (out / "instances.jsonl").write_text(jsonl_text(i.model_dump_json() for i in instances), encoding="utf-8")
    sampling = Sampling(
        temperature=params.policy.temperature,
        top_p=params.policy.top_p,
        max_new_tokens=params.policy.max_new_tokens,
        seed=params.seed,
    )
    stats = RolloutStats()
    trajectories = run_episodes(
        env,
        instances,
        policy,
        make_user(params, policy),
        sampling,
        EpisodeLimits(max_steps=params.env.max_steps, max_errors=params.env.max_errors),
        trials=cfg.trials,
        batch_size=params.policy.batch_size,
        out_path=out / "trajectories.jsonl",
        progress=progress,
        stats=stats,
    )
    write_parquet(trajectories, out / "trajectories.parquet")  # the flat table later stages load with `datasets`
    ks = tuple(k for k in (1, 2, 4, 8) if k <= cfg.trials)
    summary = summarize(trajectories, ks=ks)
    summary["rollout"] = {
        "episodes_run": stats.episodes,
        "episodes_resumed": stats.skipped,
        "generated_tokens": stats.generated_tokens,
        "seconds": round(stats.seconds, 1),
        "tokens_per_s": round(stats.tokens_per_s, 1),
    }
    summary["model"] = model_path or params.policy.model
    if params.env.domain == "toolsandbox":
        # ToolSandbox reports the mean evaluator similarity (mean_reward) and the count of perfect (1.0) episodes.
        summary["perfect"] = sum(1 for t in trajectories if t.success)
    (out / "metrics.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    table = format_table(summary)
    (out / "table.md").write_text(table + "\n")
    return summary


def _reset_if_params_changed(params: Params, out: Path) -> None:
    """Finished episodes are reused on a re-run only when they came from the same settings: a change in any
    section the rollouts depend on discards the old trajectory file (DVC keeps it between runs: persist)."""
    import hashlib

    sections = {k: getattr(params, k).model_dump() for k in ("model", "env", "user", "policy", "tasks", "baseline")}
    sections["seed"] = params.seed
    key = hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()
    stamp = out / "run_key.txt"
    if stamp.exists() and stamp.read_text().strip() != key:
        (out / "trajectories.jsonl").unlink(missing_ok=True)
    stamp.write_text(key + "\n")
