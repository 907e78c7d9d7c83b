"""JSONL lines survive the line separators JSON leaves raw (issue #35)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.jsonl import iter_jsonl, jsonl_line, jsonl_lines, jsonl_text
from trace_core.schemas import Message, Trajectory

SEPARATORS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e\r"


def _trajectory(text: str) -> Trajectory:
    return Trajectory(
        trajectory_id="t/0", instance_id="i/0", domain="retail", family="f", source="procedural", trial=0,
        policy="p", messages=[Message(role="assistant", content=text)], termination_reason="agent_stop",
        num_steps=1, reward=1.0, success=True,
    )


def test_a_trajectory_with_every_separator_round_trips(tmp_path):
    text = f"before{SEPARATORS}after \u2028 and \u2029 and \u0085"
    traj = _trajectory(text)
    path = tmp_path / "t.jsonl"
    path.write_text(jsonl_text([traj.model_dump_json(), json.dumps({"x": text}, ensure_ascii=False)]), "utf-8")
    assert "\u2028" not in path.read_text("utf-8")  # escaped on the way out
    first, second = iter_jsonl(path)
    assert Trajectory.model_validate_json(first) == traj
    assert json.loads(second) == {"x": text}


def test_files_written_raw_before_the_escaping_still_read():
    raw = json.dumps({"x": "a\u2028b\u0085c"}, ensure_ascii=False) + "\n"
    assert [json.loads(line) for line in jsonl_lines(raw)] == [{"x": "a\u2028b\u0085c"}]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(), min_size=1, max_size=5))
def test_any_text_round_trips(texts):
    lines = jsonl_lines(jsonl_text(json.dumps({"t": t}, ensure_ascii=False) for t in texts))
    assert [json.loads(line)["t"] for line in lines] == texts
    assert all(jsonl_line(json.dumps(t, ensure_ascii=False)).count("\n") == 1 for t in texts)


def test_a_missing_file_has_no_lines(tmp_path):
    assert list(iter_jsonl(tmp_path / "nope.jsonl")) == []
