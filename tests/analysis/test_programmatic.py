"""The programmatic path on trajectories with deficits injected on purpose.

Scripted agents replay the reference actions of procedural instances in the real τ² retail environment, some with
one deliberate deficit (drop the second write, pick the wrong variant, write on a request the policy forbids,
mangle the arguments of a write), mixed with correct agents. The analysis must select exactly the injected
capabilities and reject every other one, including the controls, for several seeds."""

from __future__ import annotations

import functools

import pytest

from trace_core.analysis.base import Item
from trace_core.analysis.controls import ControlLabeller
from trace_core.analysis.programmatic import ProgrammaticLabeller, extract_calls
from trace_core.analysis.stage import build_dictionary
from trace_core.analysis.stats import Thresholds
from trace_core.envs.oracle import replay_reference
from trace_core.envs.procedural import _retail as R
from trace_core.envs.procedural import generate
from trace_core.schemas import Action, Message, ToolCall, Trajectory
from tests.defaults import PARAMS

EXAMPLES = PARAMS.analysis.max_examples  # example task ids kept per capability (params.yaml)

TH = Thresholds(rho=0.10, delta=0.20, k=8, n=10, bootstrap_samples=200, ci=PARAMS.analysis.ci)
SEEDS = (11, 12, 13)


@functools.lru_cache(maxsize=1)
def env():
    from trace_core.envs.tau2_env import Tau2Environment

    return Tau2Environment("retail", "compact")


@functools.lru_cache(maxsize=1)
def labeller():
    return ProgrammaticLabeller.for_domain("retail")


# -- deficits --------------------------------------------------------------------------------------------------
def drop_second_write(inst):
    writes = [i for i, a in enumerate(inst.reference_actions) if a.name in R.WRITE_TOOLS]
    return [a for i, a in enumerate(inst.reference_actions) if i != writes[1]]


def wrong_variant(inst):
    out = []
    for a in inst.reference_actions:
        if "new_item_ids" in a.arguments:
            product = next(r.arguments["product_id"] for r in inst.reference_actions if r.name == "get_product_details")
            right = a.arguments["new_item_ids"][0]
            others = sorted(v for v in R.db().products[product].variants if v not in (right, *a.arguments["item_ids"]))
            a = Action(name=a.name, arguments={**a.arguments, "new_item_ids": [others[0]]})
        out.append(a)
    return out


def ignore_precondition(inst):
    """Do the checks, then cancel the order anyway (the request is one the policy forbids)."""
    forbidden = Action(name="cancel_pending_order", arguments={"order_id": inst.meta["order_id"], "reason": "no longer needed"})
    return [*inst.reference_actions, forbidden]


def mangle_arguments(inst):
    """Break the write's arguments in one of three ways: id formatting, a renamed key, a missing key."""
    out = []
    for a in inst.reference_actions:
        if a.name in R.WRITE_TOOLS:
            args = dict(a.arguments)
            key = next(iter(args))
            how = inst.index % 3
            if how == 0:
                args[key] = str(args[key]).upper().lstrip("#")
            elif how == 1:
                args[key + "_id" if not key.endswith("_id") else key.replace("_id", "Id")] = args.pop(key)
            else:
                args.pop(key)
            a = Action(name=a.name, arguments=args)
        out.append(a)
    return out


INJECTED = {
    "multi_step_completion": ("compound", 1, drop_second_write),
    "structured_data_reasoning": ("variant_choice", 1, wrong_variant),
    "precondition_verification": ("policy_refusal", 3, ignore_precondition),
    "tool_call_precision": ("identify_then_act", 1, mangle_arguments),
}


def _refusable(inst) -> bool:
    return inst.must_refuse and "cancel_pending_order" in (inst.tool_subset or []) and inst.meta.get("order_status") == "pending"


def _instances(family: str, difficulty: int, seed: int, n: int, keep=lambda i: True):
    out, index = [], 0
    while len(out) < n:
        inst = generate(family, seed, index, difficulty)
        index += 1
        if keep(inst):
            out.append(inst)
    return out


def _episode(inst, actions=None, tag="ok") -> Item:
    ep = replay_reference(env(), inst, actions=actions)
    result = ep.score()
    traj = ep.trajectory(policy=f"scripted:{tag}")
    traj = traj.model_copy(update={"trajectory_id": f"{inst.instance_id}#{tag}", "reward": result.reward, "success": result.reward >= 1 - 1e-6})
    return Item(traj, inst)


@functools.cache
def population(seed: int) -> dict[str, list[Item]]:
    """Per injected capability: 4 episodes with the deficit; plus "correct": correct agents on every family."""
    pop: dict[str, list[Item]] = {"correct": []}
    for cid, (family, difficulty, deficit) in INJECTED.items():
        keep = _refusable if cid == "precondition_verification" else (lambda i: True)
        insts = _instances(family, difficulty, seed, 7, keep)
        pop[cid] = [_episode(i, deficit(i), tag=cid) for i in insts[:4]]
        pop["correct"] += [_episode(i) for i in insts[4:]]
    pop["correct"] += [_episode(i) for i in _instances("single_write", 1, seed, 3)]
    return pop


def analyse(items):
    sets = [labeller().label(items), ControlLabeller(n_runs=10, seed=0).label(items)]
    return build_dictionary(items, sets, TH, EXAMPLES, within_family=False)[0]


# -- tests -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_deficits_cause_failures_and_correct_agents_succeed(seed):
    pop = population(seed)
    assert all(item.trajectory.success for item in pop["correct"])
    for cid in INJECTED:
        assert not any(item.trajectory.success for item in pop[cid]), cid


@pytest.mark.parametrize("seed", SEEDS)
def test_selects_exactly_the_injected_capabilities(seed):
    pop = population(seed)
    items = [item for group in pop.values() for item in group]
    d = analyse(items)
    assert set(d.selected) == set(INJECTED), {c.capability_id: (c.stats.coverage_mean, c.stats.delta_mean) for c in d.capabilities}
    for c in d.capabilities:
        if c.capability_id in INJECTED:
            assert c.stats.delta_mean >= TH.delta and c.stats.coverage_mean >= 0.2 and c.stats.er_plus_mean == 0
            assert set(c.example_failed_task_ids) <= {i.task_id for i in pop[c.capability_id]}
    assert not d.warnings


@pytest.mark.parametrize("cid", sorted(INJECTED))
def test_each_deficit_alone_selects_only_itself(cid):
    pop = population(SEEDS[0])
    d = analyse(pop["correct"] + pop[cid])
    assert d.selected == [cid]


def test_detector_reasons_name_the_evidence():
    pop = population(SEEDS[0])
    notes = {cid: labeller().judge(pop[cid][0].trajectory, pop[cid][0].instance)[cid] for cid in INJECTED}
    assert all(label == "LACKING" for label, _ in notes.values())
    assert "required writes attempted" in notes["multi_step_completion"][1]
    assert "the data said" in notes["structured_data_reasoning"][1]
    assert "forbids" in notes["precondition_verification"][1]


def _traj(messages, success=False):
    return Trajectory(trajectory_id="t", instance_id="i", domain="retail", family="x", source="procedural",
                      messages=messages, termination_reason="agent_stop", success=success)


def test_precision_split_between_formatting_and_data():
    inst = generate("variant_choice", 0, 0, 1)
    write = next(a for a in inst.reference_actions if a.name in R.WRITE_TOOLS)
    lab = labeller()

    def run_with(args, seen_text):
        msgs = [Message(role="user", content=inst.opening)]
        for j, a in enumerate(inst.reference_actions[:-1]):
            msgs.append(Message(role="assistant", tool_calls=[ToolCall(id=f"c{j}", name=a.name, arguments=a.arguments)]))
            msgs.append(Message(role="tool", tool_call_id=f"c{j}", name=a.name, content=seen_text if j == 2 else "{}"))
        msgs.append(Message(role="assistant", tool_calls=[ToolCall(id="w", name=write.name, arguments=args)]))
        msgs.append(Message(role="tool", tool_call_id="w", name=write.name, content="Error: no", error=True))
        return lab.judge(_traj(msgs), inst)

    right = write.arguments["new_item_ids"][0]
    listing = f'{{"variants": {{"{right}": {{}}, "9999999999": {{}}}}}}'
    # The wrong id was in the product listing: data reasoning, not precision.
    j = run_with({**write.arguments, "new_item_ids": ["9999999999"]}, listing)
    assert j["structured_data_reasoning"][0] == "LACKING" and j["tool_call_precision"][0] == "PRESENT"
    # The same wrong id with no listing seen: an invented value is a precision failure.
    j = run_with({**write.arguments, "new_item_ids": ["9999999999"]}, "{}")
    assert j["tool_call_precision"][0] == "LACKING" and j["structured_data_reasoning"][0] == "PRESENT"
    # Right value, wrong type: precision.
    j = run_with({**write.arguments, "new_item_ids": right}, listing)
    assert j["tool_call_precision"][0] == "LACKING" and "should be array" in j["tool_call_precision"][1]


def test_malformed_and_unknown_calls_and_no_reference():
    inst = generate("single_write", 0, 0, 1)
    lab = labeller()
    bad = _traj([Message(role="assistant", tool_calls=[ToolCall(name="<unparsed>", parse_error="bad json")])])
    assert lab.judge(bad, inst)["tool_call_precision"][0] == "LACKING"
    unknown = _traj([Message(role="assistant", tool_calls=[ToolCall(name="delete_everything", arguments={})])])
    assert "unknown tool" in lab.judge(unknown, inst)["tool_call_precision"][1]
    assert all(label == "NA" for label, _ in lab.judge(bad, None).values())
    assert extract_calls(bad)[0].parse_error == "bad json"


def test_each_call_gets_its_own_observation_when_ids_repeat():
    """The local parser names every turn's first call `call_0`: each call must still get the answer that followed
    it (looked up by id across the episode, every call got the last one)."""
    def turn(name, **arguments):
        return Message(role="assistant", tool_calls=[ToolCall(id="call_0", name=name, arguments=arguments)])

    messages = [turn("find_user_id_by_email", email="a@b.c"),
                Message(role="tool", tool_call_id="call_0", content="user_1"),
                turn("get_order_details", order_id="#W1", item_ids="1"),
                Message(role="tool", tool_call_id="call_0", content="Error: unexpected keyword", error=True),
                Message(role="assistant", content="Done.")]
    calls = extract_calls(_traj(messages))
    assert [(c.ok, c.observation) for c in calls] == [(True, "user_1"), (False, "Error: unexpected keyword")]
    assert calls[0].seen == "" and calls[1].seen == "user_1"
