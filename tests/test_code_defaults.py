"""params.yaml is the only place a default value is written: no function signature and no model field in trace_core/
gives a literal default to a parameter named like a params.yaml key (issue #32). `None` is not a default value here
(it means "not given"); a same-named parameter that is not the params.yaml setting goes on ALLOWED with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

AGENTS_SYNTHESIS = "TODO(#32): fixed in the agents/synthesis merge"
SPLIT = "TODO(#32): evaluation/routing, fixed with the evaluation stage split"
LATER = "TODO(#32): a params.yaml default repeated in code, outside #32's training/bootstrap part; not fixed yet"

# (path under trace_core/, qualified function or class) -> (parameters, why the defaults may stay for now).
ALLOWED: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    # -- same name, another meaning --------------------------------------------------------------------------------
    ("analysis/__init__.py", "analyse"): (("source",), "a phrase for error messages, not baseline.source"),
    ("analysis/stage.py", "analyse"): (("source",), "a phrase for error messages, not baseline.source"),
    ("analysis/stage.py", "join_items"): (("source",), "a phrase for error messages, not baseline.source"),
    ("analysis/base.py", "LabelSet"): (("runs",), "how many labelling runs a label set holds, not embedding.runs"),
    ("analysis/embedding.py", "embed_texts"): (("batch_size",), "MiniLM encoder batch, not policy.batch_size"),
    ("cli.py", "_add_params_args"): (("out_dir",), "whether the command gets an --out-dir flag, not a path"),
    ("config.py", "load_params"): (("path",), "the params file itself, not model.path"),
    ("routing/router.py", "RouteOption"): (("examples",), "the example texts themselves (empty), not their count"),
    ("synthesis/sandbox.py", "run_generator"): (("timeout_s",), "the sandbox's time limit, not an HTTP timeout"),
    ("training/ledger.py", "RolloutLedger.add"): (("seeds",), "a count to add to the ledger, not synthesis seeds"),
    ("synthesis/contract.py", "SyntheticEnv.__init__"): (
        ("domain",), "the retail templates' own target (their tools and DB are τ² retail's; the ToolSandbox templates "
        "pass theirs), a property of the template, not the run's env.domain"),
    ("synthesis/generated.py", "GeneratedEnv.__init__"): (
        ("domain", "timeout_s"), "domain: generated modules write τ² retail instances only (another domain raises); "
        "timeout_s: the sandbox's time limit per run, not an HTTP timeout"),
    ("synthesis/generated.py", "GenerationAgent.__init__"): (
        ("probe_seeds",), "the seeds each attempt's module is test-run at (a tuple), not the harness' probe count"),
    # -- owned by the templates helper (synthesis/templates/) -------------------------------------------------------
    ("synthesis/templates/__init__.py", "make"): (("difficulty", "profile"), AGENTS_SYNTHESIS),
    ("synthesis/templates/toolsandbox.py", "ToolSandboxTemplate.__init__"): (("difficulty", "domain", "profile"),
                                                                            LATER),
    # -- owned by the evaluation stage split ----------------------------------------------------------------------
    # answer_prefix, max_task_chars: found when the check learned defaults spelled through a module constant
    # -- file contracts: what a file written before the field existed meant, not a run setting -------------------
    ("schemas.py", "EnvSpec"): (
        ("domain", "profile"), "spec.json files from before these fields were retail/compact environments; the value "
        "is part of spec_hash, which keys the adapters trained on them, so a required field (or a migration that "
        "rewrites them) would orphan those adapters"),
    ("schemas.py", "Instance"): (
        ("difficulty",), "the instance's own knob position, 0 for sources without a knob (τ², ToolSandbox's offline "
        "scenarios) and in instance files from before the field; not tasks.difficulty"),
}


def _allowed(path: str, name: str, arg: str) -> bool:
    return arg in ALLOWED.get((path, name), ((), ""))[0]


def _leaf_keys(node, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                _leaf_keys(value, out)
            else:
                out.add(str(key))
    return out


def _literal(node: ast.AST | None) -> bool:
    """A value written in code: a constant other than None, a signed number, or a list/tuple/set/dict of them."""
    if node is None:
        return False
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return isinstance(node.operand, ast.Constant)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_literal(e) or isinstance(e, ast.Constant) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(_literal(v) or isinstance(v, ast.Constant) for v in node.values)
    return False


def _field_default(value: ast.AST | None) -> ast.AST | None:
    """The default of a class-level field: `x: int = 3`, or `Field(3)` / `Field(default=3)` / `field(default=3)`."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in ("Field", "field"):
        for kw in value.keywords:
            if kw.arg == "default":
                return kw.value
        return value.args[0] if value.args else None
    return value


def _constants(tree: ast.Module) -> set[str]:
    """Module-level names bound to a literal (`DEFAULT_DIFFICULTY = 1`): a default spelled through one is still a
    default value written in code."""
    names = set()
    for stmt in tree.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) \
            else []
        if _literal(getattr(stmt, "value", None)):
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _walk(node: ast.AST, prefix: str, keys: set[str], found: dict[tuple[str, str], int],
          consts: frozenset[str] = frozenset()) -> None:
    """Record (qualified name, parameter) -> line for every literal default of a params.yaml key under `node`
    (a literal, or a module constant bound to one)."""

    def written(default: ast.AST | None) -> bool:
        return _literal(default) or (isinstance(default, ast.Name) and default.id in consts)

    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            a = child.args
            positional = a.posonlyargs + a.args
            pairs = list(zip(positional[len(positional) - len(a.defaults):], a.defaults))
            pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg in keys and written(default):
                    found[(name, arg.arg)] = child.lineno
            _walk(child, name + ".", keys, found, consts)
        elif isinstance(child, ast.ClassDef):
            for stmt in child.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and stmt.target.id in keys and written(_field_default(stmt.value))):
                    found[(prefix + child.name, stmt.target.id)] = stmt.lineno
            _walk(child, prefix + child.name + ".", keys, found, consts)
        else:
            _walk(child, prefix, keys, found, consts)


def offences() -> dict[tuple[str, str, str], int]:
    """(path under trace_core/, qualified function or class, parameter) -> line, for every literal default."""
    keys = _leaf_keys(yaml.safe_load((ROOT / "params.yaml").read_text()), set())
    found: dict[tuple[str, str, str], int] = {}
    for path in sorted((ROOT / "trace_core").rglob("*.py")):
        rel = path.relative_to(ROOT / "trace_core").as_posix()
        here: dict[tuple[str, str], int] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        _walk(tree, "", keys, here, frozenset(_constants(tree)))
        found.update({(rel, name, arg): line for (name, arg), line in here.items()})
    return found


def test_no_params_key_has_a_default_in_library_code():
    bad = {k: line for k, line in offences().items() if not _allowed(*k)}
    assert not bad, (
        "library code writes a default for a params.yaml key (params.yaml is the only home of defaults): "
        + "; ".join(f"trace_core/{p}:{line} {fn}({arg}=...)" for (p, fn, arg), line in sorted(bad.items()))
        + ". Make the parameter required and pass the params value, or add it to ALLOWED with the reason."
    )


def test_allowlist_has_no_stale_entries():
    stale = {(p, name, arg) for (p, name), (args, _) in ALLOWED.items() for arg in args} - set(offences())
    assert not stale, f"ALLOWED names offences that are gone; remove them: {sorted(stale)}"


def test_the_check_sees_a_signature_default_and_a_field_default(tmp_path):
    tree = ast.parse("def f(lr=0.1, seed=None):\n    pass\nclass C:\n    lr: float = 1e-3\n    epochs: int\n")
    fn, cls = tree.body
    found: dict = {}
    _walk(ast.parse("LR = 0.1\ndef g(lr=LR, seed=SEED):\n    pass\n"), "", {"lr", "seed"}, found,
          frozenset(_constants(ast.parse("LR = 0.1"))))
    assert found == {("g", "lr"): 2}  # a default through a module constant counts; an unknown name does not
    assert _literal(fn.args.defaults[0]) and not _literal(fn.args.defaults[1])
    assert _literal(_field_default(cls.body[0].value)) and not _literal(_field_default(cls.body[1].value))
    assert _leaf_keys({"a": {"lr": 1, "b": {"seed": 2}}, "c": [1]}, set()) == {"lr", "seed", "c"}
