"""Stages synthesis, training, routing, baselines and evaluation on the ToolSandbox target with the tiny model (slow;
skipped without the extra): ToolSandbox's two templates synthesized and trained, a stand-in analysis, then every
method on one held-out scenario per family; the table reports mean similarity and the perfect count with
intervals, and the trained baselines ran on the target's own training split."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("tool_sandbox", reason="ToolSandbox extra not installed (bash scripts/install.sh --toolsandbox)")

from tests.evaluation.test_stage import synthesized_project  # noqa: E402
from tests.training.test_stage import TINY, TinyBase  # noqa: E402
from trace_core import baselines as baselines_stage  # noqa: E402
from trace_core import routing as routing_stage  # noqa: E402
from trace_core.config import load_params  # noqa: E402
from trace_core.envs.toolsandbox import split_instances  # noqa: E402
from trace_core.evaluation import stage  # noqa: E402
from trace_core.schemas import BaselinesRecord  # noqa: E402
from trace_core.training import run as train  # noqa: E402

CAPS = {"tool_call_precision": "single_tool_call", "precondition_verification": "multiple_tool_call"}

SETTINGS = {
    **TINY,
    "env.domain": "toolsandbox", "baseline.source": "toolsandbox", "evaluation.source": "toolsandbox",
    "baseline.tau2_split": "train", "evaluation.tau2_split": "test",
    "baseline.instances_per_family": 1, "evaluation.instances_per_family": 1,
    "synthesis.capabilities": list(CAPS),
    "synthesis.difficulty": 1,
    "training.keep_unlearned": True,  # a tiny model's adapters learn nothing; this test is about the methods
    "policy.max_context": 8192,
    "evaluation.curve_points": 1,
    "evaluation.bootstrap_samples": 50,
    "evaluation.router.answer_prefix": "",  # the tiny tokenizer has no " A" token
    "evaluation.gepa.minibatch": 1,
    "evaluation.gepa.train_instances": 2,
    "evaluation.gepa.val_instances": 1,
    "evaluation.gepa.max_new_tokens": 8,
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory, tiny_model, tokenizer) -> Path:
    root = tmp_path_factory.mktemp("toolsandbox-project")
    params, caps = synthesized_project(root, SETTINGS, CAPS)
    analysis = root / params.analysis.out_dir
    seen = split_instances("train", 1, params.baseline.seed)
    baseline = root / params.baseline.out_dir
    baseline.mkdir(parents=True)
    (baseline / "instances.jsonl").write_text("".join(i.model_dump_json() + "\n" for i in seen))
    by_family = {f: c for c, f in CAPS.items()}
    pd.DataFrame([{"instance_id": i.instance_id, "capability_id": by_family.get(i.family, next(iter(CAPS))),
                   "label": "LACKING", "success": False} for i in seen]).to_parquet(analysis / "labels.parquet")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        tiny = TinyBase(tiny_model, tokenizer)
        assert train(params, progress=False, base=tiny.agent())["trained"] == 2
        routing_stage.run(params, progress=False, base=tiny.agent())
        baselines_stage.run(params, progress=False, base=tiny.agent())
    finally:
        os.chdir(cwd)
    return root


def test_every_method_plays_toolsandbox_and_the_table_has_similarity(project, tiny_model, tokenizer, monkeypatch):
    monkeypatch.chdir(project)
    params = load_params(project / "params.yaml", SETTINGS)
    record = BaselinesRecord.model_validate_json((project / params.baselines.out_dir / "baselines.json").read_text())
    assert [(b.name, b.status) for b in record.baselines] == [("grpo_target", "done"), ("gepa", "done"),
                                                              ("mixture", "done")], record.baselines
    grpo = record.get("grpo_target").record
    assert grpo["environment"]["kind"] == "target_split" and grpo["environment"]["split"] == "toolsandbox:train"
    test_half = {i.instance_id for i in split_instances("test", None, 0)}
    gepa = record.get("gepa").record
    assert not (set(gepa["trainset"]) | set(gepa["valset"])) & test_half

    metrics = stage.run(params, progress=False, base=TinyBase(tiny_model, tokenizer).agent())
    out = project / params.evaluation.out_dir
    results = json.loads((out / "results.json").read_text())
    expected = {"base", "trace", *(f"single:{c}" for c in CAPS), "oracle", "merged_linear", "merged_ties",
                "mixture", "grpo_target", "gepa", "describe", "trace_label", "trace_channel", "trace_gate"}
    assert set(results["methods"]) == expected, results["warnings"]
    summary = results["summary"]
    assert summary["graded"] is True and summary["instances"] == 4
    for m in expected:
        entry = summary["methods"][m]
        assert 0.0 <= entry["similarity"]["value"] <= 1.0 and len(entry["similarity"]["ci"]) == 2
        assert entry["perfect"]["episodes"] == 4
        assert metrics[f"{m.replace(':', '-')}/perfect"] == entry["perfect"]["count"]
    table = (out / "table.md").read_text()
    assert "| mean similarity | perfect |" in table and " / 4 [" in table
