"""Baseline "GRPO on the target tasks" (docs/method.md §5): one LoRA trained with GRPO directly on target training
instances, at the same rollout budget as TRACE.

`TargetEnv` is the target environment (τ² retail, `Tau2Environment`, scored by τ²'s own evaluator) with a
`reset(seed)` over procedural instances, so `train_adapter` can train on it like on a synthetic environment. Any
other target (ToolSandbox, τ² airline/telecom) trains on its own training split instead: `SplitTargetEnv`, the
target environment with `reset(seed)` over that split's instances minus the held-out ones. Seed s
maps to family `families[s % F]` at index `(s // F) * RETRIES + k` of the procedural stream `stream_seed`, where k is
the first attempt whose task is not one of the held-out instances: a pure function of (constructor arguments, s),
and distinct seeds never share coordinates. `assert_disjoint` checks any set of training instances against the
held-out set by id and by content (`task_key`).

`train_within_budget` is the budgeted GRPO run both trained baselines use (this one and `mixture`): `train_adapter`
with `max_rollouts` (the ledger never counts more), adapter snapshots when the ledger crosses given rollout marks,
and the training stage's resumption (a `run_key.txt` that empties the folder when what the run depends on
changed; a finished run is reused). `train_on_target` is that run on a `TargetEnv`.

Outputs under `out_dir`: `adapter/`, `adapter_record.json` (the trainer's record plus `status`, `run_key`,
`budget_rollouts`, `snapshots`, `snapshot_rollouts`, `environment`), `training_metrics.json`,
`snapshots/r<mark>/` (a PEFT adapter and `snapshot.json` per mark), and the resumption state `ledger.json`,
`checkpoints/`, `run_key.txt`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.envs.tau2_env import Tau2Environment
from trace_core.inputs import task_key
from trace_core.runs import claim, run_key, write_json_atomic
from trace_core.schemas import Instance, Message, RewardResult, ToolCall
from trace_core.training.ledger import RolloutLedger
from trace_core.training.settings import GRPOSettings

TARGET_ID = "grpo_target"  # the ledger's capability id for this baseline
# Attempts per seed before giving up on finding a task outside the held-out set. A procedural draw repeats a
# held-out task only when the random choices coincide (e.g. the same pending order and reason), which is rare.
RETRIES = 8
DEFAULT_TRAIN_SEEDS = range(4096)  # cycled by the trainer; more than any CPU budget draws
SNAPSHOTS = "snapshots"


def assert_disjoint(instances: Iterable[Instance], held_out: Iterable[Instance | str]) -> None:
    """Raise ValueError when any of `instances` is one of `held_out` (given as instances, compared by id and by
    `task_key`, or as instance ids)."""
    ids: set[str] = set()
    keys: set[str] = set()
    for h in held_out:
        if isinstance(h, str):
            ids.add(h)
        else:
            ids.add(h.instance_id)
            keys.add(task_key(h))
    clash = [i.instance_id for i in instances if i.instance_id in ids or task_key(i) in keys]
    if clash:
        raise ValueError(
            f"{len(clash)} training instances are held-out evaluation instances (e.g. {clash[:3]}); build the "
            "TargetEnv with held_out=<the evaluation instances> and a stream_seed the evaluation does not use"
        )


class TargetEnv(Tau2Environment):
    """The target domain with procedural training instances: `reset(seed)` for GRPO, the τ² tools, state and
    score of `Tau2Environment(domain, profile)` (reward = τ²'s own score, 1.0 solved / 0.0 not).

    `held_out`: the evaluation instances; no seed ever yields one of them (by id or content). `stream_seed` is the
    procedural `seed` coordinate of every training instance; it must differ from the held-out instances' own."""

    def __init__(
        self,
        families: Sequence[str],
        difficulty: int,
        stream_seed: int,
        *,
        domain: str,
        profile: str,
        held_out: Iterable[Instance] = (),
        capability_id: str = TARGET_ID,
    ):
        from trace_core.envs.procedural import FAMILIES
        from trace_core.envs.procedural._retail import check_difficulty

        super().__init__(domain, profile)  # type: ignore[arg-type]
        if domain != "retail":
            raise ValueError(f"procedural target families exist for the retail domain only, not {domain!r}")
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown:
            raise ValueError(
                f"families {list(families)!r}: need at least one, and {unknown} are unknown; choose from "
                f"{', '.join(sorted(FAMILIES))}"
            )
        check_difficulty(difficulty)
        self.families = list(families)
        self.difficulty = difficulty
        self.stream_seed = int(stream_seed)
        self.capability_id = capability_id
        held = list(held_out)
        same_stream = sorted({h.seed for h in held if h.source == "procedural" and h.seed == self.stream_seed})
        if same_stream:
            raise ValueError(
                f"stream_seed={self.stream_seed} is the procedural seed of held-out instances: training instances "
                "would be evaluation instances; pick another (params.yaml evaluation.target_seed)"
            )
        self._held_ids = frozenset(h.instance_id for h in held)
        self._held_keys = frozenset(task_key(h) for h in held)
        self._held_hash = hashlib.sha256("\n".join(sorted(self._held_keys)).encode()).hexdigest()[:16]

    def hint(self, instance: Instance) -> str:
        """The same non-revealing guidance synthetic environments give (hint injection, `training.hint_fraction`)."""
        from trace_core.envs.base import plan_hint
        from trace_core.envs.tau2_env import write_tools

        return plan_hint(instance, write_tools(self.domain))

    def coordinates(self, seed: int) -> tuple[str, int]:
        """The family and the first index tried for `seed`."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        n = len(self.families)
        return self.families[seed % n], (seed // n) * RETRIES

    def reset(self, seed: int) -> Instance:
        from trace_core.envs.procedural import generate

        family, first = self.coordinates(seed)
        for index in range(first, first + RETRIES):
            inst = generate(family, self.stream_seed, index, self.difficulty)
            if inst.instance_id not in self._held_ids and task_key(inst) not in self._held_keys:
                return inst
        raise RuntimeError(
            f"seed {seed}: {RETRIES} draws of {family} (stream {self.stream_seed}) were all held-out tasks; the "
            "held-out set covers this family at this difficulty almost entirely — lower the evaluation size or "
            "raise the difficulty"
        )

    def check_disjoint(self, seeds: Iterable[int], held_out: Iterable[Instance | str]) -> None:
        """`assert_disjoint` over the instances of `seeds`."""
        assert_disjoint((self.reset(s) for s in seeds), held_out)

    def describe(self) -> dict[str, Any]:
        """What the instances depend on (part of the run key)."""
        return {
            "kind": "target",
            "domain": self.domain,
            "profile": self.profile,
            "families": self.families,
            "difficulty": self.difficulty,
            "stream_seed": self.stream_seed,
            "held_out": self._held_hash,
        }


class SplitTargetEnv(Environment):
    """The target environment with its own training split as the training instances: `reset(seed)` for GRPO (and
    GEPA's sets) over `instances` (e.g. ToolSandbox's scenarios of the baseline's half, `baseline.tau2_split`), in
    an order shuffled once with `stream_seed`; tools, state and score are the target's own (`env`, built by
    `trace_core.envs.targets.target_env`; the reward is its evaluator's, e.g. ToolSandbox's similarity).

    Instances that are held-out evaluation instances, by id, by content (`task_key`) or by task group
    (`trace_core.envs.targets.task_group`: ToolSandbox's eight augmentations of a base scenario are one task), are
    left out; none left is an error naming the split settings."""

    def __init__(
        self,
        env: Environment,
        instances: Iterable[Instance],
        stream_seed: int,
        *,
        held_out: Iterable[Instance] = (),
        split: str = "",
        capability_id: str = TARGET_ID,
    ):
        import random

        from trace_core.envs.targets import task_group

        self.env = env
        self.domain = env.domain
        self.profile = getattr(env, "profile", "")
        self.stream_seed = int(stream_seed)
        self.split = split
        self.capability_id = capability_id
        held = list(held_out)
        held_ids = {h.instance_id for h in held}
        held_keys = {task_key(h) for h in held}
        held_groups = {task_group(h) for h in held}
        pool = list(instances)
        kept = [i for i in pool if i.instance_id not in held_ids and task_key(i) not in held_keys
                and task_group(i) not in held_groups]
        if not kept:
            raise ValueError(
                f"no {self.domain} training instances left: all {len(pool)} of the training split {split!r} are "
                "held-out evaluation instances (or variants of them); give baseline.tau2_split a split the "
                "evaluation does not use (e.g. baseline train, evaluation test)"
            )
        kept.sort(key=lambda i: i.instance_id)
        random.Random(self.stream_seed).shuffle(kept)
        self.instances = kept
        self.excluded = len(pool) - len(kept)
        self._held_hash = hashlib.sha256("\n".join(sorted(held_keys)).encode()).hexdigest()[:16]
        self._pool_hash = hashlib.sha256("\n".join(task_key(i) for i in kept).encode()).hexdigest()[:16]

    def reset(self, seed: int) -> Instance:
        """Training instance `seed` (cycling through the shuffled split)."""
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        return self.instances[seed % len(self.instances)]

    def hint(self, instance: Instance) -> str:
        """The same non-revealing guidance synthetic environments give (hint injection, `training.hint_fraction`)."""
        from trace_core.envs.base import plan_hint
        from trace_core.envs.targets import write_tools

        return plan_hint(instance, write_tools(self.domain))

    def check_disjoint(self, seeds: Iterable[int], held_out: Iterable[Instance | str]) -> None:
        """`assert_disjoint` over the instances of `seeds`."""
        assert_disjoint((self.reset(s) for s in seeds), held_out)

    def describe(self) -> dict[str, Any]:
        """What the instances depend on (part of the run key)."""
        return {
            "kind": "target_split",
            "domain": self.domain,
            "profile": self.profile,
            "split": self.split,
            "instances": len(self.instances),
            "pool": self._pool_hash,
            "stream_seed": self.stream_seed,
            "held_out": self._held_hash,
        }

    # -- the Environment API, the target's own -------------------------------------------------------------
    def tool_schemas(self, instance: Instance | None = None) -> list[dict[str, Any]]:
        return self.env.tool_schemas(instance)

    def system_prompt(self, instance: Instance | None = None) -> str:
        return self.env.system_prompt(instance)

    def start(self, instance: Instance, user: Any, limits: EpisodeLimits | None = None,
              system_prompt: str | None = None) -> Any:
        return self.env.start(instance, user, limits, system_prompt)

    def _new_state(self, instance: Instance) -> Any:
        return self.env._new_state(instance)

    def _execute(self, state: Any, call: ToolCall) -> tuple[str, bool]:
        return self.env._execute(state, call)

    def score(self, instance: Instance, messages: list[Message], termination_reason: str) -> RewardResult:
        return self.env.score(instance, messages, termination_reason)


# ------------------------------------------------------------------------------------ a budgeted GRPO run
def _snapshot_dir(out: Path, mark: int) -> Path:
    return out / SNAPSHOTS / f"r{mark:07d}"


def _save_snapshot(model: Any, out: Path, mark: int, rollouts: int, step: int) -> None:
    """Save the adapter as the snapshot of `mark` (written to a temporary folder first, so a kill never leaves a
    half-written snapshot that looks finished)."""
    from trace_core.training.trainer import ADAPTER_FILE, sha256_file

    final = _snapshot_dir(out, mark)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    write_json_atomic(
        tmp / "snapshot.json",
        {"mark": mark, "rollouts": rollouts, "step": step, "adapter_sha256": sha256_file(tmp / ADAPTER_FILE)},
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _snapshot_done(out: Path, mark: int) -> dict | None:
    path = _snapshot_dir(out, mark) / "snapshot.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _budget_callbacks(out: Path, capability_id: str, marks: Sequence[int], history: list[dict]) -> Any:
    """A Trainer callback that saves a snapshot at the first step end where the ledger has reached each mark,
    and keeps TRL's log history (for training_metrics.json) at the end."""
    from transformers import TrainerCallback

    from trace_core.training.trainer import STAGE

    ledger_path = out / "ledger.json"

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            # The ledger file is rewritten after every rollout round, so it holds this step's count.
            spent = RolloutLedger(ledger_path).rollouts(STAGE, capability_id)
            for mark in marks:
                if mark <= spent and _snapshot_done(out, mark) is None:
                    _save_snapshot(getattr(model, "module", model), out, mark, spent, int(state.global_step))
            return control

        def on_train_end(self, args, state, control, **kwargs):
            history[:] = [dict(entry) for entry in state.log_history]
            return control

    return Snapshots()


def _checkpoint_log_history(out: Path) -> list[dict]:
    """TRL's log history as the latest checkpoint saved it (empty without a checkpoint)."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = out / "checkpoints"
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        return []
    return list(json.loads((Path(last) / "trainer_state.json").read_text()).get("log_history", []))


def describe_env(env: Any) -> dict[str, Any]:
    """What an environment's instances depend on: its own `describe()`, or a synthetic environment's settings."""
    if hasattr(env, "describe"):
        return env.describe()
    return {
        "class": type(env).__name__,
        **{k: getattr(env, k) for k in ("template", "capability_id", "difficulty", "profile", "domain") if hasattr(env, k)},
    }


def budget_run_key(
    env: Any,
    settings: GRPOSettings,
    budget_rollouts: int,
    snapshots: Sequence[int],
    train_seeds: Sequence[int],
    limits: EpisodeLimits,
    max_context: int,
    depends_on: Mapping[str, Any] | None,
) -> str:
    """A hash of everything a budgeted run's adapter depends on. `depends_on` is what only the caller knows (the
    base weights' fingerprint, the user simulator's settings, a generated environment's code hash)."""
    seeds = list(train_seeds)
    data = {
        "env": describe_env(env),
        "settings": settings.to_dict(),
        "budget": budget_rollouts,
        "snapshots": sorted(snapshots),
        "train_seeds": hashlib.sha256(json.dumps(seeds).encode()).hexdigest()[:16],
        "limits": [limits.max_steps, limits.max_errors],
        "max_context": max_context,
        "depends_on": dict(depends_on or {}),
    }
    return run_key(data)


def _is_loader(model: Any) -> bool:
    """A function that loads the model (not a model: torch modules are callable too, but have `parameters`)."""
    return callable(model) and not hasattr(model, "parameters")


def train_within_budget(
    env: Any,
    model: Any,
    tokenizer: Any,
    settings: GRPOSettings,
    out_dir: str | os.PathLike,
    budget_rollouts: int,
    capability_id: str,
    *,
    snapshots: Sequence[int] = (),
    train_seeds: Sequence[int] = DEFAULT_TRAIN_SEEDS,
    limits: EpisodeLimits,
    make_user: Callable[[], Any],
    max_context: int,
    depends_on: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """GRPO on `env` until the rollout ledger cannot pay for another step within `budget_rollouts`; return the
    adapter record (also in out_dir/adapter_record.json).

    `model`: a model folder, an already-loaded causal LM (PEFT wraps it in place: pass a fresh copy), or a
    zero-argument function returning one (or a (model, tokenizer) pair; `tokenizer` may then be None), called only
    when there is training to do — a finished run is returned without loading anything. The run's
    `max_steps` is raised to what the budget could pay for without refills (ceil(budget / rollouts per step)), so
    the budget, not `settings.max_steps`, ends it. `snapshots`: rollout marks (each in 1..budget); the adapter is
    saved under snapshots/r<mark>/ at the first step end where the ledger has reached the mark, and marks the run
    never reached (the budget's remainder was smaller than a step) get the final adapter. Their `snapshot.json`
    holds the rollouts actually spent at that point. A folder left by a run with another `budget_run_key` is
    emptied first; a finished run with the same key is returned as it is."""
    from trace_core.training.stage import RECORD, STEP_METRICS, finished, step_rows, write_record
    from trace_core.training.trainer import ADAPTER_FILE, train_adapter

    per_step = settings.rollouts_per_step
    if budget_rollouts < per_step:
        raise ValueError(
            f"budget_rollouts={budget_rollouts} cannot pay for one GRPO step of {per_step} rollouts "
            f"(groups_per_step x num_generations); lower them or raise the budget"
        )
    marks = sorted({int(m) for m in snapshots})
    if any(not 1 <= m <= budget_rollouts for m in marks):
        raise ValueError(f"snapshot marks {marks} must lie in 1..budget_rollouts={budget_rollouts}")
    settings = replace(settings, max_steps=max(settings.max_steps, math.ceil(budget_rollouts / per_step)))
    out = Path(out_dir)
    key = budget_run_key(env, settings, budget_rollouts, marks, train_seeds, limits, max_context, depends_on)
    claim(out, key)
    done = finished(out, key)
    if done is not None:
        return done

    if _is_loader(model):  # load only now that training is needed
        loaded = model()
        model, tokenizer = loaded if isinstance(loaded, tuple) else (loaded, tokenizer)
    history: list[dict] = []
    record = train_adapter(
        env,
        model,
        tokenizer,
        settings,
        out,
        capability_id,
        train_seeds=train_seeds,
        limits=limits,
        make_user=make_user,
        max_context=max_context,
        hint=env.hint if settings.hint_fraction > 0 else None,
        resume=True,
        callbacks=[_budget_callbacks(out, capability_id, marks, history)],
        progress=progress,
        max_rollouts=budget_rollouts,
    )
    for mark in marks:
        if _snapshot_done(out, mark) is None:
            # Never reached: the final adapter is what this budget bought.
            final = _snapshot_dir(out, mark)
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(out / "adapter", final)
            write_json_atomic(
                final / "snapshot.json",
                {"mark": mark, "rollouts": record["rollouts"], "step": record["steps"],
                 "adapter_sha256": record["adapter_sha256"], "final": True},
            )
    snaps = {m: _snapshot_done(out, m) or {} for m in marks}
    if not history:
        history = _checkpoint_log_history(out)  # no step ran in this process (the budget was already spent)
    write_json_atomic(
        out / STEP_METRICS,
        {"capability_id": capability_id, "steps": step_rows(history, settings.num_generations)},
    )
    record.update(
        status="trained",
        run_key=key,
        adapter=str((out / "adapter").resolve()),
        budget_rollouts=budget_rollouts,
        snapshots={str(m): str(_snapshot_dir(out, m).resolve()) for m in marks},
        snapshot_rollouts={str(m): int(snaps[m].get("rollouts", record["rollouts"])) for m in marks},
        environment=describe_env(env),
    )
    assert (out / "adapter" / ADAPTER_FILE).exists()
    return write_record(out / RECORD, record)  # written last: its run_key marks the run as finished


def train_on_target(
    env: TargetEnv | SplitTargetEnv,
    model: Any,
    tokenizer: Any,
    settings: GRPOSettings,
    out_dir: str | os.PathLike,
    budget_rollouts: int,
    **options: Any,
) -> dict[str, Any]:
    """The "GRPO on the target tasks" baseline: `train_within_budget` on a `TargetEnv` or `SplitTargetEnv` (ledger
    id `grpo_target`; `options` are its keyword arguments). The reward is the target's own score of each episode."""
    if not isinstance(env, (TargetEnv, SplitTargetEnv)):
        raise TypeError(f"train_on_target needs a TargetEnv or SplitTargetEnv, got {type(env).__name__}; build one "
                        "with trace_core.baselines.stage.target_training_env(params, held_out)")
    return train_within_budget(env, model, tokenizer, settings, out_dir, budget_rollouts, env.capability_id, **options)


__all__ = [
    "RETRIES",
    "TARGET_ID",
    "SplitTargetEnv",
    "TargetEnv",
    "assert_disjoint",
    "budget_run_key",
    "describe_env",
    "task_key",
    "train_on_target",
    "train_within_budget",
]
