"""JSON Lines as every stage writes and reads them: one JSON document per "\\n"-terminated line.

JSON allows U+2028, U+2029 and U+0085 raw inside strings, and Python's `str.splitlines()` splits on them, so a
record whose text holds one (a model reply, a user message) was cut in two on reading and lost (issue #35: a
resumed run replayed such finished episodes and dropped them). Writers escape the three (`jsonl_line`); readers
split on "\\n" only (`jsonl_lines`, `iter_jsonl`), which also reads files written before the escaping.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

_ESCAPES = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def jsonl_line(json_text: str) -> str:
    """One JSON document (as `json.dumps` or `model_dump_json` wrote it, on one line) as a JSONL line: the line
    separators that JSON leaves raw are escaped (they only occur inside strings, so the value is unchanged) and a
    "\\n" ends it."""
    return json_text.translate(_ESCAPES) + "\n"


def jsonl_text(json_texts: Iterable[str]) -> str:
    """Several documents as the text of a JSONL file."""
    return "".join(jsonl_line(t) for t in json_texts)


def jsonl_lines(text: str) -> list[str]:
    """The non-blank lines of JSONL `text`, split on "\\n" only (never on U+2028, U+2029, U+0085, \\v, \\f...)."""
    return [line for line in text.split("\n") if line.strip()]


def iter_jsonl(path: str | os.PathLike) -> Iterator[str]:
    """The non-blank lines of the JSONL file at `path` (UTF-8), split on "\\n" only; nothing when it is missing."""
    p = Path(path)
    if not p.exists():
        return iter(())
    return iter(jsonl_lines(p.read_text(encoding="utf-8")))
