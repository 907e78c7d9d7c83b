"""Shared test setup: quiet, offline environment; the project root importable; a throw-away project copy."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

for _key, _value in {
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_key, _value)

# CI replays a fixed set of hypothesis examples (a red build should mean a code change, not a new random draw);
# local runs keep exploring fresh examples.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # hypothesis is a dev extra
    pass

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # flows/ and tasks/ are not installed; --import-mode=importlib adds no paths
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def tmp_project(tmp_path: Path) -> Path:
    """A temporary project root holding a copy of params.yaml (outputs and the MLflow store land inside it)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


# -- a tiny causal LM with a real chat template (fast stand-in for SmolLM2 in unit tests) ------------------------
# Text the tiny tokenizer is trained on: tool-schema JSON, the chat template and a few words.
TINY_CORPUS = (
    '{"type": "function", "function": {"name": "cancel_pending_order", "description": "Cancel a pending order.", '
    '"parameters": {"type": "object", "properties": {"order_id": {"type": "string"}, "reason": {"type": "string"}}, '
    '"required": ["order_id", "reason"]}}}'
)


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [TINY_CORPUS, qwen2_5_chat_template, "Cancel order please I changed my mind tool_call arguments"] * 3
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = qwen2_5_chat_template
    fast.padding_side = "left"
    assert fast.convert_tokens_to_ids("<|im_end|>") == 2
    return fast


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        initializer_range=0.3,  # peaky logits: greedy choices are far from ties
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread while these tests run: on 2 cores shared with other jobs, torch's second thread makes
    small ops wait on a busy core (measured here: a 2,000-token forward of the tiny model took 0.70 s with 2
    threads, 0.06 s with 1)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
