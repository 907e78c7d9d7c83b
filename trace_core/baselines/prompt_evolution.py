"""Baseline "GEPA (prompt evolution)" (docs/method.md §5): the agent's system prompt optimised with the `gepa` package
under the same rollout budget as TRACE, the model's weights untouched.

The candidate GEPA evolves is `{"system_prompt": text}`, seeded with the environment's own system prompt
(`Environment.system_prompt`: the compact policy on the CPU profile, τ²'s official policy on the full one).
`PromptAdapter` is the `gepa.core.adapter.GEPAAdapter`: `evaluate` plays one episode per instance of the batch with
the candidate as system prompt (`run_episodes`) and scores it with the environment's reward (τ²'s own score on the
target); `make_reflective_dataset` turns each episode into a record for the reflection model — the task, the
compacted trajectory (`compact_trajectory`) and feedback from the score and the reference solution.

Budget, in rollouts (episodes). GEPA's own `max_metric_calls` is set to the budget (it counts every example
evaluated). Episodes are cached per (prompt, instance) in `episodes.jsonl`: with greedy decoding the same prompt
on the same instance replays the same episode, so a repeat costs nothing, and a resumed run replays the episodes
it already paid for (GEPA re-evaluates its seed candidate before loading a saved state). The budget is enforced on
the episodes actually run: a stopper ends GEPA when what is left cannot pay for a child minibatch and a validation
pass, and an evaluation that would go past the budget raises `BudgetExhausted` before running anything, which
ends the optimisation. So `rollouts` never exceeds the budget.

History: every candidate GEPA accepted and scored on the validation set, in the order found, with `rollouts` (the
episodes run when its validation score was known, i.e. when GEPA could first have picked it), its validation
score (mean reward) and success rate. `best_within(result, n)` is the best candidate known within n rollouts.

Outputs under `out_dir`: `history.json` (the history and the run's summary, rewritten as it grows; `finished`
marks a completed run, which is then reused), `best_prompt.txt`, and the resumption state `episodes.jsonl`,
`gepa/` (GEPA's run_dir: its saved state), `gepa_log.txt`, `run_key.txt`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.jsonl import jsonl_line, jsonl_lines
from trace_core.runs import claim, read_json, run_key, write_json_atomic
from trace_core.schemas import Instance, Trajectory

SYSTEM_PROMPT = "system_prompt"  # the one component of a candidate
HISTORY = "history.json"
BEST_PROMPT = "best_prompt.txt"
EPISODES = "episodes.jsonl"
GEPA_DIR = "gepa"
GEPA_LOG = "gepa_log.txt"
# Consecutive reflections without a usable prompt after which the run stops (e.g. a model whose replies never
# hold text, or a context too short for the reflection prompt): GEPA would otherwise keep sampling minibatches.
MAX_REFLECTION_FAILURES = 5


class BudgetExhausted(RuntimeError):
    """An evaluation needs more episodes than the rollout budget has left."""


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- the episode cache
class EpisodeCache:
    """Episodes already played, per (prompt hash, instance content hash), appended to a JSONL file as they are
    run (flushed and fsynced; a torn last line is cut off on load, so the next append starts a line of its own).
    Its size is the rollouts spent."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.rows: dict[str, Trajectory] = {}
        if self.path is not None and self.path.exists():
            data = self.path.read_bytes()
            whole = data.rfind(b"\n") + 1  # the end of the last complete line
            if whole < len(data):  # killed mid-write: appending after the tear would spoil the next row
                with open(self.path, "r+b") as f:
                    f.truncate(whole)
                data = data[:whole]
            for line in jsonl_lines(data.decode("utf-8", errors="replace")):
                try:
                    row = json.loads(line)
                    self.rows[row["key"]] = Trajectory.model_validate(row["trajectory"])
                except (ValueError, KeyError):
                    continue  # a torn tail from a kill

    @staticmethod
    def key(prompt: str, instance: Instance) -> str:
        return f"{prompt_hash(prompt)}/{instance.content_hash()}"

    def get(self, prompt: str, instance: Instance) -> Trajectory | None:
        return self.rows.get(self.key(prompt, instance))

    def add(self, prompt: str, pairs: Sequence[tuple[Instance, Trajectory]]) -> None:
        new = [(self.key(prompt, inst), traj) for inst, traj in pairs]
        self.rows.update(new)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.writelines(
                jsonl_line(json.dumps({"key": key, "trajectory": traj.model_dump(mode="json")}, ensure_ascii=False))
                for key, traj in new
            )
            f.flush()
            os.fsync(f.fileno())

    def __len__(self) -> int:
        return len(self.rows)


# ------------------------------------------------------------------------------------------------ the adapter
@dataclass
class Rollout:
    """GEPA's opaque trajectory type here: the instance and its episode."""

    instance: Instance
    trajectory: Trajectory


def feedback(instance: Instance, trajectory: Trajectory, reveal_reference: bool = True) -> str:
    """What the reflection model is told about an episode: the outcome, the score's parts and, for a failure, what
    a correct agent does (the reference tool calls, the facts to tell the user, or that the request must be
    refused)."""
    if trajectory.success:
        return f"Solved (reward {trajectory.reward:.2f}): the end state is the one the task requires."
    parts = [f"Not solved (reward {trajectory.reward:.2f}, the episode ended by {trajectory.termination_reason})."]
    if trajectory.reward_components:
        shown = ", ".join(f"{k}={v:g}" for k, v in sorted(trajectory.reward_components.items()))
        parts.append(f"Score components: {shown}.")
    if reveal_reference:
        if instance.must_refuse:
            parts.append("The policy forbids this request: the agent should check the facts, make no change and "
                         "explain the refusal.")
        elif instance.reference_actions:
            calls = "; ".join(f"{a.name}({json.dumps(a.arguments, sort_keys=True)})" for a in instance.reference_actions)
            parts.append(f"A correct agent makes these tool calls: {calls}.")
        if instance.communicate_info:
            parts.append(f"It must also tell the user: {', '.join(instance.communicate_info)}.")
    return " ".join(parts)


class PromptAdapter:
    """A `GEPAAdapter` over `{"system_prompt": text}` candidates: episodes of `env` with `policy`, scored by the
    environment's reward. `budget_rollouts` bounds the episodes run (cache hits are free); see the module doc."""

    propose_new_texts = None  # GEPA's default reflective proposal (InstructionProposalSignature) is used

    def __init__(
        self,
        env: Environment,
        policy: Any,
        *,
        limits: EpisodeLimits,
        budget_rollouts: int,
        make_user: Callable[[], Any],
        sampling: Any,
        batch_size: int,
        max_trajectory_chars: int,
        cache: EpisodeCache | None = None,
        reveal_reference: bool = True,
        progress: bool = False,
    ):
        self.env = env
        self.policy = policy
        self.limits = limits
        self.budget = int(budget_rollouts)
        self.make_user = make_user
        self.sampling = sampling
        self.cache = cache if cache is not None else EpisodeCache()
        self.batch_size = batch_size
        self.max_trajectory_chars = max_trajectory_chars
        self.reveal_reference = reveal_reference
        self.progress = progress
        self.last_run = 0  # episodes run by the latest evaluate call

    @property
    def spent(self) -> int:
        return len(self.cache)

    @property
    def remaining(self) -> int:
        return self.budget - self.spent

    def episodes(self, batch: Sequence[Instance], prompt: str) -> list[Trajectory]:
        """One episode per instance with `prompt` as system prompt: cached ones replayed, the others run (all
        together, or none when the budget cannot pay for them)."""
        from trace_core.agents.rollout import run_episodes

        todo = list({inst.content_hash(): inst for inst in batch if self.cache.get(prompt, inst) is None}.values())
        if len(todo) > self.remaining:
            raise BudgetExhausted(
                f"an evaluation needs {len(todo)} new episodes and the budget of {self.budget} rollouts has "
                f"{self.remaining} left"
            )
        self.last_run = len(todo)
        if todo:
            played = run_episodes(
                self.env,
                todo,
                self.policy,
                self.make_user,
                self.sampling,
                self.limits,
                trials=1,
                batch_size=self.batch_size,
                progress=self.progress,
                system_prompt=prompt,
            )
            self.cache.add(prompt, list(zip(todo, played, strict=True)))
        return [self.cache.get(prompt, inst) for inst in batch]  # type: ignore[misc]

    def evaluate(self, batch: list[Instance], candidate: dict[str, str], capture_traces: bool = False) -> Any:
        from gepa.core.adapter import EvaluationBatch

        prompt = candidate[SYSTEM_PROMPT]
        trajectories = self.episodes(batch, prompt)
        outputs = [
            {"instance_id": t.instance_id, "reward": t.reward, "success": t.success,
             "termination": t.termination_reason}
            for t in trajectories
        ]
        return EvaluationBatch(
            outputs=outputs,
            scores=[float(t.reward) for t in trajectories],
            trajectories=[Rollout(i, t) for i, t in zip(batch, trajectories, strict=True)] if capture_traces else None,
        )

    def make_reflective_dataset(
        self, candidate: dict[str, str], eval_batch: Any, components_to_update: list[str]
    ) -> dict[str, list[dict[str, Any]]]:
        from trace_core.analysis.base import compact_trajectory

        records = []
        for rollout in eval_batch.trajectories or []:
            inst, traj = rollout.instance, rollout.trajectory
            records.append(
                {
                    "Inputs": {"Customer request": inst.opening or inst.user_goal},
                    "Generated Outputs": compact_trajectory(traj, max_chars=self.max_trajectory_chars),
                    "Feedback": feedback(inst, traj, self.reveal_reference),
                }
            )
        return {name: records for name in components_to_update if name == SYSTEM_PROMPT}


# ------------------------------------------------------------------------------------------ reflection models
def reflection_lm_from_backend(
    backend: Any, *, temperature: float, max_new_tokens: int, seed: int
) -> Callable[[str], str]:
    """A `str -> str` reflection model from a chat backend (`OpenAIPolicy` for an endpoint, or `LocalPolicy` for
    the local model, via `chat_completer`): the prompt as one user message, the reply's text back."""
    from trace_core.agents.factories import chat_completer

    complete = chat_completer(backend, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)

    def reflect(prompt: str) -> str:
        return complete([{"role": "user", "content": prompt}])

    return reflect


class _CheckedReflection:
    """The reflection model as GEPA calls it, refusing replies that hold no prompt (an empty candidate would cost
    a minibatch and a validation pass for nothing). GEPA's proposer catches the error and skips the proposal;
    `failures_in_a_row` lets a stopper end a run whose reflection model never answers usefully."""

    def __init__(self, lm: Callable[[str], str]):
        self.lm = lm
        self.calls = 0
        self.failures = 0
        self.failures_in_a_row = 0

    def __call__(self, prompt: Any) -> str:
        self.calls += 1
        text = self.lm(prompt if isinstance(prompt, str) else json.dumps(prompt))
        # GEPA keeps what is between the first and last ``` (or the whole reply): it must hold some words.
        body = text.strip().strip("`").strip()
        if len(body) < 20:
            self.failures += 1
            self.failures_in_a_row += 1
            raise ValueError(f"the reflection model returned no usable prompt ({len(text)} characters)")
        self.failures_in_a_row = 0
        return text


# ------------------------------------------------------------------------------------------------ the history
class _History:
    """GEPA callback: appends each candidate scored on the validation set to history.json (once per candidate:
    a resumed run re-announces its seed and may redo an iteration)."""

    def __init__(self, path: Path, summary: dict[str, Any], adapter: PromptAdapter, valset: Sequence[Instance]):
        self.path = path
        self.adapter = adapter
        self.valset = list(valset)
        self.data = summary
        self.errors: list[str] = []

    def save(self) -> None:
        write_json_atomic(self.path, self.data)

    def on_valset_evaluated(self, event: Mapping[str, Any]) -> None:
        try:
            self._add(event)
        except Exception as exc:  # noqa: BLE001 — GEPA would swallow it; keep it for the summary
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _add(self, event: Mapping[str, Any]) -> None:
        prompt = event["candidate"][SYSTEM_PROMPT]
        digest = prompt_hash(prompt)
        candidates = self.data["candidates"]
        if any(c["gepa_idx"] == event["candidate_idx"] and c["prompt_sha"] == digest for c in candidates):
            return
        trajectories = [self.adapter.cache.get(prompt, inst) for inst in self.valset]
        successes = [t.success for t in trajectories if t is not None]
        spent = self.adapter.spent
        candidates.append(
            {
                "id": len(candidates),
                "gepa_idx": int(event["candidate_idx"]),
                "parents": [int(p) for p in event.get("parent_ids") or [] if p is not None],
                "iteration": int(event["iteration"]),
                "system_prompt": prompt,
                "prompt_sha": digest,
                "val_score": float(event["average_score"]),
                "val_success": sum(successes) / len(successes) if successes else None,
                "val_evaluated": int(event["num_examples_evaluated"]),
                "rollouts": spent,
                "rollouts_at_proposal": spent - self.adapter.last_run,
            }
        )
        self.data["rollouts"] = spent
        self.save()


def best_within(result: Mapping[str, Any], rollouts: float = math.inf) -> tuple[str, int]:
    """The best system prompt known within `rollouts` episodes and the episodes spent by then: the history's
    candidate with the highest validation score among those whose score was known by then (ties: the earliest).
    Before any candidate was scored, the seed prompt at 0 rollouts (it needs no optimisation)."""
    known = [c for c in result.get("candidates", []) if c["rollouts"] <= rollouts]
    if not known:
        return result["seed_prompt"], 0
    best = max(known, key=lambda c: (c["val_score"], -c["rollouts"]))
    return best["system_prompt"], int(best["rollouts"])


# ---------------------------------------------------------------------------------------------------- the run
class _FileLog:
    """GEPA's logger: its messages (iterations, scores, proposed texts) appended to a file instead of stdout."""

    def __init__(self, path: Path):
        self.path = path

    def log(self, message: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(str(message) + "\n")


def evolve_prompt(
    env: Environment,
    policy: Any,
    reflection_lm: Callable[[str], str],
    trainset: Sequence[Instance],
    valset: Sequence[Instance],
    out_dir: str | os.PathLike,
    budget_rollouts: int,
    *,
    limits: EpisodeLimits,
    make_user: Callable[[], Any],
    sampling: Any,
    minibatch_size: int,
    batch_size: int,
    max_trajectory_chars: int,
    seed: int,
    seed_prompt: str | None = None,
    acceptance: str = "strict_improvement",
    held_out: Iterable[Instance | str] = (),
    depends_on: Mapping[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Optimise the system prompt of `policy` on `env` with GEPA within `budget_rollouts` episodes; return the
    summary (also out_dir/history.json): `best_prompt`, `best_val_score`, `rollouts` (episodes run),
    `metric_calls` (GEPA's count, cache hits included), `stopped_by`, `candidates` (the history; see
    `best_within`), `seed_prompt`, the instance ids of both sets.

    `trainset`: target training instances GEPA draws reflection minibatches of `minibatch_size` from; `valset`:
    those every accepted candidate is scored on. Both must be disjoint from `held_out` (checked). `sampling`: the
    policy's sampling (default greedy). `reflection_lm`: `str -> str` (see `reflection_lm_from_backend`).
    `acceptance`: GEPA's rule for a child's minibatch score ("strict_improvement" or "improvement_or_equal").
    `depends_on`: what else the result depends on (model fingerprint, reflection model) for the run key; a
    folder holding another key's run is emptied first, a finished run with this key is returned as it is."""
    import gepa

    from trace_core.baselines.target import assert_disjoint

    trainset, valset = list(trainset), list(valset)
    if not trainset or not valset:
        raise ValueError("GEPA needs target training instances in both trainset and valset (e.g. 24 and 8)")
    assert_disjoint(trainset + valset, held_out)
    if minibatch_size < 1:
        raise ValueError(f"minibatch_size={minibatch_size} must be >= 1 (GEPA's default is 3)")
    if budget_rollouts < len(valset) + minibatch_size:
        raise ValueError(
            f"budget_rollouts={budget_rollouts} cannot pay for scoring the seed prompt on the {len(valset)} "
            f"validation instances plus one minibatch of {minibatch_size}; raise the budget or shrink the sets"
        )
    seed_prompt = seed_prompt if seed_prompt is not None else env.system_prompt(trainset[0])
    out = Path(out_dir)
    key = run_key(
        {
            "seed_prompt": seed_prompt,
            "trainset": [i.content_hash() for i in trainset],
            "valset": [i.content_hash() for i in valset],
            "budget": budget_rollouts,
            "minibatch": minibatch_size,
            "acceptance": acceptance,
            "sampling": vars(sampling),
            "limits": [limits.max_steps, limits.max_errors],
            "seed": seed,
            "max_trajectory_chars": max_trajectory_chars,
            "depends_on": dict(depends_on or {}),
        }
    )
    claim(out, key)
    previous = read_json(out / HISTORY)
    if previous is not None and previous.get("finished") and previous.get("run_key") == key:
        return previous

    adapter = PromptAdapter(
        env,
        policy,
        limits=limits,
        budget_rollouts=budget_rollouts,
        make_user=make_user,
        sampling=sampling,
        cache=EpisodeCache(out / EPISODES),
        batch_size=batch_size,
        max_trajectory_chars=max_trajectory_chars,
        progress=progress,
    )
    summary = previous if previous is not None and previous.get("run_key") == key else {
        "run_key": key,
        "finished": False,
        "budget_rollouts": budget_rollouts,
        "seed_prompt": seed_prompt,
        "trainset": [i.instance_id for i in trainset],
        "valset": [i.instance_id for i in valset],
        "minibatch_size": minibatch_size,
        "candidates": [],
    }
    history = _History(out / HISTORY, summary, adapter, valset)
    reflection = _CheckedReflection(reflection_lm)
    # The cheapest progress left: a child minibatch and a validation pass (the parent's minibatch may be cached).
    least = minibatch_size + len(valset)

    def out_of_budget(state: Any) -> bool:
        return adapter.remaining < least

    def reflection_broken(state: Any) -> bool:
        return reflection.failures_in_a_row >= MAX_REFLECTION_FAILURES

    stopped_by = "max_metric_calls"
    metric_calls = None
    try:
        result = gepa.optimize(
            seed_candidate={SYSTEM_PROMPT: seed_prompt},
            trainset=trainset,
            valset=valset,
            adapter=adapter,
            reflection_lm=reflection,
            reflection_minibatch_size=minibatch_size,
            max_metric_calls=budget_rollouts,
            stop_callbacks=[out_of_budget, reflection_broken],
            logger=_FileLog(out / GEPA_LOG),
            run_dir=str(out / GEPA_DIR),
            callbacks=[history],
            track_best_outputs=False,
            display_progress_bar=progress,
            acceptance_criterion=acceptance,
            seed=seed,
            raise_on_exception=True,
        )
        metric_calls = int(result.total_metric_calls) if result.total_metric_calls is not None else None
        if out_of_budget(None):
            stopped_by = "budget"
        elif reflection_broken(None):
            stopped_by = "reflection_failed"
    except BudgetExhausted:
        stopped_by = "budget"
    if history.errors:
        raise RuntimeError(f"recording GEPA's candidates failed: {history.errors[0]}")
    if not summary["candidates"]:
        raise RuntimeError("GEPA finished without scoring the seed prompt; see " + str(out / GEPA_LOG))
    best_prompt, _ = best_within(summary)
    best = max(summary["candidates"], key=lambda c: (c["val_score"], -c["rollouts"]))
    summary.update(
        finished=True,
        rollouts=adapter.spent,
        metric_calls=metric_calls,
        stopped_by=stopped_by,
        reflection_calls=reflection.calls,
        reflection_failures=reflection.failures,
        best_prompt=best_prompt,
        best_candidate=best["id"],
        best_val_score=best["val_score"],
    )
    (out / BEST_PROMPT).write_text(best_prompt, encoding="utf-8")
    history.save()  # written last: `finished` marks the run as done
    return summary


__all__ = [
    "SYSTEM_PROMPT",
    "BudgetExhausted",
    "EpisodeCache",
    "PromptAdapter",
    "best_within",
    "evolve_prompt",
    "feedback",
    "prompt_hash",
    "reflection_lm_from_backend",
]
