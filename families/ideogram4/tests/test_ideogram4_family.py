"""The ideogram4 plugin: the contract kit, an image through the CLI equal to plain
``Ideogram4Pipeline`` on the model card's guidance schedule, the fp8 repo's layout (fused qkv,
per-channel scales) loaded split and equal to the dense model where a plain ``from_pretrained``
random-initialises its attention, an ai-toolkit LoRA, and plans on the cards people use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.contract.plugins import Registry
from engine.testing import FamilyContract
from families.ideogram4.table import guidance_schedule


class TestIdeogram4Kit(FamilyContract):
    family_name = "ideogram4"


@pytest.fixture(scope="module")
def folder(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("ideogram4")


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny pipeline with fp8-exact weights (dense) and the same model in the fp8 repo's layout."""
    from families.ideogram4.tiny import build_tiny_pipeline, write_fp8_fused_layout

    root = tmp_path_factory.mktemp("ideogram4-fp8")
    dense = build_tiny_pipeline(root / "ideogram-4")
    return dense, write_fp8_fused_layout(dense, root / "ideogram-4-fp8")


def _generator(seed: int) -> object:
    import torch

    return torch.Generator("cpu").manual_seed(seed)


@pytest.mark.parametrize(("card", "memory", "scheme"), [
    ("rtx4090", "group_offload", None),  # 37.2 GB of transformers: even int8 overflows 24 GB, both are streamed
    ("l40s", "resident", "fp8"),         # 48 GB: both transformers in fp8 fit resident
    ("h100", "resident", None),          # 80 GB: dense and resident
    ("b200", "resident", None),
])
def test_ideogram4_plans_both_transformers_on_the_cards_people_use(card: str, memory: str, scheme: str | None) -> None:
    """Both transformers are weighed (37.2 GB together): the plan streams or quantises them as one."""
    from tests.support import table_plan

    plan = table_plan("ideogram4", card)
    assert (plan.value("dtype"), plan.value("memory_mode"), plan.value("transformer_quant")) == ("bf16", memory, scheme)
    assert plan.sizes["table"].transformer_gb == 37.2
    if card == "rtx4090":
        assert "37.2 GB of weights" in plan["memory_mode"].reason


def test_a_request_naming_no_size_is_sized_at_its_native_2k() -> None:
    """The pipeline renders 2048 x 2048 when no size is asked: the plan's guard sizes for that."""
    from engine.contract.plugins import load_registry
    from engine.policy.request_shape import request_shape
    from engine.requests.inference import InferenceRequest

    registry = load_registry()
    for name in ("ideogram4", "hunyuan_image"):
        shape = request_shape(registry.family(name), None, InferenceRequest())
        assert (shape.width, shape.height) == (2048, 2048), name
    assert request_shape(registry.family("flux"), None, InferenceRequest()).width == 1024


def test_the_model_cards_guidance_runs_on_its_schedule() -> None:
    assert guidance_schedule(48) == (7.0,) * 45 + (3.0,) * 3  # the pipeline's own default
    assert guidance_schedule(4) == (7.0, 3.0, 3.0, 3.0) and guidance_schedule(2) == (7.0, 7.0)


@pytest.mark.slow
def test_the_cli_image_equals_plain_ideogram4pipeline_on_its_schedule(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """The default guidance is the model card's schedule (7.0, polishing at 3.0); ``--guidance 4``
    is held on every step."""
    from diffusers import Ideogram4Pipeline

    from engine.cli import main

    from engine.testing.stock import planned_dtypes

    pipe = Ideogram4Pipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder))
    for extra, plain in (([], {"guidance_schedule": [7.0, 3.0, 3.0, 3.0]}),
                         (["--guidance", "4"], {"guidance_scale": 4.0, "guidance_schedule": None})):
        out = tmp_path / f"fox{len(extra)}.png"
        status = main(["generate", "--model", str(folder), "--prompt", "a red fox", "--width", "64", "--height", "64",
                       "--steps", "4", "--seed", "5", "-o", str(out), *extra])
        assert status == 0, capsys.readouterr().err[-2000:]
        expected = pipe("a red fox", height=64, width=64, num_inference_steps=4, generator=_generator(5), **plain)
        assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(expected.images[0])), extra


def test_the_fp8_repos_layout_is_known_from_its_headers(engine_registry: Registry, fp8_pair: tuple[Path, Path]) -> None:
    from engine.preflight.model import resolve_model

    dense, fp8 = fp8_pair
    assert resolve_model(engine_registry, dense).stored_layout is None
    source = resolve_model(engine_registry, fp8)
    assert source.stored_layout is not None and source.stored_layout.name == "fp8_fused_qkv"
    assert source.measured_sizes is not None and source.measured_sizes.transformer_gb > 0


@pytest.mark.slow
def test_the_fp8_repo_loads_split_and_draws_the_dense_models_image(
    engine_registry: Registry, fp8_pair: tuple[Path, Path],
) -> None:
    """Through the engine, the fp8 layout (fused qkv, per-channel scales, ``attention.o``) gives
    the dense model's image pixel for pixel; a plain ``from_pretrained`` of it loads the fused
    attention random-initialised (and the other fp8 weights unscaled)."""
    import torch
    from diffusers import Ideogram4Transformer2DModel

    from engine.service.facade import Engine

    dense, fp8 = fp8_pair
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 3}
    images = {}
    with Engine(registry=engine_registry) as engine:
        for name, path in (("dense", dense), ("fp8", fp8)):
            engine.images.load(str(path))
            images[name] = np.asarray(engine.images.generate("a red fox", **asked)[0])
            if name == "fp8":
                layout = engine.status()["pipeline"]["model"]["stored_layout"]  # type: ignore[index]
                assert layout["name"] == "fp8_fused_qkv" and "split" in layout["converted"]
    assert np.array_equal(images["fp8"], images["dense"])
    plain = Ideogram4Transformer2DModel.from_pretrained(str(fp8 / "transformer"), low_cpu_mem_usage=False)
    held = Ideogram4Transformer2DModel.from_pretrained(str(dense / "transformer"))
    assert not torch.equal(plain.layers[0].attention.to_q.weight, held.layers[0].attention.to_q.weight)


def test_an_fp8_repo_its_conversion_cannot_cover_is_refused_before_anything_is_evicted(
    engine_registry: Registry, fp8_pair: tuple[Path, Path], tmp_path: Path,
) -> None:
    """A copy whose second block lost its output projection: the conversion, run on ``meta``
    tensors from the headers, leaves ``to_out.0`` unset, so the load is refused naming it while
    the resident model stays; it is never loaded random-initialised."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.errors import EngineError
    from engine.service.facade import Engine

    dense, fp8 = fp8_pair
    broken = tmp_path / "ideogram-4-fp8"
    shutil.copytree(fp8, broken)
    file = next((broken / "transformer").glob("*.safetensors"))
    save_file({k: v for k, v in load_file(str(file)).items() if not k.startswith("layers.1.attention.o.")}, str(file))
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(dense))
        resident = engine.images.session
        with pytest.raises(EngineError) as refused:
            engine.images.load(str(broken))
        assert engine.images.session is resident
    assert refused.value.code == "corrupt_checkpoint"
    assert "layers.1.attention.to_out.0.weight" in refused.value.message, refused.value.message


@pytest.mark.slow
def test_an_ai_toolkit_lora_with_fused_qkv_moves_the_image_as_diffusers_loads_it(
    engine_registry: Registry, folder: Path, tmp_path: Path,
) -> None:
    """ai-toolkit's layout (``diffusion_model.`` prefix, kohya down/up, a fused ``attention.qkv``,
    ``attention.o``): the engine's image with it equals ``Ideogram4Pipeline.load_lora_weights``'."""
    import torch
    from diffusers import Ideogram4Pipeline
    from safetensors.torch import save_file

    from engine.service.facade import Engine

    torch.manual_seed(7)
    hidden, rank = 32, 4
    lora = {}
    for i in range(2):
        for module, rows in (("attention.qkv", 3 * hidden), ("attention.o", hidden)):
            lora[f"diffusion_model.layers.{i}.{module}.lora_down.weight"] = torch.randn(rank, hidden) * 0.5
            lora[f"diffusion_model.layers.{i}.{module}.lora_up.weight"] = torch.randn(rows, rank) * 0.5
            lora[f"diffusion_model.layers.{i}.{module}.alpha"] = torch.tensor(float(rank))
    path = tmp_path / "ideogram_style.safetensors"
    save_file(lora, str(path))
    asked = {"width": 64, "height": 64, "steps": 2, "seed": 5, "guidance": 4.0}
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(folder))
        base = np.asarray(engine.images.generate("a red fox", **asked)[0]).astype(int)
        moved = np.asarray(engine.images.generate("a red fox", loras=[f"{path}:1.0"], **asked)[0]).astype(int)
    from engine.testing.stock import planned_dtypes

    pipe = Ideogram4Pipeline.from_pretrained(str(folder), dtype=planned_dtypes(folder))
    pipe.load_lora_weights(str(path))
    plain = np.asarray(pipe("a red fox", height=64, width=64, num_inference_steps=2, guidance_scale=4.0,
                            guidance_schedule=None, generator=_generator(5)).images[0]).astype(int)
    assert np.abs(moved - base).max() > 8
    assert np.abs(moved - plain).max() <= 1
