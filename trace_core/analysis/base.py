"""What every labeller shares: the input item (a trajectory with its instance), the LabelSet a labeller returns,
capability-id slugs, and a compact text rendering of a trajectory for prompts and report excerpts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol

from trace_core.schemas import CapabilitySpec, Instance, LabelRow, Trajectory

LABELS = ("NA", "PRESENT", "LACKING")


@dataclass(frozen=True)
class Item:
    """One analysed episode. `instance` carries the reference actions (None when the target has none)."""

    trajectory: Trajectory
    instance: Instance | None = None

    @property
    def task_id(self) -> str:
        return self.trajectory.instance_id


@dataclass
class LabelSet:
    """A labeller's output: the capabilities it judged and one row per (run, trajectory, capability).
    `runs` is the number of independent labelling runs (1 for a deterministic labeller: repeating it would
    only repeat the same labels)."""

    capabilities: list[CapabilitySpec]
    rows: list[LabelRow] = field(default_factory=list)
    runs: int = 1


def label_row(run: int, item: Item, capability_id: str, label: str, labeller: str, note: str = "") -> LabelRow:
    """One judgement of `item` for the label table."""
    t = item.trajectory
    return LabelRow(
        run=run,
        trajectory_id=t.trajectory_id,
        instance_id=t.instance_id,
        success=t.success,
        capability_id=capability_id,
        label=label,
        labeller=labeller,
        note=note,
    )


class Labeller(Protocol):
    name: str

    def label(self, items: list[Item]) -> LabelSet: ...


class AnalysisError(RuntimeError):
    """The analysis cannot go on (bad input, an endpoint that keeps answering invalid JSON, ...)."""


_SLUG_RE = re.compile(r"[^a-z0-9]+")


def slugify(name: str, max_words: int = 6) -> str:
    """A snake_case capability id from a free-text name: "Tool-calling precision!" -> "tool_calling_precision"."""
    words = [w for w in _SLUG_RE.split(name.lower()) if w]
    slug = "_".join(words[:max_words])
    if not slug:
        raise ValueError(f"cannot make a capability id from {name!r}")
    if slug[0].isdigit():
        slug = "c_" + slug
    return slug


def unique_id(slug: str, taken: set[str]) -> str:
    """`slug`, or `slug_2`, `slug_3`, ... — the first not in `taken` (which is updated)."""
    out, n = slug, 2
    while out in taken:
        out, n = f"{slug}_{n}", n + 1
    taken.add(out)
    return out


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def render_step(message, limit: int = 300) -> str:
    """One message as one line: `assistant: text`, `call name {args}`, `tool[name]: result`, `user: text`."""
    if message.role == "assistant":
        parts = []
        if message.has_text():
            parts.append("assistant: " + _clip(message.content, limit))
        for call in message.tool_calls or []:
            if call.parse_error:
                parts.append(f"call <malformed: {_clip(call.parse_error, 120)}>")
            else:
                args = json.dumps(call.arguments, sort_keys=True, ensure_ascii=False)
                parts.append(f"call {call.name} {_clip(args, limit)}")
        return " | ".join(parts) if parts else "assistant: (empty)"
    if message.role == "tool":
        tag = "tool-error" if message.error else "tool"
        return f"{tag}[{message.name or ''}]: {_clip(message.content or '', limit)}"
    return f"{message.role}: {_clip(message.content or '', limit)}"


def compact_trajectory(trajectory: Trajectory, max_chars: int = 6000, step_chars: int = 300) -> str:
    """The trajectory as numbered one-line steps (system prompt left out), cut to `max_chars` by shortening the
    middle: the opening and the end of an episode carry most of what an analyst needs."""
    header = (
        f"task {trajectory.instance_id} | outcome: {'SUCCESS' if trajectory.success else 'FAILURE'} "
        f"(reward {trajectory.reward:.2f}, ended by {trajectory.termination_reason})"
    )
    lines = [f"{i}. {render_step(m, step_chars)}" for i, m in enumerate(trajectory.messages) if m.role != "system"]
    text = "\n".join([header, *lines])
    if len(text) <= max_chars:
        return text
    head, tail = [header], []
    budget = max_chars - len(header) - 40
    i, j = 0, len(lines) - 1
    while i <= j:  # alternate from both ends until the budget is spent
        for side in (0, 1):
            if i > j:
                break
            line = lines[i] if side == 0 else lines[j]
            if len(line) + 1 > budget:
                i = j + 1
                break
            budget -= len(line) + 1
            if side == 0:
                head.append(line)
                i += 1
            else:
                tail.insert(0, line)
                j -= 1
    return "\n".join([*head, f"... ({len(lines) - len(head) - len(tail) + 1} steps omitted) ...", *tail])
