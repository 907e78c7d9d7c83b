"""Synthetic environments written by an LLM (docs/method.md §2): a generation agent asks a model at an
OpenAI-compatible endpoint for a generator module for one capability, and `GeneratedEnv` turns such a module
into a `SyntheticEnv` without trusting it.

A generator module defines `generate(seed, difficulty, db) -> dict`; it only ever runs through
`sandbox.run_generator`, after `sandbox.check_source` accepted it. Its dicts become `Instance`s here (validated,
tool names checked against the target's); tools, state and reward stay the target's, as for every template.

The agent retries with feedback: each attempt's module goes through the static check, a sandbox run on a few
seeds and the caller's conformance check, and the first failure's report is sent back as the next user turn,
up to `max_attempts` attempts. An attempt that never passes is not an error: the result says ok=False and keeps
every report (the caller then reports the capability as unsynthesised). An endpoint that fails is an error.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trace_core.agents.openai_client import OpenAIPolicy
from trace_core.agents.policy import PolicyError, Sampling
from trace_core.schemas import Action, Instance
from trace_core.synthesis.contract import SyntheticEnv
from trace_core.synthesis.sandbox import (
    ALLOWED_MODULES,
    GENERATE_SIGNATURE,
    SandboxError,
    check_source,
    retail_db_json,
    run_generator,
)

MAX_EXCERPTS = 4
EXCERPT_CHARS = 600
MAX_PROBLEMS = 10
PROBLEM_CHARS = 1500


class GeneratedInstanceError(ValueError):
    """A generator module returned a dict that is not a valid instance (the message says which field and why)."""


class GenerationError(RuntimeError):
    """The generation agent cannot work: the endpoint is unreachable or failing, or the prompt does not fit."""


# ---------------------------------------------------------------------------------------------------------------
# Instances from a generator's dicts
# ---------------------------------------------------------------------------------------------------------------


class _GeneratedAction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class _GeneratedInstance(BaseModel):
    """What `generate` must return (the keys a module writes; everything else is filled in here)."""

    model_config = ConfigDict(extra="forbid")

    user_goal: str = Field(min_length=1)
    opening: str = Field(min_length=1)
    user_facts: dict[str, str] = Field(default_factory=dict)
    reference_actions: list[_GeneratedAction] = Field(min_length=1)
    communicate_info: list[str] = Field(default_factory=list)
    must_refuse: bool = False
    tool_subset: list[str] | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @field_validator("communicate_info")
    @classmethod
    def _no_commas(cls, v: list[str]) -> list[str]:
        # τ² removes commas from the agent's messages before looking for these strings.
        bad = [x for x in v if "," in x]
        if bad:
            raise ValueError(f"communicate_info strings must not contain commas: {bad}")
        return v


def _validation_summary(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()[:8])


class GeneratedEnv(SyntheticEnv):
    """The environment of one generator module. `generate(seed, difficulty)` runs the module in the sandbox
    (or takes the instance `prefetch` already made); raises SandboxError when the module fails and
    GeneratedInstanceError when its dict is not a valid instance. The module must pass the static check."""

    template = "generated"
    capability = "generated"

    def __init__(
        self,
        source: str,
        capability_id: str,
        difficulty: int,
        profile: str,
        domain: str = "retail",
        *,
        timeout_s: float = 120,
        memory_mb: int = 2048,
        cpu_s: int = 120,
    ):
        if domain != "retail":
            raise ValueError(f"generated environments use the retail DB; domain {domain!r} is not supported")
        problems = check_source(source)
        if problems:
            raise ValueError("the generator module fails the static check:\n" + "\n".join(problems))
        super().__init__(capability_id, difficulty, profile, domain)
        self.source = source
        self.source_sha = hashlib.sha256(source.encode()).hexdigest()[:16]
        self.limits = {"timeout_s": timeout_s, "memory_mb": memory_mb, "cpu_s": cpu_s}
        self._cache: dict[tuple[int, int], Instance] = {}

    def twin(self) -> GeneratedEnv:
        """The same module and settings with an empty cache: its instances are generated afresh (for
        determinism checks)."""
        return GeneratedEnv(
            self.source, self.capability_id, self.difficulty, self.profile, self.domain, **self.limits
        )

    @functools.cached_property
    def _tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.target.tool_schemas())

    def prefetch(self, seeds: Iterable[int], difficulty: int | None = None) -> list[Instance]:
        """The instances of `seeds` (at `difficulty`, default the environment's), made by one sandbox run for
        all seeds not made before, and kept."""
        d = self.difficulty if difficulty is None else int(difficulty)
        seeds = [int(s) for s in seeds]
        missing = list(dict.fromkeys(s for s in seeds if (s, d) not in self._cache))
        if missing:
            dicts = run_generator(self.source, missing, d, **self.limits)
            for seed, data in zip(missing, dicts, strict=True):
                self._cache[(seed, d)] = self.to_instance(data, seed, d)
        return [self._cache[(s, d)] for s in seeds]

    def generate(self, seed: int, difficulty: int) -> Instance:
        return self.prefetch([seed], difficulty)[0]

    def to_instance(self, data: dict, seed: int, difficulty: int) -> Instance:
        """The Instance for one dict a module returned; GeneratedInstanceError says what is wrong with it."""
        from trace_core.envs.tau2_env import write_tools

        where = f"generate(seed={seed}, difficulty={difficulty})"
        try:
            got = _GeneratedInstance.model_validate(data)
        except ValidationError as exc:
            raise GeneratedInstanceError(f"{where} returned an invalid instance: {_validation_summary(exc)}") from None
        known = self._tool_names
        used = [a.name for a in got.reference_actions]
        unknown = sorted({n for n in used + (got.tool_subset or []) if n not in known})
        if unknown:
            raise GeneratedInstanceError(
                f"{where} uses tools the target does not have: {unknown}; the tools are: {', '.join(sorted(known))}"
            )
        if got.tool_subset is not None:
            unoffered = sorted(set(used) - set(got.tool_subset))
            if unoffered:
                raise GeneratedInstanceError(
                    f"{where}: tool_subset must contain every tool of reference_actions; missing {unoffered}"
                )
        writes = [n for n in used if n in write_tools(self.domain)]
        if got.must_refuse and writes:
            raise GeneratedInstanceError(
                f"{where}: a must_refuse instance cannot have writes in reference_actions (found {writes}); "
                "its reference is the checks an agent makes before refusing"
            )
        return Instance(
            instance_id=f"gen/{self.capability_id}/d{difficulty}/s{seed}",
            source="synthetic",
            domain=self.domain,
            family=self.capability_id,
            seed=seed,
            difficulty=difficulty,
            user_goal=got.user_goal,
            user_facts=got.user_facts,
            opening=got.opening,
            reference_actions=[Action(name=a.name, arguments=a.arguments) for a in got.reference_actions],
            communicate_info=got.communicate_info,
            requires_write=bool(writes),
            must_refuse=got.must_refuse,
            tool_subset=sorted(got.tool_subset) if got.tool_subset is not None else None,
            meta={**got.meta, "generator_sha": self.source_sha},
        )


# ---------------------------------------------------------------------------------------------------------------
# The prompt
# ---------------------------------------------------------------------------------------------------------------

EXAMPLE_MODULE = '''\
import random

REASONS = ["no longer needed", "ordered by mistake"]


def generate(seed, difficulty, db):
    rng = random.Random(seed)  # every random choice comes from this generator: same seed, same instance
    pending = sorted(oid for oid, order in db["orders"].items() if order["status"] == "pending")
    order_id = rng.choice(pending)
    order = db["orders"][order_id]
    user = db["users"][order["user_id"]]
    name = user["name"]["first_name"] + " " + user["name"]["last_name"]
    reason = rng.choice(REASONS)
    tools = ["find_user_id_by_email", "get_order_details", "cancel_pending_order", "return_delivered_order_items"]
    if difficulty >= 2:
        tools.append("modify_pending_order_items")  # one more look-alike tool to choose from
    return {
        "user_goal": f"You are {name}. You want to cancel your pending order {order_id} ({reason}).",
        "opening": f"Hi, my email is {user['email']}. Please cancel my order {order_id}, it was {reason}.",
        "user_facts": {"name": name, "email": user["email"], "zip": user["address"]["zip"], "order_id": order_id},
        "reference_actions": [
            {"name": "find_user_id_by_email", "arguments": {"email": user["email"]}},
            {"name": "get_order_details", "arguments": {"order_id": order_id}},
            {"name": "cancel_pending_order", "arguments": {"order_id": order_id, "reason": reason}},
        ],
        "communicate_info": [],
        "must_refuse": False,
        "tool_subset": tools,
    }
'''

SYSTEM_PROMPT = """You write Python generator modules for synthetic training environments. Each environment \
trains a tool-using retail customer-service agent on one capability it lacks. The agent talks to a simulated user \
and calls the real tools of the retail store on a fresh copy of the store's database; an instance is solved when \
the database ends up exactly as replaying the instance's reference actions leaves it (and, when given, the agent \
said every communicate_info string). You write only the instance generator."""

TASK_PROMPT = """## Capability to train
{capability_id}: {name}
{definition}

## Where the agent failed (excerpts)
{failures}

## The agent's rules (its system prompt)
{policy}

## Tools (reference actions may use only these; [write] tools change the database)
{tools}

## The database `db`
{db}

## The module you write
- It defines `{signature}` at top level and returns one instance as a dict of plain JSON data:
  - "user_goal" (str): what the simulated user wants, addressed to them ("You are ... You want to ...").
  - "opening" (str): the user's first message.
  - "user_facts" (dict str -> str): what the user knows and tells when asked (e.g. name, email, zip, user_id, \
order_id).
  - "reference_actions" (list of {{"name": tool, "arguments": dict}}): the tool calls a correct agent makes, in \
order. Replayed on the unmodified database every call must succeed, and the writes must be exactly what the user \
asked for under the rules.
  - "communicate_info" (list of str, optional): facts the agent must tell the user (e.g. a price as "54.04"); no \
commas.
  - "must_refuse" (bool, optional): true when the rules forbid the request; then reference_actions holds only the \
look-ups the agent makes before refusing (no write).
  - "tool_subset" (list of tool names, optional): the tools offered; must contain every reference tool. Add a \
look-alike or two as distractors.
  - "meta" (dict, optional): anything you want to record.
- `seed` is an int; `difficulty` is 0 (easiest) to 3 (hardest): make higher difficulty need more of the \
capability (more constraints, more records to compare, distractors), not just longer text.
- Deterministic: use only `rng = random.Random(seed)` for randomness, iterate over sorted keys. Same arguments, \
same dict. Different seeds should give different instances (records, values, wording).
- The instance must need the capability above: an agent lacking it should fail, one having it should succeed.
- `db` is a fresh copy for each call; read it, never rely on changing it.
- Sandbox: you may import only {modules}. No files, no network, no `open`/`eval`/`exec`/`__import__`/`globals`, \
no dunder attributes (`x.__class__`), no `getattr` with a computed name. `print` goes to a log.

## Example module (a small one: cancel a pending order)
```python
{example}```

Reply with your complete module in one ```python block."""

FEEDBACK_PROMPT = """Your module was rejected at the {stage} stage (attempt {attempt} of {attempts}):
{problems}

Fix every problem and reply with the complete corrected module in one ```python block."""


def _first_sentence(text: str, limit: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _param_type(spec: dict) -> str:
    kind = spec.get("type", "any")
    if kind == "array":
        return f"list[{spec.get('items', {}).get('type', 'any')}]"
    return kind


def describe_tools(schemas: list[dict], writes: Iterable[str]) -> str:
    """One line per tool (name, parameters with types, what it does) and one per parameter with a description."""
    writes = set(writes)
    lines = []
    for schema in schemas:
        fn = schema["function"]
        params = fn.get("parameters", {})
        props = params.get("properties", {})
        required = set(params.get("required", []))
        args = ", ".join(f"{p}: {_param_type(s)}" + ("" if p in required else " (optional)") for p, s in props.items())
        tag = " [write]" if fn["name"] in writes else ""
        lines.append(f"- {fn['name']}({args}){tag}: {_first_sentence(fn.get('description', ''))}")
        for p, s in props.items():
            if s.get("description"):
                lines.append(f"    {p}: {_first_sentence(s['description'], 140)}")
    return "\n".join(lines)


def _is_keyed_collection(value: Any) -> bool:
    """A dict of records keyed by an id that each record repeats (users by user_id, variants by item_id, ...)."""
    return (
        isinstance(value, dict)
        and len(value) > 0
        and all(isinstance(v, dict) and k in v.values() for k, v in value.items())
    )


def _trim(value: Any, keep: int = 2) -> Any:
    """A short example of `value`: keyed collections and lists cut to `keep` entries, recursively."""
    if _is_keyed_collection(value):
        keys = sorted(value)
        out = {k: _trim(value[k], keep) for k in keys[:keep]}
        if len(keys) > keep:
            out["..."] = f"{len(keys) - keep} more"
        return out
    if isinstance(value, dict):
        return {k: _trim(v, keep) for k, v in value.items()}
    if isinstance(value, list):
        return [_trim(v, keep) for v in value[:keep]] + ([f"... {len(value) - keep} more"] if len(value) > keep else [])
    return value


def describe_db(db: dict) -> str:
    """The shape of the DB dict a generator receives, from the real data: each table's size and key, one
    example record (trimmed), and the values of the fields generators branch on most."""
    lines = [f"A dict with keys {', '.join(sorted(db))}. Each maps an id to a record (the id is repeated inside)."]
    for table in sorted(db):
        records = db[table]
        first_id = min(records)
        first = records[first_id]
        id_field = next((k for k, v in first.items() if v == first_id), "id")
        lines.append(f'\ndb["{table}"]: {len(records)} records keyed by {id_field}. One of them:')
        lines.append(json.dumps(_trim(first), indent=1, ensure_ascii=False))
    orders = db.get("orders", {})
    statuses: dict[str, int] = {}
    for order in orders.values():
        statuses[order.get("status")] = statuses.get(order.get("status"), 0) + 1
    if statuses:
        lines.append("\nOrder statuses: " + ", ".join(f"{s} ({n})" for s, n in sorted(statuses.items())))
    methods = [pm for user in db.get("users", {}).values() for pm in user.get("payment_methods", {}).values()]
    sources = sorted({pm.get("source") for pm in methods})
    if sources:
        lines.append("Payment method sources: " + ", ".join(sources))
    return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def _target_description() -> tuple[str, str, str]:
    """(policy, tools, db) sections of the prompt, from the real target environment and DB."""
    from trace_core.envs.tau2_env import Tau2Environment, write_tools

    target = Tau2Environment("retail", "compact")
    tools = describe_tools(target.tool_schemas(), write_tools("retail"))
    return target.system_prompt(), tools, describe_db(json.loads(retail_db_json()))


def _failure_excerpts(examples: list[str]) -> str:
    shown = [" ".join(str(e).split()) for e in examples if str(e).strip()][:MAX_EXCERPTS]
    if not shown:
        return "(none given)"
    return "\n".join(f"- {_first_sentence(e, EXCERPT_CHARS)}" for e in shown)


_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_module(reply: str) -> str | None:
    """The module in a model reply: the longest fenced ```python (or unlabelled) block that defines `generate`,
    else the longest such block; None when the reply has none."""
    blocks = [body for lang, body in _FENCE_RE.findall(reply) if lang.lower() in ("", "python", "py", "python3")]
    if not blocks:
        return None
    with_generate = [b for b in blocks if re.search(r"^def generate\b", b, re.MULTILINE)]
    return max(with_generate or blocks, key=len)


# ---------------------------------------------------------------------------------------------------------------
# The agent
# ---------------------------------------------------------------------------------------------------------------

Stage = Literal["static", "sandbox", "validation", "ok"]


class AttemptReport(BaseModel):
    attempt: int
    stage: Stage  # where the attempt stopped ("ok": it passed everything)
    problems: list[str] = Field(default_factory=list)


class GenerationResult(BaseModel):
    capability_id: str
    ok: bool
    attempts: int
    source: str  # the last module written (the accepted one when ok)
    reports: list[AttemptReport]


def _capability_text(capability: Any) -> dict[str, str]:
    return {
        "capability_id": capability.capability_id,
        "name": capability.name,
        "definition": " ".join(capability.definition.split()),
    }


def _short(problems: list[str]) -> list[str]:
    kept = [p if len(p) <= PROBLEM_CHARS else p[:PROBLEM_CHARS] + " ..." for p in problems[:MAX_PROBLEMS]]
    if len(problems) > MAX_PROBLEMS:
        kept.append(f"... and {len(problems) - MAX_PROBLEMS} more problems")
    return kept


class GenerationAgent:
    """Writes a generator module for a capability with the model at `base_url` (or any `backend` with
    `complete_texts(conversations, sampling)`), and checks each attempt: static check, sandbox run of
    `probe_seeds` at every difficulty, then the caller's `validate`."""

    def __init__(
        self,
        base_url: str | None,
        model: str | None,
        api_key: str | None = None,
        backend: Any = None,
        *,
        max_attempts: int,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        difficulty: int,
        profile: str,
        timeout_s: float,
        probe_seeds: tuple[int, ...] = (0, 1, 2),
        sandbox_timeout_s: float = 60,
    ):
        if backend is None:
            if not base_url or not model:
                raise GenerationError(
                    "the generation agent needs an OpenAI-compatible endpoint: set synthesis.generator.base_url "
                    "(or env TRACE_SYNTHESIS_BASE_URL) and synthesis.generator.model"
                )
            backend = OpenAIPolicy(base_url, model, api_key=api_key, concurrency=1, timeout_s=timeout_s)
        self.backend = backend
        self.max_attempts = max(1, int(max_attempts))
        self.temperature = float(temperature)
        self.max_new_tokens = int(max_new_tokens)
        self.seed = int(seed)
        self.difficulty = int(difficulty)
        self.profile = profile
        self.probe_seeds = tuple(probe_seeds)
        self.sandbox_timeout_s = float(sandbox_timeout_s)

    @property
    def endpoint(self) -> str:
        """What error messages name: the URL of an HTTP backend, else the backend's name."""
        return getattr(self.backend, "url", None) or getattr(self.backend, "name", type(self.backend).__name__)

    def conversation(self, capability: Any, example_failures: list[str]) -> list[dict]:
        """The opening system + user turns for `capability`."""
        policy, tools, db = _target_description()
        user = TASK_PROMPT.format(
            **_capability_text(capability),
            failures=_failure_excerpts(example_failures),
            policy=policy,
            tools=tools,
            db=db,
            signature=GENERATE_SIGNATURE,
            modules=", ".join(sorted(ALLOWED_MODULES - {"__future__"})),
            example=EXAMPLE_MODULE,
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def _ask(self, conv: list[dict], attempt: int) -> str:
        sampling = Sampling(  # top_p 1: synthesis.generator has no nucleus setting
            temperature=self.temperature, top_p=1.0, max_new_tokens=self.max_new_tokens,
            seed=self.seed + 100_003 * attempt,
        )
        try:
            reply = self.backend.complete_texts([conv], sampling)[0]
        except PolicyError as exc:
            raise GenerationError(
                f"the generation endpoint failed: {exc}. Is the server running? The endpoint comes from "
                "synthesis.generator.base_url (env TRACE_SYNTHESIS_BASE_URL overrides)."
            ) from exc
        if reply is None:
            raise GenerationError(
                f"the generation prompt does not fit the context of the model at {self.endpoint}; serve a model "
                "with a longer context or lower synthesis.generator.max_new_tokens"
            )
        return reply

    def check(
        self, source: str | None, capability_id: str, validate: Callable[[GeneratedEnv], list[str]]
    ) -> tuple[Stage, list[str]]:
        """Where `source` stops: ("ok", []) or the failing stage and its problems."""
        if source is None:
            return "static", ["no ```python fenced block with the module was found in the reply"]
        problems = check_source(source)
        if problems:
            return "static", problems
        env = GeneratedEnv(source, capability_id, self.difficulty, self.profile, timeout_s=self.sandbox_timeout_s)
        try:
            for d in range(env.max_difficulty + 1):
                env.prefetch(self.probe_seeds, d)
        except (SandboxError, GeneratedInstanceError) as exc:
            return "sandbox", [str(exc)]
        try:
            problems = list(validate(env))
        except (SandboxError, GeneratedInstanceError) as exc:  # a seed the probe did not cover
            problems = [str(exc)]
        return ("validation", problems) if problems else ("ok", [])

    def generate_env(
        self,
        capability: Any,
        example_failures: list[str],
        validate: Callable[[GeneratedEnv], list[str]],
    ) -> GenerationResult:
        """Up to `max_attempts` modules for `capability` (a CapabilitySpec or Capability), each checked; the
        first failing stage's report goes back to the model. ok=False after the last failed attempt."""
        conv = self.conversation(capability, example_failures)
        reports: list[AttemptReport] = []
        source = ""
        for attempt in range(1, self.max_attempts + 1):
            reply = self._ask(conv, attempt - 1)
            module = extract_module(reply)
            source = module if module is not None else source
            stage, problems = self.check(module, capability.capability_id, validate)
            reports.append(AttemptReport(attempt=attempt, stage=stage, problems=problems))
            if stage == "ok":
                return GenerationResult(
                    capability_id=capability.capability_id, ok=True, attempts=attempt, source=source, reports=reports
                )
            feedback = FEEDBACK_PROMPT.format(
                stage=stage,
                attempt=attempt,
                attempts=self.max_attempts,
                problems="\n".join(f"- {p}" for p in _short(problems)),
            )
            conv = conv + [{"role": "assistant", "content": reply}, {"role": "user", "content": feedback}]
        return GenerationResult(
            capability_id=capability.capability_id,
            ok=False,
            attempts=self.max_attempts,
            source=source,
            reports=reports,
        )
