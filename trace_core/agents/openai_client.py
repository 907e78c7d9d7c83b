"""The OpenAI-compatible policy backend: `OpenAIPolicy`, for any `/chat/completions` endpoint (vLLM, SGLang,
llama.cpp server, OpenAI); the interface and the `None`-on-overflow contract: `trace_core.agents.policy`."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from trace_core.agents.chat import to_openai_messages
from trace_core.agents.parsing import MAX_REPLY_CHARS, parse_assistant
from trace_core.agents.policy import PolicyError, Request, Sampling
from trace_core.schemas import Message, ToolCall

_CONTEXT_ERRORS = ("context_length_exceeded", "maximum context length", "context length", "too many tokens")
# This many "context too long" answers in a row (no successful reply between them) end the run with PolicyError:
# a server that says so to every request is misconfigured (its context is shorter than policy.max_context), and
# scoring every episode 0 as a context overflow would hide that.
MAX_CONSECUTIVE_CONTEXT_ERRORS = 16


def _checked_message(body: Any, url: str) -> dict:
    """`body["choices"][0]["message"]` after checking the shapes we read from it; PolicyError naming the field."""

    def bad(field: str, value: Any, want: str) -> PolicyError:
        return PolicyError(f"{url} returned a malformed reply: {field} is {type(value).__name__} "
                           f"({str(value)[:120]!r}), expected {want}; is the endpoint OpenAI-compatible?")

    if not isinstance(body, dict):
        raise bad("the body", body, "a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise bad("choices", choices, "a non-empty list")
    if not isinstance(choices[0], dict):
        raise bad("choices[0]", choices[0], "an object")
    msg = choices[0].get("message")
    if not isinstance(msg, dict):
        raise bad("choices[0].message", msg, "an object")
    content = msg.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise bad("choices[0].message.content", content, "a string, a list of parts or null")
    if isinstance(content, list):
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
                raise bad(f"choices[0].message.content[{i}]", part, 'an object with a "text" string')
    calls = msg.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise bad("choices[0].message.tool_calls", calls, "a list or null")
    for i, tc in enumerate(calls or []):
        if not isinstance(tc, dict):
            raise bad(f"choices[0].message.tool_calls[{i}]", tc, "an object")
        fn = tc.get("function")
        if fn is not None and not isinstance(fn, dict):
            raise bad(f"choices[0].message.tool_calls[{i}].function", fn, "an object")
        if tc.get("id") is not None and not isinstance(tc.get("id"), str):
            raise bad(f"choices[0].message.tool_calls[{i}].id", tc.get("id"), "a string")
    return msg


def _tool_call_from_openai(tc: dict, n: int) -> ToolCall:
    fn = tc.get("function") or {}
    name = fn.get("name")
    cid = tc.get("id") or f"call_{n}"
    if not isinstance(name, str) or not name.strip():
        return ToolCall(id=cid, name="invalid", parse_error="the server returned a tool call without a name")
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        return ToolCall(id=cid, name=name, arguments={})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            return ToolCall(id=cid, name=name, parse_error=f"arguments are not valid JSON: {exc}; got {args[:80]!r}")
    if not isinstance(args, dict):
        return ToolCall(id=cid, name=name, parse_error=f"arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(id=cid, name=name, arguments=args)


def _message_from_openai(choice_msg: dict) -> Message:
    content = choice_msg.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    content = content[:MAX_REPLY_CHARS] if isinstance(content, str) else content
    tcs = choice_msg.get("tool_calls") or []
    if tcs:
        calls = [_tool_call_from_openai(tc, n) for n, tc in enumerate(tcs)]
        return Message(role="assistant", content=content or None, tool_calls=calls)
    text = content or ""
    if "<tool_call>" in text:
        return parse_assistant(text)
    return Message(role="assistant", content=text or None, raw=text)


def _unreachable(url: str, exc: Exception) -> str:
    return (f"policy endpoint {url} is unreachable ({exc}); start the server or point policy.base_url "
            f"(or TRACE_POLICY_BASE_URL) at a running one")


class OpenAIPolicy:
    """Chat completions from an OpenAI-compatible server, `concurrency` requests in flight.

    An unreachable endpoint fails fast (one TCP connect check, then `PolicyError` naming the URL); HTTP 5xx,
    429 and timeouts are retried `max_retries` times with exponential backoff, then `PolicyError`. `timeout_s` is
    a total deadline per request, retries and a slowly trickled body included. A 4xx that says the context is too
    long gives None for that request (MAX_CONSECUTIVE_CONTEXT_ERRORS of them in a row: `PolicyError`). A reply
    of the wrong shape is a `PolicyError` naming the field. Returned messages keep the server's tool-call ids
    (later tool messages must answer them); `raw` is the reply text when the server sent no structured calls."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        concurrency: int,
        timeout_s: float,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        connect_timeout_s: float = 3.0,
    ):
        if not base_url:
            raise PolicyError("OpenAIPolicy needs a base_url (e.g. http://127.0.0.1:8000/v1)")
        if not model:
            raise PolicyError(f"OpenAIPolicy needs the model name served at {base_url}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.concurrency = max(1, int(concurrency))
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.name = f"openai:{model}"
        self._client: Any = None
        self._lock = threading.Lock()
        self._reachable_at = -1e9
        self._context_errors = 0  # consecutive "context too long" answers

    @property
    def url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def _http(self) -> Any:
        import httpx

        with self._lock:
            if self._client is None:
                headers = {"Content-Type": "application/json"}
                if self.api_key:
                    headers["Authorization"] = f"Bearer {self.api_key}"
                self._client = httpx.Client(
                    headers=headers,
                    timeout=httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                    limits=httpx.Limits(max_connections=self.concurrency),
                )
            return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def check_reachable(self) -> None:
        """One TCP connect to the endpoint's host:port; PolicyError naming the URL if it fails. A success is
        trusted for 30 s (a later connection failure still fails fast, in `_post`)."""
        if time.monotonic() - self._reachable_at < 30.0:
            return
        u = urlparse(self.base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise PolicyError(f"policy endpoint {self.base_url!r} is not an http(s) URL")
        port = u.port or (443 if u.scheme == "https" else 80)
        try:
            with socket.create_connection((u.hostname, port), timeout=self.connect_timeout_s):
                pass
        except OSError as exc:
            raise PolicyError(_unreachable(self.url, exc)) from None
        self._reachable_at = time.monotonic()

    def _post(self, payload: dict) -> dict | None:
        """One completion with retries, all within `timeout_s`; None when the server says the prompt is too long."""
        import httpx

        client = self._http()
        deadline = time.monotonic() + self.timeout_s
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
            try:
                status, body = self._send(client, payload, deadline)
            except httpx.ConnectError as exc:
                raise PolicyError(_unreachable(self.url, exc)) from None
            except (httpx.TimeoutException, TimeoutError) as exc:
                last = f"timeout ({type(exc).__name__}: {exc})"
                continue
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            text = body.decode("utf-8", errors="replace")
            if status >= 500 or status == 429:
                last = f"HTTP {status}: {text[:200]}"
                continue
            if status >= 400:
                if any(s in text.lower() for s in _CONTEXT_ERRORS):
                    self._context_error(text)
                    return None
                raise PolicyError(f"{self.url} answered HTTP {status}: {text[:300]}")
            try:
                reply = json.loads(text)
            except ValueError:
                last = f"HTTP {status} with a body that is not JSON: {text[:200]!r}"
                continue
            with self._lock:
                self._context_errors = 0
            return reply
        if time.monotonic() >= deadline:
            raise PolicyError(f"{self.url} gave no complete reply within policy.timeout_s={self.timeout_s:g} s "
                              f"(last error: {last or 'none'}); raise policy.timeout_s or check the server")
        raise PolicyError(f"{self.url} failed {self.max_retries + 1} times; last error: {last}")

    def _send(self, client: Any, payload: dict, deadline: float) -> tuple[int, bytes]:
        """(status, body) of one POST, read in chunks so that a body trickled slower than the per-read timeout
        still stops at `deadline` (TimeoutError)."""
        chunks: list[bytes] = []
        with client.stream("POST", self.url, json=payload) as r:
            for chunk in r.iter_bytes():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the reply was still arriving after {self.timeout_s:g} s")
            return r.status_code, b"".join(chunks)

    def _context_error(self, text: str) -> None:
        with self._lock:
            self._context_errors += 1
            n = self._context_errors
        if n >= MAX_CONSECUTIVE_CONTEXT_ERRORS:
            raise PolicyError(
                f"{self.url} answered 'context too long' to {n} requests in a row (last: {text[:200]!r}); the "
                f"served model's context is shorter than the prompts: serve it with a longer context or lower "
                f"policy.max_context / env.max_steps"
            )

    def _payload(self, messages: list[dict], tools: list[dict] | None, sampling: Sampling, seed: int) -> dict:
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": float(sampling.temperature),
            "top_p": float(sampling.top_p),
            "max_tokens": int(sampling.max_new_tokens),
            "seed": int(seed),
        }
        if tools:
            payload["tools"] = tools
        return payload

    def _run(self, payloads: list[dict]) -> list[dict | None]:
        if not payloads:
            return []
        self.check_reachable()
        if len(payloads) == 1 or self.concurrency == 1:
            return [self._post(p) for p in payloads]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(payloads))) as pool:
            return list(pool.map(self._post, payloads))

    def generate(self, requests: list[Request], sampling: Sampling) -> list[Message | None]:
        payloads = [
            self._payload(to_openai_messages(msgs), tools, sampling, sampling.seed + i)
            for i, (msgs, tools) in enumerate(requests)
        ]
        out: list[Message | None] = []
        for body in self._run(payloads):
            if body is None:
                out.append(None)
                continue
            out.append(_message_from_openai(_checked_message(body, self.url)))
        return out

    def complete_texts(self, conversations: list[list[dict]], sampling: Sampling) -> list[str | None]:
        payloads = [self._payload(conv, None, sampling, sampling.seed + i) for i, conv in enumerate(conversations)]
        texts: list[str | None] = []
        for body in self._run(payloads):
            if body is None:
                texts.append(None)
                continue
            content = _checked_message(body, self.url).get("content") or ""
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content)
            texts.append(content[:MAX_REPLY_CHARS])
        return texts
