"""Benchmark: peak memory and time of the GRPO loss pass per micro-batch size (`training.micro_batch_size`).

One optimiser step's loss work is a forward and backward pass over every trained sequence; TRL splits the step's
sequences into micro-batches of `micro_batch_size`. This measures that pass alone, as the trainer runs it: the
model in float32 with the LoRA adapter of params.yaml `training:` (PEFT), TRL's fused log-prob head, bf16
autocast where the CPU multiplies bf16 natively, and `--sequences` random token sequences of `--length` tokens
(episode-sized; `--completion` of them scored). Each micro-batch size runs in its own fresh process, so each peak
RSS is that configuration's own; the table puts them side by side with ratios to the first.

    .venv/bin/python bench/loss_memory.py                          # micro-batch 4 vs 1, 4 sequences of 3,000 tokens
    .venv/bin/python bench/loss_memory.py --sizes 4 2 1 --length 2000 --model PATH
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(args: argparse.Namespace, micro_batch: int) -> dict:
    """Run in a fresh process: one loss pass over the sequences in micro-batches; seconds and peak RSS."""
    import torch
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from trace_core.agents.model import cpu_has_fast_bf16, load_model
    from trace_core.config import load_params
    from trace_core.training.settings import GRPOSettings
    from trace_core.training.trainer import lora_config

    params = load_params(args.params)
    settings = GRPOSettings.from_params(params)
    torch.manual_seed(0)
    model = load_model(args.model, dtype="float32", threads=params.model.threads)
    add_fused_lm_head(model, temperature=settings.temperature, outputs=("log_probs", "entropy"))
    model = get_peft_model(model, lora_config(settings))
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.sequences, args.length))
    labels = ids.clone()
    labels[:, : args.length - args.completion] = -100  # the prompt is not scored, as in TRL
    autocast = cpu_has_fast_bf16()
    # Warm-up on a short sequence, so that one-off kernel set-up is not timed.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids[:1, :32], labels=ids[:1, :32], fused_lm_head=True)
    out.log_probs.sum().backward()
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    for start in range(0, args.sequences, micro_batch):
        chunk = slice(start, start + micro_batch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids[chunk], attention_mask=torch.ones_like(ids[chunk]), labels=labels[chunk],
                        fused_lm_head=True)
        (-(out.log_probs.sum()) / labels.ne(-100).sum()).backward()
    seconds = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"micro_batch": micro_batch, "seconds": seconds, "peak_gb": peak_kb / 1024**2, "bf16": autocast}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--model", default=None, help="model folder (default: bootstrap output, else params model)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 1], help="micro-batch sizes to compare")
    ap.add_argument("--sequences", type=int, default=4, help="sequences in the step (each size must divide it)")
    ap.add_argument("--length", type=int, default=3000, help="tokens per sequence")
    ap.add_argument("--completion", type=int, default=2000, help="scored tokens at the end of each sequence")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.model is None:
        from trace_core.bootstrap import agent_model_path
        from trace_core.config import load_params

        args.model = agent_model_path(load_params(args.params), fallback=True)
    if args.child is not None:
        print(json.dumps(measure(args, args.child)))
        return
    for size in args.sizes:
        if size < 1 or args.sequences % size:
            ap.error(f"micro-batch size {size} must divide --sequences {args.sequences}")
    if not 0 < args.completion <= args.length:
        ap.error(f"--completion {args.completion} must be in 1..--length ({args.length})")

    rows = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--child", str(size), "--params", args.params, "--model", args.model,
               "--sequences", str(args.sequences), "--length", str(args.length), "--completion", str(args.completion)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            rows.append({"micro_batch": size, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"\nloss pass over {args.sequences} sequences of {args.length} tokens ({args.completion} scored), "
          f"model {args.model}")
    print(f"{'micro_batch':>11} | {'seconds':>8} | {'peak GB':>8} | {'time ratio':>10} | {'memory ratio':>12}")
    first = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" in r:
            print(f"{r['micro_batch']:>11} | failed: {r['error']}")
            continue
        print(f"{r['micro_batch']:>11} | {r['seconds']:>8.1f} | {r['peak_gb']:>8.2f} | "
              f"{r['seconds'] / first['seconds']:>10.2f} | {r['peak_gb'] / first['peak_gb']:>12.2f}")


if __name__ == "__main__":
    main()
