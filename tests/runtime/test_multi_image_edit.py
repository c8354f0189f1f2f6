"""Qwen-Image-Edit-2509/2511: several input images in one edit, through every door (Python's
list, the CLI's repeated ``--image``, a JSON list over HTTP, OpenAI's repeated ``image[]``); the
tiny Edit-Plus pipeline's two-image edit equals plain diffusers' pixel for pixel; more images than
a checkpoint takes are refused before anything is evicted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from engine.contract.plugins import load_registry
from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.requests import GenerateBody
from engine.server.app import ServerSettings, create_app
from engine.service.facade import Engine
from tests.support import HostModel, LiveServer

REGISTRY = load_registry()
PROMPT = "put the cup on the table"
SMALL = {"steps": 2, "width": 64, "height": 64, "seed": 1, "guidance": 4.0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from families.qwen_image.tiny import build_tiny_edit_pipeline

    root = tmp_path_factory.mktemp("edits")
    inputs = root / "inputs"
    inputs.mkdir()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(inputs / "a.png")
    Image.effect_noise((64, 64), 80).convert("RGB").save(inputs / "b.png")
    made = {
        "plus": build_tiny_edit_pipeline(root / "models" / "qwen-image-edit-2511-tiny", plus=True),
        "single": build_tiny_edit_pipeline(root / "models" / "qwen-image-edit-tiny"),
    }
    for folder in made.values():  # the folder's own defaults: a short run (OpenAI's edits send no steps)
        (folder / "diffusion_engine.json").write_text('{"steps": 2, "width": 64, "height": 64}')
    return {**made, "inputs": inputs}


@pytest.mark.slow
def test_a_two_image_edit_equals_plain_diffusers_pixel_for_pixel(folders: dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    # The pipeline encodes each input image at one megapixel whatever the output's size (8,192
    # tokens of attention for two, 45 s on two cores); both sides read the same module constant at
    # call time, so a smaller one keeps the comparison whole at a fraction of the work.
    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 256 * 256)

    from engine.runtime.processors import pipeline_processors

    a, b = folders["inputs"] / "a.png", folders["inputs"] / "b.png"
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(folders["plus"]))
    try:
        assert engine.images.loaded_plan().checkpoint == "qwen-image-edit-2511"  # type: ignore[union-attr]
        [ours] = engine.images.generate(GenerateBody(prompt=PROMPT, image=[str(a), str(b)], **SMALL))
    finally:
        engine.images.unload()
    # Plain diffusers with the folder's processor built as the folder says (torchvision is not here).
    from engine.testing.stock import planned_dtypes

    pipe = diffusers.DiffusionPipeline.from_pretrained(folders["plus"], dtype=planned_dtypes(folders["plus"]),
                                                       **pipeline_processors(str(folders["plus"])))
    assert type(pipe).__name__ == "QwenImageEditPlusPipeline"
    theirs = pipe(image=[Image.open(a).convert("RGB"), Image.open(b).convert("RGB")], prompt=PROMPT,
                  negative_prompt=" ", true_cfg_scale=4.0, num_inference_steps=2, width=64, height=64,
                  generator=torch.Generator("cpu").manual_seed(1)).images[0]
    assert int((np.asarray(ours) != np.asarray(theirs)).any(axis=-1).sum()) == 0


def test_more_images_than_a_checkpoint_takes_are_refused_before_eviction(folders: dict[str, Path]) -> None:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    host = HostModel(engine)
    images = [str(folders["inputs"] / "a.png"), str(folders["inputs"] / "b.png")]
    with pytest.raises(EngineError) as one_only:
        engine.images.check_generate(GenerateBody(prompt=PROMPT, model=str(folders["single"]), image=images))
    assert one_only.value.code == "too_many_images"
    assert "qwen-image-edit-2509 (up to 3), qwen-image-edit-2511 (up to 3)" in one_only.value.message
    with pytest.raises(EngineError, match="at most 3") as four:
        engine.images.check_generate(GenerateBody(prompt=PROMPT, model=str(folders["plus"]), image=images * 2))
    assert four.value.code == "too_many_images"
    assert host.evicted == 0 and engine.images.session is None


@pytest.fixture(scope="module")
def served(folders: dict[str, Path]) -> Iterator[str]:
    engine = Engine(registry=REGISTRY, hardware=probe(verify=False))
    engine.images.load(str(folders["plus"]))
    settings = ServerSettings(model_roots=(folders["plus"].parent,), input_roots=(folders["inputs"],))
    with LiveServer(create_app(engine, settings)) as url:
        yield url
    engine.images.unload()


def test_several_images_over_http_are_read_as_a_list_and_counted_before_anything_runs(
        served: str, folders: dict[str, Path]) -> None:
    """A JSON list of paths (confined to the input roots) and OpenAI's repeated ``image[]``
    uploads both reach the checkpoint's own limit: four are refused (it takes three) before a
    job is queued. The two-image edit itself runs in the pixel-equality test above."""
    jobs = len(httpx.get(f"{served}/v1/images/jobs").json()["jobs"])
    listed = httpx.post(f"{served}/v1/images/jobs", json={"prompt": PROMPT, "image": ["a.png", "b.png"] * 2, **SMALL})
    assert listed.status_code == 400 and listed.json()["error"]["code"] == "too_many_images", listed.text
    outside = httpx.post(f"{served}/v1/images/jobs", json={"prompt": PROMPT, "image": ["a.png", "/etc/hostname"]})
    assert outside.status_code == 400 and outside.json()["error"]["code"] == "path_outside_roots"
    uploads = [("image[]", (name, (folders["inputs"] / name).read_bytes(), "image/png")) for name in ("a.png", "b.png")]
    many = httpx.post(f"{served}/v1/images/edits", data={"prompt": PROMPT}, files=uploads * 2, timeout=60)
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_images"
    assert "at most 3" in many.json()["error"]["message"]  # the checkpoint's own limit, before anything runs
    bomb = [("image[]", ("a.png", b"not a png", "image/png"))] + uploads[:1]
    broken = httpx.post(f"{served}/v1/images/edits", data={"prompt": PROMPT}, files=bomb, timeout=60)
    assert broken.status_code == 400 and "image[0]" in broken.json()["error"]["message"]
    assert len(httpx.get(f"{served}/v1/images/jobs").json()["jobs"]) == jobs


def test_the_cli_takes_image_twice_and_refuses_two_for_a_one_image_edit(
        folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    refused = main(["generate", "--model", str(folders["single"]), "--prompt", PROMPT, "--image",
                    str(folders["inputs"] / "a.png"), "--image", str(folders["inputs"] / "b.png"), "-o",
                    str(tmp_path / "no.png")])
    err = capsys.readouterr().err
    assert refused == 2 and "error[too_many_images]" in err and "2 input images" in err, err
    assert not (tmp_path / "no.png").exists()
