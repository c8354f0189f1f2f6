"""The hunyuan_image plugin: the contract kit, an image through the CLI equal to plain
``HunyuanImagePipeline`` (its repo's guiders as they are by default, at the guidance asked
otherwise, and as they were again after), its checkpoints by name, and plans on the cards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.testing import FamilyContract


class TestHunyuanImageKit(FamilyContract):
    family_name = "hunyuan_image"


@pytest.fixture(scope="module")
def folder(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("hunyuan_image")


@pytest.mark.parametrize(("card", "memory", "scheme"), [
    ("rtx4090", "group_offload", None),  # 32.5 GB of transformer: even int8 overflows 24 GB
    ("l40s", "resident", "fp8"),         # 48 GB: the transformer in fp8 holds everything resident
    ("h100", "resident", None),
    ("b200", "resident", None),
])
def test_hunyuan_image_plans_on_the_cards_people_use(card: str, memory: str, scheme: str | None) -> None:
    from tests.support import table_plan

    plan = table_plan("hunyuan_image", card)
    assert (plan.value("dtype"), plan.value("memory_mode"), plan.value("transformer_quant")) == ("bf16", memory, scheme)


@pytest.mark.parametrize(("name", "checkpoint", "steps"), [
    ("hunyuanvideo-community/HunyuanImage-2.1-Diffusers", "hunyuanimage-2.1", 50),
    ("hunyuanvideo-community/HunyuanImage-2.1-Distilled-Diffusers", "hunyuanimage-2.1-distilled", 8),
    ("hunyuanimage-2.1", "hunyuanimage-2.1", 50),
])
def test_each_checkpoint_samples_its_own_steps(engine_registry: Registry, name: str, checkpoint: str,
                                               steps: int) -> None:
    from engine.preflight.model import resolve_model

    chosen = resolve_model(engine_registry, name).checkpoint
    assert chosen is not None and (chosen.name, chosen.default_steps, chosen.default_guidance) == (checkpoint, steps, 3.25)


@pytest.mark.slow
def test_the_image_equals_plain_hunyuanimagepipeline_with_its_guiders(engine_registry: Registry, folder: Path) -> None:
    """By default the repo's guiders guide (real CFG at their 3.5): the pipeline's own default
    call. ``guidance=5`` puts both guiders at 5; the next default call is the repo's again."""
    import torch
    from diffusers import HunyuanImagePipeline

    from engine.service.facade import Engine

    prompt = 'a fox holding a sign that says "HELLO"'  # quoted text: the glyph encoder and its guider
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 5}
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(folder))
        ours = [np.asarray(engine.images.generate(prompt, guidance=g, **asked)[0]) for g in (None, 5.0, None)]
    from engine.testing.stock import planned_dtypes

    pipe = HunyuanImagePipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder))

    def plain() -> np.ndarray:
        return np.asarray(pipe(prompt, height=64, width=64, num_inference_steps=2,
                               generator=torch.Generator("cpu").manual_seed(5)).images[0])

    default = plain()
    pipe.guider, pipe.ocr_guider = pipe.guider.new(guidance_scale=5.0), pipe.ocr_guider.new(guidance_scale=5.0)
    stronger = plain()
    assert np.array_equal(ours[0], default) and np.array_equal(ours[2], default)
    assert np.array_equal(ours[1], stronger) and not np.array_equal(stronger, default)
