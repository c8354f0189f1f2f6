"""A workflow pipeline built over the loaded one (img2img, inpaint, image-to-video) shares its
modules and leaves them in the plan's dtypes: diffusers' ``from_pipe`` would cast them all to
fp32 (a bf16 denoiser upcast to twice its memory, then fed bf16 latents by the new pipeline)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image

from engine.contract.plugins import Registry
from engine.requests.inference import InferenceRequest


def _dtypes(module: torch.nn.Module) -> set[torch.dtype]:
    return {parameter.dtype for parameter in module.parameters()}


@pytest.mark.slow
def test_an_image_to_video_call_on_a_bf16_wan_keeps_every_module_in_its_dtype(
    engine_registry: Registry, tiny_pipeline: Callable[[str], Path],
) -> None:
    from engine.service.facade import Engine

    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(tiny_pipeline("wan")), request=InferenceRequest(dtype="bf16"))
        pipe = engine.images.session.pipeline  # type: ignore[union-attr]
        before = {name: _dtypes(module) for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
        assert torch.bfloat16 in before["transformer"] and before["vae"] == {torch.float32}  # the VAE kept fp32
        clip = engine.videos.generate("a square", image=Image.new("RGB", (64, 64), "red"), frames=5, width=64,
                                      height=64, steps=2, seed=0)
        after = {name: _dtypes(module) for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    assert len(clip.frames) == 5 and after == before


def test_a_built_workflow_pipeline_is_of_its_own_class(tiny_pipeline: Callable[[str], Path]) -> None:
    import diffusers

    from engine.runtime.workflows import workflow_pipeline

    loaded = diffusers.DiffusionPipeline.from_pretrained(str(tiny_pipeline("flux")), dtype=torch.bfloat16)
    built = workflow_pipeline(loaded, "FluxImg2ImgPipeline", {})
    assert type(built) is diffusers.FluxImg2ImgPipeline and built.transformer is loaded.transformer
    assert _dtypes(loaded.transformer) == {torch.bfloat16}
