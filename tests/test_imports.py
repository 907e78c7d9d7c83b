"""Import hygiene: the light modules stay light, and the core library never touches orchestration/tracking."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("tau2", "torch", "prefect", "mlflow")
LIGHT_MODULES = (
    "trace_core.envs",
    "trace_core.envs.tau2_env",
    "trace_core.schemas",
    "trace_core.config",
    "trace_core.metrics",
)


def test_light_modules_do_not_import_heavy_dependencies():
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in LIGHT_MODULES)
        + f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing {LIGHT_MODULES} pulled in {loaded}"


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call):
            # importlib.import_module("prefect...") / __import__("mlflow")
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            first = node.args[0] if node.args else None
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                roots.add(first.value.split(".")[0])
    return roots


def test_core_library_never_imports_prefect_or_mlflow():
    files = sorted((ROOT / "trace_core").rglob("*.py"))
    assert files, "no source found under trace_core/"
    offenders = {str(f.relative_to(ROOT)): sorted(_imported_roots(f) & {"prefect", "mlflow"}) for f in files}
    offenders = {f: mods for f, mods in offenders.items() if mods}
    assert offenders == {}, f"trace_core must not import prefect/mlflow: {offenders}"


def test_scanner_sees_all_import_forms(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nimport prefect.flows as pf\nfrom mlflow import log_metric\nfrom . import sibling\n"
        "def f():\n    import importlib\n    importlib.import_module('mlflow.tracking')\n    __import__('torch')\n"
    )
    assert _imported_roots(src) == {"os", "prefect", "mlflow", "importlib", "torch"}
