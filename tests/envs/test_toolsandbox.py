"""The ToolSandbox target (optional extra: `bash scripts/install.sh --toolsandbox`); skipped without it."""

from __future__ import annotations

import pytest

pytest.importorskip("tool_sandbox", reason="ToolSandbox extra not installed (bash scripts/install.sh --toolsandbox)")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trace_core.envs.base import EpisodeLimits  # noqa: E402
from trace_core.envs.toolsandbox import (  # noqa: E402
    ToolSandboxEnvironment,
    ToolSandboxUser,
    llm_user,
    offline_counts,
    scenario_instance,
    scenario_instances,
)
from trace_core.envs.toolsandbox_plans import do_nothing, play_plan, reference_plan  # noqa: E402
from trace_core.schemas import Message, ToolCall  # noqa: E402
from tests.defaults import PARAMS, default_limits, harness_config


@pytest.fixture(scope="module")
def env():
    return ToolSandboxEnvironment(PARAMS.env.profile)


def _call(name, **arguments):
    return Message(role="assistant", tool_calls=[ToolCall(id="c1", name=name, arguments=arguments)])


def test_scenario_counts_offline_and_network():
    # 129 base scenarios x 8 augmentations; 28 base scenarios need RapidAPI tools.
    assert offline_counts() == {"total": 1032, "offline": 808, "network": 224, "network_base": 28}


def test_instance_fields_and_scrambled_schemas(env):
    plain = scenario_instance("wifi_off")
    assert plain.instance_id == "toolsandbox/wifi_off" and plain.source == "toolsandbox"
    assert plain.family == "single_tool_call" and plain.meta["augmentation"] == "none" and plain.meta["offline"]
    assert plain.opening == "Turn off wifi" and plain.user_goal == "Turn off wifi"
    names = [t["function"]["name"] for t in env.tool_schemas(plain)]
    assert names == ["set_wifi_status"]
    scrambled = scenario_instance("wifi_off_3_distraction_tools_tool_name_scrambled")
    assert scrambled.meta["augmentation"] == "3_distraction_tools_tool_name_scrambled"
    schemas = env.tool_schemas(scrambled)
    assert len(schemas) == 4 and all(s["type"] == "function" for s in schemas)
    assert "set_wifi_status" not in {s["function"]["name"] for s in schemas}
    assert env.agent_tool_name(scrambled, "set_wifi_status") in {s["function"]["name"] for s in schemas}
    assert not scenario_instance("find_temperature").meta["offline"]


def test_tool_errors_and_unknown_tools_are_observations(env):
    inst = scenario_instance("wifi_off")
    ep = env.start(inst, ToolSandboxUser(max_turns=PARAMS.user.max_turns), EpisodeLimits(max_steps=6, max_errors=10))
    out = ep.step(_call("no_such_tool"))
    assert out.observations[0].error and "unknown tool" in out.observations[0].content
    out = ep.step(_call("set_wifi_status", on="sideways", extra=1))
    assert out.observations[0].error and out.observations[0].content
    out = ep.step(_call("set_wifi_status", on=False))
    assert not out.observations[0].error


def test_episodes_have_separate_execution_contexts(env):
    # ToolSandbox keeps its world state in a process-global context: two interleaved episodes must not share it.
    inst = scenario_instance("get_wifi")
    a = env.start(inst, ToolSandboxUser(max_turns=PARAMS.user.max_turns), default_limits())
    b = env.start(scenario_instance("wifi_off"), ToolSandboxUser(max_turns=PARAMS.user.max_turns), default_limits())
    b.step(_call("set_wifi_status", on=False))
    assert a.step(_call("get_wifi_status")).observations[0].content == "True"
    assert b.step(_call("set_wifi_status", on=True)).observations[0].error is False


def test_score_is_the_evaluator_similarity(env):
    inst = scenario_instance("wifi_off")
    ep = env.start(inst, ToolSandboxUser(max_turns=PARAMS.user.max_turns), default_limits())
    ep.step(_call("set_wifi_status", on=False))
    ep.step(Message(role="assistant", content="Wifi is turned off"))
    assert ep.done and ep.termination_reason == "user_stop"
    r = ep.score()
    assert r.reward == 1.0 and r.info["perfect"] and r.components["minefield_similarity"] == 0.0
    # Half of the milestones: the state change without telling the user.
    ep = env.start(inst, ToolSandboxUser(max_turns=PARAMS.user.max_turns), default_limits())
    ep.step(_call("set_wifi_status", on=False))
    ep.step(Message(role="assistant", content="Okay."))
    assert ep.score().reward == pytest.approx(0.5, abs=0.1)


def test_scripted_user_answers_from_the_task_once_then_ends():
    inst = scenario_instance("search_phone_number_with_name")
    user = ToolSandboxUser(max_turns=PARAMS.user.max_turns)
    msgs = [user.opening(inst), Message(role="assistant", content="Whose number?")]
    first = user.respond(inst, msgs)
    assert first.content == inst.user_goal and "Homer S" in first.content
    msgs += [first, Message(role="assistant", content="Which Homer?")]
    assert "###STOP###" in user.respond(inst, msgs).content


def test_llm_user_uses_toolsandbox_instruction():
    seen = []
    user = llm_user(lambda convo: seen.append(convo) or "Turn it off please")
    inst = scenario_instance("wifi_off")
    user.respond(inst, [user.opening(inst), Message(role="assistant", content="What should I do?")])
    system = seen[0][0]["content"]
    assert "role play as a user" in system and "Turn off wifi" in system


# A slice of the oracle sweep for the default suite: each category, a state dependency, a result-dependent
# milestone (days till a holiday), a contact update, a reminder, and two augmentations.
SMOKE = [
    "wifi_off", "search_phone_number_with_name", "remove_contact_by_phone",
    "find_days_till_holiday_wifi_off", "add_reminder_content_and_date_and_time",
    "send_message_with_contact_content_cellular_off_multiple_user_turn",
    "remove_contact_by_phone_no_remove_contact_insufficient_information",
    "modify_reminder_with_recency_latest_3_distraction_tools_tool_name_scrambled",
]


@pytest.mark.parametrize("name", SMOKE)
def test_oracle_scores_one_on_smoke_slice(env, name):
    inst = scenario_instance(name)
    assert inst.meta["reference_plan"], f"{name} has no reference plan"
    assert play_plan(env, inst).score().reward == 1.0


@pytest.mark.parametrize("name", ["find_days_till_holiday", "find_days_till_holiday_3_distraction_tools_tool_name_scrambled"])
def test_a_score_computed_later_sees_the_clock_the_episode_saw(env, name):
    """The score replays the episode's tool calls; a clock read must give the time the agent saw (ToolSandbox
    compares the agent's later timestamp_diff argument with it within 1 s), not the time of the replay."""
    import datetime as real_datetime
    import time

    import tool_sandbox.tools.utilities as utilities

    ep = play_plan(env, scenario_instance(name))
    time.sleep(1.5)
    assert ep.score().reward == 1.0
    assert utilities.datetime is real_datetime  # the replay's clock is put back


def test_analysis_finds_the_successes_doing_nothing_also_gets(env):
    from trace_core.analysis.base import Item
    from trace_core.analysis.stage import vacuous_successes

    empty = scenario_instance("find_days_till_holiday_insufficient_information")  # no milestones
    real = scenario_instance("wifi_off")
    items = [Item(ep.trajectory(policy="scripted"), inst) for ep, inst in [
        (do_nothing(env, empty), empty), (play_plan(env, real), real), (do_nothing(env, real), real)]]
    assert [i.trajectory.success for i in items] == [True, True, False]
    assert vacuous_successes(items) == {empty.instance_id}


def test_do_nothing_scores_one_only_without_milestones(env):
    assert do_nothing(env, scenario_instance("find_days_till_holiday_insufficient_information")).score().reward == 1.0
    assert do_nothing(env, scenario_instance("wifi_off")).score().reward == 0.0


def test_every_offline_base_scenario_has_a_plan():
    bases = {i.meta["base_scenario"] for i in scenario_instances(offline_only=True)}
    assert len(bases) == 101 and all(reference_plan(b) is not None for b in bases)


_text = st.text(max_size=40)
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _text,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(_text, st.sampled_from(["set_wifi_status", "search_contacts", "add_reminder"])),
       arguments=st.dictionaries(_text, _json, max_size=4), text=_text)
def test_tool_call_path_never_raises(env, name, arguments, text):
    inst = scenario_instance("wifi_off_all_tools")
    ep = env.start(inst, ToolSandboxUser(max_turns=PARAMS.user.max_turns), EpisodeLimits(max_steps=3, max_errors=10))
    ep.step(Message(role="assistant", tool_calls=[ToolCall(id=text, name=name, arguments=arguments)]))
    if not ep.done:
        ep.step(Message(role="assistant", content=text))
    while not ep.done:
        ep.step(Message(role="assistant", content="bye"))
    r = ep.score()
    assert 0.0 <= r.reward <= 1.0


@pytest.mark.slow
def test_oracle_sweep_over_all_offline_scenarios():
    from trace_core.envs.toolsandbox_plans import sweep

    rows = sweep(scenario_instances(offline_only=True))
    perfect = [r for r in rows if r["oracle"] == 1.0]
    assert len(rows) == 808 and len(perfect) >= 0.95 * len(rows), [r for r in rows if r not in perfect][:5]


def test_splits_are_disjoint_by_base_scenario_and_sampled_per_family():
    from trace_core.envs.toolsandbox import split_instances

    train, test = split_instances("train", None, 0), split_instances("test", None, 0)
    assert len(train) + len(test) == 808
    assert not {i.meta["base_scenario"] for i in train} & {i.meta["base_scenario"] for i in test}
    # Nor by content: two base scenarios with the same request and plan (find_current_city_insufficient_information
    # and its low-battery twin) used to fall in different halves, so the evaluation refused the run whenever the
    # baseline had sampled one and the evaluation the other.
    from trace_core.inputs import task_key

    assert not {task_key(i) for i in train} & {task_key(i) for i in test}
    picked = split_instances("test", per_family=2, seed=0)
    assert picked == split_instances("test", per_family=2, seed=0)
    assert all(sum(1 for i in picked if i.family == f) <= 2 for f in {i.family for i in picked})


def test_params_select_the_toolsandbox_target(tmp_path):
    from trace_core.baseline import make_user, target_instances
    from trace_core.config import load_params
    from trace_core.envs.targets import target_env

    over = {"env.domain": "toolsandbox", "baseline.source": "toolsandbox", "evaluation.source": "toolsandbox",
            "baseline.tau2_split": "train", "evaluation.tau2_split": "test", "baseline.instances_per_family": 1}
    params = load_params("params.yaml", over)
    assert isinstance(target_env(params.env.domain, params.env.profile), ToolSandboxEnvironment)
    assert isinstance(make_user(params)(), ToolSandboxUser)
    insts = target_instances(params)
    assert len(insts) == len({i.family for i in insts}) and all(i.source == "toolsandbox" for i in insts)
    with pytest.raises(ValueError, match="baseline.source") as refused:
        load_params("params.yaml", {**over, "baseline.source": "procedural"})
    import os
    import re

    named = re.search(r"(profiles/[\w.]+\w)", str(refused.value)).group(1)  # the profile the error points to exists
    assert os.path.isfile(named), named
    with pytest.raises(ValueError, match="tau2_split"):
        load_params("params.yaml", {**over, "evaluation.tau2_split": "train"})
    from pathlib import Path

    from trace_core.cli import parse_overrides

    lines = Path("profiles/toolsandbox.overrides").read_text().splitlines()
    profile = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    params = load_params("params.yaml", parse_overrides(profile))  # as `-S` applies the profile
    assert params.env.domain == "toolsandbox"


def test_programmatic_labeller_reads_toolsandbox_trajectories(env):
    from trace_core.analysis.programmatic import ProgrammaticLabeller

    labeller = ProgrammaticLabeller.for_domain("toolsandbox")
    inst = scenario_instance("send_message_with_contact_content_cellular_off_3_distraction_tools_tool_name_scrambled")
    good = play_plan(env, inst).trajectory()
    bad = do_nothing(env, inst).trajectory()
    good_labels, bad_labels = labeller.judge(good, inst), labeller.judge(bad, inst)
    assert "LACKING" not in {v[0] for v in good_labels.values()}, good_labels
    assert bad_labels["multi_step_completion"][0] == "LACKING"


@pytest.mark.slow
@pytest.mark.parametrize("template", ["toolsandbox_tool_call_precision", "toolsandbox_precondition_verification"])
def test_toolsandbox_templates_pass_the_harness(template):
    from trace_core.synthesis.harness import validate
    from trace_core.synthesis.templates import make

    env = make(template, None, 1)
    assert env.domain == "toolsandbox"
    report = validate(env, harness_config(seeds=20, reference_seeds=4, probe_seeds=4, min_distinct=0.9,
                                         max_probe_reward=0.2, max_probe_success=0.1, train_instances=0,
                                         eval_instances=0))
    assert not [c for c in report.checks if not c.passed], [(c.name, c.detail) for c in report.checks if not c.passed]


def test_synthesis_picks_toolsandbox_templates_on_that_target():
    from tests.synthesis.test_stage import cap as _cap
    from trace_core.config import load_params
    from trace_core.synthesis.stage import match_template

    over = {"env.domain": "toolsandbox", "baseline.source": "toolsandbox", "evaluation.source": "toolsandbox",
            "baseline.tau2_split": "train", "evaluation.tau2_split": "test"}
    params = load_params("params.yaml", over)
    for cid, want in [("tool_call_precision", "toolsandbox_tool_call_precision"),
                      ("precondition_verification", "toolsandbox_precondition_verification")]:
        assert match_template(_cap(cid), params)[0] == want
    assert match_template(_cap("tool_call_precision"), load_params("params.yaml"))[0] == "tool_call_precision"


def test_generated_scenario_scores_with_toolsandbox_evaluator(env):
    from trace_core.synthesis.templates import make

    syn = make("toolsandbox_precondition_verification", None, 1)
    inst = syn.reset(3)
    # the plain target environment rebuilds the generated scenario
    ep = env.start(inst, ToolSandboxUser(max_turns=PARAMS.user.max_turns), default_limits())
    send = inst.reference_actions[-1]
    assert ep.step(_call(send.name, **send.arguments)).observations[0].error  # cellular is off
    for action in inst.reference_actions:
        ep.step(_call(action.name, **action.arguments))
    ep.step(Message(role="assistant", content="Sent."))
    assert env.score(inst, ep.messages, ep.termination_reason).reward == 1.0
