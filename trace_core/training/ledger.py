"""`RolloutLedger`: how many rollouts (episodes) each stage spent on each capability, kept on disk.

The method's budget is counted in rollouts (TRACE reached its τ² result with 5,120 in all), so every episode a
stage runs is recorded here, including those of constant-reward groups that were dropped and those of a step that
was interrupted and redone after a resume: the ledger counts what was spent, not what was kept. It also counts the
environment seeds drawn, so a resumed run continues with fresh seeds instead of replaying the same ones.

On disk (JSON, replaced atomically after every change, so a kill leaves the old or the new file, never a torn one):
    {"schema_version": "1",
     "rollouts": {"training": {"multi_step_completion": 320}},
     "seeds": {"training": {"multi_step_completion": 40}}}
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trace_core.runs import write_json_atomic

LEDGER_VERSION = "1"
COUNTERS = ("rollouts", "seeds")


class RolloutLedger:
    """Counters per (stage, capability_id). With a `path`, the file is loaded if present and rewritten after
    every `add`."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self.counts: dict[str, dict[str, dict[str, int]]] = {name: {} for name in COUNTERS}
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(
                f"{path} is not a valid rollout ledger ({exc}); restore it or delete it to restart the count"
            ) from None
        if data.get("schema_version") != LEDGER_VERSION:
            raise ValueError(
                f"{path} has ledger schema_version {data.get('schema_version')!r}, expected {LEDGER_VERSION!r}"
            )
        for name in COUNTERS:
            self.counts[name] = {
                stage: {cap: int(n) for cap, n in caps.items()} for stage, caps in data.get(name, {}).items()
            }

    def add(self, stage: str, capability_id: str, *, rollouts: int = 0, seeds: int = 0) -> None:
        """Count `rollouts` episodes and `seeds` environment seeds drawn, then persist."""
        if rollouts < 0 or seeds < 0:
            raise ValueError(f"ledger counts only grow; got rollouts={rollouts}, seeds={seeds}")
        for name, n in (("rollouts", rollouts), ("seeds", seeds)):
            per_cap = self.counts[name].setdefault(stage, {})
            per_cap[capability_id] = per_cap.get(capability_id, 0) + int(n)
        self.save()

    def rollouts(self, stage: str | None = None, capability_id: str | None = None) -> int:
        """Rollouts counted, summed over every stage / capability left unspecified."""
        return self._total("rollouts", stage, capability_id)

    def seeds(self, stage: str | None = None, capability_id: str | None = None) -> int:
        return self._total("seeds", stage, capability_id)

    def _total(self, name: str, stage: str | None, capability_id: str | None) -> int:
        return sum(
            n
            for s, caps in self.counts[name].items()
            if stage is None or s == stage
            for c, n in caps.items()
            if capability_id is None or c == capability_id
        )

    def to_dict(self) -> dict:
        return {"schema_version": LEDGER_VERSION, **{name: self.counts[name] for name in COUNTERS}}

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, self.to_dict())

