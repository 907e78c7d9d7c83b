"""Where a pipeline run stands, read from its output folders alone: `trace status`.

A default-size `dvc repro` on a CPU runs for a day or more, stage after stage, and resumes after a kill. This module
answers "how far is it?" without loading a model or touching DVC's state: for each stage, what its outputs on disk
say (done, partly done with counts, not started), and which stage a live `dvc repro` is writing (DVC's lock file,
`.dvc/tmp/rwlock`, names the output and the process id). Whether finished outputs are still up to date with the
code and params is `dvc status`'s question, not this one's.

Every reader tolerates missing, half-written or foreign files: a file it cannot read shows as "unreadable", so the
report never fails because a stage is writing while it looks.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trace_core.config import Params
from trace_core.runs import read_typed, resume_dir
from trace_core.schemas import AdapterEval, AdapterRecord, BaselinesRecord, EvaluationResults, RoutingDecisions

DONE, RUNNING, PARTIAL, PENDING, SKIPPED = "done", "running", "partial", "not started", "skipped"
UNREADABLE = "unreadable"


@dataclass
class Row:
    """One line of the report: a stage, or one capability or method inside a stage."""

    name: str
    state: str
    detail: str = ""
    children: list[Row] = field(default_factory=list)


def _json(path: Path) -> Any:
    """The parsed file, None when it is missing, or the string "unreadable"."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "unreadable"


class _Unreadable(Exception):
    pass


def _typed(path: Path, model: Any) -> Any:
    """The stage record at `path` as its typed model (trace_core.schemas), None when it is missing, or the string
    "unreadable" (half-written, foreign, or of another schema)."""
    if not path.exists():
        return None
    try:
        return read_typed(path, model, model.__name__, "", _Unreadable)
    except (_Unreadable, OSError):
        return UNREADABLE


def _lines(path: Path) -> int:
    """Complete (newline-terminated) lines of a JSONL file that is possibly being appended to."""
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _alive(pid: Any) -> bool:
    """A running process with this id (pid <= 0 would address process groups)."""
    try:
        pid = int(pid)
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except (OSError, ValueError, TypeError, OverflowError):
        return False
    return True


def writers(root: Path) -> dict[Path, int]:
    """Outputs a live DVC process holds a write lock on (from `.dvc/tmp/rwlock`), with its pid."""
    lock = _json(root / ".dvc" / "tmp" / "rwlock")
    if not isinstance(lock, dict) or not isinstance(lock.get("write"), dict):
        return {}
    out = {}
    for path, info in lock["write"].items():
        pid = info.get("pid") if isinstance(info, dict) else None
        if _alive(pid):
            out[Path(path).resolve()] = int(pid)
    return out


def _rollouts(ledger: Any) -> int:
    """Every rollout a ledger file counts (0 for a missing or unreadable one)."""
    if not isinstance(ledger, dict):
        return 0
    return sum(int(n) for caps in ledger.get("rollouts", {}).values() for n in caps.values())


def _last_checkpoint_step(folder: Path) -> int | None:
    steps = [int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps) if steps else None


def _log_history(folder: Path, step: int) -> list[dict]:
    """The GRPO trainer's logged steps in checkpoint `step` (trainer_state.json); [] when unreadable."""
    state = _json(folder / f"checkpoint-{step}" / "trainer_state.json")
    history = state.get("log_history") if isinstance(state, dict) else None
    return [h for h in history if isinstance(h, dict)] if isinstance(history, list) else []


def _timed(history: list[dict]) -> list[dict]:
    return [h for h in history if isinstance(h.get("step_time"), (int, float))]


def _last_logged(history: list[dict]) -> str:
    """The last logged step: its mean reward and time."""
    last = history[-1] if history else None
    if last is None or "reward" not in last:
        return ""
    took = f", {last['step_time']:,.0f} s" if isinstance(last.get("step_time"), (int, float)) else ""
    return f" (step {last.get('step')}: mean reward {last['reward']:.2f}{took})"


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def _steps_left(history: list[dict], step: int, max_steps: int) -> str:
    """An estimate of the time the remaining GRPO steps take: their number times the median logged step time (the
    median, since one step of a paused or resumed run can take many times the others)."""
    times = sorted(h["step_time"] for h in _timed(history))
    if not times or step >= max_steps:
        return ""
    median = times[len(times) // 2]
    return f"; ~{_duration(median * (max_steps - step))} of steps left (median step {median:,.0f} s)"


def _rollouts_left(history: list[dict], left: int) -> str:
    """An estimate of the time a baseline's remaining `left` rollouts take, at the logged seconds per rollout."""
    history = _timed(history)
    seconds = sum(h["step_time"] for h in history)
    rollouts = sum(h.get("rollouts/rollouts", 0) for h in history if isinstance(h.get("rollouts/rollouts"), (int, float)))
    if left <= 0 or not seconds or not rollouts:
        return ""
    return f"; ~{_duration(seconds / rollouts * left)} left ({seconds / rollouts:,.1f} s per rollout)"


class _Report:
    def __init__(self, params: Params, root: Path):
        self.p, self.root = params, root
        self.locked = writers(root)

    def dir(self, configured: str | os.PathLike) -> Path:
        path = Path(configured)
        return path if path.is_absolute() else self.root / path

    def running(self, path: Path) -> int | None:
        """The pid of a live `dvc repro` writing `path` (or something inside it), else None."""
        path = path.resolve()
        return next((pid for locked, pid in self.locked.items() if locked == path or path in locked.parents), None)

    # ------------------------------------------------------------------------------------------ one per stage
    def bootstrap(self) -> Row:
        out = self.dir(self.p.bootstrap.out_dir)
        m = _json(out / "metrics.json")
        if isinstance(m, dict) and (out / "model").is_dir():
            if not m.get("enabled", True):
                return Row("bootstrap", DONE, "disabled: the raw model is the base agent")
            return Row("bootstrap", DONE, f"{m.get('steps')} SFT steps on {m.get('dialogues')} dialogues, "
                                          f"{m.get('seconds_total', 0):,.0f} s")
        return self._pending("bootstrap", out)

    def baseline(self) -> Row:
        out = self.dir(self.p.baseline.out_dir)
        m = _json(out / "metrics.json")
        episodes = _lines(out / "trajectories.jsonl")
        if isinstance(m, dict) and (out / "table.md").exists():
            return Row("baseline", DONE, f"{m.get('n_trajectories', episodes)} episodes on {m.get('n_tasks')} "
                                         f"instances, success {m.get('success_rate', 0):.3f}")
        row = self._pending("baseline", out)
        if episodes:
            row.detail = f"{episodes} episodes played" + (f"; {row.detail}" if row.detail else "")
            row.state = row.state if row.state == RUNNING else PARTIAL
        return row

    def analysis(self) -> Row:
        out = self.dir(self.p.analysis.out_dir)
        caps = _json(out / "capabilities.json")
        if isinstance(caps, dict):
            return Row("analysis", DONE, "selected: " + (", ".join(caps.get("selected", [])) or "none"))
        return self._pending("analysis", out)

    def synthesis(self) -> Row:
        out = self.dir(self.p.synthesis.out_dir)
        row = Row("synthesis", PENDING)
        for cid in self.p.synthesis.capabilities:
            spec = _json(out / cid / "spec.json")
            if isinstance(spec, dict):
                reason = str(spec.get("reason", "")).split(";")[0]  # the first clause; spec.json has the rest
                row.children.append(Row(cid, DONE, f"{spec.get('status')}: {reason}"))
            else:
                row.children.append(self._pending(cid, out / cid))
        return self._roll_up(row)

    def training(self) -> Row:
        out = self.dir(self.p.training.out_dir)
        synthesis = self.dir(self.p.synthesis.out_dir)
        row = Row("training", PENDING)
        for cid in self.p.synthesis.capabilities:
            spec = _json(synthesis / cid / "spec.json")
            folder = out / cid
            work = resume_dir(folder)  # a run in progress keeps its checkpoints and ledger here (older runs: folder)
            record = _typed(folder / "adapter_record.json", AdapterRecord)
            ev = _typed(folder / "eval.json", AdapterEval)
            spent = _rollouts(_json(folder / "ledger.json")) or _rollouts(_json(work / "ledger.json"))
            if isinstance(spec, dict) and spec.get("status") != "ready":
                row.children.append(Row(cid, SKIPPED, f"environment {spec.get('status')}"))
            elif isinstance(record, AdapterRecord) and isinstance(ev, AdapterEval):
                base, adapter = ev.base, ev.adapter
                row.children.append(Row(cid, DONE, (
                    f"{spent} rollouts; held-out successes {base.successes}/{base.episodes} -> "
                    f"{adapter.successes}/{adapter.episodes}, mean reward "
                    f"{base.mean_reward:.3f} -> {adapter.mean_reward:.3f}")))
            elif UNREADABLE in (record, ev):
                bad = "adapter_record.json" if record == UNREADABLE else "eval.json"
                row.children.append(Row(cid, UNREADABLE, str(folder / bad)))
            else:
                child = self._pending(cid, folder)
                checkpoints = work / "checkpoints" if (work / "checkpoints").is_dir() else folder / "checkpoints"
                step = _last_checkpoint_step(checkpoints)
                if isinstance(record, AdapterRecord):
                    parts = ["adapter trained; evaluating against the base agent"]
                elif step is not None:
                    history = _log_history(checkpoints, step)
                    parts = [f"checkpoint at step {step}/{self.p.training.max_steps}" + _last_logged(history)
                             + _steps_left(history, step, self.p.training.max_steps)]
                else:
                    parts = []
                if spent:
                    parts.append(f"{spent} rollouts spent")
                if parts and child.state == PENDING:
                    child.state = PARTIAL
                child.detail = "; ".join(parts + ([child.detail] if child.detail else []))
                row.children.append(child)
        return self._roll_up(row)

    def routing(self) -> Row:
        out = self.dir(self.p.routing.out_dir)
        decisions = _typed(out / "decisions.json", RoutingDecisions)
        if decisions == UNREADABLE:
            return Row("routing", UNREADABLE, str(out / "decisions.json"))
        if isinstance(decisions, RoutingDecisions):
            full = decisions.full
            if full is None:
                return Row("routing", DONE, f"{len(decisions.instances)} instances; no trained adapters to route to")
            routed = sum(bool(r.chosen) for r in full.routes)
            detail = f"{len(full.routes)} instances, {routed} routed to an adapter"
            if decisions.learned is not None and len(decisions.learned) < len(decisions.adapters):
                played = sum(bool(decisions.played_weights(r)) for r in full.routes)
                detail += (f" ({played} to one of the {len(decisions.learned)} learned of {len(decisions.adapters)}; "
                           "the others play the base agent)")
            if full.accuracy:
                detail += f"; accuracy {full.accuracy['accuracy']:.0%} (chance {full.accuracy['chance_uniform']:.0%})"
            return Row("routing", RUNNING if self.running(out) else DONE, detail)
        row = self._pending("routing", out)
        cached = len(list((out / "probabilities").glob("*.json")))
        if cached and row.state == PENDING:
            row.state, row.detail = PARTIAL, f"{cached} sets of router probabilities saved"
        return row

    def baselines(self) -> Row:
        out = self.dir(self.p.baselines.out_dir)
        training = self.dir(self.p.training.out_dir)
        record = _typed(out / "baselines.json", BaselinesRecord)
        if record == UNREADABLE:
            return Row("baselines", UNREADABLE, str(out / "baselines.json"))
        if isinstance(record, BaselinesRecord) and not self.running(out):
            row = Row("baselines", DONE, f"budget {record.budget} rollouts")
            for b in record.baselines:
                row.children.append(Row(b.name, DONE if b.status == "done" else SKIPPED,
                                        f"{b.rollouts} rollouts" if b.status == "done" else (b.warning or "")))
            return row
        # TRACE's budget as the stage counts it: the rollouts recorded with each trained adapter.
        capabilities = self.p.synthesis.capabilities
        records = [_typed(training / cid / "adapter_record.json", AdapterRecord) for cid in capabilities]
        budget = sum(r.rollouts for r in records if isinstance(r, AdapterRecord) and r.trained)
        row = Row("baselines", PENDING, f"budget for grpo_target, gepa, mixture: {budget} rollouts (the adapters' "
                                        "training so far)")
        for folder in sorted(p for p in out.glob("*") if p.is_dir()):
            child = self._baseline(folder, budget)
            if child.state != PENDING:
                row.children.append(child)
        if row.children:
            row.state = RUNNING if self.running(out) else PARTIAL
        elif self.running(out):
            row.state = RUNNING
        return row

    def evaluation(self) -> Row:
        out = self.dir(self.p.evaluation.out_dir)
        results = _typed(out / "results.json", EvaluationResults)
        if results == UNREADABLE:
            return Row("evaluation", UNREADABLE, str(out / "results.json"))
        table = isinstance(results, EvaluationResults) and (out / "table.md").exists()
        provisional = table and results.provisional
        if table and not provisional and not self.running(out):
            return Row("evaluation", DONE, f"table: {out / 'table.md'}")
        row = Row("evaluation", PENDING)
        cfg = self.p.evaluation
        if cfg.source == "procedural":
            expected = len(self.p.tasks.families) * cfg.instances_per_family * cfg.trials
            per_method = f"/{expected}"
        else:
            per_method = ""
        trajectories = out / "trajectories"
        for folder in sorted(p for p in trajectories.glob("*") if p.is_dir()):
            n = sum(_lines(f) for f in folder.glob("*.jsonl"))
            row.children.append(Row(folder.name, PARTIAL if n else PENDING, f"{n}{per_method} held-out episodes"))
        if not row.children:
            row = self._pending("evaluation", out)
        else:
            row.state = RUNNING if self.running(out) else PARTIAL
        if provisional:
            pending = results.pending or ["the baselines"]
            row.detail = f"provisional table ({', '.join(map(str, pending))} still to run): {out / 'table.md'}" + (
                f"; {row.detail}" if row.detail else "")
        return row

    # ---------------------------------------------------------------------------------------------- helpers
    def _baseline(self, folder: Path, budget: int) -> Row:
        history = _json(folder / "history.json")
        if isinstance(history, dict) or (folder / "episodes.jsonl").exists():  # gepa (history.json comes later)
            history = history if isinstance(history, dict) else {}
            spent = _lines(folder / "episodes.jsonl")
            state = DONE if history.get("finished") else PARTIAL
            detail = f"{spent}/{history.get('budget_rollouts', budget)} rollouts, " \
                     f"{len(history.get('candidates', []))} candidates scored"
            return Row(folder.name, state, detail)
        record = _typed(folder / "adapter_record.json", AdapterRecord)
        spent = _rollouts(_json(folder / "ledger.json"))
        if isinstance(record, AdapterRecord) and record.status:
            planned = (record.model_extra or {}).get("budget_rollouts", budget)
            return Row(folder.name, DONE, f"{spent}/{planned} rollouts")
        step = _last_checkpoint_step(folder / "checkpoints")
        detail = f"{spent}/{budget} rollouts"
        if step is not None:
            history = _log_history(folder / "checkpoints", step)
            detail += f", checkpoint at step {step}" + _last_logged(history) + _rollouts_left(history, budget - spent)
        return Row(folder.name, PARTIAL if spent else PENDING, detail)

    def _pending(self, name: str, out: Path) -> Row:
        pid = self.running(out)
        return Row(name, RUNNING, f"dvc repro (pid {pid}) is writing it") if pid else Row(name, PENDING)

    def _roll_up(self, row: Row) -> Row:
        states = {c.state for c in row.children}
        if RUNNING in states:
            row.state = RUNNING
        elif states and states <= {DONE, SKIPPED}:
            row.state = DONE
        elif states - {PENDING}:
            row.state = PARTIAL
        return row


def report(params: Params, root: str | os.PathLike = ".") -> list[Row]:
    """One row per stage, in pipeline order, with a row per capability or method where a stage has several. A stage
    whose files hold something unexpected (well-formed JSON of another shape) shows as "unreadable"."""
    r = _Report(params, Path(root).resolve())
    rows = []
    for name in ("bootstrap", "baseline", "analysis", "synthesis", "training", "routing", "baselines", "evaluation"):
        try:
            rows.append(getattr(r, name)())
        except Exception as exc:  # noqa: BLE001 - a progress report must not fail on a foreign or half-written file
            rows.append(Row(name, UNREADABLE, f"{type(exc).__name__}: {exc}"))
    return rows


def render(rows: list[Row]) -> str:
    """The report as aligned text lines."""
    lines = []
    for row in rows:
        lines.append(f"{row.name:<12} {row.state:<12} {row.detail}".rstrip())
        for child in row.children:
            lines.append(f"  {child.name:<34} {child.state:<12} {child.detail}".rstrip())
    return "\n".join(lines)


def as_dicts(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]


__all__ = ["DONE", "PARTIAL", "PENDING", "RUNNING", "SKIPPED", "UNREADABLE", "Row", "as_dicts", "render", "report",
           "writers"]
