"""Stage `bootstrap`: the tool-use warm-start that turns the raw model into the base agent.

A 135M model emits no correct tool calls zero-shot, so the embedded default first gets a short supervised LoRA
(TRL's SFTTrainer, loss on the assistant's own tokens) on reference dialogues — oracle replays of generic
procedural families, from seeds disjoint from every evaluation seed — and the LoRA is merged into the weights.
The families are deliberately few: the base agent must keep real deficits for TRACE to find. Capable models skip
the stage (`bootstrap.enabled: false`).

Outputs (in `bootstrap.out_dir`): `model/` (merged weights + tokenizer), `manifest.json` (exactly which
instances were used, data and weight hashes, the run key), `metrics.json` (loss curve summary, timings).

Re-runs: the run key hashes what the merged weights depend on (the source weights, the tokenized dialogues, the
section's training settings, the seed, the model's dtype and threads, and whether bf16 autocast is used on this
CPU). When the outputs on disk (kept by DVC: `persist: true`) were made under the same key and the merged weights
still hash as recorded, the stage reuses them instead of training again: a change to a parameter the warm-start
does not read (e.g. `env.domain: toolsandbox`, whose dialogues stay τ² retail ones) costs the data
preparation, not the SFT.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from pathlib import Path

from trace_core.config import Params
from trace_core.runs import read_json, run_key, write_json_atomic


def agent_model_path(params: Params, fallback: bool = False) -> str:
    """Where the base agent's weights are: the bootstrap output when enabled, else the provisioned model.
    `fallback`: a missing bootstrap output gives the provisioned model instead of an error (benchmarks)."""
    from trace_core.agents.model import provision_model

    if params.bootstrap.enabled:
        path = Path(params.bootstrap.out_dir) / "model"
        if not (path / "config.json").exists() and fallback:
            return str(provision_model(params.model.path, params.model.cache_dir))
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no model yet: run the bootstrap stage first (`dvc repro bootstrap`)")
        return str(path)
    return str(provision_model(params.model.path, params.model.cache_dir))


def warmstart_instances(params: Params):
    """The warm-start instances: `num_dialogues` split evenly over `bootstrap.families`, seed `bootstrap.seed`."""
    from trace_core.envs.procedural import generate_set

    cfg = params.bootstrap
    per_family = math.ceil(cfg.num_dialogues / max(1, len(cfg.families)))
    return generate_set(cfg.families, cfg.seed, per_family, cfg.difficulty)[: cfg.num_dialogues]


def reference_dialogues(params: Params):
    """(instance, messages, tools) for every warm-start instance, from oracle replays that scored 1.0."""
    from trace_core.envs.oracle import replay_reference
    from trace_core.envs.tau2_env import Tau2Environment
    from trace_core.envs.users import ScriptedUser

    # The warm-start dialogues are procedural τ² retail ones; on another target (ToolSandbox) they still teach the
    # tool-call format, on retail's own tools.
    domain = params.env.domain if params.env.domain != "toolsandbox" else "retail"
    env = Tau2Environment(domain, params.env.profile)
    out = []
    for inst in warmstart_instances(params):
        ep = replay_reference(env, inst, ScriptedUser(max_turns=params.user.max_turns))
        if ep.score().reward < 1.0:
            raise RuntimeError(f"reference replay of {inst.instance_id} does not score 1.0; the generator is broken")
        out.append((inst, ep.messages, ep.tools))
    return out


def tokenize_dialogue(tokenizer, messages, tools, max_length: int):
    """Token ids of the whole dialogue and labels that keep only the assistant's own tokens (the rest -100).

    Each assistant turn's tokens are found by rendering the conversation up to the turn with a generation
    prompt and again including the turn: the difference is exactly what the model must produce."""
    from trace_core.agents.chat import render_conversation, render_prompt

    ids: list[int] = []
    labels: list[int] = []
    for i, m in enumerate(messages):
        if m.role != "assistant":
            continue
        prompt = render_prompt(tokenizer, messages[:i], tools)
        full = render_conversation(tokenizer, messages[: i + 1], tools)
        if not full.startswith(prompt):
            raise ValueError("the chat template does not render an assistant turn as a suffix of its prompt")
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        turn_ids = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
        new_context = prompt_ids[len(ids):] if prompt_ids[: len(ids)] == ids else None
        if new_context is None:  # tokenisation across the boundary differs; fall back to re-basing
            ids, labels = list(prompt_ids), [-100] * len(prompt_ids)
        else:
            ids += new_context
            labels += [-100] * len(new_context)
        ids += turn_ids
        labels += turn_ids
    return ids[:max_length], labels[:max_length]


def lr_factor(step: int, total_steps: int, warmup_ratio: float) -> float:
    """The warm-start's LR multiplier at optimiser step `step` (from 0): a linear rise over the first
    max(1, floor(warmup_ratio x total_steps)) steps, times a linear fall from 1 to 0 over all steps."""
    warmup = max(1, int(total_steps * warmup_ratio))
    return min(1.0, (step + 1) / warmup) * max(0.0, 1 - step / total_steps)


def training_order(n: int, batch_size: int, epochs: int, seed: int) -> list[int]:
    """Example indices in training order: per epoch a shuffle, cut into batches whose order is shuffled too.
    Consecutive runs of `batch_size` form the optimiser steps (a batch short of `batch_size`, when `n` is not a
    multiple of it, regroups with the next epoch's first examples)."""
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
        rng.shuffle(batches)
        out += [i for batch in batches for i in batch]
    return out


def sft_lora(model, tokenizer, examples, cfg, seed: int, bf16: bool, work_dir: Path, progress: bool = True):
    """Train a LoRA on `examples` ((ids, labels) pairs, -100 on every token but the assistant's) with TRL's
    SFTTrainer; return (the PEFT model, the loss of every optimiser step).

    The objective is the token mean of the next-token cross-entropy over each batch's assistant tokens: the data
    are passed pre-tokenized with their labels, which SFTTrainer uses as they are, its fused LM head projects only
    the labelled positions onto the vocabulary, and with gradient accumulation the loss is divided by the batch's
    labelled-token count. The order is `training_order` (sequential sampler) and the LR follows `lr_factor`.

    It replaced a hand-written loop with the same objective (up to commit fe19151: one sequence per forward pass,
    losses weighted by their share of the batch's assistant tokens). Measured 2026-12-06 on 2 shared Sapphire Rapids
    cores, bf16 autocast, 12 dialogues = 3 steps of 4, same order: step losses 0.717, 0.440, 0.345 (loop) vs 0.7173,
    0.4396, 0.3456 (SFTTrainer); 63.6 vs 69.9 s per step, within the noise of the shared machine (single steps of
    either took 30-110 s)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    if cfg.micro_batch_size < 1 or cfg.batch_size % cfg.micro_batch_size:
        raise ValueError(
            f"bootstrap.micro_batch_size={cfg.micro_batch_size} must divide bootstrap.batch_size={cfg.batch_size} "
            "(the rest is gradient accumulation); 1 avoids padding"
        )
    order = training_order(len(examples), cfg.batch_size, cfg.epochs, seed)
    data = Dataset.from_dict({"input_ids": [examples[i][0] for i in order], "labels": [examples[i][1] for i in order]})
    total_steps = math.ceil(len(order) / cfg.batch_size)
    args = SFTConfig(
        output_dir=str(work_dir),
        num_train_epochs=1,  # `order` holds every epoch
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.batch_size // cfg.micro_batch_size,
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        optim="adamw_torch",
        train_sampling_strategy="sequential",
        max_length=None,  # tokenize_dialogue has cut each dialogue to bootstrap.max_length
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=not progress,
        dataloader_num_workers=0,
    )
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM")
    losses: list[float] = []

    class _Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class _Trainer(SFTTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda s: lr_factor(s, num_training_steps, cfg.warmup_ratio)
                )
            return self.lr_scheduler

    trainer = _Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, peft_config=lora,
                       callbacks=[_Losses()])
    trainer.train()
    if len(losses) != total_steps:
        raise RuntimeError(f"SFTTrainer logged {len(losses)} step losses for {total_steps} steps")
    return trainer.model, losses


def run(params: Params, out_dir: Path | None = None) -> dict:
    """Train the warm-start LoRA on reference dialogues, merge it, save `out_dir/model/`; write
    `out_dir/manifest.json` and `out_dir/metrics.json`; return the metrics dict."""
    import torch

    from trace_core.agents.model import cpu_has_fast_bf16, load_model, load_tokenizer, provision_model, weights_hash

    cfg = params.bootstrap
    out = Path(out_dir or cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = provision_model(params.model.path, params.model.cache_dir)
    if not cfg.enabled:
        # The stage's declared output must exist; it points at the model used as-is.
        (out / "model").mkdir(exist_ok=True)
        (out / "model" / "SOURCE.txt").write_text(f"bootstrap disabled; the base agent is {source}\n")
        metrics = {"enabled": False, "source_model": str(source)}
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
        (out / "manifest.json").write_text(json.dumps({"enabled": False, "model": str(source)}, indent=2))
        return metrics

    t0 = time.perf_counter()
    torch.manual_seed(params.seed)
    tokenizer = load_tokenizer(source)
    dialogues = reference_dialogues(params)
    examples = [tokenize_dialogue(tokenizer, msgs, tools, cfg.max_length) for _, msgs, tools in dialogues]
    data_hash = hashlib.sha256(json.dumps(examples).encode()).hexdigest()[:16]
    t_data = time.perf_counter() - t0
    autocast = params.model.dtype == "bfloat16" and cpu_has_fast_bf16()  # emulated bf16 is ~25x slower
    source_weights = weights_hash(source)
    key = run_key({
        "source_weights": source_weights, "data_hash": data_hash, "seed": params.seed, "autocast": autocast,
        "bootstrap": cfg.model_dump(exclude={"enabled", "out_dir"}),
        "model": params.model.model_dump(include={"dtype", "threads"}),
    })
    reused = _finished(out, key)
    if reused is not None:
        print(f"bootstrap: reusing {out / 'model'} (trained under the same run key {key})", flush=True)
        return reused

    model = load_model(source, dtype="float32", threads=params.model.threads)  # fp32 master weights; bf16 autocast
    model, losses = sft_lora(model, tokenizer, examples, cfg, params.seed, autocast, out / "sft.tmp")
    shutil.rmtree(out / "sft.tmp", ignore_errors=True)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)

    merged = model.merge_and_unload()
    target = out / "model"
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)

    manifest = {
        "run_key": key,
        "source_model": str(source),
        "source_weights": source_weights,
        "merged_weights": weights_hash(target),
        "families": cfg.families,
        "difficulty": cfg.difficulty,
        "seed": cfg.seed,
        "instances": [inst.instance_id for inst, _, _ in dialogues],
        "data_hash": data_hash,
    }
    n = max(1, steps_per_epoch)
    metrics = {
        "enabled": True,
        "dialogues": len(examples),
        "tokens": sum(len(e[0]) for e in examples),
        "trained_tokens": sum(sum(1 for x in e[1] if x != -100) for e in examples),
        "steps": len(losses),
        "loss_first_epoch": sum(losses[:n]) / len(losses[:n]),
        "loss_last_epoch": sum(losses[-n:]) / len(losses[-n:]),
        "seconds_data": round(t_data, 1),
        "seconds_total": round(time.perf_counter() - t0, 1),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True))
    write_json_atomic(out / "manifest.json", manifest)  # last: its run key marks the outputs as finished
    return metrics


def _finished(out: Path, key: str) -> dict | None:
    """The metrics of a warm-start already finished in `out` under `key` (manifest, metrics and merged weights
    intact), or None."""
    from trace_core.agents.model import weights_hash

    manifest, metrics = read_json(out / "manifest.json"), read_json(out / "metrics.json")
    if not isinstance(manifest, dict) or manifest.get("run_key") != key or not isinstance(metrics, dict):
        return None
    if not (out / "model" / "config.json").exists() or weights_hash(out / "model") != manifest.get("merged_weights"):
        return None
    return metrics
