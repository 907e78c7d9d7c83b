"""Conversions between our `Message`s and the formats models read.

- `to_hf_messages`: chat dicts for `tokenizer.apply_chat_template` (assistant tool calls as
  `{"type": "function", "function": {"name", "arguments": dict}}`, tool results as role "tool").
- `to_openai_messages`: the OpenAI chat-completions wire format (tool-call arguments as JSON strings, ids).
- `render_prompt`: the prompt text a local model continues (generation prompt included).
- `render_assistant`: the text of one assistant turn exactly as the chat template writes it after the
  generation prompt, ending with the end-of-turn token. Supervised warm-start trains on this text, so the model
  learns the template's own format, and `parse_assistant(render_assistant(m))` gives `m`'s calls back.

Assistant turns a local model produced keep its exact text in `raw`. With `prefer_raw=True` (the default for
`render_prompt`) such a turn is written back into later prompts as that text, not re-rendered from the parsed
calls: the model then sees what it actually said (including malformed calls), and the prompt tokens stay
consistent with the sampled `token_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from trace_core.schemas import Message, ToolCall

END_OF_TURN = "<|im_end|>"


def _uses_raw(m: Message, prefer_raw: bool) -> bool:
    return prefer_raw and m.role == "assistant" and isinstance(m.raw, str) and m.raw != ""


def to_hf_messages(messages: Iterable[Message], prefer_raw: bool = False) -> list[dict[str, Any]]:
    """Our messages as chat-template dicts. `content` None becomes "" (templates concatenate strings)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if _uses_raw(m, prefer_raw):
            out.append({"role": "assistant", "content": m.raw})
            continue
        d: dict[str, Any] = {"role": m.role, "content": m.content if m.content is not None else ""}
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.role == "tool":
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
        out.append(d)
    return out


def to_openai_messages(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """Our messages in the OpenAI chat-completions format. Tool calls need ids there: a call without one gets
    `call_<turn>_<n>`, and a tool message without `tool_call_id` answers the preceding call in order."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant turn's calls not yet answered
    for turn, m in enumerate(messages):
        if m.role == "assistant":
            d: dict[str, Any] = {"role": "assistant", "content": m.content}
            if m.tool_calls:
                calls = []
                pending = []
                for n, c in enumerate(m.tool_calls):
                    cid = c.id or f"call_{turn}_{n}"
                    pending.append(cid)
                    calls.append(
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
                        }
                    )
                d["tool_calls"] = calls
            elif m.content is None:
                d["content"] = ""
            out.append(d)
        elif m.role == "tool":
            cid = m.tool_call_id or (pending[0] if pending else "call_unknown")
            if cid in pending:
                pending.remove(cid)
            d = {"role": "tool", "tool_call_id": cid, "content": m.content or ""}
            if m.name:
                d["name"] = m.name
            out.append(d)
        else:
            out.append({"role": m.role, "content": m.content or ""})
    return out


def render_prompt(
    tokenizer: Any, messages: list[Message], tools: list[dict] | None = None, prefer_raw: bool = True
) -> str:
    """The text a local model continues: the conversation rendered by the tokenizer's chat template with the
    tool schemas and the generation prompt."""
    return tokenizer.apply_chat_template(
        to_hf_messages(messages, prefer_raw=prefer_raw),
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=False,
    )


def render_conversation(
    tokenizer: Any, messages: list[Message], tools: list[dict] | None = None, prefer_raw: bool = True
) -> str:
    """A whole conversation as the template writes it (no generation prompt): a training example's text."""
    return tokenizer.apply_chat_template(
        to_hf_messages(messages, prefer_raw=prefer_raw),
        tools=tools or None,
        add_generation_prompt=False,
        tokenize=False,
    )


def _as_message(turn: Message | list[ToolCall] | None, content: str | None) -> Message:
    if isinstance(turn, Message):
        return turn
    return Message(role="assistant", content=content, tool_calls=list(turn) if turn else None)


def _qwen25_assistant(m: Message) -> str:
    """TRL's Qwen2.5 template's assistant turn, after `<|im_start|>assistant\\n` (see chat_template_utils)."""
    if not m.tool_calls:
        return (m.content or "") + END_OF_TURN
    text = m.content or ""
    for c in m.tool_calls:
        # The template's `tojson` is json.dumps with ensure_ascii=False and default separators.
        args = json.dumps(c.arguments, ensure_ascii=False)
        text += '\n<tool_call>\n{"name": "' + c.name + '", "arguments": ' + args + "}\n</tool_call>"
    if not m.content:
        text = text[1:]  # the generation prompt already ends with the newline the template writes here
    return text + END_OF_TURN


_PROBE = [{"role": "user", "content": "\x00probe\x00"}]


def render_assistant(
    turn: Message | list[ToolCall] | None = None,
    content: str | None = None,
    tokenizer: Any = None,
    end_of_turn: bool = True,
) -> str:
    """The text of one assistant turn as the chat template renders it after the generation prompt.

    `turn` is an assistant Message, or a list of ToolCalls (with `content` as its text). Without a tokenizer the
    TRL Qwen2.5 layout is written directly; with one, the tokenizer's own template is asked (render a probe
    conversation with and without the turn and take the difference), so any template works. The result ends
    with the end-of-turn token unless `end_of_turn=False`."""
    m = _as_message(turn, content)
    if tokenizer is None:
        text = _qwen25_assistant(m)
        eot = END_OF_TURN
    else:
        prefix = tokenizer.apply_chat_template(_PROBE, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(
            _PROBE + to_hf_messages([m.model_copy(update={"raw": None})]), add_generation_prompt=False, tokenize=False
        )
        if not full.startswith(prefix):
            raise ValueError("the chat template does not render an assistant turn as a continuation of its prompt")
        text = full[len(prefix) :]
        eot = getattr(tokenizer, "eos_token", None) or END_OF_TURN
        cut = text.rfind(eot)
        if cut >= 0:
            text = text[: cut + len(eot)]
    if not end_of_turn and text.endswith(eot):
        text = text[: -len(eot)]
    return text
