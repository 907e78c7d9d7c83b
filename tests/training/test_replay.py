"""bench/replay.py: the seeds it picks from an eval.json and the words it counts episodes by (the model-free parts;
playing the seeds is the training stage's `play_greedy`, tested there)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trace_core.envs.targets import write_tools
from trace_core.schemas import Message, ToolCall, Trajectory
from trace_core.synthesis.templates.precondition_verification import PreconditionVerification

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location("bench_replay", ROOT / "bench" / "replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _episode(instance, *turns: list[tuple[str, dict]]) -> Trajectory:
    messages = [Message(role="user", content="hi")]
    for i, calls in enumerate(turns):
        messages.append(Message(role="assistant", content=None if calls else "All done.",
                                tool_calls=[ToolCall(id=f"c{i}_{j}", name=n, arguments=a)
                                            for j, (n, a) in enumerate(calls)] or None))
    return Trajectory(trajectory_id="t", instance_id=instance.instance_id, domain="retail", family="f",
                      source="synthetic", seed=instance.seed, messages=messages, termination_reason="agent_stop")


def test_outcomes_name_what_the_agent_did(replay):
    env = PreconditionVerification(None, 0, "default")
    instances = [env.reset(seed) for seed in range(40)]
    allowed = next(i for i in instances if not i.must_refuse)
    refuse = next(i for i in instances if i.must_refuse)
    writes = set(write_tools("retail"))
    reads = [(a.name, a.arguments) for a in allowed.reference_actions if a.name not in writes]
    write = next((a.name, dict(a.arguments)) for a in allowed.reference_actions if a.name in writes)
    dropped = (write[0], {k: v for k, v in write[1].items() if k != sorted(write[1])[-1]})
    wrong = (write[0], {**write[1], sorted(write[1])[-1]: "something else"})
    cases = {
        "no tool call": (allowed, [[]]),
        "no write": (allowed, [reads, []]),
        "reference writes": (allowed, [reads, [write], []]),
        "write missing an argument": (allowed, [[dropped], []]),
        "write with a wrong argument": (allowed, [[wrong], []]),
        "write of another tool": (allowed, [[("modify_user_address", {"user_id": "x"})], []]),
        "refused after reads": (refuse, [[(a.name, a.arguments) for a in refuse.reference_actions], []]),
        "wrote where it had to refuse": (refuse, [[write], []]),
    }
    for expected, (instance, turns) in cases.items():
        episode = _episode(instance, *turns)
        assert replay.outcome(instance, episode, writes) == expected, expected
        lines = replay.describe(instance.seed, instance, episode, writes)
        assert lines[0].startswith(f"seed {instance.seed}: ") and expected in lines[0] and lines[1].startswith("  reference writes: ")


def test_recorded_episodes_are_read_back_by_seed(replay, tmp_path):
    env = PreconditionVerification(None, 0, "default")
    episodes = [_episode(env.reset(seed), [], []) for seed in (300, 7)]
    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(e.to_row()) + "\n" for e in episodes))
    recorded = replay.read_recorded(path)
    assert sorted(recorded) == [7, 300] and recorded[300] == episodes[0]


def test_seeds_come_from_a_list_or_an_eval_json(replay, tmp_path):
    rows = [{"seed": 1, "base_success": True, "adapter_success": False},
            {"seed": 2, "base_success": False, "adapter_success": True},
            {"seed": 3, "base_success": True, "adapter_success": True}]
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"per_seed": rows}))
    assert replay.pick_seeds("lost", path) == [1]
    assert replay.pick_seeds("won", path) == [2]
    assert replay.pick_seeds("changed", path) == [1, 2]
    assert replay.pick_seeds("7, 9", None) == [7, 9]
    with pytest.raises(SystemExit, match="needs an eval.json"):
        replay.pick_seeds("lost", tmp_path / "missing.json")
    with pytest.raises(SystemExit, match="comma-separated integers"):
        replay.pick_seeds("seven", None)


def test_replay_command_line_help():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "replay.py"), "--help"], capture_output=True,
                          text=True, check=True)
    for flag in ("--capability", "--seeds", "--adapter", "--eval-json", "--out", "--from-file", "--base-model", "-S"):
        assert flag in done.stdout
