"""Real GRPO steps through TRL's GRPOTrainer with our multi-turn rollouts, on the tiny model and the real
`tool_call_precision` environment: only the adapter moves, masked tokens get no gradient, kill + resume."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from trace_core.training import RolloutLedger, build_trainer, train_adapter
from trace_core.training.trainer import sha256_file
from tests.defaults import default_limits, default_user

CAPABILITY = "tool_call_precision"
ONE_STEP_EPISODES = default_limits(max_steps=1)


def _train(env, model, tokenizer, settings, out_dir, **kw):
    return train_adapter(
        env, model, tokenizer, settings, out_dir, CAPABILITY, train_seeds=range(64), limits=ONE_STEP_EPISODES,
        max_context=4096, **{"make_user": default_user, **kw}
    )


def test_a_step_moves_the_adapter_and_not_the_base(parity_env, policy_model, tokenizer, settings_factory, tmp_path):
    from safetensors.torch import load_file

    before = {name: p.detach().clone() for name, p in policy_model.named_parameters()}
    record = _train(parity_env, policy_model, tokenizer, settings_factory(max_steps=1), tmp_path)

    # PEFT wrapped the model in place: its base weights now sit under `base_layer`, untouched (under bf16
    # autocast the frozen linear weights are stored in bf16: exactly the values autocast would have cast them to).
    base = {n.replace(".base_layer", ""): p for n, p in policy_model.named_parameters() if "lora_" not in n}
    assert base.keys() == before.keys()
    assert all(torch.equal(before[n].to(base[n].dtype), base[n]) for n in before)
    assert all(not p.requires_grad for p in base.values())
    # LoRA B starts at zero; the step moved it.
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert len(lora_b) == 2 * 7 and any(t.abs().sum() > 0 for t in lora_b)  # 2 layers x 7 projections

    # TRL optimised the episode rewards our rollouts returned.
    state = json.loads((tmp_path / "checkpoints" / "checkpoint-1" / "trainer_state.json").read_text())
    logged = state["log_history"][0]
    assert logged["rewards/episode_reward/mean"] == pytest.approx(logged["rollouts/mean_reward"])
    assert logged["rollouts/informative_groups"] >= 1
    # The diagnostic: the mean absolute change of the LoRA weights from the run's start to after the step.
    start = load_file(tmp_path / "lora_start.safetensors")
    final = {n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t
             for n, t in adapter.items()}
    assert start.keys() == final.keys()
    moved = sum(float((final[n].float() - start[n]).abs().sum()) for n in start)
    change = moved / sum(t.numel() for t in start.values())
    assert change > 0 and logged["lora_abs_change"] == pytest.approx(change, rel=1e-4)

    assert record["steps"] == 1 and record["loss_type"] == "dapo"
    assert record["rollouts"] == RolloutLedger(tmp_path / "ledger.json").rollouts("training", CAPABILITY) >= 4
    assert record["adapter_sha256"] == sha256_file(tmp_path / "adapter" / "adapter_model.safetensors")
    print(f"\nGRPO step with the tiny model: {record['seconds_per_step']:.1f} s")


def test_masked_tokens_carry_no_gradient(
    parity_env, policy_model, tokenizer, settings_factory, chatty_user, tmp_path, monkeypatch
):
    """d loss / d log-prob is exactly -advantage / (policy tokens in the step) at every sampled token, and exactly 0
    at every user-turn / tool / template token inside the completions and at padding. (The loss is a function of
    the per-token log-probs; TRL's are replaced by a leaf tensor so that its gradient can be read per position.)"""
    # In fp32, so that the alignment check below can be tight: under bf16 autocast (CPUs with AMX) the sampler's and
    # TRL's log-probs of rows padded differently differ by up to ~0.14 from rounding alone.
    monkeypatch.setattr("trace_core.training.trainer._use_bf16", lambda on_cpu: False)
    settings = settings_factory(num_generations=2, groups_per_step=2, micro_batch_size=4)
    trainer, _ = build_trainer(
        parity_env,
        policy_model,
        tokenizer,
        settings,
        tmp_path,
        CAPABILITY,
        train_seeds=range(64),
        limits=default_limits(max_steps=2),
        make_user=chatty_user,
        max_context=4096,
    )
    trainer.model.train()
    rows = [{"prompt": f"group {i // settings.num_generations}"} for i in range(settings.rollouts_per_step)]
    batch = trainer._generate_and_score_completions(rows)  # one generation batch, as TRL's dataloader gives it
    policy = (batch["completion_mask"] * batch["tool_mask"]).bool()
    environment = batch["completion_mask"].bool() & ~policy
    assert environment.any(dim=1).all()  # every completion has a user turn between its two sampled turns
    assert batch["advantages"].abs().sum() > 0

    watched = {}
    compute = trainer._get_per_token_logps_and_entropies

    def leaf_logps(*args, **kwargs):
        logps, entropies, aux = compute(*args, **kwargs)
        watched["logps"] = logps.detach().requires_grad_()
        return watched["logps"], entropies, aux

    trainer._get_per_token_logps_and_entropies = leaf_logps
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train() normally
    trainer._compute_loss(trainer.model, batch).backward()
    grad = watched["logps"].grad

    # The sequences are aligned with what the policy sampled: TRL's recomputed log-probs of the sampled tokens, in
    # both turns, equal the ones recorded while sampling (each turn was prompted with the training tokens).
    assert torch.allclose(watched["logps"][policy], batch["sampling_per_token_logps"][policy], atol=1e-3)

    assert torch.all(grad[~policy] == 0)
    expected = -batch["advantages"][:, None].expand_as(grad) / policy.sum()
    assert torch.allclose(grad[policy], expected[policy], atol=1e-7)
    assert (grad[policy] != 0).any()


def test_filler_rows_are_stand_ins_with_the_same_gradient(
    parity_env, policy_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    """A constant-reward (filler) group enters TRL as one-token masked stand-ins instead of its episodes, and the
    LoRA gradient of the step is the same as with the full episodes masked out (what the trainer did before)."""
    from tests.training.conftest import ParityEnv
    from trace_core.training.episodes import episode_tokens

    class OddSeedsScoreZero(ParityEnv):
        def score(self, instance, messages, termination_reason):
            if instance.seed % 2:
                return type(super().score(instance, messages, termination_reason))(reward=0.0)
            return super().score(instance, messages, termination_reason)

    monkeypatch.setattr("trace_core.training.trainer._use_bf16", lambda on_cpu: False)
    env = OddSeedsScoreZero(difficulty=0)
    # Per-row scoring on both sides: with group_scoring the full episodes' rows would share their system prompt and
    # the stand-ins' rows would not, a rounding-level difference this exact comparison would pick up.
    settings = settings_factory(num_generations=4, groups_per_step=2, micro_batch_size=8, max_resample_rounds=0,
                                group_scoring=False)
    trainer, rollouts = build_trainer(
        env, policy_model, tokenizer, settings, tmp_path, CAPABILITY, train_seeds=range(64), limits=ONE_STEP_EPISODES,
        make_user=default_user, max_context=4096,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    rows = [{"prompt": f"group {i // settings.num_generations}"} for i in range(settings.rollouts_per_step)]
    stand_ins = trainer._generate_and_score_completions(rows)
    collection = rollouts.last
    assert collection.num_informative == 1 and collection.fillers == 1  # seed 0 varies, seed 1 scores 0
    filler = slice(settings.num_generations, None)
    assert stand_ins["completion_mask"][filler].sum() == stand_ins["prompt_mask"][filler].sum() == 4

    # The same collection with the filler group's real episodes, masked: TRL gets it from a replaced rollout_func.
    full = rollouts.sequences(collection)
    for k, traj in enumerate(collection.groups[1].trajectories):
        seq = episode_tokens(traj.messages, tokenizer, collection.groups[1].tools, include_tail=False)
        row = settings.num_generations + k
        full["prompt_ids"][row], full["completion_ids"][row] = seq.prompt_ids, seq.completion_ids
        full["env_mask"][row], full["logprobs"][row] = [0] * len(seq.completion_ids), seq.logprobs
    assert all(len(c) > 1 for c in full["completion_ids"][filler])
    trainer.rollout_func = lambda prompts, trainer: full
    episodes = trainer._generate_and_score_completions(rows)
    assert torch.equal(episodes["advantages"], stand_ins["advantages"])

    def lora_grad(batch):
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, batch).backward()
        return torch.cat([p.grad.flatten() for n, p in trainer.model.named_parameters() if "lora_" in n])

    expected, got = lora_grad(episodes), lora_grad(stand_ins)
    assert expected.abs().sum() > 0
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-7)


class Killed(Exception):
    pass


class KillAfterFirstCheckpoint:
    """A Trainer callback that dies right after checkpoint-1 is written, like a process killed mid-run."""

    def __getattr__(self, event):  # every other callback event is a no-op
        return lambda *args, **kwargs: None

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 1:
            raise Killed


def test_group_scoring_feeds_each_group_whole_with_its_prompt_shared(
    parity_env, policy_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    """With group_scoring a micro-batch is one GRPO group (TRL's row shuffle is skipped), and its loss goes through
    `group_logps`, which shares the group's prompt."""
    import trace_core.training.trainer as trainer_module

    monkeypatch.setattr("trace_core.training.trainer._use_bf16", lambda on_cpu: False)
    settings = settings_factory(num_generations=3, groups_per_step=2, micro_batch_size=1)
    trainer, rollouts = build_trainer(parity_env, policy_model, tokenizer, settings, tmp_path, CAPABILITY,
                                      train_seeds=range(64), limits=default_limits(max_steps=2),
                                      make_user=default_user, max_context=4096)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (3, 2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    rows = [{"prompt": f"group {i // settings.num_generations}"} for i in range(settings.rollouts_per_step)]
    micro = []
    for step in range(2):
        trainer._step = step
        micro.append(trainer._prepare_inputs(rows))
    groups = rollouts.last.groups
    for batch, group in zip(micro, groups):
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
        assert len(prompts) == 3 and prompts[0] == prompts[1] == prompts[2]  # one instance per micro-batch
        rewards = [t.reward for t in group.trajectories]
        assert torch.allclose(batch["advantages"], (torch.tensor(rewards) - sum(rewards) / 3).sign()
                              * batch["advantages"].abs())  # in the collection's order, not shuffled

    calls = []
    real = trainer_module.group_logps
    monkeypatch.setattr(trainer_module, "group_logps", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    for k, batch in enumerate(micro):
        trainer._compute_loss(trainer.model, batch).backward()
        informative = k < rollouts.last.num_informative
        assert len(calls) == k + 1 and (calls[-1] is not None) == informative


def test_training_steps_score_informative_groups_with_the_prompt_shared(
    parity_env, policy_model, tokenizer, settings_factory, tmp_path, monkeypatch
):
    """Through TRL's own training loop (not only `_compute_loss`), each informative group's loss goes through
    `group_logps`."""
    import trace_core.training.trainer as trainer_module

    calls = []
    real = trainer_module.group_logps
    monkeypatch.setattr(trainer_module, "group_logps", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    settings = settings_factory(num_generations=2, groups_per_step=2, micro_batch_size=1, max_steps=1)
    record = _train(parity_env, policy_model, tokenizer, settings, tmp_path)
    assert record["steps"] == 1 and len(calls) == settings.groups_per_step
    assert sum(c is not None for c in calls) >= 1  # at least one informative group, scored with its prompt shared


def test_kill_and_resume(parity_env, policy_model, tiny_model, tokenizer, settings_factory, tmp_path):
    settings = settings_factory(max_steps=2, checkpoint_every=1)
    with pytest.raises(Killed):
        _train(parity_env, policy_model, tokenizer, settings, tmp_path, callbacks=[KillAfterFirstCheckpoint()])
    assert (tmp_path / "checkpoints" / "checkpoint-1").is_dir() and not (tmp_path / "adapter").exists()
    killed = RolloutLedger(tmp_path / "ledger.json")
    rollouts_1, seeds_1 = killed.rollouts("training", CAPABILITY), killed.seeds("training", CAPABILITY)
    assert rollouts_1 == seeds_1 * settings.num_generations > 0

    with pytest.raises(ValueError, match="resume=True"):
        _train(parity_env, policy_model, tokenizer, settings, tmp_path, resume=False)

    fresh = copy.deepcopy(tiny_model)
    fresh.config.max_position_embeddings = 4096
    record = _train(parity_env, fresh, tokenizer, settings, tmp_path, resume=True)

    ledger = RolloutLedger(tmp_path / "ledger.json")
    rollouts_2, seeds_2 = (
        ledger.rollouts("training", CAPABILITY) - rollouts_1,
        ledger.seeds("training", CAPABILITY) - seeds_1,
    )
    assert record["steps"] == 2 and record["resumed_from_step"] == 1
    # The resumed run did one step's collection, on fresh seeds, and the ledger kept counting.
    per_round = max(settings.groups_per_step, settings.rollout_batch_size // settings.num_generations)
    assert per_round <= seeds_2 <= per_round * (1 + settings.max_resample_rounds)
    assert rollouts_2 == seeds_2 * settings.num_generations
    assert record["rollouts"] == rollouts_1 + rollouts_2 and record["seeds"] == seeds_1 + seeds_2

    adapter = tmp_path / "adapter" / "adapter_model.safetensors"
    assert record["adapter_sha256"] == sha256_file(adapter)
    assert record["adapter_sha256"] != sha256_file(
        tmp_path / "checkpoints" / "checkpoint-1" / "adapter_model.safetensors"
    )
    assert json.loads((tmp_path / "adapter_record.json").read_text()) == record
    assert record["settings"]["max_steps"] == 2 and record["capability_id"] == CAPABILITY


def test_sigkill_mid_training_then_resume(policy_model, tokenizer, tmp_path):
    """A real `kill -9` of a training process once its first checkpoint is on disk (so mid-way through a later
    step), then a resumed run: training completes, the ledger file is intact and counts every seed's group exactly
    once (rollouts = seeds x num_generations), the resumed steps draw fresh seeds, and the record agrees."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time
    from pathlib import Path

    from tests.training.conftest import ParityEnv, tiny_settings

    model_dir, out = tmp_path / "model", tmp_path / "run"
    policy_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    settings = {"max_steps": 4, "checkpoint_every": 1, "groups_per_step": 1, "max_resample_rounds": 1}
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoTokenizer
        from tests.defaults import default_limits, default_user
        from tests.training.conftest import ParityEnv, tiny_settings
        from trace_core.training import train_adapter
        torch.set_num_threads(1)
        train_adapter(ParityEnv(difficulty=0), {str(model_dir)!r}, AutoTokenizer.from_pretrained({str(model_dir)!r}),
                      tiny_settings(**{settings!r}), {str(out)!r}, {CAPABILITY!r}, train_seeds=range(64),
                      limits=default_limits(max_steps=1), make_user=default_user, max_context=4096)
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    try:
        while not (out / "checkpoints" / "checkpoint-1" / "trainer_state.json").exists():
            if proc.poll() is not None:
                pytest.fail(f"training exited before its first checkpoint: {proc.stderr.read().decode()[-2000:]}")
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        time.sleep(0.5)  # into the next step's rollouts
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "adapter_record.json").exists()  # it did not finish
    killed = RolloutLedger(out / "ledger.json")  # parses: the ledger is written atomically
    seeds_killed = killed.seeds("training", CAPABILITY)

    from transformers import AutoTokenizer

    record = train_adapter(ParityEnv(difficulty=0), str(model_dir), AutoTokenizer.from_pretrained(model_dir),
                           tiny_settings(**settings), out, CAPABILITY, train_seeds=range(64),
                           limits=ONE_STEP_EPISODES, make_user=default_user, resume=True, max_context=4096)
    ledger = RolloutLedger(out / "ledger.json")
    assert record["steps"] == 4 and record["resumed_from_step"] >= 1
    assert ledger.seeds("training", CAPABILITY) > seeds_killed  # later steps drew seeds after those counted
    assert ledger.rollouts("training", CAPABILITY) == ledger.seeds("training", CAPABILITY) * 2 == record["rollouts"]
    assert record["adapter_sha256"] == sha256_file(out / "adapter" / "adapter_model.safetensors")


def test_frozen_linears_in_bf16_give_the_same_outputs_and_gradients(policy_model):
    """Storing the frozen base weights in bf16 is exactly what autocast computes with fp32 ones: same logits, same
    LoRA gradients, and only the wrapped base linears change dtype."""
    from peft import LoraConfig, get_peft_model

    from trace_core.training.trainer import store_frozen_linears_in_bf16

    model = get_peft_model(policy_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # B starts at 0: give the adapter a non-zero contribution
    ids = torch.randint(0, policy_model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def forward_backward():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return logits.detach(), grads

    logits, grads = forward_backward()
    assert store_frozen_linears_in_bf16(model) == 2 * 2  # 2 layers x 2 target modules
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n for n, d in dtypes.items() if d == torch.bfloat16} == {
        n for n in dtypes if "base_layer" in n and ("q_proj" in n or "down_proj" in n)
    }
    logits_bf16, grads_bf16 = forward_backward()
    assert torch.equal(logits, logits_bf16)
    assert grads.keys() == grads_bf16.keys() and all(torch.equal(grads[n], grads_bf16[n]) for n in grads)


def test_a_step_without_loss_leaves_the_adapter_where_it_was():
    """AdamW's momentum moves weights on a zero gradient; a GRPO step of masked fillers only must not."""
    from trace_core.training.trainer import skip_zero_gradient_steps

    def run(guard):
        torch.manual_seed(0)
        layer = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.0)
        if guard:
            skip_zero_gradient_steps(opt)
        layer(torch.ones(1, 4)).sum().backward()
        opt.step()  # a training step
        after = [p.detach().clone() for p in layer.parameters()]
        opt.zero_grad(set_to_none=False)  # a step whose loss is 0: every gradient zero
        opt.step()
        return all(torch.equal(a, p) for a, p in zip(after, layer.parameters()))

    assert not run(guard=False)  # the defect: the weights moved without a gradient
    assert run(guard=True)


def test_the_trainer_guards_its_optimizer(parity_env, policy_model, tokenizer, settings_factory, tmp_path):
    trainer, _ = build_trainer(parity_env, policy_model, tokenizer, settings_factory(max_steps=1), tmp_path, CAPABILITY,
                               train_seeds=range(8), limits=ONE_STEP_EPISODES, make_user=default_user,
                               max_context=4096)
    optimizer = trainer.create_optimizer()
    lora = [p for p in trainer.model.parameters() if p.requires_grad]
    for p in lora:
        p.grad = torch.ones_like(p)
    optimizer.step()  # a training step: AdamW now has momentum
    before = [p.detach().clone() for p in lora]
    for p in lora:
        p.grad.zero_()
    optimizer.step()
    assert all(torch.equal(b, p) for b, p in zip(before, lora))
