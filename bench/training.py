"""Benchmark: one GRPO step of our training vs TRL's stock GRPOTrainer, on the same single-turn task.

Both paths train the same model with the same LoRA adapter and the same GRPO settings (params.yaml `training:`,
through `trace_core.training.trainer.grpo_config` / `lora_config`), on the synthetic `tool_call_precision`
environment at difficulty 0 with one assistant turn per episode (a single tool call):

- ours:  `build_trainer` (what `train_adapter` runs): TRL's GRPOTrainer with our `rollout_func`, which rolls the
         episodes out with `TokenConsistentPolicy` (own decode loop, shared-prefix KV cache) and scores them.
- stock: TRL's GRPOTrainer as it comes: no rollout_func, its own `model.generate`. Its dataset holds, per seed,
         the prompt our first turn sees (the env's system prompt, tools and the instance's opening incl. the
         prefilled look-ups, rendered by the chat template), and its reward function is the same R_c: the
         completion is parsed into an assistant message (`parse_assistant`), an episode of that instance is
         started, stepped once with it, closed by the one-step limit and scored by the environment.

Same seeds, group size, rollouts per step, max_new_tokens, micro-batches, stop tokens and loss. Our DAPO refill
of constant-reward groups is off by default (`--refill-rounds 0`), so both paths run the same number of rollouts
per step; with refills, rollouts/s counts every rollout ours ran, trained on or not.

Timing: each trainer trains in its own thread and the two take turns one optimiser step at a time (only one runs
at any moment), so load from other jobs on the machine hits both alike. A step's time runs from the moment its
trainer gets the turn to the end of its optimiser step: rollouts, rewards, loss, backward, optimiser, TRL's
logging. "rollout s" is the part spent in TRL's `_generate` (ours: the rollout_func, episodes included) and
`_calculate_rewards` (stock: the episodes that score). The first `--warmup` steps of each path are dropped; the
table shows medians of the rest, and rollouts/s is their rollouts over their seconds. The checkpoint TRL writes
after the last step is not counted.

The default model is a randomly initialised, scaled-down SmolLM2 (`TINY_SHAPE`, with SmolLM2's tokenizer and chat
template); its completions are noise, so every reward is 0 and completions mostly run to max_new_tokens in both
paths. `--model smollm2` uses the real 135M base; with ~1,100-token prompts its training activations need
`--micro-batch 1` on a 23 GB machine (4 sequences per forward/backward ran out of memory there).

On CPU the step is mostly TRL's loss, the same work in both paths: it scores every position of prompt and
completion against the whole 49k vocabulary (its chunked log-prob kernel keeps to the completion only on Triton
devices). Hence the small default batch, G 4 x 1 group: 25-35 s a step with the tiny model on 2 shared cores,
3-5 minutes a run. params.yaml's batch is --num-generations 8 --groups 2.

    .venv/bin/python bench/training.py                    # tiny random model, 1 warm-up + 2 timed steps per path
    .venv/bin/python bench/training.py --model smollm2 --micro-batch 1 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAPABILITY = "tool_call_precision"
# SmolLM2's config scaled down: everything else (vocabulary, special tokens, RoPE, tied embeddings) stays.
TINY_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def tiny_smollm2(folder: Path, seed: int):
    """A random causal LM with SmolLM2's config, shrunk to `TINY_SHAPE`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    for key, value in TINY_SHAPE.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def stop_token_ids(tokenizer) -> list[int]:
    """The tokens that end a turn: the end-of-turn token, eos and <|endoftext|> (what `LocalPolicy` stops on)."""
    ids = set()
    for token in ("<|im_end|>", "<|endoftext|>", tokenizer.eos_token):
        i = tokenizer.convert_tokens_to_ids(token) if token else None
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(ids)


def first_turn_prompt(env, tokenizer, seed: int, limits, make_user) -> str:
    """The text the policy continues on the first turn of seed `seed`'s episode."""
    from trace_core.agents.chat import render_prompt

    episode = env.start(env.reset(seed), make_user(), limits)
    return render_prompt(tokenizer, episode.messages, episode.tools)


def one_call_reward(env, limits, make_user):
    """TRL reward function: R_c of a one-turn episode whose assistant turn is the parsed completion."""
    from trace_core.agents.parsing import parse_assistant

    def episode_reward(completions: list[str], seed: list[int], **_) -> list[float]:
        rewards = []
        for text, s in zip(completions, seed, strict=True):
            episode = env.start(env.reset(s), make_user(), limits)
            episode.step(parse_assistant(text))  # the one-step limit closes the episode
            rewards.append(float(episode.score().reward))
        return rewards

    return episode_reward


class TakeTurns:
    """A baton passed between trainers that each train in their own thread: only the holder runs, and it hands
    the baton on after each optimiser step. A trainer that has finished (or failed) is skipped."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.holder = self.names[0]
        self.running = set(self.names)
        self.cond = threading.Condition()

    def wait(self, name: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder == name)

    def hand_on(self, name: str) -> None:
        with self.cond:
            k = self.names.index(name)
            following = self.names[k + 1 :] + self.names[: k + 1]
            self.holder = next((n for n in following if n in self.running), name)
            self.cond.notify_all()

    def leave(self, name: str) -> None:
        with self.cond:
            self.running.discard(name)
        self.hand_on(name)


def new_step() -> dict:
    return {"seconds": 0.0, "rollout_seconds": 0.0, "rollouts": 0, "tokens": 0.0, "reward": 0.0}


@dataclass
class StepLog:
    """One path's optimiser steps, each a dict: seconds (the whole step), rollout_seconds (generation, then
    rewards), rollouts run, tokens (mean completion length) and reward (mean). `current` is the step under way."""

    steps: list[dict] = field(default_factory=list)
    current: dict = field(default_factory=new_step)

    def close_step(self, seconds: float) -> None:
        self.steps.append({**self.current, "seconds": seconds})
        self.current = new_step()

    def timed(self, warmup: int, key: str) -> list[float]:
        """`key` of every step after the first `warmup`."""
        return [step[key] for step in self.steps[warmup:]]


def instrument(trainer, log: StepLog, count_rollouts=None) -> None:
    """Time `trainer`'s rollout phase into `log`: TRL's `_generate` (our rollout_func, or its own generate) and
    `_calculate_rewards`; note the completions' mean length and reward. Rollouts run are the completions scored,
    or `count_rollouts()` when given (ours: refills run rollouts that are not trained on)."""
    generate, calculate_rewards = trainer._generate, trainer._calculate_rewards

    def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            log.current["rollout_seconds"] += time.perf_counter() - started

    def timed_rewards(inputs, prompts, completions, completion_ids_list):
        started = time.perf_counter()
        try:
            rewards = calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            log.current["rollout_seconds"] += time.perf_counter() - started
        lengths = [len(ids) for ids in completion_ids_list]
        log.current["rollouts"] = count_rollouts() if count_rollouts else len(lengths)
        log.current["tokens"] = sum(lengths) / len(lengths)
        log.current["reward"] = float(rewards.sum(dim=1).mean())
        return rewards

    trainer._generate, trainer._calculate_rewards = timed_generate, timed_rewards


def step_clock(name: str, turns: TakeTurns, log: StepLog):
    """A trainer callback that times each optimiser step into `log`, from getting the turn to the step's end, and
    hands the turn on between steps."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        started = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            turns.wait(name)
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            log.close_step(time.perf_counter() - self.started)
            if state.global_step < state.max_steps:  # after the last step: keep the turn until train() returns
                turns.hand_on(name)
                turns.wait(name)
            self.started = time.perf_counter()

    return StepClock()


def train_alternating(trainers: dict, turns: TakeTurns) -> None:
    """Run every trainer's `train()` in its own thread, taking `turns` one optimiser step at a time (their
    callbacks come from `step_clock`)."""
    errors: dict[str, BaseException] = {}

    def train(name, trainer):
        try:
            trainer.train()
        except BaseException as exc:  # noqa: BLE001 — re-raised below, once both trainers have stopped
            errors[name] = exc
        finally:
            turns.leave(name)

    threads = [threading.Thread(target=train, args=item, name=item[0], daemon=True) for item in trainers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, exc in errors.items():
        raise RuntimeError(f"the {name} trainer failed: {exc!r}") from exc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml", help="GRPO settings come from its `training:` section")
    ap.add_argument("--model", default="tiny",
                    help="'tiny' (random scaled-down SmolLM2, the default), 'smollm2' (the real 135M), or a folder")
    ap.add_argument("--steps", type=int, default=2, help="timed GRPO steps per path (default 2)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps per path before them (default 1)")
    ap.add_argument("--num-generations", type=int, default=4, help="G, rollouts per group (default 4)")
    ap.add_argument("--groups", type=int, default=1, help="groups per step (default 1)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default: params)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per completion (default: params)")
    ap.add_argument("--refill-rounds", type=int, default=0,
                    help="our DAPO refill rounds for constant-reward groups (default 0: same rollouts as stock)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on 2 shared cores a second thread mostly waits)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    import copy
    import warnings

    import torch
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    from trace_core.agents.model import load_model, load_tokenizer, provision_model
    from trace_core.config import load_params
    from trace_core.envs.base import EpisodeLimits
    from trace_core.envs.settings import scripted_user_factory
    from trace_core.synthesis.templates import make
    from trace_core.training import GRPOSettings, build_trainer
    from trace_core.training.trainer import grpo_config, lora_config

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # transformers deprecation, per step
    params = load_params(args.params)
    torch.set_num_threads(args.threads)
    total_steps = args.warmup + args.steps
    settings = dataclasses.replace(
        GRPOSettings.from_params(params),
        max_steps=total_steps,
        num_generations=args.num_generations,
        groups_per_step=args.groups,
        micro_batch_size=args.micro_batch or params.training.micro_batch_size,
        max_new_tokens=args.max_new_tokens or params.training.max_new_tokens,
        max_resample_rounds=args.refill_rounds,
        hint_fraction=0.0,
        checkpoint_every=total_steps,
    )

    if args.model == "tiny":
        folder = provision_model("smollm2", params.model.cache_dir)  # for its config, tokenizer and chat template
        model = tiny_smollm2(folder, settings.seed)
        shape = ", ".join(f"{k} {v}" for k, v in TINY_SHAPE.items())
        model_name = f"tiny random SmolLM2 ({shape}; {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params)"
    else:
        folder = provision_model(args.model, params.model.cache_dir)
        # as train_adapter loads it
        model, model_name = load_model(folder, dtype="float32", threads=params.model.threads), str(folder)
    tokenizer = load_tokenizer(folder)
    model.generation_config.eos_token_id = stop_token_ids(tokenizer)  # both paths stop on the same tokens

    env = make(CAPABILITY, difficulty=0)
    limits = EpisodeLimits(max_steps=1, max_errors=params.env.max_errors)
    make_user = scripted_user_factory(params)
    # Ours draws its seeds in order from train_seeds; without refills, exactly the stock dataset's seeds.
    seeds = list(range(total_steps * settings.groups_per_step))
    prompts = [first_turn_prompt(env, tokenizer, s, limits, make_user) for s in seeds]
    # TRL tokenizes a text prompt with the tokenizer's defaults, our policy without special tokens: same ids?
    if tokenizer(prompts[0])["input_ids"] != tokenizer(prompts[0], add_special_tokens=False)["input_ids"]:
        raise SystemExit("the tokenizer adds special tokens to a prompt: the two paths would see different prompts")
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts) / len(prompts)

    turns = TakeTurns(["ours", "stock"])
    logs = {"ours": StepLog(), "stock": StepLog()}
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        ours, rollouts = build_trainer(
            env,
            copy.deepcopy(model),
            tokenizer,
            settings,
            Path(tmp) / "ours",
            CAPABILITY,
            train_seeds=range(10_000),
            limits=limits,
            make_user=make_user,
            max_context=params.policy.max_context,
            callbacks=[step_clock("ours", turns, logs["ours"])],
        )
        instrument(ours, logs["ours"], count_rollouts=lambda: rollouts.last.rollouts)

        config = grpo_config(settings, Path(tmp) / "stock" / "checkpoints")
        config.max_completion_length = settings.max_new_tokens  # ours: max_new_tokens for the one turn
        config.shuffle_dataset = False  # groups in seed order, like ours
        stock = GRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=one_call_reward(env, limits, make_user),
            args=config,
            train_dataset=Dataset.from_dict({"prompt": prompts, "seed": seeds}),
            processing_class=tokenizer,
            peft_config=lora_config(settings),
            callbacks=[step_clock("stock", turns, logs["stock"])],
        )
        stock.remove_callback(PrinterCallback)
        instrument(stock, logs["stock"])

        started = time.perf_counter()
        train_alternating({"ours": ours, "stock": stock}, turns)
        wall = time.perf_counter() - started

    print(f"model: {model_name}")
    print(f"task: {CAPABILITY} difficulty 0, one call per episode; prompts {prompt_tokens:.0f} tokens on average")
    print(f"GRPO: G {settings.num_generations} x {settings.groups_per_step} groups = {settings.rollouts_per_step} "
          f"rollouts/step, max_new_tokens {settings.max_new_tokens}, micro-batch {settings.micro_batch_size}, "
          f"LoRA r{settings.lora_r} on {len(settings.target_modules)} projections, refill rounds "
          f"{settings.max_resample_rounds}")
    print(f"steps: {args.warmup} warm-up + {args.steps} timed per path, taking turns step by step; torch threads "
          f"{args.threads}; both trainings {wall:.0f} s\n")

    rows = {}
    print(f"{'path':<11}{'s/step':>9}{'rollout s':>11}{'rollouts/s':>12}{'tokens/rollout':>16}{'reward':>8}")
    for name, label in (("ours", "ours"), ("stock", "stock TRL")):
        log = logs[name]
        seconds = log.timed(args.warmup, "seconds")
        row = rows[name] = {
            "step": statistics.median(seconds),
            "rollout": statistics.median(log.timed(args.warmup, "rollout_seconds")),
            "rate": sum(log.timed(args.warmup, "rollouts")) / sum(seconds),
            "tokens": statistics.mean(log.timed(args.warmup, "tokens")),
            "reward": statistics.mean(log.timed(args.warmup, "reward")),
        }
        print(f"{label:<11}{row['step']:>9.2f}{row['rollout']:>11.2f}{row['rate']:>12.3f}{row['tokens']:>16.1f}"
              f"{row['reward']:>8.3f}")

    def ratio(key: str) -> str:
        return f"x{rows['ours'][key] / rows['stock'][key]:.2f}"

    print(f"\nours / stock: s/step {ratio('step')}, rollouts/s {ratio('rate')}, rollout phase {ratio('rollout')}")
    for name in ("ours", "stock"):
        steps = " ".join(f"{step['seconds']:.1f}" for step in logs[name].steps)
        print(f"{name} steps (s, warm-up first): {steps}")

if __name__ == "__main__":
    main()
