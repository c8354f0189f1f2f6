"""Single-file checkpoints holding the whole pipeline, as SDXL ones are downloaded."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.errors import EngineError
from engine.hardware.probe import probe
from engine.contract.plugins import load_registry
from engine.policy.inference import InferenceRequest, plan_inference
from engine.preflight.model import resolve_model
from engine.runtime.session import GenerateRequest, InferenceSession
from families.sdxl.tiny import write_original_checkpoint

REGISTRY = load_registry()
HARDWARE = probe(verify=False)


def same_weights(session: InferenceSession, folder: Path) -> bool:
    """Every weight of the loaded pipeline's parts equals the diffusers folder's (in the dtype
    the plan loaded it in)."""
    from safetensors.torch import load_file

    for part in ("unet", "vae", "text_encoder", "text_encoder_2"):
        loaded = getattr(session.pipeline, part).state_dict()
        for file in (folder / part).glob("*.safetensors"):
            if any(not torch.equal(loaded[k], v.to(loaded[k].dtype)) for k, v in load_file(file).items()):
                return False
    return True


@pytest.mark.slow
def test_a_whole_pipeline_file_loads_without_a_base_and_is_sized_per_component(
    tiny_pipeline: Callable[[str], Path], tmp_path: Path
) -> None:
    tiny = tiny_pipeline("sdxl")
    # The download as people have it: one original-layout file, and the
    # component configs (no weights) beside it.
    folder = tmp_path / "sd_xl_tiny"
    shutil.copytree(tiny, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    file = write_original_checkpoint(tiny, folder / "sd_xl_tiny.safetensors")
    source = resolve_model(REGISTRY, file)
    assert source.kind == "single_file_pipeline" and source.base == str(folder)
    pipeline_sizes = resolve_model(REGISTRY, tiny).measured_sizes
    sizes = source.measured_sizes
    assert sizes is not None and pipeline_sizes is not None
    for part in ("transformer_gb", "text_encoders_gb", "vae_gb"):  # from the file's header, per part
        assert getattr(sizes, part) == pytest.approx(getattr(pipeline_sizes, part), rel=1e-6)
    components = plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, InferenceRequest()).to_dict()[
        "estimate"]["components"]  # type: ignore[index]
    assert components["text_encoders_gb"] == round(sizes.text_encoders_gb, 2)  # not all-UNet
    session = InferenceSession(REGISTRY, source, plan_inference(REGISTRY, source.facts(REGISTRY), HARDWARE, InferenceRequest()))
    session.load()
    try:
        [image] = session.generate(GenerateRequest("a harbour", steps=2, width=64, height=64))
        assert image.size == (64, 64) and same_weights(session, tiny)  # every weight came through the file
    finally:
        session.unload()


def test_an_sdxl_gguf_is_refused_up_front_with_the_reason(tmp_path: Path) -> None:
    import gguf

    file = tmp_path / "sdxl-unet-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(file), "sdxl")
    writer.add_tensor("add_embedding.linear_1.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EngineError, match="GGUF weights only for transformer models") as raised:
        resolve_model(REGISTRY, file)
    assert raised.value.code == "gguf_unsupported"
