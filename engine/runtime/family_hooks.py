"""The runtime hooks, asked of the family plugins first, answered by the runtime where none does.

A family may add, save and load its LoRAs its own way, or read its pipeline's output its own
way (``engine_lora_add``, ``engine_lora_state_dict``, ``engine_lora_load``,
``engine_pipeline_output``). The registry (the contract) relays the question
(:meth:`~engine.contract.registry.Registry.answer`); where no plugin answers, the engine's
default is the runtime's: peft's generic injection and diffusers' output fields. The
defaults live here, beside the code they run, so the contract imports no runtime.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.contract.registry import Registry
from engine.contract.types import FamilySpec


def lora_add(registry: Registry, family: FamilySpec, denoiser: Any, config: Any, adapter_name: str = "default") -> str:
    """Add a trainable LoRA to ``denoiser``; how it was added."""
    answer = registry.answer("engine_lora_add", family=family, denoiser=denoiser, config=config,
                             adapter_name=adapter_name)
    if answer is None:
        from engine.runtime.adapters import add_adapter

        answer = add_adapter(denoiser, config, adapter_name)
    return str(answer)


def lora_state_dict(registry: Registry, family: FamilySpec, denoiser: Any,
                    adapter_name: str = "default") -> dict[str, Any]:
    """The adapter's weights in peft's keys, for saving."""
    answer = registry.answer("engine_lora_state_dict", family=family, denoiser=denoiser, adapter_name=adapter_name)
    if answer is None:
        from engine.runtime.adapters import adapter_state_dict

        answer = adapter_state_dict(denoiser, adapter_name)
    return dict(answer)


def lora_load(registry: Registry, family: FamilySpec, pipeline: Any, state_dict: Mapping[str, Any],
              adapter_name: str) -> str:
    """Load a LoRA into a pipeline without diffusers' LoRA loader; how it was loaded."""
    answer = registry.answer("engine_lora_load", family=family, pipeline=pipeline, state_dict=dict(state_dict),
                             adapter_name=adapter_name)
    if answer is None:
        from engine.runtime.adapters import load_adapter

        answer = load_adapter(getattr(pipeline, family.pipeline.denoiser), state_dict, adapter_name)
    return str(answer)


def pipeline_output(registry: Registry, family: FamilySpec, pipeline: Any, result: Any) -> list[Any]:
    """One pipeline call's outputs, one per prompt (images, or each clip's frames)."""
    answer = registry.answer("engine_pipeline_output", family=family, pipeline=pipeline, result=result)
    if answer is None:  # the default reads the family's output kind, or refuses (unreadable_output)
        from engine.runtime.outputs import pipeline_output as read

        answer = read(family.rendering.output, result)
    return list(answer)


def pipeline_sound(registry: Registry, family: FamilySpec, video: Any, pipeline: Any, result: Any) -> list[Any]:
    """Each clip's sound (one per clip; [] for a silent family or a call that gave none)."""
    if video is None or not video.audio:
        return []
    answer = registry.answer("engine_pipeline_sound", family=family, pipeline=pipeline, result=result)
    if answer is None:  # the default reads result.audio at the declared (else the vocoder's) rate
        from engine.runtime.outputs import pipeline_sound as read

        answer = read(result, pipeline, video.audio_rate)
    return list(answer)


__all__ = ["lora_add", "lora_load", "lora_state_dict", "pipeline_output", "pipeline_sound"]
