"""Replay held-out seeds of a capability's environment and show what the agent did: for diagnosing an adapter
(or the base agent) from its behaviour, not only from eval.json's per-seed rewards.

Each seed is played greedily, as the training stage's held-out evaluation plays it (`trace_core.training.stage.
play_greedy`: the deployed policy, the scripted user, the policy's turn budget), by the base model or, with
--adapter, the base model with that LoRA adapter. Printed per seed: whether the instance must be refused, the
reward and its components, the reference's writes, and each assistant turn (its tool calls with their arguments,
then its text); at the end, how many episodes ended which way (no tool call, no write, the reference's write made
exactly, a write with other arguments, ...). --out keeps the trajectories (JSON lines, `Trajectory` rows).

Seeds: a comma-separated list, or `lost` / `won` / `changed` to take them from an eval.json (the training stage's
paired evaluation: `lost` = the base agent solved it and the adapter did not). Example, the seeds an adapter lost
(2 cores; pause or wait for any other heavy job first):

    .venv/bin/python bench/replay.py --capability precondition_verification \\
        --synthesis-dir artifacts/synthesis --base-model artifacts/bootstrap/model \\
        --adapter artifacts/training/precondition_verification/adapter --seeds lost
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SELECTIONS = {
    "lost": lambda row: row["base_success"] and not row["adapter_success"],
    "won": lambda row: row["adapter_success"] and not row["base_success"],
    "changed": lambda row: row["adapter_success"] != row["base_success"],
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench/replay.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capability", required=True, help="the capability whose environment is played")
    ap.add_argument("--seeds", required=True,
                    help="comma-separated seeds (e.g. 256,257), or lost / won / changed (from --eval-json)")
    ap.add_argument("--eval-json", help="the paired evaluation the lost/won/changed seeds come from (default: "
                                        "eval.json beside --adapter's folder)")
    ap.add_argument("--adapter", help="a LoRA adapter folder (default: none, the base model plays)")
    ap.add_argument("--limit", type=int, default=0, help="play at most this many of the seeds (0: all)")
    ap.add_argument("--synthesis-dir", help="folder holding <capability>/spec.json (default: synthesis.out_dir)")
    ap.add_argument("--base-model", help="the base model folder (default: the bootstrap output, as stage training)")
    ap.add_argument("--out", help="write the trajectories here (JSON lines)")
    ap.add_argument("--from-file", metavar="JSONL",
                    help="describe the trajectories an earlier --out wrote instead of playing (no model is loaded; "
                         "--seeds all takes every one)")
    ap.add_argument("--params", default="params.yaml", help="the params file (default: params.yaml)")
    ap.add_argument("-S", "--set", dest="overrides", action="append", metavar="KEY=VALUE",
                    help="override one parameter, e.g. -S policy.max_new_tokens=256 (repeatable)")
    return ap


def pick_seeds(text: str, eval_json: Path | None) -> list[int]:
    """The seeds `--seeds` names: a list, or a selection of an eval.json's per-seed rows."""
    text = text.strip()
    if text in SELECTIONS:
        if eval_json is None or not eval_json.exists():
            raise SystemExit(f"--seeds {text} needs an eval.json: give --eval-json (or --adapter inside a training "
                             f"folder that has one); looked for {eval_json}")
        rows = json.loads(eval_json.read_text(encoding="utf-8"))["per_seed"]
        return [row["seed"] for row in rows if SELECTIONS[text](row)]
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: give comma-separated integers or one of {sorted(SELECTIONS)}") from None


def read_recorded(path: Path) -> dict[int, Any]:
    """Seed -> trajectory of a file an earlier --out wrote (the seed is the instance id's `/s<seed>` suffix)."""
    from trace_core.schemas import Trajectory

    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            trajectory = Trajectory.from_row(json.loads(line))
            out[int(trajectory.instance_id.rsplit("/s", 1)[1])] = trajectory
    return out


def outcome(instance: Any, trajectory: Any, writes: set[str]) -> str:
    """How an episode ended, in words a table can count (judged from the calls, not from the reward)."""
    from trace_core.synthesis.contract import agent_calls

    calls = [c for c, _ in agent_calls(trajectory.messages)]
    made = [c for c in calls if c.name in writes]
    if not calls:
        return "no tool call"
    if not made:
        if trajectory.termination_reason not in ("agent_stop", "user_stop"):
            return f"no write, ended {trajectory.termination_reason}"
        return "refused after reads" if instance.must_refuse else "no write"
    if instance.must_refuse:
        return "wrote where it had to refuse"
    reference = [(a.name, a.arguments) for a in instance.reference_actions if a.name in writes]
    if all((c.name, c.arguments) in reference for c in made):
        return "reference writes" if len(made) >= len(reference) else "some reference writes, others missing"
    if any(c.name == name and set(c.arguments) < set(args) for c in made for name, args in reference):
        return "write missing an argument"
    if any(c.name == name for c in made for name, _ in reference):
        return "write with a wrong argument"
    return "write of another tool"


def describe(seed: int, instance: Any, trajectory: Any, writes: set[str]) -> list[str]:
    """A few lines per episode: the instance's verdict, the reference writes, then each assistant turn."""
    ref = [f"{a.name}({json.dumps(a.arguments, sort_keys=True)})" for a in instance.reference_actions
           if a.name in writes]
    components = ", ".join(f"{k} {v:g}" for k, v in sorted(trajectory.reward_components.items()))
    verdict = "must refuse" if instance.must_refuse else "allowed"
    head = (f"seed {seed}: {verdict}; reward {trajectory.reward:g} ({components}); "
            f"ended {trajectory.termination_reason}; {outcome(instance, trajectory, writes)}")
    lines = [head, f"  reference writes: {', '.join(ref) or 'none'}"]
    for m in trajectory.messages:
        if m.role != "assistant":
            continue
        calls = [f"{c.name}({json.dumps(c.arguments, sort_keys=True)})" for c in (m.tool_calls or [])
                 if not (c.id or "").startswith("prefill_")]
        text = " ".join((m.content or "").split())
        if calls or text:
            lines.append("  agent: " + "; ".join(calls + ([repr(text[:160])] if text else [])))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from trace_core.agents.model import load_model, load_tokenizer
    from trace_core.bootstrap import agent_model_path
    from trace_core.cli import load, parse_overrides
    from trace_core.envs.targets import write_tools
    from trace_core.training.stage import build_env, load_spec, play_greedy

    params = load(args.params, parse_overrides(args.overrides))
    spec_dir = Path(args.synthesis_dir or params.synthesis.out_dir) / args.capability
    eval_json = Path(args.eval_json) if args.eval_json else (Path(args.adapter).parent / "eval.json"
                                                             if args.adapter else None)
    spec = load_spec(spec_dir, args.capability)
    env = build_env(spec, spec_dir)
    if args.from_file:
        recorded = read_recorded(Path(args.from_file))
        seeds = sorted(recorded) if args.seeds.strip() == "all" else pick_seeds(args.seeds, eval_json)
        missing = [s for s in seeds if s not in recorded]
        if missing:
            raise SystemExit(f"{args.from_file} has no episode for seeds {missing[:10]}")
    else:
        seeds = pick_seeds(args.seeds, eval_json)
    if args.limit:
        seeds = seeds[:args.limit]
    if not seeds:
        print("no seeds to play")
        return 0
    name = f"adapter:{args.capability}" if args.adapter else "base"
    if args.from_file:
        trajectories, name = [recorded[s] for s in seeds], args.from_file
    else:
        path = args.base_model or agent_model_path(params)
        model, tokenizer = load_model(path, dtype=params.model.dtype, threads=params.model.threads), load_tokenizer(path)
        if args.adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, args.adapter)
        model.eval()
        trajectories = play_greedy(params, env, model, tokenizer, seeds, name)
    writes = set(write_tools(spec.domain))
    ends = Counter()
    for seed, trajectory in zip(seeds, trajectories, strict=True):  # play_greedy keeps the seeds' order
        instance = env.reset(seed)
        ends[outcome(instance, trajectory, writes)] += 1
        print("\n".join(describe(seed, instance, trajectory, writes)))
    print(f"\n{name} on {len(seeds)} seeds of {args.capability} ({spec_dir}): "
          + "; ".join(f"{k} {v}" for k, v in ends.most_common()))
    if args.out:
        from trace_core.runs import write_text_atomic

        write_text_atomic(Path(args.out), "".join(json.dumps(t.to_row(), sort_keys=True) + "\n"
                                                  for t in trajectories))
        print(f"trajectories: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
