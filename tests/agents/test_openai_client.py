"""The OpenAI-compatible client against hostile stub servers (issue #35): malformed replies, a trickled body, a
server that says "context too long" to everything, a dead port, and the CLI's one-line error."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trace_core.agents.openai_client import MAX_CONSECUTIVE_CONTEXT_ERRORS
from trace_core.agents.policy import PolicyError
from trace_core.schemas import Message
from tests.defaults import default_sampling, openai_policy

REQUEST = ([Message(role="system", content="s"), Message(role="user", content="hi")], [])


def _serve(handle):
    """A local server whose POST handler is `handle(handler)`; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            handle(self)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/v1"


def _json_reply(body, status: int = 200):
    def handle(h):
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return handle


@pytest.mark.parametrize(
    "body, field",
    [
        ({"choices": [{"message": "hello"}]}, "choices[0].message is str"),
        ({"choices": [{"message": {"content": 42}}]}, "choices[0].message.content is int"),
        ({"choices": [{"message": {"content": None, "tool_calls": {"name": "x"}}}]}, "tool_calls is dict"),
        ({"choices": [{"message": {"tool_calls": ["call"]}}]}, "tool_calls[0] is str"),
        ({"choices": [{"message": {"tool_calls": [{"function": "f"}]}}]}, "tool_calls[0].function is str"),
        ({"choices": {"0": {}}}, "choices is dict"),
        ([1, 2], "the body is list"),
        ({"choices": [{"message": {"content": [3]}}]}, "content[0] is int"),
    ],
)
def test_malformed_replies_are_policy_errors_naming_the_field(body, field):
    srv, url = _serve(_json_reply(body))
    try:
        policy = openai_policy(url, "m", max_retries=0)
        with pytest.raises(PolicyError, match=field.replace("[", r"\[").replace("]", r"\]")):
            policy.generate([REQUEST], default_sampling())
        with pytest.raises(PolicyError, match="malformed"):
            policy.complete_texts([[{"role": "user", "content": "hi"}]], default_sampling())
    finally:
        srv.shutdown()


@pytest.mark.timeout(60)
def test_a_trickled_reply_stops_at_the_total_deadline():
    stop = threading.Event()

    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "100000")
        h.end_headers()
        try:
            while not stop.is_set():
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    srv, url = _serve(trickle)
    try:
        policy = openai_policy(url, "m", timeout_s=2.0)  # each byte comes well within the per-read timeout
        start = time.monotonic()
        with pytest.raises(PolicyError, match="timeout_s"):
            policy.generate([REQUEST], default_sampling())
        assert time.monotonic() - start < 3 * 2.0
    finally:
        stop.set()
        srv.shutdown()


def test_a_server_that_always_says_context_too_long_ends_the_run():
    srv, url = _serve(_json_reply({"error": {"message": "This model's maximum context length is 8 tokens"}}, 400))
    try:
        policy = openai_policy(url, "m")
        results = [policy.generate([REQUEST], default_sampling())[0] for _ in range(MAX_CONSECUTIVE_CONTEXT_ERRORS - 1)]
        assert results == [None] * (MAX_CONSECUTIVE_CONTEXT_ERRORS - 1)  # one overflow is an episode's end
        with pytest.raises(PolicyError, match="context too long.*in a row"):
            policy.generate([REQUEST], default_sampling())
    finally:
        srv.shutdown()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_endpoint_is_one_line_naming_the_url_and_the_fix():
    url = f"http://127.0.0.1:{_dead_port()}/v1"
    with pytest.raises(PolicyError) as info:
        openai_policy(url, "m").generate([REQUEST], default_sampling())
    msg = str(info.value)
    assert "\n" not in msg and f"{url}/chat/completions" in msg and "policy.base_url" in msg


def test_cli_prints_one_line_for_a_policy_error(monkeypatch, capsys):
    from trace_core import cli

    def failing(params, args):
        raise PolicyError("policy endpoint http://127.0.0.1:9/v1/chat/completions is unreachable")

    monkeypatch.setattr(cli, "_cmd_baseline", failing)
    assert cli.main(["baseline", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "trace baseline: policy endpoint" in err and "Traceback" not in err
