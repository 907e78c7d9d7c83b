"""`GRPOSettings`: every knob of one GRPO run that trains one capability's LoRA adapter (docs/method.md §3).

The class lives in `trace_core.config`, as the GRPO part of params.yaml's `training:` section (`TrainingCfg`
extends it), so that its fields are listed once; `GRPOSettings.from_params` is the trainer's view of that section.
"""

from __future__ import annotations

from trace_core.config import GRPOSettings

__all__ = ["GRPOSettings"]
