"""The quantised single files people download beside ComfyUI's fp8_scaled: ComfyUI's marked
float8, int8 (plain and ConvRot), nvfp4 and mxfp8 files, and Black Forest Labs' FP8R and NVFP4
linears. Each is written at tiny size from the tiny FLUX.1 as its publisher lays it out (with a
dense twin holding the values its codes encode), told from its header, planned per card (kept
in the engine's scheme where the card computes it, else dequantised, said), rendered on the CPU
as the model it holds, and refused naming the tensor when a scale or marker is wrong, before
anything is evicted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry
from engine.errors import PreflightError
from engine.testing.upstream_checkpoints import BFL, COMFY, marker_tensor

FORMATS = (*COMFY, *BFL)
TO_Q = "transformer_blocks.0.attn.to_q"


@pytest.fixture(scope="module")
def written(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path, Path]]:
    """``written(fmt)``: (the tiny FLUX.1 base, its transformer stored in ``fmt``, the dense twin)."""
    from engine.testing.upstream_checkpoints import write_upstream

    base, root, made = tiny_pipeline("flux"), tmp_path_factory.mktemp("upstream"), {}

    def get(fmt: str) -> tuple[Path, Path, Path]:
        if fmt not in made:
            twin = root / f"{fmt}-dense" / "flux1-dev.safetensors"
            made[fmt] = (base, write_upstream(base, "transformer", root / f"flux1-dev-{fmt}.safetensors", fmt, twin), twin)
        return made[fmt]

    return get


def _resaved(source: Path, target: Path, change: Callable[[dict], dict]) -> Path:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(source), "pt") as handle:
        metadata = handle.metadata()
    target.parent.mkdir(parents=True, exist_ok=True)
    save_file(change(load_file(str(source))), str(target), metadata=metadata)
    return target


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_named_from_its_header_and_sized_as_the_model_it_encodes(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], fmt: str,
) -> None:
    """Packed fp4 (two codes a byte) is sized and matched against its base as the weights it holds."""
    from engine.preflight.model import resolve_model

    base, stored, twin = written(fmt)
    source, dense = resolve_model(engine_registry, stored, base=base), resolve_model(engine_registry, twin, base=base)
    assert (source.upstream_format, dense.upstream_format) == (fmt, None)
    assert source.measured_sizes == dense.measured_sizes and sorted(source.denoiser_shapes) == sorted(dense.denoiser_shapes)


def test_comfyuis_markers_are_read_from_the_files_metadata_as_well(
    engine_registry: Registry, tiny_pipeline: Callable[[str], Path], tmp_path: Path,
) -> None:
    from engine.preflight.model import resolve_model
    from engine.testing.upstream_checkpoints import write_upstream

    base = tiny_pipeline("flux")
    file = write_upstream(base, "transformer", tmp_path / "flux1-dev-nvfp4.safetensors", "nvfp4", in_metadata=True)
    assert resolve_model(engine_registry, file, base=base).upstream_format == "nvfp4"


#: The engine scheme each format stays in per card; None: dequantised to the compute dtype.
KEPT = {
    "rtx4090": {"float8_e4m3fn": "fp8", "int8_tensorwise": "int8", "int8_convrot": "int8_convrot", "nvfp4": None,
                "mxfp8": None, "bfl_fp8r": "fp8", "bfl_nvfp4": "nvfp4"},
    "b200": {"float8_e4m3fn": "fp8", "int8_tensorwise": "int8", "int8_convrot": "int8_convrot", "nvfp4": "nvfp4",
             "mxfp8": "mxfp8", "bfl_fp8r": "fp8", "bfl_nvfp4": "nvfp4"},
    "t4": {"float8_e4m3fn": None, "int8_tensorwise": None, "int8_convrot": None, "nvfp4": None, "mxfp8": None,
           "bfl_fp8r": "fp8", "bfl_nvfp4": "nvfp4"},
    "cpu": {"float8_e4m3fn": None, "int8_tensorwise": "int8", "int8_convrot": "int8_convrot", "nvfp4": None, "mxfp8": None,
            "bfl_fp8r": "fp8", "bfl_nvfp4": "nvfp4"},
}


@pytest.mark.parametrize("card", sorted(KEPT))
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_plan_keeps_the_format_where_the_card_computes_it_and_dequantises_it_elsewhere_with_the_reason(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], card: str, fmt: str,
) -> None:
    """BFL's files stay packed on every card (diffusers' own quantizer dequantises a layer as it
    runs where the card lacks the kernel); an explicit other scheme is never laid over any."""
    from engine.hardware.presets import PRESETS
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model
    from engine.requests.inference import InferenceRequest

    base, stored, _ = written(fmt)
    facts = resolve_model(engine_registry, stored, base=base).facts(engine_registry)
    plan = plan_inference(engine_registry, facts, PRESETS[card], InferenceRequest(), env={})
    kept, reason = KEPT[card][fmt], plan["transformer_quant"].reason
    assert plan.value("transformer_quant") == kept and f"stored {fmt}" in reason, reason
    assert ("dequantised to" in reason) == (kept is None), reason
    if fmt in BFL:
        no_kernel = card in ("t4", "cpu") or (fmt == "bfl_nvfp4" and card == "rtx4090")
        assert "diffusers' bfl quantizer" in reason and ("dequantises each layer" in reason) == no_kernel, reason
    other = "int8" if kept != "int8" else "fp8"
    with pytest.raises(PreflightError) as refused:
        plan_inference(engine_registry, facts, PRESETS[card], InferenceRequest(quant=other), env={})
    assert refused.value.code == "prequantised_model" and fmt in refused.value.message


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_on_the_cpu_each_renders_the_model_its_codes_encode(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], fmt: str,
) -> None:
    """Pixel for pixel the dense twin's image (an int8 file kept int8: the twin quantised int8
    alike; ConvRot's kept in its own rotation, the twin rotated and quantised at load, and BFL's
    layers dequantised by diffusers as they run: within one level), and within the format's
    rounding of the original model's. BFL's Linears stay packed in memory."""
    import torch

    from engine.requests.inference import InferenceRequest
    from engine.service.facade import Engine

    base, stored, twin = written(fmt)
    asked, images = {"width": 64, "height": 64, "steps": 2, "seed": 3}, {}
    # fp32 throughout: the decoding is what is compared, not bf16's rounding of it
    twin_request = InferenceRequest(quant=KEPT["cpu"][fmt] or "auto", dtype="fp32")
    plain = InferenceRequest(dtype="fp32")
    with Engine(registry=engine_registry) as engine:
        for name, model, given, request in (("stored", stored, base, plain), ("twin", twin, base, twin_request),
                                            ("original", base, None, plain)):
            engine.images.load(str(model), base=str(given) if given else None, request=request)
            if name == "stored" and fmt in BFL:
                layer = engine.images.session.pipeline.transformer.transformer_blocks[0].attn.to_q  # type: ignore[union-attr]
                assert type(layer).__name__ in ("BFLFP8RLinear", "BFLNVFP4Linear")
                assert layer.weight.dtype in (torch.float8_e4m3fn, torch.uint8)
            images[name] = np.asarray(engine.images.generate("a red fox", **asked)[0]).astype(int)
    assert np.abs(images["stored"] - images["twin"]).max() <= (1 if fmt in (*BFL, "int8_convrot") else 0)
    assert np.abs(images["stored"] - images["original"]).mean() < (16 if "fp4" in fmt else 8)


@pytest.mark.parametrize(("fmt", "change", "code", "named"), [
    ("nvfp4", lambda s: {k: v for k, v in s.items() if k != f"{TO_Q}.weight_scale_2"}, "corrupt_checkpoint",
     f"{TO_Q}.weight_scale_2 is missing"),
    ("mxfp8", lambda s: {**s, f"{TO_Q}.weight_scale": s[f"{TO_Q}.weight_scale"][:64]}, "corrupt_checkpoint",
     f"{TO_Q}.weight_scale is U8 [64, 16], which does not scale {TO_Q}.weight"),
    ("int8_convrot", lambda s: {**s, f"{TO_Q}.weight_scale": s[f"{TO_Q}.weight_scale"][:5]}, "corrupt_checkpoint",
     f"{TO_Q}.weight_scale is F32 [5, 1]"),
    ("bfl_nvfp4", lambda s: {k: v for k, v in s.items() if k != f"{TO_Q}.input_scale"}, "corrupt_checkpoint",
     f"{TO_Q}.input_scale is missing"),
    ("float8_e4m3fn", lambda s: {**s, f"{TO_Q}.comfy_quant": marker_tensor({"format": "int4_awq"})},
     "unsupported_format", f"{TO_Q}.comfy_quant marks a format this engine does not read ('int4_awq'"),
    ("int8_convrot", lambda s: {**s, f"{TO_Q}.comfy_quant": marker_tensor(
        {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 48})}, "corrupt_checkpoint",
     f"{TO_Q}.comfy_quant has a ConvRot group of 48"),
    ("float8_e4m3fn", lambda s: {**s, f"{TO_Q}.comfy_quant": marker_tensor({"format": "x"})[:-3]},
     "corrupt_checkpoint", f"{TO_Q}.comfy_quant it is not JSON"),
    ("float8_e4m3fn", lambda s: {**s, "proj_out.weight_scale": s[f"{TO_Q}.weight_scale"].clone()}, "corrupt_checkpoint",
     "proj_out.weight_scale scales no quantised weight"),
], ids=["nvfp4-global-scale-missing", "mxfp8-block-scales-cut", "convrot-row-scales-cut", "bfl-input-scale-missing",
        "marker-of-unknown-format", "convrot-group-not-a-power-of-4", "marker-not-json", "orphan-scale"])
def test_a_scale_or_marker_that_does_not_fit_refuses_the_file_naming_the_tensor(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], tmp_path: Path, fmt: str,
    change: Callable[[dict], dict], code: str, named: str,
) -> None:
    from engine.preflight.model import resolve_model

    base, stored, _ = written(fmt)
    broken = _resaved(stored, tmp_path / stored.name, change)
    with pytest.raises(PreflightError) as refused:
        resolve_model(engine_registry, broken, base=base)
    assert refused.value.code == code and named in refused.value.message, refused.value.message


def test_a_broken_nvfp4_file_leaves_the_resident_model_in_place(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], tmp_path: Path,
) -> None:
    from engine.testing.checkpoints import refused_beside_resident

    base, stored, _ = written("nvfp4")
    broken = _resaved(stored, tmp_path / stored.name, lambda s: {k: v for k, v in s.items() if k != f"{TO_Q}.weight_scale"})
    error = refused_beside_resident(engine_registry, base, broken)
    assert error.code == "corrupt_checkpoint" and f"{TO_Q}.weight_scale is missing" in error.message  # type: ignore[attr-defined]


def test_a_nunchaku_svdquant_file_is_refused_naming_its_kernels(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], tmp_path: Path,
) -> None:
    """SVDQuant's W4A4 layers (int4 codes, a 16-bit low-rank branch) run only on Nunchaku's CUDA
    kernels: named, and pointed at the diffusers folder such a GPU loads, never read as weights."""
    import torch

    from engine.preflight.model import resolve_model

    base, _, twin = written("float8_e4m3fn")

    def svdquant(state: dict) -> dict:
        weight = state.pop(f"{TO_Q}.weight")
        rows, cols = weight.shape
        return {**state, f"{TO_Q}.qweight": torch.zeros(rows, cols // 2, dtype=torch.int8),
                f"{TO_Q}.wscales": torch.ones(cols // 64, rows, dtype=torch.bfloat16),
                f"{TO_Q}.proj_down": torch.zeros(cols, 32, dtype=torch.bfloat16),
                f"{TO_Q}.proj_up": torch.zeros(rows, 32, dtype=torch.bfloat16)}

    file = _resaved(twin, tmp_path / "svdq-int4_r32-flux.1-dev.safetensors", svdquant)
    with pytest.raises(PreflightError) as refused:
        resolve_model(engine_registry, file, base=base)
    assert refused.value.code == "unsupported_format" and "Nunchaku SVDQuant" in refused.value.message
    assert "nunchaku_lite" in refused.value.message


def test_a_file_of_several_formats_is_dequantised_saying_so(
    engine_registry: Registry, written: Callable[[str], tuple[Path, Path, Path]], tmp_path: Path,
) -> None:
    """ComfyUI files mix formats by layer (fp4 blocks, float8 where fp4 hurts); the engine lays
    one scheme per denoiser, so such a file loads dequantised, with the formats named."""
    from engine.hardware.presets import PRESETS
    from engine.policy.inference import plan_inference
    from engine.preflight.model import resolve_model
    from engine.requests.inference import InferenceRequest
    from engine.testing.upstream_checkpoints import _encoded

    base, stored, _ = written("nvfp4")

    def mixed(state: dict) -> dict:
        layer = "transformer_blocks.0.attn.to_k"
        codes, scales, _ = _encoded(state[f"{layer}.weight"].float() * 0 + 0.01, "float8_e4m3fn", 0)
        kept = {k: v for k, v in state.items() if not k.startswith(layer + ".") or k == f"{layer}.bias"}
        return {**kept, f"{layer}.weight": codes, f"{layer}.comfy_quant": marker_tensor({"format": "float8_e4m3fn"}),
                **{f"{layer}.{suffix}": scale for suffix, scale in scales.items()}}

    file = _resaved(stored, tmp_path / "flux1-dev-mixed.safetensors", mixed)
    facts = resolve_model(engine_registry, file, base=base).facts(engine_registry)
    plan = plan_inference(engine_registry, facts, PRESETS["b200"], InferenceRequest(), env={})
    assert plan.value("transformer_quant") is None
    assert "stored mixed (float8_e4m3fn, nvfp4)" in plan["transformer_quant"].reason
    assert "several formats" in plan["transformer_quant"].reason
