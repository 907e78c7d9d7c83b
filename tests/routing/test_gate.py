"""The trained gate (trace_core/routing/gate.py) on tiny fake data: a bag-of-words hashing embedder stands in for
MiniLM except in the distractor test, which uses the bundled MiniLM on procedural openings."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest

from trace_core.config import GateCfg
from trace_core.routing.gate import (
    EVAL_DISTRACTORS,
    NONE,
    Example,
    Gate,
    GateError,
    GateLeakError,
    check_no_leak,
    distractor_examples,
    distractors,
    example_of,
    fit_gate,
)
from trace_core.routing.router import build_options, select
from trace_core.schemas import GateRecord, Instance

CFG = GateCfg(per_capability=8, distractors=24, synthetic_weights=[1.0], inverse_regularizations=[10.0], folds=3)
FAKE = {"package": "fake-hashing"}


def fake_embed(texts: list[str]) -> np.ndarray:
    out = np.zeros((len(texts), 64))
    for i, text in enumerate(texts):
        for word in re.findall(r"[a-z]+", text.lower()):
            out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1.0
        out[i] /= np.linalg.norm(out[i]) or 1.0
    return out


def _instance(n: int, family: str, text: str, seed: int = 0) -> Instance:
    return Instance(instance_id=f"{family}-{seed}-{n}", source="procedural", domain="retail", family=family,
                    seed=seed, index=n, user_goal=text, opening=text)


REFUND = "I want a refund for order #W{n}, the item arrived broken and I want my money back"
ADDRESS = "Please change the shipping address of order #W{n} to {n} Elm Street, I moved house"


def _examples() -> list[Example]:
    out = [example_of(_instance(n, "refund_family", REFUND.format(n=n)), REFUND.format(n=n), "refunds", "synthetic")
           for n in range(8)]
    out += [example_of(_instance(n, "address_family", ADDRESS.format(n=n)), ADDRESS.format(n=n), "address",
                       "synthetic") for n in range(8)]
    return out + distractor_examples(0, CFG.distractors)


CAPS = ["refunds", "address"]
OPTIONS = build_options([{"capability_id": c, "name": c, "definition": c} for c in CAPS])


def test_gate_fits_routes_each_class_and_its_probabilities_sum_to_one():
    record = fit_gate(_examples(), fake_embed, CAPS, CFG, 0, [], FAKE)
    assert record.classes == [NONE, *CAPS] and len(record.coef) == 3 and record.temperature > 0
    assert record.counts == {"distractor:none": 24, "synthetic:address": 8, "synthetic:refunds": 8}
    gate = Gate(record, fake_embed)
    tasks = [REFUND.format(n=99), ADDRESS.format(n=77), "Tell me a joke about owls."]
    probabilities = gate.probabilities(OPTIONS, tasks)
    for p in probabilities:
        assert set(p) == {"A", "B", "C"} and abs(sum(p.values()) - 1) < 1e-9
    assert [select(p, OPTIONS, 0.0).top for p in probabilities] == ["refunds", "address", None]
    # Top-p composition works on the gate's probabilities: weights over the kept capabilities, at most 1.
    composed = select(probabilities[0], OPTIONS, 0.999)
    assert composed.chosen[0] == "refunds" and 0 < sum(composed.weights.values()) <= 1 + 1e-9


def test_gate_is_deterministic_and_round_trips_through_its_json_record():
    first = fit_gate(_examples(), fake_embed, CAPS, CFG, 0, [], FAKE).model_dump_json()
    again = fit_gate(_examples(), fake_embed, CAPS, CFG, 0, [], FAKE).model_dump_json()
    assert first == again
    record = GateRecord.model_validate_json(first)
    tasks = [REFUND.format(n=5), "What is 3 times 4?"]
    assert Gate(record, fake_embed).probabilities(OPTIONS, tasks) == Gate(
        GateRecord.model_validate_json(again), fake_embed).probabilities(OPTIONS, tasks)


def test_gate_with_one_capability_is_a_two_class_softmax():
    examples = [e for e in _examples() if e.label != "address"]
    gate = Gate(fit_gate(examples, fake_embed, ["refunds"], CFG, 0, [], FAKE), fake_embed)
    options = build_options([{"capability_id": "refunds", "name": "r", "definition": "r"}])
    (p,) = gate.probabilities(options, [REFUND.format(n=3)])
    assert abs(sum(p.values()) - 1) < 1e-9 and select(p, options, 0.0).top == "refunds"
    with pytest.raises(GateError, match="train it on these adapters"):
        gate.probabilities(OPTIONS, ["x"])


def test_gate_needs_openings_for_every_class():
    with pytest.raises(GateError, match=r"no training opening for \['none'\]"):
        fit_gate([e for e in _examples() if e.label is not None], fake_embed, CAPS, CFG, 0, [], FAKE)


def test_leakage_guard_refuses_any_evaluation_instance_or_its_seed():
    held_out = [_instance(3, "refund_family", REFUND.format(n=3))]
    with pytest.raises(GateLeakError, match="come from evaluation instances"):
        fit_gate(_examples(), fake_embed, CAPS, CFG, 0, held_out, FAKE)
    text = "Some other opening"
    # The same coordinates (family, seed, index) under another id and text, and the same text under another id.
    same_seed = Example(text, "refunds", "synthetic", "other-id", "refund_family", 0, 3)
    with pytest.raises(GateLeakError):
        check_no_leak([same_seed], held_out)
    same_text = Example(REFUND.format(n=3), "refunds", "baseline", "other-id", "refund_family", 99, 0)
    with pytest.raises(GateLeakError):
        check_no_leak([same_text], held_out)
    check_no_leak([Example(text, "refunds", "synthetic", "other-id", "refund_family", 1, 3)], held_out)


def test_a_baseline_opening_equal_to_a_held_out_one_of_another_task_is_left_out():
    """ToolSandbox: a scenario and its state-dependency variant open with the same request but sit in different
    halves. The gate leaves the baseline's copy out (it must not see a held-out opening) instead of refusing to
    train; the same text from the held-out instance itself, or a synthetic one, still stops the fit."""
    held_out = [_instance(3, "refund_family", REFUND.format(n=3), seed=77)]
    twin = Example(REFUND.format(n=3), "refunds", "baseline", "twin-of-another-task", "refund_family", None, 0)
    embedded = []

    def spy(texts):
        embedded.extend(texts)
        return fake_embed(texts)

    kept = [e for e in _examples() if not (e.source != "distractor" and e.text == REFUND.format(n=3))]
    record = fit_gate([*kept, twin], spy, CAPS, CFG, 0, held_out, FAKE)
    assert record.selection["shared_openings_dropped"] == ["twin-of-another-task"]
    assert REFUND.format(n=3) not in embedded
    assert "twin-of-another-task" not in {row["instance_id"] for row in record.training}
    for other in (twin.__class__(twin.text, "refunds", "synthetic", "syn-id", "refund_family", 5, 0),
                  twin.__class__(twin.text, "refunds", "baseline", held_out[0].instance_id, "refund_family", None, 0)):
        with pytest.raises(GateLeakError):
            fit_gate([*kept, other], fake_embed, CAPS, CFG, 0, held_out, FAKE)


def test_distractors_are_a_pure_function_of_the_seed_and_never_the_held_out_ones():
    assert distractors(3, 20) == distractors(3, 20) and distractors(3, 20)[:5] == distractors(3, 5)
    assert distractors(3, 20) != distractors(4, 20) and len(set(distractors(3, 40))) == 40
    drawn = {t for seed in range(3) for t in distractors(seed, 500)}
    assert not drawn & set(EVAL_DISTRACTORS) and len(EVAL_DISTRACTORS) == 10


def test_minilm_gate_sends_held_out_distractors_to_no_adapter():
    """The real representation: procedural openings of two families as two capabilities, 32 generated
    distractors; the 10 held-out distractors (other wording, other topics) must go to no adapter (issue #30: 9/10)."""
    from trace_core.analysis.embedding import embed_texts
    from trace_core.envs.procedural import generate_set
    from trace_core.routing.router import task_text

    families = {"single_write": "tool_call_precision", "identify_then_act": "identification"}
    examples = [example_of(i, task_text(i), families[i.family], "synthetic")
                for i in generate_set(list(families), 900, 8, 1)]
    examples += distractor_examples(0, 32)
    cfg = GateCfg(per_capability=8, distractors=32, synthetic_weights=[1.0], inverse_regularizations=[10.0], folds=5)
    gate = Gate(fit_gate(examples, embed_texts, list(families.values()), cfg, 0, [], FAKE), embed_texts)
    options = build_options([{"capability_id": c, "name": c, "definition": c} for c in families.values()])
    tops = [select(p, options, 0.0).top for p in gate.probabilities(options, list(EVAL_DISTRACTORS))]
    assert sum(t is None for t in tops) >= 9, tops
    held_out = generate_set(list(families), 5000, 3, 1)
    routed = [select(p, options, 0.0).top for p in gate.probabilities(options, [task_text(i) for i in held_out])]
    assert routed == [families[i.family] for i in held_out]


# ------------------------------------------------------------------ the grid's cross-validation (select_settings)
LATE = "my parcel {n} is late and the courier lost track of parcel {n}"
WRONG = "the parcel {n} has the wrong colour, the shirt {n} colour is wrong"


def _conflicting() -> list[Example]:
    """Synthetic openings that say the opposite of the target domain: in synthesis, late parcels are refunds and
    wrong colours addresses (40 each); in the baseline's labelled openings (10 each, the target's truth) it is the
    other way round. Only a small synthetic weight lets the baseline's openings decide."""
    out = [example_of(_instance(n, "syn_r", LATE.format(n=n), seed=100), LATE.format(n=n), "refunds", "synthetic")
           for n in range(40)]
    out += [example_of(_instance(n, "syn_a", WRONG.format(n=n), seed=100), WRONG.format(n=n), "address", "synthetic")
            for n in range(40)]
    out += [example_of(_instance(n, "late", LATE.format(n=n + 500), seed=1), LATE.format(n=n + 500), "address",
                       "baseline") for n in range(10)]
    out += [example_of(_instance(n, "wrong", WRONG.format(n=n + 500), seed=1), WRONG.format(n=n + 500), "refunds",
                       "baseline") for n in range(10)]
    return out + distractor_examples(0, 16)


@pytest.mark.parametrize("grid", [[1.0, 0.01], [0.01, 1.0]])
def test_cross_validation_picks_the_weighting_the_baseline_openings_favour(grid):
    cfg = GateCfg(per_capability=40, distractors=16, synthetic_weights=grid, inverse_regularizations=[1.0, 10.0],
                  folds=5)
    record = fit_gate(_conflicting(), fake_embed, CAPS, cfg, 0, [], FAKE)
    cv = record.selection["cv"]
    assert record.selection["synthetic_weight"] == 0.01, cv
    assert cv["openings"] == 20 and cv["instances"] == 20 and cv["folds"] == 5 and len(cv["grid"]) == 4
    by_weight = {(s["synthetic_weight"], s["inverse_regularization"]): s["accuracy"] for s in cv["grid"]}
    assert by_weight[(0.01, 1.0)] > by_weight[(1.0, 1.0)]
    # The refit follows the target: a new late parcel routes to address.
    top = select(Gate(record, fake_embed).probabilities(OPTIONS, [LATE.format(n=999)])[0], OPTIONS, 0.0).top
    assert top == "address"


def test_cross_validation_is_deterministic_and_ties_go_to_the_first_grid_point():
    cfg = GateCfg(per_capability=40, distractors=16, synthetic_weights=[1.0, 0.01], inverse_regularizations=[1.0],
                  folds=5)
    first = fit_gate(_conflicting(), fake_embed, CAPS, cfg, 0, [], FAKE).model_dump_json()
    assert fit_gate(_conflicting(), fake_embed, CAPS, cfg, 0, [], FAKE).model_dump_json() == first
    # Without baseline openings there is nothing to cross-validate on: the first grid point, said so.
    record = fit_gate(_examples(), fake_embed, CAPS, cfg, 0, [], FAKE)
    assert record.selection["cv"] is None and record.selection["synthetic_weight"] == 1.0
    # Fewer baseline openings per class than folds: fewer folds, not an error.
    few = [e for e in _conflicting() if e.source != "baseline" or e.index < 3]
    assert fit_gate(few, fake_embed, CAPS, cfg, 0, [], FAKE).selection["cv"]["folds"] == 3


def test_cross_validation_never_sees_an_evaluation_instance():
    """The leakage guard runs before any opening is embedded or cross-validated: a baseline opening of an evaluation
    instance stops the fit with nothing embedded; and the CV folds score baseline openings only."""
    examples = _conflicting()
    held_out = [_instance(3, "late", LATE.format(n=503), seed=1)]
    embedded = []

    def spy(texts):
        embedded.extend(texts)
        return fake_embed(texts)

    cfg = GateCfg(per_capability=40, distractors=16, synthetic_weights=[1.0, 0.01], inverse_regularizations=[1.0],
                  folds=5)
    with pytest.raises(GateLeakError):
        fit_gate(examples, spy, CAPS, cfg, 0, held_out, FAKE)
    assert embedded == []
    kept = [e for e in examples if e.instance_id != held_out[0].instance_id]
    record = fit_gate(kept, spy, CAPS, cfg, 0, held_out, FAKE)
    assert record.selection["cv"]["openings"] == sum(e.source == "baseline" for e in kept) == 19
    assert LATE.format(n=503) not in embedded
