"""The template library passes the conformance harness; deliberately broken environments are rejected with the
reason; R_c gives the partial credit it promises."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from trace_core.envs.oracle import replay_reference
from trace_core.schemas import Action, Message, RewardResult, ToolCall
from trace_core.synthesis.calibration import ladder
from trace_core.synthesis.contract import label
from trace_core.synthesis.harness import validate
from trace_core.synthesis.templates import TEMPLATES, make
from trace_core.synthesis.templates.multi_step_completion import MultiStepCompletion
from trace_core.synthesis.templates.precondition_verification import PreconditionVerification
from trace_core.synthesis.templates.structured_data_reasoning import StructuredDataReasoning
from tests.defaults import PARAMS, default_limits, default_user, harness_config

SMALL = harness_config(seeds=12, reference_seeds=3, probe_seeds=3, train_instances=0, eval_instances=0)


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_every_template_passes(template):
    report = validate(make(template, difficulty=1), SMALL)
    assert report.passed, report.failures()
    assert [c.name for c in report.checks] == [
        "determinism", "diversity", "schema_parity", "hint", "reference",
        "probe:do_nothing", "probe:stop_at_once", "probe:random", "probe:tool_spam",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_every_template_passes_on_many_seeds(template):
    """The acceptance sweep: TRACE_SYNTHESIS_SLOW_N seeds (1000 for the full check) per template."""
    n = int(os.environ.get("TRACE_SYNTHESIS_SLOW_N", "100"))
    cfg = harness_config(seeds=n, reference_seeds=n, probe_seeds=max(10, n // 10), train_instances=0, eval_instances=0)
    report = validate(make(template, difficulty=1), cfg)
    assert report.passed, report.failures()


# -- broken environments ----------------------------------------------------------------------------------------
class NonDeterministic(StructuredDataReasoning):
    def generate(self, seed, difficulty):
        inst = super().generate(seed, difficulty)
        return inst.model_copy(update={"user_goal": inst.user_goal + f" (mood {random.random():.6f})"})


class Unsolvable(MultiStepCompletion):
    def reference(self, instance):
        ref = super().reference(instance)
        last = ref[-1]
        return [*ref[:-1], Action(name=last.name, arguments={**last.arguments, "order_id": "#W0000000"})]


class HackableBySpam(MultiStepCompletion):
    def score(self, instance, messages, termination_reason):
        calls = sum(len(m.tool_calls or []) for m in messages if m.role == "assistant")
        return RewardResult(reward=1.0 if calls >= 3 else 0.0)


class SameEveryTime(StructuredDataReasoning):
    def generate(self, seed, difficulty):
        return super().generate(0, difficulty)


class SchemaDrift(StructuredDataReasoning):
    def tool_schemas(self, instance=None):
        schemas = [dict(s) for s in super().tool_schemas(instance)]
        fn = dict(schemas[0]["function"])
        fn["parameters"] = {**fn["parameters"], "properties": {"id": {"type": "string"}}}
        schemas[0] = {**schemas[0], "function": fn}
        return schemas


class LeakyHint(StructuredDataReasoning):
    def hint(self, instance):
        write = [a for a in instance.reference_actions if a.name.endswith("_items")][-1]
        return f"Use item {write.arguments['new_item_ids'][0]}."


@pytest.mark.parametrize(
    "cls,failing",
    [
        (LeakyHint, "hint"),
        (NonDeterministic, "determinism"),
        (Unsolvable, "reference"),
        (HackableBySpam, "probe:tool_spam"),
        (SameEveryTime, "diversity"),
        (SchemaDrift, "schema_parity"),
    ],
)
def test_broken_environments_are_rejected_with_the_reason(cls, failing):
    report = validate(cls(None, difficulty=1, profile=PARAMS.env.profile), SMALL)
    assert not report.passed
    failed = {c.name for c in report.checks if not c.passed}
    assert failing in failed, report.failures()
    assert any(f.startswith(failing) for f in report.failures())


def test_a_generator_that_raises_is_a_failed_check():
    class Raises(StructuredDataReasoning):
        def generate(self, seed, difficulty):
            raise KeyError("no such product")

    report = validate(Raises(None, difficulty=1, profile=PARAMS.env.profile), SMALL)
    assert not report.passed and "reset raised KeyError" in report.failures()[0]


# -- R_c --------------------------------------------------------------------------------------------------------
def _score(env, inst, actions, closing=True):
    ep = replay_reference(env, inst, actions=actions) if closing else None
    return ep.score()


def test_partial_credit_for_some_of_the_writes():
    env = MultiStepCompletion(None, difficulty=2, profile=PARAMS.env.profile)  # three writes
    inst = env.reset(1)
    ref = env.reference(inst)
    writes = [i for i, a in enumerate(ref) if a.name in {"modify_user_address", "modify_pending_order_address",
                                                          "modify_pending_order_payment", "cancel_pending_order",
                                                          "return_delivered_order_items"}]
    assert len(writes) == 3
    r = _score(env, inst, [a for i, a in enumerate(ref) if i != writes[-1]])
    assert r.reward == pytest.approx(2 / 3) and r.components["actions"] == pytest.approx(2 / 3)
    assert _score(env, inst, ref).reward == 1.0


def test_stray_write_attempts_cap_the_reward():
    env = MultiStepCompletion(None, difficulty=1, profile=PARAMS.env.profile)
    inst = env.reset(2)
    ref = env.reference(inst)
    first = next(a for a in ref if a.name == "cancel_pending_order" or a.name.startswith("modify") or a.name.startswith("return"))
    wrong = Action(name=first.name, arguments={**first.arguments, **{k: "#W0000000" for k in first.arguments if k == "order_id"}})
    r = _score(env, inst, [wrong, *ref])  # a failed guess, then the right solution
    assert r.components["target"] == 1.0 and r.reward == 0.5


def test_a_write_with_some_arguments_wrong_earns_a_share_of_its_credit():
    from trace_core.envs.tau2_env import write_tools
    from trace_core.synthesis.contract import NEAR_MISS_CREDIT

    env = make("tool_call_precision", difficulty=1)  # one write after the prefilled look-ups
    inst = env.reset(4)
    (write,) = [a for a in env.reference(inst) if a.name in write_tools("retail")]
    key = sorted(write.arguments)[0]
    one_wrong = Action(name=write.name, arguments={**write.arguments, key: "zzz"})
    r = _score(env, inst, [one_wrong])
    share = (len(write.arguments) - 1) / len(write.arguments)
    assert r.components["actions"] == pytest.approx(NEAR_MISS_CREDIT * share)
    assert 0 < r.reward < 1 and r.reward <= NEAR_MISS_CREDIT
    left_out = Action(name=write.name, arguments={k: v for k, v in write.arguments.items() if k != key})
    assert _score(env, inst, [left_out]).reward == 0.0  # an argument left out is no near miss: it would pay as much
    all_wrong = Action(name=write.name, arguments={k: "zzz" for k in write.arguments})
    assert _score(env, inst, [all_wrong]).reward == 0.0  # the right tool alone is worth nothing
    # more attempts than MAX_ATTEMPTS_PER_WRITE per reference write: guessing, no credit
    assert _score(env, inst, [one_wrong, one_wrong, one_wrong]).reward == 0.0
    # a retry that gets it exactly right ends in the right state, capped for the stray attempt
    assert _score(env, inst, [one_wrong, write]).reward <= 0.5


def test_refusal_needs_the_checks_and_no_write():
    env = PreconditionVerification(None, difficulty=1, profile=PARAMS.env.profile)
    seed = next(s for s in range(50) if env.reset(s).must_refuse)
    inst = env.reset(seed)
    assert _score(env, inst, env.reference(inst)).reward == 1.0
    assert _score(env, inst, []).reward == 0.0  # refused without looking anything up
    cancel = Action(name="cancel_pending_order", arguments={"order_id": inst.meta["order_id"], "reason": "no longer needed"})
    assert _score(env, inst, [*env.reference(inst), cancel]).reward == 0.0


def _play(env, inst, turns):
    """An episode whose every assistant turn names its call `call_0`, as the local parser numbers them."""
    ep = env.start(inst, default_user(), default_limits())
    for action in turns:
        if ep.done:
            break
        ep.step(Message(role="assistant", tool_calls=[ToolCall(id="call_0", name=action.name, arguments=action.arguments)]))
    while not ep.done:
        ep.step(Message(role="assistant", content="Done. ###STOP###"))
    return ep.score()


def test_each_call_is_judged_by_its_own_answer_when_ids_repeat():
    """Measured on 2026-12-06: with every turn's call named call_0, R_c judged all calls by the episode's last tool
    answer, so a trailing error took the checks' credit from a refusal and a made write from an allowed request."""
    env = PreconditionVerification(None, difficulty=0, profile=PARAMS.env.profile)
    order = lambda inst: inst.meta["order_id"]  # noqa: E731
    bad_read = lambda inst: Action(name="get_order_details", arguments={"order_id": order(inst), "item_ids": "1"})  # noqa: E731
    refuse = env.reset(next(s for s in range(50) if env.reset(s).must_refuse))
    r = _play(env, refuse, [*env.reference(refuse), bad_read(refuse)])
    assert r.components["checked"] == 1.0 and r.reward == 1.0
    allowed = env.reset(next(s for s in range(50) if not env.reset(s).must_refuse))
    r = _play(env, allowed, [*env.reference(allowed), bad_read(allowed)])
    assert r.reward == 1.0 and r.components["target"] == 1.0


def test_tool_call_precision_starts_after_the_lookups():
    env = make("tool_call_precision", difficulty=2)
    inst = env.reset(4)
    ref = env.reference(inst)
    assert len(ref) == 1 and inst.meta["prefill"]
    ep = env.start(inst, default_user(), default_limits())
    assert [m.role for m in ep.messages[:2]] == ["system", "user"]
    assert ep.messages[2].tool_calls[0].id == "prefill_0" and ep.messages[3].role == "tool" and not ep.messages[3].error
    assert ep.steps == 0
    ep.step(Message(role="assistant", tool_calls=[ToolCall(id="w", name=ref[0].name, arguments=ref[0].arguments)]))
    while not ep.done:
        ep.step(Message(role="assistant", content="Done. ###STOP###"))
    assert ep.score().reward == 1.0


# -- scaffolds (calibration's positions below difficulty 0) -----------------------------------------------------
def test_a_scaffold_prefills_the_lookups_before_the_first_write():
    plain, env = make("structured_data_reasoning", difficulty=0), make("structured_data_reasoning", difficulty=0, scaffold=2)
    a, b = plain.reset(7), env.reset(7)
    assert b.instance_id.endswith("/d0p2/s7") and a.instance_id.endswith("/d0/s7")
    assert [p["name"] for p in b.meta["prefill"]] == [x.name for x in a.reference_actions[:2]]
    assert env.reference(b) == plain.reference(a)[2:]  # the agent still owns the rest, the write included
    assert _score(env, b, env.reference(b)).reward == 1.0
    assert _score(env, b, []).reward == 0.0  # the look-ups alone earn nothing
    full = make("structured_data_reasoning", difficulty=0, scaffold=3).reset(7)  # all three look-ups, never the write
    assert len(full.meta["prefill"]) == 3 and make("structured_data_reasoning", difficulty=0, scaffold=3).reference(full)
    with pytest.raises(ValueError, match="scaffold 6 outside 0..5"):
        make("structured_data_reasoning", scaffold=6)


def test_templates_whose_lookups_are_the_capability_have_no_scaffold():
    for template in ("identification", "precondition_verification", "tool_call_precision"):
        assert TEMPLATES[template].max_scaffold == 0
        with pytest.raises(ValueError, match="scaffold 1 outside 0..0"):
            make(template, scaffold=1)


def test_refusal_instances_are_never_scaffolded():
    class Scaffoldable(PreconditionVerification):
        max_scaffold = 3

    env = Scaffoldable(None, difficulty=1, profile=PARAMS.env.profile, scaffold=3)
    refusal = next(env.reset(s) for s in range(50) if env.reset(s).must_refuse)
    allowed = next(env.reset(s) for s in range(50) if not env.reset(s).must_refuse)
    assert not refusal.meta.get("prefill") and allowed.meta["prefill"]
    assert _score(env, refusal, []).reward == 0.0


# Every position of every template's ladder (calibration may keep any of them), d1 aside (checked above).
RUNG_CHECK = harness_config(seeds=8, reference_seeds=2, probe_seeds=2, train_instances=0, eval_instances=0)
RUNGS = [(t, d, s) for t in sorted(TEMPLATES) for d, s in ladder(TEMPLATES[t].max_difficulty, TEMPLATES[t].max_scaffold)
         if (d, s) != (1, 0)]


@pytest.mark.parametrize(("template", "difficulty", "scaffold"), RUNGS, ids=[f"{t}-{label(d, s)}" for t, d, s in RUNGS])
def test_every_rung_of_every_template_passes_the_harness(template, difficulty, scaffold):
    report = validate(make(template, difficulty=difficulty, scaffold=scaffold), RUNG_CHECK)
    assert report.passed, report.failures()
    assert (report.difficulty, report.scaffold) == (difficulty, scaffold)


def test_structured_data_reasoning_rungs_below_the_lookups_leave_only_the_variant_choice():
    """Scaffold 4 names the current item and the payment method (the listing still holds the only copy of the new
    item id), scaffold 5 does the same on products with few variants."""
    from trace_core.envs.procedural._retail import db
    from trace_core.synthesis.templates.structured_data_reasoning import FEW_VARIANTS

    few = []
    for scaffold in (4, 5):
        env = make("structured_data_reasoning", difficulty=0, scaffold=scaffold)
        for seed in range(6):
            inst = env.reset(seed)
            (write,) = env.reference(inst)  # every look-up is in the history; the write is the agent's
            args = write.arguments
            assert [p["name"] for p in inst.meta["prefill"]] == [a.name for a in inst.reference_actions[:-1]]
            assert args["item_ids"][0] in inst.opening and args["payment_method_id"] in inst.opening
            assert args["new_item_ids"][0] not in inst.opening + str(inst.user_facts)
            assert _score(env, inst, [write]).reward == 1.0 and _score(env, inst, []).reward == 0.0
            wrong = write.model_copy(update={"arguments": {**args, "new_item_ids": [args["item_ids"][0]]}})
            assert _score(env, inst, [wrong]).reward < 1.0  # copying an id from the request is not the answer
            if scaffold == 5:  # the listing alone is in the history: the base agent closes after a few calls
                few.append(len(db().products[inst.meta["product_id"]].variants))
                assert [p["name"] for p in inst.meta["prefill"]] == ["get_product_details"]
    assert few and max(few) <= FEW_VARIANTS


def test_multi_step_rungs_below_the_lookups_still_need_every_write():
    """Scaffolds 3 and 4 make two simpler writes (a cancellation with a payment or address change; two
    cancellations); stopping after the first write is never full credit."""
    from trace_core.envs.tau2_env import write_tools

    writes = write_tools("retail")
    for scaffold, kinds in ((3, {"cancel_pending_order"}), (4, {"cancel_pending_order"})):
        env = make("multi_step_completion", difficulty=0, scaffold=scaffold)
        for seed in range(6):
            inst = env.reset(seed)
            ref = env.reference(inst)
            made = [a for a in ref if a.name in writes]
            assert len(made) == 2 and kinds <= {a.name for a in made}
            assert not any(p["name"] in writes for p in inst.meta.get("prefill", []))  # every write is the agent's
            if scaffold == 4:  # the user gives the user id: no identification, nothing prefilled
                assert [a.name for a in made] == ["cancel_pending_order"] * 2 and made[0] != made[1]
                assert not inst.meta.get("prefill") and f"My user id is {inst.meta['user_id']}." in inst.opening
            first = ref[: ref.index(made[0]) + 1]
            assert _score(env, inst, ref).reward == 1.0
            assert 0.0 < _score(env, inst, first).reward < 1.0


# -- hints (docs/method.md §2's hint injection) ----------------------------------------------------------------------
@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_hints_guide_without_answering(template):
    from trace_core.envs.tau2_env import write_tools

    env = make(template, difficulty=1)
    writes = write_tools("retail")
    for seed in range(5):
        inst = env.reset(seed)
        text = env.hint(inst)
        assert text.startswith("Expert guidance")
        reads = [a.name for a in env.reference(inst) if a.name not in writes]
        assert all(name in text for name in reads)  # the look-ups, by tool name
        assert not any(w in text for w in writes)  # never which change (refusal instances read the same)


def test_multi_step_hint_says_how_many_changes():
    env = make("multi_step_completion", difficulty=2)
    inst = env.reset(0)
    assert "needs 3 separate changes" in env.hint(inst)


def test_a_blended_environment_passes_the_harness():
    report = validate(make("multi_step_completion", difficulty=1, blend=True), SMALL)
    assert report.passed, report.failures()
    assert report.blend and report.difficulty == 1


# -- issue #35 item 5: seeds across the whole manifests, and rebuilds in a new process ------------------------------
GENERATORS = Path(__file__).parent / "generators"
# The manifests of params.yaml's defaults (train 0..255, eval 256..319); few first seeds, as a generator would face.
SPOT = harness_config(seeds=10, reference_seeds=5, probe_seeds=5, train_instances=256, eval_instances=64,
                     spot_seeds=10, spot_seed=7)


def test_spot_seeds_are_drawn_across_both_manifests_reproducibly():
    seeds = SPOT.spot()
    assert seeds == SPOT.spot() and len(set(seeds)) == 10 and all(0 <= s < 320 for s in seeds)
    assert any(s >= 256 for s in seeds) and any(50 <= s < 256 for s in seeds)
    no_manifests = harness_config(seeds=10, spot_seeds=10, train_instances=0, eval_instances=0)
    assert no_manifests.spot() == []  # no manifests, no spot checks


def test_a_generator_honest_only_on_the_first_seeds_is_rejected():
    from trace_core.synthesis.generated import GeneratedEnv

    env = GeneratedEnv((GENERATORS / "honest_below_50.py").read_text(), "gamed", difficulty=1, profile=PARAMS.env.profile)
    report = validate(env, SPOT)
    failed = {c.name for c in report.checks if not c.passed}
    assert not report.passed and "probe:do_nothing@spot" in failed, report.failures()
    assert {"determinism", "reference", "probe:do_nothing"}.isdisjoint(failed)  # the first seeds look honest


def test_a_generator_keeping_state_across_calls_is_rejected():
    from trace_core.synthesis.generated import GeneratedEnv

    env = GeneratedEnv((GENERATORS / "stateful.py").read_text(), "gamed", difficulty=1, profile=PARAMS.env.profile)
    report = validate(env, SPOT)
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert not report.passed and "rebuild" in failed, report.failures()
    assert "keeps state across calls" in failed["rebuild"] and "determinism" not in failed
