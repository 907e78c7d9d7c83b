"""Stage 4 — routing (docs/method.md §4): pick the adapter that fits each task, without training.

- `router`: the routing options (one lettered line per capability plus "no adapter"), the routing prompt, the
  channel cards, the `Router` (label probabilities from the base model's next-token logits with optional contextual
  calibration, or channel scoring: the task's likelihood after each option's card; top-1 or top-p selection) and
  `routing_accuracy` (accuracy against oracle labels, chance levels, confusion matrix).
- `stage`: `run`, the stage entry point (artifacts/routing/decisions.json: the router's choice per held-out
  instance, for all adapters and for each curve mark's prefix of them).
- `compose`: `AdapterBank`, every capability's LoRA adapter on one PeftModel: the base model, one adapter, or an
  exact composition W + Σ α_c B_c A_c per task; and the merged-adapter baselines (linear, TIES).

Heavy libraries (torch, peft) are imported inside the functions that need them.
"""

from trace_core.routing.compose import AdapterBank, CompositionError
from trace_core.routing.router import (
    Route,
    RouteOption,
    Router,
    RoutingError,
    build_options,
    channel_card,
    routing_accuracy,
    routing_messages,
    routing_prompt,
    select,
    task_text,
)
from trace_core.routing.stage import run

__all__ = [
    "AdapterBank",
    "CompositionError",
    "Route",
    "RouteOption",
    "Router",
    "RoutingError",
    "build_options",
    "channel_card",
    "routing_accuracy",
    "routing_messages",
    "routing_prompt",
    "run",
    "select",
    "task_text",
]
