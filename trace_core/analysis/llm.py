"""The LLM analysis agent (docs/method.md §1): an instruction-following model at an OpenAI-compatible endpoint proposes
candidate capabilities from pass/fail trajectories (discovery), then labels every (trajectory, capability) pair
NA / PRESENT / LACKING in `n_runs` independent runs (labelling).

Replies must be JSON. A reply that does not parse or validate is sent back with the error as a follow-up turn, up
to `max_attempts` tries in all; then the analysis stops with an AnalysisError (a trajectory is never dropped).
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from trace_core.agents.openai_client import OpenAIPolicy
from trace_core.agents.policy import PolicyError, Sampling
from trace_core.analysis.base import AnalysisError, Item, LabelSet, compact_trajectory, label_row, slugify, unique_id
from trace_core.config import AnalysisLLMCfg
from trace_core.schemas import CapabilitySpec, LabelRow

MAX_EXAMPLES = 4
QUOTE_CHARS = 300

# ---------------------------------------------------------------------------------------------------------------
# JSON in free text
# ---------------------------------------------------------------------------------------------------------------

_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


def _balanced_end(text: str, start: int) -> int | None:
    """Index just past the bracket that closes the one at `start` (strings and escapes respected), or None."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def extract_json(text: str, kinds: tuple[type, ...] = (dict, list)) -> Any:
    """The first JSON value of one of `kinds` in a model reply: a fenced ```json block, else the first balanced
    {...} or [...] that parses. ValueError says what was missing."""
    for block in _FENCE_RE.findall(text):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if isinstance(value, kinds):
            return value
    # Prose before the JSON can contain brackets ("[1]", "{name}"), so each opening bracket is tried in turn.
    for start in [i for i, ch in enumerate(text) if ch in "{["][:200]:
        end = _balanced_end(text, start)
        if end is None:
            continue
        try:
            value = json.loads(text[start:end])
        except ValueError:
            continue
        if isinstance(value, kinds):
            return value
    wanted = " or ".join("object {...}" if k is dict else "list [...]" for k in kinds)
    raise ValueError(f"no JSON {wanted} found in the reply")


# ---------------------------------------------------------------------------------------------------------------
# Reply schemas
# ---------------------------------------------------------------------------------------------------------------


class _Candidate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    definition: str = Field(min_length=1)
    example_task_ids: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _sluggable(cls, v: str) -> str:
        slugify(v)  # raises ValueError for a name without letters or digits
        return v.strip()

    @field_validator("example_task_ids", mode="before")
    @classmethod
    def _ids_as_strings(cls, v: Any) -> Any:
        return [str(x) for x in v] if isinstance(v, list) else v


_CANDIDATES = TypeAdapter(list[_Candidate])


class _Judgement(BaseModel):
    model_config = ConfigDict(extra="ignore")

    label: Literal["NA", "PRESENT", "LACKING"]
    reason: str = ""

    @field_validator("label", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.strip().upper() if isinstance(v, str) else v


_JUDGEMENTS = TypeAdapter(dict[str, _Judgement])


def _short_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()[:8])
    return str(exc)


# ---------------------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------------------

DISCOVERY_SYSTEM = """You analyse trajectories of a tool-using customer-service agent to find which capabilities \
it lacks. A capability is performing one or more actions in a trajectory that are necessary to solve a subset of \
the environment's tasks."""

DISCOVERY_TASK = """Above are {n} trajectories of the agent ({failures} failures, {successes} successes). Propose \
at most {k} candidate capabilities that separate failures from successes. Rules:
- Each is a general skill that transfers across tasks and domains (e.g. reasoning over structured records, \
precise tool arguments), not a domain rule or procedure (not "flight rebooking procedure").
- Candidates are distinct from each other: no two describe the same skill.
- A definition is 2-3 sentences, precise enough for another analyst to decide for any trajectory whether the \
skill was needed and whether it was shown. It gives no solution hints for particular tasks.
- name: snake_case, 2-5 words. example_task_ids: 2-4 task ids from the trajectories above, mixing failures and \
successes.
Reply with only a JSON list, most important first:
```json
[{{"name": "skill_name", "definition": "...", "example_task_ids": ["task id", "task id"]}}]
```"""

LABEL_SYSTEM = """You label one trajectory of a tool-using customer-service agent against a list of capabilities. \
For each capability answer:
- NA: the task did not need this capability.
- PRESENT: the task needed it and the agent showed it.
- LACKING: the task needed it and the agent did not show it.
When a failed trajectory is borderline between PRESENT and LACKING, answer PRESENT: label LACKING only with clear \
evidence in the trajectory."""

LABEL_TASK = """Capabilities:
{capabilities}

Trajectory:
{trajectory}

Label every capability above, using its id as the key. Reply with only a JSON object:
```json
{{{example}}}
```"""


def _capability_lines(capabilities: Sequence[CapabilitySpec]) -> str:
    return "\n".join(f"- {c.capability_id}: {' '.join(c.definition.split())}" for c in capabilities)


# ---------------------------------------------------------------------------------------------------------------
# The analyst
# ---------------------------------------------------------------------------------------------------------------


class LLMAnalyst:
    """A `Labeller` backed by an LLM. `backend` is anything with `complete_texts(conversations, sampling)`
    (default: `OpenAIPolicy` at `cfg.base_url`, overridden by env TRACE_ANALYSIS_BASE_URL, key from env
    `cfg.api_key_env` unless `api_key` is given). With `capabilities=None`, `label` discovers them first."""

    name = "llm"

    def __init__(
        self,
        cfg: AnalysisLLMCfg,
        n_runs: int,
        seed: int,
        api_key: str | None = None,
        backend: Any = None,
        capabilities: list[CapabilitySpec] | None = None,
    ):
        if n_runs < 1:
            raise AnalysisError(f"the LLM analyst needs n_runs >= 1 (got {n_runs}); set analysis.n")
        self.cfg = cfg
        self.n_runs = int(n_runs)
        self.seed = int(seed)
        self.capabilities = capabilities
        if backend is None:
            base_url = os.environ.get("TRACE_ANALYSIS_BASE_URL") or cfg.base_url
            if not base_url or not cfg.model:
                raise AnalysisError(
                    "the llm labeller needs an OpenAI-compatible endpoint: set analysis.llm.base_url (or env "
                    "TRACE_ANALYSIS_BASE_URL) and analysis.llm.model (e.g. serve the local model with "
                    "`python -m trace_core.agents.server --model smollm2 --port 8000`, "
                    "base_url http://127.0.0.1:8000/v1, model local)"
                )
            key = api_key if api_key is not None else os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
            backend = OpenAIPolicy(
                base_url, cfg.model, api_key=key, concurrency=cfg.concurrency, timeout_s=cfg.timeout_s
            )
        self.backend = backend

    @property
    def endpoint(self) -> str:
        """What error messages name: the URL of an HTTP backend, else the backend's name."""
        return getattr(self.backend, "url", None) or getattr(self.backend, "name", type(self.backend).__name__)

    # -- asking with retries -------------------------------------------------------------------------------------

    def _ask(
        self,
        conversations: list[list[dict]],
        parse: Callable[[str], Any],
        seed: int,
        what: list[str],
    ) -> list[Any]:
        """Send every conversation (concurrently, through the backend); parse each reply. A reply that fails
        `parse` gets the error back as a follow-up user turn, up to `max_attempts` tries in all."""
        convs = [list(c) for c in conversations]
        results: list[Any] = [None] * len(convs)
        pending = list(range(len(convs)))
        attempts = max(1, int(self.cfg.max_attempts))
        for attempt in range(attempts):
            # Each retry samples with other seeds, so a sampling model does not repeat the same broken reply.
            sampling = Sampling(
                temperature=self.cfg.temperature,
                top_p=1.0,  # analysis.llm has no nucleus setting
                max_new_tokens=self.cfg.max_new_tokens,
                seed=seed + 100_003 * attempt,
            )
            try:
                replies = self.backend.complete_texts([convs[i] for i in pending], sampling)
            except PolicyError as exc:
                raise AnalysisError(
                    f"the LLM analysis endpoint failed: {exc}. Is the server running? The endpoint comes from "
                    "analysis.llm.base_url (env TRACE_ANALYSIS_BASE_URL overrides)."
                ) from exc
            still = []
            for i, reply in zip(pending, replies, strict=True):
                if reply is None:
                    raise AnalysisError(
                        f"the prompt for {what[i]} does not fit the context of the model at {self.endpoint}; "
                        "lower analysis.llm.max_trajectory_chars (or analysis.llm.discovery_trajectories)"
                    )
                try:
                    results[i] = parse(reply)
                except (ValueError, ValidationError) as exc:
                    error = _short_error(exc)
                    if attempt + 1 == attempts:
                        raise AnalysisError(
                            f"the LLM at {self.endpoint} gave no valid answer for {what[i]} in {attempts} attempts; "
                            f"last error: {error}. The last reply began: {reply[:QUOTE_CHARS]!r}. Use an "
                            "instruction-following model that writes JSON (analysis.llm.model), or raise "
                            "analysis.llm.max_new_tokens / analysis.llm.max_attempts."
                        ) from None
                    convs[i] += [
                        {"role": "assistant", "content": reply},
                        {
                            "role": "user",
                            "content": f"Your reply could not be used: {error}. Answer again with only the JSON, "
                            "in the format asked for above.",
                        },
                    ]
                    still.append(i)
            pending = still
            if not pending:
                break
        return results

    # -- discovery -----------------------------------------------------------------------------------------------

    def _discovery_sample(self, items: list[Item]) -> list[Item]:
        """Up to `discovery_trajectories` items, half failures and half successes where possible (the short side's
        slots go to the other), chosen and ordered deterministically by `seed`."""
        rng = random.Random(self.seed)
        n = max(1, int(self.cfg.discovery_trajectories))
        ordered = sorted(items, key=lambda it: it.trajectory.trajectory_id)
        failures = [it for it in ordered if not it.trajectory.success]
        successes = [it for it in ordered if it.trajectory.success]
        n_fail = min(len(failures), max(n - len(successes), (n + 1) // 2))
        n_succ = min(len(successes), n - n_fail)
        chosen = rng.sample(failures, n_fail) + rng.sample(successes, n_succ)
        rng.shuffle(chosen)
        return chosen

    def discover(self, items: list[Item]) -> list[CapabilitySpec]:
        """Candidate capabilities proposed by the LLM from a pass/fail sample of `items`."""
        if not items:
            raise AnalysisError("LLM discovery needs trajectories; the analysis got none")
        shown = self._discovery_sample(items)
        texts = [compact_trajectory(it.trajectory, self.cfg.max_trajectory_chars) for it in shown]
        n_fail = sum(not it.trajectory.success for it in shown)
        prompt = "\n\n".join(f"=== trajectory {i + 1} ===\n{t}" for i, t in enumerate(texts))
        prompt += "\n\n" + DISCOVERY_TASK.format(
            n=len(shown), failures=n_fail, successes=len(shown) - n_fail, k=self.cfg.max_candidates
        )
        conv = [{"role": "system", "content": DISCOVERY_SYSTEM}, {"role": "user", "content": prompt}]

        def parse(reply: str) -> list[_Candidate]:
            value = extract_json(reply)
            if isinstance(value, dict):  # {"capabilities": [...]} is accepted too
                value = value.get("capabilities")
            candidates = _CANDIDATES.validate_python(value)
            if not candidates:
                raise ValueError("the list of capabilities is empty; propose at least one")
            return candidates

        candidates = self._ask([conv], parse, self.seed, ["capability discovery"])[0]
        task_ids = {it.task_id for it in items}
        taken: set[str] = set()
        specs = []
        for cand in candidates[: self.cfg.max_candidates]:
            examples = list(dict.fromkeys(t for t in cand.example_task_ids if t in task_ids))[:MAX_EXAMPLES]
            specs.append(
                CapabilitySpec(
                    capability_id=unique_id(slugify(cand.name), taken),
                    name=cand.name,
                    definition=" ".join(cand.definition.split()),
                    labeller="llm",
                    example_task_ids=examples,
                )
            )
        return specs

    # -- labelling -----------------------------------------------------------------------------------------------

    def _label_conversation(self, capabilities: list[CapabilitySpec], item: Item) -> list[dict]:
        example = ", ".join(
            f'"{c.capability_id}": {{"label": "NA|PRESENT|LACKING", "reason": "..."}}' for c in capabilities[:2]
        )
        if len(capabilities) > 2:
            example += ", ..."
        user = LABEL_TASK.format(
            capabilities=_capability_lines(capabilities),
            trajectory=compact_trajectory(item.trajectory, self.cfg.max_trajectory_chars),
            example=example,
        )
        return [{"role": "system", "content": LABEL_SYSTEM}, {"role": "user", "content": user}]

    def label_run(self, capabilities: list[CapabilitySpec], items: list[Item], run: int) -> list[LabelRow]:
        """One independent labelling run (fresh contexts, seed `seed + run`): one request per trajectory."""
        ids = [c.capability_id for c in capabilities]

        def parse(reply: str) -> dict[str, _Judgement]:
            judged = _JUDGEMENTS.validate_python(extract_json(reply, (dict,)))
            missing = [c for c in ids if c not in judged]
            unknown = [k for k in judged if k not in ids]
            if missing or unknown:
                raise ValueError(
                    (f"missing capability ids: {', '.join(missing)}. " if missing else "")
                    + (f"unknown keys: {', '.join(unknown)}. " if unknown else "")
                    + f"Use exactly these keys: {', '.join(ids)}"
                )
            return judged

        convs = [self._label_conversation(capabilities, it) for it in items]
        what = [f"trajectory {it.trajectory.trajectory_id} (task {it.task_id}, run {run})" for it in items]
        answers = self._ask(convs, parse, self.seed + run, what)
        rows = []
        for item, judged in zip(items, answers, strict=True):
            for cid in ids:
                note = " ".join(judged[cid].reason.split())
                rows.append(label_row(run, item, cid, judged[cid].label, "llm", note))
        return rows

    def label(self, items: list[Item]) -> LabelSet:
        capabilities = self.capabilities if self.capabilities is not None else self.discover(items)
        if not capabilities:
            raise AnalysisError("the LLM analyst has no capabilities to label; pass some or let discovery run")
        rows = [row for run in range(self.n_runs) for row in self.label_run(capabilities, items, run)]
        return LabelSet(capabilities=list(capabilities), rows=rows, runs=self.n_runs)
