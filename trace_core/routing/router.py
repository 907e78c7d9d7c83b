"""The training-free router of stage 4 (docs/method.md §4).

Two ways for the base model (no adapter) to score the options, both training-free:

- `scoring="label"` (the paper's): the model reads a routing prompt — a classifier instruction, the task's opening
  context and one lettered line per capability, plus one line for "no adapter" — and its next-token logits over
  the label tokens, put through a softmax at temperature 1, are the routing probabilities α.
- `scoring="channel"` (ours, for models too small to answer a lettered question): for each option the model reads
  a short card — the skill's name and description and, optionally, a few example customer messages that need it —
  and scores the task's opening as the card's next example: α_c ∝ p(task | card_c) (a uniform prior over options,
  i.e. the posterior of a "noisy channel" classifier, Min et al. 2022). Measured with SmolLM2-135M on 8 tasks of
  each synthesis template: label 0/40, channel with descriptions only 12/40, channel with 2 examples per skill
  36/40 (chance 1/6); see `Router`.

The paper runs the adapter of the most probable option (or the base model when "no adapter" wins);
`route(top_p > 0)` is our extension that keeps the smallest top-p set of labels and composes their adapters,
W' = W + Σ α_c B_c A_c (see `compose.AdapterBank`).

Everything here is a pure, deterministic function of its inputs (model weights, tokenizer, options, tasks).
torch is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trace_core.config import ROUTER_SCORINGS

# The scorings the base model does here; "gate" (a classifier trained per run) is `trace_core.routing.gate`.
SCORINGS = tuple(s for s in ROUTER_SCORINGS if s != "gate")

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

NO_ADAPTER_NAME = "no specialist"
NO_ADAPTER_DESCRIPTION = (
    "none of the other skills is needed: small talk, a question outside this customer service, or a request that "
    "no listed skill fits"
)

# `max_task_chars` (params evaluation.router.max_task_chars): the agent's first user message is a few hundred
# characters in every task family we have (τ² openings are reason-for-call + known info, 200-900 characters). The
# budget only guards against a pathological opening that would push the options out of a small model's attention;
# it is in characters so that the prompt does not depend on the tokenizer.

SYSTEM_PROMPT = (
    "You are a router for a customer-service agent. Read the customer's first message and choose the one skill "
    "the agent will need most to handle it. Reply with the letter of that option only."
)

# `answer_prefix` (params evaluation.router.answer_prefix) primes the assistant turn so that the very next token is
# the label. Measured on SmolLM2's tokenizer:
# "Answer:" followed by " B" gives the label as one token ("ĠB"), while a trailing space ("Answer: ") would be
# merged into the label's token and break the single-token property. A bare label right after the generation
# prompt (answer_prefix="") is one token too, but routed no better on SmolLM2 (0/20 template tasks right in a
# first measurement) and sent 0/10 distractors to "no adapter", where "Answer:" sent 10/10.

# The "no adapter" card's example messages for channel scoring: small talk and requests no customer-service skill
# serves. Fixed text, like its description, and all of them are shown whenever the capability cards show examples:
# "no adapter" stands for everything else, so one or two examples would cover too little of it. (The small-talk
# example was added after SmolLM2 sent 3 of the 10 test distractors, all greetings, to a capability; the second
# distractor list in tests/routing/test_router.py was written afterwards and held out of that choice.)
NO_ADAPTER_EXAMPLES = (
    "Good afternoon! I just wanted to say thanks, everything is fine.",
    "What time is it in Tokyo right now?",
    "Can you translate 'good morning' into Italian for me?",
    "Who won the football match last night?",
)

# Zhao et al. (2021) contextual calibration: the label distribution the model gives a task without content measures
# its bias towards some labels (position, letter frequency); dividing by it removes that bias.
CONTENT_FREE_TASKS = ("N/A",)


class RoutingError(ValueError):
    """A routing prompt or option set that cannot work (the message says what to change)."""


@dataclass(frozen=True)
class RouteOption:
    """One routing option: `label` (a letter) names the capability `capability_id` (None = the base model, no
    adapter); `examples` are task openings that need it (channel scoring only)."""

    label: str
    capability_id: str | None
    name: str
    description: str
    examples: tuple[str, ...] = ()  # example task openings for channel scoring (see `channel_card`)


@dataclass(frozen=True)
class Route:
    """The routing decision for one task.

    `probabilities`: label -> α for every option (after calibration, if on). `top`: the capability of the most
    probable label (None = base model). `labels`: the labels kept (one for top_p = 0). `chosen`: the capability ids
    to activate (empty = base model). `weights`: capability id -> α over `chosen` (see `select`)."""

    probabilities: dict[str, float]
    top: str | None
    labels: list[str]
    chosen: list[str]
    weights: dict[str, float] = field(default_factory=dict)


def _field(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        if key not in obj:
            raise RoutingError(f"capability {obj!r} has no {key!r}; give capability_id, name and definition")
        return obj[key]
    if not hasattr(obj, key):
        raise RoutingError(f"capability {obj!r} has no attribute {key!r}; give capability_id, name and definition")
    return getattr(obj, key)


def build_options(
    capabilities: Iterable[Any], examples: Mapping[str, Sequence[str]] | None = None, num_examples: int = 0
) -> list[RouteOption]:
    """The routing options for `capabilities` (objects or dicts with capability_id, name, definition): "no adapter"
    first as A, then the capabilities in the given order as B, C, ...

    `num_examples` > 0 gives each option up to that many example openings for channel scoring: a capability's
    from `examples[capability_id]` (e.g. its synthetic environment's training instances); the no-adapter option
    then shows all of `NO_ADAPTER_EXAMPLES`. A capability without examples then raises, so that no option is silently
    scored with a different kind of card than the others.

    Why "no adapter" goes first: its label then never changes when capabilities are added or removed (docs/method.md §4:
    adding a capability only adds a line to the prompt, here at the end, leaving every earlier label as it was),
    and a small model's position bias towards the first option, if any, favours the safe choice — the base model —
    rather than an arbitrary adapter."""
    caps = list(capabilities)
    if len(caps) + 1 > len(LETTERS):
        raise RoutingError(f"{len(caps)} capabilities, but at most {len(LETTERS) - 1} fit the lettered labels")
    if num_examples < 0:
        raise RoutingError(f"num_examples must be >= 0, got {num_examples}")
    examples = examples or {}
    options = [RouteOption(LETTERS[0], None, NO_ADAPTER_NAME, NO_ADAPTER_DESCRIPTION,
                           NO_ADAPTER_EXAMPLES if num_examples else ())]
    seen: set[str] = set()
    for i, cap in enumerate(caps, start=1):
        cid = _field(cap, "capability_id")
        if not cid or cid in seen:
            raise RoutingError(f"capability ids must be non-empty and unique; {cid!r} is not")
        seen.add(cid)
        shown: tuple[str, ...] = ()
        if num_examples:
            shown = tuple(str(x) for x in examples.get(str(cid), ()) if str(x).strip())[:num_examples]
            if not shown:
                raise RoutingError(
                    f"num_examples={num_examples} but capability {cid!r} has no example openings; pass them in "
                    "`examples` (its synthetic training instances) or use num_examples=0"
                )
        options.append(RouteOption(LETTERS[i], str(cid), str(_field(cap, "name")), str(_field(cap, "definition")),
                                   shown))
    return options


def task_text(instance: Any) -> str:
    """What the agent sees of `instance` when the episode starts, and so all the router may see: the opening user
    message.

    That is `instance.opening` — the scripted and the LLM user both send it verbatim — or, when an instance has no
    opening, `user_goal`, which the scripted user then sends verbatim (an LLM user would write its own first message
    from it; route on that message when you have it). The hidden parts — reference actions, `user_facts` not yet
    said, `communicate_info`, the family — are never used. Neither are the system prompt and tool list: the
    system prompt is the same for every task of a domain, and the compact profile's per-family tool subset is a
    simplification of ours, not something a target environment shows (τ² gives every task all its tools), so
    routing on it would measure a leak rather than the router."""
    text = getattr(instance, "opening", None) or getattr(instance, "user_goal", None)
    if not text:
        raise RoutingError(f"instance {getattr(instance, 'instance_id', instance)!r} has neither opening nor user_goal")
    return str(text)


def _truncate(text: str, max_chars: int) -> str:
    text = text.strip()
    if len(text) <= max_chars:
        return text
    return text[:max_chars].rstrip() + " [...]"


def routing_messages(
    task: str, options: Sequence[RouteOption], max_task_chars: int
) -> list[dict[str, str]]:
    """The routing prompt M_x as chat messages (system + user); the assistant turn is primed by `routing_prompt`."""
    lines = [f"{o.label}: {o.name} — {o.description}" for o in options]
    user = (
        "Customer's first message:\n"
        f"<<<\n{_truncate(task, max_task_chars)}\n>>>\n\n"
        "Options:\n" + "\n".join(lines) + "\n\n"
        f"Which option fits best? Answer with one letter ({', '.join(o.label for o in options)})."
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def routing_prompt(
    tokenizer: Any,
    task: str,
    options: Sequence[RouteOption],
    max_task_chars: int,
    answer_prefix: str,
) -> str:
    """The routing prompt as text: the chat template with the generation prompt, then `answer_prefix`, so that the
    next token is the label."""
    text = tokenizer.apply_chat_template(
        routing_messages(task, options, max_task_chars), add_generation_prompt=True, tokenize=False
    )
    return text + answer_prefix


def _continuation(answer_prefix: str, label: str) -> str:
    # After a visible prefix ("Answer:") the label follows a space, as it would in ordinary text; right after the
    # generation prompt (which ends with a newline) it comes bare.
    return (" " + label) if answer_prefix and not answer_prefix[-1].isspace() else label


def channel_card(option: RouteOption, max_task_chars: int) -> str:
    """The text channel scoring conditions on for `option`; the task follows it as " " + opening. Plain text, not
    the chat template: the scored text is the customer's message itself, read as the next item of a list."""
    head = f"Skill: {option.name}. {option.description}\n"
    if not option.examples:
        return head + "A customer's message that needs this skill:\n-"
    shown = "".join(f"- {_truncate(x, max_task_chars)}\n" for x in option.examples)
    return head + "Customer messages that need this skill:\n" + shown + "-"


def label_token_ids(tokenizer: Any, prompt: str, options: Sequence[RouteOption], answer_prefix: str) -> list[int]:
    """The token id of each option's label at the position after `prompt`; raises RoutingError unless every label
    is exactly one token there, the prompt's own tokens are unchanged by appending it, and the ids are distinct."""
    base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = []
    for o in options:
        cont = _continuation(answer_prefix, o.label)
        full = tokenizer(prompt + cont, add_special_tokens=False)["input_ids"]
        extra = full[len(base) :]
        if full[: len(base)] != base or len(extra) != 1:
            pieces = tokenizer.convert_ids_to_tokens(full[max(0, len(base) - 2) :])
            raise RoutingError(
                f"label {o.label!r} is not a single token after the routing prompt (answer prefix "
                f"{answer_prefix!r}): the prompt's end tokenizes as {pieces}. Choose another answer_prefix (e.g. "
                "'Answer:' or '' for labels right after the generation prompt) or other labels."
            )
        ids.append(int(extra[0]))
    if len(set(ids)) != len(ids):
        dup = [o.label for o, i in zip(options, ids) if ids.count(i) > 1]
        raise RoutingError(f"labels {dup} map to the same token; use labels the tokenizer keeps apart")
    return ids


def select(probabilities: Mapping[str, float], options: Sequence[RouteOption], top_p: float) -> Route:
    """The routing decision for one task's label probabilities.

    top_p = 0, or any top_p not above the most probable label's α: that label alone (docs/method.md §4). Otherwise the
    smallest set of most probable labels whose α add up to at least top_p (ties broken by option order).

    Weights: α renormalised over the kept set, the no-adapter label included, which then contributes no adapter.
    Reading each label as a model (W for no adapter, W + B_c A_c for c), the α-mixture of the kept models' weights
    is exactly W + Σ_c α_c B_c A_c: a kept no-adapter label shrinks the composed delta towards the base model by
    its share, instead of being ignored (renormalising over the adapters alone would apply them at full strength
    even when the base model is nearly as probable). With one kept capability the weight is then < 1; with only
    the no-adapter label kept, the base model runs. The weights of the kept capabilities sum to 1 exactly when
    the no-adapter label is not kept."""
    if not 0.0 <= top_p <= 1.0:
        raise RoutingError(f"top_p must be within [0, 1], got {top_p}")
    order = [o.label for o in options]
    if set(probabilities) != set(order):
        raise RoutingError(f"probabilities have labels {sorted(probabilities)}, options {order}")
    by_label = {o.label: o for o in options}
    ranked = sorted(order, key=lambda lab: (-probabilities[lab], order.index(lab)))
    kept = [ranked[0]]
    if top_p > probabilities[ranked[0]]:
        total = probabilities[ranked[0]]
        for lab in ranked[1:]:
            if total >= top_p - 1e-12:
                break
            kept.append(lab)
            total += probabilities[lab]
    mass = sum(probabilities[lab] for lab in kept)
    weights = {}
    for lab in kept:
        cid = by_label[lab].capability_id
        if cid is not None:
            weights[cid] = probabilities[lab] / mass if mass > 0 else 1.0 / len(kept)
    return Route(
        probabilities=dict(probabilities),
        top=by_label[ranked[0]].capability_id,
        labels=kept,
        chosen=list(weights),
        weights=weights,
    )


def _base_model_context(model: Any):
    """A context in which `model` runs without any adapter: PEFT's `disable_adapter()` for a PeftModel. A plain
    model that carries injected LoRA layers (wrapped in place by PEFT) cannot be switched off from here."""
    import contextlib

    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
        return model.disable_adapter()
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no adapters either
        return contextlib.nullcontext()
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise RoutingError(
            "the model carries PEFT adapter layers but is not the PeftModel that owns them, so the router cannot "
            "disable them; pass the PeftModel (e.g. AdapterBank.model) instead of its base model"
        )
    return contextlib.nullcontext()


class Router:
    """The router over `options`, scoring with `model` (the base model; adapters are disabled while it scores).

    `scoring`: "label" (the paper's lettered prompt and next-token label logits) or "channel" (each option's card,
    `channel_card`, and the task's log-likelihood after it; the options' `examples` go on the cards). Measured
    with SmolLM2-135M on 8 tasks of each of the five synthesis templates (difficulty 1, seeds 0-7) plus 10
    distractors (tests/routing/test_router.py, `-m slow`): label scoring put 0/40 template tasks on their
    capability (it answers "no adapter" for everything, distractors included: 10/10); channel scoring with
    descriptions only 12/40 (29 of the 40 went to the identification card) and 3/10 distractors on "no adapter";
    with 2 example openings per card (other seeds of the same templates) 36/40, and 8/10 and 7/8 (a second,
    held-out list) distractors on "no adapter". A model that follows instructions (7B and up) should use
    "label", the paper's method.

    `calibrate` (label scoring only): contextual calibration (Zhao et al. 2021) — each task's label distribution is
    divided by the one the model gives the content-free tasks (`content_free`, averaged) and renormalised. The
    content-free prompts ride in the same batched forward as the tasks. Off by default because it did not help
    where measured: with SmolLM2-135M, calibrated on "N/A" 2/40 (3/40 averaging "N/A", "" and "[MASK]") with 0/10
    distractors left on "no adapter" — below chance (1/6). That model's label distribution hardly depends on the
    task, so calibration only trades one bias for another.

    `batch_size`: None scores every task in one forward; a number splits large task lists into forwards of that
    many prompts (memory)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        options: Sequence[RouteOption],
        *,
        calibrate: bool,
        content_free: Sequence[str] = CONTENT_FREE_TASKS,
        max_task_chars: int,
        answer_prefix: str,
        batch_size: int | None = None,
        scoring: str,
    ):
        if scoring not in SCORINGS:
            hint = " (the gate is trace_core.routing.gate.Gate, trained per run)" if scoring == "gate" else ""
            raise RoutingError(f"scoring must be one of {SCORINGS}, got {scoring!r}{hint}")
        if calibrate and scoring != "label":
            raise RoutingError("calibrate=True applies to scoring='label' only; turn it off for channel scoring")
        if len(options) < 2:
            raise RoutingError("routing needs at least two options (the no-adapter option and one capability)")
        labels = [o.label for o in options]
        if len(set(labels)) != len(labels):
            raise RoutingError(f"option labels must be distinct, got {labels}")
        if calibrate and not content_free:
            raise RoutingError("calibrate=True needs at least one content-free task (e.g. 'N/A')")
        if batch_size is not None and batch_size < 1:
            raise RoutingError(f"batch_size must be None or >= 1, got {batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.options = list(options)
        self.labels = labels
        self.calibrate = calibrate
        self.content_free = list(content_free)
        self.max_task_chars = int(max_task_chars)
        self.answer_prefix = answer_prefix
        self.batch_size = batch_size
        self.scoring = scoring
        if scoring == "channel":
            self.label_ids = []
            return
        # The label's token depends only on the end of the prompt (the fixed answer prefix), so one check covers
        # every task; `_encode` confirms that each prompt indeed ends with the same tokens.
        probe = self.prompt("N/A")
        self.label_ids = label_token_ids(tokenizer, probe, self.options, answer_prefix)
        tail = tokenizer(probe, add_special_tokens=False)["input_ids"]
        self._tail = list(tail[-3:])

    def prompt(self, task: str) -> str:
        return routing_prompt(self.tokenizer, task, self.options, self.max_task_chars, self.answer_prefix)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        ids = [list(x) for x in self.tokenizer([self.prompt(t) for t in texts], add_special_tokens=False)["input_ids"]]
        for t, x in zip(texts, ids):
            if x[-len(self._tail) :] != self._tail:
                raise RoutingError(
                    f"the routing prompt for task {t[:60]!r}... does not end with the answer prefix's tokens"
                )
        return ids

    def _label_log_probs(self, prompts: list[list[int]]) -> Any:
        """log softmax over the label tokens' next-token logits, one row per prompt (left-padded batched forward)."""
        import torch

        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        if pad is None:
            raise RoutingError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
        device = next(self.model.parameters()).device
        label_ids = torch.tensor(self.label_ids, device=device)
        chunks = (
            [prompts]
            if self.batch_size is None
            else [prompts[i : i + self.batch_size] for i in range(0, len(prompts), self.batch_size)]
        )
        rows = []
        was_training = bool(getattr(self.model, "training", False))
        self.model.eval()
        try:
            with torch.inference_mode(), _base_model_context(self.model):
                for chunk in chunks:
                    width = max(len(p) for p in chunk)
                    input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                    mask = torch.zeros((len(chunk), width), dtype=torch.long)
                    for i, p in enumerate(chunk):
                        input_ids[i, width - len(p) :] = torch.tensor(p)
                        mask[i, width - len(p) :] = 1
                    # Positions count real tokens only, so a left-padded prompt is seen exactly as it is alone.
                    positions = (mask.cumsum(-1) - 1).clamp(min=0)
                    out = self.model(
                        input_ids=input_ids.to(device),
                        attention_mask=mask.to(device),
                        position_ids=positions.to(device),
                        use_cache=False,
                        logits_to_keep=1,
                    )
                    last = out.logits[:, -1, :].float()
                    rows.append(torch.log_softmax(last.index_select(-1, label_ids), dim=-1).cpu())
        finally:
            if was_training:
                self.model.train()
        return torch.cat(rows, dim=0)

    def channel_log_likelihoods(self, tasks: Sequence[str]) -> Any:
        """log p(" " + task | channel_card(option)) per task (rows) and option (columns), summed over the task's
        tokens. Each card runs once; its KV cache is repeated over a batch of tasks, right-padded (causal attention
        keeps a real token from seeing the padding after it, and padded positions are not scored)."""
        import copy

        import torch

        from trace_core.agents.local import _cache_kwarg

        cache_kw = _cache_kwarg(self.model)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        conts = [self.tokenizer(" " + _truncate(t, self.max_task_chars), add_special_tokens=False)["input_ids"]
                 for t in tasks]
        if any(not c for c in conts):
            raise RoutingError("a task tokenizes to nothing; route non-empty task openings")
        device = next(self.model.parameters()).device
        size = self.batch_size or len(conts)
        out = torch.zeros(len(conts), len(self.options))
        was_training = bool(getattr(self.model, "training", False))
        self.model.eval()
        try:
            with torch.inference_mode(), _base_model_context(self.model):
                for j, option in enumerate(self.options):
                    card = self.tokenizer(channel_card(option, self.max_task_chars), add_special_tokens=False)[
                        "input_ids"]
                    first = self.model(input_ids=torch.tensor([card], device=device), use_cache=True, logits_to_keep=1)
                    card_cache = first.get(cache_kw)
                    for start in range(0, len(conts), size):
                        chunk = conts[start : start + size]
                        width = max(len(c) for c in chunk)
                        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                        real = torch.zeros((len(chunk), width), dtype=torch.bool)
                        for i, c in enumerate(chunk):
                            ids[i, : len(c)] = torch.tensor(c)
                            real[i, : len(c)] = True
                        cache = copy.deepcopy(card_cache)
                        cache.batch_repeat_interleave(len(chunk))
                        positions = torch.arange(len(card), len(card) + width).expand(len(chunk), -1)
                        res = self.model(
                            input_ids=ids.to(device),
                            attention_mask=torch.ones((len(chunk), len(card) + width), dtype=torch.long,
                                                      device=device),
                            position_ids=positions.to(device),
                            use_cache=True,
                            **{cache_kw: cache},
                        )
                        # The card's last logits predict each task's first token; the task's own logits the rest.
                        logits = torch.cat(
                            [first.logits[:, -1:, :].expand(len(chunk), -1, -1), res.logits[:, :-1, :]], dim=1
                        ).float()
                        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids.to(device).unsqueeze(-1)).squeeze(-1)
                        out[start : start + len(chunk), j] = (logp.cpu() * real).sum(dim=-1)
        finally:
            if was_training:
                self.model.train()
        return out

    def probabilities(self, tasks: Sequence[str]) -> list[dict[str, float]]:
        """label -> α for each task: softmax (temperature 1) over the label tokens' logits, calibrated if asked; for
        channel scoring, softmax over the options of log p(task | card)."""
        import torch

        tasks = list(tasks)
        if not tasks:
            return []
        if self.scoring == "channel":
            probs = torch.softmax(self.channel_log_likelihoods(tasks), dim=-1).tolist()
            return [dict(zip(self.labels, row)) for row in probs]
        extra = self.content_free if self.calibrate else []
        logp = self._label_log_probs(self._encode(tasks + extra))
        if self.calibrate:
            # Averaging the content-free distributions, then dividing in probability space (Zhao et al. 2021 use
            # W = diag(p_cf)^-1, b = 0), i.e. subtracting log p_cf before renormalising.
            p_cf = logp[len(tasks) :].exp().mean(dim=0)
            logp = torch.log_softmax(logp[: len(tasks)] - p_cf.log(), dim=-1)
        probs = logp.exp().tolist()
        return [dict(zip(self.labels, row)) for row in probs]

    def route(self, tasks: Sequence[str], top_p: float) -> list[Route]:
        """The routing decision per task (see `select` for top_p and the weights)."""
        return [select(p, self.options, top_p) for p in self.probabilities(tasks)]


def _class_name(label: str | None) -> str:
    return "none" if label is None else str(label)


def routing_accuracy(
    predicted: Sequence[str | None], oracle: Sequence[str | None], labels: Iterable[str | None]
) -> dict[str, Any]:
    """Agreement of routed capabilities (`predicted`, None = base model) with the oracle's.

    Returns n, accuracy, the two chance levels (`chance_uniform` = 1 / number of labels, `chance_majority` = the
    oracle's most frequent class rate, what always guessing it would score), per-label recall (None for a label the
    oracle never uses), and the confusion matrix (rows oracle, columns predicted; None is named "none")."""
    predicted, oracle = list(predicted), list(oracle)
    classes = list(dict.fromkeys(labels))
    if len(predicted) != len(oracle):
        raise ValueError(f"{len(predicted)} predictions for {len(oracle)} oracle labels; pass one per task")
    if not oracle:
        raise ValueError("no tasks to score")
    unknown = sorted({_class_name(x) for x in predicted + oracle if x not in classes})
    if unknown:
        raise ValueError(f"labels {unknown} are not in `labels` ({[_class_name(c) for c in classes]}); add them")
    names = [_class_name(c) for c in classes]
    confusion = {o: {p: 0 for p in names} for o in names}
    for p, o in zip(predicted, oracle):
        confusion[_class_name(o)][_class_name(p)] += 1
    n = len(oracle)
    support = {name: sum(row.values()) for name, row in confusion.items()}
    correct = sum(confusion[name][name] for name in names)
    return {
        "n": n,
        "accuracy": correct / n,
        "chance_uniform": 1.0 / len(classes),
        "chance_majority": max(support.values()) / n,
        "per_label_recall": {
            name: (confusion[name][name] / support[name] if support[name] else None) for name in names
        },
        "support": support,
        "confusion": confusion,
    }
