"""Control capabilities: candidates built so that a sound analysis rejects them.

- `control_random`: LACKING or PRESENT by a fair coin per (run, trajectory) — no relation to the outcome, so its
  contrastive gap hovers around 0 and it cannot pass in K of N runs except by a rare fluke.
- `control_uniform`: LACKING on every trajectory with an agent turn — failures and successes alike. It has full
  coverage but no contrast (Δ = 0): it shows that coverage alone does not select.

A control that passes means the thresholds or the labels are not trustworthy; the stage reports it as a warning.
"""

from __future__ import annotations

import hashlib

from trace_core.analysis.base import Item, LabelSet, label_row
from trace_core.schemas import CapabilitySpec, LabelRow

CONTROLS = {
    "control_random": "Random control: labelled LACKING or PRESENT by a seeded coin flip, unrelated to the episode.",
    "control_uniform": "Uniform control: labelled LACKING on every episode in which the agent acted.",
}


def _coin(seed: int, run: int, trajectory_id: str) -> bool:
    digest = hashlib.sha256(f"{seed}:{run}:{trajectory_id}".encode()).digest()
    return digest[0] % 2 == 1


class ControlLabeller:
    """Labels for the two control capabilities over `n_runs` runs (the random control differs per run)."""

    name = "control"

    def __init__(self, n_runs: int, seed: int):
        self.n_runs = n_runs
        self.seed = seed

    def label(self, items: list[Item]) -> LabelSet:
        specs = [
            CapabilitySpec(capability_id=cid, name=cid.replace("_", " "), definition=text, labeller="control", control=True)
            for cid, text in CONTROLS.items()
        ]
        rows: list[LabelRow] = []
        for run in range(self.n_runs):
            for item in items:
                acted = any(m.role == "assistant" for m in item.trajectory.messages)
                coin = _coin(self.seed, run, item.trajectory.trajectory_id)
                rows.append(label_row(run, item, "control_random", "LACKING" if coin else "PRESENT", "control", "coin flip"))
                note = "every episode" if acted else "agent never acted"
                rows.append(label_row(run, item, "control_uniform", "LACKING" if acted else "NA", "control", note))
        return LabelSet(capabilities=specs, rows=rows, runs=self.n_runs)
