"""Benchmark: what bubblewrap costs a generator call (issue #33), side by side with the same child run without it.

`run_generator` starts the sandbox child inside bubblewrap; "without" replaces only the command line (the same
interpreter, flags, runner, limits and job folder, minus bwrap), so the difference is bwrap's own setup: namespaces,
mounts, the probe is cached. Timed: one call for one seed (what the harness and training do per uncached seed), one
call for 64 seeds (what a manifest does), and the synthesis of one generated environment at params.yaml's
defaults (`synthesis.harness` checks on a fresh GeneratedEnv of the prompt's example module, then its train and eval
manifests). Calls alternate between the two ways. Root only for "without": the child switches to uid 65534 itself (after importing what it needs).

    flock /tmp/trace-heavy.lock .venv/bin/python bench/sandbox.py              # 10 single calls each, 3 syntheses each
    flock /tmp/trace-heavy.lock .venv/bin/python bench/sandbox.py --calls 20 --no-synthesis
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10, help="single-seed calls per way")
    ap.add_argument("--no-synthesis", action="store_true", help="skip the synthesis-at-defaults timing")
    ap.add_argument("--syntheses", type=int, default=3,
                    help="synthesis timings per way, alternating (one pair is noise: 1.28x once with tests running "
                         "beside it, three pairs 1.08x alone)")
    args = ap.parse_args()

    from trace_core.synthesis import sandbox
    from trace_core.synthesis.generated import EXAMPLE_MODULE

    isolated = sandbox._isolated_command

    # Without bwrap the child (root here) becomes uid 65534 outside any namespace, where it may not read the
    # interpreter's files (pyenv under /root): everything it imports is imported before it runs, as the runner
    # did before bubblewrap.
    preload = sorted(sandbox.ALLOWED_MODULES | {"collections.abc", "importlib", "linecache", "resource", "traceback"})
    start_child = (f"import runpy, sys; {'; '.join(f'import {m}' for m in preload)}; sys.argv = sys.argv[1:]; "
                   "runpy.run_path(sys.argv[0], run_name='__main__')")

    def plain(work: str) -> list[str]:
        return [sandbox._interpreter_paths()[0], "-S", "-s", "-B", "-c", start_child, sandbox.__file__, work]

    ways = {"bwrap": isolated, "no bwrap": plain}
    sandbox.require_isolation()  # the once-per-process probe is not part of a call
    sandbox.retail_db_json()
    times: dict[str, dict[str, list[float]]] = {w: {"1 seed": [], "64 seeds": []} for w in ways}
    outputs: dict[str, list[str]] = {w: [] for w in ways}  # every result, serialised: must not depend on the way
    for i in range(args.calls):
        for way, command in ways.items():
            sandbox._isolated_command = command
            start = time.perf_counter()
            result = sandbox.run_generator(EXAMPLE_MODULE, [i], 1)
            times[way]["1 seed"].append(time.perf_counter() - start)
            outputs[way].append(json.dumps(result, sort_keys=True))
    for _ in range(3):
        for way, command in ways.items():
            sandbox._isolated_command = command
            start = time.perf_counter()
            result = sandbox.run_generator(EXAMPLE_MODULE, list(range(64)), 1)
            times[way]["64 seeds"].append(time.perf_counter() - start)
            outputs[way].append(json.dumps(result, sort_keys=True))
    if not args.no_synthesis:
        for _ in range(args.syntheses):
            for way, command in ways.items():
                sandbox._isolated_command = command
                times[way].setdefault("synthesis", []).append(synthesis_seconds(EXAMPLE_MODULE))
    sandbox._isolated_command = isolated
    print(f"{'':22s}" + "".join(f"{w:>14s}" for w in ways) + f"{'ratio':>10s}")
    for what in times["bwrap"]:
        med = {w: statistics.median(times[w][what]) for w in ways}
        label = f"{what} (median of {len(times['bwrap'][what])})"
        print(f"{label:22s}" + "".join(f"{med[w]:13.3f}s" for w in ways) + f"{med['bwrap'] / med['no bwrap']:9.2f}x")
    same = outputs["bwrap"] == outputs["no bwrap"]
    print(f"instances identical with and without bwrap: {same} ({len(outputs['bwrap'])} calls, "
          f"{sum(map(len, outputs['bwrap']))} characters)")
    if not same:
        raise SystemExit("bwrap changed a generator's output: the sandbox must not")


def synthesis_seconds(source: str) -> float:
    """One generated environment's synthesis at the defaults: the harness on a fresh env, then the manifests."""
    from trace_core.config import load_params
    from trace_core.synthesis.generated import GeneratedEnv
    from trace_core.synthesis.harness import validate
    from trace_core.synthesis.stage import _manifest, harness_config

    params = load_params(ROOT / "params.yaml")
    cfg = params.synthesis
    start = time.perf_counter()
    env = GeneratedEnv(source, "bench", difficulty=cfg.difficulty, profile=params.env.profile)
    report = validate(env, harness_config(params))
    assert report.passed, report.failures()
    _manifest(env, range(cfg.train_instances))
    _manifest(env, range(cfg.train_instances, cfg.train_instances + cfg.eval_instances))
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
