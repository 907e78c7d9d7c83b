"""Rollout engine: batching, termination, crash-resume without redoing episodes, byte-identical output."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest

from trace_core.agents.rollout import RolloutStats, read_trajectories, run_episodes
from trace_core.envs.tau2_env import Tau2Environment, official_instances
from trace_core.schemas import Message, ToolCall
from tests.defaults import default_limits, default_sampling, default_user


@dataclass
class Sampling:
    temperature: float = 0.0
    seed: int = 0
    seeds: tuple[int, ...] | None = None


class ScriptPolicy:
    """Deterministic fake policy: a calculator call, then a closing text; counts what it is asked."""

    name = "script"

    def __init__(self, crash_after_calls: int | None = None, closing: str = "All done, goodbye."):
        self.crash_after_calls = crash_after_calls
        self.closing = closing
        self.calls = 0
        self.seen_openings: set[str] = set()

    def generate(self, requests, sampling):
        if self.crash_after_calls is not None and self.calls >= self.crash_after_calls:
            raise KeyboardInterrupt("simulated kill")
        self.calls += 1
        out = []
        for messages, tools in requests:
            assert any(t["function"]["name"] == "calculate" for t in tools)
            self.seen_openings.add(messages[1].content)
            n_assistant = sum(m.role == "assistant" for m in messages)
            if n_assistant == 0:
                out.append(Message(role="assistant", tool_calls=[ToolCall(name="calculate", arguments={"expression": "2 + 3"})], token_ids=[1, 2, 3]))
            else:
                out.append(Message(role="assistant", content=self.closing, token_ids=[4, 5]))
        return out


@pytest.fixture(scope="module")
def setup():
    env = Tau2Environment("retail", "full")
    instances = official_instances("retail", "test")[:5]
    return env, instances


def _run(setup, policy, path=None, batch_size=3, trials=2, stats=None):
    env, instances = setup
    return run_episodes(env, instances, policy, lambda: default_user(), default_sampling(), default_limits(max_steps=6),
                        trials=trials, batch_size=batch_size, out_path=path, progress=False, stats=stats)


def test_batched_rollouts_terminate_and_record(setup):
    stats = RolloutStats()
    trajs = _run(setup, ScriptPolicy(), stats=stats)
    assert len(trajs) == 10 and stats.episodes == 10
    assert [(t.instance_id, t.trial) for t in trajs] == [(i.instance_id, k) for i in setup[1] for k in range(2)]
    for t in trajs:
        assert t.termination_reason == "user_stop"
        assert t.messages[2].tool_calls[0].name == "calculate"
        assert t.messages[3].role == "tool" and t.messages[3].content == "5.0"
        assert 0.0 <= t.reward <= 1.0
    assert stats.generated_tokens == 10 * 5


def test_batch_size_does_not_change_results(setup):
    a = _run(setup, ScriptPolicy(), batch_size=1)
    b = _run(setup, ScriptPolicy(), batch_size=4)
    assert [t.model_dump_json() for t in a] == [t.model_dump_json() for t in b]


def test_kill_and_resume_loses_nothing_and_redoes_nothing(setup, tmp_path):
    clean = tmp_path / "clean.jsonl"
    _run(setup, ScriptPolicy(), clean)
    resumed = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        _run(setup, ScriptPolicy(crash_after_calls=5), resumed)
    # Simulate a torn write from the kill as well.
    with open(resumed, "a") as f:
        f.write('{"schema_version": "1", "trajec')
    finished = read_trajectories(resumed)
    assert 0 < len(finished) < 10
    stats = RolloutStats()
    _run(setup, ScriptPolicy(), resumed, stats=stats)
    assert stats.skipped == len(finished)
    assert stats.episodes == 10 - len(finished)  # only the unfinished episodes ran
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(resumed) == digest(clean)


def test_resume_keeps_finished_episodes_whose_replies_hold_line_separators(setup, tmp_path):
    # Issue #35: U+2028, U+2029 and U+0085 were written raw and the reader split on them, so a resumed run replayed
    # these finished episodes and dropped them from the file.
    closing = "All done\u2028goodbye\u2029see you\u0085bye."
    path = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        _run(setup, ScriptPolicy(crash_after_calls=5, closing=closing), path)
    finished = read_trajectories(path)
    assert 0 < len(finished) < 10
    assert all(any(m.content == closing for m in t.messages) for t in finished)
    stats = RolloutStats()
    _run(setup, ScriptPolicy(closing=closing), path, stats=stats)
    assert stats.skipped == len(finished) and stats.episodes == 10 - len(finished)
    assert len(read_trajectories(path)) == 10
    assert len(path.read_text(encoding="utf-8").split("\n")) == 11  # one line per episode, then the final "\n"


def test_context_overflow_is_a_termination_reason(setup):
    class Overflow(ScriptPolicy):
        def generate(self, requests, sampling):
            return [None for _ in requests]

    trajs = _run(setup, Overflow(), trials=1)
    assert {t.termination_reason for t in trajs} == {"context_overflow"}
    assert all(t.reward == 0.0 for t in trajs)


def test_parquet_export_round_trips_through_datasets(setup, tmp_path):
    from datasets import Dataset

    from trace_core.agents.rollout import write_parquet
    from trace_core.schemas import Trajectory

    trajs = _run(setup, ScriptPolicy(), trials=1)
    write_parquet(trajs, tmp_path / "t.parquet")
    rows = Dataset.from_parquet(str(tmp_path / "t.parquet")).to_list()
    assert [Trajectory.from_row(r) for r in rows] == trajs


class BatchSensitivePolicy(ScriptPolicy):
    """Like a real batched model, its replies depend on the batch they were generated in (here: visibly, through
    the batch size; in LocalPolicy through padding and bf16 numerics) and on the per-request sampling seed.
    Episodes take 1-3 tool calls depending on the instance, so they end at different times."""

    def __init__(self, kill_after_rows=None, path=None):
        super().__init__()
        self.kill_after_rows, self.path = kill_after_rows, path

    def generate(self, requests, sampling):
        if self.kill_after_rows is not None and len(read_trajectories(self.path)) >= self.kill_after_rows:
            raise KeyboardInterrupt("simulated kill")
        out = []
        for i, (messages, _tools) in enumerate(requests):
            calls = sum(m.role == "assistant" for m in messages)
            wanted = 1 + int(hashlib.sha256(messages[1].content.encode()).hexdigest(), 16) % 3
            seed = sampling.seeds[i] if sampling.seeds is not None else None
            if calls < wanted:
                args = {"expression": f"{len(requests)} + {calls}"}
                out.append(Message(role="assistant", tool_calls=[ToolCall(name="calculate", arguments=args)],
                                   token_ids=[1]))
            else:
                out.append(Message(role="assistant", content=f"Done in a batch of {len(requests)}, seed {seed}.",
                                   token_ids=[2]))
        return out


@pytest.mark.parametrize("kill_after", [1, 3, 4])
def test_resumed_run_is_byte_identical_to_an_uninterrupted_one(setup, tmp_path, kill_after):
    """A kill at any point (mid-batch included) and a resume in a fresh policy give the uninterrupted file: batches
    are fixed slices of the schedule, an interrupted batch is replayed whole, seeds are per (instance, trial,
    turn)."""
    clean = tmp_path / "clean.jsonl"
    _run(setup, BatchSensitivePolicy(), clean, batch_size=4)
    resumed = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        _run(setup, BatchSensitivePolicy(kill_after, resumed), resumed, batch_size=4)
    assert len(read_trajectories(resumed)) >= kill_after
    stats = RolloutStats()
    _run(setup, BatchSensitivePolicy(), resumed, batch_size=4, stats=stats)
    assert resumed.read_bytes() == clean.read_bytes()
    assert stats.replay_mismatches == 0 and stats.episodes == 10 - stats.skipped


def test_episode_seeds_are_keyed_by_instance_trial_and_turn():
    from trace_core.agents.rollout import episode_seed

    seeds = {episode_seed(0, i, t, turn) for i in ("a", "b") for t in (0, 1) for turn in (0, 1, 2)}
    assert len(seeds) == 12
    assert episode_seed(0, "a", 1, 2) == episode_seed(0, "a", 1, 2) != episode_seed(1, "a", 1, 2)
