"""Benchmark: one GRPO step's loss scoring, TRL's padded rows vs the trainer's unpadded rows, side by side.

TRL pads a step's sequences to the longest prompt and the longest completion and scores each micro-batch at that
width through its fused log-prob head; the trainer (`trace_core.training.logprobs`) scores each row at its own length
with a plain head over its completion positions. This times both on the same step-shaped batch, forward + backward per
micro-batch of `training.micro_batch_size` rows, with the real trainer (`build_trainer`: the base agent, the LoRA of
params.yaml `training:`, bf16 autocast where the CPU multiplies bf16 natively): `--episodes` random-token episodes
with prompt and completion lengths spread over the given ranges, plus `--fillers` one-token stand-ins (constant-reward
groups), and prints seconds, tokens scored and the ratio. Tokens are random, so only the time means anything.

    .venv/bin/python bench/grpo_scoring.py                                  # 8 episodes + 8 fillers, defaults
    .venv/bin/python bench/grpo_scoring.py --episodes 16 --fillers 0 --prompt 1400 1700 --completion 200 400
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
                 completion: tuple[int, int], seed: int):
    """input_ids and attention_mask as TRL builds them: prompts left-padded, completions right-padded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [(int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g)),
                int(torch.randint(completion[0], completion[1] + 1, (1,), generator=g))) for _ in range(episodes)]
    lengths += [(1, 1)] * fillers
    width_p = max(p for p, _ in lengths)
    width_c = max(c for _, c in lengths)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(lengths), width_p + width_c), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, (p, c) in enumerate(lengths):
        ids[r, width_p - p : width_p + c] = torch.randint(0, vocab, (p + c,), generator=g)
        mask[r, width_p - p : width_p + c] = 1
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
    parser.add_argument("--episodes", type=int, default=8, help="informative episodes in the step (default 8)")
    parser.add_argument("--fillers", type=int, default=8, help="one-token filler stand-ins (default 8)")
    parser.add_argument("--prompt", type=int, nargs=2, default=(1400, 1700), metavar=("MIN", "MAX"),
                        help="prompt tokens per episode (default 1400 1700: system, tools, opening)")
    parser.add_argument("--completion", type=int, nargs=2, default=(230, 400), metavar=("MIN", "MAX"),
                        help="completion tokens per episode (default 230 400, the default run's range)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from trl import GRPOTrainer

    from trace_core.agents.model import load_model, load_tokenizer
    from trace_core.bootstrap import agent_model_path
    from trace_core.config import load_params
    from trace_core.envs.base import EpisodeLimits
    from trace_core.synthesis.templates.tool_call_precision import ToolCallPrecision
    from trace_core.training import build_trainer
    from trace_core.training.settings import GRPOSettings

    params = load_params(args.params)
    settings = GRPOSettings.from_params(params)
    path = args.model or agent_model_path(params, fallback=True)
    torch.manual_seed(args.seed)
    model = load_model(path, dtype="float32", threads=params.model.threads)
    tokenizer = load_tokenizer(path)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, _ = build_trainer(ToolCallPrecision(difficulty=1), model, tokenizer, settings, tmp, "bench",
                                   train_seeds=range(4), limits=EpisodeLimits(max_steps=1))
    trainer.model.train()
    ids, mask, width_c = padded_batch(tokenizer, model.config.vocab_size, args.episodes, args.fillers,
                                      tuple(args.prompt), tuple(args.completion), args.seed)
    micro = settings.micro_batch_size
    trl = lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k)
    ours = trainer._get_per_token_logps_and_entropies
    warm = padded_batch(tokenizer, model.config.vocab_size, 1, 0, (32, 32), (16, 16), args.seed)
    for method in (trl, ours):  # warm-up, not timed
        time_scoring(method, trainer, *warm, 1)
    print(f"model {path}; {args.episodes} episodes + {args.fillers} fillers, width {ids.shape[1]} tokens, "
          f"micro-batch {micro}, forward + backward", flush=True)
    t_trl = time_scoring(trl, trainer, ids, mask, width_c, micro)
    print(f"TRL padded rows  : {t_trl:7.1f} s  ({ids.numel():,} token positions)", flush=True)
    t_ours = time_scoring(ours, trainer, ids, mask, width_c, micro)
    print(f"unpadded rows    : {t_ours:7.1f} s  ({int(mask.sum()):,} token positions)", flush=True)
    print(f"speed-up x{t_trl / t_ours:.2f}")


if __name__ == "__main__":
    main()
