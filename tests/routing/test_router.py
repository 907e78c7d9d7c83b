"""The logit router: options and labels, the prompt, batched label probabilities, calibration, top-p selection and
the accuracy report on the tiny model; then SmolLM2-135M on distractors and on the five synthesis templates'
tasks (`-m slow`)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from tests.defaults import PARAMS
from trace_core.routing.router import (
    NO_ADAPTER_EXAMPLES,
    NO_ADAPTER_NAME,
    RouteOption,
    Router,
    RoutingError,
    build_options,
    channel_card,
    label_token_ids,
    routing_accuracy,
    routing_messages,
    routing_prompt,
    select,
    task_text,
)
from trace_core.schemas import Action, CapabilitySpec, Instance

ROOT = Path(__file__).resolve().parents[2]
ROUTER = PARAMS.evaluation.router
CHARS = ROUTER.max_task_chars
PROMPT = {"max_task_chars": CHARS, "answer_prefix": ROUTER.answer_prefix}  # the params' prompt settings

CAPS = [
    {"capability_id": "cancel_skill", "name": "cancelling", "definition": "Cancel an order."},
    {"capability_id": "tool_skill", "name": "tool calls", "definition": "Exact tool arguments."},
    {"capability_id": "mind_skill", "name": "changed mind", "definition": "Please handle a changed mind."},
]
# Lengths differ by hundreds of tokens, so a batch pads short prompts heavily: padding that leaked into attention
# would show.
TASKS = ["Cancel order please", "I changed my mind about the order, please cancel it. " * 12, "tool_call", "Hi"]


@pytest.fixture(scope="module")
def options():
    return build_options(CAPS)


@pytest.fixture(scope="module")
def router(tiny_model, tokenizer, options):
    # The tiny tokenizer has no "ĠA"-style tokens, so the label follows the generation prompt directly.
    return Router(tiny_model, tokenizer, options, answer_prefix="", scoring="label", calibrate=False,
                  max_task_chars=CHARS)


# -- options, task text, prompt --------------------------------------------------------------------------------


def test_options_are_lettered_with_no_adapter_first():
    specs = [
        CapabilitySpec(capability_id="a_b", name="A B", definition="does a, b", labeller="programmatic"),
        {"capability_id": "c_d", "name": "C D", "definition": "does c, d"},
    ]
    opts = build_options(specs)
    assert [(o.label, o.capability_id) for o in opts] == [("A", None), ("B", "a_b"), ("C", "c_d")]
    assert opts[0].name == NO_ADAPTER_NAME
    assert (opts[2].name, opts[2].description) == ("C D", "does c, d")
    # Adding a capability appends a line and leaves every earlier label as it was.
    more = build_options([*specs, {"capability_id": "e", "name": "E", "definition": "e"}])
    assert more[:3] == opts and more[3].label == "D"


def test_options_reject_bad_capabilities():
    with pytest.raises(RoutingError, match="unique"):
        build_options([CAPS[0], CAPS[0]])
    with pytest.raises(RoutingError, match="definition"):
        build_options([{"capability_id": "x", "name": "x"}])
    with pytest.raises(RoutingError, match="at most 25"):
        build_options([{"capability_id": f"c{i}", "name": "n", "definition": "d"} for i in range(26)])


def _instance(**kw) -> Instance:
    base = {
        "instance_id": "i",
        "source": "procedural",
        "domain": "retail",
        "family": "single_write",
        "user_goal": "Cancel order #W1 because the customer secretly wants a refund",
        "user_facts": {"email": "a@b.c"},
        "reference_actions": [Action(name="cancel_pending_order")],
    }
    return Instance(**{**base, **kw})


def test_task_text_is_what_the_agent_sees_first():
    inst = _instance(opening="Hi, please cancel my order #W1.")
    assert task_text(inst) == "Hi, please cancel my order #W1."
    # Without an opening the scripted user sends the goal verbatim, so that is what the agent sees.
    assert task_text(_instance(opening=None)) == _instance().user_goal
    with pytest.raises(RoutingError, match="neither opening nor user_goal"):
        task_text(_instance(opening=None, user_goal=""))


def test_routing_messages_list_every_option_and_truncate_the_task(options):
    msgs = routing_messages("x" * 5000, options, max_task_chars=100)
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    assert "x" * 100 + " [...]" in user and "x" * 101 not in user
    for o in options:
        assert f"{o.label}: {o.name} — {o.description}" in user
    assert "one letter (A, B, C, D)" in user


def test_prompt_is_primed_so_the_next_token_is_the_label(tokenizer, options):
    prompt = routing_prompt(tokenizer, "Cancel order please", options, ROUTER.max_task_chars, answer_prefix="")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = label_token_ids(tokenizer, prompt, options, answer_prefix="")
    assert tokenizer.convert_ids_to_tokens(ids) == ["A", "B", "C", "D"]


def test_labels_that_are_not_one_token_are_refused(tiny_model, tokenizer, options):
    # The tiny tokenizer splits " A" into "Ġ" + "A": after "Answer:" the label is two tokens.
    with pytest.raises(RoutingError, match="not a single token.*answer_prefix"):
        Router(tiny_model, tokenizer, options, scoring="label", calibrate=False, **PROMPT)
    odd = [*options[:1], RouteOption("é", "x", "x", "x")]  # two bytes, two byte-level tokens
    with pytest.raises(RoutingError, match="'é' is not a single token"):
        Router(tiny_model, tokenizer, odd, answer_prefix="", scoring="label", calibrate=False, max_task_chars=CHARS)
    prompt = routing_prompt(tokenizer, "t", options, ROUTER.max_task_chars, answer_prefix="")
    same = [RouteOption("A", None, "n", "d"), RouteOption("A", "x", "n", "d")]
    with pytest.raises(RoutingError, match="same token"):
        label_token_ids(tokenizer, prompt, same, answer_prefix="")
    with pytest.raises(RoutingError, match="distinct"):
        Router(tiny_model, tokenizer, same, answer_prefix="", scoring="label", calibrate=False, max_task_chars=CHARS)


# -- probabilities ---------------------------------------------------------------------------------------------


def test_probabilities_are_a_distribution_over_the_labels(router):
    probs = router.probabilities(TASKS)
    assert len(probs) == len(TASKS)
    for p in probs:
        assert list(p) == ["A", "B", "C", "D"]
        assert sum(p.values()) == pytest.approx(1.0, abs=1e-6)
        assert all(0.0 < v < 1.0 for v in p.values())
    assert probs != [probs[0]] * len(probs)  # the task changes the distribution
    assert router.probabilities(TASKS) == probs  # deterministic
    assert router.probabilities([]) == []


def test_probabilities_are_the_softmax_of_the_label_logits(router, tiny_model, tokenizer):
    import torch

    ids = tokenizer(router.prompt(TASKS[1]), add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = tiny_model(input_ids=ids).logits[0, -1]
    expected = torch.softmax(logits[router.label_ids], dim=-1).tolist()
    assert list(router.probabilities([TASKS[1]])[0].values()) == pytest.approx(expected, abs=1e-5)


def _logs(p: dict[str, float]) -> list[float]:
    # Compared in log space: the tiny model's peaky distributions hide differences in the small probabilities.
    return [math.log(v) for v in p.values()]


def test_one_batched_forward_equals_one_by_one(router, tiny_model, tokenizer, options):
    batched = router.probabilities(TASKS)
    for task, p in zip(TASKS, batched):
        assert _logs(router.probabilities([task])[0]) == pytest.approx(_logs(p), abs=1e-4)
    chunked = Router(tiny_model, tokenizer, options, answer_prefix="", batch_size=3, scoring="label",
                     calibrate=False, max_task_chars=CHARS).probabilities(TASKS)
    for a, b in zip(chunked, batched):
        assert _logs(a) == pytest.approx(_logs(b), abs=1e-4)


def _peft_copy(tiny_model):
    """A PeftModel over a copy of `tiny_model` with a LoRA adapter large enough to change every output."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(tiny_model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return peft_model


def test_router_scores_with_adapters_disabled(tiny_model, tokenizer, options, router):
    import torch

    peft_model = _peft_copy(tiny_model)
    peft_model.train()
    probe = tokenizer(router.prompt(TASKS[0]), add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        adapted = peft_model(input_ids=probe).logits
        base = tiny_model(input_ids=probe).logits
    assert not torch.allclose(adapted, base, atol=1e-3)  # the adapter matters, so the next check means something
    via_peft = Router(peft_model, tokenizer, options, answer_prefix="", scoring="label",
                      calibrate=False, max_task_chars=CHARS).probabilities(TASKS)
    for a, b in zip(via_peft, router.probabilities(TASKS)):
        assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    assert peft_model.training  # mode restored
    with torch.inference_mode():
        assert torch.allclose(peft_model(input_ids=probe).logits, adapted, atol=1e-5)  # adapter back on
    # The base model with LoRA layers injected in place cannot be routed on: its adapters would stay on.
    with pytest.raises(RoutingError, match="pass the PeftModel"):
        Router(peft_model.base_model.model, tokenizer, options, answer_prefix="", scoring="label",
               calibrate=False, max_task_chars=CHARS).probabilities(TASKS)


def test_contextual_calibration_divides_by_the_content_free_distribution(tiny_model, tokenizer, options, router):
    calibrated = Router(tiny_model, tokenizer, options, answer_prefix="", calibrate=True, scoring="label",
                        max_task_chars=CHARS)
    raw = router.probabilities([*TASKS, "N/A"])
    cf = raw[-1]
    for task, p in zip(TASKS, raw):
        scaled = {k: p[k] / cf[k] for k in p}
        total = sum(scaled.values())
        got = calibrated.probabilities([task])[0]
        assert list(got.values()) == pytest.approx([v / total for v in scaled.values()], abs=1e-5)
    # The content-free task itself comes out uniform: the bias it measures is removed entirely.
    assert list(calibrated.probabilities(["N/A"])[0].values()) == pytest.approx([0.25] * 4, abs=1e-5)
    with pytest.raises(RoutingError, match="content-free"):
        Router(tiny_model, tokenizer, options, answer_prefix="", calibrate=True, content_free=[], scoring="label",
               max_task_chars=CHARS)


# -- channel scoring ---------------------------------------------------------------------------------------------

EXAMPLES = {"cancel_skill": ["Cancel #W1 please", "Stop order #W2"], "tool_skill": ["Call the tool"],
            "mind_skill": ["I changed my mind", "Not that one", "Undo it"]}


def test_options_carry_examples_and_the_cards_show_them():
    opts = build_options(CAPS, EXAMPLES, num_examples=2)
    assert opts[0].examples == NO_ADAPTER_EXAMPLES  # "no adapter" stands for everything else: all of its examples
    assert [o.examples for o in opts[1:]] == [("Cancel #W1 please", "Stop order #W2"), ("Call the tool",),
                                              ("I changed my mind", "Not that one")]
    card = channel_card(opts[3], max_task_chars=8)
    assert card.startswith("Skill: changed mind. Please handle a changed mind.\n")
    assert "- I change [...]\n- Not that [...]\n-" in card and card.endswith("\n-")
    bare = build_options(CAPS)
    assert all(o.examples == () for o in bare)
    assert channel_card(bare[1], CHARS).endswith("A customer's message that needs this skill:\n-")
    with pytest.raises(RoutingError, match="'tool_skill' has no example openings"):
        build_options(CAPS, {"cancel_skill": ["x"], "mind_skill": ["y"]}, num_examples=1)
    with pytest.raises(RoutingError, match="num_examples"):
        build_options(CAPS, EXAMPLES, num_examples=-1)


def _naive_channel(model, tokenizer, options, task):
    """log p(" " + task | card) per option, one plain forward over card + task each, no cache, no batch (the router
    strips the task, as it does for the routing prompt)."""
    import torch

    out = []
    cont = tokenizer(" " + task.strip(), add_special_tokens=False)["input_ids"]
    for o in options:
        card = tokenizer(channel_card(o, CHARS), add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            logp = torch.log_softmax(model(input_ids=torch.tensor([card + cont])).logits[0].float(), dim=-1)
        out.append(sum(logp[len(card) + i - 1, t].item() for i, t in enumerate(cont)))
    return out


@pytest.mark.parametrize("batch_size", [None, 3])
def test_channel_scores_equal_plain_forwards_over_card_and_task(tiny_model, tokenizer, batch_size):
    # The card's KV cache is repeated over a right-padded batch of tasks of very different lengths: any leak of
    # padding, wrong position or cache reuse across chunks would show against plain one-sequence forwards.
    opts = build_options(CAPS, EXAMPLES, num_examples=2)
    router = Router(tiny_model, tokenizer, opts, scoring="channel", batch_size=batch_size, calibrate=False, **PROMPT)
    scores = router.channel_log_likelihoods(TASKS)
    assert tuple(scores.shape) == (len(TASKS), len(opts))
    for task, row in zip(TASKS, scores.tolist()):
        assert row == pytest.approx(_naive_channel(tiny_model, tokenizer, opts, task), abs=1e-3)
    probs = router.probabilities(TASKS)
    for row, p in zip(scores.tolist(), probs):
        assert list(p) == ["A", "B", "C", "D"]
        z = max(row)
        norm = sum(math.exp(v - z) for v in row)
        assert list(p.values()) == pytest.approx([math.exp(v - z) / norm for v in row], abs=1e-5)
    assert router.probabilities(TASKS) == probs  # deterministic


def test_channel_scoring_runs_the_base_model_and_refuses_calibration(tiny_model, tokenizer):
    import torch

    opts = build_options(CAPS)
    peft_model = _peft_copy(tiny_model)
    with torch.inference_mode():
        probe = torch.tensor([tokenizer(channel_card(opts[1], CHARS), add_special_tokens=False)["input_ids"]])
        assert not torch.allclose(peft_model(input_ids=probe).logits, tiny_model(input_ids=probe).logits, atol=1e-3)
    base = Router(tiny_model, tokenizer, opts, scoring="channel", calibrate=False, **PROMPT)
    routed = Router(peft_model, tokenizer, opts, scoring="channel", calibrate=False, **PROMPT)
    base, routed = base.channel_log_likelihoods(TASKS), routed.channel_log_likelihoods(TASKS)
    assert torch.allclose(base, routed, atol=1e-4)
    with pytest.raises(RoutingError, match="scoring='label' only"):
        Router(tiny_model, tokenizer, opts, scoring="channel", calibrate=True, **PROMPT)
    with pytest.raises(RoutingError, match="scoring must be one of"):
        Router(tiny_model, tokenizer, opts, scoring="letters", calibrate=False, **PROMPT)


# -- selection -------------------------------------------------------------------------------------------------


P = {"A": 0.1, "B": 0.5, "C": 0.3, "D": 0.1}


def test_top_p_zero_is_the_single_argmax(options):
    for top_p in (0.0, 0.5):  # 0.5 is not above the top probability: still the argmax alone
        r = select(P, options, top_p)
        assert (r.top, r.labels, r.chosen, r.weights) == (
            "cancel_skill",
            ["B"],
            ["cancel_skill"],
            {"cancel_skill": 1.0},
        )
    base = select({"A": 0.4, "B": 0.3, "C": 0.2, "D": 0.1}, options, 0.0)
    assert (base.top, base.chosen, base.weights) == (None, [], {})


def test_top_p_keeps_the_smallest_set_and_renormalises(options):
    r = select(P, options, 0.8)
    assert r.labels == ["B", "C"]
    assert r.weights == pytest.approx({"cancel_skill": 0.5 / 0.8, "tool_skill": 0.3 / 0.8})
    assert sum(r.weights.values()) == pytest.approx(1.0)
    # Ties (A and D at 0.1) go to the earlier option; a set reaching top_p exactly stops there.
    assert select(P, options, 0.9).labels == ["B", "C", "A"]
    assert select(P, options, 1.0).labels == ["B", "C", "A", "D"]


def test_a_kept_no_adapter_label_shrinks_the_composition(options):
    r = select({"A": 0.45, "B": 0.35, "C": 0.15, "D": 0.05}, options, 0.7)
    assert r.labels == ["A", "B"] and r.top is None
    assert r.chosen == ["cancel_skill"]
    assert r.weights == pytest.approx({"cancel_skill": 0.35 / 0.80})  # the base label keeps its 0.45/0.80 share
    with pytest.raises(RoutingError, match="top_p"):
        select(P, options, 1.5)
    with pytest.raises(RoutingError, match="labels"):
        select({"A": 1.0}, options, 0.0)


def test_route_applies_select_to_each_task(router, options):
    probs = router.probabilities(TASKS)
    routes = router.route(TASKS, top_p=0.6)
    assert [r.probabilities for r in routes] == probs
    assert routes == [select(p, options, 0.6) for p in probs]


# -- accuracy report -------------------------------------------------------------------------------------------


def test_routing_accuracy_on_a_hand_made_example():
    labels = [None, "x", "y"]
    oracle = ["x", "x", "x", "y", "y", None]
    predicted = ["x", "y", None, "y", "y", "x"]
    rep = routing_accuracy(predicted, oracle, labels)
    assert rep["n"] == 6
    assert rep["accuracy"] == pytest.approx(3 / 6)
    assert rep["chance_uniform"] == pytest.approx(1 / 3)
    assert rep["chance_majority"] == pytest.approx(3 / 6)
    assert rep["per_label_recall"] == pytest.approx({"none": 0.0, "x": 1 / 3, "y": 1.0})
    assert rep["confusion"] == {
        "none": {"none": 0, "x": 1, "y": 0},
        "x": {"none": 1, "x": 1, "y": 1},
        "y": {"none": 0, "x": 0, "y": 2},
    }
    assert routing_accuracy(["x"], ["y"], labels)["per_label_recall"]["none"] is None
    with pytest.raises(ValueError, match="one per task"):
        routing_accuracy(["x"], [], labels)
    with pytest.raises(ValueError, match="'z'"):
        routing_accuracy(["z"], ["x"], labels)


# -- SmolLM2-135M (the embedded default model) ---------------------------------------------------------------

TEMPLATES = [
    "structured_data_reasoning",
    "tool_call_precision",
    "multi_step_completion",
    "precondition_verification",
    "identification",
]
PER_TEMPLATE = 8
# Openings that need none of the capabilities: small talk and requests outside a retail agent's job.
DISTRACTORS = [
    "Hi! How are you doing today?",
    "What's the weather like in Paris this weekend?",
    "Can you recommend a good book about the Roman empire?",
    "Tell me a joke about cats.",
    "Thanks, that's all. Have a nice day!",
    "Write a short poem about the sea.",
    "What is the capital of Australia?",
    "How do I boil an egg?",
    "Hello there, just wanted to say your website looks great.",
    "Can you help me with my math homework? What is 12 times 7?",
]
# A second list, written after the channel router's "no adapter" examples were chosen (with the list above in view)
# and held out of that choice.
DISTRACTORS_HELD_OUT = [
    "Good morning! Lovely weather we're having, isn't it?",
    "Could you suggest a name for my new puppy?",
    "What's a good movie to watch tonight?",
    "How many planets are in the solar system?",
    "Hey, I'm just testing this chat. Please ignore me.",
    "Can you explain how photosynthesis works?",
    "Bye for now, talk to you later!",
    "Is it going to snow in Denver tomorrow?",
]


def _smollm2():
    from trace_core.agents.model import ModelProvisionError, load_model, load_tokenizer, provision_model

    try:
        path = provision_model("smollm2", ROOT / ".cache" / "models")
    except ModelProvisionError as exc:
        pytest.skip(str(exc))
    return load_model(path, dtype="float32", threads=0), load_tokenizer(path)


def _template_options():
    from trace_core.analysis.programmatic import CAPABILITIES

    return build_options(
        {"capability_id": c, "name": CAPABILITIES[c][0], "definition": CAPABILITIES[c][1]} for c in TEMPLATES
    )


@pytest.mark.model
def test_smollm2_labels_are_single_tokens_after_the_default_prefix():
    from trace_core.agents.model import ModelProvisionError, load_tokenizer, provision_model

    try:
        tok = load_tokenizer(provision_model("smollm2", ROOT / ".cache" / "models"))
    except ModelProvisionError as exc:
        pytest.skip(str(exc))
    options = _template_options()
    ids = label_token_ids(
        tok, routing_prompt(tok, "Hi, please cancel my order.", options, CHARS, ROUTER.answer_prefix), options,
        ROUTER.answer_prefix,
    )
    assert tok.convert_ids_to_tokens(ids) == ["ĠA", "ĠB", "ĠC", "ĠD", "ĠE", "ĠF"]


@pytest.fixture(scope="module")
def smollm2_probabilities():
    """Uncalibrated label probabilities of the default router for 8 tasks of each template (difficulty 1, seeds
    0-7), the distractors and the content-free task, in one batched pass (~100 s on 2 shared cores)."""
    from trace_core.synthesis.templates import make

    model, tok = _smollm2()
    options = _template_options()
    tasks, oracle = [], []
    for name in TEMPLATES:
        env = make(name, None, 1, "compact")
        for seed in range(PER_TEMPLATE):
            tasks.append(task_text(env.reset(seed)))
            oracle.append(name)
    router = Router(model, tok, options, batch_size=8, scoring="label", calibrate=False, **PROMPT)
    probs = router.probabilities(tasks + DISTRACTORS + ["N/A"])
    n = len(tasks)
    return {"options": options, "oracle": oracle, "tasks": probs[:n], "distractors": probs[n:-1], "cf": probs[-1]}


def _top(p: dict[str, float], options) -> str | None:
    return select(p, options, 0.0).top


def _calibrated(p: dict[str, float], cf: dict[str, float]) -> dict[str, float]:
    scaled = {k: p[k] / cf[k] for k in p}
    total = sum(scaled.values())
    return {k: v / total for k, v in scaled.items()}


def _binomial_tail(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_routes_distractors_to_the_base_model(smollm2_probabilities):
    """Measured: 10 of 10 distractors go to "no adapter" uncalibrated. This says little on its own: the same
    router also sends every template task there (see the next test) — SmolLM2-135M answers "A" whatever the task."""
    s = smollm2_probabilities
    none = [_top(p, s["options"]) is None for p in s["distractors"]]
    assert sum(none) >= 0.8 * len(none), none


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.xfail(
    strict=True,
    reason=(
        "SmolLM2-135M cannot route from the opening message: measured 0/40 correct uncalibrated (all 40 -> no "
        "adapter) and 2/40 calibrated on 'N/A', below chance (1/6 uniform, 1/5 majority); its label "
        "distribution barely moves with the task. Strict: an improvement makes this XPASS and fail, so that the "
        "numbers here and in the router's docstring get updated."
    ),
)
@pytest.mark.parametrize("calibrate", [False, True], ids=["raw", "calibrated"])
def test_smollm2_routes_template_tasks_above_chance(smollm2_probabilities, calibrate):
    s = smollm2_probabilities
    probs = [_calibrated(p, s["cf"]) if calibrate else p for p in s["tasks"]]
    predicted = [_top(p, s["options"]) for p in probs]
    report = routing_accuracy(predicted, s["oracle"], [o.capability_id for o in s["options"]])
    chance = max(report["chance_uniform"], report["chance_majority"])
    correct = round(report["accuracy"] * report["n"])
    # "Clearly above chance": fewer than 1% of chance-level routers would do as well.
    assert _binomial_tail(correct, report["n"], chance) < 0.01, report


@pytest.fixture(scope="module")
def smollm2_channel():
    """Channel routing with SmolLM2-135M: cards with 2 example openings per template (seeds 100-101, disjoint from
    the routed tasks' seeds 0-7), on the template tasks and both distractor lists (~2 min on 2 cores)."""
    from trace_core.synthesis.templates import make

    model, tok = _smollm2()
    tasks, oracle, examples = [], [], {}
    for name in TEMPLATES:
        env = make(name, None, 1, "compact")
        tasks += [task_text(env.reset(seed)) for seed in range(PER_TEMPLATE)]
        oracle += [name] * PER_TEMPLATE
        examples[name] = [task_text(env.reset(seed)) for seed in (100, 101)]
    options = build_options(
        ({"capability_id": c, "name": o.name, "definition": o.description}
         for c, o in zip(TEMPLATES, _template_options()[1:])), examples, num_examples=2)
    router = Router(model, tok, options, scoring="channel", batch_size=8, calibrate=False, **PROMPT)
    tops = [r.top for r in router.route(tasks + DISTRACTORS + DISTRACTORS_HELD_OUT, 0.0)]
    n = len(tasks)
    return {"options": options, "oracle": oracle, "tasks": tops[:n], "distractors": tops[n:]}


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_channel_routes_template_tasks_above_chance(smollm2_channel):
    """Measured: 36/40 template tasks on their capability (chance 1/6)."""
    s = smollm2_channel
    report = routing_accuracy(s["tasks"], s["oracle"], [o.capability_id for o in s["options"]])
    chance = max(report["chance_uniform"], report["chance_majority"])
    correct = round(report["accuracy"] * report["n"])
    assert _binomial_tail(correct, report["n"], chance) < 0.01, report
    # Every capability is reached, not one or two favourites.
    assert all(r is not None and r > 0 for r in report["per_label_recall"].values() if r is not None), report


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_channel_sends_most_distractors_to_the_base_model(smollm2_channel):
    """Measured: 8/10 of the first list, 7/8 of the held-out list on "no adapter"."""
    none = [top is None for top in smollm2_channel["distractors"]]
    assert sum(none) >= 2 / 3 * len(none), none
