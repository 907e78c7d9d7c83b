"""Warm-start pieces on a tiny model: only the assistant's own tokens are trained, the loss ignores everything
else, and a LoRA step moves the adapter but never the base weights."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from trace_core.agents.chat import render_assistant
from trace_core.bootstrap import assistant_loss, tokenize_dialogue
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


def test_masked_positions_carry_no_gradient_and_lora_leaves_base_weights(tiny_model, tokenizer):
    from peft import LoraConfig, get_peft_model

    ids, labels = tokenize_dialogue(tokenizer, DIALOGUE, TOOLS, max_length=10_000)
    input_ids = torch.tensor([ids])
    label_ids = torch.tensor([labels])
    attention = torch.ones_like(input_ids)
    model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False))
    base = model.get_base_model()

    # The loss equals plain cross-entropy restricted to the labelled positions ...
    loss = assistant_loss(base, input_ids, attention, label_ids)
    with torch.no_grad():
        logits = base(input_ids=input_ids, attention_mask=attention).logits[0, :-1]
    keep = label_ids[0, 1:] != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], label_ids[0, 1:][keep])
    assert torch.allclose(loss, ref, atol=1e-5)

    # ... so the logits at masked positions get exactly zero gradient.
    hidden = base.model(input_ids=input_ids, attention_mask=attention).last_hidden_state
    hidden.retain_grad()
    targets = label_ids[:, 1:]
    k = targets != -100
    out = torch.nn.functional.cross_entropy(base.lm_head(hidden[:, :-1][k]), targets[k])
    out.backward()
    grad = hidden.grad[0, :-1]
    assert torch.all(grad[~keep[: grad.shape[0]]] == 0)
    assert torch.any(grad[keep[: grad.shape[0]]] != 0)
    model.zero_grad(set_to_none=True)

    # One optimiser step moves LoRA weights only.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assistant_loss(base, input_ids, attention, label_ids).backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
