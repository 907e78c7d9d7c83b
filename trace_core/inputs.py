"""What the stages after training (routing, baselines, evaluation) read alike: the held-out evaluation instances,
the adapters stage training finished, TRACE's rollout budget and the curve's rollout marks.

Errors are `StageInputError`s naming the file or setting and the stage to run; each stage raises its own
subclass of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trace_core.config import Params
from trace_core.jsonl import iter_jsonl
from trace_core.schemas import AdapterRecord, CapabilityDictionary, Instance, task_key


class StageInputError(RuntimeError):
    """An input of routing, baselines or evaluation is missing, stale or clashes with another (the message says
    which, and what to run)."""


@dataclass(frozen=True)
class TrainedAdapter:
    """One capability's adapter from stage training, with what the router and the report show about it."""

    capability_id: str
    path: Path  # the PEFT adapter folder
    rollouts: int  # training rollouts spent (the rollout ledger of its run)
    sha256: str
    name: str
    definition: str


def held_out_instances(params: Params) -> list[Instance]:
    """The evaluation instances: procedural families at `evaluation.seed`, or an official τ² split."""
    from trace_core.baseline import target_instances

    try:
        return list(target_instances(params, "evaluation"))
    except ValueError as exc:
        raise StageInputError(str(exc)) from None


def check_held_out(instances: Sequence[Instance], params: Params) -> None:
    """Fail when an evaluation instance was also rolled out by the baseline (and so seen by analysis)."""
    seen = Path(params.baseline.out_dir) / "instances.jsonl"
    if not seen.exists():
        return
    rows = [Instance.model_validate_json(line) for line in iter_jsonl(seen) if line.strip()]
    analysed = {i.instance_id for i in rows}
    analysed_content = {task_key(i) for i in rows}
    clash = [i.instance_id for i in instances if i.instance_id in analysed or task_key(i) in analysed_content]
    if clash:
        raise StageInputError(
            f"{len(clash)} evaluation instances (e.g. {clash[:3]}) were rolled out by the baseline and analysed; "
            "choose an evaluation.seed (procedural) or evaluation.tau2_split (tau2) the baseline did not use"
        )


def read_adapter_record(path: Path) -> AdapterRecord | None:
    """The adapter record at `path`; None when missing. A file of another shape fails naming the stage to re-run."""
    if not path.exists():
        return None
    try:
        return AdapterRecord.model_validate_json(path.read_text())
    except ValueError as exc:
        raise StageInputError(f"{path} is not an adapter record ({exc.__class__.__name__}); re-run "
                              f"`dvc repro training@{path.parent.name}`") from None


@dataclass(frozen=True)
class DroppedAdapter:
    """A trained adapter left out by the gate of stage training (it did not learn), and why."""

    capability_id: str
    rollouts: int  # spent all the same
    reason: str


def trained_adapters(params: Params) -> list[TrainedAdapter]:
    """The adapters stage training finished (intact files) and that passed its gate (`learned`; every trained one
    with `training.keep_unlearned`), in `synthesis.capabilities` order."""
    return adapter_gate(params)[0]


def dropped_adapters(params: Params) -> list[DroppedAdapter]:
    """The trained adapters the gate leaves out (none with `training.keep_unlearned`)."""
    return adapter_gate(params)[1]


def routable_adapters(params: Params) -> list[TrainedAdapter]:
    """Every adapter stage training finished (intact files), learned or not, in `synthesis.capabilities` order: the
    options the router chooses among. Which capability a task lacks does not depend on whether that capability's
    adapter learned, so routing (and its accuracy against the ground truth) covers them all; stage evaluation then
    plays only the gate's adapters (`adapter_gate`): a task routed to a dropped one plays the base agent."""
    return [a for a, _ in _trained(params)]


def adapter_gate(params: Params) -> tuple[list[TrainedAdapter], list[DroppedAdapter]]:
    """The trained adapters routing and evaluation use, and those the gate drops: an adapter is used when its
    record says `learned` (the paired 95% CI of its held-out success difference lies above 0), or with
    `training.keep_unlearned`. A record without the gate's verdict (not evaluated yet) is dropped too."""
    return _gate(params, _trained(params, check_dropped=False))


def routing_adapters(params: Params) -> tuple[list[TrainedAdapter], list[TrainedAdapter], list[DroppedAdapter]]:
    """(`routable_adapters`, then `adapter_gate`'s used and dropped ones) from one reading of the records: each
    adapter file is hashed once, for routing and evaluation, which need both."""
    trained = _trained(params)
    return [a for a, _ in trained], *_gate(params, trained)


def _gate(params: Params, trained: Sequence[tuple[TrainedAdapter, AdapterRecord]]
          ) -> tuple[list[TrainedAdapter], list[DroppedAdapter]]:
    out: list[TrainedAdapter] = []
    dropped: list[DroppedAdapter] = []
    for adapter, record in trained:
        if record.learned or params.training.keep_unlearned:
            out.append(adapter)
            continue
        reason = record.gate or (f"no held-out evaluation recorded (the gate needs eval.json); re-run "
                                 f"`dvc repro training@{adapter.capability_id}`")
        dropped.append(DroppedAdapter(adapter.capability_id, record.rollouts, reason))
    return out, dropped


def _trained(params: Params, check_dropped: bool = True) -> list[tuple[TrainedAdapter, AdapterRecord]]:
    """Every finished adapter with its record, in `synthesis.capabilities` order. Its file must match the record
    (else fail naming the stage to re-run); with `check_dropped=False` only the files of adapters the gate keeps
    are checked (a dropped one is never loaded)."""
    from trace_core.training.stage import RECORD, capabilities
    from trace_core.training.trainer import ADAPTER_FILE, sha256_file

    described = capability_texts(params)
    out = []
    for cid in capabilities(params, params.synthesis.out_dir):
        folder = Path(params.training.out_dir) / cid
        record = read_adapter_record(folder / RECORD)
        if record is None or not record.trained:
            continue
        adapter = folder / record.adapter_dir
        used = record.learned or params.training.keep_unlearned
        if (check_dropped or used) and (not (adapter / ADAPTER_FILE).exists()
                                        or sha256_file(adapter / ADAPTER_FILE) != record.adapter_sha256):
            raise StageInputError(
                f"{adapter} does not match its record (missing or changed file); re-run `dvc repro training@{cid}`"
            )
        name, definition = described.get(cid, (cid.replace("_", " "), ""))
        out.append((TrainedAdapter(cid, adapter, record.rollouts, record.adapter_sha256, name, definition), record))
    return out


def trace_budget(adapters: Sequence[TrainedAdapter], dropped: Sequence[DroppedAdapter]) -> int:
    """TRACE's training rollouts: those of the adapters it uses plus those of the dropped ones, which were spent
    all the same (the equal-budget baselines get as many)."""
    return sum(a.rollouts for a in adapters) + sum(d.rollouts for d in dropped)


def gate_warnings(adapters: Sequence[TrainedAdapter], dropped: Sequence[DroppedAdapter]) -> list[str]:
    """What a report says about the gate: each dropped adapter and why; with none left, that TRACE is the base
    agent."""
    lines = [f"adapter {d.capability_id} dropped ({d.rollouts} training rollouts): {d.reason}; "
             "training.keep_unlearned=true keeps it" for d in dropped]
    if dropped and not adapters:
        lines.append("no adapter learned: TRACE is the base agent (every trained adapter was dropped by the gate)")
    return lines


def capability_texts(params: Params) -> dict[str, tuple[str, str]]:
    """capability id -> (name, definition) from analysis' capabilities.json ({} before analysis ran)."""
    path = Path(params.analysis.out_dir) / "capabilities.json"
    if not path.exists():
        return {}
    dictionary = CapabilityDictionary.model_validate_json(path.read_text())
    return {c.capability_id: (c.name, c.definition) for c in dictionary.capabilities}


def curve_marks(adapters: Sequence[TrainedAdapter], points: int) -> list[int]:
    """Rollout budgets on the curve: `points` marks up to TRACE's total, each at the cumulative training cost of a
    prefix of the adapters (so TRACE has a model at every mark: the routed prefix)."""
    cumulative = []
    total = 0
    for a in adapters:
        total += a.rollouts
        cumulative.append(total)
    if not cumulative or points < 1:
        return []
    if points >= len(cumulative):
        return cumulative
    # Evenly spaced prefixes, always ending with the full set.
    picks = sorted({round((j + 1) * len(cumulative) / points) - 1 for j in range(points)})
    return [cumulative[i] for i in picks]


def paid_prefix(adapters: Sequence[TrainedAdapter], mark: int) -> list[TrainedAdapter]:
    """The adapters (a prefix, in order) whose training rollouts together fit within `mark`."""
    paid, total = [], 0
    for a in adapters:
        if total + a.rollouts > mark:
            break
        total += a.rollouts
        paid.append(a)
    return paid
