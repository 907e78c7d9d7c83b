"""The rollout engine: many episodes at once against one policy, written to disk as they finish.

Episodes are scheduled in a fixed order, in fixed batches (slices of the schedule), and advanced in lock-step:
every live episode of the batch contributes one request to a batched `policy.generate` call, then each is stepped
with its reply; the next batch starts when the last episode of this one ends. Finished episodes are appended to a JSONL
file at once (flushed and fsynced), so a killed run loses at most the episodes in flight; a re-run skips the
episodes already on disk. At the end the file is rewritten in schedule order, so the same params give a
byte-identical file however often the run was interrupted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from trace_core.envs.base import Environment, EpisodeLimits
from trace_core.envs.users import UserSimulator
from trace_core.jsonl import iter_jsonl, jsonl_line
from trace_core.runs import write_text_atomic
from trace_core.schemas import Instance, Message, Trajectory


class PolicyLike(Protocol):
    name: str

    def generate(self, requests: list[tuple[list[Message], list[dict]]], sampling) -> list[Message | None]: ...


@dataclass
class RolloutStats:
    episodes: int = 0
    skipped: int = 0  # already on disk (resume)
    replayed: int = 0  # episodes on disk played again to complete an interrupted batch (not written again)
    replay_mismatches: int = 0  # ... of which the replay differed from the file (nondeterministic backend)
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
    *,
    trials: int,
    batch_size: int,
    out_path: str | os.PathLike | None = None,
    progress: bool = True,
    system_prompt: str | None = None,
    stats: RolloutStats | None = None,
) -> list[Trajectory]:
    """Run `trials` episodes per instance, `batch_size` at a time, and return the trajectories in schedule order.

    With `out_path`, finished trajectories are appended as they complete and episodes already in the file are
    not run again.

    Results do not depend on what ran before in the process: batches are fixed slices of the schedule (the
    ordered (instance, trial) list), each started with the policy's prompt caches cleared, and each episode
    samples with seeds derived from (seed, instance, trial, turn) (`episode_seed`). A batch that was cut short
    by a kill is replayed whole, so every row sees the same batch shapes and padding as in an uninterrupted run;
    its rows already on file are not written again (a replayed row that differs from the file's is counted in
    `stats.replay_mismatches` and the file's row kept)."""
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
    size = max(1, int(batch_size))
    batches = [schedule[k : k + size] for k in range(0, len(schedule), size)]
    sink = open(out_path, "a", encoding="utf-8") if out_path is not None else None
    bar = tqdm(total=len(schedule), initial=len(done), desc="episodes", unit="ep", disable=not progress,
               dynamic_ncols=True)
    started = time.perf_counter()
    base_seed = getattr(sampling, "seed", None)
    try:
        for batch in batches:
            if all(trajectory_key(i.instance_id, t) in done for i, t in batch):
                continue
            clear = getattr(policy, "clear_prefix_cache", None)
            if callable(clear):
                clear()  # no KV carried over from earlier batches (a resumed run has none)
            live = [(env.start(inst, make_user(), limits, system_prompt), trial) for inst, trial in batch]
            while live:
                requests = [(ep.messages, ep.tools) for ep, _ in live]
                seeds = [episode_seed(base_seed or 0, ep.instance.instance_id, trial, ep.steps) for ep, trial in live]
                replies = policy.generate(requests, _with_seeds(sampling, seeds))
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
                    traj = ep.trajectory(policy=policy.name, trial=trial, seed=base_seed)
                    key = trajectory_key(traj.instance_id, trial)
                    if key in done:  # a replayed row of an interrupted batch: already on file
                        stats.replayed += 1
                        if done[key].model_dump_json() != traj.model_dump_json():
                            stats.replay_mismatches += 1
                        continue
                    done[key] = traj
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


def episode_seed(seed: int, instance_id: str, trial: int, turn: int) -> int:
    """The sampling seed of one assistant turn: a function of (run seed, instance, trial, turn) only, so an
    episode samples the same tokens whatever ran before it in the process or shares its batch."""
    digest = hashlib.sha256(f"{seed}\0{instance_id}\0{trial}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def _with_seeds(sampling, seeds: list[int]):
    """`sampling` with one seed per request (`Sampling.seeds`), when its type has that field."""
    if dataclasses.is_dataclass(sampling) and "seeds" in {f.name for f in dataclasses.fields(sampling)}:
        return dataclasses.replace(sampling, seeds=tuple(seeds))
    return sampling


def _rewrite(path: str | os.PathLike, trajectories: Iterable[Trajectory], order: dict[str, int]) -> None:
    rows = sorted(trajectories, key=lambda t: order[trajectory_key(t.instance_id, t.trial)])
    write_text_atomic(path, "".join(jsonl_line(t.model_dump_json()) for t in rows))


def write_parquet(trajectories: list[Trajectory], path: str | os.PathLike) -> None:
    """Trajectories as a flat table (nested parts JSON-encoded), written with `datasets`."""
    from datasets import Dataset

    Dataset.from_list([t.to_row() for t in trajectories]).to_parquet(str(path))

