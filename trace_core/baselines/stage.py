"""Stage `baselines`: grpo_target, gepa and mixture (those in `evaluation.methods`), each within TRACE's budget of
training rollouts, one after another in BASELINE_ORDER. Writes into `baselines.out_dir`:

    grpo_target/, gepa/, mixture/   each baseline's resumable run (adapter and snapshots, or GEPA's history);
                                    always present, empty for a baseline that is not configured
    baselines.json                  `BaselinesRecord`: the budget, the curve's marks, each baseline's outcome
                                    (its adapter record or GEPA's result, or why it was skipped)
    metrics.json                    rollouts spent per baseline

Stage evaluation plays them on the held-out instances and refuses a record made for other adapters.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trace_core import runs
from trace_core.agents.device import free_memory, on_accelerator
from trace_core.config import Params
from trace_core.envs.settings import episode_limits, scripted_user_factory
from trace_core.envs.targets import scripted_user
from trace_core.inputs import (
    StageInputError,
    check_held_out,
    curve_marks,
    held_out_instances,
    routable_adapters,
    trace_budget,
)
from trace_core.runs import write_json_atomic
from trace_core.schemas import BaselineOutcome, BaselinesRecord, Instance

log = logging.getLogger(__name__)

RECORD = "baselines.json"
TRAINED = ("mixture", "grpo_target")  # baselines that train an adapter of their own
# The order the baselines run in: the two the comparison rests on (GRPO on the target tasks, GEPA) before the
# mixture, so on a CPU, where each takes hours, their results come first.
BASELINE_ORDER = ("grpo_target", "gepa", "mixture")


class BaselinesError(StageInputError):
    pass


def _train(name: str, params: Params, agent: Any, folder: Path, budget: int, marks: Sequence[int],
           instances: Sequence[Instance], warnings: list[str], progress: bool) -> dict | None:
    """Train baseline `name` (mixture | grpo_target) within TRACE's `budget` of rollouts, on a fresh copy of the
    base weights; resumable in `folder`. None (with a warning) when the budget cannot pay for one GRPO step."""
    from trace_core.baselines.mixture import MixtureEnv, train_on_mixture
    from trace_core.baselines.target import TargetEnv, train_on_target
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
        for a in routable_adapters(params):
            spec = load_spec(synthesis_dir / a.capability_id, a.capability_id)
            envs[a.capability_id] = build_env(spec, synthesis_dir / a.capability_id)
            first, count = spec.train_seeds
            seeds[a.capability_id] = range(first, first + count)
            depends_on[a.capability_id] = spec.spec_hash
        env = MixtureEnv(envs, seeds)
        return train_on_mixture(env, load, None, settings, folder, budget, depends_on=depends_on, **common)
    env = target_training_env(params, instances)
    if not isinstance(env, TargetEnv):  # the target's own scripted user (retail: the one above)
        common["make_user"] = scripted_user(params.env.domain, params.user.max_turns)
    return train_on_target(env, load, None, settings, folder, budget,
                           snapshots=[m for m in marks if m < budget], depends_on=depends_on, **common)


def target_training_env(params: Params, held_out: Sequence[Instance]) -> Any:
    """The target training tasks of grpo_target and gepa, never one of `held_out` (the evaluation instances).
    env.domain=retail: procedural instances of `tasks.families` on the stream `evaluation.target_seed`
    (`TargetEnv`). Any other target: its own training split, `baseline.tau2_split` of `baseline.source` (ToolSandbox:
    the offline scenarios of the baseline's half), shuffled with `evaluation.target_seed` (`SplitTargetEnv`)."""
    from trace_core.baselines.target import SplitTargetEnv, TargetEnv
    from trace_core.envs.targets import target_env, training_instances

    if params.env.domain == "retail":
        return TargetEnv(params.tasks.families, params.tasks.difficulty, params.evaluation.target_seed,
                         domain=params.env.domain, profile=params.env.profile, held_out=held_out)
    source, split = params.baseline.source, params.baseline.tau2_split
    try:
        pool = training_instances(params.env.domain, source, split)
        return SplitTargetEnv(target_env(params.env.domain, params.env.profile), pool, params.evaluation.target_seed,
                              held_out=held_out, split=f"{source}:{split}")
    except ValueError as exc:
        raise BaselinesError(f"the target training tasks of grpo_target and gepa: {exc}") from None


def _evolve_prompt(params: Params, agent: Any, folder: Path, budget: int, instances: Sequence[Instance],
                   warnings: list[str], progress: bool) -> dict | None:
    """GEPA on target training tasks with the base model (no adapter) within `budget` episodes; None (with a
    warning) when the budget cannot score the seed prompt and one minibatch."""
    from trace_core.agents.local import LocalPolicy
    from trace_core.agents.openai_client import OpenAIPolicy
    from trace_core.agents.policy import Sampling
    from trace_core.baseline import make_user
    from trace_core.baselines.prompt_evolution import evolve_prompt, reflection_lm_from_backend

    g = params.evaluation.gepa
    if budget < g.val_instances + g.minibatch:
        warnings.append(f"gepa not run: TRACE's budget of {budget} rollouts cannot score the seed prompt on "
                        f"{g.val_instances} validation tasks plus one minibatch of {g.minibatch}")
        return None
    if g.reflection == "endpoint":
        base_url = os.environ.get("TRACE_GEPA_BASE_URL") or g.base_url
        if not base_url or not g.model:
            raise BaselinesError("evaluation.gepa.reflection=endpoint needs gepa.base_url (or TRACE_GEPA_BASE_URL) "
                                 "and gepa.model; or set reflection: local")
    target = target_training_env(params, instances)
    # Seeds past any the GRPO baseline would draw first, so the two baselines start from different tasks.
    first = 1 << 20
    trainset = [target.reset(first + s) for s in range(g.train_instances)]
    valset = [target.reset(first + g.train_instances + s) for s in range(g.val_instances)]
    # The base model plays (and, locally, reflects) as in stage evaluation: its dtype, device, batch and sampling.
    model, tokenizer = agent.load(params.model.dtype)
    model = on_accelerator(model)
    policy = LocalPolicy.from_model(model, tokenizer, batch_size=params.policy.batch_size,
                                    max_context=params.policy.max_context, name=f"evaluation:{agent.path}")
    sampling = Sampling(temperature=params.evaluation.temperature, top_p=params.policy.top_p,
                        max_new_tokens=params.policy.max_new_tokens, seed=params.seed)
    if g.reflection == "endpoint":
        # One reflection prompt at a time (`reflection_lm_from_backend`), so one request in flight.
        backend = OpenAIPolicy(base_url, g.model, api_key=os.environ.get(g.api_key_env) if g.api_key_env else None,
                               concurrency=1, timeout_s=g.timeout_s)
        reflector = {"endpoint": base_url, "model": g.model}
    else:
        backend = policy
        reflector = {"local": agent.fingerprint}
    reflect = reflection_lm_from_backend(backend, temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                                         seed=params.seed)
    depends_on = {"base": agent.fingerprint, "reflection": reflector, "temperature": g.temperature,
                  "reflection_tokens": g.max_new_tokens, "user": params.user.model_dump(),
                  "max_new_tokens": params.policy.max_new_tokens, "max_context": params.policy.max_context}
    try:
        return evolve_prompt(
            target, policy, reflect, trainset, valset, folder, budget, limits=episode_limits(params),
            make_user=make_user(params, policy), sampling=sampling, minibatch_size=g.minibatch,
            batch_size=params.policy.batch_size, max_trajectory_chars=g.max_trajectory_chars, held_out=instances,
            seed=params.seed, depends_on=depends_on,
            progress=progress,
        )
    finally:
        del model, policy, backend, reflect
        free_memory()


def run(params: Params, out_dir: Path | None = None, progress: bool = True, base: Any = None) -> dict:
    """Train or evolve each configured baseline within TRACE's budget; write baselines.json and metrics.json;
    return flat metrics. `base` replaces the base agent of `params` (tests pass a tiny model)."""
    from trace_core.training.stage import base_agent

    out = Path(out_dir or params.baselines.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in BASELINE_ORDER:  # every declared output exists, whatever the methods
        (out / name).mkdir(exist_ok=True)
    instances = held_out_instances(params)
    check_held_out(instances, params)
    # TRACE spent the rollouts of every trained adapter, learned or not: the baselines get as many (and the curve's
    # marks are the costs of prefixes of all of them), whatever the gate of stage training kept.
    adapters = routable_adapters(params)
    budget = trace_budget(adapters, [])
    marks = curve_marks(adapters, params.evaluation.curve_points)
    wanted = [m for m in BASELINE_ORDER if m in params.evaluation.methods]
    outcomes: list[BaselineOutcome] = []
    agent = base or base_agent(params) if wanted and adapters else None
    for name in wanted:
        warnings: list[str] = []
        if not adapters:
            outcomes.append(BaselineOutcome(name=name, status="skipped",
                                            warning=f"{name} not run: stage training trained no adapter, so TRACE "
                                                    "spent no rollouts to match"))
            continue
        if name in TRAINED:
            result = _train(name, params, agent, out / name, budget, marks, instances, warnings, progress)
            free_memory()
        else:
            result = _evolve_prompt(params, agent, out / name, budget, instances, warnings, progress)
        if result is None:
            outcomes.append(BaselineOutcome(name=name, status="skipped", warning="; ".join(warnings) or None))
        else:
            outcomes.append(BaselineOutcome(name=name, status="done", rollouts=int(result["rollouts"]),
                                            record=result))
    record = BaselinesRecord(budget=budget, marks=marks, adapters={a.capability_id: a.sha256 for a in adapters},
                             baselines=outcomes)
    write_json_atomic(out / RECORD, record.model_dump(mode="json"))
    metrics: dict[str, Any] = {"trace_budget": budget}
    metrics.update({f"{o.name}/rollouts": o.rollouts for o in outcomes if o.status == "done"})
    write_json_atomic(out / "metrics.json", metrics)
    return metrics


def read_record(params: Params, adapters: Sequence[Any], out_dir: Path | None = None) -> BaselinesRecord:
    """The record stage baselines wrote for these adapters; fails naming the stage to run when it is missing,
    unreadable, made for other adapters or lacks a baseline `evaluation.methods` asks for."""
    path = Path(out_dir or params.baselines.out_dir) / RECORD
    fix = "run stage baselines first (`trace baselines`, or `dvc repro baselines`)"
    record = runs.read_typed(path, BaselinesRecord, "a baselines record", fix, BaselinesError)
    if record.adapters != {a.capability_id: a.sha256 for a in adapters}:
        raise BaselinesError(f"{path} was made for other adapters than stage training's: {fix}")
    missing = [m for m in BASELINE_ORDER if m in params.evaluation.methods and record.get(m) is None]
    if missing:
        raise BaselinesError(f"{path} has no {', '.join(missing)} (evaluation.methods asks for them): {fix}")
    return record
