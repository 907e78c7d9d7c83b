"""Activating routed adapters with PEFT: the base model, one capability's adapter, or an exact composition of
several (docs/method.md §4 and its top-p extension), plus the adapter-merging baselines.

`AdapterBank` loads every capability's LoRA adapter (a PEFT `save_pretrained` folder) into one PeftModel under
the capability id as adapter name. `use(weights)` switches for the duration of a `with` block:

- `{}` — the base model (adapter layers disabled);
- `{c: 1.0}` — adapter c alone (`set_adapter`): W' = W + s_c B_c A_c, s_c = lora_alpha / r (PEFT's scaling);
- anything else — the composition W' = W + Σ α_c s_c B_c A_c, built once with `add_weighted_adapter(...,
  combination_type="cat")` and cached under a name made from the rounded weights.

PEFT facts this relies on (checked numerically in tests/routing/test_compose.py): "cat" stacks the adapters' A
matrices (each scaled by α_c s_c) and B matrices side by side into one adapter of rank Σ r_c with scaling 1, so
B_cat A_cat = Σ α_c s_c B_c A_c exactly. "linear" instead forms Σ √(α_c s_c) A_c and Σ √(α_c s_c) B_c and
multiplies them, which adds the cross terms B_i A_j (i ≠ j): not the sum of the adapters' updates. With a single
adapter PEFT always uses "linear", which is then exact (√(α s)² = α s).

`merged(ids, weights, method)` builds the consolidation baselines the paper compares routing against (one merged
adapter for every task): "linear" (the cross-term mixture above, PEFT's cheapest merge) and "ties" (TIES-merging,
Yadav et al. 2023, applied to A and B separately: keep each adapter's largest-magnitude `density` fraction of
entries, elect a sign per entry by total mass, and average the entries that agree with it). Both need equal ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

MERGE_METHODS = ("linear", "ties")
COMPOSED_PREFIX = "compose"
MERGED_PREFIX = "merged"


class CompositionError(ValueError):
    """An adapter set or weighting that cannot be activated (the message says what to change)."""


def _slug(value: float, digits: int) -> str:
    # PEFT keeps adapters in torch ModuleDicts, whose keys may not contain "."; "-0.25" -> "m0p250".
    text = f"{abs(value):.{digits}f}".replace(".", "p")
    return ("m" if value < 0 else "") + text


def weights_name(prefix: str, weights: Mapping[str, float], digits: int) -> str:
    """A deterministic adapter name for `weights` rounded to `digits` decimals (ids sorted)."""
    parts = [f"{cid}_{_slug(w, digits)}" for cid, w in sorted(weights.items())]
    return "__".join([prefix, *parts])


class AdapterBank:
    """Every capability's LoRA adapter on one base model, switchable per task.

    `model`: the base model (PEFT wraps it in place: its linear layers gain LoRA branches) or a PeftModel that
    already holds other adapters. `adapters`: capability id -> folder with `adapter_config.json` and the adapter
    weights. `policy`: an optional `LocalPolicy` generating with this model; its prompt-prefix KV cache is cleared
    on every switch, because its key (a weights fingerprint plus the active adapter's name) does not change when
    adapter layers are disabled or re-enabled, so a cached prefix computed under another adapter would be reused.
    `digits`: the rounding of composition weights, which names (and so caches) composed adapters."""

    def __init__(self, model: Any, adapters: Mapping[str, str | Path], policy: Any = None, digits: int = 3):
        from peft import PeftModel

        if not adapters:
            raise CompositionError("AdapterBank needs at least one adapter: {capability_id: adapter folder}")
        for cid, folder in adapters.items():
            if "." in cid or not cid:
                raise CompositionError(f"capability id {cid!r} cannot name a PEFT adapter (empty, or contains '.')")
            if not (Path(folder) / "adapter_config.json").is_file():
                raise CompositionError(
                    f"{folder} has no adapter_config.json: not a PEFT adapter folder (for {cid}); pass the folder "
                    "written by save_pretrained, e.g. artifacts/training/<capability_id>/adapter"
                )
        items = list(adapters.items())
        if isinstance(model, PeftModel):
            peft = model
            for cid, folder in items:
                peft.load_adapter(str(folder), adapter_name=cid, is_trainable=False)
        else:
            cid0, folder0 = items[0]
            peft = PeftModel.from_pretrained(model, str(folder0), adapter_name=cid0, is_trainable=False)
            for cid, folder in items[1:]:
                peft.load_adapter(str(folder), adapter_name=cid, is_trainable=False)
        peft.eval()
        self.model = peft
        self.capabilities = [cid for cid, _ in items]
        self.policy = policy
        self.digits = int(digits)
        self._enabled = True  # PEFT loads adapters enabled
        self.model.set_adapter(self.capabilities[0], inference_mode=True)

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def adapter_names(self) -> list[str]:
        return list(self.model.peft_config)

    def ranks(self) -> dict[str, int]:
        return {name: int(cfg.r) for name, cfg in self.model.peft_config.items()}

    @property
    def active(self) -> str | None:
        """The adapter the model runs with now; None when adapter layers are disabled (the base model)."""
        if not self._enabled:
            return None
        active = self.model.active_adapter
        return active if isinstance(active, str) else active[0]

    def _switch(self, name: str | None) -> None:
        if name is None:
            self.model.base_model.disable_adapter_layers()
            self._enabled = False
        else:
            self.model.set_adapter(name, inference_mode=True)
            self.model.base_model.enable_adapter_layers()
            self._enabled = True
        if self.policy is not None:
            self.policy.clear_prefix_cache()

    # -- activation --------------------------------------------------------------------------------------------
    def adapter_for(self, weights: Mapping[str, float]) -> str | None:
        """The adapter name that realises `weights` (None = the base model), creating a composition if needed."""
        clean = {}
        for cid, w in weights.items():
            if cid not in self.model.peft_config:
                raise CompositionError(f"no adapter {cid!r} in the bank; loaded: {', '.join(self.adapter_names)}")
            if not math.isfinite(float(w)):
                raise CompositionError(f"weight of {cid!r} is {w}; weights must be finite numbers")
            w = round(float(w), self.digits)
            if w != 0.0:  # a zero weight contributes nothing; dropping it keeps the cache key canonical
                clean[cid] = w
        if not clean:
            return None
        if len(clean) == 1 and next(iter(clean.values())) == 1.0:
            return next(iter(clean))
        name = weights_name(COMPOSED_PREFIX, clean, self.digits)
        if name not in self.model.peft_config:
            ids = sorted(clean)
            # "cat" is the exact sum of the updates (module docstring); for one adapter PEFT switches to "linear",
            # which is exact there too.
            self.model.add_weighted_adapter(
                adapters=ids, weights=[clean[c] for c in ids], adapter_name=name, combination_type="cat"
            )
        return name

    @contextlib.contextmanager
    def use(self, weights: Mapping[str, float]) -> Iterator[Any]:
        """Run the model with `weights` (adapter name -> α; {} = base model) inside the block; the previous state
        comes back afterwards. Yields the PeftModel."""
        previous = self.active
        previous_name = self.model.active_adapter
        target = self.adapter_for(weights)
        self._switch(target)
        try:
            yield self.model
        finally:
            if previous is None:
                self.model.set_adapter(previous_name, inference_mode=True)
                self._switch(None)
            else:
                self._switch(previous)

    # -- merging baselines -------------------------------------------------------------------------------------
    def merged(
        self,
        ids: Sequence[str],
        weights: Sequence[float],
        method: Literal["linear", "ties"] = "linear",
        density: float = 0.5,
    ) -> str:
        """A merged adapter of `ids` with `weights` (see the module docstring for what "linear" and "ties" do);
        returns its name, to activate with `use({name: 1.0})`. Created once per (method, weights, density)."""
        ids = list(ids)
        weights = [float(w) for w in weights]
        if method not in MERGE_METHODS:
            raise CompositionError(f"method must be one of {MERGE_METHODS}, got {method!r}")
        if len(ids) < 2 or len(set(ids)) != len(ids):
            raise CompositionError(f"merging needs two or more distinct adapters, got {ids}")
        if len(weights) != len(ids):
            raise CompositionError(f"{len(weights)} weights for {len(ids)} adapters; give one weight per adapter")
        unknown = [c for c in ids if c not in self.model.peft_config]
        if unknown:
            raise CompositionError(f"no adapters {unknown} in the bank; loaded: {', '.join(self.adapter_names)}")
        ranks = {c: self.ranks()[c] for c in ids}
        if len(set(ranks.values())) != 1:
            raise CompositionError(
                f"{method} merging combines the adapters' A and B matrices entry by entry, so all ranks must be "
                f"equal; got {ranks}. Compose them exactly with use({{...}}) (PEFT 'cat', any ranks) or retrain "
                "the adapters with one rank."
            )
        if method == "ties" and not 0.0 < density <= 1.0:
            raise CompositionError(f"density must be within (0, 1] for ties, got {density}")
        named = dict(zip(ids, weights))
        if method == "ties":
            named["density"] = density
        name = weights_name(f"{MERGED_PREFIX}_{method}", named, self.digits)
        if name not in self.model.peft_config:
            kwargs = {"density": density} if method == "ties" else {}
            self.model.add_weighted_adapter(
                adapters=ids, weights=weights, adapter_name=name, combination_type=method, **kwargs
            )
        return name

    def drop_composed(self) -> list[str]:
        """Delete every cached composition and merged adapter that is not active (each holds rank Σ r_c matrices
        per module); returns their names."""
        active = self.model.active_adapter
        dropped = []
        for name in self.adapter_names:
            made_here = name.startswith((COMPOSED_PREFIX + "__", MERGED_PREFIX + "_")) and name not in self.capabilities
            if made_here and name != active:
                self.model.delete_adapter(name)
                dropped.append(name)
        return dropped
