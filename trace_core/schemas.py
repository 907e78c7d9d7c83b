"""Typed, versioned contracts that stages exchange as files (pydantic models with `schema_version`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = "1"

Role = Literal["system", "user", "assistant", "tool"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCall(_Model):
    """One tool call as the agent emitted it. `arguments` is always a dict once parsed; when the raw text
    could not be parsed, `parse_error` says why and the environment answers with an error observation."""

    id: str = ""
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    parse_error: str | None = None


class Message(_Model):
    """One turn. Assistant turns produced by a local model may carry the sampled token ids and their logprobs
    (training needs them); `raw` keeps the model's exact text before tool-call parsing."""

    role: Role
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None  # for role == "tool"
    name: str | None = None  # tool name for role == "tool"
    error: bool = False  # a tool observation that reports an error
    raw: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None

    def has_text(self) -> bool:
        return bool(self.content and self.content.strip())


def answered_calls(messages: Sequence[Message]) -> list[tuple[int, ToolCall, Message | None]]:
    """Every assistant tool call in order, as (position of its assistant message, the call, the tool message that
    answered it or None). A tool message answers a call of the latest assistant turn only: the first unanswered
    one with its `tool_call_id`, else the first unanswered one. Ids are not unique in an episode (the local parser
    numbers each turn's calls from `call_0`), so an answer is never looked up by id across turns."""
    out: list[list[Any]] = []
    pending: list[int] = []  # the latest assistant turn's unanswered calls (indexes into out)
    for pos, m in enumerate(messages):
        if m.role == "assistant":
            pending = []
            for call in m.tool_calls or []:
                pending.append(len(out))
                out.append([pos, call, None])
        elif m.role == "tool" and pending:
            k = next((k for k in pending if out[k][1].id and out[k][1].id == m.tool_call_id), pending[0])
            out[k][2] = m
            pending.remove(k)
    return [(pos, call, answer) for pos, call, answer in out]


class Action(_Model):
    """A reference (gold) tool call: what a correct agent does."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    requestor: Literal["assistant", "user"] = "assistant"


class Instance(_Model):
    """One problem for an agent. Official τ² tasks keep their original JSON in `tau2_task`; procedural ones
    record (generator, seed, index, difficulty) so that they can be remade exactly."""

    schema_version: str = SCHEMA_VERSION
    instance_id: str
    source: Literal["tau2", "procedural", "synthetic", "toolsandbox"]
    domain: str
    family: str
    split: str | None = None
    seed: int | None = None
    index: int | None = None
    difficulty: int = 0
    # What the user wants, in words (for the user simulator and for prompts).
    user_goal: str
    # Facts the user knows and reveals when asked (name, zip, email, order ids, ...).
    user_facts: dict[str, str] = Field(default_factory=dict)
    # The opening user message; the scripted simulator uses it verbatim.
    opening: str | None = None
    reference_actions: list[Action] = Field(default_factory=list)
    communicate_info: list[str] = Field(default_factory=list)
    requires_write: bool = True
    must_refuse: bool = False
    # Tools the compact profile exposes for this instance (None = every tool of the domain).
    tool_subset: list[str] | None = None
    tau2_task: dict[str, Any] | None = None
    # A generated DB state: τ² `agent_data` merged into the domain's database before the episode (and before
    # τ²'s evaluator replays it), e.g. a customer account made for this instance. None: the stock database.
    db_patch: dict[str, Any] | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    def content_hash(self) -> str:
        # Without a patch the field is left out, so instances made before it existed keep their hashes.
        exclude = {"db_patch"} if self.db_patch is None else None
        return hashlib.sha256(self.model_dump_json(exclude=exclude).encode()).hexdigest()[:16]



def task_key(instance: Instance) -> str:
    """What makes two instances the same task whatever their ids or coordinates: the goal, the reference actions,
    the facts to communicate and the opening."""
    data = instance.model_dump()
    keep = {k: data.get(k) for k in ("user_goal", "reference_actions", "communicate_info", "opening")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()

class RewardResult(_Model):
    """A reward in [0, 1] with the components it was built from (e.g. db, communicate)."""

    reward: float
    components: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)


TerminationReason = Literal[
    "agent_stop",  # the agent ended the conversation (stop token in its text)
    "user_stop",  # the user simulator said ###STOP### (or transfer / out-of-scope)
    "max_steps",
    "too_many_errors",
    "context_overflow",
    "policy_error",  # the policy backend failed (e.g. endpoint down) — recorded, not raised
]


class Trajectory(_Model):
    """One recorded episode, with its score."""

    schema_version: str = SCHEMA_VERSION
    trajectory_id: str
    instance_id: str
    domain: str
    family: str
    source: str
    trial: int = 0
    seed: int | None = None
    policy: str = ""
    messages: list[Message]
    termination_reason: TerminationReason
    num_steps: int = 0
    reward: float = 0.0
    success: bool = False
    reward_components: dict[str, float] = Field(default_factory=dict)
    reward_info: dict[str, Any] = Field(default_factory=dict)
    meta: dict[str, Any] = Field(default_factory=dict)

    def to_row(self) -> dict[str, Any]:
        """A flat row for parquet / `datasets`: nested parts become JSON strings (stable key order)."""
        d = self.model_dump()
        for key in ("messages", "reward_components", "reward_info", "meta"):
            d[key] = json.dumps(d[key], sort_keys=True, ensure_ascii=False)
        return d

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "Trajectory":
        d = dict(row)
        for key in ("messages", "reward_components", "reward_info", "meta"):
            if isinstance(d.get(key), str):
                d[key] = json.loads(d[key])
        return cls.model_validate(d)


# ---------------------------------------------------------------------------------------------------------------
# Stage `analysis`: the capability dictionary (capability_id is minted here and keys every later stage)
# ---------------------------------------------------------------------------------------------------------------

Label = Literal["NA", "PRESENT", "LACKING"]
LabellerName = Literal["programmatic", "llm", "embedding", "control"]


class CapabilitySpec(_Model):
    """A candidate capability as a labeller proposes it (before statistics)."""

    capability_id: str  # snake_case slug, unique in one dictionary
    name: str
    definition: str
    labeller: LabellerName
    # Controls are capabilities built to be rejected (random or uniform labels); one passing flags the analysis.
    control: bool = False
    example_task_ids: list[str] = Field(default_factory=list)
    excerpts: list[str] = Field(default_factory=list)  # short evidence (e.g. failing steps of an embedding cluster)


class LabelRow(_Model):
    """One (labelling run, trajectory, capability) judgement; the per-trajectory label table is a list of these."""

    run: int
    trajectory_id: str
    instance_id: str
    success: bool
    capability_id: str
    label: Label
    labeller: LabellerName
    note: str = ""  # why (detector evidence, or the LLM's short reason)


class CapabilityStats(_Model):
    """docs/method.md §1 statistics of one capability: per-run values summarised, plus bootstrap CIs over
    trajectories of the run-averaged ER−, ER+, Δ and coverage."""

    runs: int
    runs_passed: int
    runs_required: int
    coverage_mean: float
    coverage_std: float
    delta_mean: float
    delta_std: float
    er_minus_mean: float
    er_plus_mean: float
    coverage_ci: tuple[float, float]
    delta_ci: tuple[float, float]
    lacking_failed: float  # mean over runs of LF
    present_failed: float
    lacking_passed: float
    present_passed: float
    agreement: float | None = None  # mean pairwise agreement of labels across runs (None with one run)
    kappa: float | None = None  # Fleiss' kappa across runs (None with one run or no variation)
    delta_within_family_mean: float | None = None  # Δ within task families (None when not asked for)


class Capability(CapabilitySpec):
    selected: bool
    stats: CapabilityStats
    example_failed_task_ids: list[str] = Field(default_factory=list)


class CapabilityDictionary(_Model):
    """`artifacts/analysis/capabilities.json`: every candidate with its statistics; `selected` lists the
    capability ids that passed (coverage ≥ rho and Δ ≥ delta in ≥ K of N runs), sorted by mean Δ."""

    schema_version: str = SCHEMA_VERSION
    target: dict[str, Any]  # what was analysed: domain, source, counts, hash of the trajectories
    thresholds: dict[str, float]  # rho, delta, k, n, ci, bootstrap_samples
    labellers: list[str]
    selected: list[str]
    capabilities: list[Capability]
    warnings: list[str] = Field(default_factory=list)

    def get(self, capability_id: str) -> Capability:
        for c in self.capabilities:
            if c.capability_id == capability_id:
                return c
        raise KeyError(f"no capability {capability_id!r}; known: {', '.join(c.capability_id for c in self.capabilities)}")


# ---------------------------------------------------------------------------------------------------------------
# Stage `synthesis`: one synthetic environment per capability
# ---------------------------------------------------------------------------------------------------------------


class EnvSpec(_Model):
    """`artifacts/synthesis/<capability_id>/spec.json`: how to rebuild a capability's environment and whether it
    may be trained on. `status` is "ready" only when the conformance harness passed."""

    schema_version: str = SCHEMA_VERSION
    capability_id: str
    status: Literal["ready", "rejected", "unmapped", "not_selected"]
    reason: str = ""
    source: Literal["template", "generated"] | None = None
    template: str | None = None  # template name, or the generated module's file name
    matched_by: str | None = None  # params | id | definition | generated
    match_score: float | None = None
    difficulty: int | None = None
    blend: bool = False  # odd seeds one difficulty up (SyntheticEnv; calibration between bracketing difficulties)
    scaffold: int = 0  # look-ups prefilled in each instance's history (SyntheticEnv; calibration below difficulty 0)
    domain: str = "retail"
    profile: str = "compact"
    tools: list[str] = Field(default_factory=list)
    train_seeds: list[int] = Field(default_factory=list)  # [first, count]
    eval_seeds: list[int] = Field(default_factory=list)
    calibrated: bool | None = None  # None: calibration disabled
    # Each knob position calibration tried, in order: its label (d1, d0p2, d2-3), verdict, figures (mean reward,
    # success rate, informative / all-success / all-zero group shares, reward std, rollouts) and, for a template's
    # own rung below its look-up scaffolds, what that rung removes. The rollouts' outcomes are in validation.json.
    calibration: list[dict[str, Any]] = Field(default_factory=list)
    source_hash: str | None = None  # sha256 of the generator's source file(s)
    spec_hash: str = ""  # hash of everything above: keys the adapter trained on this environment

    def with_hash(self) -> "EnvSpec":
        body = self.model_dump(exclude={"spec_hash"})
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        return self.model_copy(update={"spec_hash": digest})


# ------------------------------------------------------------------------------------- late-stage records
class AdapterRecord(BaseModel):
    """`adapter_record.json` of stage training (one per capability) and of the trained baselines: what was trained,
    on which data, from which base, and where the adapter is. `status` "skipped" records carry only the `reason`.
    Extra keys (a baseline's budget, snapshots) are kept as they are."""

    model_config = ConfigDict(extra="allow")

    schema_version: str = SCHEMA_VERSION
    capability_id: str
    status: Literal["trained", "skipped"] | None = None  # None: the trainer's record before the stage's fields
    reason: str | None = None
    adapter_dir: str = "adapter"
    adapter_sha256: str | None = None
    base_model: str | None = None
    base_fingerprint: str | None = None
    steps: int = 0
    rollouts: int = 0
    run_key: str | None = None
    spec_hash: str | None = None
    data_hash: str | None = None
    # The gate of stage training (set once the adapter was evaluated): learned when the lower bound of the paired
    # 95% CI of its held-out success difference is above 0; `gate` says why, with the figures.
    learned: bool | None = None
    gate: str | None = None

    @property
    def trained(self) -> bool:
        return self.status == "trained"


class SuccessSide(_Model):
    """One side (base, or base + adapter) of an adapter's held-out comparison."""

    episodes: int
    successes: int
    success_rate: float
    success_ci: tuple[float, float]
    mean_reward: float


class SuccessDifference(_Model):
    success_rate: float
    ci: tuple[float, float]
    improved: int
    regressed: int
    method: str


class AdapterEval(BaseModel):
    """`eval.json` of stage training: the base agent and base + adapter on the same held-out seeds."""

    model_config = ConfigDict(extra="allow")  # run keys and settings the stage adds

    schema_version: str = SCHEMA_VERSION
    capability_id: str | None = None
    eval_key: str | None = None  # what the comparison depends on (adapter, seeds, dtype, ...): a change replays it
    adapter_sha256: str | None = None
    seeds: list[int]
    base: SuccessSide
    adapter: SuccessSide
    difference: SuccessDifference
    per_seed: list[dict[str, Any]] = Field(default_factory=list)
    learned: bool | None = None  # the gate: difference.ci[0] > 0 (None in files written before the gate)


class RouteDecision(_Model):
    """The router's decision for one held-out instance: label probabilities, the adapter(s) chosen and their
    composition weights ({} = the base model), and the oracle label from analysis (None: base is right)."""

    instance_id: str
    family: str
    probabilities: dict[str, float]
    chosen: list[str]
    weights: dict[str, float]
    oracle: str | None = None


class RoutingSet(_Model):
    """Routing over one set of adapters (all of them, or the prefix a curve mark paid for)."""

    adapters: list[str]  # capability ids, in synthesis.capabilities order
    rollouts: int  # their training rollouts together
    options: list[dict[str, Any]]  # the routing options (label, capability id, name, definition, examples)
    scoring: str
    routes: list[RouteDecision]
    accuracy: dict[str, Any] | None = None  # routing_accuracy against the family -> capability map of analysis
    accuracy_prevalent: dict[str, Any] | None = None
    oracle_source: str | None = None
    distractors: list[str | None] = Field(default_factory=list)  # top capability per routing.gate.EVAL_DISTRACTORS
    distractors_to_base: float | None = None  # share of them routed to no adapter


class GateRecord(_Model):
    """A trained routing gate (trace_core/routing/gate.py), saved by stage routing as gate.json: softmax((x W^T +
    b) / temperature) over `classes` ("none" = no adapter) for the opening's embedding x."""

    schema_version: str = SCHEMA_VERSION
    gate_version: int
    classes: list[str]
    coef: list[list[float]]  # classes x embedding dimensions
    intercept: list[float]
    temperature: float
    embedding: dict[str, Any]  # the representation: package, version, weights sha256, pooling
    settings: dict[str, Any]  # evaluation.router.gate and the seed
    selection: dict[str, Any] = Field(default_factory=dict)  # the chosen synthetic weight and C, each grid point's CV
    libraries: dict[str, str]
    train_accuracy: float
    counts: dict[str, int]  # "<source>:<class>" -> training openings
    training: list[dict[str, Any]]  # per opening: source, label, instance_id, family, seed, index


class RoutingDecisions(_Model):
    """`decisions.json` of stage routing: per held-out instance the router's choice, for the full adapter set and for
    each curve mark below TRACE's full budget (key: the mark, in rollouts), with the settings that produced it."""

    schema_version: str = SCHEMA_VERSION
    run_key: str  # everything the decisions depend on; stage evaluation checks it against its own inputs
    router: dict[str, Any]  # evaluation.router
    adapters: dict[str, str]  # capability id -> adapter sha256: every trained adapter, the router's options
    # The adapters evaluation plays (the training gate's `learned` ones); a task routed to any other adapter plays
    # the base agent (`played_weights`). None (files written before the gate): all of them.
    learned: list[str] | None = None
    instances: list[str]  # held-out instance ids, in evaluation order
    family_capability: dict[str, str | None]  # family -> the capability lacking there (analysis, specific rule)
    full: RoutingSet | None = None  # None: no trained adapters
    marks: dict[str, RoutingSet] = Field(default_factory=dict)
    # Every scoring routed over the full adapter set (evaluation.router.scoring and .compare): the trace_<scoring>
    # rows and the routing report read them; routers[scoring] is `full`.
    routers: dict[str, RoutingSet] = Field(default_factory=dict)
    gates: dict[str, str] = Field(default_factory=dict)  # gate file name -> its sha256 (scoring gate)

    def played_weights(self, route: RouteDecision) -> dict[str, float]:
        """The adapter weights evaluation plays for `route`: those of `learned` adapters only, renormalised to the
        routed total; {} (the base agent) when the router chose only adapters the gate dropped."""
        if self.learned is None:
            return dict(route.weights)
        kept = {c: w for c, w in route.weights.items() if c in self.learned}
        total, kept_total = sum(route.weights.values()), sum(kept.values())
        if kept_total <= 0:
            return {}
        return {c: w * total / kept_total for c, w in kept.items()}


class BaselineOutcome(_Model):
    """One equal-budget baseline of stage baselines: trained/evolved (`record` is its adapter record or GEPA's
    result) or skipped (`warning` says why)."""

    name: Literal["grpo_target", "gepa", "mixture"]
    status: Literal["done", "skipped"]
    warning: str | None = None
    rollouts: int = 0
    record: dict[str, Any] | None = None


class BaselinesRecord(_Model):
    """`baselines.json` of stage baselines: TRACE's budget and each configured baseline's outcome, in run order."""

    schema_version: str = SCHEMA_VERSION
    budget: int  # TRACE's total training rollouts (the adapters' records)
    marks: list[int]  # the curve's rollout marks (grpo_target keeps a snapshot at each below the budget)
    adapters: dict[str, str]  # capability id -> adapter sha256 the budget was read from
    baselines: list[BaselineOutcome]

    def get(self, name: str) -> BaselineOutcome | None:
        return next((b for b in self.baselines if b.name == name), None)


class EvaluationResults(_Model):
    """`results.json` of stage evaluation."""

    schema_version: str = SCHEMA_VERSION
    provisional: bool  # true: written while baselines are still to play; the final write replaces it
    pending: list[str]
    summary: dict[str, Any]  # trace_core.evaluation.stats.evaluate
    methods: list[str]
    budgets: dict[str, int | None]
    routing: dict[str, Any] | None  # the full set's RoutingSet (as JSON)
    # Every router against the ground truth of the base agent's held-out trajectories (evaluation.stage.routers).
    routers: dict[str, Any] | None = None
    oracle_choice: dict[str, str]
    family_capability: dict[str, str | None]
    transfer: dict[str, Any]
    champions: list[str]
    curve: list[dict[str, Any]]
    warnings: list[str]
    adapters: list[dict[str, Any]]  # capability_id, rollouts, adapter_sha256
