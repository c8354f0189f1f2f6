"""The built-in plugin that answers per-concern hooks from family tables.

Every implementation here is ``trylast``: a family plugin (or a third-party
plugin overriding one) answers first when it has something to say, and the
registered :class:`~engine.contract.types.FamilySpec` answers otherwise. This is why a
family's hooks module is usually one function long.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

from engine.errors import PluginError
from engine.hardware.profile import HardwareProfile
from engine.contract.hookspecs import hookimpl
from engine.contract.types import (
    ATTENTION_KERNELS,
    TRAINING_PRECISIONS,
    Checkpoint,
    ComponentSizes,
    FamilySpec,
    OptimizationDeny,
    Purpose,
    QuantDeny,
    TrainingObjective,
)


@hookimpl(trylast=True)
def engine_component_sizes(
    family: FamilySpec, checkpoint: Checkpoint | None
) -> ComponentSizes | None:
    if checkpoint is not None and checkpoint.sizes is not None:
        return checkpoint.sizes
    return family.sizes


@hookimpl(trylast=True)
def engine_quant_deny(family: FamilySpec, purpose: Purpose) -> Iterable[QuantDeny] | None:
    return family.quantisation.deny(purpose)


@hookimpl(trylast=True)
def engine_optimization_deny(family: FamilySpec) -> Iterable[OptimizationDeny] | None:
    return family.speed.optimization_deny + capability_denies(family)


#: What a capability the table declares missing turns off, and why.
_MISSING: dict[str, tuple[tuple[str, ...], str]] = {
    "step_cache": (("step_cache",), "the denoiser has no cache hooks (declared by the family's table)"),
    "attention_dispatcher": (
        ATTENTION_KERNELS,
        "the denoiser does not use diffusers' attention dispatcher (declared by the family's table)",
    ),
    "regional_compile": (("compile",), "the denoiser has no compile regions (declared by the family's table)"),
}


def capability_denies(family: FamilySpec) -> tuple[OptimizationDeny, ...]:
    """The optimisations a capability declared ``False`` rules out, before
    anything loads (undeclared ones are checked on the loaded classes)."""
    declared = family.capabilities.declared()
    return tuple(
        OptimizationDeny(optimization, reason)
        for capability, (optimizations, reason) in _MISSING.items()
        if declared[capability] is False
        for optimization in optimizations
    )


@hookimpl(trylast=True)
def engine_dense_base(family: FamilySpec, repo: str) -> str | None:
    if not family.is_prequantised(repo):
        return None
    checkpoint = family.checkpoint(repo)
    if checkpoint is not None:
        return checkpoint.repo
    return family.quantisation.default_dense_base or family.default_checkpoint.repo


@hookimpl(trylast=True)
def engine_training_precision_modes(
    family: FamilySpec, hardware: HardwareProfile
) -> tuple[str, ...] | None:
    return TRAINING_PRECISIONS if family.training.base_precision_applies else ()


@hookimpl(trylast=True)
def engine_compile_regions(family: FamilySpec) -> tuple[str, ...] | None:
    return family.speed.compile_regions


@hookimpl(trylast=True)
def engine_training_objective(family: FamilySpec) -> TrainingObjective | None:
    return family.training.objective


@hookimpl(trylast=True)
def engine_build_tiny_pipeline(family: FamilySpec, path: Path, checkpoint: Checkpoint | None) -> Path | None:
    builder = (checkpoint.tiny_pipeline if checkpoint is not None else "") or family.tiny_pipeline
    if not builder:
        return None
    return Path(load_object(builder)(path))


def load_object(dotted: str) -> object:
    """Import ``"package.module:attribute"`` lazily (family runtime code)."""
    module_name, _, attribute = dotted.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute) if attribute else module
    except (ImportError, AttributeError) as exc:
        raise PluginError(
            f"cannot load {dotted!r}: {exc}; is the package that provides it installed?",
            code="plugin_object_missing",
        ) from exc


# -- the runtime hooks' defaults are the runtime's own (engine.runtime.family_hooks) --------


@hookimpl(trylast=True)
def engine_generate_kwargs(family: FamilySpec, pipeline: object, kwargs: dict) -> dict | None:
    return kwargs
