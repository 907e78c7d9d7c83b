"""Learning curve of one capability's adapter: GRPO training on its synthetic environment (the project's trainer,
params.yaml `training:`), evaluated against the base agent on held-out seeds at several rollout counts.

For each point of --points (training rollouts, the rollout ledger's count) the adapter is trained on from the
previous point's weights, then the base agent and the adapter play the same --eval-seeds held-out seeds greedily.
Printed per point: held-out success and mean reward of both, the paired differences with 95% bootstrap CIs, and the
time spent; then the GRPO diagnostics per optimiser step: share of informative groups (reward std > 0), mean
reward and reward std, policy entropy (mean token entropy of the sampled completions), the mean absolute change of
the LoRA weights since the start, loss and seconds.

Resumable: run the same command again after a kill (or with more points appended) and it continues from the
trainer's last checkpoint and ledger; points already in the output folder are not evaluated again. Results per
point: OUT/points/<rollouts>.json; all points: OUT/curve.csv and OUT/curve.json; steps: OUT/steps.json. A curve
that differs from an earlier one only in its training settings (a remedy: another learning rate, temperature,
group size) can copy that curve's base-agent episodes instead of playing them again: --base-from <its OUT>.

Settings come from params.yaml plus -S overrides, as for `trace`; the environment is the synthesis output of the
capability (synthesis.out_dir/<capability>/, or --synthesis-dir), the base agent the bootstrap output (as stage
training) or --base-model. Example (the warm-started model of another run, its environment synthesized under
/tmp/run/synthesis; under the heavy-job lock on a shared machine):

    flock /tmp/trace-heavy.lock .venv/bin/python bench/learning_curve.py --capability identification \\
        --synthesis-dir /tmp/run/synthesis --base-model /work/run/artifacts/bootstrap/model \\
        --points 0,32 --eval-seeds 64 --out /tmp/run/curve-identification -S training.num_generations=8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/learning_curve.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capability", required=True, help="the capability whose adapter is trained, e.g. identification")
    ap.add_argument("--points", required=True,
                    help="training rollouts at which the adapter is evaluated, comma-separated, e.g. 0,64,128,256 "
                         "(0: the base agent itself; every other point at least one GRPO step)")
    ap.add_argument("--eval-seeds", type=int,
                    help="held-out seeds per point (the first of the spec's eval seeds; default: "
                         "training.eval_episodes). Use >= 64 to resolve a +0.1 difference")
    ap.add_argument("--out", required=True, help="output folder (new, empty, or this curve's: then it resumes)")
    ap.add_argument("--restart", action="store_true",
                    help="discard a curve in --out made with other settings instead of refusing")
    ap.add_argument("--base-from", metavar="CURVE_DIR",
                    help="another curve's --out folder: copy its base agent's held-out outcomes instead of playing "
                         "them again (refused unless the environment, base model, seeds and play settings are the "
                         "same: for curves that differ only in how they train)")
    ap.add_argument("--synthesis-dir", help="folder holding <capability>/spec.json (default: synthesis.out_dir)")
    ap.add_argument("--base-model", help="the base agent's model folder (default: the bootstrap output, as stage "
                                         "training uses)")
    ap.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    ap.add_argument("-S", "--set", dest="overrides", action="append", metavar="KEY=VALUE",
                    help="override one parameter, e.g. -S training.lr=1e-3 (value parsed as YAML; repeatable)")
    ap.add_argument("--progress", action="store_true", help="show progress bars")
    return ap


def base_from_folder(path: str, threads: int):
    """A `BaseAgent` for a model folder (what stage training builds from the bootstrap output)."""
    from trace_core.agents.model import load_model, load_tokenizer, weights_hash
    from trace_core.training.stage import BaseAgent

    if not (Path(path) / "config.json").exists():
        raise SystemExit(f"--base-model {path}: no config.json there; give a model folder (e.g. the bootstrap "
                         "stage's artifacts/bootstrap/model)")

    def load(dtype: str):
        return load_model(path, dtype=dtype, threads=threads), load_tokenizer(path)

    return BaseAgent(path=path, fingerprint=weights_hash(Path(path)), load=load)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from trace_core.cli import load, parse_overrides
    from trace_core.runs import read_json
    from trace_core.training.curve import (
        STEPS,
        CurveError,
        format_steps,
        format_table,
        learning_curve,
        parse_points,
        read_points,
    )
    from trace_core.training.stage import TrainingError, base_agent

    params = load(args.params, parse_overrides(args.overrides))
    synthesis = Path(args.synthesis_dir or params.synthesis.out_dir)
    agent = base_from_folder(args.base_model, params.model.threads) if args.base_model else base_agent(params)
    eval_seeds = args.eval_seeds if args.eval_seeds is not None else params.training.eval_episodes
    started, cpu = time.perf_counter(), time.process_time()
    try:
        points = parse_points(args.points)
        rows = learning_curve(params, synthesis / args.capability, args.out, points, eval_seeds, agent,
                              restart=args.restart, progress=args.progress,
                              base_from=args.base_from)
    except (CurveError, TrainingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    print(f"\n{args.capability}: held-out success and mean reward (R), base vs. adapter, paired 95% CIs")
    print(format_table(rows))
    steps = (read_json(out / STEPS) or {}).get("steps", [])
    if steps:
        print("\nGRPO diagnostics per optimiser step")
        print(format_steps(steps))
    base = read_json(out / "base.json") or {}
    print(f"\nthis process: {time.perf_counter() - started:.0f} s wall, {time.process_time() - cpu:.0f} s CPU; "
          f"base agent's held-out episodes (once): {base.get('seconds', 0):.0f} s; points done: "
          f"{sorted(read_points(out))}; files in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
