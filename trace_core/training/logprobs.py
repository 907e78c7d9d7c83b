"""Per-token log-probabilities of GRPO's completion tokens, scored one row at a time without its padding.

TRL pads a generation batch to its longest prompt (left) and longest completion (right), scores every micro-batch
at that width and projects through a tiled LM head that also computes entropies. For multi-turn episodes on a CPU
each of these costs more than it should:
- a one-token filler stand-in (`EpisodeRollouts.sequences`) is scored at the width of the step's longest episode;
- padding forces an attention mask, so attention cannot take its fused causal kernel;
- the tiled head took ~4x the time of a plain log-softmax over the same positions (SmolLM2-135M, 312 completion
  tokens, forward + backward, 2 AVX2 cores: ~2.5 s vs 0.6 s), about a third of a 1,850-token sequence's loss time.

`completion_logps` cuts each row to its own tokens and runs the plain head over that row's completion positions only.
The result is the same function of the weights: attention under RoPE depends only on relative positions, so dropping
left padding changes rounding, nothing else (the tests compare values and gradients with TRL's). Rows whose logits
would exceed `max_logit_elements` (a large vocabulary times a long completion, e.g. on an accelerator) go through
TRL's memory-lean fused head instead, still without padding.

`group_logps` scores a micro-batch whose rows share a prompt, as the rows of one GRPO group do (the same instance,
sampled several times): the shared prefix goes through the model once, and each row's own tokens follow on top of
its keys and values (with their autograd graph). The gradient reaches the prefix's
activations once, summed over the rows, which is what the per-row computation adds up to. On a CPU with
~1,500-token prompts and a few hundred completion tokens per row this is several times less compute per group.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

# 2**28 float32 logits are 1 GiB, and log-softmax keeps as much again for the backward pass.
MAX_LOGIT_ELEMENTS = 2**28


def row_spans(attention_mask: Any) -> list[tuple[int, int]] | None:
    """(start, end) of each row's attended tokens, or None when some row's ones are not one contiguous run (not a
    left/right-padded batch)."""
    spans = []
    for row in attention_mask:
        ones = row.nonzero()[:, 0]
        if len(ones) == 0:
            spans.append((0, 0))
            continue
        start, end = int(ones[0]), int(ones[-1]) + 1
        if end - start != len(ones):
            return None
        spans.append((start, end))
    return spans


def has_plain_head(config: Any) -> bool:
    """True when the logits are the LM head's output as is (no soft-capping or scaling, which TRL's fused head
    applies and this module does not)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scaled = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
    return all(getattr(text, name, None) in (None, 1, 1.0) for name in scaled)


def _token_scores(logits: Any, targets: Any, temperature: float, compute_entropy: bool,
                  entropy_grad: bool) -> tuple[Any, Any]:
    """Log-probabilities of `targets` under `logits / temperature`, and the entropies (None unless
    `compute_entropy`; without gradient unless `entropy_grad`)."""
    import torch

    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    source = logp if entropy_grad else logp.detach()
    entropy = -(source.exp() * source).sum(-1) if compute_entropy else None
    return logp.gather(-1, targets[..., None])[..., 0], entropy


def completion_logps(
    model: Any,
    input_ids: Any,
    spans: list[tuple[int, int]],
    logits_to_keep: int,
    *,
    temperature: float,
    compute_entropy: bool,
    entropy_grad: bool = False,
    vocab_size: int,
    fused: Callable[[Any, int], tuple[Any, Any]] | None = None,
    max_logit_elements: int | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> tuple[Any, Any]:
    """(log-probs, entropies) of shape (rows, logits_to_keep) for a left/right-padded batch, as TRL's
    `_get_per_token_logps_and_entropies` returns them; padded completion positions hold 0.

    `input_ids` is prompts (left-padded) then completions (right-padded, the last `logits_to_keep` columns);
    `spans` is `row_spans` of its attention mask. `entropy_grad`: whether the entropies must carry gradients (an
    entropy bonus in the loss); else they are computed without. `fused(ids, n)`: (log-probs, entropies) of the last
    n tokens of one unpadded row by TRL's fused head, used for rows with more than `max_logit_elements` (default
    `MAX_LOGIT_ELEMENTS`) logits; without it every row takes the plain head."""
    import torch

    limit = MAX_LOGIT_ELEMENTS if max_logit_elements is None else max_logit_elements
    prompt_width = input_ids.shape[1] - logits_to_keep
    logps, entropies = [], []
    for r, (start, end) in enumerate(spans):
        n = end - prompt_width  # completion tokens of this row
        if n <= 0:  # nothing to score (a fully masked completion)
            logps.append(torch.zeros(1, logits_to_keep, device=input_ids.device))
            entropies.append(torch.zeros(1, logits_to_keep, device=input_ids.device))
            continue
        ids = input_ids[r : r + 1, start:end]
        if fused is not None and n * vocab_size > limit:
            lp, ent = fused(ids, n)
        else:
            with autocast():
                # Position i predicts token i + 1: the n + 1 last positions, less the final one, score the n tokens.
                logits = model(input_ids=ids, logits_to_keep=n + 1).logits[:, :-1]
            lp, ent = _token_scores(logits, ids[:, -n:], temperature, compute_entropy, entropy_grad)
        pad = logits_to_keep - n
        logps.append(torch.nn.functional.pad(lp.float(), (0, pad)))
        if compute_entropy:
            entropies.append(torch.nn.functional.pad(ent.float(), (0, pad)))
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None)


def group_logps(
    model: Any,
    input_ids: Any,
    spans: list[tuple[int, int]],
    logits_to_keep: int,
    *,
    temperature: float,
    compute_entropy: bool,
    entropy_grad: bool = False,
    vocab_size: int,
    min_prefix: int = 32,
    max_logit_elements: int | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    checkpoint_rows: bool = True,
) -> tuple[Any, Any] | None:
    """`completion_logps`'s result for a batch whose scored rows share a prompt prefix, with that prefix computed
    once; None when the batch does not suit it (then score it with `completion_logps`).

    `model` must be the bare causal LM or a PEFT model around one (not a distributed wrapper): the prefix and the
    rows go through its decoder, and each row's completion positions through its output embeddings. None when fewer
    than two rows have completion tokens, when their common prefix (cut one token short of the shortest prompt, so
    every row's first scored position is its own) has fewer than `min_prefix` tokens, or when one row's logits
    would exceed `max_logit_elements` (default `MAX_LOGIT_ELEMENTS`)."""
    import torch
    import torch.utils.checkpoint
    from transformers import DynamicCache

    from trace_core.agents.local import _cache_kwarg

    limit = MAX_LOGIT_ELEMENTS if max_logit_elements is None else max_logit_elements
    prompt_width = input_ids.shape[1] - logits_to_keep
    counts = [end - prompt_width for _, end in spans]  # completion tokens per row
    rows = [r for r, n in enumerate(counts) if n > 0]
    if len(rows) < 2 or max(counts[r] for r in rows) * vocab_size > limit:
        return None
    tokens = [input_ids[r, spans[r][0] : spans[r][1]] for r in rows]
    shortest_prompt = min(len(t) - counts[r] for t, r in zip(tokens, rows))
    first = tokens[0][: shortest_prompt - 1]
    P = len(first)
    for t in tokens[1:]:
        differ = (t[:P] != first[:P]).nonzero()
        if len(differ):
            P = int(differ[0, 0])
    if P < min_prefix:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    if decoder is None or decoder is base or head is None:
        return None

    device = input_ids.device
    kv = _cache_kwarg(decoder)
    logps = torch.zeros(len(spans), logits_to_keep, device=device)
    entropies = torch.zeros(len(spans), logits_to_keep, device=device) if compute_entropy else None
    with autocast():
        prefix = DynamicCache(config=base.config)
        decoder(input_ids=first[None, :P], use_cache=True, position_ids=torch.arange(P, device=device)[None],
                **{kv: prefix})
    shared = [t for layer in prefix.layers for t in (layer.keys, layer.values)]

    def score_row(suffix: Any, n: int, *keys_values: Any) -> tuple[Any, Any]:
        own = DynamicCache(config=base.config)
        for li in range(len(keys_values) // 2):
            own.update(keys_values[2 * li], keys_values[2 * li + 1], li)
        at = len(suffix) - n - 1  # position i predicts token i + 1: the n positions before the row's last
        with autocast():
            hidden = decoder(input_ids=suffix[None], use_cache=True, **{kv: own},
                             position_ids=torch.arange(P, P + len(suffix), device=device)[None]).last_hidden_state
            logits = head(hidden[0, at : at + n])
        return _token_scores(logits, suffix[at + 1 :], temperature, compute_entropy, entropy_grad)

    # Each row runs alone on top of the prefix's keys and values (the same tensors, so their gradients add up):
    # batching the rows instead needs padding, a dense mask and a copy of the prefix per row, and measured 3-4x
    # slower on a CPU. With `checkpoint_rows` a row keeps no activations for the backward pass (its forward runs
    # again there); otherwise every row's activations, its copy of the prefix keys and values among them, stay
    # alive until the group's backward. A group of 8 with 3,300-token prompts, SmolLM2, 2 AVX2 cores: peak RSS
    # 15.8 GB kept vs 9.4 GB recomputed (12.7 GB row by row), 94.5 s vs 92.9 s (255 s row by row).
    for t, r in zip(tokens, rows):
        args = (t[P:], counts[r], *shared)
        if checkpoint_rows and torch.is_grad_enabled():
            lp, entropy = torch.utils.checkpoint.checkpoint(score_row, *args, use_reentrant=False)
        else:
            lp, entropy = score_row(*args)
        logps[r, : counts[r]] = lp
        if compute_entropy:
            entropies[r, : counts[r]] = entropy
    return logps, entropies
