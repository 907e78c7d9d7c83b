"""The conformance harness: every synthetic environment passes it before training (docs/method.md §2).

Checks, each a `Check` in the `ValidationReport`:
  determinism     reset(seed) twice (and from a fresh object) gives byte-identical instances
  diversity       distinct instances and distinct reference solutions over the seeds
  schema_parity   every tool offered is the target's tool with an identical schema; reference tools are offered
  reference       replaying the reference solution scores 1.0 on every checked seed
  hint            the hint (for hint injection) names no argument value of the reference's writes
  probe:<name>    trivial policies score low: do_nothing, stop_at_once, random (seeded random calls), tool_spam
                  (every offered write tool with values guessed from the conversation)
  rebuild, reference@spot, probe:<name>@spot
                  on `spot_seeds` seeds drawn at random (seeded) across the whole train and eval manifests, not
                  only the first seeds: the manifest's instance (made as the manifests are: one batch per
                  manifest) equals a fresh rebuild of that seed alone (a new sandbox process for a generated
                  module, which is how training rebuilds them), the reference scores 1.0, the probes score low
  calibration     (optional) the base agent's reward/success/group statistics within docs/method.md §2's band; the
                  difficulty knob is moved up (too easy) or down (too hard), below difficulty 0 into scaffolds
                  (prefilled look-ups), up to `max_adjustments` times (synthesis.calibration)
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trace_core.envs.base import EpisodeLimits
from trace_core.envs.oracle import CONTROL_USER_TURNS, replay_reference
from trace_core.envs.users import ScriptedUser
from trace_core.schemas import SCHEMA_VERSION, Message, ToolCall
from trace_core.synthesis.contract import SyntheticEnv


@dataclass(frozen=True)
class HarnessConfig:
    """Sizes and thresholds of the harness (params.yaml `synthesis.harness`)."""

    seeds: int  # seeds for determinism, diversity and schema parity
    reference_seeds: int  # seeds whose reference solution is replayed and scored
    probe_seeds: int  # seeds each trivial policy is run on
    min_distinct: float  # distinct instances / seeds and distinct reference solutions / seeds
    max_probe_reward: float  # mean reward a trivial policy may reach
    max_probe_success: float  # share of seeds a trivial policy may solve (reward 1.0)
    train_instances: int  # the train manifest's seeds are 0..train_instances-1 (synthesis.train_instances)
    eval_instances: int  # the eval manifest's the next eval_instances seeds (0 and 0: no manifest checks)
    spot_seeds: int  # seeds drawn at random across both manifests for the spot checks
    spot_seed: int = 0  # seed of that draw (the same seeds on every run)

    def manifests(self) -> list[range]:
        """The seeds of the train and eval manifests, one range each, as synthesis writes them."""
        train, total = self.train_instances, self.train_instances + self.eval_instances
        return [r for r in (range(train), range(train, total)) if len(r)]

    def spot(self) -> list[int]:
        """`spot_seeds` seeds drawn without replacement from every manifest seed, reproducibly."""
        population = [s for r in self.manifests() for s in r]
        k = min(self.spot_seeds, len(population))
        return sorted(random.Random(f"spot:{self.spot_seed}").sample(population, k)) if k else []


class Check(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    passed: bool
    detail: str
    value: float | None = None


class ValidationReport(BaseModel):
    """`validation.json` of one synthetic environment."""

    model_config = ConfigDict(extra="forbid")
    schema_version: str = SCHEMA_VERSION
    capability_id: str
    template: str
    difficulty: int
    scaffold: int = 0
    blend: bool = False
    passed: bool
    checks: list[Check]
    calibration: list[dict[str, Any]] = Field(default_factory=list)  # one entry per difficulty tried

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]


# -- trivial policies -------------------------------------------------------------------------------------------
def _say(text: str) -> Message:
    return Message(role="assistant", content=text)


def _calls(*calls: ToolCall) -> Message:
    return Message(role="assistant", tool_calls=list(calls))


def _visible_values(episode) -> list[str]:
    """Id-like strings the agent has seen (order ids, user ids, emails, numbers): what a guessing policy tries."""
    text = " ".join((m.content or "") for m in episode.messages if m.role in ("user", "tool"))
    found = re.findall(r"#W\d+|[a-z]+_[a-z]+_\d+|[\w.]+@[\w.]+|\b\d{6,}\b|credit_card_\d+|gift_card_\d+|paypal_\d+", text)
    return list(dict.fromkeys(found)) or ["unknown"]


def _guess(schema: dict, values: list[str], rng: random.Random) -> Any:
    kind = schema.get("type")
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if kind == "array":
        return [_guess(schema.get("items", {"type": "string"}), values, rng)]
    if kind in ("integer", "number"):
        return rng.randint(0, 5)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "object":
        return {}
    return rng.choice(values)


def _guessed_call(tool: dict, values: list[str], rng: random.Random, i: int) -> ToolCall:
    fn = tool["function"]
    props = fn.get("parameters", {}).get("properties", {})
    return ToolCall(id=f"probe_{i}", name=fn["name"], arguments={k: _guess(v, values, rng) for k, v in props.items()})


def probe_do_nothing(episode, rng: random.Random) -> None:
    while not episode.done:
        episode.step(_say("I understand. Is there anything else I can help with?"))


def probe_stop_at_once(episode, rng: random.Random) -> None:
    episode.step(_say("Goodbye. ###STOP###"))


def probe_random(episode, rng: random.Random) -> None:
    for i in range(4):
        if episode.done:
            return
        tool = rng.choice(episode.tools)
        episode.step(_calls(_guessed_call(tool, ["x", "1", "#W0000000"], rng, i)))
    if not episode.done:
        episode.step(_say("Done. ###STOP###"))


def probe_tool_spam(episode, rng: random.Random, writes: frozenset[str] = frozenset()) -> None:
    """Every offered tool, write tools first, three rounds, with values guessed from what the agent has seen."""
    n = 0
    for _ in range(3):
        tools = sorted(episode.tools, key=lambda t: t["function"]["name"] not in writes)
        for tool in tools:
            if episode.done:
                return
            episode.step(_calls(_guessed_call(tool, _visible_values(episode), rng, n)))
            n += 1
    if not episode.done:
        episode.step(_say("All done. ###STOP###"))


PROBES: dict[str, Callable] = {
    "do_nothing": probe_do_nothing,
    "stop_at_once": probe_stop_at_once,
    "random": probe_random,
    "tool_spam": probe_tool_spam,
}


# -- the checks -------------------------------------------------------------------------------------------------
def _determinism(env: SyntheticEnv, seeds: list[int]) -> Check:
    # A fresh object (no caches shared): `twin()` where the environment defines one (generated modules), else
    # the class rebuilt with the same settings.
    twin = env.twin() if hasattr(env, "twin") else type(env)(env.capability_id, difficulty=env.difficulty,
                                                               profile=env.profile, scaffold=env.scaffold,
                                                               blend=env.blend)
    for seed in seeds:
        a, b, c = env.reset(seed), env.reset(seed), twin.reset(seed)
        if not (a.model_dump_json() == b.model_dump_json() == c.model_dump_json()):
            return Check(name="determinism", passed=False, detail=f"reset({seed}) differs between calls")
    return Check(name="determinism", passed=True, detail=f"{len(seeds)} seeds reproduce byte for byte")


def _diversity(instances: list, cfg: HarnessConfig) -> Check:
    n = max(1, len(instances))
    bodies = {json.dumps(i.model_dump(exclude={"instance_id", "seed", "index", "meta"}), sort_keys=True) for i in instances}
    solutions = {json.dumps([a.model_dump() for a in i.reference_actions], sort_keys=True) for i in instances}
    inst_share, sol_share = len(bodies) / n, len(solutions) / n
    passed = inst_share >= cfg.min_distinct and sol_share >= cfg.min_distinct
    return Check(
        name="diversity",
        passed=passed,
        detail=f"{len(bodies)}/{n} distinct instances, {len(solutions)}/{n} distinct reference solutions "
        f"(need {cfg.min_distinct:.0%})",
        value=min(inst_share, sol_share),
    )


def _schema_parity(env: SyntheticEnv, instances: list) -> Check:
    from trace_core.envs.targets import all_tool_schemas

    target = {t["function"]["name"]: t for t in all_tool_schemas(env.domain, env.profile)}
    for inst in instances:
        offered = {t["function"]["name"]: t for t in env.tool_schemas(inst)}
        for name, schema in offered.items():
            if name not in target:
                return Check(name="schema_parity", passed=False, detail=f"{inst.instance_id}: tool {name!r} is not a target tool")
            if schema != target[name]:
                return Check(name="schema_parity", passed=False, detail=f"{inst.instance_id}: {name} schema differs from the target's")
        missing = sorted({a.name for a in inst.reference_actions} - set(offered))
        if missing:
            return Check(name="schema_parity", passed=False, detail=f"{inst.instance_id}: reference uses unoffered {missing}")
    return Check(name="schema_parity", passed=True, detail="every offered tool is the target's, schema for schema")


def _fresh(env: SyntheticEnv) -> SyntheticEnv:
    """A new object for `env` with nothing cached: `twin()` where the environment defines one (a generated module:
    every seed it is asked for is then made in a new sandbox process), else the class rebuilt with its settings."""
    if hasattr(env, "twin"):
        return env.twin()
    return type(env)(env.capability_id, difficulty=env.difficulty, profile=env.profile, scaffold=env.scaffold,
                     blend=env.blend)


def _rebuild(env: SyntheticEnv, seeds: list[int]) -> Check:
    """The manifests' instances (env's own, made batch by batch) against each seed rebuilt alone by a fresh
    object: a generator that keeps state across calls makes them differ."""
    bad = []
    for seed in seeds:
        if env.reset(seed).model_dump_json() != _fresh(env).reset(seed).model_dump_json():
            bad.append(seed)
    if bad:
        return Check(name="rebuild", passed=False, value=1 - len(bad) / len(seeds),
                     detail=f"the manifest's instance differs from a fresh rebuild of the seed alone on "
                     f"{len(bad)}/{len(seeds)} spot seeds ({', '.join(map(str, bad[:8]))}): the generator keeps "
                     "state across calls (e.g. on an imported module)")
    return Check(name="rebuild", passed=True, value=1.0,
                 detail=f"{len(seeds)} spot seeds across the manifests rebuild alone to the same instance")


def _spot(env: SyntheticEnv, cfg: HarnessConfig, tick: Callable[[], None]) -> list[Check]:
    """The spot checks on cfg.spot() seeds, after making the manifests' instances the way synthesis does."""
    seeds = cfg.spot()
    if not seeds:
        return []
    if hasattr(env, "prefetch"):  # a generated module: one sandbox process per manifest, as `_manifest` does
        for seeds_of in cfg.manifests():
            env.prefetch(list(seeds_of))
    checks = [_rebuild(env, seeds)]
    ref = _reference(env, seeds, tick)
    checks.append(ref.model_copy(update={"name": "reference@spot", "detail": f"{ref.detail} (spot: {seeds})"}))
    for name in PROBES:
        probe = _probe(env, name, seeds, cfg, tick)
        checks.append(probe.model_copy(update={"name": f"{probe.name}@spot"}))
    return checks


def _leaves(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _leaves(v)]
    return [str(value)]


def _hint(env: SyntheticEnv, instances: list) -> Check:
    """Hints guide, they must not answer: no argument value of a reference write (3+ characters) may appear."""
    from trace_core.envs.targets import write_tools

    writes = write_tools(env.domain)
    for inst in instances:
        text = env.hint(inst)
        if not isinstance(text, str) or not text.strip():
            return Check(name="hint", passed=False, detail=f"{inst.instance_id}: hint is empty or not text")
        for action in inst.reference_actions:
            if action.name not in writes:
                continue
            leaked = [v for v in _leaves(action.arguments) if len(v) >= 3 and v in text]
            if leaked:
                return Check(name="hint", passed=False,
                             detail=f"{inst.instance_id}: hint reveals {action.name} argument value(s) {leaked[:3]}")
    return Check(name="hint", passed=True, detail=f"{len(instances)} hints name no reference write argument value")


def _reference(env: SyntheticEnv, seeds: list[int], tick: Callable[[], None]) -> Check:
    bad = []
    for seed in seeds:
        inst = env.reset(seed)
        ep = replay_reference(env, inst, actions=env.reference(inst))
        reward = ep.score().reward
        tick()
        if reward < 1.0 - 1e-9:
            bad.append((seed, reward))
    if bad:
        shown = ", ".join(f"seed {s}: {r:.2f}" for s, r in bad[:5])
        return Check(name="reference", passed=False, detail=f"reference solution scores < 1.0 on {len(bad)}/{len(seeds)} seeds ({shown})", value=1 - len(bad) / len(seeds))
    return Check(name="reference", passed=True, detail=f"reference solution scores 1.0 on {len(seeds)} seeds", value=1.0)


def _probe(env: SyntheticEnv, name: str, seeds: list[int], cfg: HarnessConfig, tick: Callable[[], None]) -> Check:
    from trace_core.envs.targets import write_tools

    fn = PROBES[name]
    rewards = []
    for seed in seeds:
        inst = env.reset(seed)
        ep = env.start(inst, ScriptedUser(max_turns=CONTROL_USER_TURNS), EpisodeLimits(max_steps=30, max_errors=100))
        rng = random.Random(f"{name}:{seed}")
        if name == "tool_spam":
            fn(ep, rng, write_tools(env.domain))
        else:
            fn(ep, rng)
        if not ep.done:
            ep.abort("max_steps")
        rewards.append(ep.score().reward)
        tick()
    mean = sum(rewards) / max(1, len(rewards))
    solved = sum(r >= 1.0 - 1e-9 for r in rewards) / max(1, len(rewards))
    passed = mean <= cfg.max_probe_reward and solved <= cfg.max_probe_success
    return Check(
        name=f"probe:{name}",
        passed=passed,
        detail=f"mean reward {mean:.2f} (max {cfg.max_probe_reward:.2f}), solved {solved:.0%} (max {cfg.max_probe_success:.0%})",
        value=mean,
    )


@dataclass
class _Progress:
    total: int
    show: bool
    bar: Any = field(default=None)

    def __post_init__(self):
        if self.show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, desc="conformance", unit="ep", dynamic_ncols=True)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_environment(env: SyntheticEnv, cfg: HarnessConfig, progress: bool = False) -> list[Check]:
    """Every check except calibration. A generator that raises is reported as a failed check, not raised."""
    seeds = list(range(cfg.seeds))
    try:
        instances = [env.reset(s) for s in seeds]
    except Exception as exc:  # noqa: BLE001 — an environment's bug is a finding of the harness
        return [Check(name="generate", passed=False, detail=f"reset raised {type(exc).__name__}: {exc}")]
    checks = [_determinism(env, seeds[: min(len(seeds), 20)]), _diversity(instances, cfg), _schema_parity(env, instances)]
    try:
        checks.append(_hint(env, instances))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check(name="hint", passed=False, detail=f"hint raised {type(exc).__name__}: {exc}"))
    spot = len(cfg.spot())
    bar = _Progress(cfg.reference_seeds + cfg.probe_seeds * len(PROBES) + spot * (1 + len(PROBES)), progress)
    try:
        checks.append(_reference(env, list(range(cfg.reference_seeds)), bar.tick))
        for name in PROBES:
            checks.append(_probe(env, name, list(range(cfg.probe_seeds)), cfg, bar.tick))
        checks.extend(_spot(env, cfg, bar.tick))
    except Exception as exc:  # noqa: BLE001
        checks.append(Check(name="episodes", passed=False, detail=f"an episode raised {type(exc).__name__}: {exc}"))
    finally:
        bar.close()
    return checks


def validate(env: SyntheticEnv, cfg: HarnessConfig, progress: bool = False) -> ValidationReport:
    checks = check_environment(env, cfg, progress)
    return ValidationReport(
        capability_id=env.capability_id,
        template=env.template,
        difficulty=env.difficulty,
        scaffold=env.scaffold,
        blend=env.blend,
        passed=all(c.passed for c in checks),
        checks=checks,
    )
