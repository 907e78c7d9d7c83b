"""Turn a model's assistant text into a `Message` with tool calls. Never raises.

Recognised, in this order:
1. `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the chat template's own format); the last
   block may be unclosed (generation stopped or the model forgot the closing tag). A block may also hold a JSON
   list of calls. When any `<tool_call>` tag is present, only the tagged blocks count as calls.
2. Otherwise a bare JSON object with "name" and "arguments" (or a list of such objects), also inside a
   ```json fence.

"arguments" may be an object or a JSON string that decodes to one; "parameters" is accepted as an alias; a
missing "arguments" means `{}`. Anything malformed becomes `ToolCall(name=<best guess or "invalid">,
arguments={}, parse_error=<why>)` so that the environment can answer with an error observation. Text outside
the calls becomes `content` (None when only whitespace remains). Calls get ids `call_<start_index + n>`.

Only the first `MAX_REPLY_CHARS` characters are parsed (content and calls come from that prefix; `raw` still keeps
the whole text). Parsing is linear in the text, so a runaway or hostile reply costs little (bench/parsing.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from trace_core.schemas import Message, ToolCall

INVALID_NAME = "invalid"

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|tool_call)?[ \t]*\n?(.*?)```", re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\\n]|\\.){1,200})"')
_CALL_START_RE = re.compile(r'[\[{]\s*\{?\s*"name"\s*:')
# End-of-turn markers a caller may leave in the text (we decode without special tokens, but be tolerant).
_TRAILERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>")
_MAX_SCAN = 256  # JSON decode attempts per message, to keep pathological text linear-ish
# A reply longer than this is parsed from its first MAX_REPLY_CHARS characters only; the rest is dropped (not an
# error). About 16k tokens: more than any one assistant turn needs (policy.max_new_tokens is 128 on CPU), small
# enough that a multi-megabyte reply from a runaway endpoint cannot stall an episode.
MAX_REPLY_CHARS = 64_000


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _raw_decode(text: str, pos: int) -> tuple[Any, int] | None:
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None


def _guess_name(fragment: str) -> str:
    m = _NAME_RE.search(fragment)
    if not m:
        return INVALID_NAME
    try:
        name = _loads(f'"{m.group(1)}"')
    except (ValueError, RecursionError):
        name = m.group(1)
    if not isinstance(name, str):
        return INVALID_NAME
    return name.strip() or INVALID_NAME


def _short(text: str, limit: int = 80) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _call_from_obj(obj: Any) -> ToolCall:
    """One decoded JSON value -> a ToolCall (with parse_error when it is not a well-formed call)."""
    if not isinstance(obj, dict):
        return ToolCall(name=INVALID_NAME, parse_error=f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(name=INVALID_NAME, parse_error='the tool call has no "name" string')
    name = name.strip()
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        args = {}
    if isinstance(args, str):
        if not args.strip():
            args = {}
        else:
            try:
                args = _loads(args)
            except (ValueError, RecursionError) as exc:
                return ToolCall(name=name, parse_error=f'"arguments" is a string that is not valid JSON: {exc}')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name=name, parse_error=f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(name=name, arguments=args)


def _calls_from_value(value: Any) -> list[ToolCall]:
    if isinstance(value, list):
        if not value:
            return [ToolCall(name=INVALID_NAME, parse_error="an empty list of tool calls")]
        return [_call_from_obj(v) for v in value]
    return [_call_from_obj(value)]


def _parse_block(body: str, closed: bool) -> list[ToolCall]:
    """The inside of one <tool_call> block."""
    text = body.strip()
    for trailer in _TRAILERS:
        if text.endswith(trailer):
            text = text[: -len(trailer)].rstrip()
    fence = _FENCE_RE.fullmatch(text)
    if fence:
        text = fence.group(1).strip()
    if not text:
        return [ToolCall(name=INVALID_NAME, parse_error="an empty <tool_call> block")]
    try:
        value = _loads(text)
    except (ValueError, RecursionError) as exc:
        # Tolerate trailing junk after a complete object (e.g. an extra closing brace).
        start = min((i for i in (text.find("{"), text.find("[")) if i >= 0), default=-1)
        decoded = _raw_decode(text, start) if start >= 0 else None
        if decoded is not None and isinstance(decoded[0], (dict, list)):
            value = decoded[0]
        else:
            why = "unclosed <tool_call> block with invalid JSON" if not closed else "invalid JSON in <tool_call>"
            return [ToolCall(name=_guess_name(text), parse_error=f"{why}: {exc}; got {_short(text)!r}")]
    return _calls_from_value(value)


def _looks_like_calls(value: Any) -> bool:
    def one(v: Any) -> bool:
        return isinstance(v, dict) and "name" in v and ("arguments" in v or "parameters" in v)

    if isinstance(value, list):
        return bool(value) and all(one(v) for v in value)
    return one(value)


def _scan_bare(text: str) -> tuple[list[ToolCall], list[tuple[int, int]]]:
    """Bare JSON calls in `text`: (calls, spans to cut out of the content)."""
    calls: list[ToolCall] = []
    spans: list[tuple[int, int]] = []
    attempts = 0
    pos = 0
    while attempts < _MAX_SCAN:
        m = _CALL_START_RE.search(text, pos)
        if not m:
            break
        attempts += 1
        start = m.start()
        decoded = _raw_decode(text, start)
        if decoded is not None and _looks_like_calls(decoded[0]):
            calls.extend(_calls_from_value(decoded[0]))
            spans.append((start, decoded[1]))
            pos = decoded[1]
            continue
        if decoded is None and text[start] == "{" and not calls:
            # A call that starts like one but does not parse: report it rather than treat it as chat.
            rest = text[start:]
            try:
                _loads(rest)
                err = "not a tool call"
            except (ValueError, RecursionError) as exc:
                err = str(exc)
            calls.append(
                ToolCall(name=_guess_name(rest), parse_error=f"invalid JSON tool call: {err}; got {_short(rest)!r}")
            )
            spans.append((start, len(text)))
            break
        pos = start + 1
    return calls, spans


def _strip_trailers(text: str) -> str:
    """`text` without the end-of-turn markers (and whitespace) at its end; one slice, however many there are."""
    end = len(text)
    changed = True
    while changed:
        changed = False
        stripped = end
        while stripped and text[stripped - 1].isspace():
            stripped -= 1
        for trailer in _TRAILERS:
            if text.endswith(trailer, 0, stripped):
                end = stripped - len(trailer)
                changed = True
    return text[:end] if end < len(text) else text


def _content(pieces: list[str]) -> str | None:
    text = "".join(pieces).strip()
    return text or None


def parse_assistant(text: str | None, start_index: int = 0) -> Message:
    """Parse one assistant turn. `raw` keeps `text` exactly; never raises."""
    raw = text if isinstance(text, str) else ""
    try:
        calls, content = _parse(raw[:MAX_REPLY_CHARS])
    except Exception as exc:  # noqa: BLE001 - a last guard: parsing must never take an episode down
        calls, content = [ToolCall(name=INVALID_NAME, parse_error=f"parser failure: {exc!r}")], None
    for i, call in enumerate(calls):
        call.id = f"call_{start_index + i}"
    return Message(role="assistant", content=content, tool_calls=calls or None, raw=raw)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _parse_tagged(text: str) -> tuple[list[ToolCall], str | None]:
    """Text with <tool_call> blocks. A block whose body is one complete JSON value followed by the closing tag
    (or the next block, or the end) is decoded as JSON first, so tags quoted inside argument strings do not cut
    it short; anything else ends at the next tag and is reported by `_parse_block`."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    pos = 0
    close_at = -1  # the first closing tag at or after the current block (len(text): none left); searched again only
    # once a block starts past it, so text full of opening tags without a closing one stays linear
    while (start := text.find(_OPEN, pos)) >= 0:
        pieces.append(text[pos:start])
        body = start + len(_OPEN)
        j = _skip_space(text, body)
        decoded = _raw_decode(text, j) if text[j : j + 1] in ("{", "[") else None
        if decoded is not None:
            k = _skip_space(text, decoded[1])
            if k == len(text) or text.startswith(_CLOSE, k) or text.startswith(_OPEN, k):
                calls.extend(_calls_from_value(decoded[0]))
                pos = k + len(_CLOSE) if text.startswith(_CLOSE, k) else k
                continue
        if close_at < body:
            close_at = text.find(_CLOSE, body)
            close_at = len(text) if close_at < 0 else close_at
        next_open = text.find(_OPEN, body)
        end = min(close_at, next_open if next_open >= 0 else len(text))
        closed = text.startswith(_CLOSE, end)
        calls.extend(_parse_block(text[body:end], closed))
        pos = end + len(_CLOSE) if closed else end
    pieces.append(text[pos:])
    return calls, _content([p.replace(_CLOSE, "") for p in pieces])


def _parse(raw: str) -> tuple[list[ToolCall], str | None]:
    text = _strip_trailers(raw)
    # A reply that is exactly one JSON call (or list of calls) is bare JSON, even if a string inside it quotes a tag.
    stripped = text.strip()
    whole = _raw_decode(stripped, 0) if stripped[:1] in ("{", "[") else None
    if whole is not None and whole[1] == len(stripped) and _looks_like_calls(whole[0]):
        return _calls_from_value(whole[0]), None
    if _OPEN in text:
        return _parse_tagged(text)

    # No tags: fenced JSON first, then bare JSON anywhere.
    calls = []
    pieces = []
    pos = 0
    for m in _FENCE_RE.finditer(text):
        inner = m.group(1).strip()
        try:
            value = _loads(inner)
        except (ValueError, RecursionError):
            continue
        if _looks_like_calls(value):
            pieces.append(text[pos : m.start()])
            calls.extend(_calls_from_value(value))
            pos = m.end()
    pieces.append(text[pos:])
    if calls:
        return calls, _content([p.replace(_CLOSE, "") for p in pieces])

    bare_calls, spans = _scan_bare(text)
    if not bare_calls:
        return [], _content([text.replace(_CLOSE, "")])
    pieces, pos = [], 0
    for a, b in spans:
        pieces.append(text[pos:a])
        pos = b
    pieces.append(text[pos:])
    return bare_calls, _content([p.replace(_CLOSE, "") for p in pieces])
