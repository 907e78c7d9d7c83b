"""Where a policy model runs: on the accelerator when there is one, and freeing its memory between models."""

from __future__ import annotations

import gc
from typing import Any


def on_accelerator(model: Any) -> Any:
    """`model` moved to the CUDA device when one is available, else as it is (CPU)."""
    import torch

    return model.to("cuda") if torch.cuda.is_available() else model


def free_memory() -> None:
    """Collect a dropped model before loading the next one (on an accelerator, free its cached memory too)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
