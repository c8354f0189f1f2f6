"""The krea2 plugin: the contract kit for Raw and Turbo, an image through the CLI equal to plain
``Krea2Pipeline``, a folder known as Raw or Turbo by its pipeline's own flag, a Turbo LoRA run
trained on Raw that reloads from its ComfyUI export, and plans on the cards people use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.testing import FamilyContract
from families.krea2.tiny import TINY_RESOLUTION, build_tiny_pipeline, build_tiny_turbo_pipeline


class TestKrea2Kit(FamilyContract):
    family_name = "krea2"


class TestKrea2TurboKit(FamilyContract):
    family_name = "krea2"
    checkpoint_name = "krea-2-turbo"


@pytest.fixture(scope="module")
def raw(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("krea2")


@pytest.mark.parametrize(("card", "memory", "scheme"), [
    ("rtx4090", "resident", "int8"),  # 26.3 GB dense cannot stay on 24 GB; int8 (about 13 GB) can, beside fp8 encoders
    ("l40s", "resident", None),       # 48 GB: dense, beside the encoder in fp8
    ("h100", "resident", None),
    ("b200", "resident", None),
])
def test_krea2_plans_on_the_cards_people_use(engine_registry: Registry, card: str, memory: str,
                                             scheme: str | None) -> None:
    """26.3 GB of transformer, bf16 only (an fp16 card is refused); Turbo samples 8 steps
    without CFG, Raw 52 at 3.5."""
    from tests.support import table_plan

    plan = table_plan("krea2", card)
    assert (plan.value("dtype"), plan.value("memory_mode"), plan.value("transformer_quant")) == ("bf16", memory, scheme)
    family = engine_registry.family("krea-2")
    turbo, base = family.checkpoint("krea-2-turbo"), family.checkpoint("krea-2-raw")
    assert turbo is not None and base is not None
    assert (turbo.default_steps, turbo.default_guidance, turbo.trained_on) == (8, 0.0, "krea-2-raw")
    assert (base.default_steps, base.default_guidance) == (52, 3.5)


def test_a_folder_is_raw_or_turbo_by_its_pipelines_own_flag(engine_registry: Registry, tmp_path: Path) -> None:
    """A folder named like neither is the checkpoint its ``model_index.json`` says
    (``is_distilled``); one named Turbo that holds Raw is Raw."""
    from engine.preflight.model import resolve_model

    turbo = build_tiny_turbo_pipeline(tmp_path / "my-model")
    assert resolve_model(engine_registry, turbo).checkpoint.name == "krea-2-turbo"  # type: ignore[union-attr]
    mislabelled = build_tiny_pipeline(tmp_path / "krea-2-turbo-copy")
    assert resolve_model(engine_registry, mislabelled).checkpoint.name == "krea-2-raw"  # type: ignore[union-attr]


@pytest.mark.slow
def test_the_cli_image_equals_plain_krea2pipeline(raw: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import torch
    from diffusers import Krea2Pipeline
    from PIL import Image

    from engine.cli import main

    out = tmp_path / "fox.png"
    status = main(["generate", "--model", str(raw), "--prompt", "a red fox", "--width", "64", "--height", "64",
                   "--steps", "2", "--seed", "5", "--guidance", "3.5", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    from engine.testing.stock import planned_dtypes

    plain = Krea2Pipeline.from_pretrained(str(raw), dtype=planned_dtypes(raw))("a red fox", height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                                                    num_inference_steps=2, guidance_scale=3.5,
                                                    generator=torch.Generator("cpu").manual_seed(5)).images[0]
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(plain))


@pytest.mark.slow
def test_a_turbo_folder_trains_as_given_naming_raw_and_its_lora_moves_the_turbo_image(
    engine_registry: Registry, tmp_path: Path,
) -> None:
    """A local Turbo folder trains as given, the plan naming Raw as the base its LoRAs train on
    (named by hub id or name, the run would take Raw); its LoRA moves the Turbo image."""
    from engine.hardware.probe import probe
    from engine.requests import GenerateBody
    from engine.requests.training import TrainingConfig
    from engine.service.facade import Engine
    from engine.testing.datasets import write_dataset
    from engine.training.preflight import preflight_training
    from engine.training.trainer import run_training

    build_tiny_pipeline(tmp_path / "models" / "krea-2-raw")
    turbo = build_tiny_turbo_pipeline(tmp_path / "models" / "krea-2-turbo")
    data = write_dataset(tmp_path / "data", count=2, size=64)
    config = TrainingConfig.from_data({"base_model": str(turbo), "dataset_dir": str(data), "resolution": 64,
                                       "steps": 4, "lora_rank": 4, "learning_rate": 5e-2, "device": "cpu", "seed": 1,
                                       "export_kohya": True})
    plan = preflight_training(engine_registry, config, probe(verify=False))
    assert plan.trained_base is not None and "krea/Krea-2-Raw" in plan.trained_base.reason
    end = run_training(plan, tmp_path / "run", lambda _event: None, lambda: None, registry=engine_registry)
    assert end["type"] == "completed", end
    lora = Path(str(end["outputs"]["lora"]))  # type: ignore[index]
    asked = {"prompt": "a red fox", "model": str(turbo), "width": 64, "height": 64, "steps": 2, "seed": 5}
    with Engine(registry=engine_registry, hardware=probe(verify=False)) as engine:
        base = engine.images.generate(GenerateBody(**asked))[0]  # type: ignore[arg-type]
        moved = engine.images.generate(GenerateBody(**asked), loras=[f"{lora}:1.0"])[0]  # type: ignore[arg-type]
        zero = engine.images.generate(GenerateBody(**asked), loras=[f"{lora}:0.0"])[0]  # type: ignore[arg-type]
        comfy = engine.images.generate(GenerateBody(**asked),  # type: ignore[arg-type]
                                       loras=[f"{lora.parent / 'lora_kohya.safetensors'}:1.0"])[0]
    # At scale 0 the image is the base's within one level: plain Krea2Pipeline with any LoRA
    # adapter loaded (at weight 0, or disabled) is one level off its own base as well. The kohya
    # export ComfyUI reads gives the trained LoRA's image.
    pixels = [np.asarray(image).astype(int) for image in (base, moved, zero, comfy)]
    assert np.abs(pixels[1] - pixels[0]).max() > 8 and np.abs(pixels[2] - pixels[0]).max() <= 1
    assert np.abs(pixels[3] - pixels[1]).max() <= 1
