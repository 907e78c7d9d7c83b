"""The resumable-run helpers every stage shares: run keys, claiming a folder, atomic JSON."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from trace_core import runs


def test_other_settings_discard_the_folder(tmp_path):
    folder = tmp_path / "cap"
    (folder / "checkpoints" / "checkpoint-1").mkdir(parents=True)
    (folder / "ledger.json").write_text("{}")
    runs.claim(folder, "key-a")
    assert (folder / "ledger.json").exists() is False and (folder / runs.RUN_KEY).read_text() == "key-a\n"
    (folder / "ledger.json").write_text("{}")
    runs.claim(folder, "key-a")  # same settings: a killed run's state is kept for resuming
    assert (folder / "ledger.json").exists()
    runs.claim(folder, "key-b")
    assert sorted(p.name for p in folder.iterdir()) == [runs.RUN_KEY]


def test_run_keys_are_the_ones_the_stages_computed_before():
    """Moving the three copies into one must not change a key (that would re-run every finished stage)."""
    data = {"training": {"lr": 1e-4, "steps": 3}, "spec_hash": "ab", "base": None}
    assert runs.run_key(data) == hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    assert runs.run_key({"b": 1, "a": [1, 2]}) == runs.run_key({"a": [1, 2], "b": 1}) != runs.run_key({"a": [2, 1]})
    assert runs.run_key({"path": __import__("pathlib").Path("x")}) == runs.run_key({"path": "x"})


def test_json_is_written_atomically_and_read_forgivingly(tmp_path, monkeypatch):
    path = tmp_path / "record.json"
    assert runs.read_json(path) is None
    runs.write_json_atomic(path, {"b": 1, "a": 2})
    assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n' and runs.read_json(path) == {"a": 2, "b": 1}

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        runs.write_json_atomic(path, {"a": 3})
    assert runs.read_json(path) == {"a": 2, "b": 1}  # the old file, never a torn one
    path.write_text('{"a": ')
    assert runs.read_json(path) is None


def test_text_and_csv_writers_make_parents_and_leave_no_temporary_file(tmp_path):
    text = runs.write_text_atomic(tmp_path / "a" / "b.jsonl", "one\ntwo\n")
    assert text.read_text() == "one\ntwo\n"
    table = runs.write_csv_atomic(tmp_path / "c" / "d.csv", ["x", "y"], [{"x": 0.5, "y": None, "z": "extra"}])
    assert table.read_text() == "x,y\n0.5000,\n"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["b.jsonl", "d.csv"]


def test_resume_state_lives_beside_the_stage_folders_outside_every_output(tmp_path):
    assert runs.resume_dir("artifacts/training/x") == Path("artifacts/resume/training/x")
    assert runs.resume_dir(tmp_path / "smoke" / "synthesis" / "x") == tmp_path / "smoke" / "resume" / "synthesis" / "x"
    out = tmp_path / "training" / "cap"
    assert not runs.resume_dir(out).is_relative_to(out.parent)  # never inside the stage's DVC outputs
