"""Benchmark: batched vs one-at-a-time generation on the same episodes.

Runs the same greedy episodes twice through the rollout engine — once with `--batch` episodes generated together,
once one at a time — and prints tokens/s and episodes/min side by side with their ratio. Tokens are generated
tokens over the run's wall time. The policy's own clock splits each run into prompt prefill and decode steps; the
decode-only ratio is printed too, since batching speeds up decode steps and can hardly speed up prefill, which is
already compute-bound at batch 1 on CPU (measured: same prefill tokens/s either way).

    .venv/bin/python bench/rollouts.py                      # base agent if bootstrapped, else raw SmolLM2
    .venv/bin/python bench/rollouts.py --episodes 16 --batch 16 --model PATH
    .venv/bin/python bench/rollouts.py --stock-cache   # + batched without each of: in-place KV growth, row KV reuse,
                                                       #   per-group prompt prefixes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_decode(policy: Any, prompts: list[list[int]], new_tokens: int = 32) -> dict[str, float]:
    """End-to-end tokens/s (prefill included) for one batch of `prompts` (token ids), `new_tokens` each with no
    early stop: HF `model.generate` vs our loop without and with prompt-prefix sharing (cold prefix cache).
    For measurement only; the decode-loop figures in trace_core/agents/local.py came from this."""
    import torch

    from trace_core.agents.policy import Sampling

    model, tok = policy.model, policy.tokenizer
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), policy.pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p) :] = torch.tensor(p)
        mask[r, L - len(p) :] = 1
    res: dict[str, float] = {}
    with torch.inference_mode():
        t = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        res["generate_tok_s"] = B * new_tokens / (time.perf_counter() - t)
    saved = (policy.stop_ids, policy.share_prefix, policy.prefix_cache)
    policy.stop_ids = set()  # no early stop: equal work
    try:
        for key, share in (("loop_tok_s", False), ("loop_shared_prefix_tok_s", True)):
            policy.share_prefix = share
            policy.prefix_cache = False
            policy.clear_prefix_cache()
            t = time.perf_counter()
            # greedy, as generate(do_sample=False)
            greedy = Sampling(temperature=0.0, top_p=1.0, max_new_tokens=new_tokens, seed=0)
            policy._decode_batch(prompts, greedy, list(range(B)))
            res[key] = B * new_tokens / (time.perf_counter() - t)
    finally:
        policy.stop_ids, policy.share_prefix, policy.prefix_cache = saved
        policy.clear_prefix_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--episodes", type=int, default=16, help="episodes per run (same instances in both runs)")
    ap.add_argument("--batch", type=int, default=16, help="batch size of the batched run")
    ap.add_argument("--model", default=None, help="model path (default: bootstrap output, else params model)")
    ap.add_argument("--max-steps", type=int, default=4, help="assistant turns per episode (keeps the bench short)")
    ap.add_argument("--stock-cache", action="store_true",
                    help="also run the batched episodes with transformers' concatenating KV cache, without per-row KV "
                         "reuse, and with only the prefix common to the whole batch shared")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from trace_core.agents.local import LocalPolicy
    from trace_core.agents.policy import Sampling
    from trace_core.agents.rollout import RolloutStats, run_episodes
    from trace_core.baseline import make_user, target_instances
    from trace_core.bootstrap import agent_model_path
    from trace_core.config import load_params
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.tau2_env import Tau2Environment

    params = load_params(args.params)
    model = args.model
    if model is None:
        model = agent_model_path(params, fallback=True)
    instances = target_instances(params)[: args.episodes]
    env = Tau2Environment(params.env.domain, params.env.profile)
    sampling = Sampling(temperature=0.0, top_p=params.policy.top_p, max_new_tokens=params.policy.max_new_tokens,
                        seed=params.seed)
    limits = EpisodeLimits(max_steps=args.max_steps, max_errors=params.env.max_errors)
    policy = LocalPolicy(model, dtype=params.model.dtype, threads=params.model.threads, batch_size=args.batch,
                         max_context=params.policy.max_context)
    # Warm up once so that neither run pays for lazy initialisation.
    run_episodes(env, instances[:1], policy, make_user(params), sampling, limits, trials=1, batch_size=1,
                 progress=False)

    rows = []
    runs = [("one-at-a-time", 1, True, True, True), (f"batched ({args.batch})", args.batch, True, True, True)]
    if args.stock_cache:
        runs += [("batched, cat KV", args.batch, False, True, True),
                 ("batched, no row KV", args.batch, True, False, True),
                 ("batched, 1 prefix", args.batch, True, True, False)]
    for label, bs, grow, row_kv, branches in runs:
        policy.grow_in_place = grow  # False: transformers' DynamicCache, which concatenates at every token
        policy.row_cache = row_kv  # False: each batched turn re-prefills everything past the shared prefix
        policy.branch_prefixes = branches  # False: groups of prompts do not share their longer common prefixes
        policy.clear_prefix_cache()
        policy.timing = {"prefill_s": 0.0, "decode_s": 0.0}
        stats = RolloutStats()
        trajs = run_episodes(env, instances, policy, make_user(params), sampling, limits, trials=1, batch_size=bs,
                             progress=False, stats=stats)
        rows.append((label, stats, sum(t.success for t in trajs), dict(policy.timing)))
    print(f"model: {model}\nepisodes: {len(instances)}  max_steps: {args.max_steps}  threads: {params.model.threads}\n")
    print(f"{'run':<20}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'episodes/min':>14}{'successes':>11}"
          f"{'prefill s':>11}{'decode s':>10}{'decode tok/s':>14}")
    for label, s, ok, t in rows:
        decode_tps = s.generated_tokens / max(t["decode_s"], 1e-9)
        print(f"{label:<20}{s.generated_tokens:>8}{s.seconds:>9.1f}{s.tokens_per_s:>10.1f}{s.episodes_per_min:>14.2f}"
              f"{ok:>11}{t['prefill_s']:>11.1f}{t['decode_s']:>10.1f}{decode_tps:>14.1f}")
    (_, one, _, t1), (_, many, _, tb) = rows[0], rows[1]
    decode_ratio = (many.generated_tokens / max(tb["decode_s"], 1e-9)) / max(
        one.generated_tokens / max(t1["decode_s"], 1e-9), 1e-9)
    print(f"\nbatched / one-at-a-time: tokens/s x{many.tokens_per_s / max(one.tokens_per_s, 1e-9):.2f}, "
          f"episodes/min x{many.episodes_per_min / max(one.episodes_per_min, 1e-9):.2f}; decode steps only: "
          f"tokens/s x{decode_ratio:.2f}")
    if args.stock_cache:
        cat, no_rows, flat = rows[2][1], rows[3][1], rows[4][1]
        print(f"batched, growing KV cache / concatenating KV cache: tokens/s "
              f"x{many.tokens_per_s / max(cat.tokens_per_s, 1e-9):.2f}")
        print(f"batched, row KV reuse / none: tokens/s x{many.tokens_per_s / max(no_rows.tokens_per_s, 1e-9):.2f}")
        print(f"batched, per-group prefixes / one batch-wide prefix: tokens/s "
              f"x{many.tokens_per_s / max(flat.tokens_per_s, 1e-9):.2f}")


if __name__ == "__main__":
    main()
