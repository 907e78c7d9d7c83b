"""The trainer scores each GRPO sequence without its padding (`trace_core.training.logprobs`): the same log-probs,
entropies and LoRA gradients as TRL's padded, fused-head scoring, on a real padded batch of multi-turn episodes, with
filler stand-ins scored at their own length."""

from __future__ import annotations

import pytest
import torch

from trace_core.training import build_trainer
from trace_core.training import logprobs as lp_module
from trace_core.training.logprobs import has_plain_head, row_spans
from tests.defaults import default_limits

CAPABILITY = "tool_call_precision"


@pytest.fixture
def padded_batch(parity_env, policy_model, tokenizer, settings_factory, chatty_user, tmp_path, monkeypatch):
    """A trainer and one generation batch as TRL pads it: two-turn episodes of different lengths."""
    monkeypatch.setattr("trace_core.training.trainer._use_bf16", lambda on_cpu: False)
    settings = settings_factory(num_generations=2, groups_per_step=2, micro_batch_size=4)
    trainer, _ = build_trainer(parity_env, policy_model, tokenizer, settings, tmp_path, CAPABILITY,
                               train_seeds=range(64), limits=default_limits(max_steps=2), make_user=chatty_user,
                               max_context=4096)
    trainer.model.train()
    rows = [{"prompt": f"group {i // settings.num_generations}"} for i in range(settings.rollouts_per_step)]
    batch = trainer._generate_and_score_completions(rows)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    assert (mask == 0).any(dim=1).sum() >= 2  # rows really are padded, on both sides
    return trainer, batch, ids, mask


def _score(trainer, ids, mask, width, loss_mask, own: bool):
    from trl import GRPOTrainer

    method = trainer._get_per_token_logps_and_entropies if own else (
        lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k))
    trainer.model.zero_grad()
    logps, entropies, _ = method(trainer.model, ids, mask, width, compute_entropy=True)
    weights = torch.linspace(-1.0, 1.0, logps.numel()).reshape(logps.shape)
    (logps * weights * loss_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for n, p in trainer.model.named_parameters() if "lora_" in n])
    return logps.detach(), entropies.detach(), grads


@pytest.mark.parametrize("limit", [None, 0], ids=["plain_head", "fused_head_fallback"])
def test_same_logps_entropies_and_gradients_as_trl(padded_batch, limit, monkeypatch):
    trainer, batch, ids, mask = padded_batch
    if limit is not None:  # every row over the limit: TRL's fused head on the unpadded rows
        monkeypatch.setattr(lp_module, "MAX_LOGIT_ELEMENTS", limit)
    width = batch["completion_ids"].shape[1]
    valid = batch["completion_mask"].bool()
    ours = _score(trainer, ids, mask, width, valid.float(), own=True)
    theirs = _score(trainer, ids, mask, width, valid.float(), own=False)
    # Float32 rounding of a different summation order (padding, attention kernel) only: up to ~4e-4 here.
    assert torch.allclose(ours[0][valid], theirs[0][valid], atol=1e-3)
    assert torch.allclose(ours[1][valid], theirs[1][valid], atol=1e-3)
    assert torch.all(ours[0][~valid] == 0)
    assert theirs[2].abs().sum() > 0
    assert torch.allclose(ours[2], theirs[2], rtol=1e-2, atol=1e-3 * theirs[2].abs().max().item())


def test_each_row_is_scored_at_its_own_length(padded_batch):
    """The model sees each row's tokens and nothing more, so a one-token filler stand-in costs two tokens, not the
    width of the step's longest episode."""
    trainer, batch, ids, mask = padded_batch
    stand_in_ids = torch.full((1, ids.shape[1]), trainer.processing_class.pad_token_id or 0)
    stand_in_mask = torch.zeros_like(stand_in_ids)
    prompt_width = batch["prompt_ids"].shape[1]
    stand_in_ids[0, prompt_width - 1 : prompt_width + 1] = trainer.processing_class.eos_token_id
    stand_in_mask[0, prompt_width - 1 : prompt_width + 1] = 1
    ids, mask = torch.cat([ids, stand_in_ids]), torch.cat([mask, stand_in_mask])
    seen = []
    embed = trainer.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].shape[1])
    finally:
        hook.remove()
    assert seen == [int(m.sum()) for m in mask]
    assert seen[-1] == 2 and min(seen[:-1]) < ids.shape[1] == max(seen)


def test_row_spans_and_guards(tiny_model):
    assert row_spans(torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])) == [(1, 3), (0, 4), (0, 0)]
    assert row_spans(torch.tensor([[1, 0, 1, 1]])) is None  # not a padded batch: the trainer keeps TRL's scoring
    assert has_plain_head(tiny_model.config)
    capped = type(tiny_model.config)(**{**tiny_model.config.to_dict(), "final_logit_softcapping": 30.0})
    assert not has_plain_head(capped)


def _group_rows(batch, size):
    """Row indices of each GRPO group of `size` rows in a generation batch (groups are contiguous)."""
    n = batch["prompt_ids"].shape[0]
    return [list(range(i, i + size)) for i in range(0, n, size)]


@pytest.mark.parametrize("checkpoint_rows", [True, False], ids=["rows_recomputed", "rows_kept"])
def test_group_scoring_matches_per_row_scoring(padded_batch, checkpoint_rows):
    """A group's rows share their prompt: computing it once gives the per-row log-probs, entropies and gradients,
    whether each row's activations are kept for the backward pass or recomputed there."""
    trainer, batch, ids, mask = padded_batch
    width = batch["completion_ids"].shape[1]
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    vocab = unwrapped.config.vocab_size
    for rows in _group_rows(batch, 2):
        g_ids, g_mask = ids[rows], mask[rows]
        spans = row_spans(g_mask)
        valid = batch["completion_mask"][rows].bool()

        def score(fn, **kw):
            trainer.model.zero_grad()
            logps, entropies = fn(trainer.model, g_ids, spans, width, temperature=0.7, compute_entropy=True,
                                  vocab_size=vocab, **kw)
            weights = torch.linspace(-1.0, 1.0, logps.numel()).reshape(logps.shape)
            (logps * weights * valid).sum().backward()
            grads = torch.cat([p.grad.flatten() for n, p in trainer.model.named_parameters() if "lora_" in n])
            return logps.detach(), entropies.detach(), grads

        shared = score(lp_module.group_logps, min_prefix=1, checkpoint_rows=checkpoint_rows)
        assert shared is not None
        rowwise = score(lp_module.completion_logps)
        assert torch.allclose(shared[0][valid], rowwise[0][valid], atol=1e-3)
        assert torch.allclose(shared[1][valid], rowwise[1][valid], atol=1e-3)
        assert torch.all(shared[0][~valid] == 0) and torch.all(shared[1][~valid] == 0)
        assert rowwise[2].abs().sum() > 0
        assert torch.allclose(shared[2], rowwise[2], rtol=1e-2, atol=1e-3 * rowwise[2].abs().max().item())


def test_group_scoring_computes_the_prompt_once(padded_batch):
    trainer, batch, ids, mask = padded_batch
    width = batch["completion_ids"].shape[1]
    rows = _group_rows(batch, 2)[0]
    g_ids, g_mask = ids[rows], mask[rows]
    spans = row_spans(g_mask)
    vocab = trainer.accelerator.unwrap_model(trainer.model).config.vocab_size
    seen = []
    embed = trainer.model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        with torch.no_grad():
            out = lp_module.group_logps(trainer.model, g_ids, spans, width, temperature=1.0, compute_entropy=False,
                                        vocab_size=vocab, min_prefix=1)
    finally:
        hook.remove()
    assert out is not None and out[1] is None
    lengths = [e - s for s, e in spans]
    prompts = [ids.shape[1] - width - s for s, _ in spans]
    prefix = min(prompts) - 1  # one instance, one prompt: all of it but the token that scores the first reply token
    assert seen == [(1, prefix)] + [(1, n - prefix) for n in lengths]  # then each row's own tokens


def test_group_scoring_declines_batches_it_cannot_share(padded_batch):
    trainer, batch, ids, mask = padded_batch
    width = batch["completion_ids"].shape[1]
    vocab = trainer.accelerator.unwrap_model(trainer.model).config.vocab_size
    spans = row_spans(mask)
    kw = dict(temperature=1.0, compute_entropy=False, vocab_size=vocab)
    # A common prefix shorter than min_prefix (a batch whose rows share little more than a chat header).
    assert lp_module.group_logps(trainer.model, ids, spans, width, min_prefix=10**6, **kw) is None
    one = spans[:1]
    assert lp_module.group_logps(trainer.model, ids[:1], one, width, min_prefix=1, **kw) is None  # one row
    assert lp_module.group_logps(trainer.model, ids[:2], spans[:2], width, min_prefix=1, max_logit_elements=1,
                                 **kw) is None  # logits over the limit: per-row scoring (fused head) instead
