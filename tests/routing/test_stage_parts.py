"""Stage routing's pure parts: the family -> capability map of analysis (the routing reference) and the saved
router probabilities a resumed run reuses."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from trace_core.config import load_params
from trace_core.routing.stage import _cached_probabilities, family_capabilities

ROOT = Path(__file__).resolve().parents[2]



def _params(tmp_path: Path, **overrides):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    return load_params(tmp_path / "params.yaml", overrides)



def test_saved_router_probabilities_are_reused_only_when_whole(tmp_path):
    path = tmp_path / "routing.json"
    assert _cached_probabilities(path, 2) is None  # missing
    path.write_text(json.dumps([{"A": 0.75, "B": 0.25}, {"A": 0.1, "B": 0.9}]))
    assert _cached_probabilities(path, 2) == [{"A": 0.75, "B": 0.25}, {"A": 0.1, "B": 0.9}]
    assert _cached_probabilities(path, 3) is None  # saved for another number of tasks
    path.write_text(path.read_text()[:-7])  # torn by a kill
    assert _cached_probabilities(path, 2) is None
    path.write_text(json.dumps({"A": 1.0}))
    assert _cached_probabilities(path, 1) is None



def test_family_map_from_analysis_labels(tmp_path):
    params = _params(tmp_path, **{"analysis.out_dir": str(tmp_path / "an"), "baseline.out_dir": str(tmp_path / "bl")})
    (tmp_path / "an").mkdir()
    (tmp_path / "bl").mkdir()
    family = {"i1": "f1", "i2": "f1", "i3": "f2", "i4": "f3"}
    (tmp_path / "bl" / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "family": f}) + "\n" for i, f in family.items())
    )
    rows = [  # (instance, success, capability, label)
        ("i1", False, "x", "LACKING"), ("i2", False, "x", "LACKING"), ("i2", False, "y", "LACKING"),
        ("i3", False, "y", "LACKING"), ("i3", False, "z", "LACKING"), ("i3", False, "z", "LACKING"),
        ("i4", True, "x", "LACKING"), ("i4", False, "x", "PRESENT"),
    ]
    pd.DataFrame(rows, columns=["instance_id", "success", "capability_id", "label"]).to_parquet(
        tmp_path / "an" / "labels.parquet"
    )
    # z is not a trained adapter, so f2 maps to y; f3 has no failed run lacking anything.
    assert family_capabilities(params, ["x", "y"]) == {"f1": "x", "f2": "y", "f3": None}
    assert family_capabilities(params, ["x", "y"], rule="prevalent") == {"f1": "x", "f2": "y", "f3": None}
    with pytest.raises(ValueError, match="rule must be one of"):
        family_capabilities(params, ["x", "y"], rule="most")



def test_family_map_specific_rule_picks_the_deficit_that_sets_a_family_apart(tmp_path):
    """x is lacking in every failed run of both families, y only in f2's: the prevalent rule maps both families to
    x (a constant oracle), the specific rule gives f2 the deficit that distinguishes it."""
    params = _params(tmp_path, **{"analysis.out_dir": str(tmp_path / "an"), "baseline.out_dir": str(tmp_path / "bl")})
    (tmp_path / "an").mkdir()
    (tmp_path / "bl").mkdir()
    family = {"a1": "f1", "a2": "f1", "b1": "f2", "b2": "f2", "b3": "f2"}
    (tmp_path / "bl" / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "family": f}) + "\n" for i, f in family.items())
    )
    rows = [(i, False, "x", "LACKING") for i in family]
    rows += [("a1", False, "y", "PRESENT"), ("a2", False, "y", "NA"), ("b1", False, "y", "LACKING"),
             ("b2", False, "y", "LACKING"), ("b3", False, "y", "PRESENT"),
             ("a1", True, "y", "LACKING")]  # a successful run's label never counts
    pd.DataFrame(rows, columns=["instance_id", "success", "capability_id", "label"]).to_parquet(
        tmp_path / "an" / "labels.parquet"
    )
    assert family_capabilities(params, ["x", "y"], rule="prevalent") == {"f1": "x", "f2": "x"}
    assert family_capabilities(params, ["x", "y"]) == {"f1": "x", "f2": "y"}
    # One family alone: no other family to contrast with, so the specific rule is the prevalent one.
    (tmp_path / "bl" / "instances.jsonl").write_text(
        "".join(json.dumps({"instance_id": i, "family": "f2"}) + "\n" for i in ("b1", "b2", "b3"))
    )
    assert family_capabilities(params, ["x", "y"]) == family_capabilities(params, ["x", "y"], rule="prevalent")
    assert family_capabilities(params, ["x", "y"]) == {"f2": "x"}
