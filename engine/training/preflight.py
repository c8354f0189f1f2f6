"""Every cheap check a training start runs, in order, before anything is freed.

validate config -> family -> precision preflight -> base is a pipeline ->
dataset decoded. Pure and CPU-only (the dataset decode uses Pillow); the
result is a :class:`TrainingPlan` the trainer child receives whole, so it
never re-decides anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import PreflightError
from engine.hardware.profile import HardwareProfile
from engine.plugins import Registry
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.training import resolve_training_precision, training_precision_preflight_error
from engine.preflight.dataset import DatasetReport, discover_dataset
from engine.preflight.model import ModelSource, resolve_model
from engine.training.config import TrainingConfig
from engine.types import FamilySpec, TrainingObjective


@dataclass(frozen=True)
class TrainingPlan:
    config: TrainingConfig
    family: FamilySpec
    base: ModelSource
    hardware: HardwareProfile
    device: str
    base_precision: Resolved[str]
    weight_dtype: Resolved[str]
    compile: Resolved[str]
    steps: int
    lora_targets: tuple[str, ...]
    objective: TrainingObjective
    dataset: DatasetReport

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.family.name,
            "base": self.base.to_dict(),
            "device": self.device,
            "steps": self.steps,
            "lora_targets": list(self.lora_targets),
            "objective": self.objective.prediction,
            "resolved": {
                "base_precision": self.base_precision.to_dict(),
                "weight_dtype": self.weight_dtype.to_dict(),
                "compile": self.compile.to_dict(),
            },
            "dataset": self.dataset.to_dict(),
        }


def preflight_training(
    registry: Registry,
    config: TrainingConfig,
    hardware: HardwareProfile,
) -> TrainingPlan:
    """The plan for ``config`` on ``hardware``, or the first :class:`PreflightError`."""
    family = registry.family(config.family) if config.family else None
    if family is not None:
        _precision_check(registry, family, config, hardware)
    base = resolve_model(registry, config.base_model, family=config.family)
    if family is None:
        family = base.family
        _precision_check(registry, family, config, hardware)
    if base.kind not in ("pipeline", "hub"):
        raise PreflightError(
            f"{config.base_model} is a {base.kind.replace('_', '-')} checkpoint; LoRA training "
            "needs a diffusers pipeline folder (with model_index.json) or a hub repo id",
            code="not_a_pipeline",
        )
    objective = registry.training_objective(family)
    if objective is None:
        raise PreflightError(f"the {family.name} plugin provides no trainer", code="not_trainable")
    dataset = discover_dataset(config.dataset_dir)
    device = "cpu" if config.device == "cpu" or not hardware.cuda else "cuda"
    precision = (
        resolve_training_precision(
            registry, family, hardware, config.base_precision,
            base_repo=config.base_model, device=config.device,
        )
        if family.base_precision_applies
        else auto("none", f"{family.label}'s trainer ignores base_precision")
    )
    return TrainingPlan(
        config=config,
        family=family,
        base=base,
        hardware=hardware,
        device=device,
        base_precision=precision,
        weight_dtype=_weight_dtype(family, hardware, device, config),
        compile=_compile(registry, family, device, precision.value, config.compile),
        steps=config.total_steps(len(dataset.items)),
        lora_targets=config.lora_targets or family.lora_targets,
        objective=objective,
        dataset=dataset,
    )


def _precision_check(
    registry: Registry, family: FamilySpec, config: TrainingConfig, hardware: HardwareProfile
) -> None:
    error = training_precision_preflight_error(
        registry, family, hardware, config.base_precision,
        base_repo=config.base_model, device=config.device, mixed_precision=config.mixed_precision,
    )
    if error is not None:
        raise error


def _weight_dtype(family: FamilySpec, hardware: HardwareProfile, device: str, config: TrainingConfig) -> Resolved[str]:
    if device == "cpu":
        return auto("fp32", "CPU: fp32 weights and compute (bf16 matmuls are emulated on most CPUs)")
    if family.training_requires_bf16 or (hardware.native_bf16 and config.mixed_precision != "fp16"):
        return auto("bf16", f"{family.label} trains in bf16")
    return auto("fp16", f"no native bf16 on {hardware.device_name}: fp16 mixed precision")


def _compile(registry: Registry, family: FamilySpec, device: str, precision: str, requested: str) -> Resolved[str]:
    regions = registry.compile_regions(family)
    if requested == "off":
        return explicit("off", "pinned off")
    source = auto if requested == "auto" else explicit
    if not regions:
        return source("off", "the family names no blocks to compile")
    if precision == "int8":
        return source("off", "int8 base: inductor rejects the int8 tensor-subclass training graph")
    if precision == "nf4":
        return source("off", "nf4 base: bitsandbytes 4-bit layers are not compiled")
    if device != "cuda" and requested == "auto":
        return auto("off", "CPU: compiling costs more than a short run gains")
    return source("regional", f"regional compile of {', '.join(regions)} with dynamic shapes")
