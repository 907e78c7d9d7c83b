"""AdapterBank on the tiny random model: what each activation computes, checked against models built by hand."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file

from trace_core.routing.compose import AdapterBank, CompositionError
from tests.defaults import default_sampling, local_policy

TARGETS = ["q_proj", "v_proj", "down_proj"]
# name -> (rank, alpha, seed): alpha != rank so that PEFT's scaling (alpha / r) is not 1 and must be accounted for.
ADAPTERS = {"cap_a": (4, 8, 1), "cap_b": (4, 4, 2), "cap_c": (2, 6, 3)}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    """Three LoRA adapters saved by PEFT, with random non-zero B matrices (PEFT initialises B to zero, which would
    make every adapter a no-op and every comparison below vacuous)."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, (r, alpha, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        model = get_peft_model(
            copy.deepcopy(tiny_model), LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0)
        )
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn_like(p) * 0.3)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture
def bank(tiny_model, adapter_dirs):
    return AdapterBank(copy.deepcopy(tiny_model), {k: adapter_dirs[k] for k in ("cap_a", "cap_b", "cap_c")})


@pytest.fixture(scope="module")
def inputs(tiny_model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, tiny_model.config.vocab_size, (2, 12), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def logits(model, inputs):
    with torch.inference_mode():
        return model(**inputs).logits.float()


def hand_composed(tiny_model, adapter_dirs, weights: dict[str, float]):
    """The base model with Σ α_c · (alpha_c / r_c) · B_c A_c added to its weights directly from the saved files."""
    model = copy.deepcopy(tiny_model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, alpha_c in weights.items():
            r, lora_alpha, _ = ADAPTERS[name]
            state = load_file(str(adapter_dirs[name] / "adapter_model.safetensors"))
            for key, a in state.items():
                if ".lora_A." not in key:
                    continue
                b = state[key.replace(".lora_A.", ".lora_B.")]
                module = key.removeprefix("base_model.model.").replace(".lora_A.weight", "")
                params[module + ".weight"] += alpha_c * (lora_alpha / r) * (b @ a)
    return model


def test_base_model_when_weights_are_empty(bank, tiny_model, inputs):
    base = logits(tiny_model, inputs)
    with bank.use({}) as model:
        assert bank.active is None
        assert torch.allclose(logits(model, inputs), base, atol=1e-6)
    # Outside the block the adapter active before it is back, and it does change the outputs.
    assert bank.active == "cap_a"
    assert not torch.allclose(logits(bank.model, inputs), base, atol=1e-3)


def test_nested_switches_restore_the_outer_state(bank, tiny_model, inputs):
    base = logits(tiny_model, inputs)
    with bank.use({}):
        with bank.use({"cap_b": 1.0}) as model:
            assert bank.active == "cap_b"
            assert not torch.allclose(logits(model, inputs), base, atol=1e-3)
        assert bank.active is None
        assert torch.allclose(logits(bank.model, inputs), base, atol=1e-6)
    assert bank.active == "cap_a"


def test_single_adapter_equals_peft_from_pretrained(bank, tiny_model, adapter_dirs, inputs):
    from peft import PeftModel

    for name in ("cap_b", "cap_c"):
        reference = PeftModel.from_pretrained(copy.deepcopy(tiny_model), str(adapter_dirs[name])).eval()
        with bank.use({name: 1.0}) as model:
            assert bank.active == name
            assert torch.allclose(logits(model, inputs), logits(reference, inputs), atol=1e-5)


def test_composition_is_the_exact_sum_of_updates(bank, tiny_model, adapter_dirs, inputs):
    weights = {"cap_a": 0.6, "cap_c": 0.4}  # different ranks (4 and 2): "cat" handles them
    expected = logits(hand_composed(tiny_model, adapter_dirs, weights), inputs)
    with bank.use(weights) as model:
        got = logits(model, inputs)
        name = bank.active
    assert name.startswith("compose__") and "cap_a_0p600" in name
    # Equal up to float32 rounding, whose size depends on the CPU's kernels (1.1e-5 seen on an AVX2-only host, below
    # 1e-5 with AMX); a missing or mis-weighted part is two orders of magnitude off (next check).
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
    # Each part matters: leaving one adapter out is far from the composition.
    assert not torch.allclose(got, logits(hand_composed(tiny_model, adapter_dirs, {"cap_a": 0.6}), inputs), atol=1e-3)


def test_single_adapter_with_a_weight_below_one_is_scaled_exactly(bank, tiny_model, adapter_dirs, inputs):
    expected = logits(hand_composed(tiny_model, adapter_dirs, {"cap_b": 0.7}), inputs)
    with bank.use({"cap_b": 0.7}) as model:
        assert torch.allclose(logits(model, inputs), expected, atol=1e-5)


def test_compositions_are_cached_by_rounded_weights(bank):
    with bank.use({"cap_a": 0.5, "cap_b": 0.5}):
        first = bank.active
    count = len(bank.adapter_names)
    with bank.use({"cap_b": 0.50001, "cap_a": 0.49999, "cap_c": 0.0}):  # same after rounding; zero weight dropped
        assert bank.active == first
    assert len(bank.adapter_names) == count
    assert bank.drop_composed() == [first]
    assert first not in bank.adapter_names


def test_peft_linear_combination_is_not_the_sum_of_updates(bank, tiny_model, adapter_dirs, inputs):
    """Why composition uses "cat": PEFT's "linear" mixes A and B separately, adding cross terms B_a A_b."""
    weights = {"cap_a": 0.5, "cap_b": 0.5}
    bank.model.add_weighted_adapter(["cap_a", "cap_b"], [0.5, 0.5], "linear_probe", combination_type="linear")
    with bank.use({"linear_probe": 1.0}) as model:
        linear = logits(model, inputs)
    exact = logits(hand_composed(tiny_model, adapter_dirs, weights), inputs)
    assert (linear - exact).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["linear", "ties"])
def test_merged_baselines_change_the_outputs(bank, tiny_model, inputs, method):
    name = bank.merged(["cap_a", "cap_b"], [0.5, 0.5], method=method, density=0.5)
    assert name.startswith(f"merged_{method}__") and name in bank.adapter_names
    assert bank.merged(["cap_a", "cap_b"], [0.5, 0.5], method=method, density=0.5) == name  # cached
    with bank.use({name: 1.0}) as model:
        merged = logits(model, inputs)
    assert not torch.allclose(merged, logits(tiny_model, inputs), atol=1e-3)
    for single in ("cap_a", "cap_b"):
        with bank.use({single: 1.0}) as model:
            assert not torch.allclose(merged, logits(model, inputs), atol=1e-3)


def test_ties_and_linear_merges_differ(bank, inputs):
    outs = []
    for method in ("linear", "ties"):
        with bank.use({bank.merged(["cap_a", "cap_b"], [1.0, 1.0], method=method, density=0.3): 1.0}) as model:
            outs.append(logits(model, inputs))
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)


def test_merging_errors_say_what_to_do(bank):
    with pytest.raises(CompositionError, match=r"ranks must be equal.*cap_c.*use\("):
        bank.merged(["cap_a", "cap_c"], [0.5, 0.5], method="linear")
    with pytest.raises(CompositionError, match="ranks must be equal"):
        bank.merged(["cap_a", "cap_c"], [0.5, 0.5], method="ties")
    with pytest.raises(CompositionError, match="method must be one of"):
        bank.merged(["cap_a", "cap_b"], [0.5, 0.5], method="svd")
    with pytest.raises(CompositionError, match="one weight per adapter"):
        bank.merged(["cap_a", "cap_b"], [1.0], method="linear")
    with pytest.raises(CompositionError, match="density"):
        bank.merged(["cap_a", "cap_b"], [1.0, 1.0], method="ties", density=0.0)
    with pytest.raises(CompositionError, match="no adapter 'nope'"), bank.use({"nope": 1.0}):
        pass


def test_bank_refuses_a_folder_without_adapter_config(tiny_model, tmp_path):
    with pytest.raises(CompositionError, match="adapter_config.json"):
        AdapterBank(copy.deepcopy(tiny_model), {"cap_a": tmp_path})


def test_switching_clears_the_policy_prefix_cache(tiny_model, tokenizer, adapter_dirs):
    """LocalPolicy keys its cached prompt KV on the weights and the active adapter's name, neither of which
    changes when adapter layers are disabled: without the bank clearing it, the base model would reuse KV the
    adapter computed. Greedy log-probs under `use({})` must equal a fresh base-model policy's."""

    prompt = [[int(i) for i in tokenizer("Cancel order please I changed my mind " * 4)["input_ids"]]]
    sampling = default_sampling(temperature=0.0, max_new_tokens=3)
    base_lps = local_policy(copy.deepcopy(tiny_model), tokenizer).generate_ids(prompt, sampling)[0][1]

    model = copy.deepcopy(tiny_model)
    policy = local_policy(model, tokenizer)
    bank = AdapterBank(model, {"cap_a": adapter_dirs["cap_a"]}, policy=policy)
    adapter_lps = policy.generate_ids(prompt, sampling)[0][1]
    assert policy._prefix is not None  # the prompt's prefix KV, computed with cap_a active
    assert adapter_lps != pytest.approx(base_lps, abs=1e-4)
    with bank.use({}):
        assert policy._prefix is None
        assert policy.generate_ids(prompt, sampling)[0][1] == pytest.approx(base_lps, abs=1e-5)
    assert policy._prefix is None  # switching back cleared it again
    assert policy.generate_ids(prompt, sampling)[0][1] == pytest.approx(adapter_lps, abs=1e-5)
