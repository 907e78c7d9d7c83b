"""Stage `bootstrap`: the tool-use warm-start that turns the raw model into the base agent.

A 135M model emits no correct tool calls zero-shot, so the embedded default first gets a short supervised LoRA
on reference dialogues — oracle replays of generic procedural families, from seeds disjoint from every
evaluation seed — and the LoRA is merged into the weights. The families are deliberately few: the base agent
must keep real deficits for TRACE to find. Capable models skip the stage (`bootstrap.enabled: false`).

Outputs (in `bootstrap.out_dir`): `model/` (merged weights + tokenizer), `manifest.json` (exactly which
instances were used, data and weight hashes), `metrics.json` (loss curve summary, timings).
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


def assistant_loss(causal_lm, input_ids, attention_mask, labels):
    """Mean next-token cross-entropy over the labelled (assistant) positions only.

    The vocabulary projection runs on those positions alone: full logits for 4 x 2,600 tokens x 49k words
    would be ~2 GB in fp32 and most of them would be masked out anyway."""
    import torch.nn.functional as F

    hidden = causal_lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


def run(params: Params, out_dir: Path | None = None) -> dict:
    """Train the warm-start LoRA on reference dialogues, merge it, save `out_dir/model/`; write
    `out_dir/manifest.json` and `out_dir/metrics.json`; return the metrics dict."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

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
    rng = random.Random(params.seed)
    tokenizer = load_tokenizer(source)
    dialogues = reference_dialogues(params)
    examples = [tokenize_dialogue(tokenizer, msgs, tools, cfg.max_length) for _, msgs, tools in dialogues]
    data_hash = hashlib.sha256(json.dumps(examples).encode()).hexdigest()[:16]
    t_data = time.perf_counter() - t0

    model = load_model(source, dtype="float32", threads=params.model.threads)  # fp32 master weights; bf16 autocast
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    model.train()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(examples) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / max(1, total_steps // 10)) * max(0.0, 1 - s / total_steps))
    losses: list[float] = []
    autocast = params.model.dtype == "bfloat16" and cpu_has_fast_bf16()  # emulated bf16 is ~25x slower
    bar = tqdm(total=total_steps, desc="bootstrap SFT", unit="step", dynamic_ncols=True)
    for epoch in range(cfg.epochs):
        order = list(range(len(examples)))
        rng.shuffle(order)
        batches = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            # One sequence per forward pass, gradients accumulated over the batch: without padding there is no
            # attention mask, so SDPA takes its fused causal kernel instead of materialising batch x heads x L x L
            # scores (a 4 x 3,072-token batch needed > 24 GB that way). Each sequence's loss is weighted by its
            # share of the batch's assistant tokens, so the step equals the batch's token-mean loss.
            counts = [sum(1 for x in examples[i][1][1:] if x != -100) for i in batch]
            total = max(1, sum(counts))
            batch_loss = 0.0
            for i, n_tokens in zip(batch, counts):
                if n_tokens == 0:
                    continue
                ids, labels = examples[i]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = assistant_loss(model.get_base_model(), torch.tensor([ids]), None, torch.tensor([labels]))
                (loss * (n_tokens / total)).backward()
                batch_loss += loss.item() * n_tokens / total
            loss = torch.tensor(batch_loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}")
    bar.close()

    merged = model.merge_and_unload()
    target = out / "model"
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)

    manifest = {
        "source_model": str(source),
        "source_weights": weights_hash(source),
        "merged_weights": weights_hash(target),
        "families": cfg.families,
        "difficulty": cfg.difficulty,
        "seed": cfg.seed,
        "instances": [inst.instance_id for inst, _, _ in dialogues],
        "data_hash": data_hash,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
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
    return metrics
