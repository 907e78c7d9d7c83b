"""The synthesis stage: capability -> template mapping, per-capability folders, calibration logic."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trace_core import cli
from trace_core.config import load_params
from trace_core.schemas import Capability, CapabilityDictionary, CapabilityStats, EnvSpec, Message
from trace_core.synthesis import run
from trace_core.synthesis.calibration import calibrate, group_statistics, ladder, verdict
from trace_core.synthesis.stage import SynthesisError, match_template
from trace_core.synthesis.templates import make
from tests.defaults import PARAMS, calibration_config, default_limits, default_sampling, default_user

STATS = CapabilityStats(runs=1, runs_passed=1, runs_required=1, coverage_mean=0.3, coverage_std=0, delta_mean=0.5,
                        delta_std=0, er_minus_mean=0.6, er_plus_mean=0.1, coverage_ci=(0.2, 0.4), delta_ci=(0.3, 0.7),
                        lacking_failed=3, present_failed=2, lacking_passed=0, present_passed=5)


def cap(cid, definition="", selected=True, name=None):
    return Capability(capability_id=cid, name=name or cid.replace("_", " "), definition=definition, labeller="llm",
                      selected=selected, stats=STATS)


SMALL = {
    "synthesis.harness.seeds": 6, "synthesis.harness.reference_seeds": 2, "synthesis.harness.probe_seeds": 2,
    "synthesis.train_instances": 5, "synthesis.eval_instances": 3,
    "synthesis.calibration.enabled": False,  # whatever params.yaml says: it rolls out the bootstrapped base agent
}


@pytest.fixture
def project(tmp_project: Path) -> Path:
    caps = [
        cap("structured_data_reasoning"),
        cap("argument_formatting", "Emitting tool calls whose arguments have the exact format and type the schema "
            "expects; malformed or imprecise parameters fail."),
        cap("friendly_tone", "Speaking warmly and with empathy to the customer."),
        cap("multi_step_completion", selected=False),
    ]
    d = CapabilityDictionary(target={}, thresholds={}, labellers=["llm"], capabilities=caps,
                             selected=[c.capability_id for c in caps if c.selected])
    folder = tmp_project / "artifacts" / "analysis"
    folder.mkdir(parents=True)
    (folder / "capabilities.json").write_text(d.model_dump_json())
    return tmp_project


def test_mapping_by_params_id_and_definition(project):
    params = load_params(project / "params.yaml", {"synthesis.templates": {"friendly_tone": "identification"}})
    assert match_template(cap("structured_data_reasoning"), params)[:2] == ("structured_data_reasoning", "id")
    assert match_template(cap("friendly_tone"), params)[:2] == ("identification", "params")
    params = load_params(project / "params.yaml")
    t, how, score = match_template(cap("argument_formatting", "tool call arguments in the exact format, precise parameters"), params)
    assert (t, how) == ("tool_call_precision", "definition") and score >= 0.25
    assert match_template(cap("friendly_tone", "warm empathetic words"), params)[0] is None
    with pytest.raises(SynthesisError, match="unknown template"):
        match_template(cap("x"), load_params(project / "params.yaml", {"synthesis.templates": {"x": "nope"}}))


def test_stage_writes_one_folder_per_capability(project, monkeypatch):
    monkeypatch.chdir(project)
    params = load_params(project / "params.yaml", SMALL)
    metrics = run(params, project / "out", progress=False)
    out = project / "out"
    specs = {p.parent.name: EnvSpec.model_validate_json(p.read_text()) for p in out.glob("*/spec.json")}
    assert specs["structured_data_reasoning"].status == "ready"
    assert specs["argument_formatting"].template == "tool_call_precision"
    assert specs["argument_formatting"].matched_by == "definition"
    assert specs["friendly_tone"].status == "unmapped" and "synthesis.templates" in specs["friendly_tone"].reason
    assert specs["multi_step_completion"].status == "not_selected"
    assert metrics["ready"] == 2 and metrics["unmapped"] == 1
    ready = out / "structured_data_reasoning"
    train = [json.loads(x) for x in (ready / "train_manifest.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (ready / "eval_manifest.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in train] == [0, 1, 2, 3, 4] and [r["seed"] for r in held] == [5, 6, 7]
    assert train[0]["instance_id"] == make("structured_data_reasoning").reset(0).instance_id
    report = json.loads((ready / "validation.json").read_text())
    assert report["passed"] and "probe:tool_spam" in (ready / "validation.html").read_text()
    first = (ready / "spec.json").read_bytes()
    run(params, project / "out", capability="structured_data_reasoning", progress=False)
    assert (ready / "spec.json").read_bytes() == first  # same inputs, same spec (and spec_hash)


def test_cli_and_missing_analysis(project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    args = [f"-S{k}={v}" for k, v in SMALL.items()]
    assert cli.main(["synthesis", *args, "--capability", "friendly_tone"]) == 0
    assert "unmapped" in capsys.readouterr().out
    empty = project / "elsewhere"
    empty.mkdir()
    monkeypatch.chdir(empty)
    (empty / "params.yaml").write_text((project / "params.yaml").read_text())
    assert cli.main(["synthesis"]) == 1
    assert "run the analysis stage first" in capsys.readouterr().err


# -- calibration ------------------------------------------------------------------------------------------------
def test_group_statistics_and_verdicts():
    s = group_statistics([[1, 1], [0, 0], [1, 0], [0.5, 0]])
    assert s["mean_reward"] == pytest.approx(3.5 / 8) and s["success_rate"] == 0.375
    assert s["all_success"] == 0.25 and s["all_zero"] == 0.25 and s["informative"] == 0.5
    cfg = calibration_config()
    assert verdict(s, cfg)[0] == "polarized"  # a quarter of the groups all-success and a quarter all-zero
    assert verdict(group_statistics([[0] * 9 + [1]] * 4), cfg)[0] == "too_hard"
    assert verdict(group_statistics([[1, 1, 1, 0]] * 4), cfg)[0] == "too_easy"
    assert verdict(group_statistics([[1, 0, 0, 0.5]] * 4), cfg) == ("ok", [])


def _knob(template="multi_step_completion"):
    return lambda d, s, b=False: make(template, difficulty=d, scaffold=s, blend=b)


def _by_position(p):
    """A rollout whose per-sample success probability depends on the knob position only."""
    def rollout(env, seeds, samples):
        k = round(p[(env.difficulty, env.scaffold)] * samples)
        return [[1.0] * k + [0.0] * (samples - k) for _ in seeds]
    return rollout


def test_calibrate_moves_the_knob_until_the_band():
    rollout = _by_position({(0, 0): 0.9, (1, 0): 0.7, (2, 0): 0.4, (3, 0): 0.1})
    cfg = calibration_config(seeds=4, samples=10)
    d, s, _, ok, tried = calibrate(_knob(), 0, rollout, cfg)
    assert (d, s, ok) == (2, 0, True) and [t["difficulty"] for t in tried] == [0, 1, 2]
    assert all(t["rollouts"] == 40 for t in tried)
    d, s, _, ok, tried = calibrate(_knob(), 3, rollout, cfg)
    assert (d, s, ok) == (2, 0, True) and tried[0]["verdict"] == "too_hard"
    never = calibration_config(seeds=2, samples=4, max_adjustments=1)
    d, s, _, ok, tried = calibrate(_knob(), 0, lambda env, seeds, n: [[1.0] * n for _ in seeds], never)
    assert not ok and len(tried) == 2
    assert tried[-1]["stopped"] == "synthesis.calibration.max_adjustments=1 reached"
    assert all("stopped" not in t for t in tried[:-1])


def test_calibrate_goes_below_difficulty_0_into_scaffolds():
    assert ladder(2, 2) == [(0, 2), (0, 1), (0, 0), (1, 0), (2, 0)]
    # Too hard down to difficulty 0; with two of the look-ups prefilled the agent lands in the band.
    rollout = _by_position({(1, 0): 0.0, (0, 0): 0.0, (0, 1): 0.1, (0, 2): 0.4, (0, 3): 0.8})
    d, s, _, ok, tried = calibrate(_knob("structured_data_reasoning"), 1, rollout,
                                   calibration_config(seeds=4, samples=10))
    assert (d, s, ok) == (0, 2, True)
    assert [(t["difficulty"], t["scaffold"]) for t in tried] == [(1, 0), (0, 0), (0, 1), (0, 2)]
    # A template without scaffolds stops at difficulty 0 and keeps the position closest to the band.
    d, s, _, ok, tried = calibrate(_knob("precondition_verification"), 1, _by_position({(1, 0): 0.0, (0, 0): 0.1}),
                                calibration_config(seeds=4, samples=10))
    assert (d, s, ok) == (0, 0, False) and len(tried) == 2
    assert tried[-1]["stopped"] == "no easier position than d0 (the template has no scaffolds)"
    # Levels at the bottom that would replay the last one tried (here d0p3..d0p5 are made as d0p2) are passed over.
    capped = lambda d, s, b=False: make("structured_data_reasoning", difficulty=d, scaffold=min(s, 2), blend=b)
    d, s, _, ok, tried = calibrate(capped, 1, lambda env, seeds, n: [[0.0] * n for _ in seeds],
                                   calibration_config(seeds=4, samples=2))
    assert [(t["difficulty"], t["scaffold"]) for t in tried] == [(1, 0), (0, 0), (0, 1), (0, 2)] and not ok
    assert tried[-1]["skipped"] == ["d0p3", "d0p4", "d0p5"]
    assert tried[-1]["stopped"] == ("no easier position than d0p2 (the ladder's bottom); d0p3, d0p4, d0p5 passed "
                                    "over: the same instances as d0p2 on every calibration seed")
    # A level in the middle that changes nothing is passed over and the walk goes on (here d0p2 is made as d0p1).
    same = lambda d, s, b=False: make("structured_data_reasoning", difficulty=d, scaffold=1 if s == 2 else s, blend=b)
    d, s, _, ok, tried = calibrate(same, 1, rollout, calibration_config(seeds=4, samples=10))
    assert [(t["difficulty"], t["scaffold"]) for t in tried] == [(1, 0), (0, 0), (0, 1), (0, 3)]
    assert tried[2]["skipped"] == ["d0p2"] and not ok  # d0p3 is too easy, and d0p2 is d0p1 again:
    assert tried[-1]["stopped"] == "the next position, d0p2, makes the same instances as d0p1, tried already"
    # max_adjustments bounds the walk: one move, then the best of the two positions tried.
    d, s, _, ok, tried = calibrate(_knob("structured_data_reasoning"), 1, rollout,
                                calibration_config(seeds=4, samples=10, max_adjustments=1))
    assert not ok and [(t["difficulty"], t["scaffold"]) for t in tried] == [(1, 0), (0, 0)]


def test_polarized_moves_only_while_the_mean_is_outside_the_band():
    # Per seed all-or-nothing (half the groups all-success at difficulty 1, mean 0.75): polarized and too easy on
    # average, so the knob moves up; at difficulty 2 the mean is in the band but the groups are still constant.
    outcomes = {1: [1, 1, 1, 0], 2: [1, 1, 0, 0]}

    def rollout(env, seeds, samples):
        return [[float(outcomes[env.difficulty][i % 4])] * samples for i, _ in enumerate(seeds)]

    d, s, _, ok, tried = calibrate(_knob(), 1, rollout, calibration_config(seeds=4, samples=4))
    assert [(t["difficulty"], t["verdict"]) for t in tried] == [(1, "polarized"), (2, "polarized")]
    assert (d, s, ok) == (2, 0, False)
    assert tried[-1]["stopped"] == "polarized at d2: a verdict that points the knob neither way"


def test_a_bracketed_band_is_tried_with_a_blend_of_the_two_difficulties():
    # Difficulty 1 too easy (0.9), difficulty 2 too hard (0.1): their blend (odd seeds at 2) averages 0.5.
    p = {1: 0.9, 2: 0.1}

    def rollout(env, seeds, samples):
        groups = []
        for seed in seeds:
            k = round(p[env.reset(seed).difficulty] * samples)
            groups.append([1.0] * k + [0.0] * (samples - k))
        return groups

    d, s, blend, ok, tried = calibrate(_knob("tool_call_precision"), 1, rollout,
                                       calibration_config(seeds=4, samples=10))
    assert (d, s, blend, ok) == (1, 0, True, True)
    assert [(t["difficulty"], t["blend"], t["verdict"]) for t in tried] == [
        (1, False, "too_easy"), (2, False, "too_hard"), (1, True, "ok")]
    # no attempt left for the blend: the closer of the two is kept
    d, s, blend, ok, tried = calibrate(_knob("tool_call_precision"), 1, rollout,
                                       calibration_config(seeds=4, samples=10, max_adjustments=1))
    assert not ok and not blend and len(tried) == 2
    assert tried[-1]["stopped"] == "the next position, d1, was tried already"
    # A polarized position whose mean is above the band also moves the knob up: with a too-hard neighbour above it,
    # that is a bracket too, and the blend says which verdicts made it one.
    def polar(env, seeds, samples):
        groups = []
        for i, seed in enumerate(seeds):
            d = env.reset(seed).difficulty
            groups.append([float(i % 4 != 3)] * samples if d == 0 else [0.1] * samples)
        return groups

    d, s, blend, ok, tried = calibrate(_knob("tool_call_precision"), 1, polar, calibration_config(seeds=4, samples=8))
    assert [(t["difficulty"], t["blend"], t["verdict"]) for t in tried] == [
        (1, False, "too_hard"), (0, False, "polarized"), (0, True, "too_easy")]  # 2 of 4 groups all-success
    assert tried[-1]["stopped"] == ("the next position, d1, was tried already; then the blend of d0 (polarized, mean "
                                    "above the band) and d1 (too hard) was tried last")


def test_a_blend_alternates_difficulties_by_seed():
    env = make("tool_call_precision", difficulty=2, blend=True)
    assert [env.reset(s).difficulty for s in range(4)] == [2, 3, 2, 3]
    assert "/d2-3/" in env.reset(0).instance_id
    assert env.reset(1).reference_actions == make("tool_call_precision", difficulty=3).reset(1).reference_actions
    with pytest.raises(ValueError, match="blend"):
        make("tool_call_precision", difficulty=3, blend=True)


class _Refuser:
    """A policy that answers every turn with text and no tool call (scores 0 on write instances)."""

    name = "refuser"

    def generate(self, requests, sampling):
        return [Message(role="assistant", content="I am sorry, I cannot help with that.") for _ in requests]


def test_the_spec_says_whether_and_how_the_base_agent_was_calibrated(project, monkeypatch):
    monkeypatch.chdir(project)
    params = load_params(project / "params.yaml", SMALL)
    run(params, project / "out", capability="structured_data_reasoning", progress=False)
    spec = EnvSpec.model_validate_json((project / "out" / "structured_data_reasoning" / "spec.json").read_text())
    assert spec.status == "ready" and spec.calibrated is None
    assert "not calibrated (synthesis.calibration.enabled is false)" in spec.reason

    cal = {"synthesis.calibration.enabled": True, "synthesis.calibration.seeds": 2, "synthesis.calibration.samples": 2,
           "training.num_generations": 2}
    params = load_params(project / "params.yaml", {**SMALL, **cal})
    run(params, project / "out", capability="structured_data_reasoning", progress=False, policy_factory=_Refuser)
    spec = EnvSpec.model_validate_json((project / "out" / "structured_data_reasoning" / "spec.json").read_text())
    report = json.loads((project / "out" / "structured_data_reasoning" / "validation.json").read_text())
    assert spec.status == "ready" and spec.calibrated is False
    # too hard at 1, at 0, with 1..3 look-ups prefilled, then the template's own rung 4 (6 = 1 + max_adjustments)
    assert [(t["difficulty"], t["scaffold"]) for t in report["calibration"]] == [(1, 0), (0, 0), (0, 1), (0, 2), (0, 3),
                                                                                 (0, 4)]
    assert "outside the calibration band" in spec.reason
    assert "d1 too_hard" in spec.reason and "d0p4 too_hard" in spec.reason
    # the spec itself records every position tried, with its figures (and what a template's own rung removes)
    assert [p["position"] for p in spec.calibration] == ["d1", "d0", "d0p1", "d0p2", "d0p3", "d0p4"]
    assert all(p["verdict"] == "too_hard" and p["mean_reward"] == 0.0 and p["success_rate"] == 0.0
               and p["informative"] == 0.0 and p["rollouts"] == 4 for p in spec.calibration)
    assert "rung" not in spec.calibration[4] and "item id" in spec.calibration[5]["rung"]
    assert spec.difficulty == 1 and spec.scaffold == 0  # all equally far from the band: the first position is kept
    # ... and why: every rollout at every position ended without a tool call
    assert all(t["outcomes"]["kinds"] == {"no_tool_call": 4} for t in report["calibration"])
    assert "rollouts ended: no_tool_call 100%" in spec.reason
    assert spec.reason.endswith("; stopped: synthesis.calibration.max_adjustments=5 reached")
    assert not (project / "out" / "structured_data_reasoning" / "calibration").exists()  # no fingerprint: none kept


class _CountingFactory:
    """A policy factory with a `fingerprint` (so calibration keeps its trajectories) that counts model calls."""

    def __init__(self, fingerprint="agent-1"):
        self.fingerprint, self.calls = fingerprint, 0

    def __call__(self):
        factory = self

        class Counting(_Refuser):
            def generate(self, requests, sampling):
                factory.calls += len(requests)
                return super().generate(requests, sampling)

        return Counting()


def test_calibration_keeps_its_trajectories_and_resumes_from_them(project, monkeypatch):
    monkeypatch.chdir(project)
    cal = {"synthesis.calibration.enabled": True, "synthesis.calibration.seeds": 2, "synthesis.calibration.samples": 2,
           "training.num_generations": 2,
           "synthesis.calibration.max_adjustments": 1}
    params = load_params(project / "params.yaml", {**SMALL, **cal})
    folder = project / "out" / "structured_data_reasoning" / "calibration"
    factory = _CountingFactory()
    run(params, project / "out", capability="structured_data_reasoning", progress=False, policy_factory=factory)
    assert sorted(p.name for p in folder.iterdir()) == ["d0.jsonl", "d1.jsonl", "run_key.txt"]
    assert len((folder / "d1.jsonl").read_text().splitlines()) == 4 and factory.calls > 0
    report = (project / "out" / "structured_data_reasoning" / "validation.json").read_text()

    again = _CountingFactory()  # same agent, same settings: every rollout is read back, none is replayed
    run(params, project / "out", capability="structured_data_reasoning", progress=False, policy_factory=again)
    assert again.calls == 0
    assert (project / "out" / "structured_data_reasoning" / "validation.json").read_text() == report

    # Played into the resume folder (outside the DVC output, which `dvc exp run` restores to its dvc.lock version
    # first) and copied into the environment's folder when done: either copy alone is enough to replay nothing.
    from trace_core.runs import resume_dir

    resume = resume_dir(project / "out" / "structured_data_reasoning") / "calibration"
    assert sorted(p.name for p in resume.iterdir()) == sorted(p.name for p in folder.iterdir())
    for lost in (folder, resume):
        shutil.rmtree(lost)
        kept = _CountingFactory()
        run(params, project / "out", capability="structured_data_reasoning", progress=False, policy_factory=kept)
        assert kept.calls == 0 and (folder / "d1.jsonl").exists() and (resume / "d1.jsonl").exists()

    other = _CountingFactory("agent-2")  # other weights: the old trajectories are dropped and the positions replayed
    run(params, project / "out", capability="structured_data_reasoning", progress=False, policy_factory=other)
    assert other.calls == factory.calls
    assert (folder / "run_key.txt").read_text() != ""

    off = load_params(project / "params.yaml", SMALL)  # calibration off: nothing stale is left behind
    run(off, project / "out", capability="structured_data_reasoning", progress=False)
    assert not folder.exists()


def test_outcomes_say_which_argument_of_a_write_was_wrong():
    from trace_core.envs.tau2_env import write_tools
    from trace_core.schemas import ToolCall, Trajectory
    from trace_core.synthesis.calibration import outcomes, summary

    env = make("structured_data_reasoning")
    inst = env.reset(3)
    writes = write_tools("retail")
    ref = [a for a in inst.reference_actions if a.name in writes]
    assert len(ref) == 1

    def traj(calls, reward=0.0, end="agent_stop"):
        msgs = [Message(role="user", content="hi")]
        for k, (name, args) in enumerate(calls):
            msgs.append(Message(role="assistant", tool_calls=[ToolCall(id=f"c{k}", name=name, arguments=args)]))
            msgs.append(Message(role="tool", tool_call_id=f"c{k}", name=name, content="{}"))
        return Trajectory(trajectory_id=str(len(msgs)), instance_id=inst.instance_id, domain="retail", family="x",
                          source="synthetic", messages=msgs, termination_reason=end, reward=reward)

    bad = {**ref[0].arguments, "new_item_ids": ["0000000000"]}
    trajs = [
        traj([(a.name, a.arguments) for a in inst.reference_actions], reward=1.0),
        traj([(ref[0].name, bad)]),
        traj([("get_user_details", {"user_id": "x"})]),
        traj([]),
        traj([(a.name, a.arguments) for a in inst.reference_actions], end="max_steps"),
    ]
    out = outcomes([inst], trajs, writes)
    assert out["kinds"] == {"solved": 1, "wrong_write": 1, "no_write": 1, "no_tool_call": 1, "not_finished:max_steps": 1}
    assert out["wrong_arguments"] == {"new_item_ids": 1}
    assert out["termination"] == {"agent_stop": 4, "max_steps": 1}
    line = summary(out, len(trajs))
    assert line.startswith("solved 20%") and "wrong_write 20% (wrong: new_item_ids 1)" in line


def test_the_position_calibration_chose_is_validated_and_kept_in_the_spec(project, monkeypatch):
    import trace_core.synthesis.stage as stage

    monkeypatch.chdir(project)
    record = {"difficulty": 0, "scaffold": 2, "verdict": "ok", "reasons": [], "rollouts": 4, "mean_reward": 0.4}
    monkeypatch.setattr(stage, "_calibrate", lambda *a, **k: (0, 2, False, True, [record]))
    cal = {"synthesis.calibration.enabled": True}
    run(load_params(project / "params.yaml", {**SMALL, **cal}), project / "out", capability="structured_data_reasoning",
        progress=False, policy_factory=_Refuser)
    folder = project / "out" / "structured_data_reasoning"
    spec = EnvSpec.model_validate_json((folder / "spec.json").read_text())
    report = json.loads((folder / "validation.json").read_text())
    assert (spec.difficulty, spec.scaffold, spec.calibrated) == (0, 2, True) and "band at d0p2" in spec.reason
    assert spec.calibration == [{"position": "d0p2", "verdict": "ok", "mean_reward": 0.4, "rollouts": 4}]
    assert (report["difficulty"], report["scaffold"]) == (0, 2) and report["passed"]  # the harness ran on d0p2
    first = json.loads((folder / "train_manifest.jsonl").read_text().splitlines()[0])
    assert "/d0p2/" in first["instance_id"]


def test_calibration_hints_the_share_training_will(project):
    """With hint_fraction, that share of each group sees the hint in its system prompt, as GRPO's groups will, and
    the record says how hinted and un-hinted rollouts did. Here only hinted rollouts answer at all."""
    from trace_core.synthesis.calibration import PolicyRollout

    class HintReader:
        name = "hint-reader"

        def generate(self, requests, sampling):
            out = []
            for messages, _tools in requests:
                hinted = "Expert guidance" in (messages[0].content or "")
                out.append(Message(role="assistant", content="Done. ###STOP###" if hinted else "Sorry."))
            return out

    env = make("precondition_verification", difficulty=1)
    users = []  # the caller's user plays every rollout (the stage passes params.user's)

    def make_user():
        users.append(default_user())
        return users[-1]

    rollout = PolicyRollout(HintReader(), default_sampling(temperature=0.7), default_limits(max_steps=3),
                            make_user=make_user, batch_size=PARAMS.policy.batch_size, hint_fraction=0.5)
    groups = rollout(env, [0, 1, 2], 4)
    assert [len(g) for g in groups] == [4, 4, 4] and len(users) == 12
    record = rollout.describe(env)
    assert record["hinted"]["rollouts"] == 6
    assert record["outcomes"]["termination"].get("agent_stop") == 6  # exactly the hinted half stopped itself
    with pytest.raises(ValueError, match="hint_fraction"):
        load_params(project / "params.yaml", {"synthesis.calibration.enabled": True,
                                              "synthesis.calibration.hint_fraction": 0.25})
    both = {"synthesis.calibration.hint_fraction": 0.25, "training.hint_fraction": 0.25}
    assert load_params(project / "params.yaml", both).synthesis.calibration.hint_fraction == 0.25
    # calibration's groups are GRPO's groups: as many samples per seed as training.num_generations
    with pytest.raises(ValueError, match="samples=4 differs from training.num_generations=8"):
        load_params(project / "params.yaml", {"synthesis.calibration.enabled": True, "synthesis.calibration.samples": 4,
                                              "training.num_generations": 8})


def test_a_rejected_generated_module_records_the_real_reason(project, monkeypatch):
    """Issue #35 item 6: the spec says why the generation agent's modules were rejected, not that no endpoint is
    configured (one is)."""
    from trace_core.agents.server import ChatServer

    monkeypatch.chdir(project)
    reply = "```python\nimport os\n\ndef generate(seed, difficulty, db):\n    return {}\n```"
    with ChatServer(lambda messages: reply, model_name="scripted") as server:
        params = load_params(project / "params.yaml", {**SMALL, "synthesis.generator.base_url": server.base_url,
                                                        "synthesis.generator.model": "scripted",
                                                        "synthesis.generator.max_attempts": 2})
        run(params, project / "out", capability="friendly_tone", progress=False)
    folder = project / "out" / "friendly_tone"
    spec = EnvSpec.model_validate_json((folder / "spec.json").read_text())
    assert spec.status == "rejected" and spec.source == "generated"
    assert "no generator endpoint" not in spec.reason
    assert "2 attempts" in spec.reason and "static stage" in spec.reason and "`import os` is not allowed" in spec.reason
    assert json.loads((folder / "generation.json").read_text())["ok"] is False


def test_chosen_positions_are_measured_without_walking_the_ladder(project, monkeypatch, capsys):
    """bench/calibration_positions.py: calibration's record for each position named, in the order named, with the
    trajectories kept and the table printed."""
    import importlib.util

    from trace_core.synthesis import stage
    from trace_core.synthesis.contract import parse_label

    monkeypatch.chdir(project)
    monkeypatch.setattr(stage, "BaseAgentFactory", lambda params: _Refuser)
    path = Path(__file__).resolve().parents[2] / "bench" / "calibration_positions.py"
    spec = importlib.util.spec_from_file_location("calibration_positions", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    small = ["-S", "synthesis.calibration.seeds=2", "-S", "synthesis.calibration.samples=2",
             "-S", "training.num_generations=2"]
    records = bench.main(["multi_step_completion", "d0p4", "d0p3", "--params", str(project / "params.yaml"),
                          "--out", str(project / "cal"), *small])
    assert [(r["difficulty"], r["scaffold"], r["blend"]) for r in records] == [(0, 4, False), (0, 3, False)]
    assert all(r["verdict"] == "too_hard" and r["rollouts"] == 4 and r["outcomes"]["kinds"] == {"no_tool_call": 4}
               for r in records)
    assert "| d0p4 | too_hard | 0.000 | 0.000 | 0% | 0% | 100% | 0.000 |" in capsys.readouterr().out
    folder = project / "cal" / "multi_step_completion"
    assert len((folder / "d0p4.jsonl").read_text().splitlines()) == 4
    assert json.loads((folder / "positions.json").read_text())[1]["scaffold"] == 3
    assert parse_label("d2-3") == (2, 0, True) and parse_label("d0p4") == (0, 4, False)
    for bad in ("d0p", "d1-3", "d0p1-1", "p2"):
        with pytest.raises(ValueError, match="not a knob position"):
            parse_label(bad)
