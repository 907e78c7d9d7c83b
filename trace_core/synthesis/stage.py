"""Stage `synthesis`: for each capability, choose or generate its environment, validate it, write its folder.

    artifacts/synthesis/<capability_id>/spec.json          EnvSpec (status ready | rejected | unmapped | not_selected)
    artifacts/synthesis/<capability_id>/validation.json    the conformance report (and calibration, when enabled)
    artifacts/synthesis/<capability_id>/validation.html    the same as an HTML section
    artifacts/synthesis/<capability_id>/train_manifest.jsonl, eval_manifest.jsonl   seed, instance id, content hash
    artifacts/synthesis/<capability_id>/generator.py       the module, for LLM-generated environments
    artifacts/synthesis/<capability_id>/calibration/<position>.jsonl   the base agent's calibration trajectories
    artifacts/resume/synthesis/<capability_id>/calibration/   the same while they are played (with run_key.txt: a
                                                            killed run resumes from them; trace_core.runs.resume_dir)

How a capability finds its environment: params `synthesis.templates` (explicit), a template of the same name, the
template whose keywords its name and definition match best (share ≥ match_threshold), or — with an endpoint
configured — the LLM generation agent. Anything else is reported as unmapped, never skipped silently.
"""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
from pathlib import Path

from trace_core.config import Params
from trace_core.jsonl import jsonl_text
from trace_core.runs import RUN_KEY, claim, resume_dir
from trace_core.schemas import Capability, CapabilityDictionary, EnvSpec
from trace_core.synthesis.contract import SyntheticEnv, label
from trace_core.synthesis.harness import HarnessConfig, ValidationReport, validate
from trace_core.synthesis.templates import templates_for


class SynthesisError(RuntimeError):
    pass


def load_dictionary(analysis_dir: str | Path) -> CapabilityDictionary:
    path = Path(analysis_dir) / "capabilities.json"
    if not path.exists():
        raise SynthesisError(f"{path} not found: run the analysis stage first (`dvc repro analysis`)")
    return CapabilityDictionary.model_validate_json(path.read_text())


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower().replace("_", " ")))


def match_template(capability: Capability, params: Params) -> tuple[str | None, str | None, float | None]:
    """(template, how, score) for a capability, or (None, None, best score) when nothing matches."""
    cid = capability.capability_id
    explicit = params.synthesis.templates
    registry = templates_for(params.env.domain)
    # params' mapping names retail templates: on ToolSandbox it applies only where it names one of its templates
    if cid in explicit and (params.env.domain != "toolsandbox" or explicit[cid] in registry):
        if explicit[cid] not in registry:
            raise SynthesisError(f"synthesis.templates maps {cid} to unknown template {explicit[cid]!r}; "
                                 f"templates: {', '.join(sorted(registry))}")
        return explicit[cid], "params", None
    if cid in registry:
        return cid, "id", None
    same = sorted(name for name, cls in registry.items() if cls.capability == cid)
    if same:
        return same[0], "id", None
    words = _words(f"{capability.name} {capability.definition}")
    # A keyword matches a word of the text when one starts with the other ("verify" ~ "verifying").
    def score(keywords: tuple[str, ...]) -> float:
        hits = sum(any(w.startswith(k) or k.startswith(w) for w in words if len(w) > 3) for k in keywords)
        return hits / max(1, len(keywords))

    scored = sorted(((score(cls.keywords), name) for name, cls in registry.items()), key=lambda x: (-x[0], x[1]))
    best_score, best = scored[0]
    if best_score >= params.synthesis.match_threshold:
        return best, "definition", round(best_score, 3)
    return None, None, round(best_score, 3)


def harness_config(params: Params) -> HarnessConfig:
    h = params.synthesis.harness
    return HarnessConfig(seeds=h.seeds, reference_seeds=h.reference_seeds, probe_seeds=h.probe_seeds,
                         min_distinct=h.min_distinct, max_probe_reward=h.max_probe_reward,
                         max_probe_success=h.max_probe_success, train_instances=params.synthesis.train_instances,
                         eval_instances=params.synthesis.eval_instances, spot_seeds=h.spot_seeds,
                         spot_seed=params.seed)


def _manifest(env: SyntheticEnv, seeds: range) -> str:
    if hasattr(env, "prefetch"):  # a generated module: one sandbox process for all seeds
        env.prefetch(list(seeds))
    lines = []
    for seed in seeds:
        inst = env.reset(seed)
        lines.append(json.dumps({"seed": seed, "instance_id": inst.instance_id, "content_hash": inst.content_hash()}))
    return jsonl_text(lines)


def _source_hash(env: SyntheticEnv) -> str:
    import inspect

    files = sorted({inspect.getsourcefile(cls) for cls in type(env).__mro__ if cls.__module__.startswith("trace_core.synthesis")})
    digest = hashlib.sha256()
    for f in files:
        digest.update(Path(f).read_bytes())
    if getattr(env, "source", None):  # a generated module: its own text is part of what the spec pins
        digest.update(env.source.encode())
    return digest.hexdigest()[:16]


CALIBRATION_DIR = "calibration"


def _calibrate(params: Params, env: SyntheticEnv, capability_id: str, policy_factory, folder: Path,
               progress: bool = False):
    import sys

    from trace_core.synthesis.calibration import calibrate
    from trace_core.synthesis.templates import make

    published = folder / CALIBRATION_DIR
    keep = _claim_calibration(resume_dir(folder) / CALIBRATION_DIR, params, env, policy_factory, published)
    cfg, rollout = calibration_rollout(params, policy_factory, keep, progress)
    c = params.synthesis.calibration
    # One line per position, bars or not: calibration is the long part of this stage (minutes per position on a CPU).
    print(f"calibration {capability_id}: {c.seeds} seeds x {c.samples} samples per position, from "
          f"{label(params.synthesis.difficulty)}", file=sys.stderr, flush=True)
    result = calibrate(lambda d, s, b: make(env.template, capability_id, d, params.env.profile, scaffold=s, blend=b),
                       params.synthesis.difficulty, rollout, cfg, on_try=position_reporter(capability_id),
                       describe=rollout.describe)
    # The finished trajectories into the environment's folder (DVC-tracked); the resume copy stays for a re-run.
    shutil.rmtree(published, ignore_errors=True)
    if keep is not None:
        shutil.copytree(keep, published)
    return result


def calibration_rollout(params: Params, policy_factory, keep_dir: Path | None = None, progress: bool = False):
    """(CalibrationConfig, PolicyRollout) as `synthesis.calibration` sets them: the base agent from
    `policy_factory`, its trajectories appended under `keep_dir` (None: not kept)."""
    from trace_core.agents.policy import Sampling
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.settings import scripted_user_factory
    from trace_core.synthesis.calibration import CalibrationConfig, PolicyRollout

    c = params.synthesis.calibration
    cfg = CalibrationConfig(seeds=c.seeds, samples=c.samples, low=c.low, high=c.high, min_std=c.min_std,
                            max_all_success=c.max_all_success, max_all_zero=c.max_all_zero,
                            min_informative=c.min_informative, max_adjustments=c.max_adjustments)
    sampling = Sampling(temperature=c.temperature, top_p=params.policy.top_p,
                        max_new_tokens=params.policy.max_new_tokens, seed=params.seed)
    limits = EpisodeLimits(max_steps=params.env.max_steps, max_errors=params.env.max_errors)
    rollout = PolicyRollout(policy_factory(), sampling, limits, make_user=scripted_user_factory(params),
                            batch_size=params.policy.batch_size, progress=progress, keep_dir=keep_dir,
                            hint_fraction=c.hint_fraction)
    return cfg, rollout


def position_reporter(capability_id: str):
    """An `on_try` that prints one line per position: verdict, figures, how the rollouts ended, seconds taken."""
    import sys
    import time

    from trace_core.synthesis.calibration import summary

    since = time.monotonic()

    def report(t: dict) -> None:
        nonlocal since
        elapsed, since = time.monotonic() - since, time.monotonic()
        print(f"calibration {capability_id} {label(t['difficulty'], t['scaffold'], t['blend'])}: {t['verdict']} (mean reward "
              f"{t['mean_reward']:.2f}, success {t['success_rate']:.2f}, informative groups {t['informative']:.0%}; "
              f"{summary(t['outcomes'], t['rollouts'])}; {elapsed:.0f} s)", file=sys.stderr, flush=True)

    return report


def _claim_calibration(folder: Path, params: Params, env: SyntheticEnv, policy_factory,
                       published: Path | None = None) -> Path | None:
    """`folder` emptied of trajectories played under other settings, or None (nothing kept) when the policy has no
    `fingerprint` to tell its weights apart. The key covers what a calibration rollout depends on. A `published`
    copy played under the same settings (an earlier run's, e.g. restored by DVC) seeds a folder that lacks them."""
    fingerprint = getattr(policy_factory, "fingerprint", None)
    if fingerprint is None:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    key = hashlib.sha256(json.dumps({
        "policy": fingerprint,
        "environment": _source_hash(env),
        "calibration": params.synthesis.calibration.model_dump(),
        "sampling": params.policy.model_dump(include={"top_p", "max_new_tokens", "max_context", "batch_size"}),
        "dtype": params.model.dtype,
        "env": params.env.model_dump(),
        "user": params.user.model_dump(),
        "seed": params.seed,
    }, sort_keys=True, default=str).encode()).hexdigest()[:16]
    def stamped(path: Path | None) -> bool:
        return path is not None and (path / RUN_KEY).exists() and (path / RUN_KEY).read_text().strip() == key

    if not stamped(folder) and stamped(published):
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(published, folder)
    claim(folder, key)
    return folder


def _report_html(spec: EnvSpec, report: ValidationReport | None) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(c.name)}</td><td>{'pass' if c.passed else 'FAIL'}</td><td>{e(c.detail)}</td></tr>"
        for c in (report.checks if report else [])
    )
    cal = ""
    if report and report.calibration:
        cal = "<h4>calibration</h4><pre>" + e(json.dumps(report.calibration, indent=1)) + "</pre>"
    return (
        f"<section><h3>{e(spec.capability_id)} — {e(spec.status)}</h3><p>{e(spec.reason)}</p>"
        f"<p>source: {e(str(spec.source))} {e(str(spec.template))} (matched by {e(str(spec.matched_by))}), "
        f"difficulty {spec.difficulty}{' (blend with the next)' if spec.blend else ''}, scaffold {spec.scaffold}, "
        f"spec {e(spec.spec_hash)}</p>"
        f"<table border=1 cellpadding=4><tr><th>check</th><th>result</th><th>detail</th></tr>{rows}</table>{cal}</section>\n"
    )


def synthesize(capability: Capability, params: Params, out: Path, policy_factory=None, progress: bool = False) -> EnvSpec:
    """Build, validate and write one capability's environment folder; return its spec."""
    from trace_core.synthesis.templates import make

    cfg = params.synthesis
    folder = out / capability.capability_id
    folder.mkdir(parents=True, exist_ok=True)
    # The folder persists between runs (calibration trajectories resume); everything else is remade here.
    for stale in folder.iterdir():
        if stale.is_file():
            stale.unlink()
        elif stale.name == CALIBRATION_DIR and not (cfg.calibration.enabled and capability.selected):
            shutil.rmtree(stale)
    base = {"capability_id": capability.capability_id, "domain": params.env.domain, "profile": params.env.profile}
    if not capability.selected:
        spec = EnvSpec(**base, status="not_selected", reason="analysis did not select this capability")
        return _write(folder, spec.with_hash(), None)

    template, how, score = match_template(capability, params)
    if template is None:
        env, how, source, rejected = _generated(capability, params, folder)
        if env is None and rejected:
            spec = EnvSpec(**base, status="rejected", source="generated", matched_by="generated", match_score=score,
                           reason=rejected)
            return _write(folder, spec.with_hash(), None)
        if env is None:
            spec = EnvSpec(**base, status="unmapped", match_score=score,
                           reason=f"no template matches (best keyword share {score}) and no generator endpoint is "
                           "configured: map it in synthesis.templates or set synthesis.generator.base_url")
            return _write(folder, spec.with_hash(), None)
    else:
        env, source = make(template, capability.capability_id, cfg.difficulty, params.env.profile), "template"

    report = validate(env, harness_config(params), progress=progress)
    difficulty, scaffold, blend, calibrated = env.difficulty, 0, False, None
    if report.passed and cfg.calibration.enabled and source == "template":
        if policy_factory is None:
            raise SynthesisError("calibration is enabled but no policy was given")
        difficulty, scaffold, blend, calibrated, tried = _calibrate(params, env, capability.capability_id,
                                                                    policy_factory, folder, progress)
        if (difficulty, scaffold, blend) != (env.difficulty, 0, False):
            # The harness vouches for the environment that will be trained on, not only for the starting one.
            env = make(template, capability.capability_id, difficulty, params.env.profile, scaffold=scaffold,
                       blend=blend)
            report = validate(env, harness_config(params), progress=progress)
        report = report.model_copy(update={"calibration": tried})
    first_inst = env.reset(0)
    spec = EnvSpec(
        **base,
        status="ready" if report.passed else "rejected",
        reason=_reason(report, calibrated, cfg.calibration.enabled, source, difficulty, scaffold, blend),
        source=source,
        template=env.template,
        matched_by=how,
        match_score=score,
        difficulty=difficulty,
        blend=blend,
        scaffold=scaffold,
        tools=sorted(t["function"]["name"] for t in env.tool_schemas(first_inst)),
        train_seeds=[0, cfg.train_instances],
        eval_seeds=[cfg.train_instances, cfg.eval_instances],
        calibrated=calibrated,
        calibration=_positions(report.calibration or [], type(env)),
        source_hash=_source_hash(env),
    ).with_hash()
    if report.passed:
        (folder / "train_manifest.jsonl").write_text(_manifest(env, range(cfg.train_instances)))
        (folder / "eval_manifest.jsonl").write_text(
            _manifest(env, range(cfg.train_instances, cfg.train_instances + cfg.eval_instances))
        )
    return _write(folder, spec, report)


POSITION_FIGURES = ("verdict", "mean_reward", "success_rate", "informative", "all_success", "all_zero", "reward_std",
                    "rollouts")


def _positions(tried: list[dict], env_class) -> list[dict]:
    """The spec's record of each position calibration tried: label, verdict and figures (`POSITION_FIGURES`),
    and what a template's own rung removes (`SyntheticEnv.rungs`)."""
    out = []
    for t in tried:
        record = {"position": label(t["difficulty"], t["scaffold"], t.get("blend", False)),
                  **{k: t[k] for k in POSITION_FIGURES if k in t}}
        if t["scaffold"] in getattr(env_class, "rungs", {}):
            record["rung"] = env_class.rungs[t["scaffold"]]
        out.append(record)
    return out


def _reason(report, calibrated: bool | None, enabled: bool, source: str, difficulty: int, scaffold: int = 0,
            blend: bool = False) -> str:
    """Why the spec has its status, including whether the base agent's success was checked against the band."""
    from trace_core.synthesis.contract import label

    where = label(difficulty, scaffold, blend)
    if not report.passed:
        failed = "; ".join(report.failures())
        return f"the environment calibration chose ({where}) failed the conformance harness: {failed}" if (
            report.calibration) else failed
    if calibrated is None:
        why = ("synthesis.calibration.enabled is false" if not enabled
               else "calibration runs on templates only" if source != "template" else "calibration did not run")
        return f"passed the conformance harness; base-agent success not calibrated ({why})"
    if calibrated:
        return f"passed the conformance harness; base agent in the calibration band at {where}"
    from trace_core.synthesis.calibration import summary

    tried = ", ".join(f"{label(t['difficulty'], t['scaffold'], t.get('blend', False))} {t['verdict']} ({'; '.join(t['reasons']) or '-'}"
                      + (f"; rollouts ended: {summary(t['outcomes'], t['rollouts'])}" if t.get("outcomes") else "")
                      + (f"; then passed over {', '.join(t['skipped'])}: the same instances"
                         if t.get("skipped") and not t.get("stopped") else "") + ")"
                      for t in report.calibration)
    return (f"passed the conformance harness; base agent outside the calibration band at every position tried "
            f"({len(report.calibration)} of at most 1 + synthesis.calibration.max_adjustments), kept {where} "
            f"(closest to the band): {tried}" + (f"; stopped: {report.calibration[-1]['stopped']}"
                                                  if report.calibration[-1].get("stopped") else ""))


REJECTION_CHARS = 3000  # of the last attempt's problems in the spec's reason (generation.json keeps them all)


def _generated(capability: Capability, params: Params, folder: Path):
    """(env, how, source, None) for the LLM generation agent's environment; (None, None, None, reason) when every
    module it wrote was rejected; (None, None, None, None) when no endpoint is configured."""
    import os

    g = params.synthesis.generator
    base_url = os.environ.get("TRACE_SYNTHESIS_BASE_URL") or g.base_url
    if not base_url:
        return None, None, None, None
    from trace_core.synthesis.generated import GenerationAgent
    from trace_core.synthesis.sandbox import require_isolation

    require_isolation()  # before the first request: modules that cannot run are not worth writing

    agent = GenerationAgent(base_url, g.model, api_key=os.environ.get(g.api_key_env) if g.api_key_env else None,
                            max_attempts=g.max_attempts, temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                            seed=params.seed, difficulty=params.synthesis.difficulty, profile=params.env.profile,
                            timeout_s=g.timeout_s)
    hc = harness_config(params)
    result = agent.generate_env(capability, capability.excerpts, lambda env: validate(env, hc).failures())
    (folder / "generation.json").write_text(json.dumps(_plain(result), indent=2, default=str))
    if not result.ok:
        last = result.reports[-1]
        problems = "; ".join(last.problems) or "no problem was reported"
        if len(problems) > REJECTION_CHARS:
            problems = problems[:REJECTION_CHARS] + " ..."
        return None, None, None, (
            f"the generation agent at {base_url} wrote a module in each of {result.attempts} attempts and every one "
            f"was rejected (all reports in generation.json); the last at the {last.stage} stage: {problems}"
        )
    (folder / "generator.py").write_text(result.source)
    from trace_core.synthesis.generated import GeneratedEnv

    env = GeneratedEnv(result.source, capability.capability_id, difficulty=params.synthesis.difficulty,
                       profile=params.env.profile)
    return env, "generated", "generated", None


def _plain(obj):
    return obj.model_dump() if hasattr(obj, "model_dump") else getattr(obj, "__dict__", str(obj))


def _write(folder: Path, spec: EnvSpec, report: ValidationReport | None) -> EnvSpec:
    for stale in ("train_manifest.jsonl", "eval_manifest.jsonl", "validation.json"):
        if report is None or not report.passed or stale == "validation.json":
            (folder / stale).unlink(missing_ok=True)
    if report is not None:
        (folder / "validation.json").write_text(report.model_dump_json(indent=2) + "\n")
    (folder / "validation.html").write_text(_report_html(spec, report))
    (folder / "spec.json").write_text(spec.model_dump_json(indent=2) + "\n")
    return spec


def run(params: Params, out_dir: Path | None = None, capability: str | None = None, progress: bool = True,
        policy_factory=None) -> dict:
    """Synthesize `capability` (or every capability in synthesis.capabilities plus every selected one)."""
    from trace_core.synthesis.templates._base import SEED

    for name, value in (("baseline.seed", params.baseline.seed), ("bootstrap.seed", params.bootstrap.seed)):
        if value == SEED:
            raise SynthesisError(f"{name}={value} is the seed synthetic instances are drawn from; pick another")
    d = load_dictionary(params.analysis.out_dir)
    out = Path(out_dir or params.synthesis.out_dir)
    known = {c.capability_id: c for c in d.capabilities if not c.control}
    if capability is not None:
        wanted = [capability]
    else:
        wanted = list(dict.fromkeys([*params.synthesis.capabilities, *d.selected]))
    if policy_factory is None and params.synthesis.calibration.enabled:
        policy_factory = BaseAgentFactory(params)
    specs = {}
    for cid in wanted:
        cap = known.get(cid) or _absent(cid)
        specs[cid] = synthesize(cap, params, out, policy_factory, progress)
    metrics = {
        "ready": sum(s.status == "ready" for s in specs.values()),
        "rejected": sum(s.status == "rejected" for s in specs.values()),
        "unmapped": sum(s.status == "unmapped" for s in specs.values()),
        "per_capability": {cid: {"status": s.status, "difficulty": s.difficulty} for cid, s in specs.items()},
    }
    if capability is None:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def _absent(cid: str) -> Capability:
    from trace_core.schemas import CapabilityStats

    zero = CapabilityStats(runs=0, runs_passed=0, runs_required=0, coverage_mean=0, coverage_std=0, delta_mean=0,
                           delta_std=0, er_minus_mean=0, er_plus_mean=0, coverage_ci=(0, 0), delta_ci=(0, 0),
                           lacking_failed=0, present_failed=0, lacking_passed=0, present_passed=0)
    return Capability(capability_id=cid, name=cid, definition="", labeller="programmatic", selected=False, stats=zero)


class BaseAgentFactory:
    """Makes the base agent's policy (bootstrap output, or the model as configured); `fingerprint` identifies its
    weights (or endpoint and model name), so that calibration trajectories are reused only for the same agent."""

    def __init__(self, params: Params):
        self.params = params

    def __call__(self):
        from trace_core.agents.factories import make_policy
        from trace_core.bootstrap import agent_model_path

        p = self.params.model_copy(deep=True)
        if p.policy.backend == "local":
            p.model.path = agent_model_path(self.params)
        return make_policy(p)

    @property
    def fingerprint(self) -> str:
        from trace_core.agents.model import weights_hash
        from trace_core.bootstrap import agent_model_path

        p = self.params.policy
        if p.backend != "local":
            return f"{p.backend}|{p.base_url}|{p.model}"
        path = Path(agent_model_path(self.params))
        return weights_hash(path) if path.is_dir() else str(path)
