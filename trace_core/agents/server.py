"""A small OpenAI-compatible chat-completions server on loopback (standard library HTTP only).

It serves either a backend with `complete_texts(conversations, sampling)` (e.g. `LocalPolicy` around a local
model) or a plain function `messages -> str`, at `POST /v1/chat/completions` and `GET /v1/models`. It lets the
parts of the project that speak to an OpenAI-compatible endpoint (the LLM analyst, the user simulator) run
against the local model, and gives tests a real endpoint. Plain text only: no tools, no streaming, n = 1.

    python -m trace_core.agents.server --model smollm2 --port 8000
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from trace_core.agents.policy import Sampling

ROLES = ("system", "user", "assistant", "tool")


class BadRequest(ValueError):
    """The request body is not a valid chat-completions request (answered with HTTP 400)."""


def _content(value: Any, i: int) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):  # OpenAI's list-of-parts form: keep the text parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict) and p.get("type") == "text")
    raise BadRequest(f"messages[{i}].content must be a string, null or a list of text parts")


def parse_request(body: Any, default_max_tokens: int) -> tuple[list[dict], Sampling]:
    """The conversation (role/content dicts) and sampling settings of a request body; BadRequest says what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    conv = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role in {ROLES}")
        conv.append({"role": m["role"], "content": _content(m.get("content"), i)})
    if body.get("n", 1) != 1 or body.get("stream"):
        raise BadRequest("only n=1 without streaming is supported")

    def number(key: str, default: float, kind: type, low: float) -> Any:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
            raise BadRequest(f"'{key}' must be a number >= {low}")
        if kind is int and value != int(value):
            raise BadRequest(f"'{key}' must be an integer")
        return kind(value)

    sampling = Sampling(
        temperature=number("temperature", 0.0, float, 0.0),
        top_p=number("top_p", 1.0, float, 0.0),
        max_new_tokens=number("max_tokens", default_max_tokens, int, 1),
        seed=number("seed", 0, int, 0),
    )
    return conv, sampling


class ChatServer:
    """Serve `backend` on `host:port` (port 0 = a free port). Use as a context manager or `start()`/`stop()`;
    `base_url` is `http://127.0.0.1:<port>/v1`. Backend calls are serialised (a local model is not
    thread-safe). With `keep_requests` every request body is appended to `requests` (for tests)."""

    def __init__(
        self,
        backend: Any,
        model_name: str = "local",
        host: str = "127.0.0.1",
        port: int = 0,
        max_tokens: int = 256,
        keep_requests: bool = False,
    ):
        if not (hasattr(backend, "complete_texts") or callable(backend)):
            raise TypeError(
                "backend must have complete_texts(conversations, sampling) or be a messages -> str function"
            )
        self.backend = backend
        self.model_name = model_name
        self.host, self.port = host, port
        self.max_tokens = max_tokens
        self.keep_requests = keep_requests
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the server is not started; call start() or use it as a context manager")
        return f"http://{self.host}:{self._httpd.server_address[1]}/v1"

    def start(self) -> Self:
        self._httpd = ThreadingHTTPServer((self.host, self.port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def complete(self, conv: list[dict], sampling: Sampling) -> str | None:
        """The reply text; None when the prompt does not fit the backend's context."""
        with self._lock:
            if hasattr(self.backend, "complete_texts"):
                return self.backend.complete_texts([conv], sampling)[0]
            return str(self.backend(conv))

    def _tokens(self, text: str) -> int:
        # Usage is the text re-tokenized (close to, not exactly, what was generated); 0 without a tokenizer.
        tok = getattr(self.backend, "tokenizer", None)
        return len(tok(text, add_special_tokens=False)["input_ids"]) if tok is not None else 0

    def answer(self, body: Any) -> tuple[int, dict]:
        """(HTTP status, JSON body) for one chat-completions request."""
        if self.keep_requests:
            with self._lock:
                self.requests.append(body)
        try:
            conv, sampling = parse_request(body, self.max_tokens)
        except BadRequest as exc:
            return 400, _error(str(exc), "invalid_request_error")
        text = self.complete(conv, sampling)
        if text is None:
            return 400, _error("the prompt exceeds the model's maximum context length", "context_length_exceeded")
        n_prompt, n_reply = self._tokens("\n".join(m["content"] for m in conv)), self._tokens(text)
        return 200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_reply, "total_tokens": n_prompt + n_reply},
        }


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def _handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") != "/v1/models":
                return self._send(404, _error(f"no route GET {self.path}; try /v1/models", "not_found"))
            model = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "trace"}
            self._send(200, {"object": "list", "data": [model]})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self._send(404, _error(f"no route POST {self.path}; try /v1/chat/completions", "not_found"))
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                body = json.loads(raw or b"null")
            except ValueError as exc:
                return self._send(400, _error(f"the request body is not JSON: {exc}", "invalid_request_error"))
            try:
                self._send(*server.answer(body))
            except Exception as exc:  # noqa: BLE001 - the client gets a 500 with the reason, the server lives on
                self._send(500, _error(f"the backend failed: {type(exc).__name__}: {exc}", "server_error"))

        def log_message(self, *args: Any) -> None:  # quiet: the default logs every request to stderr
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    from trace_core.agents.local import LocalPolicy
    from trace_core.agents.model import load_model, load_tokenizer, provision_model

    ap = argparse.ArgumentParser(description="Serve a local model as an OpenAI-compatible chat endpoint.")
    ap.add_argument("--model", required=True, help="a Hugging Face model folder, an offline hub id, or 'smollm2'")
    ap.add_argument("--name", default="local", help="the model name clients send (default: local)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=256, help="reply length when a request sets no max_tokens")
    ap.add_argument("--cache-dir", default=".cache/models", help="where 'smollm2' is converted once")
    args = ap.parse_args(argv)
    path = provision_model(args.model, args.cache_dir)
    policy = LocalPolicy.from_model(
        load_model(path, dtype=args.dtype, threads=args.threads),
        load_tokenizer(path),
        threads=args.threads,
        batch_size=1,  # the server answers one request at a time
        max_context=args.max_context,
    )
    server = ChatServer(policy, args.name, args.host, args.port, max_tokens=args.max_tokens).start()
    print(f"serving {args.model} as {args.name!r} at {server.base_url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
