"""LoRAs out: the kohya / ComfyUI file of every family round-trips through
diffusers' own converters to the same image as the diffusers-format file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.lora import LoraChoice, plan_input, read_loras
from engine.preflight.model import resolve_model
from engine.runtime.lora_check import converted_state_dict, unmatched_modules
from engine.runtime.session import GenerateRequest, InferenceSession
from engine.training.export import KOHYA_FILE, denoiser_out_features, kohya_metadata, kohya_state_dict

REGISTRY = load_registry()
HARDWARE = probe(verify=False)
FAMILIES = ["flux", "flux2", "qwen_image", "zimage", "sdxl"]
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
#: tiny model does not have; single blocks round-trip at those widths in
#: test_flux_single_blocks_round_trip_through_diffusers_at_full_width.
FLUX_DOUBLE_ONLY = r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"


def adapted(pipeline: Path, family: str, targets: object = None, seed: int = 0) -> tuple[object, dict[str, torch.Tensor]]:
    """(pipeline, peft state) with a random non-zero adapter of rank 4, alpha 8."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    spec = REGISTRY.family(family)
    pipe = diffusers.DiffusionPipeline.from_pretrained(pipeline)
    torch.manual_seed(seed)
    getattr(pipe, spec.pipeline.denoiser).add_adapter(LoraConfig(
        r=RANK, lora_alpha=ALPHA, init_lora_weights=False, target_modules=targets or list(spec.lora.targets),
    ))
    state = {k: v * 3 for k, v in get_peft_model_state_dict(getattr(pipe, spec.pipeline.denoiser)).items()}
    return pipe, state


def write_both(pipe: object, family: str, state: dict[str, torch.Tensor], out: Path) -> tuple[Path, Path]:
    """The diffusers-format file (with the adapter's alpha in its metadata) and the kohya file."""
    spec = REGISTRY.family(family)
    denoiser = getattr(pipe, spec.pipeline.denoiser)
    config = denoiser.peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"]) if isinstance(config["target_modules"], set) else config["target_modules"]
    type(pipe).save_lora_weights(  # type: ignore[attr-defined]
        str(out / "diffusers"), **{f"{spec.pipeline.denoiser}_lora_layers": state,
                                   f"{spec.pipeline.denoiser}_lora_adapter_metadata": config},
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


def test_flux2_kohya_keys_are_bfl_checkpoint_names(tiny_pipeline: Callable[[str], Path]) -> None:
    """A FLUX.2 LoRA of the family's default targets is written under BFL's module names (what
    ComfyUI and diffusers' FLUX.2 kohya converter read): q, k, v fused into ``img_attn_qkv``,
    the feed-forward as ``img_mlp_0`` / ``img_mlp_2``, a single block's fused projection as
    ``linear1`` and nothing left in diffusers' spelling."""
    pipe, state = adapted(tiny_pipeline("flux2"), "flux2")
    kohya = kohya_state_dict(REGISTRY.family("flux2"), state, ALPHA, denoiser_out_features(pipe.transformer))  # type: ignore[attr-defined]
    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya}
    assert modules == {
        "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_img_mlp_0", "lora_unet_double_blocks_0_img_mlp_2",
        "lora_unet_double_blocks_0_txt_mlp_0", "lora_unet_double_blocks_0_txt_mlp_2",
        "lora_unet_single_blocks_0_linear1",
    }


#: FLUX.1-dev's transformer widths (inner 3072, MLP 12288, T5 4096, pooled
#: CLIP 768) with one block of each kind: built on the ``meta`` device, so
#: its module tree and shapes cost no memory and no time.
FLUX_DEV_ONE_BLOCK_EACH = {
    "in_channels": 64, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
    "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
}


def _full_width_flux() -> torch.nn.Module:
    import diffusers

    with torch.device("meta"):
        return diffusers.FluxTransformer2DModel(**FLUX_DEV_ONE_BLOCK_EACH)


def _random_adapter(model: torch.nn.Module, modules: list[str]) -> dict[str, torch.Tensor]:
    """Rank-4 peft weights (``<module>.lora_A.weight`` / ``lora_B``) at the modules' true widths."""
    generator = torch.Generator().manual_seed(0)
    state = {}
    for name in modules:
        linear = model.get_submodule(name)
        state[f"{name}.lora_A.weight"] = torch.randn(RANK, linear.in_features, generator=generator) * 0.1
        state[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, RANK, generator=generator) * 0.1
    return state


@pytest.mark.parametrize("which", ["default targets", "every block module"])
def test_flux_single_blocks_round_trip_through_diffusers_at_full_width(which: str) -> None:
    """diffusers' kohya FLUX converter splits ``single_blocks_N_linear1`` at
    FLUX.1's own widths (3 x 3072 + 12288, hard-coded), so no tiny model can
    carry a single block through it. At the true widths (a weightless FLUX.1
    skeleton) the export of a double and a single block converts back with
    every module landing (0 unmatched) and each module's delta equal to the
    adapter's; a single-block module the run did not adapt (the MLP input,
    with the default targets) comes back as a zero delta."""
    from diffusers import FluxPipeline

    spec = REGISTRY.family("flux")
    model = _full_width_flux()
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    if which == "default targets":
        modules = [n for n in names if any(n == t or n.endswith("." + t) for t in spec.lora.targets)]
    else:  # every module a double or single block maps to in the kohya / ComfyUI layout
        sources = {s.replace("{i}", "0") for _, group in spec.lora.kohya_map for s in group if "{i}" in s}
        modules = [n for n in names if n in sources]
    assert any(m.startswith("single_transformer_blocks.0.") for m in modules)
    state = _random_adapter(model, modules)
    kohya = kohya_state_dict(spec, state, ALPHA, denoiser_out_features(model))
    exported = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya}
    assert "lora_unet_single_blocks_0_linear1" in exported and exported <= comfy_flux_keys(double=1, single=1)
    if which == "every block module":
        assert exported == comfy_flux_keys(double=1, single=1)

    converted = FluxPipeline.lora_state_dict(dict(kohya))
    converted = dict(converted[0] if isinstance(converted, tuple) else converted)
    unmatched, total = unmatched_modules(converted, {"transformer": model})
    assert unmatched == []
    back = sorted(k.removeprefix("transformer.")[: -len(".lora_A.weight")] for k in converted if k.endswith("lora_A.weight"))
    assert total == len(back) and set(modules) <= set(back)
    for module in back:  # each delta applied to random inputs, as peft applies it: B (A x)
        a, b = converted[f"transformer.{module}.lora_A.weight"], converted[f"transformer.{module}.lora_B.weight"]
        probe = torch.randn(a.shape[1], 8, generator=torch.Generator().manual_seed(1))
        if module in modules:  # diffusers folds alpha / rank into the weights of a kohya file
            expected = state[f"{module}.lora_B.weight"] @ (state[f"{module}.lora_A.weight"] @ probe) * (ALPHA / RANK)
            assert torch.allclose(b @ (a @ probe), expected, atol=1e-5, rtol=0), module
        else:
            assert module == "single_transformer_blocks.0.proj_mlp" and not (b @ (a @ probe)).any()


def test_flux_embedder_loras_are_refused_not_dropped() -> None:
    """The input embedders (``img_in`` / ``txt_in`` in ComfyUI's names) come out of
    diffusers' kohya converter without their ``transformer.`` prefix (diffusers
    0.42), so ``load_lora_weights`` would silently skip them: the engine's match
    check names them instead, and such a kohya file is refused, never half-applied
    (the run's diffusers-format file carries them fine)."""
    from diffusers import FluxPipeline

    spec = REGISTRY.family("flux")
    model = _full_width_flux()
    state = _random_adapter(model, ["x_embedder", "context_embedder", "transformer_blocks.0.attn.to_out.0"])
    kohya = kohya_state_dict(spec, state, ALPHA, denoiser_out_features(model))
    assert {"lora_unet_img_in.alpha", "lora_unet_txt_in.alpha"} <= set(kohya)  # ComfyUI's FLUX names
    converted = FluxPipeline.lora_state_dict(dict(kohya))
    converted = dict(converted[0] if isinstance(converted, tuple) else converted)
    unmatched, total = unmatched_modules(converted, {"transformer": model})
    assert len(unmatched) == 2 and all(("x_embedder" in u) or ("context_embedder" in u) for u in unmatched)
    assert total == 3


def test_sdxl_kohya_keys_use_unet_module_names(tiny_pipeline: Callable[[str], Path]) -> None:
    pipe, state = adapted(tiny_pipeline("sdxl"), "sdxl")
    kohya = kohya_state_dict(REGISTRY.family("sdxl"), state, ALPHA, denoiser_out_features(pipe.unet))  # type: ignore[attr-defined]
    assert "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight" in kohya
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha" in kohya
    assert float(kohya["lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha"]) == ALPHA


# A real training run's two files (ss_* metadata, alpha, the same image):
# tests/runtime/test_lora_trained.py::test_both_files_of_a_run_keep_its_alpha_and_render_what_the_trainer_had


def test_kohya_metadata_fields() -> None:
    spec = REGISTRY.family("sdxl")
    meta = kohya_metadata(family=spec, base_model="/models/sdxl-base", rank=16, alpha=8.0, resolution=1024,
                          steps=500, targets=("to_q",))
    assert meta["ss_base_model_version"] == "sdxl" and meta["ss_sd_model_name"] == "sdxl-base"
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_steps"]) == ("16", "8.0", "500")
    assert all(isinstance(v, str) for v in meta.values())


@pytest.mark.slow
def test_the_engines_full_flux_kohya_export_round_trips_through_generate_lora(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every default FLUX target, single blocks' fused ``linear1`` included, exported to the
    kohya layout and given to ``generate --lora``: the fused modules are split with the
    tiny model's own widths (diffusers' converter assumes the full-size model's), and the
    image equals the diffusers-format file's."""
    from PIL import Image

    from engine.cli import main

    folder = tiny_pipeline("flux")
    pipe, state = adapted(folder, "flux")  # the family's default targets
    diffusers_file, kohya_file = write_both(pipe, "flux", state, tmp_path)
    with safe_open(str(kohya_file), "pt") as handle:
        assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in handle.keys()
    images = {}
    for name, lora in (("diffusers", diffusers_file), ("kohya", kohya_file), ("plain", None)):
        out = tmp_path / f"{name}.png"
        args = ["generate", "--model", str(folder), "--prompt", "a lighthouse at dusk", "--steps", "2", "--seed", "3",
                "--width", "64", "--height", "64", "-o", str(out)] + (["--lora", str(lora)] if lora else [])
        assert main(args) == 0, capsys.readouterr().err[-2000:]
        images[name] = np.asarray(Image.open(out)).astype(np.int16)
    assert "Traceback" not in capsys.readouterr().err
    assert np.abs(images["diffusers"] - images["plain"]).mean() > 0.5  # the LoRA does something
    assert np.abs(images["kohya"] - images["diffusers"]).max() <= 1


def test_a_lora_diffusers_refuses_with_an_empty_message_is_a_lora_mismatch_naming_the_error(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    """diffusers' FLUX kohya converter asserts (with no message) on widths it does not
    expect; read without the model's widths, that is a ``lora_mismatch`` naming the
    library's error, never an IndexError."""
    from diffusers import FluxPipeline

    from engine.preflight.lora import LoraMismatch

    pipe, state = adapted(tiny_pipeline("flux"), "flux")
    _, kohya_file = write_both(pipe, "flux", state, tmp_path)
    [lora] = read_loras([LoraChoice(str(kohya_file))])
    with pytest.raises(LoraMismatch) as refused:
        converted_state_dict(FluxPipeline, lora)
    assert refused.value.code == "lora_mismatch" and "AssertionError" in refused.value.message
