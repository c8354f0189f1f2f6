"""Every cheap check a training start runs, in order, before anything is freed.

validate config -> family -> precision preflight -> base is a pipeline ->
dataset decoded. Pure and CPU-only (the dataset decode uses Pillow); the
result is a :class:`TrainingPlan` the trainer child receives whole, so it
never re-decides anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from engine.errors import EngineError, PreflightError, together
from engine.hardware.profile import HardwareProfile
from engine.contract.plugins import Registry
from engine.policy.resolved import Resolved, auto, explicit
from engine.policy.available import AvailableMemory, available_memory
from engine.policy.training import (
    InsufficientMemory,
    MemoryRequest,
    resolve_checkpointing,
    resolve_training_precision,
    training_device,
    training_precision_preflight_error,
)
from engine.policy.training_memory import TrainingMemoryEstimate
from engine.preflight.dataset import DatasetReport, discover_dataset
from engine.training.run_memory import held_denoisers, memory_request, training_shape
from engine.preflight.hub import weights_report
from engine.preflight.model import ModelSource, hub_access_error, lora_target_error, resolve_model
from engine.training.buckets import BucketPlan, plan_buckets
from engine.requests.training import TrainingConfig
from engine.training.levers import TrainingLevers, resolve_levers
from engine.training.output_dir import output_check
from engine.training.resume import check_resume
from engine.training.multigpu import check_each_device, rank_devices
from engine.training.video_plan import ExpertChoice, clip_window, early_window, expert_choice, video_spec_of
from engine.preflight.clips import ClipWindow
from engine.contract.types import FamilySpec, TrainingObjective

_T = TypeVar("_T")


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
    #: The run's estimated device memory, and the memory it was checked against.
    memory: TrainingMemoryEstimate | None = None
    available: AvailableMemory | None = None
    gradient_checkpointing: Resolved[bool] = explicit(False)
    #: Each image's aspect bucket (None: every image square at ``resolution``).
    buckets: BucketPlan | None = None
    #: LR, warmup, flow shift, loss weighting, EMA, optimizer (see :mod:`engine.training.levers`).
    levers: TrainingLevers | None = None
    #: A resume's changed settings, ``(field, recorded, asked)`` (only those a checkpoint can honour).
    resume_changes: tuple[tuple[str, object, object], ...] = ()
    #: Whether the base's weights are here, and what a start would download (:func:`weights_report`).
    weights: dict[str, object] | None = None
    #: A video family's clip window (frames at its fps); None for an image family.
    window: ClipWindow | None = None
    #: A two-expert base's trained expert(s) (:mod:`engine.training.video_plan`); None: one denoiser.
    expert: Resolved[ExpertChoice] | None = None
    #: The base trained on where it is not the one named (a distilled model's base), or the note
    #: that a local distilled folder trains as given; None: the base named, nothing to say.
    trained_base: Resolved[str] | None = None

    @property
    def trained_components(self) -> tuple[str, ...]:
        """The pipeline components the LoRA goes on: the denoiser, or the expert(s) chosen."""
        return self.expert.value.components if self.expert is not None else (self.family.pipeline.denoiser,)

    @property
    def loaded_denoisers(self) -> tuple[str, ...]:
        """The denoisers the run loads: those it trains, and a one-expert run's other expert only
        when its samples need it (each clip is rendered by both)."""
        return held_denoisers(self.family, self.expert.value if self.expert else None,
                              samples=bool(self.config.sample_prompts))

    def to_dict(self) -> dict[str, object]:
        return {
            "memory": {
                "estimate": self.memory.to_dict() if self.memory else None,
                "available": self.available.to_dict() if self.available else None,
            },
            "family": self.family.name,
            "base": self.base.to_dict(),
            "weights": self.weights,
            "device": self.device,
            "gpus": self.config.gpus,
            "nodes": {"count": self.config.nodes, "rank": self.config.node_rank,
                      "main_address": self.config.main_address, "world": self.config.world},
            "steps": self.steps,
            "lora_targets": list(self.lora_targets),
            "objective": self.objective.prediction,
            "resolved": {
                "base_precision": self.base_precision.to_dict(),
                "weight_dtype": self.weight_dtype.to_dict(),
                "compile": self.compile.to_dict(),
                "gradient_checkpointing": self.gradient_checkpointing.to_dict(),
                **({"base": self.trained_base.to_dict()} if self.trained_base else {}),
                **(self.levers.to_dict() if self.levers else {}),
            },
            "dataset": self.dataset.to_dict(),
            "buckets": self.buckets.to_dict() if self.buckets else None,
            "window": self.window.to_dict() if self.window else None,
            "expert": {**self.expert.to_dict(), "value": self.expert.value.to_dict()} if self.expert else None,
        }


def preflight_training(
    registry: Registry,
    config: TrainingConfig,
    hardware: HardwareProfile,
    available: AvailableMemory | None = None,
    *,
    allow_download: bool = True,
    fetch: bool = True,
) -> TrainingPlan:
    """The plan for ``config`` on ``hardware``, or the first :class:`PreflightError`.

    :param available: the memory the run will have after eviction (the
        service's figure, with its sources); its free figure replaces
        ``hardware``'s. Without it, ``hardware``'s free memory is used as is.
    :param allow_download: whether a hub base missing from the cache may be downloaded.
    :param fetch: whether the run will be started (its base must then be here or fetchable);
        False for a dry run, which sizes a base that is not here from the family's table,
        downloads nothing and says so (``TrainingPlan.weights``).
    """
    # Every path of the request is checked first and its refusals kept, so a dry run
    # reports a missing dataset together with what the machine refuses.
    problems: list[PreflightError] = []
    resume_changes = _kept(problems, lambda: check_resume(config))  # the checkpoint read safely
    resolved = _resolved(registry, config)  # once: the clips' window and the plan both read it
    window = early_window(resolved, config)  # a video family's clips are judged against it
    dataset = _kept(problems, lambda: discover_dataset(config.dataset_dir, resolution=config.resolution,
                                                       strict=config.strict, window=window))
    _kept(problems, lambda: output_check(config))
    plan: TrainingPlan | None = None
    try:
        plan = _planned(registry, config, hardware, available, resume_changes, dataset, resolved,
                        allow_download=allow_download, fetch=fetch)
    except PreflightError as exc:
        problems.append(exc)
    if problems or plan is None:
        raise together(problems)
    return plan


def _kept(problems: list[PreflightError], check: Callable[[], _T]) -> _T:
    """``check()``'s answer; its refusal is kept in ``problems`` (the answer is then unused)."""
    try:
        return check()
    except PreflightError as exc:
        problems.append(exc)
        return None  # type: ignore[return-value]  # a refused request never reaches its use


def _planned(
    registry: Registry, config: TrainingConfig, hardware: HardwareProfile, available: AvailableMemory | None,
    resume_changes: tuple[tuple[str, object, object], ...], dataset: DatasetReport | None,
    resolved: ModelSource | None, *, allow_download: bool, fetch: bool,
) -> TrainingPlan | None:
    """The plan once the request's paths are read: the base, the machine, the memory. None
    after every check when the dataset was refused (its refusal is already kept)."""
    available = available or available_memory(hardware)
    hardware = available.apply(hardware)
    devices = rank_devices(config, hardware)  # --gpus N: N devices, each checked below
    family, base, trained_base = _family_and_base(registry, config, hardware, resolved,
                                                  allow_download=allow_download, fetch=fetch)
    if trained_base is not None and base.kind == "hub":  # the run, its record and config.toml name it
        config = config.model_copy(update={"base_model": base.location})
    config = _anchored(config, base)
    objective = registry.training_objective(family)
    if objective is None:
        raise PreflightError(f"the {family.name} plugin provides no trainer", code="not_trainable")
    window = clip_window(family, base.checkpoint, config)  # frames asked of an image family: refused first
    # Sized by the longest example: a clip's window where the dataset has clips.
    named = [item.relative for item in dataset.items if item.is_clip] if dataset is not None else []
    clips = bool(named)
    if clips and family.rendering.output != "frames":  # before anything is evicted, not at step 0
        raise PreflightError(
            f"{config.dataset_dir} holds {len(named)} video clip(s) ({', '.join(named[:3])}"
            f"{', ...' if len(named) > 3 else ''}), but {family.label} renders images: train a video family "
            "on clips, or give it a folder of images", code="clips_not_supported")
    expert = expert_choice(family, base, config)
    device = training_device(hardware, config.device, four_bit_base=family.training.base_precision_applies)
    memory = memory_request(registry, family, base, config, frames=window.frames if window and clips else 1,
                            expert=expert.value if expert is not None else None)
    precision = (
        resolve_training_precision(
            registry, family, hardware, config.base_precision,
            base_repo=config.base_model, device=config.device, memory=memory,
        )
        if family.training.base_precision_applies
        else _ignored_precision(family, config.base_precision)
    )
    _precision_check(registry, family, config, hardware, memory, mode=precision)
    check_each_device(devices, lambda device: _precision_check(registry, family, config, device, memory))
    checkpointing = resolve_checkpointing(family, precision.value, memory, hardware, config.device)
    levers = resolve_levers(family, objective, config, device, hardware,
                            steps=config.total_steps(len(dataset.items)) if dataset is not None else None)
    if dataset is None:
        return None
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
        lora_targets=config.lora_targets or family.lora.targets,
        objective=objective,
        dataset=dataset,
        memory=memory.settled(checkpointing.value).estimate(family, precision.value, device),
        available=available,
        gradient_checkpointing=checkpointing,
        levers=levers,
        resume_changes=resume_changes,
        weights=weights_report(base, registry.component_sizes(family, base.checkpoint)),
        buckets=plan_buckets(
            [item.size for item in dataset.items], [item.relative for item in dataset.items],
            config.resolution, _side_multiple(family, base), warned={name for name, _ in dataset.small},
            frames=[window.frames if window and item.is_clip else 1 for item in dataset.items],
        ),
        window=window,
        expert=expert,
        trained_base=trained_base,
    )


def _side_multiple(family: FamilySpec, base: ModelSource) -> int:
    """Bucket sides: a video checkpoint's own multiple (TI2V-5B's 16x VAE x patch 2 = 32) where larger."""
    spec = video_spec_of(family, base.checkpoint)
    return max(family.rendering.sides, spec.size_multiple if spec is not None else 1)


def _resolved(registry: Registry, config: TrainingConfig) -> ModelSource | None:
    """The base, resolved once for the whole preflight; None where it is refused (the plan resolves
    it again in its turn, after the checks that come first, and gives that refusal)."""
    try:
        return resolve_model(registry, config.base_model, family=config.family)
    except EngineError:
        return None


def _family_and_base(
    registry: Registry, config: TrainingConfig, hardware: HardwareProfile, resolved: ModelSource | None,
    *, allow_download: bool, fetch: bool,
) -> tuple[FamilySpec, ModelSource, Resolved[str] | None]:
    """The family (checked against the precision rules as soon as it is known, before the
    base is resolved when the config names it), the base, which must be a pipeline, and the
    decision that trains on another base than the one named (or None)."""
    family = registry.family(config.family) if config.family else None
    if family is not None:
        _precision_check(registry, family, config, hardware)
    base = resolved or resolve_model(registry, config.base_model, family=config.family)
    if family is None:
        family = base.family
        _precision_check(registry, family, config, hardware)
    if base.kind not in ("pipeline", "hub"):
        raise PreflightError(
            f"{config.base_model} is a {base.kind.replace('_', '-')} checkpoint; LoRA training "
            "needs a diffusers pipeline folder (with model_index.json) or a hub repo id",
            code="not_a_pipeline",
        )
    base, trained_base = _trained_base(registry, family, base)
    _base_check(base, config.lora_targets or family.lora.targets, allow_download=allow_download, fetch=fetch)
    return family, base, trained_base


def _trained_base(registry: Registry, family: FamilySpec, base: ModelSource) -> tuple[ModelSource, Resolved[str] | None]:
    """The base a run trains on: a checkpoint whose LoRAs train on another (a step-distilled
    model's undistilled base, by its table's ``trained_on``) is swapped for it when named by hub
    id or name; a local folder of it trains as given. The decision and its reason, or None."""
    asked = base.checkpoint
    target = family.checkpoint(asked.trained_on) if asked is not None and asked.trained_on else None
    if asked is None or target is None:
        return base, None
    why = (f"{asked.label} is step-distilled: its LoRAs train on {target.label} ({target.reference}), the "
           "undistilled model with the full schedule and real guidance, and apply to "
           f"{asked.label} as trained")
    if base.kind != "hub":
        return base, auto(base.location, f"trains on the folder as given, though {why}; pass --base "
                          f"{target.reference} to train on that")
    return resolve_model(registry, target.reference, family=family.name), auto(target.reference, why)


def _ignored_precision(family: FamilySpec, asked: str) -> Resolved[str]:
    """A family whose trainer holds its base in the training dtype: ``none``, and an explicit
    request is kept beside it, ignored with a note (a leftover value never fails the run)."""
    if asked == "auto":
        return auto("none", f"{family.label}'s trainer holds its base in the training dtype")
    return auto("none", f"{family.label}'s trainer holds its base in the training dtype: base_precision="
                        f"{asked} is ignored (leave it at auto for this family)").with_request(asked)


def _base_check(base: ModelSource, targets: tuple[str, ...], *, allow_download: bool, fetch: bool) -> None:
    """Refuse a hub base that cannot (or may not) be had for a start, and LoRA targets the base lacks."""
    access = hub_access_error(base, allow_download=allow_download) if fetch else None
    error = access or lora_target_error(base, targets)
    if error is not None:
        raise error


def _anchored(config: TrainingConfig, base: ModelSource) -> TrainingConfig:
    """``config`` with every local path absolute (a hub base stays its repo id): the run's
    record and ``config.toml`` then mean the same from any working directory, so
    ``train --resume`` and ``train --config`` work wherever they are typed."""
    update: dict[str, object] = {}
    if base.kind != "hub":
        update["base_model"] = str(Path(base.location).expanduser().absolute())
    for name in ("dataset_dir", "output_dir", "prompt_cache_dir", "resume_from"):
        value = getattr(config, name)
        if value is not None:
            update[name] = Path(value).expanduser().absolute()
    return config.model_copy(update=update)


def _precision_check(
    registry: Registry,
    family: FamilySpec,
    config: TrainingConfig,
    hardware: HardwareProfile,
    memory: MemoryRequest | None = None,
    *,
    mode: Resolved[str] | None = None,
) -> None:
    """Refuse a doomed precision request.

    Run early, before the base is read, with the family's table sizes, where
    only the rules may refuse (an explicit mode is checked as asked; ``auto``
    only by the rules that hold whatever it picks, so it is not resolved on
    the table's guess); and again with the base's own sizes and the ``mode``
    resolved once from them, where memory may refuse too.
    """
    early = memory is None
    explicit_mode = explicit(config.base_precision) if config.base_precision != "auto" else None
    error = training_precision_preflight_error(
        registry, family, hardware, config.base_precision,
        base_repo=config.base_model, device=config.device, mixed_precision=config.mixed_precision,
        memory=memory or MemoryRequest.from_table(family, training_shape(config)),
        resolved=mode or explicit_mode, rules_only=early and explicit_mode is None,
    )
    if error is not None and not (early and isinstance(error, InsufficientMemory)):
        raise error


def _weight_dtype(family: FamilySpec, hardware: HardwareProfile, device: str, config: TrainingConfig) -> Resolved[str]:
    if device == "cpu":
        return auto("fp32", "CPU: fp32 weights and compute (bf16 matmuls are emulated on most CPUs)")
    if family.training.requires_bf16 or (hardware.native_bf16 and config.mixed_precision != "fp16"):
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
