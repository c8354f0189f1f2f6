"""The training start's numeric canary: the run's base precision on a real slice of its base.

Before anything is evicted, one Linear of the base's denoiser is read from its
safetensors (:func:`engine.runtime.canary.read_linear`), set up in the run's
base precision on the run's device and run; output that is not finite, or is
constant, refuses the start (:class:`TrainingCanaryFailed`). Runs shorter than
:data:`CANARY_MIN_STEPS` skip it (with the reason): they fail fast on their own.
Here, not in the runtime, because it reads a training plan: the runtime never
imports the trainer.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import PreflightError
from engine.runtime.canary import TORCH_DTYPES, CanaryResult, ModuleFilter, read_linear, run_linear

if TYPE_CHECKING:
    from engine.training.preflight import TrainingPlan

#: Runs shorter than this skip the canary: a broken scheme fails their first step anyway.
CANARY_MIN_STEPS = 20


class TrainingCanaryFailed(PreflightError):
    """A training start refused: its base precision broke a real slice of the model."""

    code = "canary_failed"

    def __init__(self, result: CanaryResult) -> None:
        super().__init__(result.reason)
        self.result = result

    def to_dict(self) -> dict[str, object]:  # type: ignore[override]
        return {**super().to_dict(), "canary": self.result.to_dict()}



def training_canary(plan: TrainingPlan) -> CanaryResult:
    """Run the canary for a training plan before anything is evicted; raise
    :class:`TrainingCanaryFailed` when the run's base precision breaks it."""
    from engine.training.precision import CONVERTED_MODES, base_transform

    scheme = plan.base_precision.value
    dtype_name = plan.weight_dtype.value
    skip = _skip_reason(plan)
    if skip:
        return CanaryResult(True, scheme, dtype_name, plan.device, skipped=True, reason=skip)
    keep: ModuleFilter
    if scheme in CONVERTED_MODES:
        transform, keep = base_transform(scheme)
    else:
        transform, keep = None, lambda module, _: isinstance(module, torch.nn.Linear)
    layer_and_name = read_linear(Path(plan.base.location) / plan.family.pipeline.denoiser, keep)
    if layer_and_name is None:
        return CanaryResult(True, scheme, dtype_name, plan.device, skipped=True,
                            reason="no Linear weight the scheme converts was found in the base's files")
    name, layer = layer_and_name
    dtype = TORCH_DTYPES[dtype_name]
    layer = layer.to(dtype=dtype)
    if transform is not None:
        holder = torch.nn.Module()
        holder.add_module("layer", layer)
        transform(holder, lambda module, child: keep(module, name) if child == "layer" else False)
        layer = holder.layer
    layer = layer.to(plan.device)
    result = run_linear(layer, name, scheme=scheme, dtype=dtype, device=plan.device)
    if not result.ok:
        advice = "Choose another base_precision or check the base's weights; nothing was evicted"
        raise TrainingCanaryFailed(replace(result, reason=f"{result.reason}. {advice}"))
    return result


def _skip_reason(plan: TrainingPlan) -> str | None:
    if plan.steps < CANARY_MIN_STEPS:
        return f"a {plan.steps}-step run (< {CANARY_MIN_STEPS}) fails fast on its own; no canary"
    if plan.base.kind != "pipeline":
        return "the base is not a local pipeline folder; its weights are not read before the start"
    return None
