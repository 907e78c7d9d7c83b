"""Stage 2 — synthesis: one synthetic training environment per selected capability (docs/method.md §2).

`contract` defines SyntheticEnv (the target's tools and state, a seeded generator, a partial-credit reward R_c);
`templates/` holds one generator per file; `generated` and `sandbox` turn LLM-written generator modules into
environments without trusting them; `harness` is the conformance check every environment passes before training;
`stage.run` writes one folder per capability under artifacts/synthesis/.
"""

from __future__ import annotations


def run(params, out_dir=None, **kwargs):
    """Stage entry point (see `trace_core.synthesis.stage.run`)."""
    from trace_core.synthesis.stage import run as _run

    return _run(params, out_dir, **kwargs)
