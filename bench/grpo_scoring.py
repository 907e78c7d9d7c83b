"""Benchmark: one GRPO step's loss scoring, TRL's padded rows vs the trainer's unpadded rows vs whole groups with
their shared prompt computed once, side by side.

TRL pads a step's sequences to the longest prompt and the longest completion and scores each micro-batch at that
width through its fused log-prob head; the trainer (`trace_core.training.logprobs`) scores each row at its own length
with a plain head over its completion positions (`completion_logps`), or, with `training.group_scoring`, one group per
micro-batch with the group's common prompt computed once (`group_logps`). This times all three on the same
step-shaped batch, forward + backward per micro-batch (`training.micro_batch_size` rows for the first two, one group
of `training.num_generations` rows for the third), with the real trainer (`build_trainer`: the base agent, the LoRA of
params.yaml `training:`, bf16 autocast where the CPU multiplies bf16 natively): `--episodes` random-token episodes in
groups of num_generations that share a prompt, prompt and completion lengths spread over the given ranges, plus
`--fillers` one-token stand-ins (constant-reward groups). It prints seconds, tokens scored and the ratios. Tokens are
random, so only the time means anything.

    .venv/bin/python bench/grpo_scoring.py                                  # 2 groups of 8 + 8 fillers, defaults
    .venv/bin/python bench/grpo_scoring.py --episodes 16 --fillers 0 --prompt 1400 1700 --completion 200 400
    .venv/bin/python bench/grpo_scoring.py --skip-trl                       # the two unpadded layouts only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def padded_batch(tokenizer, vocab: int, episodes: int, fillers: int, prompt: tuple[int, int],
                 completion: tuple[int, int], seed: int, group: int = 1):
    """input_ids and attention_mask as TRL builds them: prompts left-padded, completions right-padded; each run of
    `group` consecutive episodes shares one prompt (a GRPO group: one instance, several samples)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))
    rows = []
    for k in range(episodes):
        if k % group == 0:
            shared = torch.randint(0, vocab, (draw(*prompt),), generator=g)
        rows.append((shared, torch.randint(0, vocab, (draw(*completion),), generator=g)))
    one = torch.randint(0, vocab, (1,), generator=g)
    rows += [(one, one)] * fillers
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width_p + width_c), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(rows):
        ids[r, width_p - len(p) : width_p + len(c)] = torch.cat([p, c])
        mask[r, width_p - len(p) : width_p + len(c)] = 1
    return ids, mask, width_c


def time_scoring(method, trainer, ids, mask, width_c: int, micro: int) -> float:
    trainer.model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    for start in range(0, ids.shape[0], micro):
        rows = slice(start, start + micro)
        logps, _, _ = method(trainer.model, ids[rows], mask[rows], width_c, compute_entropy=True)
        (logps * mask[rows, -width_c:]).sum().backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default=str(ROOT / "params.yaml"))
    parser.add_argument("--model", default=None, help="model path (default: the base agent, or the raw model)")
    parser.add_argument("--episodes", type=int, default=16,
                        help="informative episodes in the step, a multiple of training.num_generations (default 16)")
    parser.add_argument("--fillers", type=int, default=8, help="one-token filler stand-ins (default 8)")
    parser.add_argument("--prompt", type=int, nargs=2, default=(1400, 1700), metavar=("MIN", "MAX"),
                        help="prompt tokens per episode (default 1400 1700: system, tools, opening)")
    parser.add_argument("--completion", type=int, nargs=2, default=(230, 400), metavar=("MIN", "MAX"),
                        help="completion tokens per episode (default 230 400, the default run's range)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-trl", action="store_true", help="leave out TRL's padded scoring (the slowest)")
    args = parser.parse_args()

    import torch
    from trl import GRPOTrainer

    from trace_core.agents.model import load_model, load_tokenizer
    from trace_core.bootstrap import agent_model_path
    from trace_core.config import load_params
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.settings import scripted_user_factory
    from trace_core.synthesis.templates.tool_call_precision import ToolCallPrecision
    from trace_core.training import build_trainer
    from trace_core.training.settings import GRPOSettings

    params = load_params(args.params)
    settings = GRPOSettings.from_params(params)
    G = settings.num_generations
    if args.episodes % G:
        parser.error(f"--episodes {args.episodes} must be a multiple of training.num_generations={G}")
    if not settings.scores_groups:
        parser.error("training.group_scoring is off (or gradient_checkpointing is on) in --params; the third "
                     "layout needs it")
    path = args.model or agent_model_path(params, fallback=True)
    torch.manual_seed(args.seed)
    model = load_model(path, dtype="float32", threads=params.model.threads)
    tokenizer = load_tokenizer(path)
    with tempfile.TemporaryDirectory() as tmp:
        limits = EpisodeLimits(max_steps=1, max_errors=params.env.max_errors)
        env = ToolCallPrecision(None, difficulty=1, profile=params.env.profile)
        trainer, _ = build_trainer(env, model, tokenizer, settings, tmp, "bench",
                                   train_seeds=range(4), limits=limits, make_user=scripted_user_factory(params),
                                   max_context=params.policy.max_context)
    trainer.model.train()
    ids, mask, width_c = padded_batch(tokenizer, model.config.vocab_size, args.episodes, args.fillers,
                                      tuple(args.prompt), tuple(args.completion), args.seed, group=G)
    micro = settings.micro_batch_size
    trl = lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k)
    ours = trainer._get_per_token_logps_and_entropies  # per row below two rows a batch, else grouped
    warm = padded_batch(tokenizer, model.config.vocab_size, 2, 0, (64, 64), (16, 16), args.seed, group=2)
    for method, m in ((trl, 1), (ours, 1), (ours, 2)):  # warm-up, not timed
        time_scoring(method, trainer, *warm, m)
    print(f"model {path}; {args.episodes} episodes in groups of {G} + {args.fillers} fillers, width "
          f"{ids.shape[1]} tokens, forward + backward", flush=True)
    times = {}
    if not args.skip_trl:
        times["trl"] = time_scoring(trl, trainer, ids, mask, width_c, micro)
        print(f"TRL padded rows, micro-batch {micro}    : {times['trl']:7.1f} s  ({ids.numel():,} token positions)",
              flush=True)
    times["rows"] = time_scoring(ours, trainer, ids, mask, width_c, 1)
    print(f"unpadded rows, one at a time   : {times['rows']:7.1f} s  ({int(mask.sum()):,} token positions)",
          flush=True)
    prompt_width = ids.shape[1] - width_c
    grouped = int(mask.sum()) - sum(int(mask[r, :prompt_width].sum()) - 1
                                    for r in range(args.episodes) if r % G)  # later rows reuse the first's prompt
    times["groups"] = time_scoring(ours, trainer, ids, mask, width_c, G)
    print(f"groups of {G}, prompt computed once : {times['groups']:7.1f} s  ({grouped:,} token positions)",
          flush=True)
    if "trl" in times:
        print(f"speed-up over TRL: unpadded rows x{times['trl'] / times['rows']:.2f}, "
              f"groups x{times['trl'] / times['groups']:.2f}")
    print(f"speed-up of groups over unpadded rows: x{times['rows'] / times['groups']:.2f}")


if __name__ == "__main__":
    main()
