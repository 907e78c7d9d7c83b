"""LLM-written generator modules: the static check, the sandbox (limits and guards hold even for a module that
was never checked), GeneratedEnv on the real retail environment, and the generation agent against a real
OpenAI-compatible server on 127.0.0.1 with a scripted backend."""

from __future__ import annotations

import socket
import time

import pytest

from trace_core.agents.server import ChatServer
from trace_core.envs.oracle import replay_reference
from trace_core.schemas import CapabilitySpec, Instance
from trace_core.synthesis import generated as generated_module
from trace_core.synthesis.generated import (
    EXAMPLE_MODULE,
    GeneratedEnv,
    GeneratedInstanceError,
    GenerationAgent,
    GenerationError,
    extract_module,
)
from trace_core.synthesis.sandbox import SandboxError, check_source, run_generator
from tests.defaults import PARAMS, harness_config

# The generation agent's settings as stage synthesis passes them from params.yaml
_g = PARAMS.synthesis.generator
GENERATOR = {"max_attempts": _g.max_attempts, "temperature": _g.temperature, "max_new_tokens": _g.max_new_tokens,
             "seed": PARAMS.seed, "difficulty": PARAMS.synthesis.difficulty, "profile": PARAMS.env.profile,
             "timeout_s": _g.timeout_s}

GOOD = EXAMPLE_MODULE  # the prompt's worked example doubles as the known-good module
CAP = CapabilitySpec(
    capability_id="tool_precision",
    name="tool calling precision",
    definition="Calls the right tool with exactly the right arguments.",
    labeller="llm",
)
FAILURE = "agent called cancel_pending_order on #W0000000, an order of another user"


def module(body: str) -> str:
    """A generator module whose generate(seed, difficulty, db) runs `body` (indented by the caller's lines)."""
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"def generate(seed, difficulty, db):\n{lines}\n"


# -- static check ---------------------------------------------------------------------------------------------------
def test_static_check_accepts_the_good_module():
    assert check_source(GOOD) == []
    # Harmless dunders, classes, dataclasses and literal getattr are ordinary generator code.
    extra = (
        "from dataclasses import dataclass\n"
        "@dataclass\nclass Pick:\n    oid: str\n    def __post_init__(self):\n        self.n = len(self.oid)\n"
        "def helper(rng):\n    return getattr(rng, 'random')()\n"
        "if __name__ == '__main__':\n    print(Pick.__name__)\n"
    )
    assert check_source(GOOD + extra) == []


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import os\n" + GOOD, ["line 1: `import os` is not allowed: a generator may import only bisect,"]),
        (GOOD + "X = open('notes.txt', 'w')\n", ["`open` is not allowed: file access is not allowed"]),
        ("m = __import__('os')\n" + GOOD, ["line 1: `__import__` is not allowed: dynamic imports"]),
        (
            "k = ().__class__.__subclasses__()\n" + GOOD,
            ["line 1: dunder attribute `.__class__` is not allowed", "line 1: dunder attribute `.__subclasses__`"],
        ),
        ("v = eval('1 + 1')\n" + GOOD, ["line 1: `eval` is not allowed: running dynamic code"]),
        ("def make(seed, difficulty, db):\n    return {}\n", ["must define `def generate(seed, difficulty, db)`"]),
        ("def generate(seed, difficulty, db)\n    return {}\n", ["syntax error at line 1"]),
        ("def generate(seed):\n    return {}\n", ["`generate` must take three positional arguments"]),
        ("import typing\nS = typing.sys\n" + GOOD, ["line 2: attribute `.sys` is not allowed: it names a module"]),
        ("import random as r\nO = r._os\n" + GOOD, ["line 2: attribute `._os` is not allowed"]),
        (
            "import functools\nR = functools.reduce(getattr, ['a'], 1)\n" + GOOD,
            ["`getattr` may only be called directly"],
        ),
        ("def f(x, name):\n    return getattr(x, name)\n" + GOOD, ["`getattr` needs a literal attribute name"]),
        ("from string import Formatter\n" + GOOD, ["`Formatter` is not allowed: it evaluates strings"]),
        ("from . import helpers\n" + GOOD, ["relative imports are not allowed"]),
    ],
)
def test_static_check_rejects_with_a_specific_message(source, expected):
    problems = check_source(source)
    assert len(problems) >= len(expected), problems
    for want in expected:
        assert any(want in p for p in problems), (want, problems)


# -- sandbox --------------------------------------------------------------------------------------------------------
def test_sandbox_runs_the_good_module_deterministically():
    first = run_generator(GOOD, [0, 1, 2], 1)
    again = run_generator(GOOD, [0, 1, 2], 1)
    assert first == again
    assert len({str(d) for d in first}) == 3  # different seeds, different instances
    assert first[0]["reference_actions"][-1]["name"] == "cancel_pending_order"


def test_each_seed_gets_a_fresh_module_and_db():
    # Module state and DB edits from one seed must not reach the next: results cannot depend on batching.
    source = "CALLS = []\n" + module(
        """
CALLS.append(seed)
db["orders"].clear()
return {"calls": len(CALLS), "orders": len(db["users"]) > 0}
"""
    )
    assert run_generator(source, [0, 1, 2], 1) == [{"calls": 1, "orders": True}] * 3


def test_ordinary_python_runs_and_print_goes_to_a_capped_log():
    source = (
        "from __future__ import annotations\n"
        "import collections\n"
        "from dataclasses import dataclass\n\n"
        "@dataclass\nclass Count:\n    status: str\n    n: int\n\n"
        + module(
            """
for _ in range(20000):
    print("x" * 100)  # 2 MB of log: kept short, and never mixed into the results
counts = collections.Counter(o["status"] for o in db["orders"].values())
return {"top": [Count(s, n).status for s, n in counts.most_common(2)]}
"""
        )
    )
    assert check_source(source) == []
    (out,) = run_generator(source, [0], 1)
    assert out["top"] == ["pending", "delivered"]


def test_endless_loop_hits_the_wall_clock_limit():
    start = time.monotonic()
    with pytest.raises(SandboxError, match="wall-clock limit") as err:
        run_generator(module("while True:\n    pass"), [4, 5], 1, timeout_s=3)
    assert time.monotonic() - start < 15
    assert err.value.kind == "timeout" and err.value.seed == 4


def test_cpu_time_limit():
    with pytest.raises(SandboxError, match="CPU time") as err:
        run_generator(module("while True:\n    pass"), [0], 1, cpu_s=1, timeout_s=30)
    assert err.value.kind == "cpu"


def test_huge_allocation_hits_the_memory_limit():
    with pytest.raises(SandboxError, match="out of memory") as err:
        run_generator(module("big = bytearray(4 * 1024 ** 3)\nreturn {}"), [0], 1, memory_mb=512)
    assert err.value.kind == "memory"


def test_open_is_gone_at_run_time(tmp_path):
    """The runtime guard holds for a module that skipped the static check."""
    target = tmp_path / "pwned.txt"
    source = module(f"open({str(target)!r}, 'w').write('x')\nreturn {{}}")
    assert check_source(source)  # the static check would have refused it
    with pytest.raises(SandboxError, match="NameError: name 'open' is not defined"):
        run_generator(source, [0], 1)
    assert not target.exists()


def test_imports_outside_the_allow_list_fail_at_run_time():
    with pytest.raises(SandboxError, match="import of 'socket' is not allowed"):
        run_generator(module("import socket\nreturn {}"), [0], 1)


def test_an_escaped_module_still_cannot_write_or_fork(tmp_path):
    """Past the Python-level guards (a dunder walk to `os`, which only the static check refuses), the operating
    system's limits remain: no bytes can be written to a file and no process can be started."""
    target = tmp_path / "escaped.txt"
    source = module(
        f"""
os = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close").__init__.__globals__
out = {{}}
try:
    fd = os["open"]({str(target)!r}, os["O_WRONLY"] | os["O_CREAT"], 0o644)
    out["wrote"] = os["write"](fd, b"pwned")
except OSError as exc:
    out["write_error"] = str(exc)
try:
    if os["fork"]() == 0:
        os["_exit"](0)
    out["forked"] = True
except OSError as exc:
    out["fork_error"] = str(exc)
return out
"""
    )
    (out,) = run_generator(source, [0], 1)
    assert "wrote" not in out and "write_error" in out
    assert "forked" not in out and "fork_error" in out
    assert not target.exists() or target.stat().st_size == 0


def test_an_escaped_module_cannot_read_outside_its_temp_dir(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    source = module(
        f"""
os = next(c for c in ().__class__.__base__.__subclasses__() if c.__name__ == "_wrap_close").__init__.__globals__
out = {{}}
for path in ({str(secret)!r}, "/etc/hostname"):
    try:
        fd = os["open"](path, os["O_RDONLY"])
        out[path] = os["read"](fd, 100).decode()
    except OSError as exc:
        out[path + ":error"] = type(exc).__name__
return out
"""
    )
    (out,) = run_generator(source, [0], 1)
    assert set(out) == {f"{secret}:error", "/etc/hostname:error"}, out


def _without_bwrap(monkeypatch, tmp_path, fake: str | None = None):
    """PATH holds only `tmp_path`, with a fake bwrap printing `fake` and failing when given."""
    from trace_core.synthesis import sandbox

    if fake is not None:
        script = tmp_path / "bwrap"
        script.write_text(f"#!/bin/sh\necho {fake!r} >&2\nexit 1\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._isolation_problem.cache_clear()


def test_generator_modules_refuse_to_run_without_bubblewrap(monkeypatch, tmp_path):
    from trace_core.synthesis.sandbox import IsolationError
    from trace_core.synthesis.templates import TEMPLATES, make

    _without_bwrap(monkeypatch, tmp_path)
    with pytest.raises(IsolationError, match=r"`bubblewrap` package.*apt-get install bubblewrap"):
        run_generator(GOOD, [0], 1)
    # Templates are our own code and do not run in the sandbox: they keep working.
    name = sorted(TEMPLATES)[0]
    assert make(name, name, 1, "compact").reset(0).instance_id


def test_generator_modules_refuse_to_run_without_user_namespaces(monkeypatch, tmp_path):
    from trace_core.synthesis.sandbox import IsolationError

    _without_bwrap(monkeypatch, tmp_path, "bwrap: No permissions to create new namespace")
    with pytest.raises(IsolationError, match=r"(?s)No permissions.*kernel.unprivileged_userns_clone=1.*"
                       r"user.max_user_namespaces") as err:
        run_generator(GOOD, [0], 1)
    assert not isinstance(err.value, SandboxError)  # not the module's fault: the agent does not retry on it


def test_exception_names_the_seed():
    source = module("if seed == 7:\n    raise ValueError('boom')\nreturn {'seed': seed}")
    with pytest.raises(SandboxError, match=r"(?s)On seed 7, the generator raised.*ValueError: boom") as err:
        run_generator(source, [6, 7, 8], 1)
    assert err.value.kind == "exception" and err.value.seed == 7


@pytest.mark.parametrize(
    "body, message",
    [("return [seed]", "returned list, not a dict"), ("return {'ids': {1, 2}}", "not plain JSON data")],
)
def test_results_that_are_not_json_dicts(body, message):
    with pytest.raises(SandboxError, match=message) as err:
        run_generator(module(body), [3], 1)
    assert err.value.kind == "output" and err.value.seed == 3


# -- GeneratedEnv ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env():
    return GeneratedEnv(GOOD, CAP.capability_id, difficulty=1, profile=PARAMS.env.profile)


def test_instances_validate_and_replay_to_full_reward(env):
    inst = env.generate(0, 1)
    assert isinstance(inst, Instance)
    assert inst.instance_id == "gen/tool_precision/d1/s0"
    assert (inst.source, inst.domain, inst.family, inst.requires_write) == (
        "synthetic",
        "retail",
        "tool_precision",
        True,
    )
    assert [a.name for a in inst.reference_actions] == [
        "find_user_id_by_email",
        "get_order_details",
        "cancel_pending_order",
    ]
    for seed in (0, 1):
        episode = replay_reference(env, env.reset(seed))
        assert episode.score().reward == 1.0


def test_prefetch_runs_the_sandbox_once_and_caches(monkeypatch):
    calls = []
    real = generated_module.run_generator

    def counting(source, seeds, difficulty, **kw):
        calls.append(list(seeds))
        return real(source, seeds, difficulty, **kw)

    monkeypatch.setattr(generated_module, "run_generator", counting)
    fresh = GeneratedEnv(GOOD, CAP.capability_id, PARAMS.synthesis.difficulty, PARAMS.env.profile)
    made = fresh.prefetch([3, 4, 5])
    assert calls == [[3, 4, 5]]
    assert fresh.generate(4, 1) == made[1]
    fresh.generate(9, 1)
    assert calls == [[3, 4, 5], [9]]
    assert fresh.twin().generate(4, 1) == made[1]  # a twin regenerates, identically


def test_env_refuses_a_module_that_fails_the_static_check():
    with pytest.raises(ValueError, match="`import os` is not allowed"):
        GeneratedEnv("import os\n" + GOOD, CAP.capability_id, 1, PARAMS.env.profile)


def _instance_dict(**changes):
    data = {
        "user_goal": "You want to cancel order #W1.",
        "opening": "Cancel #W1 please.",
        "user_facts": {"order_id": "#W1"},
        "reference_actions": [{"name": "cancel_pending_order", "arguments": {"order_id": "#W1", "reason": "x"}}],
    }
    data.update(changes)
    return data


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"user_goal": None}, "user_goal: Input should be a valid string"),
        (
            {"reference_actions": [{"name": "teleport_order", "arguments": {}}]},
            "tools the target does not have: ['teleport_order']",
        ),
        ({"tool_subset": ["get_order_details"]}, "missing ['cancel_pending_order']"),
        ({"must_refuse": True}, "a must_refuse instance cannot have writes"),
        ({"communicate_info": ["1,000"]}, "must not contain commas"),
        ({"surprise": 1}, "surprise: Extra inputs are not permitted"),
    ],
)
def test_bad_instance_dicts_are_reported(env, changes, message):
    with pytest.raises(GeneratedInstanceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        env.to_instance(_instance_dict(**changes), 5, 1)


# -- the generation agent -------------------------------------------------------------------------------------------
BAD_IMPORT = "import os\n" + GOOD
RAISES = module("raise ValueError('no pending order found')")


def fenced(source: str) -> str:
    return f"Here is the module.\n```python\n{source}```\nIt is deterministic."


def replay_ok(env: GeneratedEnv) -> list[str]:
    """A small stand-in for the conformance harness: the reference must solve seed 0."""
    reward = replay_reference(env, env.reset(0)).score().reward
    return [] if reward == 1.0 else [f"the reference solution scores {reward} on seed 0"]


def scripted(messages: list[dict]) -> str:
    replies = [fenced(BAD_IMPORT), fenced(RAISES), fenced(GOOD)]
    return replies[sum(m["role"] == "assistant" for m in messages)]


def test_agent_retries_with_feedback_until_the_module_passes():
    with ChatServer(scripted, model_name="scripted", keep_requests=True) as server:
        agent = GenerationAgent(server.base_url, "scripted", **{**GENERATOR, "max_attempts": 5})
        result = agent.generate_env(CAP, [FAILURE], replay_ok)
        requests = [r["messages"] for r in server.requests]
    assert result.ok and result.attempts == 3 and result.source == GOOD
    assert [r.stage for r in result.reports] == ["static", "sandbox", "ok"]
    assert "`import os` is not allowed" in result.reports[0].problems[0]
    assert "no pending order found" in result.reports[1].problems[0]
    assert len(requests) == 3
    prompt = requests[0][1]["content"]
    for part in (
        CAP.definition,
        FAILURE,
        "cancel_pending_order(order_id: string, reason: string) [write]",
        'db["orders"]',
        "Order statuses:",
        "def generate(seed, difficulty, db)",
        "hashlib",
    ):
        assert part in prompt, part
    # Each failure's report is the next request's last user turn, after the rejected reply.
    assert requests[1][-2] == {"role": "assistant", "content": fenced(BAD_IMPORT)}
    assert "rejected at the static stage" in requests[1][-1]["content"]
    assert "`import os` is not allowed" in requests[1][-1]["content"]
    assert "rejected at the sandbox stage" in requests[2][-1]["content"]
    assert "ValueError: no pending order found" in requests[2][-1]["content"]


def test_agent_gives_up_after_max_attempts_with_the_reports():
    def always_too_easy(env: GeneratedEnv) -> list[str]:
        return ["probe:do_nothing: mean reward 1.00 (max 0.30)"]

    with ChatServer(lambda messages: fenced(GOOD), model_name="scripted", keep_requests=True) as server:
        agent = GenerationAgent(server.base_url, "scripted", **{**GENERATOR, "max_attempts": 2})
        result = agent.generate_env(CAP, [], always_too_easy)
        requests = [r["messages"] for r in server.requests]
    assert not result.ok and result.attempts == 2
    assert [(r.attempt, r.stage) for r in result.reports] == [(1, "validation"), (2, "validation")]
    assert result.reports[1].problems == ["probe:do_nothing: mean reward 1.00 (max 0.30)"]
    assert len(requests) == 2 and "probe:do_nothing: mean reward 1.00" in requests[1][-1]["content"]
    assert "(none given)" in requests[0][1]["content"]


def test_a_reply_without_a_module_is_reported():
    assert extract_module("I cannot help with that.") is None
    reply = "Helper:\n```python\nX = 1\n```\nModule:\n```python\n" + GOOD + "```"
    assert extract_module(reply) == GOOD
    agent = GenerationAgent(None, None, backend=_Prose(), **{**GENERATOR, "max_attempts": 1})
    result = agent.generate_env(CAP, [], replay_ok)
    assert not result.ok
    assert result.reports[0].stage == "static" and "no ```python fenced block" in result.reports[0].problems[0]


class _Prose:
    name = "prose"

    def complete_texts(self, conversations, sampling):
        return ["I would write a generator that cancels orders."] * len(conversations)


def test_unreachable_endpoint_fails_fast_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the agent connects: nothing listens there
    url = f"http://127.0.0.1:{port}/v1"
    agent = GenerationAgent(url, "scripted", **GENERATOR)
    start = time.monotonic()
    with pytest.raises(GenerationError, match=f"{url}/chat/completions is unreachable"):
        agent.generate_env(CAP, [], replay_ok)
    assert time.monotonic() - start < 10


def test_the_real_conformance_harness_accepts_a_generated_environment():
    from trace_core.synthesis.generated import EXAMPLE_MODULE, GeneratedEnv
    from trace_core.synthesis.harness import validate

    env = GeneratedEnv(EXAMPLE_MODULE, "cancel_skill", difficulty=1, profile=PARAMS.env.profile)
    env.prefetch(list(range(8)))
    report = validate(env, harness_config(seeds=8, reference_seeds=2, probe_seeds=2, train_instances=0,
                                          eval_instances=0))
    assert report.passed, report.failures()
