"""Oracle sweep over ToolSandbox's offline scenarios: the reference plan and the do-nothing agent, scored by
ToolSandbox's own evaluator through TRACE's adapter. Heavy (about 1 s per scenario on 2 cores): run it under
`flock /tmp/trace-heavy.lock`, in slices if needed, e.g.

    python bench/toolsandbox_oracle.py --start 0 --stop 270 --out artifacts/toolsandbox/oracle.jsonl

Rows are appended as JSON lines; `--summary FILE` prints the counts of a finished file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--stop", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("artifacts/toolsandbox/oracle.jsonl"))
    ap.add_argument("--summary", type=Path, default=None, help="only summarise this JSON-lines file")
    args = ap.parse_args(argv)
    if args.summary is not None:
        rows = [json.loads(line) for line in args.summary.read_text().splitlines() if line.strip()]
        perfect = [r for r in rows if r["oracle"] is not None and r["oracle"] >= 1 - 1e-6]
        nothing = [r["do_nothing"] for r in rows]
        print(json.dumps({
            "scenarios": len(rows), "oracle_perfect": len(perfect),
            "exceptions": [{k: r.get(k) for k in ("scenario", "oracle", "milestones", "why", "error")}
                           for r in rows if r not in perfect],
            "do_nothing_perfect": sum(1 for x in nothing if x >= 1 - 1e-6),
            "do_nothing_mean": round(sum(nothing) / max(1, len(nothing)), 4),
        }, indent=1))
        return 0
    from trace_core.envs.toolsandbox import scenario_instances
    from trace_core.envs.toolsandbox_plans import sweep

    instances = scenario_instances(offline_only=True)[args.start:args.stop]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for inst in instances:
            (row,) = sweep([inst])
            f.write(json.dumps(row) + "\n")
            f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
