"""Benchmark: training the routing gate (trace_core/routing/gate.py) at params.yaml's sizes, which issue #30 bounds
at 2 minutes on 2 cores.

Stand-ins for the training openings of one pipeline run, the same count and kind of text: per capability of
`synthesis.capabilities`, `evaluation.router.gate.per_capability` openings of a synthesis template's train seeds
(`trace_core.synthesis.templates`, matched as synthesis matches them); `--baseline` procedural openings of
`tasks.families` at `baseline.seed` with made-up labels (the baseline's labelled openings; 120 = the embedded
default's 24 x 5 trajectories); `evaluation.router.gate.distractors` distractors. Times the MiniLM embedding, the
fit (the settings' cross-validated grid, the refit, its cross-validated temperature), and the whole; prints the
seconds. Labels are arbitrary for the baseline part, so only the time means anything.

    flock /tmp/trace-heavy.lock .venv/bin/python bench/gate.py
    .venv/bin/python bench/gate.py --baseline 240 -S evaluation.router.gate.per_capability=128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--baseline", type=int, default=120, help="baseline openings (labelled trajectories)")
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="params override key=value (YAML)")
    args = ap.parse_args(argv)

    import yaml

    from trace_core.config import load_params

    params = load_params(args.params, {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.overrides)})
    import torch

    if params.model.threads:
        torch.set_num_threads(params.model.threads)
    from trace_core.analysis.embedding import _load_encoder, embed_texts
    from trace_core.envs.procedural import generate_set
    from trace_core.routing.gate import distractor_examples, embedding_id, example_of, fit_gate
    from trace_core.routing.router import _truncate, task_text
    from trace_core.schemas import Capability, CapabilityStats
    from trace_core.synthesis.stage import match_template
    from trace_core.synthesis.templates import make

    cfg, caps = params.evaluation.router.gate, params.synthesis.capabilities
    stats = CapabilityStats(runs=1, runs_passed=1, runs_required=1, coverage_mean=0, coverage_std=0, delta_mean=0,
                            delta_std=0, er_minus_mean=0, er_plus_mean=0, coverage_ci=(0, 0), delta_ci=(0, 0),
                            lacking_failed=0, present_failed=0, lacking_passed=0, present_passed=0)
    examples = []
    for cid in caps:
        cap = Capability(capability_id=cid, name=cid.replace("_", " "), definition=cid.replace("_", " "),
                         labeller="programmatic", selected=True, stats=stats)
        template, _, _ = match_template(cap, params)
        env = make(template, cid, params.synthesis.difficulty, params.env.profile)
        for seed in range(cfg.per_capability):
            inst = env.reset(seed)
            examples.append(example_of(inst, task_text(inst), cid, "synthetic"))
    per_family = -(-args.baseline // len(params.tasks.families))
    for n, inst in enumerate(generate_set(params.tasks.families, params.baseline.seed, per_family,
                                          params.tasks.difficulty)[: args.baseline]):
        examples.append(example_of(inst, task_text(inst), [None, *caps][n % (len(caps) + 1)], "baseline"))
    examples += distractor_examples(params.seed, cfg.distractors)
    _load_encoder()  # loaded once per process; timed apart
    cut = params.evaluation.router.max_task_chars

    def embed(texts):
        return embed_texts([_truncate(t, cut) for t in texts])

    start = time.perf_counter()
    embed([e.text for e in examples])
    embedded = time.perf_counter() - start
    vectors = {}

    def cached(texts):
        todo = [t for t in texts if t not in vectors]
        for t, v in zip(todo, embed(todo)):
            vectors[t] = v
        import numpy as np

        return np.stack([vectors[t] for t in texts])

    held_out = generate_set(params.tasks.families, params.evaluation.seed, params.evaluation.instances_per_family,
                            params.tasks.difficulty)
    cached([e.text for e in examples])
    start = time.perf_counter()
    record = fit_gate(examples, cached, list(caps), cfg, params.seed, held_out, embedding_id())
    fitted = time.perf_counter() - start
    print(f"{len(examples)} openings ({len(caps)} capabilities x {cfg.per_capability}, {args.baseline} baseline, "
          f"{cfg.distractors} distractors), torch threads {torch.get_num_threads()}")
    grid = len(cfg.synthetic_weights) * len(cfg.inverse_regularizations)
    print(f"embedding: {embedded:.1f} s; {grid}-point grid x {cfg.folds}-fold CV + fit + temperature: {fitted:.1f} s; "
          f"total {embedded + fitted:.1f} s (temperature {record.temperature:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
