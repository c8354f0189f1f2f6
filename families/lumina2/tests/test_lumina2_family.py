"""The lumina2 plugin: the contract kit, an image through the CLI equal to plain
``Lumina2Pipeline`` sampled as its model card samples (guidance over the first quarter of the
schedule), names that never take Lumina-Next for it, and plans on the cards people use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.testing import FamilyContract
from families.lumina2.table import CFG_TRUNC_RATIO
from families.lumina2.tiny import TINY_RESOLUTION


class TestLumina2Kit(FamilyContract):
    family_name = "lumina2"


@pytest.fixture(scope="module")
def lumina(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("lumina2")


@pytest.mark.parametrize("card", ["rtx4090", "l40s", "h100", "b200"])
def test_lumina2_plans_on_the_cards_people_use_and_is_never_bare_lumina(engine_registry: Registry, card: str) -> None:
    """10.6 GB of bf16 weights: dense, bf16 and resident on every card people run it on; the
    name "lumina" alone is not this family (Lumina-Next is another model)."""
    from engine.errors import EngineError
    from tests.support import table_plan

    plan = table_plan("lumina2", card)
    assert (plan.value("dtype"), plan.value("memory_mode"), plan.value("transformer_quant")) == ("bf16", "resident", None)
    assert engine_registry.family("lumina-image-2").name == "lumina2"
    with pytest.raises(EngineError):
        engine_registry.family("lumina")


@pytest.mark.slow
def test_the_cli_image_equals_plain_lumina2pipeline_with_the_model_cards_truncation(
    lumina: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The engine passes ``cfg_trunc_ratio=0.25`` (the pipeline's own default runs guidance on
    every step): its image equals plain diffusers given that, and differs from the default's."""
    import torch
    from diffusers import Lumina2Pipeline
    from PIL import Image

    from engine.cli import main

    out = tmp_path / "fox.png"
    status = main(["generate", "--model", str(lumina), "--prompt", "a red fox", "--width", "64", "--height", "64",
                   "--steps", "4", "--seed", "5", "-o", str(out)])
    assert status == 0, capsys.readouterr().err[-2000:]
    from engine.testing.stock import planned_dtypes

    pipe = Lumina2Pipeline.from_pretrained(str(lumina), dtype=planned_dtypes(lumina))

    def plain(**extra: float) -> np.ndarray:
        return np.asarray(pipe("a red fox", height=TINY_RESOLUTION, width=TINY_RESOLUTION, num_inference_steps=4,
                               guidance_scale=4.0, generator=torch.Generator("cpu").manual_seed(5), **extra).images[0])

    ours = np.asarray(Image.open(out).convert("RGB"))
    assert np.array_equal(ours, plain(cfg_trunc_ratio=CFG_TRUNC_RATIO))
    assert not np.array_equal(ours, plain())


@pytest.mark.slow
def test_a_lora_trains_moves_the_image_and_reloads_from_its_comfyui_export(
    engine_registry: Registry, lumina: Path, tmp_path: Path,
) -> None:
    """Four steps on two images: the LoRA moves the image, scale 0 is the base, and the kohya
    file ComfyUI reads (``lora_unet_`` + the transformer's module names) gives the same image."""
    from engine.testing.lora_roundtrip import train_and_reload

    modules = train_and_reload(engine_registry, lumina, tmp_path)
    assert modules and all(m.startswith("lora_unet_") and "_attn_to_" in m for m in modules)
