"""The local policy backend: `LocalPolicy`, a transformers causal LM on this machine, batched generation with
its own KV-cache decode loop (the interface and the `None`-on-overflow contract: `trace_core.agents.policy`)."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

from trace_core.agents.chat import END_OF_TURN, render_prompt
from trace_core.agents.parsing import parse_assistant
from trace_core.agents.policy import Request, Sampling
from trace_core.schemas import Message

# Decode-loop choice. Measured on a shared 2-core AMD EPYC host (AVX2 only: no AMX / AVX512-BF16, so bf16 is
# emulated and a 64-token bf16 forward took 1.64 s vs 0.30 s in fp32; figures below are fp32, 1 torch thread,
# because with 2 threads on cores that other jobs also use every step was 2-5x slower). Real SmolLM2-135M,
# 608-token prompt (system + 3 tool schemas + user), 32 new tokens forced, end-to-end incl. prefill; load
# average 2-6 from other jobs, so runs vary by +-25%. Re-measure with `bench_decode` (bench/rollouts.py).
#                          batch 1 (3 runs)         batch 8 (2 runs)
#   HF model.generate      5.1-7.9 s  4.0-6.3 tok/s   29-56 s  4.6-8.8 tok/s
#   own loop               5.1-6.1 s  5.2-6.3 tok/s   35-49 s  5.2-7.3 tok/s
#   own loop + prefix      5.2-10.8 s 3.0-6.2 tok/s   18-20 s  12.8-14.6 tok/s
# (batch-8 prefill alone: 29-34 s plain vs 5.9-6.5 s with the shared prefix; decode ~0.17 s/step at batch 1,
# ~0.47 s/step at batch 8.) Without prefix sharing the two loops are equal within noise; with it ours is 1.5-3x
# faster at batch 8, and the cross-call prefix cache removes most of the re-prefill of later turns. It also
# drops finished rows (and their left padding) from the KV cache, samples each row from its own seeded
# generator, and returns per-token logprobs without materialising all scores. So the own loop is kept.


class LocalPolicy:
    """Batched generation with a local transformers model.

    Each request's prompt is its conversation rendered by the tokenizer's chat template (tools included, earlier
    local assistant turns written back as their exact `raw` text). Prompts are sorted by length and generated in
    chunks of `batch_size` (left padding). Greedy when `temperature == 0`; otherwise request i samples from
    its own `torch.Generator` seeded with `sampling.seed_for(i)` (`seeds[i]`, else `seed + i`), so a request's
    sample does not depend on which other requests share its batch (up to floating-point differences between batch
    shapes). Generation stops at the end-of-turn token (`<|im_end|>`), eos, or `max_new_tokens`.

    The returned Message is `parse_assistant(text)` with `raw` = the decoded text before the stop token,
    `token_ids` = every generated id including the final stop token when there is one (so training learns to
    stop), and `logprobs` = each token's log-probability under the temperature-scaled distribution (before
    top-p truncation; the raw distribution when greedy).

    Prompt-prefix reuse (`share_prefix`, `prefix_cache`): the longest token prefix shared by a chunk's prompts
    (system + tools for different episodes; all but the last token for a single request) is prefilled once and
    its KV expanded over the batch, and the last such prefix is kept for the next call, so the next turn of an
    episode or the next batch over the same tools only prefills what is new. Rows that share a longer prefix in
    groups (episodes with the same tool subset) prefill each group's prefix once too (`branch_prefixes`). The kept KV is keyed on a
    fingerprint of the weights (every parameter's storage pointer and in-place version counter, plus the active
    PEFT adapter name), so optimizer steps invalidate it; call `clear_prefix_cache()` after changes that touch
    neither (e.g. `disable_adapter()`). Each row of the last batched call keeps its KV too (`row_cache`, on with
    `prefix_cache`), so the next turn of every episode in a batch starts from its own previous prompt and reply
    (`bench/rollouts.py --stock-cache`, SmolLM2-135M bf16, batch 8, 8 four-turn episodes: x1.40 tokens/s over
    batched turns without it). The model is put in eval mode while generating and restored after.
    Not thread-safe: one `generate` at a time.
    """

    def __init__(
        self,
        model_path: str | os.PathLike | None = None,
        *,
        batch_size: int,
        max_context: int,
        dtype: str | None = None,
        threads: int | None = None,
        model: Any = None,
        tokenizer: Any = None,
        name: str | None = None,
        share_prefix: bool = True,
        prefix_cache: bool = True,
        min_prefix: int = 16,
        decode_attention: bool = True,
    ):
        from trace_core.agents.model import load_model, load_tokenizer, set_threads

        if model is None and model_path is None:
            raise ValueError("LocalPolicy needs model_path or an already-loaded model + tokenizer")
        if model is None and (dtype is None or threads is None):
            raise ValueError("LocalPolicy(model_path) loads the model: pass dtype= and threads= (params model.dtype, "
                             "model.threads)")
        set_threads(threads or 0)
        if model is None:
            model = load_model(model_path, dtype=dtype, threads=threads)
        if tokenizer is None:
            if model_path is None:
                raise ValueError("pass tokenizer= together with model=")
            tokenizer = load_tokenizer(model_path)
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.max_context = int(max_context)
        self.name = name or f"local:{Path(str(model_path)).name if model_path else type(model).__name__}"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = int(tokenizer.pad_token_id)
        self.stop_ids = self._stop_ids()
        self._cache_kw = _cache_kwarg(model)
        self.share_prefix = share_prefix
        # On CPU, decode steps use `_decode_attention` (two matmuls) instead of SDPA's kernel: see its docstring.
        self.decode_attention = decode_attention
        self.grow_in_place = True  # KV cache appends in place (`_growing`); False: transformers' concatenating cache
        self.prefix_cache = prefix_cache
        self.min_prefix = int(min_prefix)
        self._prefix: tuple | None = None  # (weights fingerprint, token ids, [(keys, values) per layer])
        # Each row of the last batched call: (token ids fed, [(keys, values) per layer], batch 1), so that the next
        # turn of every episode in a batch prefills only its new tokens (`row_cache`).
        self.row_cache = prefix_cache
        # Rows that share more than the batch-wide prefix in groups (same tools, same opening) prefill each
        # group's prefix once (`_branch_rows`).
        self.branch_prefixes = share_prefix
        self._rows: tuple | None = None  # (weights fingerprint, [(token ids, [(keys, values) per layer])])
        self.prefix_stats = {"reused": 0, "computed": 0}
        # Wall seconds in prompt prefill (shared prefixes included) and in decode steps, summed over calls.
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}
        self.dtype = str(getattr(model, "dtype", "")).replace("torch.", "")

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, **kwargs: Any) -> LocalPolicy:
        """Wrap an already-loaded model (e.g. the one being trained); torch's thread count is left alone unless
        `threads` is given. `batch_size` and `max_context` are required (params policy.batch_size, max_context)."""
        return cls(model=model, tokenizer=tokenizer, **kwargs)

    def _stop_ids(self) -> set[int]:
        tok = self.tokenizer
        ids: set[int] = set()
        for t in (END_OF_TURN, tok.eos_token, "<|endoftext|>"):
            if not t:
                continue
            i = tok.convert_tokens_to_ids(t)
            if isinstance(i, int) and i >= 0 and (i != tok.unk_token_id or t == tok.unk_token):
                ids.add(i)
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif isinstance(gen_eos, (list, tuple)):
            ids.update(int(i) for i in gen_eos)
        return ids

    # -- public API ------------------------------------------------------------------------------------------

    def prompt_ids(self, request: Request) -> list[int]:
        """The token context of a request's next assistant turn (subclasses may build it differently)."""
        msgs, tools = request
        return self._encode([render_prompt(self.tokenizer, msgs, tools)])[0]

    def generate(self, requests: list[Request], sampling: Sampling) -> list[Message | None]:
        outs = self.generate_ids([self.prompt_ids(r) for r in requests], sampling)
        result: list[Message | None] = []
        for out in outs:
            if out is None:
                result.append(None)
                continue
            ids, logprobs, text = out
            msg = parse_assistant(text)
            msg.token_ids = ids
            msg.logprobs = logprobs
            result.append(msg)
        return result

    def complete_texts(self, conversations: list[list[dict]], sampling: Sampling) -> list[str | None]:
        """Plain chat completion (no tools): role/content dicts in, reply text out (None: context overflow)."""
        prompts = [
            self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            for conv in conversations
        ]
        return [None if o is None else o[2] for o in self.generate_ids(self._encode(prompts), sampling)]

    def generate_ids(
        self, prompts: list[list[int]], sampling: Sampling
    ) -> list[tuple[list[int], list[float], str] | None]:
        """Token-level generation: prompt ids in; (generated ids, logprobs, text before the stop token) out, or
        None for a prompt longer than `max_context`."""
        results: list[tuple[list[int], list[float], str] | None] = [None] * len(prompts)
        todo = [i for i, p in enumerate(prompts) if len(p) <= self.max_context]
        todo.sort(key=lambda i: (len(prompts[i]), i))  # similar lengths together: less padding
        was_training = bool(getattr(self.model, "training", False))
        if was_training:
            self.model.eval()
        config = getattr(self.model, "config", None)
        attn = getattr(config, "_attn_implementation", None)
        swap = self.decode_attention and attn == "sdpa" and next(self.model.parameters()).device.type == "cpu"
        if swap:
            config._attn_implementation = _decode_attention_name()
        try:
            for start in range(0, len(todo), self.batch_size):
                chunk = todo[start : start + self.batch_size]
                outs = self._decode_batch([prompts[i] for i in chunk], sampling, [sampling.seed_for(i) for i in chunk])
                for i, (ids, lps) in zip(chunk, outs, strict=True):
                    body = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
                    text = self.tokenizer.decode(body, skip_special_tokens=False)
                    results[i] = (ids, lps, text)
        finally:
            if swap:
                config._attn_implementation = attn
            if was_training:
                self.model.train()
        return results

    # -- internals -------------------------------------------------------------------------------------------

    def _encode(self, prompts: list[str]) -> list[list[int]]:
        if not prompts:
            return []
        enc = self.tokenizer(prompts, add_special_tokens=False)
        return [list(ids) for ids in enc["input_ids"]]

    def _max_new(self, prompt_len: int, sampling: Sampling) -> int:
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        n = int(sampling.max_new_tokens)
        if isinstance(limit, int) and limit > 0:
            n = min(n, limit - prompt_len)
        return max(0, n)

    def clear_prefix_cache(self) -> None:
        """Forget the cached prompt-prefix KV (call after changing weights in a way that leaves every parameter's
        storage and version counter untouched, e.g. switching or disabling PEFT adapters)."""
        self._prefix = None
        self._rows = None

    def _weights_fingerprint(self) -> tuple:
        """Changes whenever a parameter is replaced or updated in place (optimizer steps bump `_version`)."""
        model = self.model
        active = getattr(model, "active_adapter", None)
        if callable(active):
            try:
                active = active()
            except Exception:  # noqa: BLE001 - no adapters loaded
                active = None
        return (
            id(model),
            str(active),
            tuple((p.data_ptr(), p._version) for p in model.parameters()),
        )

    def _prefill_prefix(self, prefix: list[int]) -> Any:
        """A batch-1 DynamicCache holding `prefix`, reusing the longest matching part of the previous call's."""
        fp = self._weights_fingerprint()
        reuse, base = 0, None
        st = self._prefix
        if st is not None and st[0] == fp:
            old = st[1]
            reuse = _common_prefix(old, prefix, min(len(old), len(prefix)))
            base = st[2]
        cache = self._extend(base, reuse, prefix)
        if self.prefix_cache:
            self._prefix = (fp, list(prefix), [(layer.keys, layer.values) for layer in cache.layers])
        return cache

    def _extend(self, base: list[tuple[Any, Any]] | None, n: int, tokens: list[int]) -> Any:
        """A batch-1 cache holding `tokens`: the first `n` positions copied from `base` (per-layer keys and
        values, batch 1), the rest prefilled."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        if self.grow_in_place:
            cache = _growing(cache)
        for li, (k, v) in enumerate(base if n else ()):
            cache.update(k[..., :n, :], v[..., :n, :], li)
        if n < len(tokens):
            device = next(self.model.parameters()).device
            self.model(
                input_ids=torch.tensor([tokens[n:]], dtype=torch.long, device=device),
                attention_mask=torch.ones((1, len(tokens)), dtype=torch.long, device=device),
                position_ids=torch.arange(n, len(tokens), device=device)[None],
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
        self.prefix_stats["reused"] += n
        self.prefix_stats["computed"] += len(tokens) - n
        return cache

    def _branch_rows(self, prompts: list[list[int]], own: list, P: int, root: Any) -> list:
        """`own` with an entry for each row that had none and shares more than the common prefix `P` with another
        such row: (that longer prefix's length, its KV). The prompts of different episodes often share far more
        than the prefix common to all (the same tools, the same opening) in several groups; each distinct branch
        point of their prefix tree is prefilled once, from the longest branch point below it, or from `root`
        (the common prefix's batch-1 cache). One at a time, consecutive episodes only ever reuse the previous
        prompt's prefix, so without this a batch would prefill more than the same episodes one after another."""
        free = [r for r, o in enumerate(own) if o is None]
        depth = dict.fromkeys(free, 0)
        points: dict[tuple, list[int]] = {}  # every pairwise common prefix worth sharing: the tree's branch points
        for i, r in enumerate(free):
            for s in free[i + 1 :]:
                # At least one prompt token stays unprefilled: its forward gives the row's first logits.
                k = _common_prefix(prompts[r], prompts[s], min(len(prompts[r]), len(prompts[s])) - 1)
                if k >= P + self.min_prefix:
                    depth[r], depth[s] = max(depth[r], k), max(depth[s], k)
                    points.setdefault(tuple(prompts[r][:k]), prompts[r][:k])
        root_kv = [(layer.keys, layer.values) for layer in root.layers] if root is not None else None
        done: list[tuple[list[int], list[tuple[Any, Any]]]] = []  # (branch point, its KV), longest first
        kv: dict[tuple, list[tuple[Any, Any]]] = {}
        for key in sorted(points, key=len):
            tokens = points[key]
            below = next(((len(t), layers) for t, layers in done if tokens[: len(t)] == t), None)
            n, src = below if below is not None else ((P, root_kv) if root is not None else (0, None))
            layers = [(layer.keys, layer.values) for layer in self._extend(src, n, tokens).layers]
            done.insert(0, (tokens, layers))
            kv[key] = layers
        out = list(own)
        for r in free:
            if depth[r]:
                out[r] = (depth[r], kv[tuple(prompts[r][: depth[r]])])
        return out

    def _decode_batch(
        self, prompts: list[list[int]], sampling: Sampling, seeds: list[int]
    ) -> list[tuple[list[int], list[float]]]:
        import torch
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        model = self.model
        device = next(model.parameters()).device
        B = len(prompts)
        max_new = self._max_new(max(len(p) for p in prompts), sampling)
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lps: list[list[float]] = [[] for _ in range(B)]
        if max_new == 0 or any(len(p) == 0 for p in prompts):
            return list(zip(out_ids, out_lps))

        # The shared prompt prefix (system + tools, and for one request all but its last token) is computed
        # once (or taken from the previous call) and its KV expanded over the batch; only suffixes are prefilled.
        cache = DynamicCache(config=model.config)
        plain = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
        if plain and self.grow_in_place:
            cache = _growing(cache)
        P = 0
        if self.share_prefix and plain:
            P = min(len(p) for p in prompts) - 1
            for p in prompts[1:]:
                P = _common_prefix(prompts[0], p, P)
            if P < self.min_prefix:
                P = 0

        # A row whose prompt extends a row of the previous call (the next turn of the same episode) starts from
        # that row's KV instead of the shared prefix, when that covers more of it.
        fp = self._weights_fingerprint() if plain and self.row_cache else None
        own = self._matching_rows(prompts, fp, P) if fp is not None else [None] * B

        greedy = sampling.temperature <= 0
        temp = float(sampling.temperature) if not greedy else 1.0
        top_p = float(sampling.top_p)
        gens = []
        if not greedy:
            for s in seeds:
                g = torch.Generator(device="cpu")
                g.manual_seed(int(s) & 0xFFFF_FFFF_FFFF)
                gens.append(g)
        stop = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=device)

        saved: dict[int, Any] = {}  # request index -> its KV when it stopped (for `row_cache`)
        started = time.perf_counter()
        with torch.inference_mode():
            root = None
            if plain and self.share_prefix and self.branch_prefixes and sum(o is None for o in own) > 1:
                root = self._prefill_prefix(prompts[0][:P]) if P else None
                own = self._branch_rows(prompts, own, P, root)
            cached = [P if o is None else o[0] for o in own]
            groups = _length_groups([len(p) - c for p, c in zip(prompts, cached)]) if plain else [list(range(B))]
            rows = [r for g in groups for r in g]  # live row -> request index in this chunk
            if len(groups) == 1 and all(o is None for o in own):
                if P:  # the shared prefix, expanded over the batch
                    cache = root if root is not None else self._prefill_prefix(prompts[0][:P])
                    if B > 1:
                        cache.batch_repeat_interleave(B)
                parts = [self._prefill_rows(cache, prompts, own, cached, None, P, device)]
            else:
                shared = None
                if P and any(o is None for o in own):
                    shared = root if root is not None else self._prefill_prefix(prompts[0][:P])
                parts = []
                for g in groups:
                    part = DynamicCache(config=model.config)
                    part = _growing(part) if self.grow_in_place else part
                    parts.append(self._prefill_rows(part, [prompts[r] for r in g], [own[r] for r in g],
                                                    [cached[r] for r in g], shared, P, device))
            if len(parts) == 1:
                cache, mask, next_pos, logits = parts[0]
            else:  # rows whose new tokens differ a lot in number were prefilled apart (no padding to the longest)
                cache, mask = self._merge(parts, model.config)
                next_pos = torch.cat([part[2] for part in parts])
                logits = torch.cat([part[3] for part in parts])
            prefilled = time.perf_counter()
            self.timing["prefill_s"] += prefilled - started
            for step in range(max_new):
                logits = logits.float()
                if greedy:
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = logits.argmax(dim=-1)
                else:
                    logp = torch.log_softmax(logits / temp, dim=-1)
                    probs = logp.exp()
                    if top_p < 1.0:
                        probs = _top_p_filter(probs, top_p)
                    tok = torch.stack(
                        [torch.multinomial(probs[k].cpu(), 1, generator=gens[rows[k]])[0] for k in range(len(rows))]
                    ).to(device)
                tok_lp = logp.gather(1, tok[:, None])[:, 0]
                done = torch.isin(tok, stop)
                for k, r in enumerate(rows):
                    out_ids[r].append(int(tok[k]))
                    out_lps[r].append(float(tok_lp[k]))
                if step == max_new - 1:
                    break
                keep = (~done).nonzero()[:, 0]
                if fp is not None:
                    for k in done.nonzero()[:, 0].tolist():
                        saved[rows[k]] = self._row_kv(cache, mask, k)
                if keep.numel() == 0:
                    break
                if keep.numel() < len(rows):
                    rows = [rows[k] for k in keep.tolist()]
                    mask, tok, next_pos = mask[keep], tok[keep], next_pos[keep]
                    # Drop leading columns that are padding for every remaining row (finished long prompts').
                    lead = int(mask.any(dim=0).long().argmax()) if plain else 0
                    mask = mask[:, lead:]
                    if all(hasattr(layer, "select_rows") for layer in cache.layers):
                        for layer in cache.layers:
                            layer.select_rows(keep, lead)
                    else:
                        cache.batch_select_indices(keep)
                        for layer in cache.layers if lead else ():
                            layer.keys = layer.keys[..., lead:, :]
                            layer.values = layer.values[..., lead:, :]
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
                logits = model(
                    input_ids=tok[:, None],
                    attention_mask=mask,
                    position_ids=next_pos[:, None],
                    use_cache=True,
                    **{self._cache_kw: cache},
                ).logits[:, -1, :]
                next_pos = next_pos + 1
            self.timing["decode_s"] += time.perf_counter() - prefilled
            if fp is not None:
                for k, r in enumerate(rows):
                    if r not in saved:
                        saved[r] = self._row_kv(cache, mask, k)
                entries = []
                for r in range(B):
                    fed = list(prompts[r]) + out_ids[r][:-1]  # the last sampled token was never fed
                    if saved.get(r) is not None and len(fed) == saved[r][0]:
                        entries.append((fed, saved[r][1]))
                self._rows = (fp, entries)
        return list(zip(out_ids, out_lps))

    def _matching_rows(self, prompts: list[list[int]], fp: tuple, shared: int) -> list[tuple | None]:
        """For each prompt, (tokens reusable, layers' KV) from the previous call's row with the longest common
        prefix, if that is longer than the `shared` prefix; else None."""
        if self._rows is None or self._rows[0] != fp or not self._rows[1]:
            return [None] * len(prompts)
        out: list[tuple | None] = []
        for p in prompts:
            best, best_kv = 0, None
            for fed, kv in self._rows[1]:
                n = min(len(fed), len(p) - 1)  # at least one prompt token is fed, for its logits
                k = 0
                while k < n and fed[k] == p[k]:
                    k += 1
                if k > best:
                    best, best_kv = k, kv
            out.append((best, best_kv) if best_kv is not None and best > max(shared, self.min_prefix) else None)
        self.prefix_stats["reused"] += sum(o[0] for o in out if o is not None)
        return out

    @staticmethod
    def _row_kv(cache: Any, mask: Any, k: int) -> tuple[int, list[tuple[Any, Any]]]:
        """Row k's real (unpadded) keys and values per layer, batch 1, and how many positions that is."""
        keep = mask[k].bool()
        layers = [(layer.keys[k : k + 1][:, :, keep, :], layer.values[k : k + 1][:, :, keep, :])
                  for layer in cache.layers]
        return int(keep.sum()), layers

    def _prefill_rows(self, cache: Any, prompts: list[list[int]], own: list, cached: list[int], shared: Any,
                      P: int, device: Any) -> tuple[Any, Any, Any, Any]:
        """Prefill rows whose first `cached[r]` tokens have KV already (their own, `own[r]`, or the shared prefix):
        `cache` is assembled from those unless it already holds them (the expanded prefix), then one forward
        over the left-padded remainders. Returns (cache, attention mask, next position per row, last logits)."""
        import torch

        C = max(cached)
        if any(o is not None for o in own) or (shared is not None and C):
            cache = self._assemble(cache, own, shared, P, C)
        suffixes = [p[c:] for p, c in zip(prompts, cached)]
        b, Ls = len(prompts), max(len(x) for x in suffixes)
        ids = torch.full((b, Ls), self.pad_id, dtype=torch.long)
        smask = torch.zeros((b, Ls), dtype=torch.long)
        for r, sfx in enumerate(suffixes):
            ids[r, Ls - len(sfx) :] = torch.tensor(sfx, dtype=torch.long)
            smask[r, Ls - len(sfx) :] = 1
        ids, smask = ids.to(device), smask.to(device)
        pos = torch.tensor(cached, device=device)[:, None] + (smask.cumsum(-1) - 1).clamp(min=0)
        cmask = torch.zeros((b, C), dtype=torch.long, device=device)
        for r, c in enumerate(cached):
            cmask[r, C - c :] = 1  # each row's cached part is right-aligned against its suffix
        mask = torch.cat([cmask, smask], dim=1)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return cache, mask, pos[:, -1] + 1, out.logits[:, -1, :]

    def _merge(self, parts: list[tuple], config: Any) -> tuple[Any, Any]:
        """One batch cache and mask from separately prefilled parts, each left-padded to the widest."""
        import torch
        import torch.nn.functional as F
        from transformers import DynamicCache

        width = max(part[1].shape[1] for part in parts)
        merged = DynamicCache(config=config)
        if self.grow_in_place:
            merged = _growing(merged)
        for li, layer in enumerate(merged.layers):
            keys, values = [], []
            for part in parts:
                k, v = part[0].layers[li].keys, part[0].layers[li].values
                keys.append(F.pad(k, (0, 0, width - k.shape[-2], 0)))
                values.append(F.pad(v, (0, 0, width - v.shape[-2], 0)))
            layer.update(torch.cat(keys), torch.cat(values))
        mask = torch.cat([F.pad(part[1], (width - part[1].shape[1], 0)) for part in parts])
        return merged, mask

    def _assemble(self, cache: Any, own: list, shared: Any, P: int, C: int) -> Any:
        """A batch cache of width C: row r holds its own previous KV (`own[r]`) or the shared prefix, right-aligned
        (left padding is masked)."""
        mine = next((o for o in own if o is not None), None)
        for li, layer in enumerate(cache.layers):
            first = mine[1][li][0] if mine is not None else shared.layers[li].keys
            b, h, d = len(own), first.shape[1], first.shape[-1]
            keys = first.new_zeros((b, h, C, d))
            values = first.new_zeros((b, h, C, d))
            for r, o in enumerate(own):
                if o is None:
                    if not P:
                        continue
                    k_src, v_src, n = shared.layers[li].keys, shared.layers[li].values, P
                else:
                    n = o[0]
                    k_src, v_src = o[1][li]
                keys[r, :, C - n :, :] = k_src[0, :, :n, :]
                values[r, :, C - n :, :] = v_src[0, :, :n, :]
            layer.update(keys, values)
        return cache


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, up to `limit`."""
    k = 0
    while k < limit and a[k] == b[k]:
        k += 1
    return k


def _length_groups(lengths: list[int]) -> list[list[int]]:
    """Row indices grouped so that no row is padded to more than about twice its own length plus 64 tokens: the
    next turn of a running episode (tens to hundreds of new tokens) is not prefilled padded to the length of a
    new episode's whole prompt (thousands, when its tools differ from the others'). One group: the input order."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= 2 * lengths[groups[-1][0]] + 64:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups if len(groups) > 1 else [list(range(len(lengths)))]


def _growing(cache: Any) -> Any:
    """`cache` with its plain `DynamicLayer`s replaced by `_GrowingLayer`s (other layer kinds are kept)."""
    from transformers.cache_utils import DynamicLayer

    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cls = _growing_layer_class()
        cache.layers = [cls() for _ in cache.layers]
    return cache


@functools.cache
def _growing_layer_class() -> type:
    """The layer class, defined on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A `DynamicLayer` that appends new keys/values into spare capacity of a preallocated buffer. The stock
        layer concatenates, copying the whole cache at every decoded token: measured with SmolLM2-135M at batch 8
        and ~2,500-token prompts, `aten::cat` was 35% of decoding time. `keys`/`values` stay views of the buffer's
        filled part, so everything that reads or replaces them (batch selection, trimming) works unchanged; a
        layer whose tensors were replaced starts a new buffer at the next update (one copy)."""

        headroom = 256  # spare positions per (re)allocation: one copy per this many decoded tokens

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, t = self.get_seq_length(), key_states.shape[-2]
            kb, vb = getattr(self, "_kbuf", None), getattr(self, "_vbuf", None)
            fits = (
                n > 0
                and kb is not None
                and self.keys.data_ptr() == kb.data_ptr()
                and self.values.data_ptr() == vb.data_ptr()
                and self.keys.shape[0] == kb.shape[0] == key_states.shape[0]
                and n + t <= kb.shape[-2]
            )
            if not fits:
                b, h, _, d = key_states.shape
                kb = key_states.new_empty((b, h, n + t + self.headroom, d))
                vb = value_states.new_empty((b, value_states.shape[1], n + t + self.headroom, value_states.shape[-1]))
                if n:
                    kb[..., :n, :] = self.keys
                    vb[..., :n, :] = self.values
                self._kbuf, self._vbuf = kb, vb
            kb[..., n : n + t, :] = key_states
            vb[..., n : n + t, :] = value_states
            self.keys, self.values = kb[..., : n + t, :], vb[..., : n + t, :]
            return self.keys, self.values

        def select_rows(self, indices: Any, lead: int = 0) -> None:
            """Keep the rows `indices`, without their first `lead` positions, in one copy that keeps the spare
            capacity (selecting and trimming the filled part instead would cost a second copy at the next
            update, to make room again)."""
            n = self.get_seq_length()
            kb, vb = getattr(self, "_kbuf", None), getattr(self, "_vbuf", None)
            if n and kb is not None and self.keys.data_ptr() == kb.data_ptr() and self.values.data_ptr() == vb.data_ptr():
                self._kbuf, self._vbuf = kb[indices, :, lead:, :], vb[indices, :, lead:, :]
                self.keys, self.values = self._kbuf[..., : n - lead, :], self._vbuf[..., : n - lead, :]
            elif n:
                self.keys, self.values = self.keys[indices, :, lead:, :], self.values[indices, :, lead:, :]

    return GrowingLayer


def _decode_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any) -> tuple[Any, None]:
    """Attention for one new token per row, as two batched matmuls with the softmax in float32; anything else
    (prefill, dropout, position bias) goes to transformers' SDPA function unchanged.

    Why: for a decode step the query is 1 token per row against thousands of cached keys, and PyTorch's CPU SDPA
    kernels, built for long queries, were half as fast as plain matmuls on the same tensors (SmolLM2 shapes, batch
    16, 3 KV heads x 3 query heads, 1,500 keys, bf16: 13.2 ms vs 6.2 ms per layer, 2 cores). The query heads that
    share a KV head become rows of one matmul, as transformers' `pack_gqa` does, so keys are never repeated."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    if key.dtype in (torch.bfloat16, torch.float16) and not key.is_contiguous():
        # The growing cache's keys are a view of a buffer with spare capacity. Half-precision batched matmuls on
        # such strided operands take a slow path on some CPUs (2-core Zen 4, bf16, batch 16, 1,500 keys: 2.29 ms
        # vs 0.45 ms contiguous, and x4 at batch 1; float32 runs at the same speed either way), and one copy costs
        # 0.12 ms. Values are left as they are: their penalty there is about the cost of the copy.
        key = key.contiguous()
    q = query.reshape(b, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).float()
    scores.mul_(scaling if scaling is not None else d**-0.5)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores.masked_fill_(~attention_mask, float("-inf"))
        else:
            scores.add_(attention_mask.float())
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # (batch, kv heads, query heads per kv head, dim)
    return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous(), None


@functools.cache
def _decode_attention_name() -> str:
    """Register `_decode_attention` with transformers (attention function + SDPA's mask format), once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = "trace_decode"
    AttentionInterface.register(name, _decode_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.2x names the KV-cache argument `cache` (`past_key_values` is deprecated)."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _top_p_filter(probs: Any, top_p: float) -> Any:
    """Zero the tail outside the smallest set of tokens whose mass reaches top_p (the top token always stays)."""
    import torch

    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    drop = (cum - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)
