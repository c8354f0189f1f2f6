"""Images in: img2img, inpaint and instruction edits on every family's tiny pipeline."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.model import resolve_model
from engine.runtime.inputs import fit_inputs, fitted_size
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.runtime.workflows import choose_workflow, effective_steps

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
W, H = 64, 48


def gradient(width: int = W, height: int = H) -> Image.Image:
    """A smooth RGB input (a random-noise input would say nothing about pasting back)."""
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], -1).astype(np.uint8))


def left_half_mask(width: int = W, height: int = H) -> Image.Image:
    mask = Image.new("L", (width, height), 0)
    mask.paste(255, (0, 0, width // 2, height))
    return mask


def loaded(folder: Path, request: InferenceRequest = InferenceRequest()) -> InferenceSession:
    source = resolve_model(REGISTRY, folder)
    session = InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request), request)
    session.load()
    return session


def draw(session: InferenceSession, **options: object) -> np.ndarray:
    options = {"steps": 2, **options}
    [image] = session.generate(GenerateRequest("a lighthouse at dusk", seed=3, width=W, height=H, **options))  # type: ignore[arg-type]
    return np.asarray(image).astype(int)


# -- fitting, pure ---------------------------------------------------------------


def test_inputs_are_fitted_within_the_box_at_the_multiple_and_cast_to_the_vae_dtype() -> None:
    assert fitted_size((200, 100), (64, 64), 16, "image") == (64, 32)  # aspect kept, inside the box
    assert fitted_size((100, 75), (None, None), 16, "image") == (96, 64)  # own size, rounded down
    assert fitted_size((30, 60), (None, 96), 8, "image") == (48, 96)  # one side given
    with pytest.raises(EngineError, match="raise width / height") as raised:
        fitted_size((400, 20), (64, 64), 16, "image")  # 64 x 3: under one multiple
    assert raised.value.code == "invalid_image"
    fitted = fit_inputs(gradient(100, 75), left_half_mask(100, 75), width=None, height=None,
                        multiple=16, dtype=torch.bfloat16)
    assert fitted.image is not None and fitted.image.dtype == torch.bfloat16
    assert tuple(fitted.image.shape) == (1, 3, 64, 96) and float(fitted.image.max()) <= 1.0
    assert fitted.mask is not None and fitted.mask.size == (96, 64)


def test_the_table_decides_the_workflow_and_refusals_name_the_input() -> None:
    flux = REGISTRY.family("flux")
    assert choose_workflow(flux, None, image=False, mask=False) == ("txt2img", None)
    assert choose_workflow(flux, None, image=True, mask=False) == ("img2img", "FluxImg2ImgPipeline")
    assert choose_workflow(flux, None, image=True, mask=True) == ("inpaint", "FluxInpaintPipeline")
    assert choose_workflow(flux, flux.checkpoint("flux.1-kontext-dev"), image=True, mask=False) == (
        "edit", "FluxKontextPipeline")
    with pytest.raises(EngineError, match="needs both"):
        choose_workflow(flux, None, image=False, mask=True)
    text_only = dataclasses.replace(REGISTRY.family("zimage").default_checkpoint, workflows=())
    with pytest.raises(EngineError, match=r"no img2img pipeline.*image \(--image\)") as raised:
        choose_workflow(REGISTRY.family("zimage"), text_only, image=True, mask=False)
    assert raised.value.code == "unsupported_workflow"
    assert effective_steps(10, 0.6) == 6 and effective_steps(40, 0.05) == 2 and effective_steps(4, None) == 4


# -- every family, real tiny pipelines --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sdxl", "flux", "zimage", "qwen_image"])
def test_img2img_and_inpaint_on_each_family(family: str, tiny_pipeline: Callable[[str], Path]) -> None:
    session = loaded(tiny_pipeline(family))
    seen: list[tuple[int, int]] = []
    try:
        text = draw(session)
        # 40 steps at strength 0.05: two steps run, and the step cache is
        # decided on those two (40 would engage it where the family allows).
        [image] = session.generate(
            GenerateRequest("a lighthouse at dusk", seed=3, steps=40, strength=0.05, width=W, height=H,
                            image=gradient()), lambda done, total: seen.append((done, total)),
        )
        cache = session.status()["plan"]["resolved"]["step_cache"]  # type: ignore[index]
        img2img = np.asarray(image).astype(int)
        other_input = draw(session, image=gradient().transpose(Image.Transpose.FLIP_LEFT_RIGHT), strength=0.05, steps=40)
        inpaint = draw(session, image=gradient(), mask_image=left_half_mask(), strength=0.9)
        status = session.status()
    finally:
        session.unload()
    assert img2img.shape == inpaint.shape == text.shape == (H, W, 3)
    assert not np.array_equal(img2img, text) and not np.array_equal(img2img, other_input)
    assert seen == [(1, 2), (2, 2)] and cache["value"] == "off" and "40 steps" not in cache["reason"]
    source = np.asarray(gradient()).astype(int)
    # Outside the mask the input is pasted back over the pipeline's output (a
    # tiny random VAE's round trip moves those pixels by ~65 levels, so the
    # raw output says nothing); inside, the model's drawing stays.
    assert np.abs(inpaint[:, W // 2:] - source[:, W // 2:]).max() <= 1
    assert np.abs(inpaint[:, : W // 2] - source[:, : W // 2]).mean() > 5
    assert {"img2img", "inpaint", "txt2img"} <= set(status["workflows"])  # type: ignore[arg-type]


@pytest.mark.slow
def test_an_edit_checkpoint_edits_with_its_own_pipeline(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tmp_path / "tiny-flux.1-kontext-dev"
    shutil.copytree(tiny_pipeline("flux"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
    session = loaded(folder)
    try:
        assert type(session.pipeline).__name__ == "FluxKontextPipeline"
        text = draw(session)
        edited = draw(session, image=gradient())
        assert session.status()["workflows"] == ["edit", "inpaint", "txt2img"]
    finally:
        session.unload()
    assert edited.shape == (H, W, 3) and not np.array_equal(edited, text)


@pytest.mark.slow
def test_http_inputs_come_from_the_inputs_root_and_openai_edits_take_uploads(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    import base64
    import io

    import httpx
    import openai

    from engine.server.app import create_app
    from engine.server.settings import ServerSettings
    from engine.service.facade import Engine
    from tests.support import LiveServer

    inputs, outside = tmp_path / "inputs", tmp_path / "outside"
    inputs.mkdir()
    outside.mkdir()
    gradient(64, 64).save(inputs / "in.png")
    left_half_mask(64, 64).save(inputs / "mask.png")  # only referenced: refused without image
    gradient().save(outside / "in.png")
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    engine.images.load(str(tiny_pipeline("sdxl")), request=InferenceRequest(steps=2))  # OpenAI's edit has no steps
    body = {"prompt": "a barn", "steps": 2, "width": 64, "height": 64}  # the HTTP minimum side
    try:
        with LiveServer(create_app(engine, ServerSettings(input_roots=(inputs,)))) as url:
            ok = httpx.post(f"{url}/v1/images/generate", timeout=120, json={**body, "image": "in.png", "strength": 0.9})
            escaped = httpx.post(f"{url}/v1/images/generate", json={**body, "image": str(outside / "in.png")})
            lone_mask = httpx.post(f"{url}/v1/images/generate", json={**body, "mask_image": "mask.png"})
            cancel = httpx.delete(f"{url}/v1/images/generate")
            png, alpha_mask = io.BytesIO(), io.BytesIO()
            gradient(64, 64).save(png, format="PNG")
            mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
            mask.paste((0, 0, 0, 0), (0, 0, 32, 64))  # OpenAI: transparent = edit here
            mask.save(alpha_mask, format="PNG")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
            edited = client.images.edit(image=("in.png", png.getvalue(), "image/png"), prompt="a barn",
                                        mask=("mask.png", alpha_mask.getvalue(), "image/png"), n=1)
    finally:
        engine.images.unload()
    [out] = [Image.open(io.BytesIO(base64.b64decode(d.b64_json or ""))) for d in edited.data or []]
    assert out.size == (64, 64)  # no size sent: the input's
    assert np.abs(np.asarray(out).astype(int)[:, 32:] - np.asarray(gradient(64, 64)).astype(int)[:, 32:]).max() <= 1
    assert ok.status_code == 200 and len(ok.json()["images"]) == 1
    assert escaped.status_code == 400 and escaped.json()["error"]["code"] == "path_outside_roots"
    assert lone_mask.status_code == 422 and "mask_image needs image" in lone_mask.text
    assert cancel.status_code == 200 and cancel.json() == {"cancelled": False}


@pytest.mark.slow
def test_sdxl_controlnet_generates_from_a_canny_map(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    from engine.runtime.inputs import canny_map
    from engine.service.facade import Engine
    from families.sdxl.tiny import build_tiny_controlnet

    square = Image.new("RGB", (64, 64), (0, 0, 0))
    square.paste((255, 255, 255), (16, 16, 48, 48))
    edges = np.asarray(canny_map(square))[..., 0] > 0
    assert edges[16, 20:44].all() and not edges[32, 24:40].any() and not edges[2:10, 2:10].any()
    engine = Engine(registry=REGISTRY, hardware=HARDWARE)
    with pytest.raises(EngineError, match="takes ControlNetModel"):  # refused before anything loads
        engine.images.load(str(tiny_pipeline("sdxl")), controlnet=str(tiny_pipeline("sdxl") / "unet"))
    assert engine.status()["pipeline"] is None
    engine.images.load(str(tiny_pipeline("sdxl")), controlnet=str(build_tiny_controlnet(tmp_path / "controlnet")))
    try:
        options = {"steps": 2, "seed": 1, "width": 64, "height": 64}
        [plain] = engine.images.generate("a box", **options)
        [guided] = engine.images.generate("a box", control_image=square, control_scale=1.0, **options)
        corner = Image.new("RGB", (64, 64), (0, 0, 0))
        corner.paste((255, 255, 255), (0, 0, 24, 24))
        [moved] = engine.images.generate("a box", control_image=corner, control_scale=1.0, **options)
    finally:
        engine.images.unload()
    assert guided.size == (64, 64)
    assert not np.array_equal(np.asarray(guided), np.asarray(plain))
    assert not np.array_equal(np.asarray(guided), np.asarray(moved))  # the map steers the image
