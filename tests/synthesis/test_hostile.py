"""Hostile generator modules (issue #33): each is run the way synthesis runs an LLM-written module, and must be
rejected (with a reason) or contained: it reads no secret of the caller, writes no file, opens no connection,
leaves no process behind, and the caller goes on running. The Python-level guards are walked past on purpose
(a dunder walk to `os`), so what holds is the operating system's isolation (bubblewrap) and the parent's own
checks. The suite runs as root and as an unprivileged user (.ci/run); with TRACE_HOSTILE_REPORT set, one JSON
line per module (outcome, reason, seconds, uid) is appended to that file."""

from __future__ import annotations

import builtins
import json
import os
import random
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from trace_core.envs.base import EpisodeLimits
from trace_core.synthesis.generated import EXAMPLE_MODULE, GeneratedEnv
from trace_core.synthesis.harness import _determinism, _probe, probe_do_nothing
from trace_core.synthesis.sandbox import CHILD_RUNNER, SandboxError, check_source, run_generator
from tests.defaults import PARAMS, default_user, harness_config

TOKEN = secrets.token_hex(16)
SECRET_VAR = "TRACE_HOSTILE_SECRET"
# The dunder walk to `os` that only the static check refuses: every module below starts from it.
WALK = (
    'OS = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close")'
    ".__init__.__globals__\n"
)
# The real `__import__`, reached through `os` (which imports sys): any module, past the guarded import.
IMPORT = 'IMP = OS["sys"].modules["builtins"].__import__\n'


def gen(body: str, prelude: str = WALK) -> str:
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"{prelude}def generate(seed, difficulty, db):\n{lines}\n"


# -- fixtures: secrets, a loopback server, a private temp folder, the record ---------------------------------------
@pytest.fixture(scope="module")
def secret_files(tmp_path_factory):
    """A secret file outside the project and a fake HOME with ~/.ssh/id_rsa, both holding TOKEN."""
    root = tmp_path_factory.mktemp("hostile-secrets")
    beside = root / "beside-project-secret.txt"
    beside.write_text(f"secret {TOKEN}\n")
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text(f"-----BEGIN KEY----- {TOKEN}\n")
    return {"beside": str(beside), "home": str(home), "ssh": str(home / ".ssh" / "id_rsa")}


@pytest.fixture(autouse=True)
def caller(monkeypatch, secret_files, tmp_path):
    """The caller's environment holds the token (an API key, HOME); the sandbox's job folders go to a private
    temp folder, which must be empty afterwards, and no process may survive that names it."""
    monkeypatch.setenv(SECRET_VAR, TOKEN)
    monkeypatch.setenv("HOME", secret_files["home"])
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    os.chmod(tmp_path, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(jobs))
    yield
    assert list(jobs.iterdir()) == [], "a job folder was left behind"
    deadline = time.monotonic() + 5
    while _processes_naming(str(jobs)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_naming(str(jobs)), "a sandbox process outlived its run"


def _processes_naming(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


class Server:
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.port, self.accepted, self.stop = self.sock.getsockname()[1], 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.thread.join()
        self.sock.close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def record(name: str, outcome: str, reason: str, seconds: float) -> None:
    row = {"module": name, "outcome": outcome, "reason": " ".join(reason.split())[:200], "seconds": round(seconds, 2),
           "uid": os.getuid()}
    print(json.dumps(row))
    path = os.environ.get("TRACE_HOSTILE_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def no_secret(*texts) -> None:
    for text in texts:
        assert TOKEN not in str(text), "a secret reached the output"


def run(name: str, source: str, **limits) -> dict | SandboxError:
    """Run `source` for seed 0 as synthesis would; return its instance or its SandboxError, recorded. The static
    check's verdict is part of the record: a hostile module is rejected there before it ever runs."""
    static = check_source(source)
    start = time.monotonic()
    try:
        (out,) = run_generator(source, [0], 1, **limits)
    except SandboxError as exc:
        no_secret(exc, exc.stderr)
        first = str(exc).splitlines()[0]
        record(name, "stopped", f"static: {static[0] if static else 'passes'} | run: {first}", time.monotonic() - start)
        return exc
    no_secret(json.dumps(out))
    record(name, "contained", f"static: {static[0] if static else 'passes'} | run: returned {json.dumps(out)[:120]}",
           time.monotonic() - start)
    return out


def errors_of(out: dict) -> set[str]:
    return {k for k in out if k.endswith("error")}


# -- reading the caller's secrets ------------------------------------------------------------------------------------
def test_dunder_walk_reaches_os_but_sees_only_the_sandbox():
    out = run("dunder_walk_to_os", gen("""
return {"uid": OS["getuid"](), "root": sorted(OS["listdir"]("/")), "env": dict(OS["environ"]),
        "host": OS["uname"]().nodename}
"""))
    assert check_source(gen("return {}"))  # the static check refuses the walk itself
    assert out["uid"] == 65534 and out["host"] == "sandbox"
    assert set(out["root"]) <= {"dev", "job", "lib", "lib64", "proc", "root", "tmp", "trace", "usr", "opt", "home"}
    assert SECRET_VAR not in out["env"] and "HOME" not in out["env"]


READ = """
out = {}
for path in PATHS:
    try:
        fd = OS["open"](path, OS["O_RDONLY"])
        out[path] = OS["read"](fd, 4096).decode(errors="replace")
    except OSError as exc:
        out[path + ":error"] = type(exc).__name__
return out
"""


@pytest.mark.parametrize("what", ["etc_passwd", "beside_project", "home_ssh"])
def test_secret_files_cannot_be_read(what, secret_files):
    path = {"etc_passwd": "/etc/passwd", "beside_project": secret_files["beside"], "home_ssh": secret_files["ssh"]}
    out = run(f"read_{what}", gen(READ, WALK + f"PATHS = [{path[what]!r}]\n"))
    assert set(out) == {path[what] + ":error"}, out


def test_proc_self_environ_holds_no_caller_variable():
    out = run("read_proc_environ", gen("""
out = {}
for path in ("/proc/self/environ", "/proc/1/environ", "/proc/1/cmdline"):
    try:
        fd = OS["open"](path, OS["O_RDONLY"])
        out[path] = OS["read"](fd, 65536).decode(errors="replace")
    except OSError as exc:
        out[path] = type(exc).__name__
return out
"""))
    # Started by root, the child became uid 65534 itself, which leaves its /proc entries unreadable to it.
    environ = out["/proc/self/environ"]
    names = {v.split("=", 1)[0] for v in environ.split("\0") if v} if environ != "PermissionError" else set()
    assert names <= {"PYTHONHASHSEED", "PWD"}, names
    assert SECRET_VAR not in out["/proc/1/environ"] and "HOME=" not in out["/proc/1/environ"]


def test_home_expansion_finds_nothing():
    out = run("expand_home_ssh", gen(READ, WALK + 'PATHS = [OS["path"].expanduser("~/.ssh/id_rsa")]\n'))
    assert all(k.endswith(":error") for k in out), out


# -- writing -------------------------------------------------------------------------------------------------------
def test_writes_outside_the_private_tmp_fail(secret_files):
    target = Path(secret_files["beside"]).parent / "planted.txt"
    paths = [str(target), "/job/planted.txt", CHILD_RUNNER, "/tmp/planted.txt", "/usr/lib/planted.txt"]
    out = run("write_outside_tmp", gen(f"""
out = {{}}
for path in {paths!r}:
    try:
        fd = OS["open"](path, OS["O_WRONLY"] | OS["O_CREAT"], 0o644)
        out[path] = OS["write"](fd, b"pwned")
    except OSError as exc:
        out[path + ":error"] = type(exc).__name__
return out
"""))
    assert not target.exists()
    assert all(k.endswith(":error") for k in out), out  # even the private tmpfs takes no byte (file size limit 0)


# -- network -------------------------------------------------------------------------------------------------------
def test_restored_socket_module_cannot_reach_a_loopback_server(server):
    out = run("restore_socket_connect", gen(f"""
mods = OS["sys"].modules
for name in ("socket", "_socket", "select", "selectors"):
    if mods.get(name, 0) is None:
        del mods[name]
sock = IMP("socket")
out = {{}}
try:
    s = sock.create_connection(("127.0.0.1", {server.port}), timeout=2)
    out["connected"] = True
except OSError as exc:
    out["error"] = type(exc).__name__
return out
""", WALK + IMPORT))
    assert "connected" not in out and "error" in out
    time.sleep(0.3)
    assert server.accepted == 0


def test_dns_lookup_fails():
    out = run("dns_lookup", gen("""
mods = OS["sys"].modules
for name in ("socket", "_socket", "select", "selectors"):
    if mods.get(name, 0) is None:
        del mods[name]
sock = IMP("socket")
try:
    return {"resolved": sock.getaddrinfo("pypi.org", 443)[0][4][0]}
except OSError as exc:
    return {"error": type(exc).__name__}
""", WALK + IMPORT))
    assert "resolved" not in out


# -- processes -------------------------------------------------------------------------------------------------------
def test_spawning_and_forking_fail():
    out = run("spawn_and_fork", gen("""
out = {}
for what, call in (("fork", lambda: OS["fork"]()), ("system", lambda: OS["system"]("id")),
                   ("spawn", lambda: OS["posix_spawn"]("/usr/bin/id", ["id"], {}))):
    try:
        pid = call()
        if what == "fork" and pid == 0:
            OS["_exit"](0)
        out[what] = pid
    except OSError as exc:
        out[what + ":error"] = type(exc).__name__
return out
"""))
    assert out.get("system", 1) != 0 and "fork" not in out and "spawn" not in out, out


def test_fork_bomb_is_contained():
    out = run("fork_bomb", gen("""
n = 0
for _ in range(10000):
    try:
        OS["fork"]()
        n += 1
    except OSError:
        pass
return {"forks": n}
"""))
    assert isinstance(out, SandboxError) or out["forks"] == 0


def test_endless_loop_is_stopped_by_the_wall_clock():
    err = run("infinite_loop", gen("while True:\n    pass", ""), timeout_s=3)
    assert isinstance(err, SandboxError) and err.kind == "timeout"


def test_ten_gigabyte_allocation_is_stopped():
    err = run("allocate_10GB", gen("big = bytearray(10 * 1024 ** 3)\nreturn {'n': len(big)}", ""), memory_mb=1024)
    assert isinstance(err, SandboxError) and err.kind == "memory"


def test_os_exit_is_reported():
    err = run("os_exit", gen('OS["_exit"](0)'))
    assert isinstance(err, SandboxError) and err.kind == "crash" and "0 of 1 seeds" in str(err)


def test_ctypes_into_libc_cannot_forge_results_or_fork():
    err = run("ctypes_libc", gen("""
ctypes = IMP("ctypes")
libc = ctypes.CDLL(None)
libc.system(b"touch /tmp/x")
libc.write(1, b'{"seed": 0, "instance": {"forged": 1}}\\n{"not json', 48)
return {"honest": True}
""", WALK + IMPORT))
    assert isinstance(err, SandboxError) and err.kind == "output", err


def test_patched_serialiser_cannot_crash_or_oversize():
    # issue #35 item 4: json.dumps replaced passes the static check; the runner's own encoder is unaffected.
    source = "import json\n" + gen('json.dumps = lambda *a, **k: "5"\nreturn {"seed": seed}', "")
    assert check_source(source) == []
    out = run("patch_json_dumps", source)
    assert out == {"seed": 0}
    # Past the guards: 3 MB written straight to the result stream; the parent's cap stops it.
    err = run("write_3MB_result", gen("""
OS["write"](1, b'{"seed": 0, "instance": {"x": "' + b"a" * (3 * 1024 * 1024) + b'"}}\\n')
return {}
"""))
    assert isinstance(err, SandboxError) and err.kind == "output" and "1000000 bytes" in str(err)


# -- rewards and determinism (the harness) ---------------------------------------------------------------------------
GOOD_BODY = EXAMPLE_MODULE.split("def generate(seed, difficulty, db):\n", 1)[1]


def test_patching_builtins_cannot_fake_a_reward():
    source = WALK + 'B = OS["sys"].modules["builtins"]\n' + EXAMPLE_MODULE.replace(
        "    rng = random.Random(seed)",
        "    B.sum = lambda *a, **k: 1.0\n    B.min = B.max = B.round = B.abs = lambda *a, **k: 1.0\n"
        "    rng = random.Random(seed)",
    )
    start = time.monotonic()
    env = GeneratedEnv.__new__(GeneratedEnv)  # past the constructor's static check, as an escaped module would be
    _init_unchecked(env, source)
    inst = env.generate(0, 1)
    ep = env.start(inst, default_user(), EpisodeLimits(max_steps=30, max_errors=100))
    probe_do_nothing(ep, random.Random(0))
    reward = ep.score().reward
    record("patch_builtins_fake_reward", "contained", f"do-nothing reward in the parent {reward}",
           time.monotonic() - start)
    assert reward == 0.0 and builtins.sum([1, 2]) == 3


def _init_unchecked(env: GeneratedEnv, source: str) -> None:
    import hashlib

    from trace_core.synthesis.contract import SyntheticEnv

    SyntheticEnv.__init__(env, "hostile", 1, "compact", "retail")
    env.source, env.source_sha = source, hashlib.sha256(source.encode()).hexdigest()[:16]
    env.limits = {"timeout_s": 60, "memory_mb": 2048, "cpu_s": 60}
    env._cache = {}


def test_non_deterministic_instances_are_rejected():
    source = EXAMPLE_MODULE.replace("rng = random.Random(seed)", "rng = random.Random()")
    assert check_source(source) == []
    start = time.monotonic()
    check = _determinism(GeneratedEnv(source, "hostile", 1, PARAMS.env.profile), [0, 1, 2])
    record("non_deterministic", "rejected" if not check.passed else "accepted", check.detail, time.monotonic() - start)
    assert not check.passed


def test_reward_always_one_is_rejected():
    # Only look-ups in the reference: an agent that does nothing leaves the DB as the reference does.
    source = EXAMPLE_MODULE.replace(
        '            {"name": "cancel_pending_order", "arguments": {"order_id": order_id, "reason": reason}},\n', ""
    )
    assert source != EXAMPLE_MODULE and check_source(source) == []
    start = time.monotonic()
    cfg = harness_config(train_instances=0, eval_instances=0)
    env = GeneratedEnv(source, "hostile", 1, PARAMS.env.profile)
    check = _probe(env, "do_nothing", [0, 1, 2, 3], cfg, lambda: None)
    record("reward_always_1", "rejected" if not check.passed else "accepted", check.detail, time.monotonic() - start)
    assert not check.passed


def test_the_caller_keeps_running():
    out = run("honest_after_hostile", EXAMPLE_MODULE)
    assert isinstance(out, dict) and out["reference_actions"]
