"""The flux3 plugin: the contract kit for FLUX.3 and its distilled checkpoint (modular
pipelines), an image equal to the blocks' own with the prompt upsampler left out where the
folder does not ship it, sizes from its configs (said so in the plan), and plans on the cards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.testing import FamilyContract


class TestFlux3Kit(FamilyContract):
    family_name = "flux3"


class TestFlux3DistilledKit(FamilyContract):
    family_name = "flux3"
    checkpoint_name = "flux3-distilled"


@pytest.fixture(scope="module")
def folder(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("flux3")


def _plain(folder: Path, **components: object) -> object:
    """The blocks as diffusers builds them from the folder, the upsampler step popped (the
    folder does not ship it), every component loaded in the dtype the engine's plan chose (the processor built without its
    video part, which needs torchvision, as the engine builds it)."""
    from diffusers import Flux3AutoBlocks

    from engine.runtime.processors import build_processor

    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = blocks.init_pipeline(str(folder))
    from engine.testing.stock import planned_dtypes

    pipe.load_components(torch_dtype=planned_dtypes(folder))
    pipe.update_components(tokenizer=build_processor(folder / "tokenizer", "AutoProcessor"), **components)
    return pipe


def _image(pipe: object, seed: int) -> np.ndarray:
    import torch

    images = pipe(prompt="a red fox", num_inference_steps=2, height=64, width=64,  # type: ignore[operator]
                  generator=torch.Generator("cpu").manual_seed(seed), output="images")
    return np.asarray(images[0])


@pytest.mark.parametrize("card", ["rtx4090", "l40s", "h100", "b200"])
def test_flux3_plans_resident_in_bf16_and_says_where_its_sizes_come_from(card: str) -> None:
    """11.1 + 8.9 + 0.2 GB: resident everywhere people run it, the encoder in fp8; the sizes
    are its configs', and the plan says so."""
    from tests.support import table_plan

    plan = table_plan("flux3", card)
    assert (plan.value("dtype"), plan.value("memory_mode"), plan.value("transformer_quant")) == ("bf16", "resident", None)
    assert "not published" in plan.sizes["table"].source and "default configs" in plan.sizes["table"].source


def test_the_tables_sizes_are_the_configs_own() -> None:
    """The figures the table carries are the classes' default configs counted on the meta device."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel

    from families.flux3.table import FLUX3

    with torch.device("meta"):
        transformer, vae = Flux3Transformer2DModel(), AutoencoderKLFlux2()
    gb = [sum(p.numel() for p in model.parameters()) * 2 / 1e9 for model in (transformer, vae)]
    assert (FLUX3.sizes.transformer_gb, FLUX3.sizes.vae_gb) == (round(gb[0], 1), round(gb[1], 1))
    assert transformer.config.joint_attention_dim == 8 * 2560  # eight taps of Qwen3-VL-4B


@pytest.mark.slow
def test_the_image_equals_the_blocks_own_with_the_upsampler_left_out(engine_registry: Registry, folder: Path) -> None:
    """Through the engine: the blocks' image (the prompt encoded as given, the folder shipping no
    upsampler); ``guidance=5`` is the blocks' image with the guider at 5."""
    from diffusers import ClassifierFreeGuidance

    from engine.service.facade import Engine

    asked = {"width": 64, "height": 64, "steps": 2, "seed": 5}
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(folder))
        ours = [np.asarray(engine.images.generate("a red fox", guidance=g, **asked)[0]) for g in (None, 5.0)]
    assert np.array_equal(ours[0], _image(_plain(folder), 5))
    stronger = _image(_plain(folder, guider=ClassifierFreeGuidance(guidance_scale=5.0)), 5)
    assert np.array_equal(ours[1], stronger) and not np.array_equal(ours[1], ours[0])


@pytest.mark.slow
def test_a_diffusers_lora_moves_the_image(engine_registry: Registry, folder: Path, tmp_path: Path) -> None:
    """A LoRA in diffusers' layout on the single-stream blocks' attention loads through the
    engine's LoRA door (the modular pipeline's own loader) and moves the image; at scale 0 it is
    the base's."""
    import torch
    from safetensors.torch import save_file

    from engine.service.facade import Engine

    torch.manual_seed(3)
    lora = {}
    for module in ("to_q", "to_k", "to_v", "to_out.0"):
        key = f"transformer.single_transformer_blocks.0.attn.{module}"
        lora[f"{key}.lora_A.weight"] = torch.randn(4, 32) * 0.5
        lora[f"{key}.lora_B.weight"] = torch.randn(32, 4) * 0.5
    path = tmp_path / "flux3_style.safetensors"
    save_file(lora, str(path))
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 5}
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(folder))
        base = np.asarray(engine.images.generate("a red fox", **asked)[0]).astype(int)
        moved = np.asarray(engine.images.generate("a red fox", loras=[f"{path}:1.0"], **asked)[0]).astype(int)
        zero = np.asarray(engine.images.generate("a red fox", loras=[f"{path}:0.0"], **asked)[0]).astype(int)
    assert np.abs(moved - base).max() > 8 and np.abs(zero - base).max() <= 1


def test_guidance_asked_of_the_distilled_checkpoint_is_refused_before_anything_loads(
    engine_registry: Registry, tiny_pipeline: Callable[..., Path],
) -> None:
    """The distilled model has no guider: ``guidance=4`` is refused with what to do, nothing loaded."""
    from engine.errors import EngineError
    from engine.service.facade import Engine

    distilled = tiny_pipeline("flux3", "flux3-distilled")
    with Engine(registry=engine_registry) as engine:
        with pytest.raises(EngineError) as refused:
            engine.images.generate("a red fox", model=str(distilled), guidance=4.0, width=64, height=64, steps=1)
        assert engine.images.session is None
    assert refused.value.code == "invalid_request" and "guidance-distilled" in refused.value.message
