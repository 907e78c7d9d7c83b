"""Warm-start pieces on a tiny model: only the assistant's own tokens are trained, SFTTrainer's loss is the token
mean over them, and training moves the adapter but never the base weights."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")

from trace_core.agents.chat import render_assistant
from trace_core.bootstrap import tokenize_dialogue
from trace_core.schemas import Message, ToolCall

TOOLS = [{"type": "function", "function": {"name": "cancel_pending_order", "description": "Cancel.",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}}]
CALL = ToolCall(id="c0", name="cancel_pending_order", arguments={"order_id": "#W1"})
DIALOGUE = [
    Message(role="system", content="You are a retail agent."),
    Message(role="user", content="Please cancel order #W1."),
    Message(role="assistant", tool_calls=[CALL]),
    Message(role="tool", tool_call_id="c0", name="cancel_pending_order", content='{"status": "cancelled"}'),
    Message(role="assistant", content="Done, order #W1 is cancelled."),
    Message(role="user", content="Thanks ###STOP###"),
]


def test_labels_cover_exactly_the_assistant_turns(tokenizer):
    ids, labels = tokenize_dialogue(tokenizer, DIALOGUE, TOOLS, max_length=10_000)
    assert len(ids) == len(labels)
    trained = tokenizer.decode([t for t, y in zip(ids, labels) if y != -100])
    expected = render_assistant(DIALOGUE[2], tokenizer=tokenizer) + render_assistant(DIALOGUE[4], tokenizer=tokenizer)
    assert trained.replace("\n", "") == expected.replace("\n", "")
    context = tokenizer.decode([t for t, y in zip(ids, labels) if y == -100])
    assert "Please cancel order #W1." in context and '"status": "cancelled"' in context
    assert "Thanks" not in trained and "retail agent" not in trained


def _sft_cfg(**overrides):
    from pathlib import Path

    from trace_core.config import load_params

    cfg = load_params(Path(__file__).resolve().parents[1] / "params.yaml").bootstrap
    return cfg.model_copy(update={"lora_r": 4, "lora_alpha": 8, "lr": 1e-2,
                                  "target_modules": ["q_proj", "v_proj", "down_proj"], **overrides})


def test_sft_loss_is_the_token_mean_over_assistant_tokens_and_moves_lora_only(tiny_model, tokenizer, tmp_path):
    """SFTTrainer reproduces the warm-start objective: its first step's loss (the LoRA starts as a no-op) equals the
    cross-entropy over the batch's assistant tokens, token-averaged over the batch; only LoRA weights move."""
    from trace_core.bootstrap import sft_lora, training_order

    short = DIALOGUE[:3]  # one assistant turn: the examples differ in how many tokens they train
    examples = [tokenize_dialogue(tokenizer, d, TOOLS, max_length=10_000) for d in (DIALOGUE, short, DIALOGUE, short)]
    examples += examples[:2]
    cfg = _sft_cfg(batch_size=2, micro_batch_size=1, epochs=1)
    base = copy.deepcopy(tiny_model)
    before = {n: p.detach().clone() for n, p in base.named_parameters()}

    first = [examples[i] for i in training_order(len(examples), cfg.batch_size, cfg.epochs, seed=0)[: cfg.batch_size]]
    nll, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in first:
            logits = tiny_model(input_ids=torch.tensor([ids])).logits[0, :-1]
            targets = torch.tensor(labels[1:])
            keep = targets != -100
            nll += torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum").item()
            count += int(keep.sum())
    model, losses = sft_lora(base, tokenizer, examples, cfg, seed=0, bf16=False, work_dir=tmp_path, progress=False)
    assert len(losses) == 3
    assert losses[0] == pytest.approx(nll / count, rel=1e-4)

    trained = {n.replace("base_model.model.", "").replace(".base_layer", ""): p.detach()
               for n, p in model.named_parameters()}
    lora = {n for n in trained if "lora_" in n}
    assert lora and all(torch.equal(before[n], trained[n]) for n in before)  # base weights untouched
    assert any(not torch.all(trained[n] == 0) for n in lora if "lora_B" in n)  # the adapter learnt


def test_sft_micro_batches_must_divide_the_batch(tiny_model, tokenizer, tmp_path):
    from trace_core.bootstrap import sft_lora

    with pytest.raises(ValueError, match="bootstrap.micro_batch_size=3 must divide bootstrap.batch_size=4"):
        sft_lora(tiny_model, tokenizer, [], _sft_cfg(batch_size=4, micro_batch_size=3), 0, False, tmp_path)


def test_lr_schedule_and_order_are_the_warm_start_s():
    from trace_core.bootstrap import lr_factor, training_order

    assert [lr_factor(s, 16, 0.1) for s in (0, 1, 15)] == [1.0, 15 / 16, 1 / 16]  # one warmup step: pure decay
    assert [round(lr_factor(s, 30, 0.1), 6) for s in (0, 1, 2, 3)] == [round(x, 6) for x in (1 / 3, 2 / 3 * 29 / 30,
                                                                                              28 / 30, 27 / 30)]
    order = training_order(10, 4, 2, seed=0)
    assert sorted(order[:10]) == sorted(order[10:]) == list(range(10))


def test_a_rerun_under_the_same_run_key_reuses_the_merged_weights(tiny_model, tokenizer, tmp_path, monkeypatch):
    """DVC re-runs the stage when any of its params sections changes (e.g. `env.domain: toolsandbox`, whose
    warm-start dialogues stay τ² retail ones); the SFT runs again only when what the weights depend on changed."""
    from pathlib import Path

    from trace_core import bootstrap
    from trace_core.agents import model as model_module
    from trace_core.config import load_params

    source = tmp_path / "source"
    tiny_model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    monkeypatch.setattr(model_module, "provision_model", lambda path, cache_dir=None: source)
    root = Path(__file__).resolve().parents[1]
    small = {"bootstrap.num_dialogues": 2, "bootstrap.batch_size": 2, "bootstrap.max_length": 256,
             "bootstrap.out_dir": str(tmp_path / "bootstrap"), "model.dtype": "float32", "model.threads": 1}
    params = load_params(root / "params.yaml", small)
    first = bootstrap.run(params)
    manifest = json.loads((tmp_path / "bootstrap" / "manifest.json").read_text())
    assert first["steps"] == 1 and manifest["run_key"] and manifest["source_weights"]

    def no_sft(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(bootstrap, "sft_lora", no_sft)
    assert bootstrap.run(load_params(root / "params.yaml", {**small, "env.max_steps": 7})) == first  # unread
    with pytest.raises(AssertionError, match="trained again"):  # another warm-start setting: trains again
        bootstrap.run(load_params(root / "params.yaml", {**small, "bootstrap.lr": 0.002}))
    weights = next((tmp_path / "bootstrap" / "model").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # the merged weights no longer hash as recorded
    with pytest.raises(AssertionError, match="trained again"):
        bootstrap.run(params)
