"""Tests for the procedural retail families: purity, the Instance contract, difficulty knobs, and solvability
(reference replay scores 1.0 in the compact τ² environment; doing nothing scores 0.0 when a write is needed).

The default run generates thousands of instances (cheap) and scores a small sample per family (~0.5 s per
episode); `-m slow` replays all 1,000 default-difficulty instances of every family."""

from __future__ import annotations

import os
import statistics

import pytest

# τ²'s evaluator imports LiteLLM, which otherwise tries to download a price table on first use (CI is offline).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from trace_core.envs.procedural import FAMILIES, MAX_DIFFICULTY, generate, generate_set
from trace_core.envs.procedural import _retail as R
from trace_core.schemas import Instance

FAMILY_NAMES = sorted(FAMILIES)
N_DETERMINISM = 1000
# The slow sweep's size per family (1,000 by default; lower it to smoke-test the sweep itself).
N_SLOW = int(os.environ.get("TRACE_PROCEDURAL_SLOW_N", "1000"))
FACT_KEYS = {"name", "zip", "email", "user_id", "order_id"}


@pytest.fixture(scope="module")
def env():
    from trace_core.envs.tau2_env import Tau2Environment

    return Tau2Environment("retail", "compact")


def _sample(family: str, seed: int = 2024, per_difficulty: int = 3) -> list[Instance]:
    return [generate(family, seed, i, d) for d in range(MAX_DIFFICULTY + 1) for i in range(per_difficulty)]


def _check_solvable(env, inst: Instance) -> None:
    from trace_core.envs.oracle import do_nothing, replay_reference

    ep = replay_reference(env, inst)
    errors = [m.content for m in ep.messages if m.role == "tool" and m.error]
    assert not errors, f"{inst.instance_id}: reference actions failed: {errors}"
    result = ep.score()
    assert result.reward == 1.0, f"{inst.instance_id}: replay scored {result.reward} ({result.info})"
    if inst.requires_write:
        idle = do_nothing(env, inst).score()
        assert idle.reward == 0.0, f"{inst.instance_id}: doing nothing scored {idle.reward}"


# -- purity --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_regeneration_is_byte_identical(family):
    coords = [(i, i % (MAX_DIFFICULTY + 1)) for i in range(N_DETERMINISM)]
    first = [generate(family, 123, i, d).model_dump_json() for i, d in coords]
    # Interleave other draws so that any hidden shared state (a module RNG, a mutated cache) would show.
    generate(family, 999, 0, 2)
    second = [generate(family, 123, i, d).model_dump_json() for i, d in reversed(coords)][::-1]
    assert first == second
    assert len({Instance.model_validate_json(x).instance_id for x in first}) == N_DETERMINISM


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_different_seeds_differ(family):
    a = [generate(family, 1, i, 1) for i in range(50)]
    b = [generate(family, 2, i, 1) for i in range(50)]
    differ = sum((x.opening, x.reference_actions) != (y.opening, y.reference_actions) for x, y in zip(a, b))
    assert differ >= 45, f"only {differ}/50 instances differ between seeds"
    # Indices within one seed differ too.
    assert len({x.opening for x in a}) >= 45


def _digest(n: int) -> str:
    import hashlib

    h = hashlib.sha256()
    for family in FAMILY_NAMES:
        for i in range(n):
            h.update(generate(family, 42, i, i % (MAX_DIFFICULTY + 1)).model_dump_json().encode())
    return h.hexdigest()


def test_same_instances_in_a_fresh_process_with_another_hash_seed():
    """Nothing may depend on Python's salted hash (set order, hash()): a new process must agree byte for byte."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import importlib.util as u; "
        "s = u.spec_from_file_location('t', sys.argv[2]); m = u.module_from_spec(s); s.loader.exec_module(m); "
        "print(m._digest(40))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), __file__],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert out.stdout.strip().splitlines()[-1] == _digest(40)


def test_generation_does_not_mutate_the_db():
    before = R.db().model_dump_json()
    for family in FAMILY_NAMES:
        for d in range(MAX_DIFFICULTY + 1):
            for i in range(20):
                generate(family, 5, i, d)
    assert R.db().model_dump_json() == before


# -- the Instance contract -----------------------------------------------------------------------------------
def test_write_tools_match_tau2():
    from trace_core.envs.tau2_env import write_tools

    assert R.WRITE_TOOLS == write_tools("retail")
    from trace_core.envs.tau2_env import Tau2Environment

    names = {s["function"]["name"] for s in Tau2Environment("retail", "full").tool_schemas()}
    assert set(R.ALL_TOOLS) == names


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_instance_contract(family):
    for d in range(MAX_DIFFICULTY + 1):
        for i in range(60):
            inst = generate(family, 7, i, d)
            assert inst.instance_id == f"proc/retail/{family}/d{d}/s7/{i}"
            assert (inst.source, inst.domain, inst.family) == ("procedural", "retail", family)
            assert (inst.seed, inst.index, inst.difficulty) == (7, i, d)
            assert inst.opening and inst.user_goal
            assert set(inst.user_facts) <= FACT_KEYS and inst.user_facts
            assert all(isinstance(v, str) and v for v in inst.user_facts.values())
            assert all("," not in x for x in inst.communicate_info)
            writes = [a for a in inst.reference_actions if a.name in R.WRITE_TOOLS]
            assert inst.requires_write == bool(writes)
            if inst.must_refuse:
                assert not writes and not inst.requires_write
            else:
                assert writes
            used = {a.name for a in inst.reference_actions}
            assert inst.tool_subset == sorted(set(inst.tool_subset))
            assert used <= set(inst.tool_subset) <= set(R.ALL_TOOLS)
            distractors = inst.meta["distractor_tools"]
            assert 1 <= len(distractors) <= 2 and not set(distractors) & used
            # Identifiers a correct agent needs must be in the conversation: the order ids it writes to are in
            # the opening (or, where the family hides them, found from the user's details).
            for a in writes:
                oid = a.arguments.get("order_id")
                if oid and not (family == "identify_then_act" and d >= 2):
                    assert oid in inst.opening, (inst.instance_id, oid)


# -- difficulty knobs ----------------------------------------------------------------------------------------
def _by_difficulty(family: str, n: int = 150) -> dict[int, list[Instance]]:
    return {d: [generate(family, 11, i, d) for i in range(n)] for d in range(MAX_DIFFICULTY + 1)}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_difficulty_changes_what_is_generated(family):
    sets = _by_difficulty(family, 40)
    for d in range(MAX_DIFFICULTY):
        lo = [x.model_dump(exclude={"instance_id", "difficulty"}) for x in sets[d]]
        hi = [x.model_dump(exclude={"instance_id", "difficulty"}) for x in sets[d + 1]]
        assert lo != hi


def test_single_write_difficulty():
    sets = _by_difficulty("single_write")
    kinds = {d: {x.meta["kind"] for x in xs} for d, xs in sets.items()}
    assert kinds[0] == {"cancel"}
    assert [len(kinds[d]) for d in range(4)] == [1, 2, 4, 5]
    lengths = [statistics.mean(len(x.opening) for x in sets[d]) for d in range(4)]
    assert lengths == sorted(lengths)
    # d0/d1 state the cancel reason in the policy's words; d2+ paraphrase it.
    for d, xs in sets.items():
        for x in xs:
            if x.meta["kind"] == "cancel":
                assert (x.meta["reason"] in x.opening) == (d < 2)


def test_identify_then_act_difficulty():
    sets = _by_difficulty("identify_then_act")
    for d, xs in sets.items():
        for x in xs:
            finder = x.reference_actions[0].name
            assert finder == ("find_user_id_by_email" if d == 0 else "find_user_id_by_name_zip")
            assert "user_id" not in x.user_facts and x.meta["user_id"] not in x.opening
            if d >= 2:
                assert "order_id" not in x.user_facts and x.meta["order_id"] not in x.opening
                assert x.meta["product_hint"] in x.opening
                assert "get_user_details" in {a.name for a in x.reference_actions}
    # At d3 the product is in several of the user's orders (only one pending); at d2 in exactly one.
    db = R.db()
    for d in (2, 3):
        for x in sets[d]:
            user = db.users[x.meta["user_id"]]
            holders = [o for o in user.orders if any(it.name == x.meta["product_hint"] for it in db.orders[o].items)]
            assert (len(holders) == 1) == (d == 2)


def test_variant_choice_difficulty():
    sets = _by_difficulty("variant_choice")
    cons = [statistics.mean(x.meta["n_constraints"] for x in sets[d]) for d in range(4)]
    assert cons[0] == 1 and cons[1] == 2 and cons[2] > 2.5 and cons[3] == 3
    distract = [statistics.mean(x.meta["n_distractor_variants"] for x in sets[d]) for d in range(4)]
    assert distract == sorted(distract)
    assert all(x.meta["relative_constraints"] for x in sets[3])
    assert all(x.meta["order_items"] >= 3 for x in sets[3])
    assert {x.meta["kind"] for x in sets[1]} == {"exchange", "modify_items"}
    db = R.db()
    for xs in sets.values():
        for x in xs:
            product = db.products[x.meta["product_id"]]
            new = product.variants[x.meta["new_item_id"]]
            assert new.available and new.item_id != x.meta["item_id"]
            matches = [
                v.item_id
                for v in product.variants.values()
                if v.available
                and v.item_id != x.meta["item_id"]
                and all(v.options[k] == val for k, val in x.meta["constraints"].items())
            ]
            assert matches == [new.item_id]


def test_compound_difficulty():
    sets = _by_difficulty("compound")
    for d, xs in sets.items():
        assert {x.meta["n_writes"] for x in xs} == {[2, 2, 3, 4][d]}
        assert {x.reference_actions[0].name for x in xs} == {
            "find_user_id_by_name_zip" if d == 3 else "find_user_id_by_email"
        }
    assert all(x.meta["kinds"] == ["user_address", "order_address"] for x in sets[0])
    assert len({tuple(sorted(x.meta["kinds"])) for x in sets[1]}) > 3


def test_policy_refusal_mix_and_difficulty():
    sets = _by_difficulty("policy_refusal", 300)
    scenarios = {d: {x.meta["scenario"] for x in xs} for d, xs in sets.items()}
    for a in range(4):
        for b in range(a + 1, 4):
            assert not scenarios[a] & scenarios[b]
    for d, xs in sets.items():
        share = sum(x.must_refuse for x in xs) / len(xs)
        assert 0.5 <= share <= 0.7, (d, share)
        for scenario in scenarios[d]:  # every scenario has both its refusal and its allowed look-alike
            assert {x.must_refuse for x in xs if x.meta["scenario"] == scenario} == {True, False}
    # Subtler levels contain refusals where a non-refusing agent's write would actually go through.
    assert any(x.meta["tool_would_succeed"] for d in (2, 3) for x in sets[d] if x.must_refuse)


# -- API errors ----------------------------------------------------------------------------------------------
def test_unknown_family_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown procedural family 'nope'.*single_write"):
        generate("nope", 0, 0, 1)
    with pytest.raises(ValueError, match="unknown procedural family"):
        generate_set(["single_write", "nope"], 0, 2, 1)


@pytest.mark.parametrize("difficulty", [-1, 4, 1.5, "1", True])
def test_bad_difficulty_is_a_clear_error(difficulty):
    with pytest.raises(ValueError, match=r"difficulty must be an integer in 0\.\.3"):
        generate("single_write", 0, 0, difficulty)
    with pytest.raises(ValueError, match="difficulty"):
        FAMILIES["compound"](0, 0, difficulty)
    with pytest.raises(ValueError, match="difficulty"):
        generate_set(["compound"], 0, 1, difficulty)


def test_generate_set_order():
    out = generate_set(["variant_choice", "compound"], 3, 4, 2)
    assert [(x.family, x.index) for x in out] == [("variant_choice", i) for i in range(4)] + [
        ("compound", i) for i in range(4)
    ]
    assert all(x.difficulty == 2 and x.seed == 3 for x in out)
    assert out[5].model_dump_json() == generate("compound", 3, 1, 2).model_dump_json()
    assert generate_set(["compound"], 0, 0, 0) == []


# -- solvability ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reference_replay_scores_one_and_doing_nothing_zero(env, family):
    sample = _sample(family)
    if family == "policy_refusal":
        assert {x.must_refuse for x in sample} == {True, False}
    for inst in sample:
        _check_solvable(env, inst)


def _apply_on_mini_db(inst: Instance) -> None:
    """Run the reference actions with τ²'s own retail tools on a private copy of just the records they touch
    (~1 ms, so thousands of instances can be checked): every call must succeed and every write change the DB."""
    from tau2.domains.retail.data_model import RetailDB
    from tau2.domains.retail.tools import RetailTools

    full = R.db()
    args = [a.arguments for a in inst.reference_actions]
    order_ids = sorted({a["order_id"] for a in args if "order_id" in a})
    user_ids = {full.orders[o].user_id for o in order_ids} | {a["user_id"] for a in args if "user_id" in a}
    user_ids.add(inst.meta["user_id"])
    mini = RetailDB.model_construct(
        products=full.products,  # no retail tool writes to products
        users={u: full.users[u].model_copy(deep=True) for u in sorted(user_ids)},
        orders={o: full.orders[o].model_copy(deep=True) for o in order_ids},
    )
    tools = RetailTools(mini)

    def snapshot() -> list[str]:
        return [m.model_dump_json() for m in (*mini.users.values(), *mini.orders.values())]

    for a in inst.reference_actions:
        before = snapshot() if a.name in R.WRITE_TOOLS else None
        tools.use_tool(a.name, **a.arguments)  # raises on any invalid call
        if before is not None:
            assert snapshot() != before, (inst.instance_id, a.name)


def test_db_identities_are_unique():
    """find_user_id_by_email / _by_name_zip return the first match: the generators rely on there being one."""
    users = list(R.db().users.values())
    assert len({u.email.lower() for u in users}) == len(users)
    assert len({(u.name.first_name.lower(), u.name.last_name.lower(), u.address.zip) for u in users}) == len(users)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reference_actions_apply_cleanly(family):
    for d in range(MAX_DIFFICULTY + 1):
        for i in range(250):
            _apply_on_mini_db(generate(family, 31, i, d))


def test_every_compound_write_changes_the_db():
    """Each of several writes matters on its own (not only their sum): the DB hash moves after every write."""
    from trace_core.envs.tau2_env import fresh_environment

    for d, i in ((1, 0), (3, 0), (3, 1)):
        inst = generate("compound", 99, i, d)
        tau_env = fresh_environment("retail")
        before = tau_env.get_db_hash()
        for a in inst.reference_actions:
            tau_env.make_tool_call(a.name, requestor="assistant", **a.arguments)
            if a.name in R.WRITE_TOOLS:  # hashing the DB costs ~0.1 s, so only after writes
                after = tau_env.get_db_hash()
                assert after != before, (inst.instance_id, a.name)
                before = after


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_all_default_instances_are_solvable(request, env, family):
    # ~20 min per family on 2 cores: only when asked for (`-m slow`), even if no conftest deselects it.
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("full sweep; run with -m slow")
    failures = []
    for i in range(N_SLOW):
        inst = generate(family, 0, i, 1)
        try:
            _check_solvable(env, inst)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} failures, first: {failures[:3]}"
    for d in range(MAX_DIFFICULTY + 1):  # the cheap check, on every instance of every difficulty
        for i in range(N_SLOW):
            _apply_on_mini_db(generate(family, 0, i, d))
