#!/usr/bin/env bash
# A shrunken end-to-end run of every stage on the embedded default: the real warm-started model, real rollouts,
# real GRPO steps, real routing, but a handful of instances and one optimiser step per capability, so that the
# whole pipeline can be seen working in about an hour after the warm-start on 2 CPU cores. Its numbers say that
# the stages fit together, not how well TRACE works: for that run the full CPU profile (README, "Size profile")
# or a GPU profile. `dvc repro` at the params.yaml defaults sits between the two and adds the trained baselines.
#
#   bash scripts/smoke.sh                    # bootstrap (dvc, shared with the full run), then the other stages
#   bash scripts/smoke.sh --print-overrides  # the -S overrides it adds to params.yaml, one per line
#   bash scripts/smoke.sh -S policy.batch_size=8 ...   # more overrides (they win)
#
# Outputs go to artifacts/smoke/<stage>/ (outside every DVC-tracked path), runs to MLflow and Prefect as usual.
# The evaluation leaves out the methods that train or evolve on TRACE's rollout budget (mixture, grpo_target,
# gepa): each of them would take longer than the rest of the run together (stage baselines then has none to run).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=artifacts/smoke
OVERRIDES=(
  baseline.instances_per_family=8 "baseline.out_dir=$OUT/baseline"
  "analysis.out_dir=$OUT/analysis"
  synthesis.calibration.enabled=false "synthesis.out_dir=$OUT/synthesis"
  training.max_steps=1 training.eval_episodes=8 training.max_resample_rounds=1 "training.out_dir=$OUT/training"
  "routing.out_dir=$OUT/routing" "baselines.out_dir=$OUT/baselines"
  evaluation.instances_per_family=2 "evaluation.methods=[base,trace,single,oracle,merged_linear,merged_ties,describe]"
  "evaluation.out_dir=$OUT/evaluation"
)

EXTRA=()
while (( $# )); do
  case "$1" in
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    --print-overrides) printf '%s\n' "${OVERRIDES[@]}"; exit 0 ;;
    -S|--set) (( $# > 1 )) || { echo "smoke.sh: $1 needs KEY.PATH=VALUE" >&2; exit 2; }; EXTRA+=("$2"); shift 2 ;;
    *) echo "smoke.sh: unknown option $1 (use -S KEY.PATH=VALUE, --print-overrides or --help)" >&2; exit 2 ;;
  esac
done

[[ -x .venv/bin/python ]] || { echo "smoke.sh: no .venv here; run bash scripts/install.sh first" >&2; exit 1; }
# shellcheck disable=SC1091
source .venv/bin/activate
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
  DVC_NO_ANALYTICS=1 HF_HUB_OFFLINE=1

ARGS=()
for o in "${OVERRIDES[@]}" "${EXTRA[@]}"; do ARGS+=(-S "$o"); done

echo "[smoke] bootstrap (dvc repro bootstrap: skipped when the base agent is up to date)"
dvc repro bootstrap
for stage in baseline analysis synthesis training routing baselines evaluation; do
  echo "[smoke] $stage ($(date +%T))"
  python -m flows.pipeline --stage "$stage" "${ARGS[@]}"
done
echo "[smoke] done ($(date +%T)): $OUT/evaluation/table.md"
