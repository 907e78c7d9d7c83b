"""User simulators: the scripted user's rules, and the LLM user against a real (local) HTTP chat endpoint."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trace_core.envs.base import STOP, Environment
from trace_core.envs.users import LLMUser, ScriptedUser
from trace_core.schemas import Instance, Message, RewardResult, ToolCall
from tests.defaults import completer, default_limits, default_user, openai_policy

FACTS = {"name": "Ada Lovelace", "zip": "02139", "email": "ada@example.com", "order_id": "#W1234567"}


def _instance(opening: str | None = "I want to cancel an order.", facts: dict | None = None) -> Instance:
    return Instance(
        instance_id="test/users/0",
        source="synthetic",
        domain="retail",
        family="test",
        user_goal="Cancel order #W1234567 because it is no longer needed.",
        user_facts=dict(FACTS if facts is None else facts),
        opening=opening,
    )


def _convo(inst: Instance, user, *agent_lines: str) -> list[Message]:
    """Alternate agent lines with the user's replies; returns the whole message list."""
    msgs = [Message(role="system", content="policy"), user.opening(inst)]
    for line in agent_lines:
        msgs.append(Message(role="assistant", content=line))
        msgs.append(user.respond(inst, msgs))
    return msgs


def _replies(msgs: list[Message]) -> list[str]:
    return [m.content or "" for m in msgs[2:] if m.role == "user"]


# -- ScriptedUser -----------------------------------------------------------------------------------------------
def test_scripted_opening_is_the_instance_opening_or_goal():
    u = default_user()
    assert u.opening(_instance()).content == "I want to cancel an order."
    assert u.opening(_instance(opening=None)).content == _instance().user_goal


def test_scripted_reveals_only_what_is_asked():
    inst, u = _instance(), default_user()
    r = _replies(_convo(inst, u, "Could you give me your email address?"))[0]
    assert "ada@example.com" in r
    assert "02139" not in r and "Ada Lovelace" not in r and "#W1234567" not in r
    r = _replies(_convo(inst, u, "What is your name and zip code?"))[0]
    assert "Ada Lovelace" in r and "02139" in r and "ada@example.com" not in r
    r = _replies(_convo(inst, u, "Which order number is it?"))[0]
    assert "#W1234567" in r and "ada@example.com" not in r
    # a generic identification request gets every identifying fact at once
    r = _replies(_convo(inst, u, "First I need to verify your identity."))[0]
    assert all(v in r for v in FACTS.values())
    # no cue: no fact leaks, the user ends the conversation
    r = _replies(_convo(inst, u, "Our store opens at 9am."))[0]
    assert not any(v in r for v in FACTS.values())
    assert r.endswith(STOP)


def test_scripted_does_not_reveal_facts_it_lacks():
    inst, u = _instance(facts={"email": "ada@example.com"}), default_user()
    r = _replies(_convo(inst, u, "What is your zip code?"))[0]
    assert "02139" not in r and r.endswith(STOP)


def test_scripted_reveals_a_fact_once_then_repeats_it_only_when_asked_again():
    inst, u = _instance(), ScriptedUser(max_turns=10)
    msgs = _convo(inst, u, "Your email please?", "Sorry, could you repeat your email?", "Thanks, goodbye.")
    r = _replies(msgs)
    assert r[0].startswith("Sure,") and "ada@example.com" in r[0]
    assert r[1].startswith("As I said") and "ada@example.com" in r[1] and STOP not in r[1]
    assert r[2].endswith(STOP)


def test_scripted_confirms_at_most_twice():
    inst, u = _instance(), ScriptedUser(max_turns=10, max_confirmations=2)
    ask = "Shall I proceed with cancelling order? (yes/no)"
    r = _replies(_convo(inst, u, ask, ask, ask))
    assert r[0] == r[1] == "Yes, please go ahead."
    assert r[2].endswith(STOP)


def test_scripted_stops_when_agent_wraps_up():
    inst, u = _instance(), default_user()
    r = _replies(_convo(inst, u, "Your order has been cancelled. Have a nice day!"))
    assert r == [f"Thank you, that's all. {STOP}"]


def test_scripted_stops_after_max_turns():
    inst, u = _instance(), ScriptedUser(max_turns=3, max_confirmations=100)
    ask = "Do you want me to continue? (yes/no)"
    r = _replies(_convo(inst, u, *[ask] * 6))
    stops = [i for i, x in enumerate(r) if STOP in x]
    assert stops and stops[0] == 3  # three replies (plus the opening), then the user leaves
    assert r[3] == f"I have to go now. {STOP}"


def test_scripted_is_deterministic():
    inst = _instance()
    lines = ("Hello! What is your name?", "And your zip?", "Shall I proceed?", "Done. Bye.")
    a = _convo(inst, default_user(), *lines)
    b = _convo(inst, default_user(), *lines)
    assert [m.model_dump() for m in a] == [m.model_dump() for m in b]


# -- LLMUser against a real HTTP server --------------------------------------------------------------------------
class _ChatServer:
    """A tiny OpenAI-compatible /v1/chat/completions server on 127.0.0.1, in a thread. `reply(payload)` gives
    (status, body-dict-or-text); every request payload is recorded."""

    def __init__(self, reply: Callable[[dict], tuple[int, object]]):
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(n) or b"{}")
                outer.requests.append({"path": self.path, **payload})
                status, body = reply(payload)
                data = (json.dumps(body) if not isinstance(body, str) else body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # keep test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _completion(text: str) -> dict:
    return {
        "id": "cmpl-1",
        "object": "chat.completion",
        "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    }


def _completer(base_url: str) -> Callable[[list[dict]], str]:
    """The project's completer (`chat_completer` over `OpenAIPolicy`, with params.yaml's settings)."""
    return completer(openai_policy(base_url, "fake", max_retries=0, timeout_s=5, connect_timeout_s=2))


class _EchoEnv(Environment):
    """A one-tool environment for driving whole episodes without τ²."""

    domain = "test"

    def tool_schemas(self, instance=None):
        return [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {}}}}]

    def system_prompt(self, instance=None):
        return "You are a test agent."

    def _new_state(self, instance):
        return []

    def _execute(self, state, call: ToolCall):
        state.append(call.arguments)
        return json.dumps(call.arguments), False

    def score(self, instance, messages, termination_reason):
        return RewardResult(reward=float(termination_reason in ("agent_stop", "user_stop")))


def test_llm_user_talks_to_a_real_endpoint_and_truncates_at_the_stop_token():
    replies = iter(["Hi, I need to cancel order #W1234567.", f"Great, thanks! {STOP} and some trailing chatter"])
    with _ChatServer(lambda payload: (200, _completion(next(replies)))) as server:
        user = LLMUser(_completer(server.base_url), guidelines="You play a customer.")
        inst = _instance(opening=None)
        ep = _EchoEnv().start(inst, user, default_limits(max_steps=5))
        assert ep.messages[1].content == "Hi, I need to cancel order #W1234567."
        result = ep.step(Message(role="assistant", content="Done, your order is cancelled."))
    assert result.done and result.termination_reason == "user_stop"
    assert result.observations[0].content == f"Great, thanks! {STOP}"  # everything after the stop token is cut

    # the requests: OpenAI chat-completions shape, system prompt with the scenario, roles flipped
    assert [r["path"] for r in server.requests] == ["/v1/chat/completions"] * 2
    first, second = server.requests
    assert first["messages"][0]["role"] == "system"
    assert "You play a customer." in first["messages"][0]["content"]
    assert inst.user_goal in first["messages"][0]["content"] and "ada@example.com" in first["messages"][0]["content"]
    assert STOP in first["messages"][0]["content"]
    assert first["messages"][1] == {"role": "user", "content": "Hi! How can I help you today?"}
    assert [m["role"] for m in second["messages"]] == ["system", "assistant", "user"]
    assert second["messages"][1]["content"] == "Hi, I need to cancel order #W1234567."
    assert second["messages"][2]["content"] == "Done, your order is cancelled."


def test_llm_user_keeps_only_up_to_the_first_stop_token():
    text = f"Transfer me. ###TRANSFER### then {STOP} more"
    with _ChatServer(lambda payload: (200, _completion(text))) as server:
        user = LLMUser(_completer(server.base_url), guidelines="g")
        reply = user.respond(_instance(), [Message(role="assistant", content="Hello")])
    assert reply.content == "Transfer me. ###TRANSFER###"


def test_llm_user_empty_reply_means_stop():
    with _ChatServer(lambda payload: (200, _completion(""))) as server:
        reply = LLMUser(_completer(server.base_url), guidelines="g").respond(_instance(), [])
    assert reply.content == STOP


@pytest.mark.parametrize("failure", ["http500", "garbage", "refused"])
def test_failing_endpoint_ends_the_episode_with_a_stop(failure):
    def reply(payload):
        return (500, {"error": "boom"}) if failure == "http500" else (200, "this is not json")

    def run(base_url: str):
        user = LLMUser(_completer(base_url), guidelines="g")
        ep = _EchoEnv().start(_instance(), user, default_limits(max_steps=5))  # opening comes from the instance
        ep.step(Message(role="assistant", tool_calls=[ToolCall(name="echo", arguments={"x": 1})]))
        return ep, ep.step(Message(role="assistant", content="Anything else?"))

    if failure == "refused":
        with socket.socket() as s:  # a port that nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ep, result = run(f"http://127.0.0.1:{port}/v1")
    else:
        with _ChatServer(reply) as server:
            ep, result = run(server.base_url)
        assert server.requests, "the simulator never reached the server"
    assert result.done and result.termination_reason == "user_stop"
    assert "user simulator failed" in result.observations[0].content
    assert result.observations[0].content.endswith(STOP)
    assert ep.score().reward == 1.0  # the episode finished normally and can be scored
