"""Measure chosen calibration positions of one template against the base agent, without walking the ladder.

Plays `synthesis.calibration`'s seeds x samples (temperature, hint share and band from params) at each position
given, and prints per position: verdict, mean reward, success rate, share of informative groups (and all-success /
all-zero groups, reward std) and how the rollouts ended. The base agent is the bootstrap output under
`bootstrap.out_dir` (or the model as configured when bootstrap is disabled), as the synthesis stage uses it.

    .venv/bin/python bench/calibration_positions.py multi_step_completion d0p3 d0p4 \\
        -S bootstrap.out_dir=/work/run/artifacts/bootstrap --out /tmp/cal
    .venv/bin/python bench/calibration_positions.py structured_data_reasoning d0p5 -S synthesis.calibration.seeds=8

With `--out DIR`: DIR/<template>/<position>.jsonl keeps each position's trajectories (a rerun with the same
settings and model reads them back instead of replaying; delete the folder after changing either) and
DIR/<template>/positions.json the records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("template", help="template name (trace_core/synthesis/templates/)")
    ap.add_argument("positions", nargs="+", help="knob positions as reports name them: d1, d0p4, d2-3")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE", help="params override")
    ap.add_argument("--out", type=Path, default=None, help="keep trajectories and records here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from trace_core.cli import parse_overrides
    from trace_core.config import load_params
    from trace_core.synthesis.calibration import measure_positions
    from trace_core.synthesis.contract import label, parse_label
    from trace_core.synthesis.stage import BaseAgentFactory, calibration_rollout, position_reporter
    from trace_core.synthesis.templates import make

    params = load_params(args.params, parse_overrides(args.set))
    try:
        positions = [parse_label(p) for p in args.positions]
        make(args.template)  # an unknown template fails here, before the model loads
    except ValueError as exc:
        ap.error(str(exc))
    folder = args.out / args.template if args.out else None
    cfg, rollout = calibration_rollout(params, BaseAgentFactory(params), folder, progress=False)
    records = measure_positions(
        lambda d, s, b: make(args.template, None, d, params.env.profile, scaffold=s, blend=b), positions, rollout, cfg,
        describe=rollout.describe, on_try=position_reporter(args.template))
    print(f"{args.template}: {cfg.seeds} seeds x {cfg.samples} samples per position, temperature "
          f"{params.synthesis.calibration.temperature}, band [{cfg.low}, {cfg.high}]")
    print("| position | verdict | mean reward | success | informative | all-success | all-zero | reward std |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in records:
        print(f"| {label(r['difficulty'], r['scaffold'], r['blend'])} | {r['verdict']} | {r['mean_reward']:.3f} | "
              f"{r['success_rate']:.3f} | {r['informative']:.0%} | {r['all_success']:.0%} | {r['all_zero']:.0%} | "
              f"{r['reward_std']:.3f} |")
    if folder is not None:
        (folder / "positions.json").write_text(json.dumps(records, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
