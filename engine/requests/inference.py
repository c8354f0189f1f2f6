"""The inference request as the policy reads it: one record, whichever door it came in by.

:class:`InferenceRequest` is what a face's request body (:class:`engine.requests.PlanControls`)
becomes, and what :func:`engine.policy.inference.plan_inference` decides from; ``auto``
leaves a control to the engine. :class:`LoraPlanInput` is the LoRAs of a load as the
planner sees them (counted and sized from their headers).
"""

from __future__ import annotations

from typing import Any
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraPlanInput:
    """The LoRAs a load applies, as the planner sees them (read from headers)."""

    count: int = 0
    #: The largest rank among them (the hot-swap slot size under compile).
    max_rank: int = 0
    #: Parameters in their LoRA matrices, all together.
    params: int = 0
    #: The caller will change LoRAs or scales on the loaded pipeline.
    switching: bool = False
    #: The steps and guidance a few-step LoRA among them samples at (an
    #: ``engine.policy.lora_sampling.LoraSampling``), with the reason; None: the checkpoint's.
    sampling: Any = None
    #: How many of their adapted modules match the model, and those that do not (skipped,
    #: where the caller asked for a partial load); None: not checked yet.
    modules: LoraModules | None = None


@dataclass(frozen=True)
class LoraModules:
    """The pre-eviction check's count of a load's LoRA modules: matched, and skipped by name."""

    matched: int
    unmatched: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"matched": self.matched, "unmatched": len(self.unmatched), "skipped": list(self.unmatched)}

    def summary(self) -> str:
        skipped = f"; {len(self.unmatched)} match nothing and are skipped (e.g. {', '.join(self.unmatched[:3])})"
        return f"{self.matched} adapted modules match the model" + (skipped if self.unmatched else "")


@dataclass(frozen=True)
class InferenceRequest:
    """What the user asked for; ``auto`` leaves a control to the engine."""

    #: ``diffusers``, ``sdcpp`` (stable-diffusion.cpp, the CPU engine) or ``auto``.
    engine: str = "auto"
    dtype: str = "auto"
    quant: str = "auto"
    memory: str = "auto"
    attention: str = "auto"
    step_cache: str = "auto"
    compile: str = "auto"
    speed: str = "auto"
    steps: int | None = None
    threads: int | None = None
    #: Processes one request runs on (GPUs; CPU processes on a CPU); None or 1: this one.
    gpus: int | None = None
    #: How they split it: ``auto``, ``ulysses``, ``ring`` or ``cfg`` (:mod:`engine.policy.parallel`).
    parallel: str = "auto"
    loras: LoraPlanInput = LoraPlanInput()
    text_encoder_quant: str = "auto"
    text_encoder_memory: str = "auto"
    vae_tiling: str = "auto"
    #: Reuse prompt embeddings from the on-disk cache across loads (see
    #: :mod:`engine.runtime.prompt_cache`); False encodes every call.
    prompt_cache: bool = True
    #: The image size and batch the activation guard sizes for (None: 1024 px).
    width: int | None = None
    height: int | None = None
    count: int = 1
    #: A video's frames the guard sizes for (None: the checkpoint's default clip; images: 1).
    frames: int | None = None
    #: The guidance asked (``guidance``, then a two-expert model's ``guidance_2``; None or absent: the
    #: checkpoint's), what CFG parallel needs above 1 on every step.
    guidance: tuple[float | None, ...] = ()


__all__ = ["InferenceRequest", "LoraPlanInput"]
