"""The off tier's promise, checked by pixels: an engine image equals plain diffusers'.

The plan's ``speed_tier`` reason says a dense model with no speed request is
"bit-identical to stock diffusers". That is a claim about images, so it is
checked as one: every family's tiny pipeline generates through the facade (the
whole path: the plan, the loader, the prompt cache, the call the engine builds)
and through ``DiffusionPipeline.from_pretrained`` called as the family's
diffusers docs write it (the same prompt, steps, seed on a CPU generator, size and
guidance, and both dtypes: the default's, and the other one asked for (bf16 is what a GPU user of
the model runs, and the default where this CPU multiplies it natively; asking for the default's own
dtype by name would repeat a case), with the components the family keeps in fp32 in fp32 as its
docs load them). On the
CPU the two must not differ by a single level in any pixel.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.contract.plugins import load_registry
from engine.preflight.pipeline_index import MODULAR_INDEX
from engine.hardware.probe import probe
from engine.service.facade import Engine
from engine.testing.stock import stock_dtypes

REGISTRY = load_registry()
FAMILIES = sorted(REGISTRY.families)
#: Each family's default tiny pipeline, and each checkpoint with a pipeline class of its own that
#: makes images from text itself (an edit checkpoint's text-to-image is its base pipeline's, and
#: its edits are compared with plain diffusers' in their own tests).
CASES = [pytest.param(family, None, id=family) for family in FAMILIES] + [
    pytest.param(family, checkpoint.name, id=f"{family}-{checkpoint.name}")
    for family in FAMILIES for checkpoint in REGISTRY.family(family).checkpoints
    if checkpoint.tiny_pipeline and REGISTRY.family(family).workflows_of(checkpoint).get("txt2img") is None]
PROMPT, STEPS, SEED = "a lighthouse at dusk", 2, 11
#: The plan's default (bf16 where this CPU multiplies it natively, fp32 elsewhere) and the other
#: dtype asked for by name: each dtype compared once, the default through the plan's own choice.
NATIVE_BF16 = probe(verify=False).cpu_bf16_matmul
DTYPES = ["auto", "fp32" if NATIVE_BF16 else "bf16"]


def clip_frames(family: str) -> int:
    """The family's shortest clip of more than one latent frame (5 on 4k+1, 9 on 8k+1)."""
    from engine.testing.run import kit_frames

    return kit_frames(REGISTRY.family(family).video_of(None))


def stock(folder: Path, family: str, guidance: float, size: dict[str, int], dtype: Any) -> list[np.ndarray]:
    """Plain diffusers: the folder's own pipeline class in ``dtype`` (one, or per component), one
    seeded CPU generator."""
    import diffusers

    from engine.runtime.processors import pipeline_processors

    spec = REGISTRY.family(family)
    call: dict[str, Any] = {"prompt": PROMPT, "num_inference_steps": STEPS,
                            "generator": torch.Generator("cpu").manual_seed(SEED), **size}
    if (folder / MODULAR_INDEX).is_file():  # a modular pipeline: its blocks, called as diffusers documents
        return stock_modular(folder, spec, call, guidance, dtype)
    # A vision-language processor built without torchvision, as the engine builds it (stock
    # transformers builds its video part only with torchvision; the image calls are its own).
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder, dtype=dtype, **pipeline_processors(str(folder)))
    if spec.pipeline.guidance_kwarg == "guider.guidance_scale":  # a diffusers guider holds it
        pipe.guider = pipe.guider.new(guidance_scale=guidance)
    else:
        call[spec.pipeline.guidance_kwarg] = guidance
    if spec.pipeline.guidance_kwarg == "true_cfg_scale":  # true CFG runs with a negative prompt: its model card's " "
        call["negative_prompt"] = " "
    # The call arguments the family's plugin says its model is sampled with (Lumina 2's guidance
    # truncation), as documented: the same for plain diffusers as for the engine.
    call = REGISTRY.generate_kwargs(spec, pipe, call)
    if spec.rendering.output == "frames":
        result = pipe(**call, num_frames=clip_frames(family), output_type="pil")
        return [np.asarray(frame) for frame in result.frames[0]]
    return [np.asarray(pipe(**call).images[0])]


def stock_modular(folder: Path, spec: Any, call: dict[str, Any], guidance: float, dtype: Any) -> list[np.ndarray]:
    """A modular pipeline as its docs load it (``ModularPipeline.from_pretrained``, then
    ``load_components``), its processor built without torchvision as the engine builds it
    (transformers builds the video part only with torchvision), a step whose component the
    folder does not ship popped as its docs say (FLUX.3's prompt upsampler), the guidance on its
    guider where it has one (a guidance-distilled pipeline takes none)."""
    import diffusers

    from engine.runtime.processors import pipeline_processors

    pipe = diffusers.ModularPipeline.from_pretrained(str(folder))
    blocks = pipe.blocks
    popped = [blocks.sub_blocks.pop(step) for step, component in spec.pipeline.optional_steps
              if not (folder / component).is_dir()]
    if popped:  # the pipeline built again from its blocks without them
        pipe = blocks.init_pipeline(str(folder))
    processors = pipeline_processors(str(folder))
    pipe.load_components(names=[name for name in pipe.pretrained_component_names
                                if (folder / name).is_dir() and name not in processors], torch_dtype=dtype)
    pipe.update_components(**processors)
    if spec.pipeline.guidance_kwarg == "guider.guidance_scale" and getattr(pipe, "guider", None) is not None:
        pipe.update_components(guider=pipe.guider.new(guidance_scale=guidance))
    if spec.rendering.output == "frames":
        videos = pipe(**call, num_frames=clip_frames(spec.name), output_type="pil", output="videos")
        return [np.asarray(frame) for frame in videos[0]]
    return [np.asarray(pipe(**call, output="images")[0])]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("family", "checkpoint"), CASES)
def test_an_off_tier_image_equals_plain_diffusers_pixel_for_pixel(
    family: str, checkpoint: str | None, dtype: str, tiny_pipeline: Callable[..., Path], tmp_path: Path
) -> None:
    """In bf16 the mixed plans (a video VAE kept fp32 beside a bf16 denoiser) are held to it too:
    the engine once cast the timestep to bf16 on its way into the denoiser, where stock keeps it."""
    from engine.requests.inference import InferenceRequest

    folder = tiny_pipeline(family, checkpoint)
    spec = REGISTRY.family(family)
    size = {"width": 64, "height": 64}
    chosen = spec.checkpoint(checkpoint) if checkpoint else spec.default_checkpoint
    guidance = (chosen.default_guidance if chosen else 0.0) + 1.0  # not the default: the value is passed
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False), runs_dir=tmp_path)
    engine.images.load(str(folder), request=InferenceRequest(dtype=dtype))
    try:
        plan = engine.status()["pipeline"]["plan"]["resolved"]  # type: ignore[index]
        assert plan["speed_tier"]["value"] == "off", plan["speed_tier"]
        assert plan["transformer_quant"]["value"] in (None, "none")
        # The default computes in the model's own dtype where this CPU multiplies it natively.
        assert engine.hardware().cpu_bf16_matmul == NATIVE_BF16
        wanted = dtype if dtype != "auto" else "bf16" if NATIVE_BF16 else "fp32"
        assert plan["dtype"]["value"] == wanted, plan["dtype"]
        dtypes = stock_dtypes(folder, spec, engine.images.loaded_plan())
        if spec.rendering.output == "frames":
            clip = engine.videos.generate(PROMPT, frames=clip_frames(family), steps=STEPS, seed=SEED, guidance=guidance,
                                          **size)
            ours = [np.asarray(frame) for frame in clip.frames]
        else:
            ours = [np.asarray(image) for image in engine.images.generate(
                PROMPT, steps=STEPS, seed=SEED, guidance=guidance, **size)]
    finally:
        engine.images.unload()
    theirs = stock(folder, family, guidance, size, dtypes)
    assert len(ours) == len(theirs)
    for frame, (mine, reference) in enumerate(zip(ours, theirs)):
        assert mine.shape == reference.shape
        differing = int((mine != reference).any(axis=-1).sum())
        assert differing == 0, f"{family} frame {frame}: {differing} pixels differ from plain diffusers"
