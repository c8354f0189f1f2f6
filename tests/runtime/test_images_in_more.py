"""Images in, continued: FLUX.1 ControlNet, the ControlNet in the memory plan,
workflow pipelines under offload, and the Qwen-Image-Edit checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry

REGISTRY = load_registry()
HARDWARE = probe(verify=False)


def box(corner: tuple[int, int, int, int] = (16, 12, 48, 36)) -> Image.Image:
    """A white box on black: a control map with clear edges."""
    picture = Image.new("RGB", (64, 48), (0, 0, 0))
    picture.paste((255, 255, 255), corner)
    return picture


@pytest.mark.slow
def test_flux_controlnet_generates_from_a_canny_map(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    from engine.service.facade import Engine
    from families.flux.tiny import build_tiny_controlnet

    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    engine.images.load(str(tiny_pipeline("flux")), controlnet=str(build_tiny_controlnet(tmp_path / "flux-controlnet")))
    try:
        options = {"steps": 2, "seed": 1, "width": 64, "height": 64}  # the smallest side a request takes
        [plain] = engine.images.generate("a box", **options)
        # A square map for a square request (a 64x48 map would be fitted within the box: 64x48 out).
        [guided] = engine.images.generate("a box", control_image=box().resize((64, 64)), control_scale=1.0, **options)
        [moved] = engine.images.generate("a box", control_image=box(corner=(0, 0, 24, 24)).resize((64, 64)),
                                         control_scale=1.0, **options)
        status = engine.status()
    finally:
        engine.images.unload()
    assert guided.size == plain.size == (64, 64)
    assert not np.array_equal(np.asarray(guided), np.asarray(plain))
    assert not np.array_equal(np.asarray(guided), np.asarray(moved))  # the map steers the image
    assert "controlnet" in status["pipeline"]["workflows"]  # type: ignore[index]


# -- the ControlNet in the memory plan ---------------------------------------------


def test_a_controlnet_is_planned_like_any_component_and_refused_before_eviction(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full-size FLUX.1-dev folder (headers over sparse files) with a 6.6 GB
    ControlNet (FLUX ControlNet-Union's bf16 size) on an A100 40 GB: the
    pipeline alone fits resident, the ControlNet beside it does not."""
    from engine.hardware.presets import PRESETS
    from engine.policy.plan import InferenceRequest
    from engine.service.facade import Engine
    from engine.testing.checkpoints import write_sized_controlnet, write_sized_pipeline
    from tests.support import HostModel

    model = str(write_sized_pipeline(tiny_pipeline("flux"), REGISTRY.family("flux"), tmp_path / "FLUX.1-dev"))
    controlnet = str(write_sized_controlnet("FluxControlNetModel", 6.6, tmp_path / "flux-controlnet-union"))
    engine = Engine(registry=REGISTRY, hardware=PRESETS["a100-40g"])
    host = HostModel(engine)
    dense = InferenceRequest(quant="none")
    alone = engine.images.plan(model, request=dense).to_dict()
    beside = engine.images.plan(model, request=dense, controlnet=controlnet).to_dict()
    assert alone["resolved"]["memory_mode"]["value"] == "resident"  # type: ignore[index]
    assert beside["resolved"]["memory_mode"]["value"] != "resident"  # type: ignore[index]
    assert beside["estimate"]["components"]["controlnet_gb"] == 6.6  # type: ignore[index]
    assert "transformer + ControlNet" in beside["resolved"]["memory_mode"]["reason"]  # type: ignore[index]
    auto = engine.images.plan(model, controlnet=controlnet).to_dict()["resolved"]  # the planner may quantise instead
    assert auto["transformer_quant"]["value"] is not None or auto["memory_mode"]["value"] != "resident"  # type: ignore[index]
    # An explicit resident that the ControlNet pushes over falls to the next mode, saying why.
    asked = engine.images.plan(model, controlnet=controlnet, request=InferenceRequest(quant="none", memory="resident"))
    fell = asked["memory_mode"].to_dict()
    assert fell["status"] == "fell back" and fell["value"] != "resident"
    assert "ControlNet 6.6 included" in str(fell["reason"])
    assert host.evicted == 0 and engine.residency.owner is None
    # The terminal's plan sizes it the same way.
    from engine.cli import main

    assert main(["plan", "--model", model, "--hardware", "a100-40g", "--quant", "none", "--controlnet", controlnet]) == 0
    assert "(ControlNet 6.6 GB)" in capsys.readouterr().out


# -- workflow pipelines under offload -----------------------------------------------


@pytest.mark.slow
def test_workflow_pipelines_follow_the_loaded_pipelines_offload(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    """Model offload as a GPU plan installs it, with the host as the execution
    device (diffusers' hooks are real; on a CPU they move nothing, so where
    weights land on a GPU is not checked here): the img2img and ControlNet
    pipelines built over the offloaded one get hooks of their own (the
    ControlNet too) and draw exactly what the resident pipeline draws, and the
    loaded pipeline still does afterwards. (Sequential offload with the host
    as execution device fails inside accelerate on the base pipeline's own
    first call, so it is left to a GPU.)"""
    import dataclasses

    from engine.policy.inference import plan_inference
    from engine.policy.resolved import explicit
    from engine.preflight.model import resolve_model
    from engine.runtime.session import GenerateRequest, InferenceSession
    from families.sdxl.tiny import build_tiny_controlnet

    source = resolve_model(REGISTRY, tiny_pipeline("sdxl"))
    plan = plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE)
    controlnet = str(build_tiny_controlnet(tmp_path / "controlnet"))
    requests = [
        GenerateRequest("a box", steps=2, seed=4, width=64, height=48),
        GenerateRequest("a box", steps=2, seed=4, width=64, height=48, image=box(), strength=0.9),
        GenerateRequest("a box", steps=2, seed=4, width=64, height=48, control_image=box(), control_scale=1.0),
        GenerateRequest("a box", steps=2, seed=4, width=64, height=48),
    ]

    def run(mode: str) -> tuple[list[np.ndarray], dict[str, str]]:
        session = InferenceSession(REGISTRY, source, plan, controlnet=controlnet)
        session.load()
        try:
            if mode == "model_offload":  # what loading does for such a plan on a GPU
                session.pipeline.enable_model_cpu_offload(device="cpu")
            session.plan = dataclasses.replace(plan, controls={**plan.controls, "memory_mode": explicit(mode)})
            images = [np.asarray(session.generate(r)[0]) for r in requests]
            hooks = {name: type(getattr(pipe.unet, "_hf_hook", None)).__name__
                     for name, pipe in session._workflow_pipes.items()}
            hooks["controlnet"] = type(getattr(session._controlnet, "_hf_hook", None)).__name__
            hooks["all_hooks"] = str(all(getattr(p, "_all_hooks", None) for p in session._workflow_pipes.values()))
        finally:
            session.unload()
        return images, hooks

    resident, _ = run("resident")
    model, model_hooks = run("model_offload")
    assert model_hooks == {"StableDiffusionXLImg2ImgPipeline": "CpuOffload",
                           "StableDiffusionXLControlNetPipeline": "CpuOffload",
                           "controlnet": "CpuOffload",  # outside the offload sequence: offloaded on its own
                           "all_hooks": "True"}  # so each call ends with its last model offloaded
    for ours, reference in zip(model, resident, strict=True):
        # Within one level of 255: the offload hooks' casts may round one pixel the other way
        # (seen with accelerate 1.15); a workflow that ran without its model would differ everywhere.
        difference = np.abs(ours.astype(int) - reference.astype(int))
        assert difference.max() <= 1 and difference.mean() < 0.01
    assert not np.array_equal(resident[0], resident[1]) and not np.array_equal(resident[0], resident[2])


# -- Qwen-Image-Edit ----------------------------------------------------------------


def test_the_qwen_image_edit_checkpoint_declares_its_pipelines() -> None:
    from engine.runtime.workflows import choose_workflow

    family = REGISTRY.family("qwen_image")
    edit = family.checkpoint("qwen-image-edit")
    assert choose_workflow(family, edit, image=True, mask=False) == ("edit", "QwenImageEditPipeline")
    # Its own pipeline needs an input image: text-to-image is the base pipeline over its parts.
    assert choose_workflow(family, edit, image=False, mask=False) == ("txt2img", "QwenImagePipeline")
    assert choose_workflow(family, None, image=False, mask=False) == ("txt2img", None)


@pytest.mark.slow
def test_a_qwen_image_edit_checkpoint_edits_at_the_requested_size(tmp_path: Path) -> None:
    """A tiny Qwen-Image-Edit pipeline: the edit conditions on the input at
    diffusers' fixed 1024x1024 area (the tiny VAE encodes it in well under a
    second) and draws at the requested size; text-to-image with the same seed
    (the base pipeline over the same parts) draws something else. Its processor
    loads without torchvision (this environment has none: its wheel does not load
    against the CPU torch build), without the video part an edit never calls."""
    from engine.service.facade import Engine
    from families.qwen_image.tiny import build_tiny_edit_pipeline

    folder = build_tiny_edit_pipeline(tmp_path / "tiny-qwen-image-edit")
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    engine.images.load(str(folder))
    try:
        options = {"steps": 2, "seed": 5, "width": 64, "height": 64}
        [text] = engine.images.generate("make it red", **options)  # 2 steps (1 leaves the terminal-shifted schedule NaN): each edit step attends over 4k tokens
        [edited] = engine.images.generate("make it red", image=box(corner=(8, 8, 40, 40)).resize((64, 64)), **options)
        status = engine.status()["pipeline"]
    finally:
        engine.images.unload()
    assert status["model"]["checkpoint"] == "qwen-image-edit"  # type: ignore[index]
    assert edited.size == text.size == (64, 64)
    assert not np.array_equal(np.asarray(edited), np.asarray(text))


@pytest.mark.slow
def test_an_edit_checkpoint_whose_processor_cannot_be_built_is_refused_before_eviction(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    """A processor whose config is cut short (a download stopped mid-file) cannot be
    built: the load says which component and file before anything is evicted. The same
    folder with the whole config builds (without torchvision too: the video part is
    left out), so the refusal is the file's doing."""
    import json
    import shutil

    from engine.hardware.presets import PRESETS
    from engine.runtime.processors import build_processor
    from engine.service.facade import Engine
    from tests.support import HostModel

    folder = tmp_path / "Qwen-Image-Edit"
    shutil.copytree(tiny_pipeline("qwen_image"), folder)
    shutil.copytree(folder / "tokenizer", folder / "processor")
    config = folder / "processor" / "preprocessor_config.json"
    config.write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12544}))
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(
        {**index, "_class_name": "QwenImageEditPipeline", "processor": ["transformers", "Qwen2VLProcessor"]}))
    assert build_processor(folder / "processor", "Qwen2VLProcessor").image_processor.size["longest_edge"] == 12544
    config.write_text(config.read_text()[:40])
    engine = Engine(registry=REGISTRY, hardware=PRESETS["h100"])
    host = HostModel(engine)
    with pytest.raises(EngineError) as refused:
        engine.images.load(str(folder))
    assert refused.value.code == "load_failed"
    assert "the processor (Qwen2VLProcessor)" in refused.value.message
    assert host.evicted == 0 and engine.residency.owner is None
