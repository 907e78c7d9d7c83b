#!/usr/bin/env bash
# Install Apple's ToolSandbox (commit 165848b, not on PyPI) into the interpreter $1 (default .venv/bin/python).
#
# Source: ../shared/vendor/ToolSandbox-165848b.tar.gz (unmodified upstream, see its README) when present, otherwise
# the same commit from GitHub. scripts/toolsandbox-compat.patch is applied to a temporary copy (current polars,
# ccy 2, no langchain; dependencies reduced to what the imported modules need, so that `pip check` stays clean),
# and the result is installed with --no-deps under the project's constraints. Apple's LICENSE travels inside the
# installed distribution. Idempotent: a matching install is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
COMMIT=165848b9a78cead7ca7fe7c89c688b58e6501219
SHORT=${COMMIT:0:7}
# The vendored tarball: $TOOLSANDBOX_VENDOR, else ../shared/vendor next to this checkout, else next to the main
# checkout when this is a git worktree.
VENDOR=
main_root=$(cd "$(git rev-parse --git-common-dir 2>/dev/null || echo .)/.." 2>/dev/null && pwd || pwd)
for dir in ${TOOLSANDBOX_VENDOR:-} ../shared/vendor "$main_root/../shared/vendor"; do
  if [[ -f $dir/ToolSandbox-$SHORT.tar.gz ]]; then VENDOR=$dir/ToolSandbox-$SHORT.tar.gz; break; fi
done
PATCH=$PWD/scripts/toolsandbox-compat.patch
MARK="trace-compat-$(sha256sum "$PATCH" | cut -c1-12)"

if "$PY" - "$MARK" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import distribution
raise SystemExit(0 if (distribution("tool_sandbox").read_text("TRACE_COMPAT") or "").strip() == sys.argv[1] else 1)
PYEOF
  echo "[toolsandbox] already installed ($MARK)"; exit 0
fi

work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
if [[ -n $VENDOR ]]; then
  echo "[toolsandbox] source: $VENDOR"
  tar -xzf "$VENDOR" -C "$work"
else
  url=https://github.com/apple/ToolSandbox/archive/$COMMIT.tar.gz
  echo "[toolsandbox] source: $url (no vendored ToolSandbox-$SHORT.tar.gz in ../shared/vendor)"
  "$PY" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' "$url" "$work/src.tar.gz" \
    2>/dev/null || { echo "install_toolsandbox.sh: cannot download $url; put ToolSandbox-$SHORT.tar.gz in ../shared/vendor" \
      "or set TOOLSANDBOX_VENDOR to its folder" >&2; exit 1; }
  tar -xzf "$work/src.tar.gz" -C "$work" && rm "$work/src.tar.gz"
fi
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)
[[ -f $src/LICENSE && -d $src/tool_sandbox ]] || { echo "install_toolsandbox.sh: $src is not a ToolSandbox tree" >&2; exit 1; }
patch -d "$src" -p1 --forward --quiet < "$PATCH"
"$PY" -m pip install --quiet --disable-pip-version-check --constraint constraints.txt --no-deps --no-build-isolation \
  "$src"
# Record which compatibility patch the installed copy carries (checked above on the next run).
"$PY" - "$MARK" <<'PYEOF'
import sys
from importlib.metadata import distribution
d = distribution("tool_sandbox")
(d._path / "TRACE_COMPAT").write_text(sys.argv[1] + "\n")
PYEOF
"$PY" -c 'import tool_sandbox.scenarios, tool_sandbox.common.evaluation' \
  || { echo "install_toolsandbox.sh: tool_sandbox does not import after install" >&2; exit 1; }
echo "[toolsandbox] installed ($MARK)"
