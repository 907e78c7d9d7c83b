"""Benchmark: `parse_assistant` on hostile replies (issue #35): many unclosed `<tool_call>` tags, repeated end-of-turn
markers, and a multi-megabyte reply. Prints seconds per shape, for the capped entry point and for the parser on
the whole text (`_parse`, no `MAX_REPLY_CHARS` cap), and the 64k/16k-tag time ratio (about 4 when linear).

    .venv/bin/python bench/parsing.py
    .venv/bin/python bench/parsing.py --repeat 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best(fn, text: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(text)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    from trace_core.agents.parsing import MAX_REPLY_CHARS, _parse, parse_assistant

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per shape; the best is shown (default 3)")
    args = ap.parse_args(argv)
    shapes = {
        "16,000 unclosed tags (176 KB)": "<tool_call>" * 16_000,
        "64,000 unclosed tags (704 KB)": "<tool_call>" * 64_000,
        "8 MB of unclosed tags": "<tool_call>" * (8_000_000 // len("<tool_call>")),
        "200,000 trailing </s> (800 KB)": "hi" + "</s>" * 200_000,
    }
    print(f"MAX_REPLY_CHARS = {MAX_REPLY_CHARS:,}")
    print(f"{'shape':<34} {'parse_assistant s':>18} {'uncapped _parse s':>18}")
    rows = {}
    for name, text in shapes.items():
        capped = best(parse_assistant, text, args.repeat)
        whole = best(_parse, text, args.repeat) if len(text) < 1_000_000 else float("nan")
        rows[name] = whole
        print(f"{name:<34} {capped:>18.4f} {whole:>18.4f}")
    small, big = rows["16,000 unclosed tags (176 KB)"], rows["64,000 unclosed tags (704 KB)"]
    print(f"uncapped 64k/16k-tag ratio: {big / small:.2f} (4 = linear)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
