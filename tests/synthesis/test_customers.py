"""Generated DB states: every template instance plays a customer account made for it (`fresh_customer`)."""

from __future__ import annotations

import hashlib
import json

import pytest

from trace_core.envs.oracle import replay_reference
from trace_core.envs.procedural import generate as procedural
from trace_core.envs.procedural._retail import db
from trace_core.schemas import ToolCall
from trace_core.synthesis.templates import TEMPLATES, make
from trace_core.synthesis.templates._base import SEED
from trace_core.synthesis.templates._customers import customer_of, customer_rng, fresh_customer
from tests.defaults import default_limits, default_user


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_each_instance_has_a_new_customer_and_only_the_new_one(template):
    env = make(template, difficulty=1, profile="full")  # every tool callable
    for seed in range(3):
        inst = env.reset(seed)
        assert inst.db_patch, "template instances carry a generated DB state"
        (new_id,) = inst.db_patch["users"]
        assert new_id not in db().users
        user = inst.db_patch["users"][new_id]
        assert set(inst.db_patch["orders"]) == set(user["orders"])
        assert all(o not in db().orders for o in user["orders"])
        # The episode's database has the account; the agent finds it by what the user says.
        ep = env.start(inst, default_user(), default_limits())
        facts = inst.user_facts
        if "email" in facts:
            obs = ep._run_call(ToolCall(id="c", name="find_user_id_by_email", arguments={"email": facts["email"]}))
            assert obs.content == new_id
        first, last = facts["name"].split(" ", 1)
        obs = ep._run_call(
            ToolCall(id="d", name="find_user_id_by_name_zip", arguments={"first_name": first, "last_name": last, "zip": facts["zip"]})
        )
        assert obs.content == new_id


def test_the_stock_customer_does_not_survive_outside_the_patch():
    inst = procedural("single_write", SEED, 7, 1)
    old = customer_of(inst)
    assert old in db().users
    new = fresh_customer(inst, customer_rng("t", 7, 1))
    body = json.dumps(new.model_dump(mode="json", exclude={"db_patch"}))
    stock = db().users[old]
    assert old not in body and stock.email not in body
    assert not any(o[1:] in body for o in stock.orders)
    # Same problem: the same tools in the same order, the same items and statuses under the new ids.
    assert [a.name for a in new.reference_actions] == [a.name for a in inst.reference_actions]
    (new_order,) = [a.arguments["order_id"] for a in new.reference_actions if a.name == "get_order_details"][:1]
    (old_order,) = [a.arguments["order_id"] for a in inst.reference_actions if a.name == "get_order_details"][:1]
    copied = new.db_patch["orders"][new_order]
    assert copied["items"] == db().orders[old_order].model_dump(mode="json")["items"]
    assert copied["status"] == db().orders[old_order].status


def test_reference_scores_one_and_acting_on_the_stock_account_scores_zero():
    env = make("tool_call_precision", difficulty=1)  # single_write instances, reads prefilled
    inst = env.reset(3)
    ep = replay_reference(env, inst, actions=env.reference(inst))
    assert env.score(inst, ep.messages, ep.termination_reason).reward == 1.0
    # The same writes addressed to the stock order the instance was copied from leave the new account untouched.
    stock = procedural("single_write", SEED, 3, 1)
    wrong = [a for a in stock.reference_actions if a.name not in ("get_order_details", "find_user_id_by_email")]
    ep = replay_reference(env, inst, actions=wrong)
    r = env.score(inst, ep.messages, ep.termination_reason)
    # not solved: only the argument-level credit of a right tool with the wrong ids (at most half a write)
    assert r.components["target"] == 0.0 and r.components["actions"] == r.components["near_miss"] < 0.5


def test_content_hash_is_unchanged_for_instances_without_a_patch():
    inst = procedural("single_write", SEED, 0, 1)
    assert inst.db_patch is None
    legacy = inst.model_dump_json(exclude={"db_patch"})
    assert inst.content_hash() == hashlib.sha256(legacy.encode()).hexdigest()[:16]
