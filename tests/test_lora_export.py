"""LoRAs out: the kohya / ComfyUI file of every family round-trips through
diffusers' own converters to the same image as the diffusers-format file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.hardware.probe import probe
from engine.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.lora import LoraChoice, plan_input, read_loras
from engine.preflight.model import resolve_model
from engine.runtime.lora import converted_state_dict, unmatched_modules
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.training.export import KOHYA_FILE, denoiser_out_features, kohya_metadata, kohya_state_dict

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
FAMILIES = ["flux", "qwen_image", "zimage", "sdxl"]
RANK, ALPHA = 4, 8.0

#: FLUX.1 modules as ComfyUI's LoRA key map names them (BFL checkpoint layout):
#: ``lora_unet_`` + the module path with dots as underscores. Written out as data.
COMFY_FLUX_DOUBLE = (
    "img_attn.qkv", "img_attn.proj", "txt_attn.qkv", "txt_attn.proj",
    "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2", "img_mod.lin", "txt_mod.lin",
)
COMFY_FLUX_SINGLE = ("linear1", "linear2", "modulation.lin")


def comfy_flux_keys(double: int, single: int) -> set[str]:
    names = [f"double_blocks.{i}.{m}" for i in range(double) for m in COMFY_FLUX_DOUBLE]
    names += [f"single_blocks.{i}.{m}" for i in range(single) for m in COMFY_FLUX_SINGLE]
    return {"lora_unet_" + n.replace(".", "_") for n in names}


#: Only FLUX's double blocks: diffusers' kohya converter splits a single
#: block's linear1 with the full-size model's widths (3072 / 12288), which a
#: tiny model does not have; the single-block layout is checked separately.
FLUX_DOUBLE_ONLY = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"


def adapted(pipeline: Path, family: str, targets: object = None, seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    """(pipeline, peft state) with a random non-zero adapter of rank 4, alpha 8."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    spec = REGISTRY.family(family)
    pipe = diffusers.DiffusionPipeline.from_pretrained(pipeline)
    torch.manual_seed(seed)
    getattr(pipe, spec.denoiser).add_adapter(LoraConfig(
        r=RANK, lora_alpha=ALPHA, init_lora_weights=False, target_modules=targets or list(spec.lora_targets),
    ))
    state = {k: v * 3 for k, v in get_peft_model_state_dict(getattr(pipe, spec.denoiser)).items()}
    return pipe, state


def write_both(pipe: object, family: str, state: dict[str, torch.Tensor], out: Path) -> tuple[Path, Path]:
    """The diffusers-format file (with the adapter's alpha in its metadata) and the kohya file."""
    spec = REGISTRY.family(family)
    denoiser = getattr(pipe, spec.denoiser)
    config = denoiser.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(config["target_modules"], set) else config["target_modules"]
    type(pipe).save_lora_weights(  # type: ignore[attr-defined]
        str(out / "diffusers"), **{f"{spec.denoiser}_lora_layers": state,
                                   f"{spec.denoiser}_lora_adapter_metadata": config},
    )
    kohya = kohya_state_dict(spec, state, ALPHA, denoiser_out_features(denoiser))
    (out / "kohya").mkdir(parents=True)
    save_file(kohya, str(out / "kohya" / KOHYA_FILE), metadata={"ss_network_dim": str(RANK)})
    return out / "diffusers" / "pytorch_lora_weights.safetensors", out / "kohya" / KOHYA_FILE


def render(folder: Path, lora: Path | None) -> np.ndarray:
    files = read_loras([LoraChoice(str(lora))]) if lora else ()
    source = resolve_model(REGISTRY, folder)
    request = InferenceRequest(loras=plan_input(files, switching=True))
    session = InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, request),
                               request, loras=files)
    session.load()
    try:
        [image] = session.generate(GenerateRequest("a lighthouse at dusk", steps=2, seed=3, width=64, height=64))
    finally:
        session.unload()
    return np.asarray(image).astype(np.float64) / 255.0


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_kohya_export_round_trips_through_diffusers(
    family: str, tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tiny_pipeline(family)
    pipe, state = adapted(folder, family, FLUX_DOUBLE_ONLY if family == "flux" else None)
    diffusers_file, kohya_file = write_both(pipe, family, state, tmp_path)
    with safe_open(str(kohya_file), "pt") as handle:
        keys = list(handle.keys())
    assert keys and all(k.startswith("lora_unet_") for k in keys)

    lora = read_loras([LoraChoice(str(kohya_file))])[0]
    components = {k: v for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)}  # type: ignore[attr-defined]
    unet = components.get("unet")
    converted = converted_state_dict(type(pipe), lora, unet_config=getattr(unet, "config", None))
    unmatched, total = unmatched_modules(converted, components)
    assert unmatched == [] and total == sum(1 for k in state if k.endswith("lora_A.weight"))

    plain, from_diffusers, from_kohya = render(folder, None), render(folder, diffusers_file), render(folder, kohya_file)
    assert np.abs(from_diffusers - plain).mean() > 1e-3
    assert np.allclose(from_kohya, from_diffusers, atol=1e-5, rtol=0)


def test_flux_kohya_keys_are_comfyui_flux_names(tiny_pipeline: Callable[[str], Path]) -> None:
    """Every key is one ComfyUI's FLUX key map knows; q, k, v (and a single
    block's MLP input) are fused exactly: the fused delta is the parts' deltas."""
    pipe, state = adapted(tiny_pipeline("flux"), "flux")
    denoiser = pipe.transformer  # type: ignore[attr-defined]
    kohya = kohya_state_dict(REGISTRY.family("flux"), state, ALPHA, denoiser_out_features(denoiser))
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya}
    assert modules == {
        "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_txt_attn_qkv", "lora_unet_double_blocks_0_txt_attn_proj",
        "lora_unet_single_blocks_0_linear1",
    }
    assert modules <= comfy_flux_keys(double=1, single=1)

    def delta(name: str) -> torch.Tensor:
        down, up = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"]
        return up @ down * (float(kohya[f"{name}.alpha"]) / down.shape[0])

    def part(module: str) -> torch.Tensor:
        return state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"] * (ALPHA / RANK)

    block = "single_transformer_blocks.0"
    mlp_rows = denoiser.get_submodule(f"{block}.proj_mlp").out_features
    expected = torch.cat([part(f"{block}.attn.to_q"), part(f"{block}.attn.to_k"), part(f"{block}.attn.to_v"),
                          torch.zeros(mlp_rows, denoiser.inner_dim)])
    assert torch.allclose(delta("lora_unet_single_blocks_0_linear1"), expected, atol=1e-5)
    qkv = torch.cat([part(f"transformer_blocks.0.attn.{p}") for p in ("to_q", "to_k", "to_v")])
    assert torch.allclose(delta("lora_unet_double_blocks_0_img_attn_qkv"), qkv, atol=1e-5)
    assert torch.allclose(delta("lora_unet_double_blocks_0_img_attn_proj"), part("transformer_blocks.0.attn.to_out.0"), atol=1e-5)


def test_sdxl_kohya_keys_use_unet_module_names(tiny_pipeline: Callable[[str], Path]) -> None:
    pipe, state = adapted(tiny_pipeline("sdxl"), "sdxl")
    kohya = kohya_state_dict(REGISTRY.family("sdxl"), state, ALPHA, denoiser_out_features(pipe.unet))  # type: ignore[attr-defined]
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha" in kohya
    assert float(kohya["lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha"]) == ALPHA


@pytest.mark.slow
def test_a_trained_run_exports_both_files_that_give_the_same_image(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    """One real run (2 steps on CPU): its kohya file carries ss_* metadata and
    gives the image its diffusers file gives; the run folder works as --lora."""
    from engine.testing.datasets import write_dataset
    from engine.training.config import TrainingConfig
    from engine.training.preflight import preflight_training
    from engine.training.trainer import run_training

    base = tiny_pipeline("zimage")
    config = TrainingConfig.from_data({
        "base_model": str(base), "dataset_dir": str(write_dataset(tmp_path / "data", count=2, size=64)),
        "resolution": 64, "steps": 2, "lora_rank": 4, "learning_rate": 5e-2, "device": "cpu",
        "export_kohya": True,
    })
    plan = preflight_training(REGISTRY, config, HARDWARE)
    events: list[dict[str, object]] = []
    result = run_training(plan, tmp_path / "run", events.append, lambda: None)
    assert result["type"] == "completed"
    outputs = result["outputs"]
    assert Path(outputs["lora"]).parent == tmp_path / "run"  # type: ignore[index]
    with safe_open(outputs["lora_kohya"], "pt") as handle:  # type: ignore[index]
        metadata = handle.metadata()
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "4.0"
    assert metadata["ss_resolution"] == "(64, 64)" and metadata["ss_max_train_steps"] == "2"
    assert metadata["ss_sd_model_name"] == base.name and json.loads(metadata["ss_network_args"])
    from_run_folder, from_kohya = render(base, tmp_path / "run"), render(base, Path(outputs["lora_kohya"]))  # type: ignore[index]
    assert np.allclose(from_kohya, from_run_folder, atol=1e-5, rtol=0)
    assert np.abs(from_run_folder - render(base, None)).mean() > 0


def test_kohya_metadata_fields() -> None:
    spec = REGISTRY.family("sdxl")
    meta = kohya_metadata(family=spec, base_model="/models/sdxl-base", rank=16, alpha=8.0, resolution=1024,
                          steps=500, targets=("to_q",))
    assert meta["ss_base_model_version"] == "sdxl" and meta["ss_sd_model_name"] == "sdxl-base"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_steps"]) == ("16", "8.0", "500")
    assert all(isinstance(v, str) for v in meta.values())
