"""Which adapter a task needed, from analysis' labels rather than from any router.

One rule (`routing_label`) serves both the gate's target-domain training openings (the baseline's trajectories with
analysis' labels) and the routing ground truth on held-out tasks (the base agent's own held-out trajectories,
judged by analysis' programmatic labeller): a successful run needs no adapter; a failed run LACKING exactly one of
the routed capabilities needs that capability's adapter; any other failed run (none or several of them lacking) is
ambiguous and left out, since no single adapter is the right answer for it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from trace_core.schemas import Instance, Trajectory

AMBIGUOUS = "ambiguous"


def routing_label(lacking: Iterable[str], success: bool, capability_ids: Sequence[str]) -> str | None:
    """None (no adapter) for a success; the one capability of `capability_ids` in `lacking` for a failure; else
    `AMBIGUOUS`."""
    if success:
        return None
    lacking = set(lacking)
    hit = [c for c in capability_ids if c in lacking]
    return hit[0] if len(hit) == 1 else AMBIGUOUS


def labels_lacking(frame: Any, capability_ids: Sequence[str]) -> dict[str, tuple[str, bool, set[str]]]:
    """From analysis' label table (labels.parquet as a DataFrame): per trajectory (its trajectory_id, or its
    instance_id in tables without one) its instance id, success and the capabilities of `capability_ids` it LACKS.
    A labeller with several runs (embedding, llm) counts as LACKING when more than half of its rows for that
    trajectory and capability say so."""
    ids = set(capability_ids)
    key_col = "trajectory_id" if "trajectory_id" in frame.columns else "instance_id"
    votes: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    out: dict[str, tuple[str, bool, set[str]]] = {}
    for key, instance_id, success, cid, label in zip(frame[key_col], frame["instance_id"], frame["success"],
                                                     frame["capability_id"], frame["label"]):
        out.setdefault(str(key), (str(instance_id), bool(success), set()))
        if cid in ids:
            v = votes[(str(key), str(cid))]
            v[0] += label == "LACKING"
            v[1] += 1
    for (key, cid), (lacking, total) in votes.items():
        if lacking * 2 > total:
            out[key][2].add(cid)
    return out


def ground_truth(trajectories: Sequence[Trajectory], instances: Sequence[Instance], capability_ids: Sequence[str],
                 labeller: Any) -> dict[str, str | None]:
    """instance id -> the capability its trajectory lacked (None: no adapter, `AMBIGUOUS`: none or several), from
    `labeller.judge(trajectory, instance)` (analysis' `ProgrammaticLabeller`) on each instance's first trial."""
    by_id = {i.instance_id: i for i in instances}
    first: dict[str, Trajectory] = {}
    for t in trajectories:
        if t.instance_id not in first or t.trial < first[t.instance_id].trial:
            first[t.instance_id] = t
    out: dict[str, str | None] = {}
    for instance_id, t in first.items():
        judged = labeller.judge(t, by_id.get(instance_id))
        lacking = [c for c, (label, _) in judged.items() if label == "LACKING"]
        out[instance_id] = routing_label(lacking, t.success, capability_ids)
    return out
