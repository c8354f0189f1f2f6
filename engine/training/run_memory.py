"""What a training run's memory estimate is given: the base's sizes (its file headers where it
has them, else its table's), the request's shape, and which denoisers the run holds.

A two-expert base's experts are loaded after the captions are cached, and a one-expert run
holds its expert alone (the other only for samples): its share of the base's denoiser weights.
"""

from __future__ import annotations

from dataclasses import replace

from engine.contract.plugins import Registry
from engine.contract.types import FamilySpec
from engine.policy.training_fit import MemoryRequest
from engine.policy.training_memory import BaseFacts, TrainingShape
from engine.preflight.source import ModelSource
from engine.requests.training import TrainingConfig
from engine.training.video_plan import ExpertChoice


def training_shape(config: TrainingConfig, frames: int | None = None) -> TrainingShape:
    return TrainingShape(
        frames=frames or config.frames or 1,
        resolution=config.resolution,
        batch_size=config.batch_size,
        lora_rank=config.lora_rank,
        gradient_checkpointing=config.gradient_checkpointing,
        lora_targets=config.lora_targets,
    )


def held_denoisers(family: FamilySpec, expert: ExpertChoice | None, *, samples: bool) -> tuple[str, ...]:
    """The denoisers a run holds: the one, or the experts trained (both when samples are rendered)."""
    if expert is None:
        return (family.pipeline.denoiser,)
    return (family.pipeline.denoiser, *family.pipeline.experts) if samples else expert.components


def memory_request(
    registry: Registry, family: FamilySpec, base: ModelSource, config: TrainingConfig, *, frames: int | None = None,
    expert: ExpertChoice | None = None,
) -> MemoryRequest:
    """The estimate's inputs: the base's own header sizes where it has them; ``frames``: the
    longest example's (a clip's window; 1 for images). A two-expert base's experts are loaded
    after the captions are cached, and a one-expert run holds its expert alone (the other only
    for samples): its share of the base's denoiser weights (the experts are alike in size)."""
    shape = training_shape(config, frames)
    measured = base.measured_sizes
    if measured is not None and measured.transformer_gb > 0:
        request = MemoryRequest(BaseFacts(
            measured.transformer_gb, measured.text_encoders_gb, measured.vae_gb,
            source="file headers", shapes=base.denoiser_shapes,
        ), shape)
    else:
        request = MemoryRequest.from_table(family, shape, registry.component_sizes(family, base.checkpoint))
    if expert is None:
        return request
    every = 1 + len(family.pipeline.experts)
    held = len(held_denoisers(family, expert, samples=bool(config.sample_prompts)))
    facts = request.base
    if held < every:
        facts = replace(facts, dense_gb=facts.dense_gb * held / every,
                        source=f"{facts.source}, the {expert.name}-noise expert alone")
    return replace(request, base=replace(facts, loaded_after_caching=True))


__all__ = ["held_denoisers", "memory_request", "training_shape"]
