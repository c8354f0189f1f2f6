"""What replays an output: the request as it ran (every default filled) and what engaged.

A gallery entry (:mod:`engine.service.gallery`) and a clip written beside its MP4
(:class:`~engine.service.videos.Video`) keep this record. "What engaged" is what the loaded
pipeline did, not only what was asked: the plan's decision for every control (dtype,
quantisation, memory mode, attention...), the LoRAs applied, and what the runtime reported
after the call (the step cache, a tiled VAE, a fallback).
"""

from __future__ import annotations

from typing import Any

from engine.requests.bodies import GenerateBody


def loaded_recipe(session: Any) -> dict[str, object]:
    """The model and what engaged on the loaded pipeline (``session``: the engine's session)."""
    plan = session.plan
    source = session.source
    checkpoint = source.checkpoint or source.family.default_checkpoint
    status = session.status()
    encoders = status.get("text_encoders") or {}
    return {
        "model": source.location, "family": source.family.name, "checkpoint": checkpoint.name,
        "engaged": {name: control.value for name, control in plan.controls.items()},
        "loaded_loras": (status.get("loras") or {}).get("applied", []),
        "ran": {"step_cache": status.get("step_cache_engaged"), "vae_tiled": encoders.get("vae_tiled_last_call"),
                "fallback": status.get("fallback")},
    }


def request_recipe(body: GenerateBody, session: Any) -> dict[str, object]:
    """The request's own fields as they ran: steps and guidance with the model's defaults filled."""
    plan = session.plan
    checkpoint = session.source.checkpoint or session.source.family.default_checkpoint
    return {
        "prompt": body.prompt, "negative_prompt": body.negative_prompt, "seed": body.seed,
        "steps": body.steps or plan.default_steps,
        "guidance": checkpoint.default_guidance if body.guidance is None else body.guidance,
        **({"guidance_2": checkpoint.expert_guidance if body.guidance_2 is None else body.guidance_2}
           if checkpoint.expert_guidance is not None else {}),
        "image": body.image, "loras": [lo.model_dump() for lo in body.loras or ()],
    }


def image_recipes(body: GenerateBody, session: Any, images: list[Any]) -> list[dict[str, object]]:
    """One recipe per image of ``body`` (each with its own prompt and seed, as it replays alone)."""
    common = {**request_recipe(body, session), **loaded_recipe(session)}
    inputs = {name: getattr(body, name) for name in ("mask_image", "strength", "control_image", "control_scale")
              if getattr(body, name) is not None}
    return [{"kind": "image", **common, **inputs, "prompt": item.prompt, "negative_prompt": item.negative_prompt,
             "seed": item.seed, "width": image.width, "height": image.height}
            for item, image in zip(body.images(), images)]
