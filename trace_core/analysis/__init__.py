"""Stage 1 — analysis: turn the base agent's pass/fail trajectories into a capability dictionary.

Labellers (programmatic detectors over reference actions, an LLM analyst on an OpenAI-compatible endpoint, and
MiniLM embedding contrast) label every (trajectory, capability) NA / PRESENT / LACKING; `stats` applies
docs/method.md §1 (ER−, ER+, Δ, coverage, K of N runs) with bootstrap CIs; `stage.run` writes capabilities.json,
labels.parquet and report.html. `analyse` does the same in memory, on trajectories and instances given as lists.
"""

from __future__ import annotations


def run(params, out_dir=None, baseline_dir=None):
    """Stage entry point (see `trace_core.analysis.stage.run`)."""
    from trace_core.analysis.stage import run as _run

    return _run(params, out_dir, baseline_dir)


def analyse(params, trajectories, instances, source="the instances"):
    """The analysis in memory: (CapabilityDictionary, label rows, items); see `trace_core.analysis.stage.analyse`."""
    from trace_core.analysis.stage import analyse as _analyse

    return _analyse(params, trajectories, instances, source)
