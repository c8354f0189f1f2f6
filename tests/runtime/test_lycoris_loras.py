"""LoRA formats beyond plain LoRA: LoKr and LoHa (LyCORIS, read into peft's own adapter types)
and DoRA (diffusers' own) each change the image as the peft reference does; kohya-named LoKr
reads as peft-named; a file with one foreign key is refused naming it before anything is evicted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.contract.plugins import Registry

TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
ASKED = {"width": 64, "height": 64, "steps": 2, "seed": 5, "guidance": 1.0}  # no CFG: one pass a step


def _config(kind: str) -> object:
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if kind == "dora":
        return LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, use_dora=True, init_lora_weights=False)
    if kind == "lokr":
        return LoKrConfig(r=4, alpha=8, target_modules=TARGETS, init_weights=False)
    return LoHaConfig(r=4, alpha=8, target_modules=TARGETS, init_weights=False)


def _adapted(folder: Path, kind: str) -> tuple[object, dict]:
    """The tiny transformer with peft's adapter of ``kind`` injected (seeded), and its state dict."""
    import torch
    from diffusers import QwenImageTransformer2DModel
    from peft import get_peft_model_state_dict, inject_adapter_in_model

    model = QwenImageTransformer2DModel.from_pretrained(str(folder / "transformer"))
    torch.manual_seed(0)
    model = inject_adapter_in_model(_config(kind), model, adapter_name="default")
    with torch.no_grad():  # a strong adapter, so a tiny model's image moves
        for name, param in model.named_parameters():
            if any(tag in name for tag in ("lokr_", "hada_", "lora_")):
                param.mul_(8.0 if kind == "loha" else 3.0)  # LoHa's product of four factors starts smaller
    return model, get_peft_model_state_dict(model, adapter_name="default")


@pytest.fixture(scope="module")
def qwen(tiny_pipeline: Callable[[str], Path]) -> Path:
    return tiny_pipeline("qwen_image")


def _with_alpha(state: dict, kind: str) -> dict:
    """LyCORIS writes each module's alpha beside its factors (peft keeps it in its config)."""
    import torch

    if kind == "dora":
        return state
    modules = {key.rpartition(".")[0] for key in state}
    return {**state, **{f"{module}.alpha": torch.tensor(8.0) for module in modules}}


def _write(state: dict, file: Path, prefix: str = "transformer.") -> Path:
    from safetensors.torch import save_file

    file.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.detach().contiguous() for k, v in state.items()}, str(file))
    return file


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lokr", "loha", "dora"])
def test_each_format_changes_the_image_as_the_peft_reference_does(
    engine_registry: Registry, qwen: Path, tmp_path: Path, kind: str,
) -> None:
    import torch
    from diffusers import QwenImagePipeline

    from engine.service.facade import Engine

    model, state = _adapted(qwen, kind)
    file = _write(_with_alpha(state, kind), tmp_path / f"style_{kind}.safetensors")
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(qwen))
        base = np.asarray(engine.images.generate("a red fox", **ASKED)[0]).astype(int)
        ours = np.asarray(engine.images.generate("a red fox", loras=[f"{file}:1.0"], **ASKED)[0]).astype(int)
        zero = np.asarray(engine.images.generate("a red fox", loras=[f"{file}:0.0"], **ASKED)[0]).astype(int)
    from engine.testing.stock import planned_dtypes

    dtypes = planned_dtypes(qwen)  # the reference in the dtypes the engine computed in
    reference = QwenImagePipeline.from_pretrained(str(qwen), transformer=model.to(  # type: ignore[attr-defined]
        dtypes if isinstance(dtypes, torch.dtype) else dtypes["default"]), dtype=dtypes)
    theirs = np.asarray(reference("a red fox", num_inference_steps=2, height=64, width=64, true_cfg_scale=1.0,
                                  generator=torch.Generator("cpu").manual_seed(5)).images[0]).astype(int)
    assert np.abs(ours - base).max() > 8, f"{kind} did not move the image"
    assert np.abs(ours - theirs).max() <= 1, f"{kind}: {np.abs(ours - theirs).max()} levels from peft's"
    if kind != "dora":  # DoRA's magnitude rescales the weight at any scale: only its low-rank part scales
        assert np.abs(zero - base).max() <= 1


@pytest.mark.slow
def test_a_kohya_named_lokr_reads_as_the_peft_named_one(engine_registry: Registry, qwen: Path, tmp_path: Path) -> None:
    """LyCORIS' kohya layout: ``lora_unet_<module with underscores>.lokr_w1`` and an ``alpha``
    per module; the same image as the peft-named file's."""
    import torch

    from engine.service.facade import Engine

    _, state = _adapted(qwen, "lokr")
    named = _write(_with_alpha(state, "lokr"), tmp_path / "peft_lokr.safetensors")
    kohya_state = {}
    for key, value in state.items():
        module, _, param = key.rpartition(".")
        kohya_state["lora_unet_" + module.replace(".", "_") + "." + param] = value
        kohya_state["lora_unet_" + module.replace(".", "_") + ".alpha"] = torch.tensor(8.0)
    kohya = _write(kohya_state, tmp_path / "kohya_lokr.safetensors", prefix="")
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(qwen))
        images = [np.asarray(engine.images.generate("a red fox", loras=[f"{f}:1.0"], **ASKED)[0]) for f in (named, kohya)]
    assert np.array_equal(images[0], images[1])


def test_a_lokr_with_one_foreign_key_is_refused_naming_it_before_anything_is_evicted(
    engine_registry: Registry, qwen: Path, tmp_path: Path,
) -> None:
    import torch

    from engine.errors import EngineError
    from engine.service.facade import Engine

    _, state = _adapted(qwen, "lokr")
    file = _write({**_with_alpha(state, "lokr"), "not_a_block.proj.lokr_w1": torch.zeros(2, 2)},
                  tmp_path / "foreign_lokr.safetensors")
    with Engine(registry=engine_registry) as engine:
        engine.images.load(str(qwen))
        resident = engine.images.session
        with pytest.raises(EngineError) as refused:
            engine.images.load(str(qwen), loras=[f"{file}:1.0"], family=None)
        assert engine.images.session is resident
    assert refused.value.code == "lora_mismatch" and "not_a_block.proj" in refused.value.message, refused.value.message


@pytest.mark.slow
def test_a_lokr_asked_for_partially_skips_its_foreign_tensor_and_renders_the_clean_file(
    engine_registry: Registry, qwen: Path, tmp_path: Path,
) -> None:
    import torch

    from engine.service.facade import Engine

    _, state = _adapted(qwen, "lokr")
    clean = _write(_with_alpha(state, "lokr"), tmp_path / "clean_lokr.safetensors")
    foreign = _write({**_with_alpha(state, "lokr"), "not_a_block.proj.lokr_w1": torch.zeros(2, 2)},
                     tmp_path / "foreign_lokr.safetensors")
    with Engine(registry=engine_registry) as engine:
        status = engine.images.load(str(qwen), loras=[{"path": str(foreign), "partial": True}])
        counted = status["plan"]["lora_modules"]  # type: ignore[index]
        partial = np.asarray(engine.images.generate("a red fox", **ASKED)[0])
        engine.images.load(str(qwen), loras=[str(clean)])
        whole = np.asarray(engine.images.generate("a red fox", **ASKED)[0])
    assert counted["unmatched"] == 1 and counted["skipped"] == ["transformer.not_a_block.proj"] and counted["matched"] > 0
    assert np.array_equal(partial, whole)
