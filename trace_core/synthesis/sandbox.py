"""Running untrusted, LLM-written generator modules: a static check of the source, then execution in a child
process isolated by the operating system (bubblewrap), with Python-level guards on top.

A generator module defines `generate(seed, difficulty, db) -> dict` (one instance as plain JSON data) and may
import only a small allow-list of standard-library modules. `check_source` rejects anything else before the
module is run: the cheap first filter, with messages its author can act on. `run_generator` then runs it in a
fresh interpreter (`python -S -s -B -P`) inside bubblewrap (docs/sandbox.md): new user, network, PID, IPC, UTS
and mount namespaces, uid/gid 65534 inside whether started by root or not, a read-only view of only the C
libraries, the interpreter and its standard library, the job folder and this file, a private tmpfs as the only
writable place, a cleared environment, and death with the parent. Inside, resource limits (address space, CPU
time, file size 0, no new processes), restricted builtins (no `open`, `exec`, `eval`, imports only from the
allow-list) and no socket modules. The parent reads the child's output under its own limits (wall clock, bytes
per instance) and parses it itself, so whatever the module does, the caller gets instances or a SandboxError.
Without a working bubblewrap, generator modules do not run at all (IsolationError says what to install).

This file is also the child's program: the parent starts `python sandbox.py <job folder>` in the sandbox, so
everything it imports at module level is standard library.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
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
STDERR_KEEP = 64_000  # bytes of a child's stderr the parent keeps (the tail)
MAX_INSTANCE_CHARS = 1_000_000  # bytes of one result line; an instance is a few KB, anything near this is a bug
CHILD_KINDS = frozenset({"memory", "output", "exception"})  # the failure kinds a child reports itself


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


# -- bubblewrap -----------------------------------------------------------------------------------------------------

BWRAP = "bwrap"
BWRAP_PACKAGE = "bubblewrap"
SANDBOX_UID = 65534  # the child's uid and gid inside its user namespace (`nobody`), for root and other users alike
CHILD_JOB = "/job"  # where the job folder (module, DB, settings) appears in the child, read-only
CHILD_RUNNER = "/trace/sandbox.py"  # where this file appears in the child, read-only
PROBE = "--probe"  # the runner's argument for "start, become the sandbox user, exit"
CHILD_TMP = "/tmp"  # the child's only writable folder: a private tmpfs that disappears with it
SYSTEM_LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")  # the C libraries the interpreter links to
NAMESPACE_FLAGS = (
    "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",  # net: loopback only
    "--hostname", "sandbox",
    "--die-with-parent",  # the child dies with the bwrap process the parent kills on timeout
    "--new-session",  # no terminal to inject keystrokes into
    "--clearenv",  # nothing of the caller's environment (API keys, HOME) gets in
)
# Started by an ordinary user: a user namespace in which the child is uid/gid 65534 (and cannot nest another).
USER_FLAGS = ("--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID))
# Started by root: no user namespace, which would leave the child root outside it (exempt from the process
# limit); bwrap keeps only the two capabilities the child needs to become uid/gid 65534 itself, first thing.
ROOT_FLAGS = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID")


class IsolationError(RuntimeError):
    """LLM-written generator modules cannot run here: bubblewrap is missing or cannot create namespaces. Not a
    fault of the module (so not a SandboxError): the message says what to install or which setting to change."""


def _interpreter_paths() -> list[str]:
    """What the child's interpreter needs beyond the system C libraries: the executable, its shared libpython
    (when it has one) and its standard library. No site-packages: the child runs with -S and imports only the
    standard library."""
    import sysconfig

    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    paths = [exe, stdlib]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and os.path.isfile(os.path.join(libdir, soname)):
        paths.append(os.path.realpath(os.path.join(libdir, soname)))
    return paths


def _bwrap_command(bwrap: str, work: str, program: list[str]) -> list[str]:
    """bubblewrap's command line for `program` (an argv whose first item is the interpreter): a read-only view
    of the C libraries, the interpreter and its standard library, the job folder at CHILD_JOB and this file at
    CHILD_RUNNER; a private tmpfs at CHILD_TMP; fresh /dev and /proc; no network."""
    cmd = [bwrap, *NAMESPACE_FLAGS, *(ROOT_FLAGS if os.geteuid() == 0 else USER_FLAGS)]
    made: set[str] = set()  # folders created by --dir
    bound: list[str] = []  # bind destinations (a folder inside one exists already, read-only)

    def bind(source: str, dest: str) -> None:
        # Folders on the way are made world-readable (bwrap would make them 0700: unreadable for uid 65534).
        parts = dest.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            folder = "/" + "/".join(parts[:i])
            if folder not in made and not any(folder == b or folder.startswith(b + "/") for b in bound):
                cmd.extend(["--perms", "0755", "--dir", folder])
                made.add(folder)
        cmd.extend(["--ro-bind", source, dest])
        bound.append(dest)

    for path in SYSTEM_LIBRARY_DIRS:
        if os.path.islink(path):
            cmd.extend(["--symlink", os.readlink(path), path])  # merged /usr: /lib -> usr/lib
        elif os.path.isdir(path):
            bind(path, path)
    for path in _interpreter_paths():
        bind(path, path)
    bind(work, CHILD_JOB)
    bind(os.path.abspath(__file__), CHILD_RUNNER)
    cmd += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", CHILD_TMP, "--chdir", CHILD_TMP]
    # A fixed hash seed keeps set iteration (and so a careless generator's output) the same from run to run.
    cmd += ["--setenv", "PYTHONHASHSEED", "0", "--"]
    return cmd + program


def _missing_bwrap() -> str:
    return (
        f"LLM-written generator modules run only inside bubblewrap, and `{BWRAP}` is not on PATH. Install the "
        f"`{BWRAP_PACKAGE}` package (Debian/Ubuntu: `sudo apt-get install {BWRAP_PACKAGE}`; Fedora: `sudo dnf "
        f"install {BWRAP_PACKAGE}`; scripts/install.sh does it when run as root), or map the capability to a "
        "template in synthesis.templates (templates do not need it)."
    )


def _unusable_bwrap(bwrap: str, detail: str) -> str:
    return (
        f"bubblewrap ({bwrap}) cannot create the sandbox for LLM-written generator modules: {detail}. Usually "
        "unprivileged user namespaces are disabled: enable them with `sudo sysctl -w "
        "kernel.unprivileged_userns_clone=1` (Debian/Ubuntu kernels) or `sudo sysctl -w user.max_user_namespaces"
        "=15000` (where it is 0); Ubuntu 23.10+ also needs `sudo sysctl -w "
        "kernel.apparmor_restrict_unprivileged_userns=0`; in a container, allow user namespaces (Docker: "
        "`--security-opt seccomp=unconfined`). Templates do not need it."
    )


@functools.lru_cache(maxsize=8)
def _isolation_problem(bwrap: str | None) -> str | None:
    """Why `bwrap` cannot run the child (None when it can), found by starting the sandbox's interpreter in it."""
    if bwrap is None:
        return _missing_bwrap()
    with tempfile.TemporaryDirectory(prefix="trace-sandbox-probe-") as work:
        os.chmod(work, 0o755)
        cmd = _bwrap_command(bwrap, work, [_interpreter_paths()[0], "-S", "-s", "-B", "-P", CHILD_RUNNER, PROBE])
        try:
            proc = subprocess.run(cmd, env={}, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return _unusable_bwrap(bwrap, f"{type(exc).__name__}: {exc}")
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip() or f"exit status {proc.returncode}"
        return _unusable_bwrap(bwrap, _tail(detail))
    return None


def require_isolation() -> str:
    """The path of a bwrap that can run generator modules; IsolationError (saying what to install or change)
    when there is none. Checked once per process and path."""
    bwrap = shutil.which(BWRAP)
    problem = _isolation_problem(bwrap)
    if problem:
        raise IsolationError(problem)
    return bwrap


# -- running ----------------------------------------------------------------------------------------------------

def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]


def _report(what: str, seed: int | None, stderr: str, fix: str) -> str:
    who = f"On seed {seed}, the generator" if seed is not None else "The generator"
    text = f"{who} {what}. {fix}"
    tail = _tail(stderr)
    return text + (f"\n--- stderr (tail) ---\n{tail}" if tail else "")


def _isolated_command(work: str) -> list[str]:
    """The child's command line: this file run by the base interpreter inside bubblewrap. -S -s: no
    site-packages, no user site; -B: no .pyc writes; -P: the script's folder is not put on sys.path. Not -I: it
    implies -E, which would ignore PYTHONHASHSEED."""
    program = [_interpreter_paths()[0], "-S", "-s", "-B", "-P", CHILD_RUNNER, CHILD_JOB]
    return _bwrap_command(require_isolation(), work, program)


class _Finished:
    """What a child left: exit status, its stdout lines (bytes) and the tail of its stderr; `stopped` says why the
    parent killed it (None, "timeout" or "output")."""

    def __init__(self, returncode: int, lines: list[bytes], stderr: str, stopped: str | None):
        self.returncode, self.lines, self.stderr, self.stopped = returncode, lines, stderr, stopped


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # bwrap and everything in its session; the sandbox dies with it
    except ProcessLookupError:
        pass
    proc.wait()


def _communicate(cmd: list[str], timeout_s: float, max_lines: int) -> _Finished:
    """Run `cmd` and read its output under the parent's own limits: the wall clock, at most MAX_INSTANCE_CHARS
    bytes per stdout line and `max_lines` lines, stderr kept to its last STDERR_KEEP bytes. The child's own checks
    of these are conveniences; these hold even for a child that lost control of its interpreter."""
    import selectors
    import time

    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                            close_fds=True, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    lines: list[bytes] = []
    partial, err = b"", b""
    stopped = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while sel.get_map() and stopped is None:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is proc.stderr:
                    err = (err + chunk)[-STDERR_KEEP:]
                else:
                    *done, partial = (partial + chunk).split(b"\n")
                    lines += done
                    if len(partial) > MAX_INSTANCE_CHARS or any(len(x) > MAX_INSTANCE_CHARS for x in done) or (
                        len(lines) > max_lines
                    ):
                        stopped = "output"
    if stopped is not None:
        _kill(proc)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stopped = "timeout"
            _kill(proc)
    proc.stdout.close()
    proc.stderr.close()
    if partial and stopped != "output":
        lines.append(partial)
    return _Finished(proc.returncode, lines, err.decode("utf-8", errors="replace"), stopped)


def run_generator(
    source: str,
    seeds: list[int],
    difficulty: int,
    *,
    timeout_s: float = 60,
    memory_mb: int = 2048,
    cpu_s: int = 60,
) -> list[dict]:
    """`generate(seed, difficulty, db)` for every seed, in a child process inside bubblewrap; one dict per seed,
    in order. Each seed gets a freshly executed module and a fresh copy of the DB, so results do not depend on
    which other seeds share the run. Every failure of the module (an exception, a limit, output that is not one
    JSON object per seed within the size cap) raises SandboxError; IsolationError when bubblewrap cannot run.

    The source is not checked here (callers run `check_source` first); the child's own guards and the operating
    system's isolation hold either way."""
    seeds = [int(s) for s in seeds]
    if not seeds:
        return []
    with tempfile.TemporaryDirectory(prefix="trace-sandbox-") as work:
        os.chmod(work, 0o755)  # readable by the unprivileged user bwrap maps the child to
        for name, text in (("generator.py", source), ("db.json", retail_db_json())):
            with open(os.path.join(work, name), "w", encoding="utf-8") as f:
                f.write(text)
        job = {"seeds": seeds, "difficulty": int(difficulty), "memory_mb": int(memory_mb), "cpu_s": int(cpu_s)}
        with open(os.path.join(work, "job.json"), "w", encoding="utf-8") as f:
            json.dump(job, f)
        done = _communicate(_isolated_command(work), timeout_s, len(seeds) + 1)
    return _results(done, seeds, memory_mb, cpu_s, timeout_s)


def _output_error(what: str, seed: int | None, stderr: str) -> SandboxError:
    fix = f"`generate` must return a dict of JSON values ({GENERATE_SIGNATURE} -> dict) and leave stdout alone."
    return SandboxError(_report(what, seed, stderr, fix), "output", seed, stderr)


def _record(line: bytes, seed: int | None, stderr: str) -> dict:
    """One result line of the child, parsed and shape-checked by the parent (never trusting the child)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _output_error(f"wrote a result that is not JSON ({type(exc).__name__})", seed, stderr) from None
    if not isinstance(record, dict):
        raise _output_error(f"wrote a result that is a JSON {type(record).__name__}, not an object", seed, stderr)
    return record


def _results(done: _Finished, seeds: list[int], memory_mb: int, cpu_s: int, timeout_s: float) -> list[dict]:
    """The instances from a finished child, or the SandboxError that explains its failure."""
    instances: list[dict] = []
    stderr = done.stderr
    for line in done.lines:
        seed = seeds[len(instances)] if len(instances) < len(seeds) else None
        if not line.strip():
            continue
        record = _record(line, seed, stderr)
        if "error" in record:
            kind = record.get("kind") if record.get("kind") in CHILD_KINDS else "exception"
            error = str(record["error"])
            if kind == "memory":
                what, fix = f"ran out of memory (limit {memory_mb} MB)", "Do not build large structures."
            elif kind == "output":
                what, fix = error, f"`generate` must return a dict of JSON values ({GENERATE_SIGNATURE} -> dict)."
            else:
                what, fix = "raised an exception", f"Fix the error:\n{error.strip()}"
            raise SandboxError(_report(what, seed, stderr, fix), kind, seed, stderr)
        if seed is None:
            raise _output_error(f"wrote more results than the {len(seeds)} seeds asked for", None, stderr)
        if record.get("seed") != seed or not isinstance(record.get("instance"), dict) or len(record) != 2:
            raise _output_error("wrote a result record that is not {seed, instance} for the seed asked", seed, stderr)
        instances.append(record["instance"])
    seed = seeds[len(instances)] if len(instances) < len(seeds) else None
    if done.stopped == "timeout":
        raise SandboxError(
            _report(
                f"ran past the {timeout_s:g} s wall-clock limit and was killed",
                seed,
                stderr,
                "Look for an endless loop (e.g. `while` retrying a draw that can never succeed) and bound it.",
            ),
            "timeout",
            seed,
            stderr,
        )
    if done.stopped == "output":
        raise _output_error(
            f"wrote more than {MAX_INSTANCE_CHARS} bytes for one instance (or more lines than seeds) and was killed",
            seed,
            stderr,
        )
    # bwrap reports a child killed by signal N as exit status 128 + N.
    code = done.returncode
    sig = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None
    if sig is not None and sig in {s.value for s in signal.Signals}:
        sig = signal.Signals(sig)
        if sig == signal.SIGXCPU:
            what, kind = f"used more than its {cpu_s} s of CPU time and was killed", "cpu"
            fix = "Look for an endless loop or an exhaustive search, and bound it."
        elif sig == signal.SIGKILL:
            what, kind = f"was killed (SIGKILL; often the memory limit of {memory_mb} MB)", "memory"
            fix = "Do not build large structures; work on the records you need."
        else:
            what, kind = f"crashed with signal {sig.name}", "crash"
            fix = "Avoid deep recursion and huge values."
        raise SandboxError(_report(what, seed, stderr, fix), kind, seed, stderr)
    if code != 0 or len(instances) != len(seeds):
        raise SandboxError(
            _report(
                f"exited with status {code} after {len(instances)} of {len(seeds)} seeds",
                seed,
                stderr,
                "The module must not exit or stop the interpreter; `generate` must return a dict.",
            ),
            "crash",
            seed,
            stderr,
        )
    return instances


# ---------------------------------------------------------------------------------------------------------------
# The child
# ---------------------------------------------------------------------------------------------------------------

# Builtins a generator's namespace does not get at run time (the static check forbids them too; this holds for
# modules that were never checked). `__import__` is replaced by `_guarded_import`.
REMOVED_BUILTINS = frozenset(FORBIDDEN_NAMES) | {"copyright", "credits", "license", "__loader__", "__spec__"}


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
    _lower_limit(resource.RLIMIT_NPROC, 0)  # no fork (enforced: the child has no capability outside its namespace)
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


class _NotJSON(ValueError):
    pass


def _json_encoder(limit: int):
    """A JSON encoder for a generator's result that the generator cannot patch: built before the module runs, from
    references captured here (the C string quoter, the exact builtin types and their C methods), so replacing
    `json.dumps`, `json.encoder.*` or a builtin afterwards changes nothing. Exact JSON types and their subclasses
    (read through the base type's own methods, never an override); at most `limit` characters."""
    from json.encoder import encode_basestring_ascii as quote  # the C function of _json

    type_, issubclass_, len_ = type, issubclass, len
    dict_items, list_iter, tuple_iter = dict.items, list.__iter__, tuple.__iter__
    int_repr, float_repr, str_str = int.__repr__, float.__repr__, str.__str__
    specials = {"nan", "inf", "-inf"}

    def key(k) -> str:
        t = type_(k)
        if issubclass_(t, str):
            return quote(str_str(k))
        if t is bool or k is None:
            return quote({True: "true", False: "false", None: "null"}[k])
        if issubclass_(t, int):
            return quote(int_repr(k))
        if issubclass_(t, float):
            return quote(number(k))
        raise _NotJSON(f"keys must be str, int, float, bool or None, not {t.__name__}")

    def number(v) -> str:
        text = float_repr(v)
        if text in specials:
            raise _NotJSON(f"out of range float value {text}")
        return text

    def encode(value) -> str:
        parts: list[str] = []
        size = 0

        def put(text: str) -> None:
            nonlocal size
            size += len_(text)
            if size > limit:
                raise _NotJSON(f"more than {limit} characters as JSON")
            parts.append(text)

        def walk(v) -> None:
            t = type_(v)
            if v is None or t is bool:
                put({None: "null", True: "true", False: "false"}[v])
            elif issubclass_(t, str):
                put(quote(str_str(v)))
            elif issubclass_(t, int):
                put(int_repr(v))
            elif issubclass_(t, float):
                put(number(v))
            elif issubclass_(t, dict):
                put("{")
                for i, (k, item) in enumerate(dict_items(v)):
                    put(("," if i else "") + key(k) + ":")
                    walk(item)
                put("}")
            elif issubclass_(t, (list, tuple)):
                put("[")
                for i, item in enumerate((list_iter if issubclass_(t, list) else tuple_iter)(v)):
                    if i:
                        put(",")
                    walk(item)
                put("]")
            else:
                raise _NotJSON(f"Object of type {t.__name__} is not JSON serializable")

        walk(value)
        return "".join(parts)

    return encode


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


def _become_sandbox_user() -> None:
    """Become uid/gid 65534 with no supplementary groups, if not already (bwrap started by root leaves the child
    root with only CAP_SETUID and CAP_SETGID); refuse to go on as anyone else."""
    if os.getuid() != SANDBOX_UID or os.getgid() != SANDBOX_UID:
        os.setgroups([])
        os.setgid(SANDBOX_UID)
        os.setuid(SANDBOX_UID)  # drops every capability left
    if (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) != (SANDBOX_UID,) * 4:
        raise SystemExit(f"sandbox: not running as uid/gid {SANDBOX_UID}; refusing to run the module")


def _child_main(work: str) -> int:
    _become_sandbox_user()
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

    for name in sorted(ALLOWED_MODULES):
        importlib.import_module(name)
    importlib.import_module("collections.abc")
    _block_network()
    # Everything the runner needs after the module starts is captured now: the module may patch json, random or
    # builtins (the parent checks every line it reads anyway).
    encode = _json_encoder(MAX_INSTANCE_CHARS)
    loads, reseed, format_exception, isinstance_, callable_ = (
        json.loads, random.seed, traceback.format_exception, isinstance, callable
    )
    out_write, out_flush = sys.stdout.write, sys.stdout.flush
    sys.stdout = sys.stderr = _CappedLog(sys.stderr)  # a generator's print() must not corrupt the result stream

    def emit(record: dict) -> None:
        out_write(encode(record) + "\n")
        out_flush()

    def fail(seed, kind: str, error: str) -> int:
        emit({"seed": seed, "kind": kind, "error": error[-20_000:]})
        return 1

    try:
        code = compile(source, "<generator>", "exec")
    except SyntaxError as exc:
        return fail(None, "exception", f"SyntaxError: {exc}")
    for seed in job["seeds"]:
        # A generator that (wrongly) uses the global `random` still gets the same numbers for the same seed.
        reseed(seed)
        try:
            module = _fresh_module(code, source)
            generate = module.__dict__.get("generate")
            if not callable_(generate):
                return fail(seed, "output", f"defines no function `{GENERATE_SIGNATURE}`")
            result = generate(seed, job["difficulty"], loads(db_text))
        except MemoryError:
            return fail(seed, "memory", "MemoryError")
        except BaseException:  # noqa: BLE001 — SystemExit and KeyboardInterrupt included: report, do not die
            try:
                kind, exc, tb = sys.exc_info()
                # Drop this runner's own frame: the author needs the frames of their module.
                text = "".join(format_exception(kind, exc, tb.tb_next if tb.tb_next else tb, limit=-8))
            except BaseException:  # noqa: BLE001 — a patched traceback module must not hide the failure
                text = "the exception could not be formatted"
            return fail(seed, "exception", text)
        if not isinstance_(result, dict):
            return fail(seed, "output", f"returned {type(result).__name__}, not a dict")
        try:
            line = encode({"seed": seed, "instance": result})
        except (_NotJSON, RecursionError) as exc:
            return fail(seed, "output", f"returned a dict that is not plain JSON data ({exc})")
        except BaseException as exc:  # noqa: BLE001
            return fail(seed, "output", f"returned a dict that cannot be read ({type(exc).__name__})")
        out_write(line + "\n")
        out_flush()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == PROBE:  # the parent checks that the sandbox can start and switch users
        _become_sandbox_user()
        sys.exit(0)
    sys.exit(_child_main(sys.argv[1]))
