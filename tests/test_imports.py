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


STAGES = ("analysis", "synthesis", "training", "routing", "evaluation", "baseline", "bootstrap")


def _stage_of(module: str) -> str | None:
    """The stage a dotted module name belongs to (`trace_core.training.stage` -> training), or None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "trace_core" and parts[1] in STAGES else None


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(names)])


def cross_stage_private_uses(path: Path, module: str) -> list[str]:
    """Private names (a leading underscore, dunders aside) of another stage's modules that the file at `path` (module
    `module`) imports or reaches as attributes: `from trace_core.training.stage import _claim`,
    `from trace_core.training import stage; stage._claim`, `import trace_core.training.stage as ts; ts._claim`,
    `trace_core.training.stage._claim`."""
    own = _stage_of(module)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> the other stage's module (or name) it stands for

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            stage = _stage_of(node.module)
            if stage is None or stage == own:
                continue
            for alias in node.names:
                if private(alias.name):
                    found.append(f"{module}:{node.lineno} from {node.module} import {alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                stage = _stage_of(alias.name)
                if stage is not None and stage != own:
                    aliases[alias.asname or alias.name] = alias.name if alias.asname else alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = _dotted(node.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            target = ".".join(filter(None, [aliases.get(head, head if head == "trace_core" else ""), rest]))
            stage = _stage_of(target) if target else None
            if stage is not None and stage != own:
                found.append(f"{module}:{node.lineno} {owner}.{node.attr}")
    return found


def test_no_stage_uses_another_stages_private_names():
    offences = []
    for path in sorted((ROOT / "trace_core").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        offences += cross_stage_private_uses(path, module)
    assert offences == [], (
        "a stage reaches into another stage's private names; make the helper public or move it to a shared module "
        f"(trace_core/runs.py, trace_core/agents/device.py, trace_core/envs/settings.py): {offences}"
    )


def test_the_private_name_check_sees_every_form(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "import trace_core.training.stage\n"
        "import trace_core.training.stage as ts\n"
        "from trace_core.training import stage\n"
        "from trace_core.training.stage import _claim, run\n"
        "from trace_core.evaluation.stats import _own\n"
        "trace_core.training.stage._finished\n"
        "ts._limits\n"
        "stage._free_memory\n"
        "ts.run\n"
        "x._private\n"
    )
    found = cross_stage_private_uses(source, "trace_core.evaluation.probe")
    assert sorted(f.split(" ", 1)[1] for f in found) == sorted([
        "from trace_core.training.stage import _claim",
        "trace_core.training.stage._finished",
        "ts._limits",
        "stage._free_memory",
    ])
