"""Model resolution: what a path is, refused before anything loads."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.errors import EngineError
from engine.contract.plugins import load_registry
from engine.preflight.model import ModelNotFound, NotAPipeline, resolve_model
from engine.testing.checkpoints import write_gguf, write_single_file

REGISTRY = load_registry()


@pytest.mark.parametrize("family", ["flux", "qwen_image", "zimage", "sdxl"])
def test_pipeline_folder_is_detected_by_its_class_name(
    family: str, tiny_pipeline: Callable[[str], Path]
) -> None:
    source = resolve_model(REGISTRY, tiny_pipeline(family))
    assert (source.kind, source.family.name) == ("pipeline", family)


def test_measured_sizes_come_from_the_safetensors_headers(tiny_pipeline: Callable[[str], Path]) -> None:
    import torch
    from diffusers import FluxTransformer2DModel

    folder = tiny_pipeline("flux")
    sizes = resolve_model(REGISTRY, folder).measured_sizes
    assert sizes is not None
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(folder / "transformer"))
    expected = sum(p.numel() for p in model.parameters()) * 2 / 1e9
    assert sizes.transformer_gb == pytest.approx(expected)
    assert 0 < sizes.text_encoders_gb < sizes.transformer_gb and sizes.vae_gb > 0


def test_a_two_expert_folder_is_measured_with_both_experts(tmp_path: Path) -> None:
    """Wan 2.2's pair: the denoiser's GB (and its GB under each scheme) count ``transformer_2``
    too, as the table's 57.2 GB does; it counted the high-noise expert alone, half the weights."""
    from engine.preflight.headers import dense_gb, tensor_shapes
    from families.wan.tiny import build_tiny_two_experts

    folder = build_tiny_two_experts(tmp_path / "wan22")
    source = resolve_model(REGISTRY, folder)
    each = [dense_gb(tensor_shapes(sorted((folder / name).glob("*.safetensors"))))
            for name in ("transformer", "transformer_2")]
    assert source.measured_sizes is not None and source.measured_sizes.transformer_gb == pytest.approx(sum(each))
    assert source.scheme_gb is not None and source.scheme_gb["int8"] > each[0]


def test_plan_facts_carry_table_and_measured_sizes(tiny_pipeline: Callable[[str], Path]) -> None:
    facts = resolve_model(REGISTRY, tiny_pipeline("sdxl")).facts(REGISTRY)
    assert facts.table_sizes.transformer_gb == 5.1
    assert facts.measured_sizes is not None and facts.sizes == facts.measured_sizes


def test_folder_with_one_safetensors_is_a_single_file_checkpoint(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    base = tiny_pipeline("zimage")
    write_single_file(base, "transformer", tmp_path / "zimage-finetune" / "model.safetensors")
    source = resolve_model(REGISTRY, tmp_path / "zimage-finetune", base=base)
    assert (source.kind, source.family.name, source.base) == ("single_file", "zimage", str(base))
    assert source.measured_sizes is not None and source.measured_sizes.transformer_gb > 0


def test_single_file_family_comes_from_its_keys_not_its_name(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    file = write_single_file(tiny_pipeline("qwen_image"), "transformer", tmp_path / "mystery.safetensors")
    assert resolve_model(REGISTRY, file, base=tiny_pipeline("qwen_image")).family.name == "qwen_image"


def test_gguf_file_is_resolved_with_its_size(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    base = tiny_pipeline("flux")
    file = write_gguf(base, "transformer", tmp_path / "flux-q8_0.gguf")
    source = resolve_model(REGISTRY, file, base=base)
    assert (source.kind, source.family.name) == ("gguf", "flux")
    assert source.gguf_gb == pytest.approx(file.stat().st_size / 1e9)


def test_folder_that_is_not_a_pipeline_is_refused_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "README.md").write_text("hello", encoding="utf-8")
    with pytest.raises(NotAPipeline) as raised:
        resolve_model(REGISTRY, folder)
    assert str(folder) in raised.value.message and "model_index.json" in raised.value.message
    assert raised.value.code == "not_a_pipeline"


def test_folder_with_two_checkpoints_is_refused(tmp_path: Path, tiny_pipeline: Callable[[str], Path]) -> None:
    for name in ("a.safetensors", "b.safetensors"):
        write_single_file(tiny_pipeline("sdxl"), "unet", tmp_path / "two" / name)
    with pytest.raises(NotAPipeline, match="2 .safetensors"):
        resolve_model(REGISTRY, tmp_path / "two")


def test_missing_component_is_file_not_found_naming_the_folder(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    copy = tmp_path / "broken"
    shutil.copytree(tiny_pipeline("sdxl"), copy)
    shutil.rmtree(copy / "vae")
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model(REGISTRY, copy)
    assert isinstance(raised.value, EngineError)
    assert raised.value.code == "model_file_missing" and str(copy) in raised.value.message
    assert "vae" in raised.value.message


def test_unknown_pipeline_class_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}), encoding="utf-8")
    with pytest.raises(NotAPipeline) as raised:
        resolve_model(REGISTRY, tmp_path)
    assert raised.value.code == "family_unknown" and "FluxPipeline" in raised.value.message


def test_corrupt_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x01 not a header")
    with pytest.raises(NotAPipeline) as raised:
        resolve_model(REGISTRY, tmp_path, family="flux")
    assert raised.value.code == "corrupt_checkpoint"


def test_missing_local_path_and_hub_ids() -> None:
    with pytest.raises(ModelNotFound) as raised:
        resolve_model(REGISTRY, "./models/nowhere")
    assert isinstance(raised.value, FileNotFoundError)
    hub = resolve_model(REGISTRY, "black-forest-labs/FLUX.1-schnell")
    assert (hub.kind, hub.family.name, hub.checkpoint.name) == ("hub", "flux", "flux.1-schnell")  # type: ignore[union-attr]
    assert resolve_model(REGISTRY, "diffusers/qwen-image-bnb-4bit").prequantised_scheme == "nf4"
    with pytest.raises(EngineError) as unknown:
        resolve_model(REGISTRY, "someone/some-unknown-model")
    assert unknown.value.code == "family_unknown"


def test_component_without_weights_is_file_not_found_naming_the_folder(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    copy = tmp_path / "no-weights"
    shutil.copytree(tiny_pipeline("flux"), copy)
    for weights in (copy / "transformer").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model(REGISTRY, copy)
    assert str(copy) in str(raised.value) and "transformer" in str(raised.value)


def test_a_folders_own_defaults_size_and_step_its_plan(tiny_pipeline: Callable[[str], Path], tmp_path: Path) -> None:
    """``diffusion_engine.json`` beside model_index.json gives the model's own size and steps
    (what a silent request gets); a malformed one is refused naming the file."""
    from engine.hardware.presets import preset
    from engine.policy.inference import plan_inference
    from engine.requests import InferenceRequest

    folder = tmp_path / "tiny-flux"
    shutil.copytree(tiny_pipeline("flux"), folder)
    plain = plan_inference(REGISTRY, resolve_model(REGISTRY, folder).facts(REGISTRY), preset("cpu"), InferenceRequest())
    assert (plain.default_size, plain.default_steps) == (None, 28)  # FLUX.1-dev's table
    (folder / "diffusion_engine.json").write_text(json.dumps({"defaults": {"width": 64, "height": 48, "steps": 4}}))
    own = plan_inference(REGISTRY, resolve_model(REGISTRY, folder).facts(REGISTRY), preset("cpu"), InferenceRequest())
    assert (own.default_size, own.default_steps) == ((64, 48), 4)
    asked = plan_inference(REGISTRY, resolve_model(REGISTRY, folder).facts(REGISTRY), preset("cpu"),
                           InferenceRequest(steps=9))
    assert asked.default_steps == 9  # the request wins
    (folder / "diffusion_engine.json").write_text(json.dumps({"defaults": {"width": "big"}}))
    with pytest.raises(NotAPipeline) as refused:
        resolve_model(REGISTRY, folder)
    assert refused.value.code == "corrupt_checkpoint" and "diffusion_engine.json" in refused.value.message
