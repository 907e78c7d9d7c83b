"""Calibration of a synthetic environment against the base agent (docs/method.md §2): roll the agent out on `seeds`
seeds x `samples` samples, and require mean reward and success rate in [low, high], reward std ≥ min_std, at most
`max_all_success` / `max_all_zero` of groups constant at 1 / 0, and ≥ `min_informative` groups not constant.
Too easy moves the difficulty knob up, too hard moves it down, at most `max_adjustments` times. Below difficulty 0
the knob goes on into scaffolds (`SyntheticEnv.scaffold`: 1, 2, ... of the reference's look-ups prefilled), so an
agent that fails even the easiest instances still gets an environment with reward signal, on the same tools.
When adjacent difficulties bracket the band (one too easy, the next too hard), their blend (half the seeds at each)
is the last position tried. A position whose instances equal the current one's on every calibration seed (a
scaffold level with nothing left to prefill) is passed over without a rollout. Polarized and flat verdicts (constant
groups of both kinds: per-seed outcomes barely depend on sampling) move the knob only while the mean lies outside
[low, high], toward it; inside, no difficulty would make groups informative."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from trace_core.synthesis.contract import SyntheticEnv, label


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration band and sizes: params.yaml `synthesis.calibration` (required; the stage passes them)."""

    seeds: int
    samples: int
    low: float
    high: float
    min_std: float
    max_all_success: float
    max_all_zero: float
    min_informative: float
    max_adjustments: int
    seed_offset: int = 1_000_000  # calibration seeds are disjoint from the train/eval manifests' seeds


def group_statistics(groups: list[list[float]]) -> dict[str, float]:
    """Statistics of reward groups (one list of sample rewards per seed)."""
    rewards = [r for g in groups for r in g]
    n = max(1, len(rewards))
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5
    g = max(1, len(groups))
    return {
        "mean_reward": round(mean, 6),
        "success_rate": round(sum(r >= 1.0 - 1e-9 for r in rewards) / n, 6),
        "reward_std": round(std, 6),
        "all_success": round(sum(all(r >= 1.0 - 1e-9 for r in grp) for grp in groups) / g, 6),
        "all_zero": round(sum(all(r <= 1e-9 for r in grp) for grp in groups) / g, 6),
        "informative": round(sum(max(grp) - min(grp) > 1e-9 for grp in groups if grp) / g, 6),
    }


def verdict(stats: dict[str, float], cfg: CalibrationConfig) -> tuple[str, list[str]]:
    """("ok" | "too_easy" | "too_hard" | "polarized" | "flat", reasons). Polarized: signs of both (e.g. many
    all-success and many all-zero groups) — moving the difficulty would not help; flat: too little variance."""
    easy, hard = [], []
    for key in ("mean_reward", "success_rate"):
        if stats[key] > cfg.high:
            easy.append(f"{key} {stats[key]:.2f} > {cfg.high}")
        if stats[key] < cfg.low:
            hard.append(f"{key} {stats[key]:.2f} < {cfg.low}")
    if stats["all_success"] > cfg.max_all_success:
        easy.append(f"all-success groups {stats['all_success']:.0%} > {cfg.max_all_success:.0%}")
    if stats["all_zero"] > cfg.max_all_zero:
        hard.append(f"all-zero groups {stats['all_zero']:.0%} > {cfg.max_all_zero:.0%}")
    flat = []
    if stats["reward_std"] < cfg.min_std:
        flat.append(f"reward std {stats['reward_std']:.3f} < {cfg.min_std}")
    if stats["informative"] < cfg.min_informative:
        flat.append(f"informative groups {stats['informative']:.0%} < {cfg.min_informative:.0%}")
    if easy and hard:
        return "polarized", easy + hard + flat
    if easy:
        return "too_easy", easy + flat
    if hard:
        return "too_hard", hard + flat
    if flat:
        return "flat", flat
    return "ok", []


def ladder(max_difficulty: int, max_scaffold: int) -> list[tuple[int, int]]:
    """The knob's positions, easiest first: (0, max_scaffold) ... (0, 1), then (0, 0) ... (max_difficulty, 0)."""
    return [(0, s) for s in range(max_scaffold, 0, -1)] + [(d, 0) for d in range(max_difficulty + 1)]


def _step(outcome: str, stats: dict[str, float], cfg: CalibrationConfig) -> int:
    if outcome == "too_easy":
        return 1
    if outcome == "too_hard":
        return -1
    # polarized / flat: only the mean can still be moved into the band
    return 1 if stats["mean_reward"] > cfg.high else -1 if stats["mean_reward"] < cfg.low else 0


def _said(record: dict[str, Any], cfg: CalibrationConfig) -> str:
    """A verdict as the reason to move the knob: "too easy", or "polarized, mean above the band"."""
    if record["verdict"] in ("too_easy", "too_hard"):
        return record["verdict"].replace("_", " ")
    side = "above" if record["mean_reward"] > cfg.high else "below"
    return f"{record['verdict']}, mean {side} the band"


def _measure(position: tuple[int, int, bool], env: SyntheticEnv, seeds: list[int], rollout, cfg: CalibrationConfig,
             describe=None) -> dict[str, Any]:
    """The record of one position: its coordinates, verdict and reasons, rollouts, group statistics, `describe`'s."""
    stats = group_statistics(rollout(env, seeds, cfg.samples))
    outcome, reasons = verdict(stats, cfg)
    difficulty, scaffold, blend = position
    return {"difficulty": difficulty, "scaffold": scaffold, "blend": blend, "verdict": outcome, "reasons": reasons,
            "rollouts": len(seeds) * cfg.samples, **stats, **(describe(env) if describe else {})}


class Calibration(NamedTuple):
    """Where calibration left the knob, whether that position is in the band, and one record per position tried."""

    difficulty: int
    scaffold: int
    blend: bool
    calibrated: bool
    tried: list[dict[str, Any]]


def calibrate(
    make_env: Callable[[int, int, bool], SyntheticEnv],
    start_difficulty: int,
    rollout: Callable[[SyntheticEnv, list[int], int], list[list[float]]],
    cfg: CalibrationConfig,
    on_try: Callable[[dict[str, Any]], None] | None = None,
    describe: Callable[[SyntheticEnv], dict[str, Any]] | None = None,
) -> Calibration:
    """Try knob positions from (`start_difficulty`, scaffold 0), one step per verdict along `ladder`, until one is
    in the band or the ladder or `max_adjustments` runs out. When two adjacent difficulties bracket the band (the
    lower too easy, the upper too hard) and an attempt is left, their blend is tried last (`SyntheticEnv.blend`:
    half the seeds at each). `make_env(difficulty, scaffold, blend)` builds the environment; `rollout(env, seeds,
    samples)` returns one reward group per seed; `describe(env)` adds fields to the record of the position just
    rolled out (e.g. how its failures ended); `on_try` sees each record as it is made."""
    probe = make_env(start_difficulty, 0, False)
    steps = ladder(probe.max_difficulty, probe.max_scaffold)
    at = steps.index((start_difficulty, 0))
    tried: list[dict[str, Any]] = []
    seeds = [cfg.seed_offset + i for i in range(cfg.seeds)]

    def play(difficulty: int, scaffold: int, blend: bool = False) -> dict[str, Any]:
        start = (difficulty, scaffold, blend) == (start_difficulty, 0, False)
        env = probe if start else make_env(difficulty, scaffold, blend)
        record = _measure((difficulty, scaffold, blend), env, seeds, rollout, cfg, describe)
        tried.append(record)
        if on_try is not None:
            on_try(record)
        return record

    made: dict[tuple[int, int], list[Any]] = {}

    def instances(position: tuple[int, int]) -> list[Any]:
        # What the agent would see at a position on the calibration seeds (the id names the position; ignore it).
        if position not in made:
            env = probe if position == (start_difficulty, 0) else make_env(*position, False)
            made[position] = [env.reset(s).model_dump(exclude={"instance_id"}) for s in seeds]
        return made[position]

    # Why the search ended (the spec's reason quotes it), on the last record.
    for _ in range(cfg.max_adjustments + 1):
        difficulty, scaffold = steps[at]
        record = play(difficulty, scaffold)
        if record["verdict"] == "ok":
            return Calibration(difficulty, scaffold, False, True, tried)
        step = _step(record["verdict"], record, cfg)
        nxt = at + step
        # A position that makes the same instances as this one (e.g. a scaffold level with no look-up left to
        # prefill) would replay it: pass over it at no cost and say so.
        skipped = []
        while step and 0 <= nxt < len(steps) and instances(steps[nxt]) == instances(steps[at]):
            skipped.append(label(*steps[nxt]))
            nxt += step
        here = label(difficulty, scaffold)
        if skipped:
            record["skipped"] = skipped
        if nxt == at:
            stopped = f"{record['verdict']} at {here}: a verdict that points the knob neither way"
        elif nxt < 0:
            stopped = f"no easier position than {here}" + (" (the template has no scaffolds)"
                                                          if probe.max_scaffold == 0 else " (the ladder's bottom)")
        elif nxt >= len(steps):
            stopped = f"no harder position than {here} (the template's hardest difficulty)"
        elif twin := next((pos for pos in ((t["difficulty"], t["scaffold"]) for t in tried)
                           if pos == steps[nxt] or instances(pos) == instances(steps[nxt])), None):
            stopped = f"the next position, {label(*steps[nxt])}, " + (
                "was tried already" if twin == steps[nxt] else f"makes the same instances as {label(*twin)}, tried already")
        else:
            at = nxt
            continue
        break
    else:
        stopped = f"synthesis.calibration.max_adjustments={cfg.max_adjustments} reached"
    if skipped:
        stopped += f"; {', '.join(skipped)} passed over: the same instances as {here} on every calibration seed"
    tried[-1]["stopped"] = stopped
    if len(tried) <= cfg.max_adjustments:
        moves = {t["difficulty"]: _step(t["verdict"], t, cfg) for t in tried if t["scaffold"] == 0}
        bracket = [d for d in sorted(moves) if moves[d] == 1 and moves.get(d + 1) == -1]
        if bracket:
            record = play(bracket[0], 0, True)
            if record["verdict"] == "ok":
                return Calibration(bracket[0], 0, True, True, tried)
            said = {t["difficulty"]: _said(t, cfg) for t in tried if t["scaffold"] == 0 and not t["blend"]}
            record["stopped"] = (f"{stopped}; then the blend of d{bracket[0]} ({said[bracket[0]]}) and "
                                 f"d{bracket[0] + 1} ({said[bracket[0] + 1]}) was tried last")
    # Out of room: keep the position tried closest to the band's middle.
    middle = (cfg.low + cfg.high) / 2
    best = min(tried, key=lambda t: (abs(t["mean_reward"] - middle), -t["informative"]))
    return Calibration(best["difficulty"], best["scaffold"], best["blend"], False, tried)


def measure_positions(make_env: Callable[[int, int, bool], SyntheticEnv], positions: list[tuple[int, int, bool]],
                      rollout: Callable[[SyntheticEnv, list[int], int], list[list[float]]], cfg: CalibrationConfig,
                      describe: Callable[[SyntheticEnv], dict[str, Any]] | None = None,
                      on_try: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Calibration's record (figures, verdict, `describe`'s fields) for each of `positions` as given, without
    walking the ladder: to measure chosen rungs (e.g. a template's new lowest ones) on the calibration seeds."""
    seeds = [cfg.seed_offset + i for i in range(cfg.seeds)]
    out = []
    for position in positions:
        record = _measure(position, make_env(*position), seeds, rollout, cfg, describe)
        out.append(record)
        if on_try is not None:
            on_try(record)
    return out


def outcomes(instances, trajectories, writes: frozenset[str]) -> dict[str, Any]:
    """Why the rollouts of one position ended as they did: each rollout's first failure (`kinds`, counts), how
    episodes terminated, how many had malformed tool calls, and which argument of a write was wrong when a write
    matched no reference write (`wrong_arguments`: argument name -> count; `tool:<name>` for a write tool the
    reference does not call). `instances` are those the trajectories were played on."""
    from collections import Counter

    from trace_core.synthesis.contract import FINISHED, agent_calls

    by_id = {i.instance_id: i for i in instances}
    kinds: Counter[str] = Counter()
    ended: Counter[str] = Counter()
    wrong: Counter[str] = Counter()
    malformed = 0
    for t in trajectories:
        inst = by_id[t.instance_id]
        ended[t.termination_reason] += 1
        calls = [c for c, _ in agent_calls(t.messages)]
        malformed += any(c.parse_error for c in calls)
        ref_writes = [a for a in inst.reference_actions if a.name in writes]
        made = [c for c in calls if c.name in writes and not c.parse_error]
        stray = [c for c in made if not any(a.name == c.name and a.arguments == c.arguments for a in ref_writes)]
        for c in stray:
            same = [a for a in ref_writes if a.name == c.name]
            if not same:
                wrong[f"tool:{c.name}"] += 1
                continue
            # the reference write it is closest to: fewest differing arguments
            diff = min(({k for k in a.arguments.keys() | c.arguments.keys() if a.arguments.get(k) != c.arguments.get(k)}
                        for a in same), key=len)
            wrong.update(sorted(diff))
        if t.reward >= 1.0 - 1e-9:
            kind = "solved"
        elif not calls:
            kind = "no_tool_call"
        elif inst.must_refuse:
            kind = "wrote_on_refusal" if made else "missed_checks" if t.reward <= 1e-9 else "partial_checks"
        elif not made:
            kind = "no_write"
        elif stray:
            kind = "wrong_write"
        elif {(c.name, repr(sorted(c.arguments.items()))) for c in made} != {
                (a.name, repr(sorted(a.arguments.items()))) for a in ref_writes}:
            kind = "missing_writes"
        elif t.termination_reason not in FINISHED:
            kind = f"not_finished:{t.termination_reason}"
        else:
            kind = "writes_right_end_wrong"  # e.g. facts not communicated, or the state differs elsewhere
        kinds[kind] += 1
    return {
        "kinds": dict(kinds.most_common()),
        "termination": dict(ended.most_common()),
        "malformed_call_episodes": malformed,
        "wrong_arguments": dict(wrong.most_common()),
    }


def summary(outcome: dict[str, Any], rollouts: int) -> str:
    """One line: the commonest ways the rollouts of a position ended ("wrong_write 60% (new_item_ids 18), ...")."""
    parts = []
    for kind, n in list(outcome.get("kinds", {}).items())[:3]:
        text = f"{kind} {n / max(1, rollouts):.0%}"
        if kind == "wrong_write" and outcome.get("wrong_arguments"):
            args = ", ".join(f"{k} {v}" for k, v in list(outcome["wrong_arguments"].items())[:3])
            text += f" (wrong: {args})"
        parts.append(text)
    return ", ".join(parts)


class PolicyRollout:
    """A `rollout` for `calibrate` that runs the agent with the rollout engine (`make_user`'s user, `samples` trials).

    `hint_fraction` of each group's samples see the environment's hint (`SyntheticEnv.hint`), as training's groups
    will (`training.hint_fraction`). With `keep_dir`, each position's trajectories are appended to
    `keep_dir/<label>.jsonl` (`<label>.hinted.jsonl`) as they finish: a killed run resumes there without replaying
    them (the caller keeps the folder tied to its settings). `describe(env)` says how the rollouts of the position
    just played ended (`outcomes`) and, with hints, how the hinted ones did."""

    def __init__(self, policy, sampling, limits, *, make_user, batch_size: int, hint_fraction: float,
                 progress: bool = False, keep_dir=None):
        self.policy, self.sampling, self.limits, self.make_user = policy, sampling, limits, make_user
        self.batch_size, self.progress, self.keep_dir = batch_size, progress, keep_dir
        self.hint_fraction = hint_fraction
        self._last: dict[tuple[int, int], Any] = {}

    def __call__(self, env: SyntheticEnv, seeds: list[int], samples: int) -> list[list[float]]:
        from dataclasses import replace

        from trace_core.agents.rollout import run_episodes
        from trace_core.envs.base import Hinted
        from trace_core.synthesis.contract import label

        instances = [env.reset(s) for s in seeds]
        n_hint = round(self.hint_fraction * samples)
        name = label(env.difficulty, env.scaffold, env.blend)

        def play(target, trials: int, suffix: str, sampling) -> list:
            if trials == 0:
                return []
            out_path = None
            if self.keep_dir is not None:
                self.keep_dir.mkdir(parents=True, exist_ok=True)
                out_path = self.keep_dir / f"{name}{suffix}.jsonl"
            return run_episodes(target, instances, self.policy, self.make_user, sampling, self.limits, trials=trials,
                                batch_size=self.batch_size, out_path=out_path, progress=self.progress)

        plain = play(env, samples - n_hint, "", self.sampling)
        hinted = play(Hinted(env, env.hint), n_hint, ".hinted", replace(self.sampling, seed=self.sampling.seed + 1))
        self._last[(env.difficulty, env.scaffold, env.blend)] = (instances, plain, hinted)
        groups: dict[str, list[float]] = {}
        for t in plain + hinted:
            groups.setdefault(t.instance_id, []).append(t.reward)
        return [groups.get(i.instance_id, []) for i in instances]

    def describe(self, env: SyntheticEnv) -> dict[str, Any]:
        from trace_core.envs.targets import write_tools

        instances, plain, hinted = self._last.pop((env.difficulty, env.scaffold, env.blend))
        out: dict[str, Any] = {"outcomes": outcomes(instances, plain + hinted, write_tools(env.domain))}
        if hinted:
            mean = lambda ts: round(sum(t.reward for t in ts) / max(1, len(ts)), 6)  # noqa: E731
            out["hinted"] = {"rollouts": len(hinted), "mean_reward": mean(hinted), "unhinted_mean_reward": mean(plain)}
        return out
