"""The qwen_image21 plugin: the contract kit, a CLI image equal to plain ``QwenImage21Pipeline``
and saved with its alpha, a multi-reference edit equal to the pipeline's (an RGBA reference
keeping its alpha), eleven references refused before anything loads, a LoRA that trains, moves
the image and reloads from its ComfyUI export, and plans on the cards people use."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.contract.plugins import Registry
from engine.testing import FamilyContract
from families.qwen_image21.table import REFERENCE_IMAGES


class TestQwenImage21Kit(FamilyContract):
    family_name = "qwen_image21"


@pytest.fixture(scope="module")
def folder(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("qwen_image21")


def _plain(folder: Path) -> object:
    from diffusers import QwenImage21Pipeline

    from engine.runtime.processors import pipeline_processors
    from engine.testing.stock import planned_dtypes

    return QwenImage21Pipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder),
                                               **pipeline_processors(str(folder)))


def _generator(seed: int) -> object:
    import torch

    return torch.Generator("cpu").manual_seed(seed)


@pytest.mark.parametrize(("card", "scheme", "encoders"), [
    ("rtx-a4000", "int8", "streamed"),  # 16 GB: even the dense 14.2 GB transformer leaves no room
    ("rtx4090", None, "streamed"),      # the dense transformer resident, the 8B encoder run per prompt
    ("l40s", None, "resident"),
    ("h100", None, "resident"),
    ("b200", None, "resident"),
])
def test_qwen_image21_plans_on_the_cards_people_use(card: str, scheme: str | None, encoders: str) -> None:
    """bf16 everywhere and the denoiser always resident; the Qwen3-VL-8B encoder (17.5 GB) in
    fp8 (9.6 GB) is what gives way on a 24 GB card (loaded, run and freed per prompt); a 16 GB
    card quantises the transformer too."""
    from tests.support import table_plan

    plan = table_plan("qwen_image21", card)
    assert (plan.value("dtype"), plan.value("memory_mode")) == ("bf16", "resident")
    assert (plan.value("transformer_quant"), plan.value("text_encoder_memory")) == (scheme, encoders)
    assert plan.value("text_encoder_quant") == "fp8" and "17.5 GB -> 9.6 GB" in plan["text_encoder_quant"].reason


@pytest.mark.slow
def test_the_cli_image_equals_plain_qwenimage21pipeline_and_keeps_its_alpha(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    from engine.cli import main

    out = tmp_path / "fox.png"
    status = main(["generate", "--model", str(folder), "--prompt", "a red fox", "--width", "64", "--height", "64",
                   "--steps", "2", "--seed", "5", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    plain = _plain(folder)("a red fox", height=64, width=64, num_inference_steps=2,  # type: ignore[operator]
                           generator=_generator(5)).images[0]
    saved = Image.open(out)
    assert saved.mode == "RGBA" and plain.mode == "RGBA"
    assert np.array_equal(np.asarray(saved), np.asarray(plain))


@pytest.mark.slow
def test_a_multi_reference_edit_equals_the_pipelines_and_a_reference_keeps_its_alpha(folder: Path) -> None:
    """Two references, one RGBA with a transparent border and one RGB of another shape: the
    engine hands the pipeline the first fitted to the box with its alpha and the second as it
    is, and sizes both to the area asked for (``output_resolution``): the pipeline's own image.
    With the alpha dropped (the RGB version of the same reference) the image differs."""
    from engine.service.facade import Engine

    cutout = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    cutout.paste((0, 255, 0, 255), (16, 16, 48, 48))
    scene = Image.new("RGB", (96, 64), (0, 0, 255))
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 3}
    with Engine() as engine:
        engine.images.load(str(folder))
        edited = engine.images.generate("put the cutout in the scene", image=[cutout, scene], **asked)[0]
        flattened = engine.images.generate("put the cutout in the scene", image=[cutout.convert("RGB"), scene],
                                           **asked)[0]
    plain = _plain(folder)("put the cutout in the scene", image=[cutout, scene.convert("RGBA")], width=64,  # type: ignore[operator]
                           height=64, output_resolution=64, num_inference_steps=2, generator=_generator(3)).images[0]
    assert edited.mode == "RGBA" and np.array_equal(np.asarray(edited), np.asarray(plain))
    assert not np.array_equal(np.asarray(flattened), np.asarray(edited))


def test_eleven_references_are_refused_before_anything_loads(engine_registry: Registry, folder: Path) -> None:
    from engine.errors import EngineError
    from engine.service.facade import Engine

    pictures = [Image.new("RGB", (32, 32), (i * 20, 0, 0)) for i in range(REFERENCE_IMAGES + 1)]
    with Engine(registry=engine_registry) as engine:
        with pytest.raises(EngineError) as refused:
            engine.images.generate("all of them", model=str(folder), image=pictures, width=64, height=64, steps=1)
        assert engine.images.session is None
    assert "at most 10" in refused.value.message, refused.value.message


@pytest.mark.slow
def test_a_lora_trains_moves_the_image_and_reloads_from_its_comfyui_export(
    engine_registry: Registry, folder: Path, tmp_path: Path,
) -> None:
    """Four steps on two images: the LoRA moves the image, scale 0 is the base, and the kohya
    file ComfyUI reads (``lora_unet_`` + the transformer's own module names) gives the same image."""
    from engine.testing.lora_roundtrip import train_and_reload

    modules = train_and_reload(engine_registry, folder, tmp_path)
    assert modules and all(m.startswith("lora_unet_transformer_blocks_") and "_attn_to_" in m for m in modules)


@pytest.mark.parametrize(("reference", "family", "checkpoint"), [
    ("qwen-image-2.1", "qwen_image21", "qwen-image-2.1"),
    ("Qwen/Qwen-Image-2.1", "qwen_image21", "qwen-image-2.1"),
    ("Qwen/Qwen-Image", "qwen_image", "qwen-image"),  # whose ``*qwen-image*`` matches 2.1's names too
    ("Qwen/Qwen-Image-Edit-2511", "qwen_image", "qwen-image-edit-2511"),
])
def test_a_name_is_the_family_whose_pattern_is_the_most_specific(engine_registry: Registry, reference: str,
                                                                family: str, checkpoint: str) -> None:
    from engine.preflight.model import resolve_model

    source = resolve_model(engine_registry, reference)
    assert (source.family.name, source.checkpoint.name if source.checkpoint else None) == (family, checkpoint)


def test_a_folder_of_any_name_is_qwen_image21_by_its_pipeline_class(engine_registry: Registry, tmp_path: Path,
                                                                   folder: Path) -> None:
    import shutil

    from engine.preflight.model import resolve_model

    mine = tmp_path / "my-model"
    shutil.copytree(folder, mine, copy_function=os.link)  # read only: linked, not copied
    assert resolve_model(engine_registry, mine).family.name == "qwen_image21"


@pytest.mark.slow
def test_an_edit_over_openais_edits_api_comes_back_with_its_alpha(folder: Path, tmp_path: Path) -> None:
    """OpenAI's ``/v1/images/edits`` with an RGBA cutout and an RGB scene (``image[]`` twice):
    the PNG that comes back is RGBA with the alpha the model drew (not flattened to opaque)."""
    import base64
    import io

    import httpx

    from engine.hardware.probe import probe
    from engine.server.app import ServerSettings, create_app
    from engine.service.facade import Engine
    from tests.support import LiveServer

    cutout = Image.new("RGBA", (64, 64), (255, 0, 0, 0))
    cutout.paste((0, 255, 0, 255), (16, 16, 48, 48))
    uploads = []
    for name, picture in (("cutout.png", cutout), ("scene.png", Image.new("RGB", (96, 64), (0, 0, 255)))):
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        uploads.append(("image[]", (name, buffer.getvalue(), "image/png")))
    engine = Engine(hardware=probe(verify=False))
    engine.images.load(str(folder))
    try:
        with LiveServer(create_app(engine, ServerSettings(model_roots=(folder.parent,)))) as url:
            answer = httpx.post(f"{url}/v1/images/edits", files=uploads, timeout=120,
                                data={"prompt": "put the cutout in the scene", "size": "64x64",
                                      "response_format": "b64_json"})
    finally:
        engine.images.unload()
    assert answer.status_code == 200, answer.text
    served = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    assert served.mode == "RGBA" and served.size == (64, 64)
    assert np.asarray(served)[..., 3].min() < 255  # the model's own alpha, not an opaque flattening
