"""The LLM analyst against a real OpenAI-compatible HTTP server on 127.0.0.1 (trace_core.agents.server): scripted
backends for discovery, labelling, retries and failures; the tiny local model for the wire format."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import pytest

from trace_core.agents.server import ChatServer
from trace_core.analysis.base import AnalysisError, Item
from trace_core.analysis.llm import LLMAnalyst, extract_json
from trace_core.config import AnalysisLLMCfg
from trace_core.schemas import CapabilitySpec, Message, Trajectory
from tests.defaults import local_policy

MARKER = "ZZ_WRONG_ORDER"


def cfg(base_url: str | None = None, **kw) -> AnalysisLLMCfg:
    values = {
        "base_url": base_url,
        "model": "scripted",
        "api_key_env": "TRACE_TEST_NO_KEY",
        "temperature": 0.7,
        "max_new_tokens": 256,
        "max_candidates": 10,
        "max_attempts": 3,
        "max_trajectory_chars": 2000,
        "discovery_trajectories": 4,
        "concurrency": 4,
        "timeout_s": 10,
    }
    values.update(kw)
    return AnalysisLLMCfg(**values)


def item(i: int, success: bool) -> Item:
    said = "Done, your order is cancelled." if success else f"I cancelled {MARKER} instead."
    traj = Trajectory(
        trajectory_id=f"traj_{i}",
        instance_id=f"task_{i}",
        domain="retail",
        family="x",
        source="procedural",
        messages=[
            Message(role="system", content="You are a retail agent."),
            Message(role="user", content=f"Please cancel order #W{i}."),
            Message(role="assistant", content=said),
        ],
        termination_reason="agent_stop",
        success=success,
        reward=1.0 if success else 0.0,
    )
    return Item(trajectory=traj)


ITEMS = [item(i, success=i % 2 == 0) for i in range(6)]  # task_0, 2, 4 succeed; 1, 3, 5 fail
CAPS = [
    CapabilitySpec(capability_id="data_reasoning", name="data reasoning", definition="Reads records.", labeller="llm"),
    CapabilitySpec(capability_id="tool_precision", name="tool precision", definition="Exact calls.", labeller="llm"),
]


def capability_ids(messages: list[dict]) -> list[str]:
    """The capability ids the labelling prompt lists (lines `- id: definition`)."""
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    block = first_user.split("Capabilities:\n", 1)[1].split("\n\nTrajectory:", 1)[0]
    return [line[2:].split(":", 1)[0] for line in block.splitlines()]


def label_reply(messages: list[dict]) -> str:
    text = messages[1]["content"]
    label = "LACKING" if MARKER in text else "PRESENT"
    task = re.search(r"task (task_\d+)", text).group(1)
    body = {cid: {"label": label, "reason": f"{task} {cid}"} for cid in capability_ids(messages)}
    return "Here are the labels:\n```json\n" + json.dumps(body) + "\n```"


DISCOVERY_REPLY = json.dumps(
    [
        {
            "name": "Structured data reasoning",
            "definition": "Picks  the right\nrecord.",
            "example_task_ids": ["task_1", "task_0", "nope"],
        },
        {"name": "structured-data reasoning", "definition": "A duplicate name.", "example_task_ids": [3, "task_3"]},
        {"name": "tool_calling_precision", "definition": "Exact arguments.", "example_task_ids": ["ghost"]},
    ]
)


def scripted(messages: list[dict]) -> str:
    if "propose" in messages[-1]["content"].lower():
        return "I propose these [see below]: " + DISCOVERY_REPLY
    return label_reply(messages)


@pytest.fixture()
def scripted_server():
    with ChatServer(scripted, model_name="scripted", keep_requests=True) as srv:
        yield srv


def test_extract_json_fenced_balanced_and_missing():
    assert extract_json('Sure.\n```json\n{"a": [1, 2]}\n```\nbye') == {"a": [1, 2]}
    assert extract_json('see [1] then {"a": "x}]{", "b": {"c": []}} trailing }', (dict,)) == {
        "a": "x}]{",
        "b": {"c": []},
    }
    assert extract_json("list: [1, [2, 3]] and {") == [1, [2, 3]]  # the first balanced value of either kind
    assert extract_json('[1] {"k": 1}', (dict,)) == {"k": 1}
    with pytest.raises(ValueError, match="no JSON object"):
        extract_json("no json here {broken", (dict,))


def test_discovery_then_labelling_runs(scripted_server):
    analyst = LLMAnalyst(cfg(scripted_server.base_url), n_runs=3, seed=11)
    result = analyst.label(ITEMS)

    ids = [c.capability_id for c in result.capabilities]
    assert ids == ["structured_data_reasoning", "structured_data_reasoning_2", "tool_calling_precision"]
    first = result.capabilities[0]
    assert first.name == "Structured data reasoning" and first.definition == "Picks the right record."
    assert first.labeller == "llm"
    assert [c.example_task_ids for c in result.capabilities] == [["task_1", "task_0"], ["task_3"], []]

    # one row per (run, trajectory, capability); LACKING exactly on the marked failures; the reason is the note
    assert result.runs == 3 and len(result.rows) == 3 * 6 * 3
    assert {(r.run, r.trajectory_id, r.capability_id) for r in result.rows} == {
        (run, it.trajectory.trajectory_id, c) for run in range(3) for it in ITEMS for c in ids
    }
    for r in result.rows:
        assert r.label == ("PRESENT" if r.success else "LACKING") and r.labeller == "llm"
        assert r.note == f"{r.instance_id} {r.capability_id}"

    # the server saw one discovery request (2 failures + 2 successes shown) and 18 labelling requests
    discovery, *labelling = scripted_server.requests
    prompt = discovery["messages"][1]["content"]
    assert prompt.count("=== trajectory") == 4 and prompt.count("FAILURE") == 2 and prompt.count("SUCCESS") == 2
    assert discovery["seed"] == 11 and discovery["temperature"] == 0.7 and discovery["model"] == "scripted"
    assert len(labelling) == 18
    assert "borderline between PRESENT and LACKING, answer PRESENT" in labelling[0]["messages"][0]["content"]
    assert all(b["max_tokens"] == 256 and b["temperature"] == 0.7 for b in scripted_server.requests)
    seeds: dict[str, set[int]] = {}
    for body in labelling:
        task = re.search(r"task (task_\d+)", body["messages"][1]["content"]).group(1)
        seeds.setdefault(task, set()).add(body["seed"])
    assert all(len(s) == 3 for s in seeds.values())  # each trajectory got another seed in every run


def test_discovery_is_deterministic_per_seed(scripted_server):
    def shown(seed: int) -> list[str]:
        scripted_server.requests.clear()
        LLMAnalyst(cfg(scripted_server.base_url), n_runs=1, seed=seed).discover(ITEMS)
        return re.findall(r"task (task_\d+)", scripted_server.requests[0]["messages"][1]["content"])

    assert shown(5) == shown(5)
    assert len({tuple(shown(s)) for s in range(6)}) > 1


def test_invalid_reply_is_retried_with_the_error_fed_back():
    followups: list[str] = []

    def flaky(messages: list[dict]) -> str:
        if len(messages) == 2:  # first attempt: prose without JSON, or a label outside NA/PRESENT/LACKING
            if "task_1" in messages[1]["content"]:
                return "I think the agent did fine overall."
            return json.dumps({c: {"label": "MAYBE", "reason": "?"} for c in capability_ids(messages)})
        followups.append(messages[-1]["content"])
        return label_reply(messages)

    with ChatServer(flaky, keep_requests=True) as srv:
        analyst = LLMAnalyst(cfg(srv.base_url), n_runs=1, seed=0, capabilities=CAPS)
        result = analyst.label(ITEMS[:2])
        assert len(srv.requests) == 4
        assert {b["seed"] for b in srv.requests[2:]}.isdisjoint({b["seed"] for b in srv.requests[:2]})
    assert len(result.rows) == 2 * 2
    assert any("no JSON object" in f for f in followups)
    assert any("label" in f and "NA" in f and "LACKING" in f for f in followups)  # the pydantic literal error


def test_missing_and_unknown_keys_are_invalid():
    followups: list[str] = []

    def partial(messages: list[dict]) -> str:
        if len(messages) == 2:
            return json.dumps({"data_reasoning": {"label": "NA"}, "made_up": {"label": "NA"}})
        followups.append(messages[-1]["content"])
        return label_reply(messages)

    with ChatServer(partial) as srv:
        result = LLMAnalyst(cfg(srv.base_url), n_runs=1, seed=0, capabilities=CAPS).label(ITEMS[:1])
    assert len(result.rows) == 2
    assert "missing capability ids: tool_precision" in followups[0] and "unknown keys: made_up" in followups[0]


def test_always_invalid_raises_naming_url_and_task():
    with ChatServer(lambda messages: "Sorry, I cannot produce JSON today.", keep_requests=True) as srv:
        analyst = LLMAnalyst(cfg(srv.base_url, max_attempts=2), n_runs=2, seed=0, capabilities=CAPS)
        with pytest.raises(AnalysisError) as err:
            analyst.label(ITEMS[:3])
        assert len(srv.requests) == 3 * 2  # every trajectory was tried twice before giving up
        url = srv.base_url
    msg = str(err.value)
    assert url + "/chat/completions" in msg
    assert "task task_0" in msg and "2 attempts" in msg and "Sorry, I cannot produce JSON" in msg


def test_unreachable_endpoint_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    analyst = LLMAnalyst(cfg(url), n_runs=2, seed=0)
    start = time.monotonic()
    with pytest.raises(AnalysisError, match=re.escape(url)):
        analyst.label(ITEMS)
    assert time.monotonic() - start < 5


def test_configuration_errors_and_env_override(monkeypatch):
    monkeypatch.delenv("TRACE_ANALYSIS_BASE_URL", raising=False)
    with pytest.raises(AnalysisError, match="analysis.llm.base_url"):
        LLMAnalyst(cfg(None), n_runs=1, seed=0)
    with pytest.raises(AnalysisError, match="analysis.llm.model"):
        LLMAnalyst(cfg("http://127.0.0.1:9/v1", model=None), n_runs=1, seed=0)
    monkeypatch.setenv("TRACE_ANALYSIS_BASE_URL", "http://127.0.0.1:9/env")
    assert (
        LLMAnalyst(cfg("http://127.0.0.1:9/v1"), n_runs=1, seed=0).endpoint == "http://127.0.0.1:9/env/chat/completions"
    )


def test_server_rejects_bad_requests(scripted_server):
    url = scripted_server.base_url
    with httpx.Client(timeout=5) as client:
        assert client.get(url + "/models").json()["data"][0]["id"] == "scripted"
        for body in (
            {"messages": []},
            {"messages": [{"role": "robot", "content": "x"}]},
            [1],
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        ):
            r = client.post(url + "/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["message"]
        r = client.post(url + "/chat/completions", content=b"{not json")
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
        assert client.get(url + "/nothing").status_code == 404


def test_tiny_local_model_served_and_analyst_fails_clearly(tiny_model, tokenizer):

    policy = local_policy(tiny_model, tokenizer, max_context=4096, threads=1)
    with ChatServer(policy, model_name="tiny", max_tokens=8) as srv:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Cancel order please"}],
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 6,
        }
        with httpx.Client(timeout=30) as client:
            replies = [client.post(srv.base_url + "/chat/completions", json=body).json() for _ in range(2)]
        out = replies[0]
        assert out["object"] == "chat.completion" and out["model"] == "tiny"
        choice = out["choices"][0]
        assert choice["index"] == 0 and choice["finish_reason"] == "stop"
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        assert out["usage"]["completion_tokens"] > 0 and out["usage"]["prompt_tokens"] > 0
        assert replies[1]["choices"][0]["message"]["content"] == choice["message"]["content"]  # same seed

        analyst = LLMAnalyst(
            cfg(srv.base_url, model="tiny", max_new_tokens=16, max_attempts=2, max_trajectory_chars=300),
            n_runs=1,
            seed=0,
            capabilities=CAPS[:1],
        )
        with pytest.raises(AnalysisError) as err:
            analyst.label(ITEMS[1:2])
        assert srv.base_url in str(err.value) and "task_1" in str(err.value)
