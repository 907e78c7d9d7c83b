"""Running untrusted, LLM-written generator modules: a static check of the source, then execution in a child
process that is locked down at the operating-system level as well as in Python.

A generator module defines `generate(seed, difficulty, db) -> dict` (one instance as plain JSON data) and may
import only a small allow-list of standard-library modules. `check_source` rejects anything else before the
module is run. `run_generator` then runs it in a fresh interpreter (`python -S -s -B -P`: no site-packages, no
user site, no bytecode writes, no script directory on the path) with an empty environment, its own temporary
working directory, resource limits (address space, CPU time, file size 0, no new processes), privileges dropped
to `nobody` when started as root, restricted builtins for the module (no `open`, `exec`, `eval`, imports only
from the allow-list) and no sockets. The child loads no third-party code: the retail DB arrives as a JSON file
written by the parent.

This file is also the child's program: the parent starts `python sandbox.py <workdir>`, so everything it
imports at module level is standard library.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile

ALLOWED_MODULES = frozenset(
    {
        "__future__",
        "bisect",
        "collections",
        "copy",
        "dataclasses",
        "enum",
        "functools",
        "hashlib",
        "heapq",
        "itertools",
        "json",
        "math",
        "random",
        "re",
        "statistics",
        "string",
        "typing",
    }
)

# Names a generator must not use at all (not even to pass around), with the reason shown to its author.
FORBIDDEN_NAMES = {
    "open": "file access is not allowed",
    "exec": "running dynamic code is not allowed",
    "eval": "running dynamic code is not allowed",
    "compile": "running dynamic code is not allowed",
    "__import__": "dynamic imports are not allowed; use an import statement from the allow-list",
    "globals": "namespace introspection is not allowed",
    "locals": "namespace introspection is not allowed",
    "vars": "namespace introspection is not allowed",
    "input": "a generator cannot read input",
    "breakpoint": "a generator cannot start a debugger",
    "help": "a generator cannot start the help system",
    "exit": "a generator must return, not exit",
    "quit": "a generator must return, not exit",
    "memoryview": "raw memory access is not allowed",
}

# Modules a generator must not reach. Their names are forbidden as attributes too (`typing.sys`, `json.codecs`):
# reaching one through an allowed module is the same as importing it. `_escape_attributes` adds the other names
# under which the allowed modules hold one of them (`random._os`, `enum.bltns`).
DENIED_MODULES = frozenset(
    {
        "_ctypes", "_imp", "_io", "_pickle", "_posixsubprocess", "_signal", "_socket", "_thread", "asyncio",
        "builtins", "code", "codecs", "ctypes", "gc", "http", "importlib", "inspect", "io", "marshal",
        "multiprocessing", "operator", "os", "pathlib", "pickle", "posix", "pty", "resource", "runpy", "select",
        "shutil", "signal", "socket", "ssl", "subprocess", "sys", "tempfile", "threading", "types", "urllib",
        "weakref",
    }
)

# Attributes that walk from an object to frames, code or globals (the classic ways out of a Python sandbox), and
# allowed-module functions that evaluate strings as code or as attribute paths (which would bypass every check
# on attribute names): `typing.get_type_hints` evals string annotations, `string.Formatter.get_field` follows
# "0.__class__"-style paths.
INTROSPECTION_ATTRIBUTES = frozenset(
    {
        "ag_code", "ag_frame", "co_code", "co_consts", "cr_code", "cr_frame", "f_back", "f_builtins", "f_code",
        "f_globals", "f_locals", "gi_code", "gi_frame", "gi_yieldfrom", "tb_frame", "tb_next",
    }
)
EVALUATING_ATTRIBUTES = frozenset(
    {"ForwardRef", "Formatter", "attrgetter", "get_field", "get_type_hints", "methodcaller"}
)
# Dunders that only name or initialise an object; every other dunder attribute is refused.
HARMLESS_DUNDERS = frozenset({"__init__", "__name__", "__post_init__"})

ATTRIBUTE_BUILTINS = ("getattr", "setattr", "delattr", "hasattr")
GENERATE_SIGNATURE = "def generate(seed, difficulty, db)"
STDERR_TAIL = 2000
MAX_INSTANCE_CHARS = 1_000_000  # an instance is a few KB; anything near this is a bug that would flood the parent


class SandboxError(RuntimeError):
    """A generator module failed in the sandbox. `kind` is one of timeout, cpu, memory, crash, exception, output;
    `seed` is the seed being generated when it happened (None when the module failed before any seed)."""

    def __init__(self, message: str, kind: str, seed: int | None = None, stderr: str = ""):
        super().__init__(message)
        self.kind = kind
        self.seed = seed
        self.stderr = stderr


# ---------------------------------------------------------------------------------------------------------------
# Static check
# ---------------------------------------------------------------------------------------------------------------


def _top(module: str) -> str:
    return module.split(".")[0]


@functools.lru_cache(maxsize=1)
def _escape_attributes() -> frozenset[str]:
    """The denied modules' names plus every other name under which an allowed module (or one of its submodules)
    holds a denied module, e.g. `random._os`, `collections._sys`, `enum.bltns`. Computed from the real modules."""
    import importlib

    for name in ALLOWED_MODULES:
        importlib.import_module(name)
    names = set(DENIED_MODULES)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or _top(mod_name) not in ALLOWED_MODULES:
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, type(sys)) and _top(value.__name__) in DENIED_MODULES:
                names.add(attr)
    return frozenset(names)


class _Checker(ast.NodeVisitor):
    def __init__(self) -> None:
        self.problems: list[tuple[int, str]] = []
        self.module_aliases: set[str] = set()  # names bound by `import x` / `import x as y`
        self.checked_calls: set[int] = set()  # ids of getattr/... Name nodes that are called (checked there)

    def fail(self, node: ast.AST, message: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), message))

    def _check_module(self, node: ast.AST, module: str, statement: str) -> bool:
        if _top(module) in ALLOWED_MODULES:
            return True
        allowed = ", ".join(sorted(ALLOWED_MODULES - {"__future__"}))
        self.fail(node, f"`{statement}` is not allowed: a generator may import only {allowed}")
        return False

    def _check_attribute(self, node: ast.AST, attr: str, on_module: bool) -> None:
        if attr.startswith("__") and attr.endswith("__") and attr not in HARMLESS_DUNDERS:
            self.fail(node, f"dunder attribute `.{attr}` is not allowed (no introspection of objects or classes)")
        elif attr in INTROSPECTION_ATTRIBUTES:
            self.fail(node, f"attribute `.{attr}` is not allowed (no access to frames, code or globals)")
        elif attr in EVALUATING_ATTRIBUTES:
            self.fail(node, f"`{attr}` is not allowed: it evaluates strings as code or attribute paths")
        elif attr in _escape_attributes():
            self.fail(node, f"attribute `.{attr}` is not allowed: it names a module outside the import allow-list")
        elif on_module and attr.startswith("_"):
            self.fail(node, f"private module attribute `.{attr}` is not allowed; use the module's public API")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._check_module(node, alias.name, f"import {alias.name}"):
                self.module_aliases.add(alias.asname or _top(alias.name))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.fail(node, "relative imports are not allowed: a generator is a single module")
            return
        module = node.module or ""
        if not self._check_module(node, module, f"from {module} import ..."):
            return
        for alias in node.names:
            if alias.name == "*":
                self.fail(node, f"`from {module} import *` is not allowed; import the names you use")
            elif module != "__future__":
                self._check_attribute(node, alias.name, on_module=True)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in FORBIDDEN_NAMES:
            self.fail(node, f"`{node.id}` is not allowed: {FORBIDDEN_NAMES[node.id]}")
        elif node.id.startswith("__") and node.id.endswith("__") and node.id != "__name__":
            self.fail(node, f"dunder name `{node.id}` is not allowed")
        elif node.id in ATTRIBUTE_BUILTINS and id(node) not in self.checked_calls:
            # Passed around (e.g. to functools.reduce), getattr would take attribute names no check sees.
            self.fail(node, f"`{node.id}` may only be called directly, with a literal attribute name")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        on_module = isinstance(node.value, ast.Name) and node.value.id in self.module_aliases
        self._check_attribute(node, node.attr, on_module)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ATTRIBUTE_BUILTINS:
            self.checked_calls.add(id(func))
            name = node.args[1] if len(node.args) >= 2 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                self.fail(node, f"`{func.id}` needs a literal attribute name (write obj.name instead)")
            else:
                target = node.args[0]
                on_module = isinstance(target, ast.Name) and target.id in self.module_aliases
                self._check_attribute(node, name.value, on_module)
        self.generic_visit(node)


def _check_generate(tree: ast.Module) -> list[tuple[int, str]]:
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "generate"]
    if not defs:
        return [(0, f"the module must define `{GENERATE_SIGNATURE}` at top level")]
    fn = defs[-1]  # the last definition is the one that counts
    if isinstance(fn, ast.AsyncFunctionDef):
        return [(fn.lineno, f"`generate` must be a plain function, not async: `{GENERATE_SIGNATURE}`")]
    positional = fn.args.posonlyargs + fn.args.args
    if len(positional) < 3 and fn.args.vararg is None:
        return [(fn.lineno, f"`generate` must take three positional arguments: `{GENERATE_SIGNATURE}`")]
    return []


def check_source(source: str) -> list[str]:
    """Problems that forbid running `source` as a generator module, each with its line number; [] = ok.
    A syntax error is reported, not raised."""
    try:
        tree = ast.parse(source, filename="<generator>")
    except SyntaxError as exc:
        return [f"syntax error at line {exc.lineno}: {exc.msg}" + (f": {exc.text.strip()}" if exc.text else "")]
    except ValueError as exc:  # e.g. a NUL byte in the source
        return [f"the source cannot be parsed: {exc}"]
    checker = _Checker()
    checker.visit(tree)
    problems = sorted(checker.problems + _check_generate(tree))
    return [f"line {line}: {msg}" if line else msg for line, msg in problems]


# ---------------------------------------------------------------------------------------------------------------
# Running (parent side)
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def retail_db_json() -> str:
    """The real τ² retail DB as JSON text (what `db` is inside the sandbox: users, orders, products)."""
    from trace_core.envs.procedural import _retail as R

    return json.dumps(R.db().model_dump(mode="json"))


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]


def _parse_lines(stdout: str) -> list[dict]:
    records = []
    for line in stdout.splitlines():
        if line.strip():
            records.append(json.loads(line))
    return records


def _report(what: str, seed: int | None, stderr: str, fix: str) -> str:
    who = f"On seed {seed}, the generator" if seed is not None else "The generator"
    text = f"{who} {what}. {fix}"
    tail = _tail(stderr)
    return text + (f"\n--- stderr (tail) ---\n{tail}" if tail else "")


def run_generator(
    source: str,
    seeds: list[int],
    difficulty: int,
    *,
    timeout_s: float = 60,
    memory_mb: int = 2048,
    cpu_s: int = 60,
) -> list[dict]:
    """`generate(seed, difficulty, db)` for every seed, in a locked-down child process; one dict per seed, in
    order. Each seed gets a freshly executed module and a fresh copy of the DB, so results do not depend on
    which other seeds share the run. Anything other than a JSON-serialisable dict per seed raises SandboxError.

    The source is not checked here (callers run `check_source` first); the child's own guards hold either way."""
    seeds = [int(s) for s in seeds]
    if not seeds:
        return []
    with tempfile.TemporaryDirectory(prefix="trace-sandbox-") as work:
        with open(os.path.join(work, "generator.py"), "w", encoding="utf-8") as f:
            f.write(source)
        with open(os.path.join(work, "db.json"), "w", encoding="utf-8") as f:
            f.write(retail_db_json())
        job = {"seeds": seeds, "difficulty": int(difficulty), "memory_mb": int(memory_mb), "cpu_s": int(cpu_s)}
        with open(os.path.join(work, "job.json"), "w", encoding="utf-8") as f:
            json.dump(job, f)
        # -S -s: no site-packages (the child imports only the standard library); -B: no .pyc writes; -P: the
        # script's folder is not put on sys.path. Not -I: it implies -E, which would ignore PYTHONHASHSEED, and
        # a fixed hash seed keeps set iteration (and so a careless generator's output) the same from run to run.
        cmd = [sys.executable, "-S", "-s", "-B", "-P", os.path.abspath(__file__), work]
        try:
            proc = subprocess.run(
                cmd,
                check=False,  # a failing child is reported from its output below
                cwd=work,
                env={"PYTHONHASHSEED": "0"},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                encoding="utf-8",
                errors="replace",
                timeout=timeout_s,
                close_fds=True,
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            done = len(_safe_records(out))
            seed = seeds[done] if done < len(seeds) else None
            raise SandboxError(
                _report(
                    f"ran past the {timeout_s:g} s wall-clock limit and was killed",
                    seed,
                    err,
                    "Look for an endless loop (e.g. `while` retrying a draw that can never succeed) and bound it.",
                ),
                "timeout",
                seed,
                err,
            ) from None
    return _results(proc, seeds, memory_mb, cpu_s)


def _safe_records(stdout: str) -> list[dict]:
    try:
        return _parse_lines(stdout)
    except ValueError:
        return []


def _results(proc: subprocess.CompletedProcess, seeds: list[int], memory_mb: int, cpu_s: int) -> list[dict]:
    """The instances from a finished child, or the SandboxError that explains its failure."""
    try:
        records = _parse_lines(proc.stdout)
    except ValueError:
        raise SandboxError(
            _report(
                "runner wrote output that is not one JSON object per line",
                None,
                proc.stderr,
                "This is a bug of trace_core/synthesis/sandbox.py, not of the module; please report it.",
            ),
            "output",
            None,
            proc.stderr,
        ) from None
    instances = [r["instance"] for r in records if "instance" in r]
    failed = next((r for r in records if "error" in r), None)
    seed = seeds[len(instances)] if len(instances) < len(seeds) else None
    if failed is not None:
        kind = failed.get("kind", "exception")
        if kind == "memory":
            what = f"ran out of memory (limit {memory_mb} MB)"
            fix = "Do not build large structures; work on the records you need."
        elif kind == "output":
            what = failed["error"]
            fix = f"`generate` must return a dict of JSON values ({GENERATE_SIGNATURE} -> dict)."
        else:
            what = "raised an exception"
            fix = f"Fix the error:\n{failed['error'].strip()}"
        raise SandboxError(_report(what, failed.get("seed"), proc.stderr, fix), kind, failed.get("seed"), proc.stderr)
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        if sig == signal.SIGXCPU:
            what, kind = f"used more than its {cpu_s} s of CPU time and was killed", "cpu"
            fix = "Look for an endless loop or an exhaustive search, and bound it."
        elif sig == signal.SIGKILL:
            what, kind = f"was killed (SIGKILL; often the memory limit of {memory_mb} MB)", "memory"
            fix = "Do not build large structures; work on the records you need."
        else:
            what, kind = f"crashed with signal {sig.name}", "crash"
            fix = "Avoid deep recursion and huge values."
        raise SandboxError(_report(what, seed, proc.stderr, fix), kind, seed, proc.stderr)
    if proc.returncode != 0 or len(instances) != len(seeds):
        raise SandboxError(
            _report(
                f"exited with status {proc.returncode} after {len(instances)} of {len(seeds)} seeds",
                seed,
                proc.stderr,
                "The module must not exit or stop the interpreter; `generate` must return a dict.",
            ),
            "crash",
            seed,
            proc.stderr,
        )
    return instances


# ---------------------------------------------------------------------------------------------------------------
# The child
# ---------------------------------------------------------------------------------------------------------------

# Builtins a generator's namespace does not get at run time (the static check forbids them too; this holds for
# modules that were never checked). `__import__` is replaced by `_guarded_import`.
REMOVED_BUILTINS = frozenset(FORBIDDEN_NAMES) | {"copyright", "credits", "license", "__loader__", "__spec__"}
NOBODY = 65534


def _lower_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Lower one resource limit to (soft, hard), never above a limit the child already has."""
    import resource

    hard = soft if hard is None else hard
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def _lock_down(memory_mb: int, cpu_s: int) -> None:
    """Resource limits for the rest of the child's life. Set here, in the child, rather than in a `preexec_fn`:
    the parent often has threads (an HTTP server beside the generation agent), and `preexec_fn` is unsafe then."""
    import resource

    _lower_limit(resource.RLIMIT_AS, memory_mb * 1024 * 1024)
    _lower_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
    _lower_limit(resource.RLIMIT_FSIZE, 0)  # no file can get a single byte
    _lower_limit(resource.RLIMIT_NPROC, 0)  # no fork (not enforced for root: see _drop_privileges)
    _lower_limit(resource.RLIMIT_CORE, 0)


class _CappedLog:
    """Where a generator's `print` goes: stderr, up to `limit` characters (a print loop must not flood the
    parent, which keeps the child's stderr in memory)."""

    def __init__(self, stream, limit: int = 64_000):
        self.stream, self.left = stream, limit

    def write(self, text: str) -> int:
        if self.left > 0:
            self.stream.write(text[: self.left])
            self.left -= len(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def _drop_privileges() -> None:
    """When started as root: chroot into the job folder and become `nobody`, so an escaped generator can read
    nothing outside its temp dir and change nothing it does not own. Must
    come after every file the child needs is read and every module it uses is imported (nobody may not be able
    to read them)."""
    if os.getuid() != 0:
        return
    try:
        # Confine the file system view to the job's own temporary folder first (only root may chroot): an
        # escaped generator can then read nothing outside it either.
        os.chroot(os.getcwd())
        os.chdir("/")
    except OSError:
        pass
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    except OSError:
        pass  # a root without CAP_SETUID (some containers): the limits and Python-level guards still hold


def _block_network() -> None:
    for name in ("socket", "_socket", "ssl", "_ssl", "select", "selectors"):
        if name not in sys.modules:
            sys.modules[name] = None  # `import socket` now raises ImportError


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level or _top(name) not in ALLOWED_MODULES:
        raise ImportError(f"import of {name!r} is not allowed in a generator module")
    return __import__(name, globals, locals, fromlist, level)


def _safe_builtins() -> dict:
    import builtins

    safe = {k: v for k, v in vars(builtins).items() if k not in REMOVED_BUILTINS}
    safe["__import__"] = _guarded_import
    return safe


def _fresh_module(code, source: str):
    """A new module object with the restricted builtins, registered as `generator` (dataclasses looks it up)."""
    import linecache

    module = type(sys)("generator")
    module.__dict__["__builtins__"] = _safe_builtins()
    sys.modules["generator"] = module
    linecache.cache["<generator>"] = (len(source), None, source.splitlines(True), "<generator>")
    exec(code, module.__dict__)  # noqa: S102 — the point of this process
    return module


def _child_main(work: str) -> int:
    with open(os.path.join(work, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    _lock_down(job["memory_mb"], job["cpu_s"])
    with open(os.path.join(work, "generator.py"), encoding="utf-8") as f:
        source = f.read()
    with open(os.path.join(work, "db.json"), encoding="utf-8") as f:
        db_text = f.read()
    import importlib
    import random
    import traceback

    for name in sorted(ALLOWED_MODULES):  # import everything now: after the drop the files may be unreadable
        importlib.import_module(name)
    importlib.import_module("collections.abc")
    _drop_privileges()
    _block_network()
    out = sys.stdout
    sys.stdout = sys.stderr = _CappedLog(sys.stderr)  # a generator's print() must not corrupt the result stream

    def emit(record: dict) -> None:
        out.write(json.dumps(record, allow_nan=False) + "\n")
        out.flush()

    try:
        code = compile(source, "<generator>", "exec")
    except SyntaxError as exc:
        emit({"seed": None, "kind": "exception", "error": f"SyntaxError: {exc}"})
        return 1
    for seed in job["seeds"]:
        # A generator that (wrongly) uses the global `random` still gets the same numbers for the same seed.
        random.seed(seed)
        try:
            module = _fresh_module(code, source)
            generate = getattr(module, "generate", None)
            if not callable(generate):
                emit({"seed": seed, "kind": "output", "error": f"defines no function `{GENERATE_SIGNATURE}`"})
                return 1
            result = generate(seed, job["difficulty"], json.loads(db_text))
        except MemoryError:
            emit({"seed": seed, "kind": "memory", "error": "MemoryError"})
            return 1
        except BaseException:  # noqa: BLE001 — SystemExit and KeyboardInterrupt included: report, do not die
            kind, exc, tb = sys.exc_info()
            # Drop this runner's own frame: the author needs the frames of their module.
            lines = traceback.format_exception(kind, exc, tb.tb_next if tb.tb_next else tb, limit=-8)
            emit({"seed": seed, "kind": "exception", "error": "".join(lines)})
            return 1
        if not isinstance(result, dict):
            emit({"seed": seed, "kind": "output", "error": f"returned {type(result).__name__}, not a dict"})
            return 1
        try:
            line = json.dumps({"seed": seed, "instance": result}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            emit({"seed": seed, "kind": "output", "error": f"returned a dict that is not plain JSON data ({exc})"})
            return 1
        if len(line) > MAX_INSTANCE_CHARS:
            error = f"returned an instance of {len(line)} characters as JSON (at most {MAX_INSTANCE_CHARS})"
            emit({"seed": seed, "kind": "output", "error": error})
            return 1
        out.write(line + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
