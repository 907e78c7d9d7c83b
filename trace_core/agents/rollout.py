"""The rollout engine: many episodes at once against one policy, written to disk as they finish.

Episodes are scheduled in a fixed order and advanced in lock-step: every live episode contributes one request to
a batched `policy.generate` call, then each is stepped with its reply. Finished episodes are appended to a JSONL
file at once (flushed and fsynced), so a killed run loses at most the episodes in flight; a re-run skips the
episodes already on disk. At the end the file is rewritten in schedule order, so the same params give a
byte-identical file however often the run was interrupted.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.envs.users import UserSimulator
from trace_core.jsonl import iter_jsonl, jsonl_line
from trace_core.schemas import Instance, Message, Trajectory


class PolicyLike(Protocol):
    name: str

    def generate(self, requests: list[tuple[list[Message], list[dict]]], sampling) -> list[Message | None]: ...


@dataclass
class RolloutStats:
    episodes: int = 0
    skipped: int = 0  # already on disk (resume)
    generated_tokens: int = 0
    policy_calls: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def episodes_per_min(self) -> float:
        return 60.0 * self.episodes / self.seconds if self.seconds else 0.0


def trajectory_key(instance_id: str, trial: int) -> str:
    return f"{instance_id}#{trial}"


def read_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    """Read a JSONL trajectory file; a torn last line (from a crash mid-write) is ignored."""
    out: list[Trajectory] = []
    for line in iter_jsonl(path):
        try:
            out.append(Trajectory.model_validate_json(line))
        except ValueError:
            continue
    return out


def run_episodes(
    env: Environment,
    instances: Iterable[Instance],
    policy: PolicyLike,
    make_user: Callable[[], UserSimulator],
    sampling,
    limits: EpisodeLimits,
    trials: int = 1,
    batch_size: int = 16,
    out_path: str | os.PathLike | None = None,
    progress: bool = True,
    system_prompt: str | None = None,
    stats: RolloutStats | None = None,
) -> list[Trajectory]:
    """Run `trials` episodes per instance, `batch_size` at a time, and return the trajectories in schedule order.

    With `out_path`, finished trajectories are appended as they complete and episodes already in the file are
    not run again."""
    from tqdm.auto import tqdm

    stats = stats if stats is not None else RolloutStats()
    schedule = [(inst, t) for inst in instances for t in range(trials)]
    order = {trajectory_key(i.instance_id, t): n for n, (i, t) in enumerate(schedule)}
    done: dict[str, Trajectory] = {}
    if out_path is not None:
        for traj in read_trajectories(out_path):
            key = trajectory_key(traj.instance_id, traj.trial)
            if key in order:
                done[key] = traj
        _rewrite(out_path, done.values(), order)  # drop a torn tail or foreign rows before appending
    stats.skipped += len(done)
    queue = [(i, t) for i, t in schedule if trajectory_key(i.instance_id, t) not in done]
    sink = open(out_path, "a", encoding="utf-8") if out_path is not None else None
    bar = tqdm(total=len(schedule), initial=len(done), desc="episodes", unit="ep", disable=not progress, dynamic_ncols=True)
    live: list[tuple] = []  # (episode, trial)
    started = time.perf_counter()
    try:
        while queue or live:
            while queue and len(live) < batch_size:
                inst, trial = queue.pop(0)
                live.append((env.start(inst, make_user(), limits, system_prompt), trial))
            requests = [(ep.messages, ep.tools) for ep, _ in live]
            replies = policy.generate(requests, _with_seed(sampling, stats.policy_calls))
            stats.policy_calls += 1
            still: list[tuple] = []
            for (ep, trial), reply in zip(live, replies):
                if reply is None:
                    ep.abort("context_overflow")
                else:
                    stats.generated_tokens += len(reply.token_ids or [])
                    ep.step(reply)
                if not ep.done:
                    still.append((ep, trial))
                    continue
                traj = ep.trajectory(policy=policy.name, trial=trial, seed=getattr(sampling, "seed", None))
                done[trajectory_key(traj.instance_id, trial)] = traj
                stats.episodes += 1
                if sink is not None:
                    sink.write(jsonl_line(traj.model_dump_json()))
                    sink.flush()
                    os.fsync(sink.fileno())
                bar.update(1)
                bar.set_postfix(success=f"{sum(t.success for t in done.values())}/{len(done)}")
            live = still
    finally:
        stats.seconds += time.perf_counter() - started
        bar.close()
        if sink is not None:
            sink.close()
    if out_path is not None:
        _rewrite(out_path, done.values(), order)
    return sorted(done.values(), key=lambda t: order[trajectory_key(t.instance_id, t.trial)])


def _with_seed(sampling, call_index: int):
    """Each batched call gets its own seed derived from the run seed, so sampled runs are reproducible."""
    if getattr(sampling, "temperature", 0.0) and hasattr(sampling, "seed"):
        from dataclasses import replace

        return replace(sampling, seed=sampling.seed * 1_000_003 + call_index)
    return sampling


def _rewrite(path: str | os.PathLike, trajectories: Iterable[Trajectory], order: dict[str, int]) -> None:
    rows = sorted(trajectories, key=lambda t: order[trajectory_key(t.instance_id, t.trial)])
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for t in rows:
            f.write(jsonl_line(t.model_dump_json()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)


def write_parquet(trajectories: list[Trajectory], path: str | os.PathLike) -> None:
    """Trajectories as a flat table (nested parts JSON-encoded), written with `datasets`."""
    from datasets import Dataset

    Dataset.from_list([t.to_row() for t in trajectories]).to_parquet(str(path))

