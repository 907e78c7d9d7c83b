"""The τ²-bench adapter, checked against τ² itself.

- every official airline/retail task is solved by replaying its reference actions (reward 1.0);
- the do-nothing agent scores 0 on every task that needs a write, except an explicit, explained list — and τ²'s
  own evaluator (with its default environment constructor, not our cached `trace-<domain>` one) agrees;
- on reference and perturbed trajectories our score equals τ²'s `evaluate_simulation` on a τ²-native run built
  independently with τ²'s default environment;
- official splits and the two prompt/tool profiles.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tau2 imports litellm: no cost-map download

from trace_core.envs.base import STOP, EpisodeLimits
from trace_core.envs.oracle import closing_message, do_nothing, replay_reference
from trace_core.envs.tau2_env import (
    COMPACT_POLICY,
    Tau2Environment,
    official_instances,
    official_splits,
    write_tools,
)
from trace_core.schemas import Instance, Message, ToolCall
from tests.defaults import default_limits, default_user

DOMAINS = ("airline", "retail")

# Tasks that need a write, yet an agent that does nothing scores 1.0 — in τ² too (see the evidence test below).
# In both, the reference's only write FAILS in τ²'s own tool, so the gold database equals the initial one, and
# the task has no communicate_info: "do nothing" reproduces the gold end state exactly.
DO_NOTHING_PASSES = {
    "tau2/retail/12": (
        "return_delivered_order_items",
        "Payment method should be the original payment method",  # refund to PayPal; order paid by credit card
    ),
    "tau2/retail/105": (
        "exchange_delivered_order_items",
        "Insufficient gift card balance to pay for the price difference",  # $21.10 due, gift card holds $17.00
    ),
}


@pytest.fixture(scope="module")
def instances() -> dict[str, list[Instance]]:
    return {d: official_instances(d, None) for d in DOMAINS}


@pytest.fixture(scope="module")
def envs() -> dict[str, Tau2Environment]:
    return {d: Tau2Environment(d, "full") for d in DOMAINS}


def _by_id(instances, iid: str) -> Instance:
    domain = iid.split("/")[1]
    return next(i for i in instances[domain] if i.instance_id == iid)


def _fork_map(fn, items: list, workers: int | None = None) -> list:
    """[fn(x) for x in items], spread over forked worker processes: the sweeps below score ~300 episodes, and
    each score is CPU-bound τ² work. Forking shares the τ² data already loaded here copy-on-write and pickles
    nothing but the results. Serial with one CPU or where fork is unavailable."""
    import multiprocessing as mp
    import traceback

    workers = workers or min(len(items), os.cpu_count() or 1, 4)
    if workers <= 1 or "fork" not in mp.get_all_start_methods():
        return [fn(x) for x in items]
    ctx = mp.get_context("fork")

    def run(idx, send):
        try:
            send.send(("ok", [(i, fn(items[i])) for i in idx]))
        except BaseException:  # noqa: BLE001 — report any failure to the parent
            send.send(("error", traceback.format_exc()))
        finally:
            send.close()

    jobs = []
    for w in range(workers):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run, args=(range(w, len(items), workers), send), daemon=True)  # forked: no pickling
        proc.start()
        send.close()
        jobs.append((proc, recv))
    out: list = [None] * len(items)
    errors = []
    for proc, recv in jobs:
        try:
            status, payload = recv.recv()
        except EOFError:
            status, payload = "error", f"worker {proc.pid} died without a result"
        proc.join()
        if status == "ok":
            for i, result in payload:
                out[i] = result
        else:
            errors.append(payload)
    assert not errors, "\n".join(errors)
    return out


def _warm(env: Tau2Environment) -> None:
    """Load the domain's DB (and its pickled copy) once here, before forking, so that workers share it."""
    env.tool_schemas()


# -- τ²-native runs ------------------------------------------------------------------------------------------------
def _tau2_default_env(domain: str, task):
    """τ²'s own environment, from τ²'s registry (its default constructor parses the DB from JSON)."""
    from tau2.registry import registry

    env = registry.get_env_constructor(domain)()
    if task.initial_state is not None:
        env.set_state(
            initialization_data=task.initial_state.initialization_data,
            initialization_actions=task.initial_state.initialization_actions,
            message_history=task.initial_state.message_history or [],
        )
    return env


def _tau2_native_score(domain: str, inst: Instance, steps: list[tuple], termination: str) -> float:
    """Build a τ² SimulationRun the way τ²'s orchestrator would record it — calls executed by τ²'s default
    environment, its own ToolMessages — and score it with τ²'s `evaluate_simulation` and default constructor.

    steps: ("call", name, arguments) | ("say", text). User replies are plain text (τ² does not score them)."""
    from tau2.data_model.message import AssistantMessage, UserMessage
    from tau2.data_model.message import ToolCall as TauToolCall
    from tau2.data_model.simulation import SimulationRun, TerminationReason
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    task = Tau2Environment.tau2_task(inst)
    env = _tau2_default_env(domain, task)
    msgs: list = [UserMessage(role="user", content=inst.opening or "Hi")]
    for i, step in enumerate(steps):
        if step[0] == "call":
            tc = TauToolCall(id=f"native_{i}", name=step[1], arguments=step[2])
            msgs.append(AssistantMessage(role="assistant", tool_calls=[tc]))
            msgs.append(env.get_response(tc))
        else:
            msgs.append(AssistantMessage(role="assistant", content=step[1]))
            msgs.append(UserMessage(role="user", content=f"Thanks. {STOP}"))
    sim = SimulationRun(
        id=inst.instance_id,
        task_id=inst.instance_id,
        start_time="",
        end_time="",
        duration=0.0,
        termination_reason=TerminationReason(termination),
        messages=msgs,
    )
    info = evaluate_simulation(
        simulation=sim, task=task, evaluation_type=EvaluationType.ALL, solo_mode=False, domain=domain
    )
    return float(info.reward)


def _drive(env: Tau2Environment, inst: Instance, steps: list, limits: EpisodeLimits | None = None):
    """Drive our episode with `steps` (("call", ToolCall) | ("say", text)) until they run out or it ends;
    say goodbye until the user stops. Returns (episode, number of steps executed)."""
    ep = env.start(inst, default_user(), limits or EpisodeLimits(max_steps=60, max_errors=30))
    done = 0
    for step in steps:
        if ep.done:
            break
        if step[0] == "call":
            ep.step(Message(role="assistant", tool_calls=[step[1]]))
        else:
            ep.step(Message(role="assistant", content=step[1]))
        done += 1
    while not ep.done:
        ep.step(Message(role="assistant", content="Goodbye."))
    return ep, done


# -- 1. oracle replay ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("domain", DOMAINS)
def test_reference_replay_solves_every_official_task(domain, instances, envs):
    expected = {"airline": 50, "retail": 114}[domain]
    assert len(instances[domain]) == expected
    env = envs[domain]
    _warm(env)

    def replay(inst):
        ep = replay_reference(env, inst)
        result = ep.score()
        return inst.instance_id, ep.termination_reason, result.reward, result.components, result.info

    results = _fork_map(replay, instances[domain])
    assert [r[0] for r in results] == [i.instance_id for i in instances[domain]]
    failures = {iid: rest for iid, *rest in results if rest[1] != 1.0}
    assert failures == {}


# -- 2. do-nothing control -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("domain", DOMAINS)
def test_do_nothing_scores_zero_on_write_tasks(domain, instances, envs):
    writes = [i for i in instances[domain] if i.requires_write]
    assert writes and all(any(a.name in write_tools(domain) for a in i.reference_actions) for i in writes)
    env = envs[domain]
    _warm(env)

    def idle(inst):
        ep = do_nothing(env, inst)
        return inst.instance_id, ep.termination_reason, ep.score().reward

    results = _fork_map(idle, writes)
    assert {r[1] for r in results} == {"user_stop"}
    passing = {iid: reward for iid, _, reward in results if reward > 0}
    expected = {iid for iid in DO_NOTHING_PASSES if iid.split("/")[1] == domain}
    # exactly the explained exceptions: the list can neither silently grow nor keep stale entries
    assert set(passing) == expected, passing
    assert all(r == 1.0 for r in passing.values())


@pytest.mark.parametrize("iid", sorted(DO_NOTHING_PASSES))
def test_do_nothing_exceptions_are_tau2s_own_verdict(iid, instances, envs):
    """Evidence: the reference write fails inside τ²'s own tool and leaves the DB as it was, and τ²'s evaluator
    (default registry constructor) also gives the do-nothing run 1.0."""
    inst = _by_id(instances, iid)
    domain = inst.domain
    tool, error = DO_NOTHING_PASSES[iid]
    task = Tau2Environment.tau2_task(inst)
    assert task.evaluation_criteria.communicate_info == []
    assert {str(getattr(b, "value", b)) for b in task.evaluation_criteria.reward_basis} == {"DB", "COMMUNICATE"}

    # Replay the gold actions on τ²'s default environment, as τ²'s EnvironmentEvaluator does.
    env = _tau2_default_env(domain, task)
    initial_hash = env.get_db_hash()
    failed = {}
    for action in task.evaluation_criteria.actions:
        try:
            env.make_tool_call(tool_name=action.name, requestor=action.requestor, **action.arguments)
        except Exception as exc:  # noqa: BLE001 — recording exactly what τ²'s tool raised
            failed[action.name] = str(exc)
    writes = [a.name for a in task.evaluation_criteria.actions if a.name in write_tools(domain)]
    assert writes == [tool]
    assert failed == {tool: error}
    assert env.get_db_hash() == initial_hash  # the gold end state IS the initial state

    ours = do_nothing(envs[domain], inst)
    said = [m.content for m in ours.messages if m.role == "assistant"]
    theirs = _tau2_native_score(domain, inst, [("say", s) for s in said], "user_stop")
    assert ours.score().reward == theirs == 1.0

    # the very SimulationRun our adapter builds, scored by τ² with its default constructor: the same verdict
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    from trace_core.envs.tau2_env import to_tau2_simulation

    sim = to_tau2_simulation(iid, ours.messages, ours.termination_reason)
    info = evaluate_simulation(
        simulation=sim, task=task, evaluation_type=EvaluationType.ALL, solo_mode=False, domain=domain
    )
    assert info.reward == 1.0 and info.db_check.db_match


# -- 3. equivalence with τ²'s evaluator on perturbed trajectories ----------------------------------------------------
# Which perturbations to check on which task (spread out to keep the run short; each kind appears twice).
EQUIVALENCE = {
    "tau2/airline/11": ("reference", "wrong_argument", "communicate_missing"),
    "tau2/airline/14": ("write_dropped", "bad_calls_mixed_in", "max_steps"),
    "tau2/retail/40": ("reference", "communicate_missing", "bad_calls_mixed_in"),
    "tau2/retail/74": ("write_dropped", "wrong_argument", "max_steps"),
}


def _perturb(arguments: dict) -> dict:
    """A plausible wrong argument: the other cancel reason, another cabin, else a mangled first string value."""
    args = dict(arguments)
    swaps = {"no longer needed": "ordered by mistake", "ordered by mistake": "no longer needed"}
    if args.get("reason") in swaps:
        args["reason"] = swaps[args["reason"]]
    elif args.get("cabin") in ("economy", "business", "basic_economy"):
        args["cabin"] = "business" if args["cabin"] != "business" else "economy"
    else:
        key = next(k for k, v in args.items() if isinstance(v, str))
        args[key] = args[key] + "0"
    return args


def _variants(inst: Instance, domain: str) -> dict[str, tuple[list, list, str | None, EpisodeLimits | None]]:
    """name -> (our steps, τ²-native steps, expected our termination or None, limits)."""
    ref = [(a.name, a.arguments) for a in inst.reference_actions]
    writes = [i for i, (name, _) in enumerate(ref) if name in write_tools(domain)]
    closing = closing_message(inst)

    def both(calls, text=closing):
        ours = [("call", ToolCall(name=n, arguments=a)) for n, a in calls] + [("say", text)]
        native = [("call", n, a) for n, a in calls] + [("say", text)]
        return ours, native

    out = {"reference": (*both(ref), "user_stop", None)}
    out["write_dropped"] = (*both([c for i, c in enumerate(ref) if i != writes[-1]]), "user_stop", None)
    wrong = list(ref)
    wrong[writes[0]] = (wrong[writes[0]][0], _perturb(wrong[writes[0]][1]))
    out["wrong_argument"] = (*both(wrong), "user_stop", None)
    if inst.communicate_info:
        out["communicate_missing"] = (*both(ref, "All done: your request has been completed."), "user_stop", None)
    cut = max(1, len(ref) - 1)
    ours, native = both(ref)
    out["max_steps"] = (ours, native[:cut], "max_steps", EpisodeLimits(max_steps=cut, max_errors=30))

    # Bad calls mixed into the reference run. Natively τ² sees the calls that reach its tools (and answers them
    # itself); unparsed calls never were calls, and a "**" calculation is refused by us and would run for hours
    # in τ², so neither appears in the native run.
    first_name, first_args = ref[0]
    big = {"user_id": "x" * 30_000}
    junk_ours = [
        ("call", ToolCall(name="no_such_tool", arguments={"x": 1})),
        ("call", ToolCall(name="invalid", parse_error="Expecting value: line 1 column 9")),
        ("call", ToolCall(name=first_name, arguments={**first_args, "unexpected": 1})),
        ("call", ToolCall(name="get_user_details", arguments=big)),
        ("call", ToolCall(name="calculate", arguments={"expression": "9**9**9"})),
    ]
    junk_native = [
        ("call", "no_such_tool", {"x": 1}),
        ("call", first_name, {**first_args, "unexpected": 1}),
        ("call", "get_user_details", big),
    ]
    ours, native = both(ref)
    out["bad_calls_mixed_in"] = (
        junk_ours[:3] + ours[:1] + junk_ours[3:] + ours[1:],
        junk_native[:2] + native[:1] + junk_native[2:] + native[1:],
        "user_stop",
        None,
    )
    return out


def test_score_equals_tau2_evaluator_on_perturbed_runs(instances, envs):
    for d in DOMAINS:
        _warm(envs[d])
    cases = [(iid, name) for iid, names in EQUIVALENCE.items() for name in names]

    def compare(case):
        iid, name = case
        inst = _by_id(instances, iid)
        ours_steps, native_steps, termination, limits = _variants(inst, inst.domain)[name]
        ep, _ = _drive(envs[inst.domain], inst, ours_steps, limits)
        ours = ep.score().reward
        theirs = _tau2_native_score(inst.domain, inst, native_steps, ep.termination_reason)
        return ep.termination_reason, termination, ours, theirs

    results = dict(zip(cases, _fork_map(compare, cases)))
    assert {c: (r[0], r[1]) for c, r in results.items() if r[0] != r[1]} == {}  # each run ended as planned
    assert {c: (r[2], r[3]) for c, r in results.items() if r[2] != r[3]} == {}  # our score == τ²'s
    # and the perturbations do what they are meant to: only the faithful runs pass
    faithful = {"reference", "bad_calls_mixed_in"}
    assert {c: r[2] for c, r in results.items()} == {c: float(c[1] in faithful) for c in cases}


def test_hidden_tool_in_compact_profile_counts_as_never_called(instances):
    """compact profile: a call to a real τ² tool that the instance does not offer is refused, and scoring treats
    it as never made (τ² would not see it either)."""
    inst = _by_id(instances, "tau2/retail/74").model_copy(
        update={"tool_subset": sorted({a.name for a in _by_id(instances, "tau2/retail/74").reference_actions})}
    )
    env = Tau2Environment("retail", "compact")
    assert "modify_user_address" not in {s["function"]["name"] for s in env.tool_schemas(inst)}
    hidden = ToolCall(
        name="modify_user_address",
        arguments={
            "user_id": "x",
            "address1": "a",
            "address2": "",
            "city": "c",
            "state": "s",
            "country": "USA",
            "zip": "1",
        },
    )
    steps = [("call", hidden)] + [
        ("call", ToolCall(name=a.name, arguments=a.arguments)) for a in inst.reference_actions
    ]
    ep, _ = _drive(env, inst, steps + [("say", closing_message(inst))])
    refusal = ep.messages[3]
    assert refusal.role == "tool" and refusal.error and refusal.content.startswith("Error: unknown tool")
    native = [("call", a.name, a.arguments) for a in inst.reference_actions] + [("say", closing_message(inst))]
    assert ep.score().reward == _tau2_native_score("retail", inst, native, "user_stop") == 1.0


def test_long_observation_is_cut_for_the_agent_but_scored_in_full(instances, envs):
    """airline's search_onestop_flight can return more than MAX_OBSERVATION_CHARS: the agent sees it cut, and
    τ²'s replay (which compares every result) still matches against the full text kept in `raw`."""
    from trace_core.envs.base import MAX_OBSERVATION_CHARS

    inst = _by_id(instances, "tau2/airline/11")
    search = ToolCall(
        name="search_onestop_flight", arguments={"origin": "JFK", "destination": "LAX", "date": "2024-05-16"}
    )
    steps = [("call", search)] + [
        ("call", ToolCall(name=a.name, arguments=a.arguments)) for a in inst.reference_actions
    ]
    ep, _ = _drive(envs["airline"], inst, steps + [("say", closing_message(inst))])
    obs = ep.messages[3]
    assert obs.content.endswith("...[truncated]") and len(obs.content) <= MAX_OBSERVATION_CHARS + 20
    assert obs.raw is not None and len(obs.raw) > MAX_OBSERVATION_CHARS and obs.raw.startswith(obs.content[:100])
    native = [("call", search.name, search.arguments)] + [("call", a.name, a.arguments) for a in inst.reference_actions]
    assert (
        ep.score().reward
        == _tau2_native_score("airline", inst, native + [("say", closing_message(inst))], "user_stop")
        == 1.0
    )


# -- 4. official splits ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("domain,train,test", [("retail", 74, 40), ("airline", 30, 20)])
def test_official_splits(domain, train, test, instances):
    splits = official_splits(domain)
    assert len(splits["train"]) == train and len(splits["test"]) == test
    assert not set(splits["train"]) & set(splits["test"])
    all_ids = {i.instance_id.split("/")[-1] for i in instances[domain]}
    assert set(splits["train"]) | set(splits["test"]) == all_ids
    test_instances = official_instances(domain, "test")
    assert [i.instance_id for i in test_instances] == [f"tau2/{domain}/{t}" for t in splits["test"]]
    assert all(i.split == "test" and i.source == "tau2" and i.family == f"tau2-{domain}" for i in test_instances)


# -- 5. profiles ------------------------------------------------------------------------------------------------
def test_profiles(instances, envs):
    from tau2.registry import registry

    inst = _by_id(instances, "tau2/retail/74")
    tau2_env = registry.get_env_constructor("retail")()
    all_tools = set(tau2_env.tools.get_tools())
    subset = ["get_order_details", "cancel_pending_order", "modify_pending_order_items"]
    narrowed = inst.model_copy(update={"tool_subset": subset})

    compact = Tau2Environment("retail", "compact")
    names = [s["function"]["name"] for s in compact.tool_schemas(narrowed)]
    assert sorted(names) == sorted(subset)
    assert compact.system_prompt(narrowed) == COMPACT_POLICY["retail"]
    assert len(COMPACT_POLICY["retail"]) < len(tau2_env.get_policy()) / 5
    # no subset named: every tool, still the short policy
    assert {s["function"]["name"] for s in compact.tool_schemas(inst)} == all_tools

    full = envs["retail"]
    assert {s["function"]["name"] for s in full.tool_schemas(narrowed)} == all_tools  # full ignores tool_subset
    assert full.system_prompt(narrowed) == tau2_env.get_policy()
    schemas = {s["function"]["name"]: s for s in full.tool_schemas()}
    for tool in tau2_env.get_tools():
        assert schemas[tool.name] == tool.openai_schema

    # an episode under each profile carries that profile's prompt and tools
    ep = compact.start(narrowed, default_user(), default_limits())
    assert ep.messages[0].content == COMPACT_POLICY["retail"] and {t["function"]["name"] for t in ep.tools} == set(
        subset
    )
    ep = full.start(narrowed, default_user(), default_limits())
    assert ep.messages[0].content == tau2_env.get_policy() and {t["function"]["name"] for t in ep.tools} == all_tools

    with pytest.raises(ValueError):
        Tau2Environment("retail", "tiny")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Tau2Environment("nowhere", "full")


# -- the DB update behind τ²'s set_state ------------------------------------------------------------------------


def test_fast_db_update_equals_tau2s_addict_merge():
    from tau2.utils.pydantic_utils import update_pydantic_model_with_dict as tau2_update

    from trace_core.envs.tau2_env import _db_copy, update_model_with_dict
    from trace_core.synthesis.templates import make

    db = _db_copy("retail")
    before = db.model_dump()
    user_id, user = next(iter(before["users"].items()))
    order_id = next(iter(before["orders"]))
    generated = make("identification", difficulty=1).reset(3).db_patch
    assert generated  # a whole new customer with copied orders
    patches = [
        generated,
        # partial nested updates: one address field, an order's status, a list replaced, a new key beside old ones
        {"users": {user_id: {"address": {"city": "Elsewhere"}}}, "orders": {order_id: {"status": "cancelled"}}},
        {"users": {user_id: {"orders": []}}},
        {"orders": {order_id: {"items": before["orders"][order_id]["items"][:1]}}},
        {},
    ]
    for patch in patches:
        ours, theirs = update_model_with_dict(db, patch), tau2_update(db, patch)
        assert type(ours) is type(theirs)
        assert ours.model_dump() == theirs.model_dump()
    assert db.model_dump() == before  # the input model is left as it was
    changed = update_model_with_dict(db, patches[1]).model_dump()
    assert changed["users"][user_id]["address"]["city"] == "Elsewhere"
    assert changed["users"][user_id]["address"]["zip"] == user["address"]["zip"]


def test_tau2_toolkits_use_the_fast_db_update():
    import tau2.environment.toolkit as toolkit

    from trace_core.envs.tau2_env import fresh_environment, update_model_with_dict

    fresh_environment("retail")
    assert toolkit.update_pydantic_model_with_dict is update_model_with_dict
